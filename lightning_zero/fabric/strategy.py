"""ZeroFabricStrategy: ZeRO for Lightning Fabric: the Fabric glue over the engines the Trainer's glue uses.

How its model and optimizers are set up, together or apart: [Note: set up together or apart] in
``runtime.py``. Failures in a Fabric loop reach every rank through ``failures.py`` ([Note: failures in a Fabric
loop]); saves and loads map Fabric's state dicts through ``checkpoint.py``; what a run does is the
run's (``runtime.py``, [Note: one runtime, two glues]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH, Optimizable
from lightning.fabric.wrappers import _unwrap_objects
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import checkpoint as checkpoints
from lightning_zero.engines import Engine
from lightning_zero.fabric import checkpoint as fcheckpoint
from lightning_zero.fabric.failures import FailureHook, ReportingLauncher
from lightning_zero.glue import DDP_ARGS, RunGlue
from lightning_zero.grad_sync import ZeroModule


class ZeroFabricStrategy(RunGlue, DDPStrategy, _Sharded):
    """ZeRO data parallelism in Lightning Fabric: ``L.Fabric(strategy="zero3", ...)``.

    The same stages, options, engines and checkpoint formats as the Trainer's
    :class:`lightning_zero.ZeroStrategy`; Fabric's DDP launchers, cluster environments and ranks.

    Args:
        stage: ZeRO stage, 0 to 3.
        config: a whole :class:`~lightning_zero.config.ZeroConfig` instead of ``stage`` and
            ``**options``.
        start_method: how ``fabric.launch()`` starts the processes: ``"popen"`` (re-run the script),
            ``"spawn"``, ``"fork"`` or ``"forkserver"``; processes started by ``torchrun`` or SLURM
            are used as they are.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision,
            process_group_backend, timeout: as for Fabric's ``DDPStrategy``.
        **options: any other :class:`~lightning_zero.config.ZeroConfig` field (``bucket_cap_mb``,
            ``wrap_policy``, ``state_dict_type``, ...); an unknown name is a ``TypeError`` that lists
            the known ones.
    """

    _framework_args = (*DDP_ARGS, "precision")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the run, then Fabric's DDPStrategy (see RunGlue)
        self._backward_sync_control = _ZeroBackwardSyncControl(self)
        self._module: nn.Module | None = None  # the user's model (the one this strategy sets up)
        self._wrapped: ZeroModule | None = None  # the engine's wrapper, once wrapped
        self._closed = False  # training began: the optimizers set up so far are all the model has
        self._optimizers: list[Optimizer] = []  # set up with the model, in order (engine indices)
        self._hook: FailureHook | None = None  # sys.excepthook while the strategy is active

    def _user_model(self) -> nn.Module:
        self._ready()
        assert self._module is not None
        return self._module

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers set up with the model, in the order of their checkpoint entries."""
        return list(self._optimizers)

    # -- the processes ---------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method != "popen":  # see [Note: failures in a Fabric loop]
            self._launcher = ReportingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        """As the Trainer's, then the fault board, the watchdog and the exception hook (see [Note:
        failures in a Fabric loop])."""
        super().setup_environment()
        if self._run.watch_faults() and self._hook is None:
            self._hook = FailureHook.install(self)

    # -- setting up ------------------------------------------------------------------------------

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """Wrap ``module`` with its ``optimizers`` (stages 1-3 shard them in place: the same objects)."""
        self._begin(module)
        self._optimizers = list(optimizers)
        self._wrap()
        return self._wrapped, optimizers, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Wrap ``module`` now; its optimizers may follow (see [Note: set up together or apart])."""
        self._begin(module)
        self._wrap()
        return self._wrapped

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Lay ``optimizer`` onto the model's flat spaces (see [Note: set up together or apart])."""
        self._run.add_optimizer(self._module, optimizer, self._optimizers, closed=self._closed)
        self._optimizers.append(optimizer)
        _optimizers_to_device([optimizer], self.root_device)
        return optimizer

    def _begin(self, module: nn.Module) -> None:
        """The engine for ``module`` and the precision plugin to train with (nothing wrapped yet)."""
        if self._module is not None:
            raise RuntimeError(
                f"ZeroFabricStrategy sets up one model per Fabric; {type(self._module).__name__} is set up already. "
                "Put the models into one nn.Module, or give each its own Fabric"
            )
        self.precision = self._new_engine(module, self.precision)
        self._module = module

    def _wrap(self) -> None:
        """Rank 0's parameters everywhere, then the engine's wrapper with the optimizers it shards."""
        module = self._module
        assert module is not None
        if self.config.stage != 3:  # stage 3 takes rank 0's values unit by unit (or builds them)
            self._run.broadcast_states(module)
        self._wrapped = self._run.wrap(module, self._optimizers, self.root_device)
        self._wrapped.register_forward_pre_hook(self._before_forward, prepend=True)
        _optimizers_to_device(self._optimizers, self.root_device)

    def _before_forward(self, module: nn.Module, *_: Any) -> None:
        """Training began; before a training forward the ranks' steps and backward passes are
        agreed (see [Note: steps agreed] in signals.py: Fabric has no per-batch agreement)."""
        self._closed = True  # training began: the optimizers set up so far are all the model has
        if torch.is_grad_enabled() and module.training:
            self._run.forwards += 1
            self._run.agree_counts(f"before training forward {self._run.forwards}", self.root_device)

    def _ready(self) -> Engine:
        """The engine of the model set up."""
        if self._run.engine is None:
            raise RuntimeError(
                "ZeroFabricStrategy has no model yet: set it up first with fabric.setup(model, optimizer)"
            )
        return self._run.engine

    def wrapped_module(self) -> ZeroModule:
        """The engine's wrapper around the model."""
        self._ready()
        assert self._wrapped is not None
        return self._wrapped

    def _owns(self, module: Any) -> bool:
        """Whether ``module`` is the model set up here: what ``fabric.setup`` returned, the strategy's
        wrapper inside it, or the user's own model."""
        module = _unwrap_objects(module)
        return module is not None and any(module is m for m in (self._wrapped, self._module))

    def _index(self, optimizer: Any, key: str | None = None) -> int:
        for i, opt in enumerate(self._optimizers):
            if opt is optimizer:
                return i
        where = f" (under {key!r})" if key is not None else ""
        raise ValueError(
            f"the {type(optimizer).__name__}{where} was not set up by this strategy: set it up with "
            "fabric.setup(model, optimizer) or fabric.setup_optimizers(optimizer)"
        )

    # -- training --------------------------------------------------------------------------------

    def no_sync(self) -> AbstractContextManager:
        """No collective inside where the stage honours it (see ZeroConfig.accumulate_unsharded)."""
        engine = self._ready()
        self._closed = True  # as a training forward does
        return engine.no_sync()

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The step (through the precision plugin: fp16 loss scaling), then the engine's after-step:
        masters into the parameters, stages 1-2 all-gather them."""
        engine = self._ready()
        index = self._index(optimizer)
        engine.before_step(self._optimizers[index], index)
        with self._stepping(index):
            output = super().optimizer_step(optimizer, **kwargs)
        self._run.steps += 1
        if index == 0:
            self.ledger.begin_step(self.ledger.step + 1)
        return output

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self._backward_begins(tensor)
        super().backward(tensor, module, *args, **kwargs)
        self._backward_ended()

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Stages 1-3: the 2-norm of the whole gradient, sqrt(AllReduce(sum of the shards' squares)),
        every shard scaled by the same factor; stage 0 clips its whole gradients as Fabric does. Under
        fp16 loss scaling a non-finite norm is no error: the scaler skips that step on every rank."""
        engine = self._ready()
        if getattr(self.precision, "scaler", None) is not None:
            error_if_nonfinite = False
        if not engine.sharded:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        if float(norm_type) != 2.0:
            raise ValueError(
                f"norm_type={norm_type!r}: stage {self.config.stage} clips by the 2-norm over the shards only; "
                "use norm_type=2, or stage 0"
            )
        self.precision.unscale_gradients(optimizer)
        # a non-finite norm raises before any gradient is scaled, as torch's clip_grad_norm_ does
        return engine.clip_grad_norm_(optimizer, float(max_norm), error_if_nonfinite=error_if_nonfinite)

    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor:
        """Fabric's all-reduce, tracked and checked with its shapes (ZeroRun.foreign)."""
        with self._run.foreign("reduce", tensor):
            return super().all_reduce(tensor, group, reduce_op)

    def module_to_device(self, module: nn.Module) -> None:
        """Stage 3 places only shards on the device, unit by unit, when the model is set up (a model
        built on the meta device cannot move before it has values); the other stages move it whole."""
        if self.config.stage != 3:
            super().module_to_device(module)

    # -- creating the model ----------------------------------------------------------------------

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module()``: the model created on this rank's device, in the precision's dtype;
        ``empty_init=True`` skips the initialisers (for a model a checkpoint will fill)."""
        stack = ExitStack()
        stack.enter_context(self.root_device)
        # stage 3 with empty_init: on the meta device; otherwise full size, initialised unless empty_init
        stack.enter_context(self._meta_init(empty_init) or _EmptyInit(enabled=bool(empty_init)))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return self._meta_init() or nullcontext()

    # -- checkpoints -----------------------------------------------------------------------------

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The whole model under its original names, as Lightning's FSDP gives it: at stages 1-3 in
        rank 0's CPU memory (the others get ``{}``), gathered one flat space at a time, so that no
        rank holds more than one unit or bucket beyond its shards (every rank calls it)."""
        if not self._owns(module):
            return super().get_module_state_dict(module)
        assert self._module is not None
        engine = self._ready()
        if engine.sharded:
            return engine.full_state_dict(self._module, rank0_only=True)
        return engine.module_state_dict(self._module)

    @override
    def load_module_state_dict(
        self, module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True
    ) -> None:
        """A whole-model state dict into the model as set up (each rank takes its part)."""
        if not self._owns(module):
            return super().load_module_state_dict(module, dict(state_dict), strict)
        self._ready()
        self._run.load_model(self._module, state_dict, strict=strict)
        return None

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state as one process has it, for the original parameters; at stages 1-3
        gathered to rank 0 only (the others get ``{}``): a collective, every rank calls it."""
        engine = self._ready()
        index = self._index(optimizer)
        if engine.sharded:
            return checkpoints.gather_optimizer_state(engine, optimizer, index, self.comm)
        return engine.optimizer_state(optimizer, index)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save``: the Trainer's checkpoint format (see [Note: Fabric state keys]); a full file
        written by rank 0 or a sharded directory written by every rank, complete or absent. All ranks call it."""
        fcheckpoint.save(self, path, state, storage_options, filter or {})

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``fabric.load``: a checkpoint written by this strategy or by the Trainer's, either form, any
        stage and world size, or a full file of Fabric's DDP, into the objects of ``state`` (see [Note:
        Fabric state keys]); the entries not asked for are returned. All ranks call it."""
        if isinstance(state, (nn.Module, Optimizer)):
            fcheckpoint.load_raw(self, path, state, strict, weights_only)
            return {}
        return fcheckpoint.load(self, path, state, strict, weights_only)

    # -- the end ---------------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        """End training: the watchdog stopped, the exception hook restored, hooks removed, the model
        whole again in its own parameters (stage 3 gathers it: every rank calls it; not after a failure)."""
        if self._hook is not None:
            self._hook.uninstall()
            self._hook = None
        if self._wrapped is None:
            self._run.engine = None  # set up but never wrapped: nothing to tear down
        self._run.end(keep_state=False)
        super().teardown()


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: the engine's no_sync on the model set up here."""

    def __init__(self, strategy: ZeroFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not self._strategy._owns(module):
            raise TypeError(
                "no_backward_sync needs the model that ZeroFabricStrategy set up (the object fabric.setup returned), "
                f"got a {type(module).__name__}"
            )
        return self._strategy.no_sync()
