"""The ZeRO run, whatever framework drives it.

[Note: one runtime, two glues]
A run has the same parts under the Trainer and under Fabric: its config, the communicator and the
ledger, the watchdog and the fault board, the engine of its stage, the checkpoint paths and forms,
the failure state. :class:`ZeroRun` owns them and does what a run does with them (set up, wrap,
save, read, report a failure, end); the two strategy classes (``strategy.py`` for the Trainer,
``fabric/strategy.py`` for Fabric) translate their framework's calls into these, and add only what
their framework has alone (the Trainer's signals and fit-time plugins; Fabric's optimizers set up
apart from their model, its state keys and its exception hook). What both classes do alike with
the run (properties, the framework's own collectives, the model's state, the step) is written once
in ``glue.py``, a base class ahead of each framework's ``DDPStrategy``. So a behaviour exists once,
and a change to it reaches both glues.

[Note: set up together or apart]
``fabric.setup(model, optimizer, ...)`` gives the model and its optimizers at once and the engine
wraps them together. ``fabric.setup(model)`` (or ``setup_module``) gives the model alone, as litgpt and
Lightning's FSDP examples do: the model is wrapped at once (stage 3: built on the meta device, it is
given its values and sharded unit by unit here), so ``model.parameters()`` afterwards are the model's
own parameters as set up (stage 3: DTensors holding this rank's shards). An optimizer
made from them and passed to ``setup_optimizers`` is then laid onto the engine's flat spaces in place
(:meth:`ZeroRun.add_optimizer`): stages 1-3 give each param group the sub-shards of its parameters, stage 0 under a
mixed-precision policy its fp32 masters; stage 0 in the model's own dtype keeps it as it is. Loading
weights (``fabric.load_raw``, ``fabric.load``) may come before or after. The set of optimizers closes
when training begins (the model's first forward, or ``no_backward_sync``): gradients and optimizer
steps are laid out for the optimizers known then, so one set up later is an error that says so.
Every rank must take the same steps in the same order (the wrap broadcasts rank 0's parameters).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_leaves

from lightning_zero import checkpoint as checkpoints
from lightning_zero import faults
from lightning_zero.allocator import MMAP_THRESHOLD, tune_cpu_allocator
from lightning_zero.comm import CommLedger, Communicator
from lightning_zero.comm.collectives import is_distributed
from lightning_zero.comm.mesh import sharding_comm
from lightning_zero.comm.waiting import stop_waiter
from lightning_zero.comm.watchdog import Watchdog
from lightning_zero.config import SUPPORTED_STAGES, ZeroConfig
from lightning_zero.engines import Engine, FullyShardedEngine, ShardedOptimizerEngine, make_engine
from lightning_zero.grad_sync import ZeroModule, broadcast_module_states
from lightning_zero.imports import resolve_optimizer_classes
from lightning_zero.memory import MemoryReport, measure
from lightning_zero.precision import PrecisionPolicy, resolve_policy
from lightning_zero.signals import check_counts, with_counts
from lightning_zero.solo import SoloEngine, runs_solo
from lightning_zero.zero.deferred import meta_init
from lightning_zero.zero.optimizer import check_shardable

log = logging.getLogger(__name__)

START_METHODS = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"))  # name suffix, start method


def config_of(
    stage: int, config: ZeroConfig | None, options: dict[str, Any], others: tuple[str, ...] = ()
) -> ZeroConfig:
    """A strategy's config: ``config`` as it is, or ``stage`` and ``options`` checked into one
    (``others``: the strategy's own argument names, listed too when a name is unknown)."""
    if config is not None and (options or stage != 0):
        raise TypeError("give either config=ZeroConfig(...) or stage and options, not both")
    return config if config is not None else ZeroConfig.from_kwargs(others, stage=stage, **options)


def register_names(cls: type, registry: _StrategyRegistry) -> None:
    """``zero0`` .. ``zero3`` and their ``_spawn`` and ``_fork`` variants, for ``cls``, in ``registry``."""
    for stage in SUPPORTED_STAGES:
        for suffix, start_method in START_METHODS:
            name = f"zero{stage}{suffix}"
            if name not in registry:
                registry.register(
                    name,
                    cls,
                    description=f"ZeRO stage {stage} data parallelism, start_method '{start_method}'",
                    stage=stage,
                    start_method=start_method,
                )


class ZeroRun:
    """The parts of a ZeRO run and what it does with them (see [Note: one runtime, two glues])."""

    def __init__(self, config: ZeroConfig) -> None:
        self.config = config
        self.ledger = CommLedger(max_records=config.ledger_records)  # collectives, per step, bounded
        self._comm: Communicator | None = None  # built once the process group exists
        self.engine: Engine | None = None  # the stage's mechanism while training
        self.fitted: Engine | None = None  # after a fit's end: its engine, whose shards hold the state
        self.init_rng: Tensor | None = None  # stage 3: the random state a meta-device model was built under
        self.watchdog: Watchdog | None = None  # heartbeat; reports stuck collectives (config.watchdog_s)
        self.failed = False  # this rank failed: no collective runs after it (faults.py)
        self.backwards = 0  # backward passes this rank ran (agreed with the other ranks': signals.py)
        self.steps = 0  # optimizer steps this rank took (Fabric's count; the Trainer's is global_step)
        self.forwards = 0  # training forwards (Fabric: each agreed first)

    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            self._comm = Communicator(ledger=self.ledger)
        return self._comm

    @property
    def state_engine(self) -> Engine | None:
        """The engine whose shards hold the model and optimizer state: the running one, or the last fit's."""
        return self.engine if self.engine is not None else self.fitted

    # -- the processes ---------------------------------------------------------------------------

    def prepare_process(self, device: torch.device, world_size: int) -> None:
        """Before the model exists: the CPU allocator setting for setting up, the one of stages that
        free memory on several ranks (every stage builds flat buckets or shards there, and the
        sharded stages free the unsharded model), glibc's ceiling on one rank, which keeps the
        model as it is; :meth:`_settle_allocator` sets the one for training. See [Note: why the
        CPU allocator is tuned] in ``allocator.py``."""
        tune_cpu_allocator(self.config.cpu_allocator, device_type=device.type, frees=world_size > 1)

    def watch_faults(self) -> bool:
        """Every rank's host known, the fault board open, the watchdog on (docs/failures.md). True
        when this rank has peers to fail with."""
        self.failed = False
        self.comm.watch_faults(fault_wait_s=self.config.fault_wait_s)
        if not self.comm.active:
            return False
        if self.watchdog is None:
            self.watchdog = Watchdog(self.comm, self.config.watchdog_s)
            self.watchdog.start()
        return True

    def stop_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def report_failure(self, exception: BaseException, *, step: int | None) -> bool:
        """User code raised ``exception`` on this rank: every rank is told why through the store;
        True when it is a failure (not an agreed stop). No collective runs after it."""
        self.failed = faults.on_fit_exception(self.comm, exception, step=step)
        return self.failed

    @contextmanager
    def foreign(self, op: str, data: Any = None) -> Generator[None, None, None]:
        """Around the framework's own collective ``op`` (an all-gather, a reduce) of ``data``:
        numbered, checked on gloo before it starts with its tensors' shapes in its name and their
        bytes (ranks that gather different shapes stop, named, where gloo would abort one), and
        known to the watchdog while it blocks."""
        if not is_distributed():
            yield
            return
        leaves = [t for t in tree_leaves(data) if isinstance(t, Tensor)]
        shapes = " ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in leaves[:4])
        more = f" +{len(leaves) - 4}" if len(leaves) > 4 else ""
        nbytes = sum(t.numel() * t.element_size() for t in leaves)
        with self.comm.tracked(f"lightning/{op} {shapes}{more}".rstrip(), nbytes):
            yield

    def barrier(self, name: str | None) -> None:
        """The framework's barrier, through the communicator: a peer's failure ends it too."""
        if is_distributed():
            self.comm.barrier(name=f"lightning/{name or 'barrier'}", control=True)

    def broadcast(self, obj: Any, src: int, device: torch.device) -> Any:
        """The framework's object broadcast, through the communicator as the barrier."""
        if not is_distributed():
            return obj
        return self.comm.broadcast_object(
            obj, src=src, name="lightning/broadcast", device=device, control=True
        )

    def agree_counts(self, where: str, device: torch.device) -> None:
        """Every rank's optimizer steps and backward passes so far, compared on every rank: a
        difference is a named desync on all of them (see [Note: steps agreed] in signals.py)."""
        if self.comm.active:
            flags = with_counts(0, self.steps, self.backwards)
            table = self.comm.agree(flags, name=f"zero{self.config.stage}/agree/counts", device=device)
            check_counts(table, where)

    # -- the model -------------------------------------------------------------------------------

    @contextmanager
    def deferred_init(self, device: torch.device) -> Generator[None, None, None]:
        """Stage 3: modules created inside are built on the meta device, given their values unit by
        unit at setup (see [Note: deferred initialisation])."""
        self.init_rng = torch.get_rng_state()
        with meta_init(device):  # buffers' values recorded (see [Note: buffer values])
            yield

    def new_engine(
        self, module: nn.Module, precision: str, num_nodes: int, device: torch.device
    ) -> PrecisionPolicy:
        """The stage's engine for ``module`` over its sharding group; returns the precision policy."""
        cfg = self.config
        policy = resolve_policy(cfg.param_dtype, cfg.reduce_dtype, precision)
        group = sharding_comm(
            self.comm,
            cfg.shard_size,
            cfg.stage,
            num_nodes,
            module=module,
            device=device,
            report=rank_zero_info,
            secondary_shard_size=cfg.secondary_shard_size,
        )
        solo = runs_solo(group, policy, module)  # see [Note: one process] in solo.py
        self.engine = SoloEngine(cfg, group, policy) if solo else make_engine(cfg, group, policy)
        return policy

    def broadcast_states(self, module: nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank."""
        broadcast_module_states(module, self.comm, label=f"zero{self.config.stage}")

    def wrap(self, module: nn.Module, optimizers: Sequence[Optimizer], device: torch.device) -> ZeroModule:
        """The engine's wrapper around ``module``, with the optimizers it shards (stages 1-3)."""
        engine = self.engine
        assert engine is not None
        if self.config.stage > 0 and self.comm.world_size == 1:
            rank_zero_warn(
                f"stage {self.config.stage} on one process shards nothing: it trains as plain training"
                + (" (no hooks, no copies: see docs/benchmarks.md)" if isinstance(engine, SoloEngine) else "")
            )
        optimizers = list(optimizers) if engine.needs_optimizers_first else []
        wrapped = engine.setup(module, optimizers, device=device, rng_state=self.init_rng)
        self._settle_allocator(engine, device)
        return wrapped

    def _settle_allocator(self, engine: Engine, device: torch.device) -> None:
        """Once the model is wrapped, the setting for training: a stage that frees nothing while it
        trains (0-1), or no block as large as the mmap threshold (every unit and bucket smaller),
        takes glibc's ceiling (see [Note: why the CPU allocator is tuned] in allocator.py)."""
        sharded = self.config.stage >= 2 and self.comm.world_size > 1
        frees = sharded and engine.largest_freed_block() >= MMAP_THRESHOLD
        tune_cpu_allocator(self.config.cpu_allocator, device_type=device.type, frees=frees)

    def add_optimizer(
        self, module: nn.Module | None, optimizer: Optimizer, known: Sequence[Optimizer], *, closed: bool
    ) -> None:
        """An optimizer made after its model was wrapped (``known``: those set up before it; ``closed``:
        training began): its groups take the tensors the engine steps for their parameters, as
        ``wrap`` does for the optimizers it is given (see [Note: set up together or apart])."""
        engine = self.engine
        if engine is None or module is None:
            raise RuntimeError(
                "ZeroFabricStrategy: set up the model before its optimizers (model = fabric.setup(model), "
                "then optimizer = fabric.setup_optimizers(optimizer)), or both at once: "
                "model, optimizer = fabric.setup(model, optimizer)"
            )
        if closed and engine.needs_optimizers_first:
            raise RuntimeError(
                f"ZeroFabricStrategy(stage={self.config.stage}) already laid out the model's shards and trained with "
                f"the {len(known)} optimizer(s) set up before training began (the model's first "
                "forward, or no_backward_sync); it cannot shard another one. Set up every optimizer before "
                "that: fabric.setup_optimizers(opt1, opt2) right after fabric.setup(model), or "
                "fabric.setup(model, opt1, opt2)"
            )
        if any(opt is optimizer for opt in known):
            raise ValueError(f"this {type(optimizer).__name__} is set up already")
        if not engine.needs_optimizers_first:
            return
        index = len(known)
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
        else:  # stage 0 under a policy, or one process: the groups step the fp32 masters, if any
            if isinstance(engine, SoloEngine) and engine.config.stage > 0:
                check_shardable(optimizer, resolve_optimizer_classes(engine.config.elementwise_optimizers))
            for group in optimizer.param_groups:
                group["params"] = [engine.masters.get(id(p), p) for p in group["params"]]
        engine.optimizers.append(optimizer)

    def full_state_dict(self, module: nn.Module, *, rank0_only: bool, global_rank: int) -> dict[str, Any]:
        """The model's state dict with full values in CPU memory (every rank calls it); stage 3
        gathers one flat space at a time; ``rank0_only``: only rank 0 gets it (the others ``{}``)."""
        engine = self.state_engine
        if engine is not None:
            return engine.full_state_dict(module, rank0_only=rank0_only)
        if rank0_only and global_rank != 0:
            return {}
        return {k: v.to("cpu") if isinstance(v, Tensor) else v for k, v in module.state_dict().items()}

    def memory_report(self, module: nn.Module, optimizers: Sequence[Optimizer]) -> MemoryReport:
        """Model-state bytes held by this rank now: parameters, gradients, optimizer state."""
        engine = self.engine
        grads = engine.grad_tensors() if engine is not None else []
        extra = engine.param_tensors() if engine is not None else []
        return measure(module, grads, list(optimizers), extra_params=extra)

    # -- checkpoints -----------------------------------------------------------------------------

    def prepare_folders(self, folders: Sequence[str], *, fitting: bool) -> None:
        """The run's checkpoint folders: when fitting, a read-only or missing one is named now, not at
        the first save (every rank checks it for the sharded form); what interrupted saves left there
        (``.NAME.partial``) is removed by rank 0."""
        if fitting:
            every_rank = self.config.state_dict_type == "sharded"
            checkpoints.check_writable(list(folders), self.comm, every_rank=every_rank)
        if self.comm.me == 0:
            for folder in folders:
                for stale in checkpoints.remove_stale_partials(folder):
                    log.info(f"removed {stale}, left by a save that did not finish")

    def shared_path(self, path: Any, device: torch.device) -> str:
        """Rank 0's path on every rank: all of them read or write the same checkpoint."""
        return self.comm.broadcast_object(str(path), name="checkpoint/path", device=device)

    def save(
        self,
        checkpoint: dict[str, Any],
        path: str,
        module: nn.Module,
        checkpoint_io: CheckpointIO,
        storage_options: Any | None,
    ) -> None:
        """Rank 0 writes one file (``"full"``), or every rank its shards into a directory (``"sharded"``);
        under the final name only once complete, the previous one kept as configured. All ranks call it."""
        cfg, engine = self.config, self.state_engine
        keep = cfg.keep_previous_checkpoint
        if cfg.state_dict_type == "full":
            checkpoints.save_full(
                checkpoint, path, self.comm, checkpoint_io, storage_options, engine=engine, keep_previous=keep
            )
            return
        if storage_options is not None:
            raise TypeError("storage_options: sharded checkpoints are written by DCP, not CheckpointIO")
        layout = checkpoints.layout_of(module, engine, cfg.stage, self.comm.world_size)
        checkpoints.save_sharded(checkpoint, Path(path), self.comm, layout, keep_previous=keep)

    def read(
        self, path: str, checkpoint_io: CheckpointIO, weights_only: bool | None, *, fall_back: bool
    ) -> dict[str, Any]:
        """A full file, or a sharded directory's entries with stand-ins each rank reads later, checked
        against its checksums (``verify_checkpoints``); ``fall_back``: a damaged one is replaced by
        the previous intact one (docs/checkpoints.md)."""
        read = checkpoints.read_or_fallback if fall_back else checkpoints.read
        return read(path, checkpoint_io, weights_only, comm=self.comm, verify=self.config.verify_checkpoints)

    def load_model(self, module: nn.Module, state: Any, *, strict: bool) -> None:
        """A whole-model state dict into the model as set up (each rank takes its part)."""
        checkpoints.load_model_state(module, self.engine, self.comm, state, strict=strict)

    def load_optimizers(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        states: Sequence[Any],
        device: torch.device,
        indices: Sequence[int] | None = None,
    ) -> None:
        """The optimizers' saved states (one per optimizer, in set-up order) into ``optimizers``,
        each rank its part; ``indices``: only these."""
        if len(states) != len(optimizers):
            raise checkpoints.CheckpointError(
                f"the checkpoint holds {len(states)} optimizer states; this run has {len(optimizers)} optimizers"
            )
        for index in range(len(optimizers)) if indices is None else indices:
            optimizer, state = optimizers[index], states[index]
            if isinstance(state, checkpoints.ShardedOptimizerState):
                checkpoints.load_sharded_optimizer(module, self.engine, self.comm, optimizer, state)
            elif self.engine is None:  # after fit, or not fitting: the optimizer as the user made it
                optimizer.load_state_dict(state)
            else:
                self.engine.load_optimizer_state(optimizer, index, state)
        _optimizers_to_device(list(optimizers), device)

    # -- the end ---------------------------------------------------------------------------------

    def end(self, *, keep_state: bool) -> Engine | None:
        """The watchdog stopped and the engine torn down (no collective after a failure); with
        ``keep_state`` its shards stay readable (``state_engine``) after a good end. Returns the engine."""
        self.stop_watchdog()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.teardown(failed=self.failed)
            self.fitted = engine if keep_state and not self.failed else None
        if not self.failed:
            stop_waiter()  # no thread of the package outlives the run (after a failure it may be blocked)
        self.failed = False
        return engine


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
