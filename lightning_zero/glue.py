"""What the two strategy classes do alike over their run (see [Note: one runtime, two glues]).

:class:`RunGlue` comes first among the bases of the Trainer's ``ZeroStrategy`` and of Fabric's
``ZeroFabricStrategy``, ahead of their framework's ``DDPStrategy``: the properties, the
framework's own collectives, the model's state and the step are written here once; each glue
says only where its framework keeps the model and the optimizers (``_user_model``, ``optimizers``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.comm import CommLedger, Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import Engine
from lightning_zero.memory import MemoryReport
from lightning_zero.precision import training_precision
from lightning_zero.runtime import ZeroRun, config_of, register_names

# the arguments both frameworks' DDPStrategy take that a glue passes on (each adds its precision's)
DDP_ARGS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "process_group_backend",
    "timeout",
)


class RunGlue(ABC):
    """The half of a strategy class that is the same under the Trainer and under Fabric."""

    _run: ZeroRun  # the run: config, communicator, ledger, watchdog, engine (runtime.py)
    root_device: torch.device
    global_rank: int
    num_nodes: int
    optimizers: list[Optimizer]

    _framework_args: tuple[str, ...]  # the framework's DDPStrategy arguments the glue passes on

    def __init__(
        self,
        stage: int = 0,
        *,
        config: ZeroConfig | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **options: Any,
    ) -> None:
        """The run, then the framework's strategy: ``options`` that name one of its arguments
        (``_framework_args``) go to it, the others are ZeroConfig fields (see the glue's docstring)."""
        passed = {name: options.pop(name) for name in self._framework_args if name in options}
        self._run = ZeroRun(config_of(stage, config, options, self._framework_args))
        super().__init__(start_method=start_method, **passed)  # type: ignore[call-arg]

    @abstractmethod
    def _user_model(self) -> nn.Module:
        """The user's model as set up (the LightningModule; Fabric's module)."""

    @property
    def config(self) -> ZeroConfig:
        return self._run.config

    @property
    def ledger(self) -> CommLedger:
        """Every collective issued by this strategy, grouped by optimizer step."""
        return self._run.ledger

    @property
    def engine(self) -> Engine | None:
        """The stage's mechanism (hooks, buckets, shards, units) while training."""
        return self._run.engine

    @property
    def comm(self) -> Communicator:
        return self._run.comm

    # -- the processes and the framework's own collectives -------------------------------------

    def setup_environment(self) -> None:
        """Before the model exists: the CPU allocator setting (see ``allocator.py``), then DDP's."""
        self._run.prepare_process(self.root_device, self.num_nodes * self.num_processes)
        super().setup_environment()  # type: ignore[misc]

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """The framework's all-gather, tracked and checked with its shapes (ZeroRun.foreign)."""
        with self._run.foreign("all_gather", tensor):
            return super().all_gather(tensor, group, sync_grads)  # type: ignore[misc]

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """The framework's barriers go through the communicator: a peer's failure ends them too."""
        self._run.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """The framework's object broadcasts go through the communicator, as the barriers do."""
        return self._run.broadcast(obj, src, self.root_device)

    # -- the model's state -----------------------------------------------------------------------

    def gathered(self) -> AbstractContextManager:
        """Stage 3: every unit's full parameters inside this context; every rank must enter it
        together. Inside a training step with gradients enabled they stay gathered until the end of
        the next backward, so a term computed from them (a penalty) reaches them; otherwise they are
        freed on leaving. The other stages hold whole parameters: it changes nothing there."""
        engine = self._run.engine
        return engine.gathered() if engine is not None else nullcontext()

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, Any]:
        """The model's state dict with full parameter values, in CPU memory (all ranks call it). Stage
        3 gathers one flat space at a time; ``rank0_only``: only rank 0 gets it (the others ``{}``),
        so no rank ever holds the whole model beyond it."""
        return self._run.full_state_dict(
            self._user_model(), rank0_only=rank0_only, global_rank=self.global_rank
        )

    def memory_report(self) -> MemoryReport:
        """Model-state bytes held by this rank now: parameters, gradients, optimizer state."""
        return self._run.memory_report(self._user_model(), self.optimizers)

    def _meta_init(self, empty_init: bool | None = True) -> AbstractContextManager | None:
        """Stage 3 with ``empty_init``: modules created inside are built on the meta device and given
        their values unit by unit at setup (see [Note: deferred initialisation]); None otherwise."""
        if self.config.stage == 3 and empty_init:
            return self._run.deferred_init(self.root_device)
        return None

    def _new_engine(self, module: nn.Module, precision: Any) -> Any:
        """The stage's engine for ``module``; returns the precision plugin to train with (``precision``
        under the engine's policy: its masters, its loss scaling over the shards)."""
        policy = self._run.new_engine(module, precision.precision, self.num_nodes, self.root_device)
        label = self._run.engine.label
        return training_precision(precision, policy, self.comm, label, self.root_device.type)

    # -- training ----------------------------------------------------------------------------------

    @contextmanager
    def _stepping(self, index: int | None) -> Generator[None, None, None]:
        """Around the framework's optimizer step of optimizer ``index`` (None: no engine): the engine
        hears that it ended, and after a step that returned, its after-step (masters into the
        parameters; stages 1-2 all-gather them)."""
        engine = self._run.engine
        try:
            yield
        finally:
            if index is not None:
                engine.step_ended(index)
        if index is not None:
            engine.after_step(self.optimizers[index], index)

    def _backward_begins(self, loss: Tensor) -> None:
        """A backward is about to run: one that raised before is noticed first (see [Note: a backward
        that raised]); then it is counted (agreed with the other ranks': [Note: steps agreed])."""
        if self._run.engine is not None:
            self._run.engine.prepare_backward(loss)
        self._run.backwards += 1

    def _backward_ended(self) -> None:
        """The backward ended: one process makes its master gradients ([Note: one process])."""
        if self._run.engine is not None:
            self._run.engine.finish_backward()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(cls, strategy_registry)
