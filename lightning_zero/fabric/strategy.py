"""ZeroFabricStrategy: ZeRO for Lightning Fabric: the Fabric glue over the engines the Trainer's glue uses.

[Note: set up together or apart]
``fabric.setup(model, optimizer, ...)`` gives the model and its optimizers at once and the engine
wraps them together. ``fabric.setup(model)`` (or ``setup_module``) gives the model alone, as litgpt and
Lightning's FSDP examples do: the model is wrapped at once (stage 3: built on the meta device, it is
given its values and sharded unit by unit here), so ``model.parameters()`` afterwards are the model's
own parameters as set up (stage 3: sharded placeholders, which no computation may read). An optimizer
made from them and passed to ``setup_optimizers`` is then laid onto the engine's flat spaces in place
(:func:`_lay_onto`): stages 1-3 give each param group the sub-shards of its parameters, stage 0 under a
mixed-precision policy its fp32 masters; stage 0 in the model's own dtype keeps it as it is. Loading
weights (``fabric.load_raw``, ``fabric.load``) may come before or after. The set of optimizers closes
when training begins (the model's first forward, or ``no_backward_sync``): gradients and optimizer
steps are laid out for the optimizers known then, so one set up later is an error that says so.
Every rank must take the same steps in the same order (the wrap broadcasts rank 0's parameters).

[Note: failures in a Fabric loop]
The Trainer tells the strategy that fit raised (``on_exception``); Fabric has no such hook, so the
strategy finds the exception itself, in the two places a user's error surfaces: ``sys.excepthook``
(a script launched by Fabric's default launcher, which re-runs it per rank, or by torchrun or srun;
installed once the process group exists, chained to the previous hook and restored at teardown),
and its own multiprocessing launcher (``start_method`` spawn, fork or forkserver: the user's function
runs in :meth:`_ReportingLauncher._wrapping_function`, inside torch's wrapper, which would otherwise
send the error to the parent process and exit). Either way the failing rank publishes its failure
as the Trainer's does (``lightning_zero.faults.on_fit_exception``; the step is the ledger's, the
number of optimizer steps taken), so that its peers raise ``PeerFailure`` with its message, then
waits for them (:func:`_wait_until_read`), and leaves without destroying the process group. It leaves
last because every launcher ends the other ranks once one exits with an error (torch's spawn at
once, Fabric's re-run launcher within 5 s, torchrun): its peers must have had their say first.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import _PATH, Optimizable, _Stateful
from lightning.fabric.wrappers import _unwrap_objects
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import checkpoint as checkpoints
from lightning_zero import faults
from lightning_zero.allocator import tune_cpu_allocator
from lightning_zero.checkpoint.full import UserKeyedCheckpoint, as_trainer_layout
from lightning_zero.checkpoint.states import model_state, optimizer_state
from lightning_zero.comm import CommLedger, Communicator
from lightning_zero.comm.faults import StoreUnreachable, process_exists
from lightning_zero.comm.mesh import sharding_comm
from lightning_zero.comm.waiting import POLL_S
from lightning_zero.comm.watchdog import Watchdog
from lightning_zero.config import SUPPORTED_STAGES, ZeroConfig
from lightning_zero.engines import Engine, FullyShardedEngine, ShardedOptimizerEngine, make_engine
from lightning_zero.fabric import state as fstate
from lightning_zero.grad_sync import ZeroModule, broadcast_module_states
from lightning_zero.imports import resolve_optimizer_classes
from lightning_zero.memory import MemoryReport, measure
from lightning_zero.precision import resolve_policy, training_precision
from lightning_zero.zero.optimizer import check_shardable


class ZeroFabricStrategy(DDPStrategy, _Sharded):
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

    def __init__(
        self,
        stage: int = 0,
        *,
        config: ZeroConfig | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **options: Any,
    ) -> None:
        if config is not None and (options or stage != 0):
            raise TypeError("give either config=ZeroConfig(...) or stage and options, not both")
        self._config = config if config is not None else ZeroConfig.from_kwargs(stage=stage, **options)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._backward_sync_control = _ZeroBackwardSyncControl(self)
        self._ledger = CommLedger()  # every collective of this strategy, per optimizer step
        self._comm: Communicator | None = None  # built once the process group exists
        self._engine: Engine | None = None  # the stage's mechanism, built with the model's setup
        self._module: nn.Module | None = None  # the user's model (the one this strategy sets up)
        self._wrapped: ZeroModule | None = None  # the engine's wrapper, once wrapped
        self._closed = False  # training began: the optimizers set up so far are all the model has
        self._optimizers: list[Optimizer] = []  # set up with the model, in order (engine indices)
        self._init_rng: Tensor | None = None  # stage 3: the random state a meta-device model was built under
        self._watchdog: Watchdog | None = None  # heartbeat; reports stuck collectives (config.watchdog_s)
        self._hook: _FailureHook | None = None  # sys.excepthook while the strategy is active
        self._failed = False  # user code raised on this rank: teardown runs no collective

    @property
    def config(self) -> ZeroConfig:
        return self._config

    @property
    def ledger(self) -> CommLedger:
        """Every collective issued by this strategy; its step is the number of optimizer steps taken
        (of the first optimizer set up)."""
        return self._ledger

    @property
    def engine(self) -> Engine | None:
        """The stage's mechanism (hooks, buckets, shards, units), once a model is set up."""
        return self._engine

    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            self._comm = Communicator(ledger=self._ledger)
        return self._comm

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers set up with the model, in the order of their checkpoint entries."""
        return list(self._optimizers)

    # -- the processes ---------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method != "popen":  # see [Note: failures in a Fabric loop]
            self._launcher = _ReportingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        """The CPU allocator setting (before the model exists, see ``allocator.py``), the process
        group (every rank, at ``fabric.launch()``), then the fault board, the watchdog and the
        exception hook (see [Note: failures in a Fabric loop])."""
        tune_cpu_allocator(self._config.cpu_allocator, device_type=self.root_device.type)
        super().setup_environment()
        self._watch_faults()

    def _watch_faults(self) -> None:
        """Every rank's host known, the fault board open, the watchdog on (docs/failures.md)."""
        self.comm.watch_faults(fault_wait_s=self._config.fault_wait_s)
        if not self.comm.active:
            return
        if self._watchdog is None:
            self._watchdog = Watchdog(self.comm, self._config.watchdog_s)
            self._watchdog.start()
        if self._hook is None:
            self._hook = _FailureHook.install(self)

    def _report_failure(self, exception: BaseException) -> bool:
        """User code raised ``exception`` on this rank: tell every rank why (once), as the Trainer's
        ``on_exception`` does; no collective runs after it. True when this rank published its own
        failure (not a peer's it noticed)."""
        if self._failed or self._comm is None or self._comm.board is None:
            return False
        self._failed = faults.on_fit_exception(self._comm, exception, step=self._ledger.step)
        return self._comm.published

    def _leave_last(self) -> None:
        """After publishing its failure this rank waits for its peers (see [Note: failures in a
        Fabric loop]); its heartbeat stops first: the peers need it no more, and the store may go
        with rank 0 meanwhile."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        _wait_until_read(self.comm)

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
        if self._engine is None:
            raise RuntimeError(
                "ZeroFabricStrategy: set up the model before its optimizers (model = fabric.setup(model), "
                "then optimizer = fabric.setup_optimizers(optimizer)), or both at once: "
                "model, optimizer = fabric.setup(model, optimizer)"
            )
        if self._closed and self._engine.needs_optimizers_first:
            raise RuntimeError(
                f"ZeroFabricStrategy(stage={self._config.stage}) already laid out the model's shards and trained with "
                f"the {len(self._optimizers)} optimizer(s) set up before training began (the model's first "
                "forward, or no_backward_sync); it cannot shard another one. Set up every optimizer before "
                "that: fabric.setup_optimizers(opt1, opt2) right after fabric.setup(model), or "
                "fabric.setup(model, opt1, opt2)"
            )
        if any(opt is optimizer for opt in self._optimizers):
            raise ValueError(f"this {type(optimizer).__name__} is set up already")
        assert self._module is not None
        _lay_onto(self._engine, self._module, optimizer, len(self._optimizers))
        self._optimizers.append(optimizer)
        _optimizers_to_device([optimizer], self.root_device)
        return optimizer

    def _begin(self, module: nn.Module) -> Engine:
        """The engine for ``module`` and the precision plugin to train with (nothing wrapped yet)."""
        if self._module is not None:
            raise RuntimeError(
                f"ZeroFabricStrategy sets up one model per Fabric; {type(self._module).__name__} is set up already. "
                "Put the models into one nn.Module, or give each its own Fabric"
            )
        cfg = self._config
        policy = resolve_policy(cfg.param_dtype, cfg.reduce_dtype, self.precision.precision)
        group = sharding_comm(
            self.comm,
            cfg.shard_size,
            cfg.stage,
            self.num_nodes,
            module=module,
            device=self.root_device,
            report=rank_zero_info,
        )
        engine = make_engine(cfg, group, policy)
        self.precision = training_precision(
            self.precision, policy, self.comm, engine.label, self.root_device.type
        )
        self._engine, self._module = engine, module
        return engine

    def _wrap(self) -> None:
        """Rank 0's parameters everywhere, then the engine's wrapper with the optimizers it shards."""
        engine, module = self._engine, self._module
        assert engine is not None and module is not None
        if self._config.stage != 3:  # stage 3 takes rank 0's values unit by unit (or builds them)
            broadcast_module_states(module, self.comm, label=engine.label)
        if engine.sharded and self.comm.world_size == 1:
            rank_zero_warn(
                f"stage {self._config.stage} on one process shards nothing: it trains as plain training"
            )
        optimizers = self._optimizers if engine.needs_optimizers_first else []
        self._wrapped = engine.setup(module, optimizers, device=self.root_device, rng_state=self._init_rng)
        self._wrapped.register_forward_pre_hook(self._close, prepend=True)
        _optimizers_to_device(self._optimizers, self.root_device)

    def _close(self, *_: Any) -> None:
        """Training began (a forward, ``no_backward_sync``): the optimizers set up so far are all the
        model trains with."""
        self._closed = True

    def _ready(self) -> Engine:
        """The engine of the model set up."""
        if self._engine is None:
            raise RuntimeError(
                "ZeroFabricStrategy has no model yet: set it up first with fabric.setup(model, optimizer)"
            )
        return self._engine

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
        self._close()
        return engine.no_sync()

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The step (through the precision plugin: fp16 loss scaling), then the engine's after-step:
        masters into the parameters, stages 1-2 all-gather them."""
        engine = self._ready()
        index = self._index(optimizer)
        engine.before_step(self._optimizers[index], index)
        output = super().optimizer_step(optimizer, **kwargs)
        engine.after_step(self._optimizers[index], index)
        if index == 0:
            self._ledger.begin_step(self._ledger.step + 1)
        return output

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """A backward that raised before is noticed first (see [Note: a backward that raised])."""
        if self._engine is not None:
            self._engine.prepare_backward(tensor)
        super().backward(tensor, module, *args, **kwargs)

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
                f"norm_type={norm_type!r}: stage {self._config.stage} clips by the 2-norm over the shards only; "
                "use norm_type=2, or stage 0"
            )
        self.precision.unscale_gradients(optimizer)
        # a non-finite norm raises before any gradient is scaled, as torch's clip_grad_norm_ does
        return engine.clip_grad_norm_(optimizer, float(max_norm), error_if_nonfinite=error_if_nonfinite)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Stage 3 places only shards on the device, unit by unit, when the model is set up (a model
        built on the meta device cannot move before it has values); the other stages move it whole."""
        if self._config.stage != 3:
            super().module_to_device(module)

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, Any]:
        """The model's state dict with full parameter values, in CPU memory (every rank calls it);
        stage 3 gathers one flat space at a time; ``rank0_only``: only rank 0 gets it (the others ``{}``)."""
        engine = self._ready()
        return engine.full_state_dict(self._module, rank0_only=rank0_only)

    def gathered(self) -> AbstractContextManager:
        """Stage 3: every unit's full parameters inside; every rank must enter it together (see the
        Trainer strategy's ``gathered``). The other stages hold whole parameters: nothing changes."""
        return self._ready().gathered() if self._engine is not None else nullcontext()

    def memory_report(self) -> MemoryReport:
        """Model-state bytes held by this rank now: parameters, gradients, optimizer state."""
        engine = self._ready()
        assert self._module is not None
        grads, extra = engine.grad_tensors(), engine.param_tensors()
        return measure(self._module, grads, self._optimizers, extra_params=extra)

    # -- creating the model ----------------------------------------------------------------------

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module()``: the model created on this rank's device, in the precision's dtype;
        ``empty_init=True`` skips the initialisers (for a model a checkpoint will fill)."""
        stack = ExitStack()
        stack.enter_context(self.root_device)
        stack.enter_context(self._init_context(empty_init))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        """At stage 3 modules created inside are built on the meta device and given their values
        unit by unit when the model is set up (see [Note: deferred initialisation]); the other
        stages create them as DDP does."""
        return self._deferred_init() if self._config.stage == 3 else nullcontext()

    def _init_context(self, empty_init: bool | None) -> AbstractContextManager:
        """Where parameters come to life: at stage 3 with ``empty_init=True`` on the meta device,
        given values unit by unit at setup; otherwise on the device, full size, initialised unless
        ``empty_init``."""
        if self._config.stage == 3 and empty_init:
            return self._deferred_init()
        return _EmptyInit(enabled=bool(empty_init))

    @contextmanager
    def _deferred_init(self) -> Generator[None, None, None]:
        self._init_rng = torch.get_rng_state()
        with torch.device("meta"):
            yield

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
        checkpoints.load_model_state(self._module, self._ready(), self.comm, state_dict, strict=strict)
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
        engine = self._ready()
        sharded = self._config.state_dict_type == "sharded"
        if sharded and filter:
            raise ValueError(
                "filter: a sharded checkpoint holds whole models only; use state_dict_type='full'"
            )
        if sharded and storage_options is not None:
            raise TypeError("storage_options: sharded checkpoints are written by DCP, not CheckpointIO")
        path = self._shared_path(path)
        checkpoint = self._checkpoint_of(state, sharded, filter or {})
        if sharded:
            layout = checkpoints.layout_of(self._module, engine, self._config.stage, self.comm.world_size)
            keep = self._config.keep_previous_checkpoint
            checkpoints.save_sharded(checkpoint, Path(path), self.comm, layout, keep_previous=keep)
        else:
            checkpoints.save_full(
                checkpoint, path, self.comm, self.checkpoint_io, storage_options, engine=engine
            )

    def _checkpoint_of(self, state: Mapping[str, Any], sharded: bool, filter: dict) -> dict[str, Any]:
        """What ``fabric.save`` writes (see [Note: Fabric state keys]): the full form under the user's
        keys, as Fabric's DDP writes it; the sharded form in the Trainer's layout."""
        roles = self._roles(state, saving=True)
        precision_key, precision_state = type(self.precision).__qualname__, self.precision.state_dict()
        fstate.check_user_keys(state, roles, precision_key if precision_state else None)
        checkpoint = self._sharded_entries(state, roles) if sharded else self._user_entries(state, roles)
        checkpoint = {key: _filtered(key, filter, value) for key, value in checkpoint.items()}
        if precision_state:
            checkpoint[precision_key] = precision_state
        checkpoint.update(fstate.lightning_entries(roles, user_keys=not sharded))
        return checkpoint

    def _user_entries(self, state: Mapping[str, Any], roles: fstate.Roles) -> dict[str, Any]:
        """Every entry under the user's key: the model's state dict, each optimizer's state as one
        process has it (stage 3's values, and stages 1-3's optimizer state, written while gathered)."""
        index_of = {key: i for i, key in roles.optimizers.items()}
        checkpoint: dict[str, Any] = {}
        for key, obj in state.items():
            if key == roles.model:
                checkpoint[key] = self._model_state(sharded=False)
            elif key in index_of:
                checkpoint[key] = self._optimizer_state(obj, index_of[key], sharded=False)
            else:
                checkpoint[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        return checkpoint

    def _sharded_entries(self, state: Mapping[str, Any], roles: fstate.Roles) -> dict[str, Any]:
        """The Trainer's layout: the model under ``state_dict``, the optimizers in ``optimizer_states``,
        the LR schedulers in ``lr_schedulers``, every other entry under its own key."""
        checkpoint: dict[str, Any] = {}
        for key, obj in state.items():
            if key not in roles.keys():
                checkpoint[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        checkpoint[fstate.MODEL] = self._model_state(sharded=True)
        if roles.optimizers:
            checkpoint[fstate.OPTIMIZERS] = [
                self._optimizer_state(self._optimizers[i], i, sharded=True) for i in sorted(roles.optimizers)
            ]
        checkpoint[fstate.SCHEDULERS] = [state[key].state_dict() for key in roles.lr_schedulers]
        return checkpoint

    def _roles(self, state: Mapping[str, Any], *, saving: bool) -> fstate.Roles:
        """Which of the user's keys hold the model, the optimizers and the LR schedulers (a save
        needs the model; a load reads what is asked for)."""
        model, optimizers, schedulers = None, {}, []
        for key, obj in state.items():
            if self._owns(obj):
                if model is not None:
                    raise ValueError(f"the model is in the state twice, under {model!r} and {key!r}")
                model = key
            elif isinstance(obj, Optimizer):
                index = self._index(obj, key)
                if index in optimizers:
                    raise ValueError(
                        f"one optimizer is in the state twice, under {optimizers[index]!r} and {key!r}"
                    )
                optimizers[index] = key
            elif fstate.is_scheduler(obj):
                schedulers.append(key)
        if model is None and saving:
            raise ValueError(
                "the state holds no model set up by this strategy: pass it like "
                "fabric.save(path, {'model': model, 'optimizer': optimizer, ...}) (the object fabric.setup returned)"
            )
        if saving and optimizers and len(optimizers) != len(self._optimizers):
            raise ValueError(
                f"the state holds {len(optimizers)} of the {len(self._optimizers)} optimizers set up: a checkpoint "
                "holds all of them (optimizer_states, in set-up order) or none"
            )
        return fstate.Roles(model, optimizers, schedulers)

    def _model_state(self, sharded: bool) -> dict[str, Any]:
        return model_state(self._module, self._ready(), sharded=sharded)

    def _optimizer_state(self, optimizer: Optimizer, index: int, sharded: bool) -> dict[str, Any]:
        return optimizer_state(self._module, self._ready(), optimizer, index, sharded=sharded)

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
        path = self._shared_path(path)
        if isinstance(state, (nn.Module, Optimizer)):
            self._load_raw(path, state, strict, weights_only)
            return {}
        verify = self._config.verify_checkpoints
        roles = self._roles(state or {}, saving=False)
        try:
            checkpoint = checkpoints.read(
                path, self.checkpoint_io, weights_only, comm=self.comm, verify=verify
            )
        except UserKeyedCheckpoint as err:  # Fabric's DDP wrote it: the keys are the state's
            if not state:
                return dict(err.entries)
            record = fstate.user_keys_record(roles)
            checkpoint = {**as_trainer_layout(err.entries, record), fstate.ROLES: record}
        if not state:
            return self._as_saved(checkpoint, path)
        if strict:
            fstate.check_requested(state, roles, checkpoint, path)
        self._load_model_and_optimizers(checkpoint, roles, strict)
        self._load_schedulers(checkpoint, state, roles)
        self._load_precision(checkpoint)
        for key, obj in state.items():
            if key in roles.keys() or key not in checkpoint:
                continue
            value = checkpoint.pop(key)
            if isinstance(obj, _Stateful):
                obj.load_state_dict(value)
            else:
                state[key] = value
        return fstate.as_saved(_without_stand_ins(checkpoint))

    def _load_model_and_optimizers(
        self, checkpoint: dict[str, Any], roles: fstate.Roles, strict: bool
    ) -> None:
        """The model and the optimizers asked for, each rank its part (sharded: read in place)."""
        if roles.model is not None and fstate.MODEL in checkpoint:
            model_state = checkpoint.pop(fstate.MODEL)
            checkpoints.load_model_state(self._module, self._ready(), self.comm, model_state, strict=strict)
        if not roles.optimizers or fstate.OPTIMIZERS not in checkpoint:
            return
        states = checkpoint.pop(fstate.OPTIMIZERS)
        if len(states) != len(self._optimizers):
            raise checkpoints.CheckpointError(
                f"the checkpoint holds {len(states)} optimizer states, {len(self._optimizers)} optimizers are set up"
            )
        engine = self._ready()
        for index in sorted(roles.optimizers):
            optimizer, saved = self._optimizers[index], states[index]
            if isinstance(saved, checkpoints.ShardedOptimizerState):
                checkpoints.load_sharded_optimizer(self._module, engine, self.comm, optimizer, saved)
            else:
                engine.load_optimizer_state(optimizer, index, saved)
        _optimizers_to_device(self._optimizers, self.root_device)

    def _load_schedulers(
        self, checkpoint: dict[str, Any], state: Mapping[str, Any], roles: fstate.Roles
    ) -> None:
        saved = checkpoint.get(fstate.SCHEDULERS, [])
        for key, scheduler_state in zip(roles.lr_schedulers, saved):
            state[key].load_state_dict(scheduler_state)
        if roles.lr_schedulers:
            checkpoint.pop(fstate.SCHEDULERS, None)

    def _load_precision(self, checkpoint: dict[str, Any]) -> None:
        """The precision plugin's state (fp16 loss scale), filed under its class name as the Trainer does."""
        key = type(self.precision).__qualname__
        if key in checkpoint:
            self.precision.load_state_dict(checkpoint.pop(key))

    def _load_raw(
        self, path: str, obj: nn.Module | Optimizer, strict: bool, weights_only: bool | None
    ) -> None:
        """``fabric.load_raw``: a bare state dict (a module's, or an optimizer's single-process one)."""
        raw = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if isinstance(obj, Optimizer):
            self._ready().load_optimizer_state(obj, self._index(obj), raw)
        elif self._owns(obj):
            checkpoints.load_model_state(self._module, self._ready(), self.comm, raw, strict=strict)
        else:
            obj.load_state_dict(raw, strict=strict)

    def _as_saved(self, checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
        if isinstance(checkpoint.get(fstate.MODEL), checkpoints.ShardedModelState):
            raise checkpoints.CheckpointError(
                f"{path} is a sharded checkpoint: it loads into objects, fabric.load(path, {{'model': model, ...}}), "
                "or turns into one file with: lightning-zero consolidate PATH OUT.ckpt"
            )
        return fstate.as_saved(checkpoint)

    def _shared_path(self, path: _PATH) -> str:
        """Rank 0's path on every rank: all of them read or write the same checkpoint."""
        return self.comm.broadcast_object(str(path), name="checkpoint/path", device=self.root_device)

    # -- the end ---------------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        """End training: the watchdog stopped, the exception hook restored, hooks removed, the model
        whole again in its own parameters (stage 3 gathers it: every rank calls it; not after a failure)."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._hook is not None:
            self._hook.uninstall()
            self._hook = None
        if self._engine is not None and self._wrapped is not None:
            self._engine.teardown(failed=self._failed)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for stage in SUPPORTED_STAGES:
            for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
                name = f"zero{stage}{suffix}"
                if name in strategy_registry:
                    continue
                strategy_registry.register(
                    name,
                    cls,
                    description=f"ZeRO stage {stage} data parallelism, start_method '{start_method}'",
                    stage=stage,
                    start_method=start_method,
                )


class _FailureHook:
    """``sys.excepthook`` while a strategy is active: an uncaught error in the user's script is
    published before the previous hook prints it (see [Note: failures in a Fabric loop]). One per
    process: a later strategy's hook replaces an earlier one's, keeping the hook before both."""

    def __init__(self, strategy: ZeroFabricStrategy, previous: Callable[..., Any]) -> None:
        self.strategy = strategy  # whose communicator publishes the failure
        self.previous = previous  # the hook installed before this one: prints the traceback

    @classmethod
    def install(cls, strategy: ZeroFabricStrategy) -> _FailureHook:
        current = sys.excepthook
        hook = cls(strategy, current.previous if isinstance(current, _FailureHook) else current)
        sys.excepthook = hook
        return hook

    def uninstall(self) -> None:
        if sys.excepthook is self:
            sys.excepthook = self.previous

    def __call__(self, kind: type[BaseException], error: BaseException, tb: Any) -> None:
        published = self.strategy._report_failure(error)  # first: the peers stop waiting at once
        self.previous(kind, error, tb)
        if published:
            self.strategy._leave_last()
        # the interpreter exits: status 1, the process group kept (comm/collectives.py)


class _ReportingLauncher(_MultiProcessingLauncher):
    """Fabric's spawn/fork launcher, with the user's function's failure published in the worker
    before torch's wrapper hands it to the parent process (see [Note: failures in a Fabric loop])."""

    @override
    def _wrapping_function(self, process_idx: int, *args: Any) -> None:
        try:
            super()._wrapping_function(process_idx, *args)
        except (Exception, KeyboardInterrupt) as error:
            strategy = self._strategy
            assert isinstance(strategy, ZeroFabricStrategy)
            if strategy._report_failure(error):  # its own: the parent may report a peer's instead
                traceback.print_exc()
                strategy._leave_last()
            elif strategy._failed:  # a peer's: rank 0 keeps the store until the others have read it
                strategy.comm.linger_for_peers()
            raise  # torch's wrapper hands it to the parent and exits: status 1, the group kept


def _wait_until_read(comm: Communicator) -> None:
    """A rank that published its failure waits until its peers have read it (at most
    ``fault_wait_s`` and two wait slices). Rank 0 hosts the store and leaves only once every other
    rank has read the board or failed (``Communicator.linger_for_peers``), so another rank waits for
    rank 0 to end, by its pid on this host: a read of the store while rank 0 exits would fail. Rank
    0 (or a rank on another host than rank 0) reads the store: peers that failed too are not waited
    for, the others until they end (this host) or have noted themselves (another host)."""
    if comm.board is None:
        return
    deadline = time.monotonic() + comm.fault_wait_s + 2 * POLL_S
    try:
        while time.monotonic() < deadline:
            store_host = process_exists(comm.ranks[0]) if comm.rank != 0 else None
            if store_host is False or (store_host is None and _all_read(comm)):
                return
            time.sleep(0.1)
    except StoreUnreachable:  # the store's host (rank 0) is gone: nobody is left to read it
        return


def _all_read(comm: Communicator) -> bool:
    """Every peer that did not fail too has ended (this host) or noted itself (another host)."""
    failed, noted = {f.rank for f in comm.board.faults()}, comm.board.noted()
    for peer in comm.ranks:
        if peer.rank == comm.rank or peer.rank in failed:
            continue
        running = process_exists(peer)
        if running is True or (running is None and peer.rank not in noted):
            return False
    return True


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


def _lay_onto(engine: Engine, module: nn.Module, optimizer: Optimizer, index: int) -> None:
    """An optimizer set up after its model: its groups take the tensors the engine steps for their
    parameters (see [Note: set up together or apart]), as ``engine.setup`` does for the optimizers it
    is given. ``index``: its position among the model's optimizers."""
    if not engine.needs_optimizers_first:
        return
    _check_own_parameters(module, optimizer, engine)
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already holds state (it stepped before fabric.setup_optimizers); "
            "set it up before its first step"
        )
    if isinstance(engine, FullyShardedEngine):
        check_shardable(optimizer, resolve_optimizer_classes(engine.config.elementwise_optimizers))
        engine.lay_optimizer(optimizer, index)
    elif isinstance(engine, ShardedOptimizerEngine):
        check_shardable(optimizer, resolve_optimizer_classes(engine.config.elementwise_optimizers))
        engine.sharded_params.shard_optimizer(optimizer, index)
    else:  # stage 0 under a policy: the groups step the fp32 masters
        for group in optimizer.param_groups:
            group["params"] = [engine.masters.get(id(p), p) for p in group["params"]]
    engine.optimizers.append(optimizer)


def _check_own_parameters(module: nn.Module, optimizer: Optimizer, engine: Engine) -> None:
    """Every parameter the optimizer holds is one of the model's (the sharded stages step only those;
    at stage 3 also those the model had before it was sharded)."""
    own = {id(p) for p in module.parameters()}
    zero3 = getattr(engine, "zero3", None)
    foreign = sum(
        1
        for g in optimizer.param_groups
        for p in g["params"]
        if id(p) not in own and (zero3 is None or zero3.sharded_of(p) is None)
    )
    if foreign:
        raise ValueError(
            f"the {type(optimizer).__name__} holds {foreign} parameter(s) that are not the model's (a copy, or "
            "another module's); make it from the parameters of the model fabric.setup returned: "
            "optimizer = torch.optim.AdamW(model.parameters()), then fabric.setup_optimizers(optimizer)"
        )


def _filtered(key: str | None, filter: Mapping[str, Callable[[str, Any], bool]], value: Any) -> Any:
    """Fabric's ``save(..., filter={key: fn})``: the items of a dict entry for which ``fn`` is true."""
    if key not in filter or not isinstance(value, Mapping):
        return value
    return {k: v for k, v in value.items() if filter[key](k, v)}


def _without_stand_ins(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint's model and optimizer entries that were not loaded: they stand for data
    only a load reads, so they are left out of what ``fabric.load`` returns."""
    if isinstance(checkpoint.get(fstate.MODEL), checkpoints.ShardedModelState):
        del checkpoint[fstate.MODEL]
    if any(isinstance(s, checkpoints.ShardedOptimizerState) for s in checkpoint.get(fstate.OPTIMIZERS, [])):
        del checkpoint[fstate.OPTIMIZERS]
    return checkpoint
