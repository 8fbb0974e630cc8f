"""ZeroStrategy: the Lightning glue. Collective logic lives in ``comm/`` and ``grad_sync/``."""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import checkpoint as checkpoints
from lightning_zero.checkpoint.hooks import to_sharded_state
from lightning_zero.checkpoint.states import model_state, optimizer_state
from lightning_zero.glue import DDP_ARGS, RunGlue
from lightning_zero.grad_sync import ZeroModule
from lightning_zero.guard import NonFiniteGuard
from lightning_zero.precision import install_sharded_clipping, remove_sharded_clipping
from lightning_zero.signals import StepBoundary
from lightning_zero.zero.deferred import kept_on_meta


def _checkpoint_folders(trainer: pl.Trainer) -> list[str]:
    """The folders the run writes checkpoints in: the root folder and every checkpoint callback's."""
    folders = {str(trainer.default_root_dir)}
    folders |= {str(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
    return sorted(folders)


class ZeroStrategy(RunGlue, DDPStrategy):
    """Data parallelism with ZeRO sharding, gradient synchronisation done by this package.

    Keeps Lightning's DDP launchers, cluster environments, ranks and samplers; replaces torch's
    DistributedDataParallel with :class:`~lightning_zero.grad_sync.ZeroModule`.

    Args:
        stage: ZeRO stage, 0 to 3.
        config: a whole :class:`~lightning_zero.config.ZeroConfig` instead of ``stage`` and
            ``**options``.
        start_method: how Lightning launches the processes: ``"popen"`` (re-run the script),
            ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout: as for Lightning's ``DDPStrategy``.
        **options: any other :class:`~lightning_zero.config.ZeroConfig` field (``bucket_cap_mb``,
            ``wrap_policy``, ...); an unknown name is a ``TypeError`` that lists the known ones.
    """

    _framework_args = (*DDP_ARGS, "precision_plugin")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the run, then Lightning's DDPStrategy (see RunGlue)
        self._forward_redirection = _ForwardRedirection()
        self._user_precision_plugin: Precision | None = None  # restored after fitting (loss scaling)
        self._boundary: StepBoundary | None = None  # signals and data agreed per batch (signals.py)
        self._handed: dict[str, Any] | None = None  # the state dict the checkpoint hooks were given
        self._guard: NonFiniteGuard | None = None  # nonfinite_grads skip/stop, agreed by all (guard.py)

    @property
    def nonfinite_guard(self) -> NonFiniteGuard | None:
        """The non-finite guard while fitting with ``nonfinite_grads`` on (its ``skipped_steps``)."""
        return self._guard

    def _user_model(self) -> nn.Module:
        assert self.lightning_module is not None
        return self.lightning_module

    @property
    def _sharded_after_fit(self) -> bool:
        """The last fit left the module sharded (``gather_at_teardown``): its units gather on use."""
        return getattr(self._run.fitted, "sharded_after_fit", False)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` at stage 3: modules on the meta device, given values
        at setup one unit at a time (see [Note: deferred initialisation]); otherwise as for DDP."""
        meta = self._meta_init(empty_init)
        with meta or super().tensor_init_context(empty_init=empty_init):
            with self.precision_plugin.tensor_init_context() if meta else nullcontext():
                yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: as ``tensor_init_context(empty_init=True)`` at stage 3."""
        with self._meta_init() or nullcontext():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        if not (fitting and self.config.stage == 3):  # stage 3 shards on the host, unit by unit
            self.model_to_device()
            if not self._sharded_after_fit:
                self._run.broadcast_states(self.model)
        self._run.watch_faults()
        self._run.prepare_folders(_checkpoint_folders(trainer), fitting=fitting)
        self._boundary = StepBoundary(self.comm, f"zero{self.config.stage}")
        self._boundary.install(
            trainer, handle_signals=self.config.handle_signals, backwards=lambda: self._run.backwards
        )
        if fitting:
            self._start_fitting(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self.engine is not None and self.engine.sharded:
            install_sharded_clipping(self.precision_plugin, self._clip_grad_norm, self._before_step)

    def _start_fitting(self, trainer: pl.Trainer) -> None:
        """The engine, the non-finite guard and the training precision, then the model wrapped with
        its optimizers (stages 1-3 lay the shards out along the optimizers' param groups first)."""
        cfg = self.config
        self._user_precision_plugin = self.precision_plugin
        self.precision_plugin = self._new_engine(self.model, self.precision_plugin)
        off = cfg.nonfinite_grads == "off"
        self._guard = None if off else NonFiniteGuard(self.comm, cfg.nonfinite_grads, self.engine.label)
        if self.engine.needs_optimizers_first:
            self.setup_optimizers(trainer)
            self.configure_ddp()
        else:
            self.configure_ddp()
            self.setup_optimizers(trainer)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell every rank why this one fails, through the store (see ``faults.py``)."""
        super().on_exception(exception)
        trainer = getattr(self.lightning_module, "_trainer", None)
        self._run.report_failure(exception, step=trainer.global_step if trainer is not None else None)

    @override
    def configure_ddp(self) -> None:
        assert isinstance(self.model, pl.LightningModule)
        self.model = self._setup_model(self.model)

    @override
    def _setup_model(self, model: nn.Module) -> ZeroModule:
        return self._run.wrap(model, self.optimizers, self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's accumulation window (and ``toggle_model(sync_grad=False)``): no collective runs."""
        with self.engine.no_sync() if self.engine is not None else nullcontext():
            yield None

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Lightning's closure calls ``zero_grad`` between forward and backward: the gradients go back
        into their buckets before backward, so autograd accumulates there (no second copy)."""
        self._backward_begins(closure_loss)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)  # DDP's static-graph step: nothing here (not a DDP module)
        self._backward_ended()

    def _optimizer_index(self, optimizer: Optimizer) -> int:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return next(i for i, opt in enumerate(self.optimizers) if opt is inner)

    def _before_step(self, optimizer: Optimizer) -> None:
        """The closure ran: what the user made of the gradients is what the optimizer steps."""
        if self.engine is not None:
            index = self._optimizer_index(optimizer)
            self.engine.before_step(self.optimizers[index], index)

    def _clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        assert self.engine is not None
        return self.engine.clip_grad_norm_(self.optimizers[self._optimizer_index(optimizer)], max_norm)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        fp16 = getattr(self.precision_plugin, "scaler", None) is not None  # then the scaler skips steps
        guard, step = None if fp16 else self._guard, super().optimizer_step
        with self._stepping(self._optimizer_index(optimizer) if self.engine is not None else None):
            if guard is None:
                return step(optimizer, closure, model, **kwargs)
            trainer_step = self.lightning_module.trainer.global_step
            with guard.guarding(optimizer, step=trainer_step, device=self.root_device):
                return step(optimizer, closure, model, **kwargs)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The checkpoint form of an optimizer's state (a collective in stages 1-3: all ranks call it).

        ``state_dict_type="full"``: the original parameters' state as one process has it, its
        per-element tensors as stand-ins written while they are gathered (see [Note: streamed full
        checkpoints]); ``"sharded"``: this rank's slices, by parameter name. Also after ``fit``
        returned (see [Note: after fitting] in engines.py).
        """
        engine = self._run.state_engine
        if engine is None and self.config.state_dict_type == "full":
            return super().optimizer_state(optimizer)
        index = self._optimizer_index(optimizer)
        sharded = self.config.state_dict_type == "sharded"
        return optimizer_state(self.lightning_module, engine, self.optimizers[index], index, sharded=sharded)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Every optimizer's saved state, each rank its part (stages 1-3: its shards)."""
        states = checkpoint["optimizer_states"]
        self._run.load_optimizers(self.lightning_module, self.optimizers, states, self.root_device)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The checkpoint's model state under the original names, as tensors in both forms:
        parameters that live in shards (stage 3; the fp32 masters of stages 1-2) as Streamed tensors
        that ``save_checkpoint`` writes while it gathers them and that gather when a hook computes
        with them (see [Note: streamed full checkpoints]). A sharded save then writes this rank's
        slices of what the hooks left ([Note: hooks see tensors] in ``checkpoint/hooks.py``)."""
        assert self.lightning_module is not None
        engine = self._run.state_engine
        if engine is None:
            state = super().lightning_module_state_dict()
        else:  # in both forms: see [Note: hooks see tensors]
            state = model_state(self.lightning_module, engine, sharded=False)
        self._handed = dict(state)  # the values handed out (hooks may replace them in the dict itself)
        return state

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the module as set up (shards, units): each rank takes its part."""
        return True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Rank 0 writes one file (``"full"``), or every rank its shards into a directory (``"sharded"``);
        under the final name only once complete. All ranks call it."""
        # a second signal lets the save complete (signals.py)
        with self._boundary.saving() if self._boundary is not None else nullcontext():
            self._save_checkpoint(checkpoint, filepath, storage_options)

    def _save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None
    ) -> None:
        path, module = self._run.shared_path(filepath, self.root_device), self.lightning_module
        sharded = self.config.state_dict_type == "sharded"
        if sharded and "state_dict" in checkpoint and self._handed is not None:
            to_sharded_state(checkpoint, self._handed, module, self._run.state_engine)
            self._handed = None
        self._run.save(checkpoint, path, module, self.checkpoint_io, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """A full file, or a sharded directory's entries with stand-ins that each rank reads later;
        checked against its checksums, the previous intact one if it is damaged (docs/checkpoints.md)."""
        path = self._run.shared_path(checkpoint_path, self.root_device)
        checkpoint = self._run.read(path, self.checkpoint_io, weights_only, fall_back=True)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if checkpoint.fell_back and trainer is not None:  # Lightning's "Restored all states" names it
            trainer._checkpoint_connector._ckpt_path = checkpoint.loaded_from
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        self._run.load_model(self.lightning_module, checkpoint["state_dict"], strict=strict)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            checkpoints.remove(filepath, self.checkpoint_io)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        self._run.ledger.begin_step(trainer.global_step)
        if self._boundary is not None:
            self._boundary.begin(trainer)  # agreed at the batch's end (signals.py)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Lightning's reduce (``self.log(sync_dist=True)``), tracked for the watchdog (watchdog.py)."""
        with self._run.foreign("reduce", tensor):
            return super().reduce(tensor, group, reduce_op)

    @override
    def teardown(self) -> None:
        if self._boundary is not None:
            self._boundary.uninstall()
            self._boundary = None
        engine = self._run.end(keep_state=True)  # no collective after a failure
        if engine is not None:
            if engine.sharded:
                remove_sharded_clipping(self.precision_plugin)
            if self._user_precision_plugin is not None:
                self.precision_plugin = self._user_precision_plugin
        if isinstance(self.model, ZeroModule):
            self.model = self.lightning_module
        with kept_on_meta(self.lightning_module):
            super().teardown()
