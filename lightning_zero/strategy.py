"""ZeroStrategy: the Lightning glue. Collective logic lives in ``comm/`` and ``grad_sync/``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
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
from lightning_zero.comm import CommLedger, Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import Engine
from lightning_zero.grad_sync import ZeroModule
from lightning_zero.guard import NonFiniteGuard
from lightning_zero.memory import MemoryReport
from lightning_zero.precision import install_sharded_clipping, remove_sharded_clipping, training_precision
from lightning_zero.runtime import ZeroRun, config_of, register_names
from lightning_zero.signals import StepBoundary
from lightning_zero.zero.deferred import is_deferred

log = logging.getLogger(__name__)


@contextmanager
def _kept_on_meta(module: nn.Module | None) -> Generator[None, None, None]:
    """Lightning's teardown moves the module to the CPU; a setup that failed while giving a
    meta-device model its values leaves tensors there that cannot move, and the move would hide
    the real error: skip it then."""
    if module is None or not is_deferred(module):
        yield
        return
    module.cpu = lambda *args, **kwargs: module  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.cpu


def _checkpoint_folders(trainer: pl.Trainer) -> list[str]:
    """The folders the run writes checkpoints in: the root folder and every checkpoint callback's."""
    folders = {str(trainer.default_root_dir)}
    folders |= {str(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
    return sorted(folders)


def _clear_stale_partials(trainer: pl.Trainer) -> None:
    """What interrupted saves left (``.NAME.partial``) in the run's checkpoint folders."""
    for folder in _checkpoint_folders(trainer):
        for stale in checkpoints.remove_stale_partials(folder):
            log.info(f"removed {stale}, left by a save that did not finish")


class ZeroStrategy(DDPStrategy):
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

    def __init__(
        self,
        stage: int = 0,
        *,
        config: ZeroConfig | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **options: Any,
    ) -> None:
        self._run = ZeroRun(config_of(stage, config, options))  # see [Note: one runtime, two glues]
        self._config = self._run.config
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._forward_redirection = _ForwardRedirection()
        self._user_precision_plugin: Precision | None = None  # restored after fitting (loss scaling)
        self._boundary: StepBoundary | None = None  # signals and data agreed per batch (signals.py)
        self._handed: dict[str, Any] | None = None  # the state dict the checkpoint hooks were given
        self._guard: NonFiniteGuard | None = (
            None  # nonfinite_grads skip/stop, agreed by every rank (guard.py)
        )

    @property
    def config(self) -> ZeroConfig:
        return self._config

    @property
    def ledger(self) -> CommLedger:
        """Every collective issued by this strategy, grouped by optimizer step."""
        return self._run.ledger

    @property
    def nonfinite_guard(self) -> NonFiniteGuard | None:
        """The non-finite guard while fitting with ``nonfinite_grads`` on (its ``skipped_steps``)."""
        return self._guard

    @property
    def engine(self) -> Engine | None:
        """The stage's mechanism (hooks, buckets, shards, units) while fitting."""
        return self._run.engine

    @property
    def _engine(self) -> Engine | None:
        return self._run.engine

    def gathered(self) -> Any:
        """Stage 3: every unit's full parameters inside this context; every rank must enter it
        together. Inside a training step with gradients enabled they stay gathered until the end of
        the next backward, so a term computed from them (a penalty) reaches them; otherwise they are
        freed on leaving. The other stages hold whole parameters: it changes nothing there."""
        return self._engine.gathered() if self._engine is not None else nullcontext()

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, Any]:
        """The LightningModule's state dict with full parameter values, in CPU memory (all ranks call
        it). Stage 3 gathers one flat space at a time; ``rank0_only``: only rank 0 gets it (the others
        ``{}``), so no rank ever holds the whole model beyond it. Works during and after ``fit``."""
        return self._run.full_state_dict(
            self.lightning_module, rank0_only=rank0_only, global_rank=self.global_rank
        )

    @property
    def _sharded_after_fit(self) -> bool:
        """The last fit left the module sharded (``gather_at_teardown``): its units gather on use."""
        return getattr(self._run.fitted, "sharded_after_fit", False)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` at stage 3: modules on the meta device, given values
        at setup one unit at a time (see [Note: deferred initialisation]); otherwise as for DDP."""
        if self._config.stage == 3 and empty_init:
            with self._run.deferred_init(self.root_device), self.precision_plugin.tensor_init_context():
                yield
            return
        with super().tensor_init_context(empty_init=empty_init):
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: at stage 3 modules are built on the meta device (see
        ``tensor_init_context``); the other stages build them as DDP does."""
        if self._config.stage != 3:
            yield
            return
        with self._run.deferred_init(self.root_device):
            yield

    @property
    def comm(self) -> Communicator:
        return self._run.comm

    @override
    def setup_environment(self) -> None:
        """Before the model exists: the CPU allocator setting (see ``allocator.py``), then DDP's."""
        self._run.prepare_process(self.root_device)
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        if not (fitting and self._config.stage == 3):  # stage 3 shards on the host, unit by unit
            self.model_to_device()
            if not self._sharded_after_fit:
                self._run.broadcast_states(self.model)
        self._run.watch_faults()
        if fitting:  # a read-only or missing folder is named now, not at the first save
            sharded = self._config.state_dict_type == "sharded"
            checkpoints.check_writable(_checkpoint_folders(trainer), self.comm, every_rank=sharded)
        self._boundary = StepBoundary(self.comm, f"zero{self._config.stage}")
        self._boundary.install(
            trainer, handle_signals=self._config.handle_signals, backwards=lambda: self._run.backwards
        )
        if self.is_global_zero:
            _clear_stale_partials(trainer)
        if fitting:
            cfg = self._config
            policy = self._run.new_engine(
                self.model, self.precision_plugin.precision, self.num_nodes, self.root_device
            )
            off = cfg.nonfinite_grads == "off"
            self._guard = None if off else NonFiniteGuard(self.comm, cfg.nonfinite_grads, self._engine.label)
            self._user_precision_plugin = self.precision_plugin
            self.precision_plugin = training_precision(
                self.precision_plugin, policy, self.comm, self._engine.label, self.root_device.type
            )
            if self._engine.needs_optimizers_first:  # shards follow the optimizer's param groups
                self.setup_optimizers(trainer)
                self.configure_ddp()
            else:
                self.configure_ddp()
                self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self._engine is not None and self._engine.sharded:
            install_sharded_clipping(self.precision_plugin, self._clip_grad_norm, self._before_step)

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
        if self._engine is None:
            yield None
            return
        with self._engine.no_sync():
            yield None

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Lightning's closure calls ``zero_grad`` between forward and backward: the gradients go back
        into their buckets before backward, so autograd accumulates there (no second copy)."""
        self._run.backwards += 1  # agreed before every batch ([Note: steps agreed] in signals.py)
        if self._engine is not None:
            self._engine.prepare_backward(closure_loss)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """The backward ended: one process makes its master gradients ([Note: one process])."""
        super().post_backward(closure_loss)  # DDP's static-graph step: nothing here (not a DDP module)
        if self._engine is not None:
            self._engine.finish_backward()

    def _optimizer_index(self, optimizer: Optimizer) -> int:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return next(i for i, opt in enumerate(self.optimizers) if opt is inner)

    def _before_step(self, optimizer: Optimizer) -> None:
        """The closure ran: what the user made of the gradients is what the optimizer steps."""
        if self._engine is not None:
            index = self._optimizer_index(optimizer)
            self._engine.before_step(self.optimizers[index], index)

    def _clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        assert self._engine is not None
        return self._engine.clip_grad_norm_(self.optimizers[self._optimizer_index(optimizer)], max_norm)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        guard = (
            self._guard if getattr(self.precision_plugin, "scaler", None) is None else None
        )  # fp16: the scaler's
        index = self._optimizer_index(optimizer) if self._engine is not None else None
        try:
            if guard is None:
                output = super().optimizer_step(optimizer, closure, model, **kwargs)
            else:
                step = self.lightning_module.trainer.global_step
                with guard.guarding(optimizer, step=step, device=self.root_device):
                    output = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            if index is not None:
                self._engine.step_ended(index)
        if index is not None:
            self._engine.after_step(self.optimizers[index], index)
        return output

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The checkpoint form of an optimizer's state (a collective in stages 1-3: all ranks call it).

        ``state_dict_type="full"``: the original parameters' state as one process has it, its
        per-element tensors as stand-ins written while they are gathered (see [Note: streamed full
        checkpoints]); ``"sharded"``: this rank's slices, by parameter name. Also after ``fit``
        returned (see [Note: after fitting] in engines.py).
        """
        engine = self._run.state_engine
        if engine is None and self._config.state_dict_type == "full":
            return super().optimizer_state(optimizer)
        index = self._optimizer_index(optimizer)
        sharded = self._config.state_dict_type == "sharded"
        return optimizer_state(self.lightning_module, engine, self.optimizers[index], index, sharded=sharded)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if self._engine is None and not any(isinstance(s, checkpoints.ShardedOptimizerState) for s in states):
            if len(states) != len(self.optimizers):
                raise checkpoints.CheckpointError(
                    f"the checkpoint holds {len(states)} optimizer states; this run has {len(self.optimizers)} optimizers"
                )
            super().load_optimizer_state_dict(checkpoint)
            return
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
        state = self._full_form_state(engine)  # in both forms: see [Note: hooks see tensors]
        self._handed = dict(state)  # the values handed out (hooks may replace them in the dict itself)
        return state

    def _full_form_state(self, engine: Engine | None) -> dict[str, Any]:
        if engine is None:
            return super().lightning_module_state_dict()
        return model_state(self.lightning_module, engine, sharded=False)

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
        if self._boundary is not None:
            with self._boundary.saving():  # a second signal lets the save complete (signals.py)
                self._save_checkpoint(checkpoint, filepath, storage_options)
        else:
            self._save_checkpoint(checkpoint, filepath, storage_options)

    def _save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None
    ) -> None:
        path, module = self._run.shared_path(filepath, self.root_device), self.lightning_module
        sharded = self._config.state_dict_type == "sharded"
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

    def memory_report(self) -> MemoryReport:
        """Model-state bytes held by this rank now: parameters, gradients, optimizer state."""
        assert self.lightning_module is not None
        return self._run.memory_report(self.lightning_module, self.optimizers)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        self._run.ledger.begin_step(trainer.global_step)
        if self._boundary is not None:
            self._boundary.begin(trainer)  # agreed at the batch's end (signals.py)

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Lightning's barriers go through the communicator: a peer's failure ends them too."""
        self._run.barrier(name)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Lightning's reduce (``self.log(sync_dist=True)``), tracked for the watchdog (watchdog.py)."""
        with self._run.foreign("reduce", tensor):
            return super().reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Lightning's all-gather, tracked and checked with its shapes (ZeroRun.foreign)."""
        with self._run.foreign("all_gather", tensor):
            return super().all_gather(tensor, group, sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's object broadcasts go through the communicator, as the barriers do."""
        return self._run.broadcast(obj, src, self.root_device)

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
        with _kept_on_meta(self.lightning_module):
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(cls, strategy_registry)
