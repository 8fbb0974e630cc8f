"""ZeroStrategy: the Lightning glue. Collective logic lives in ``comm/`` and ``grad_sync/``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.comm import CommLedger, Communicator
from lightning_zero.config import SUPPORTED_STAGES, ZeroConfig, option_names
from lightning_zero.grad_sync import (
    GradReducer,
    ZeroModule,
    broadcast_module_states,
    trainable_parameters,
    wrap_module,
)
from lightning_zero.memory import MemoryReport, measure
from lightning_zero.precision import install_sharded_clipping, remove_sharded_clipping
from lightning_zero.zero import ShardedParams, param_group_keys

log = logging.getLogger(__name__)


class ZeroStrategy(DDPStrategy):
    """Data parallelism with ZeRO sharding, gradient synchronisation done by this package.

    Keeps Lightning's DDP launchers, cluster environments, ranks and samplers; replaces torch's
    DistributedDataParallel with :class:`~lightning_zero.grad_sync.ZeroModule`.

    Args:
        stage: ZeRO stage (see :class:`~lightning_zero.config.ZeroConfig`).
        bucket_cap_mb: gradient bucket cap in MiB.
        first_bucket_cap_mb: cap of the first bucket in MiB.
        broadcast_buffers: broadcast buffers from rank 0 at each synchronised training forward.
        find_unused_parameters: reduce missing gradients as zeros instead of raising.
        accumulate_unsharded: stage 2: full local gradients across the accumulation window.
        start_method: how Lightning launches the processes: ``"popen"`` (re-run the script),
            ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout: as for Lightning's ``DDPStrategy``.
    """

    def __init__(
        self,
        stage: int = 0,
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        accumulate_unsharded: bool = False,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise TypeError(
                f"ZeroStrategy got unknown option(s): {', '.join(sorted(unknown))}; "
                f"known ZeRO options: {', '.join(option_names())}"
            )
        self._config = ZeroConfig(
            stage=stage,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
            accumulate_unsharded=accumulate_unsharded,
        )
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
        self._ledger = CommLedger()  # every collective of this strategy, per step
        self._comm: Communicator | None = None  # built once the process group exists
        self._reducer: GradReducer | None = None  # built when fitting starts
        self._sharded: ShardedParams | None = None  # stages 1-2: flat params and optimizer shards

    @property
    def config(self) -> ZeroConfig:
        return self._config

    @property
    def ledger(self) -> CommLedger:
        """Every collective issued by this strategy, grouped by optimizer step."""
        return self._ledger

    @property
    def reducer(self) -> GradReducer | None:
        return self._reducer

    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            self._comm = Communicator(ledger=self._ledger)
        return self._comm

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        broadcast_module_states(self.model, self.comm, label=f"zero{self._config.stage}")
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._config.stage == 0:
            self.configure_ddp()
            self.setup_optimizers(trainer)
        elif fitting:
            # the buckets are split by optimizer param group, so the optimizers come first
            self.setup_optimizers(trainer)
            self._setup_sharded()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self._sharded is not None:
            install_sharded_clipping(self.precision_plugin, self._clip_grad_norm)

    def _setup_sharded(self) -> None:
        assert isinstance(self.model, pl.LightningModule)
        if self.comm.world_size == 1:
            rank_zero_warn(
                f"stage {self._config.stage} on a single process shards nothing: it trains as plain training"
            )
        named = trainable_parameters(self.model)
        keys = param_group_keys(self.optimizers, [p for _, p in named], [n for n, _ in named])
        self.model = wrap_module(self.model, self.comm, self._config, keys=keys)
        self._reducer = self.model.reducer
        self._sharded = ShardedParams(self._reducer, self.comm)
        for index, optimizer in enumerate(self.optimizers):
            self._sharded.shard_optimizer(optimizer, index)

    @override
    def configure_ddp(self) -> None:
        assert isinstance(self.model, pl.LightningModule)
        self.model = self._setup_model(self.model)

    @override
    def _setup_model(self, model: nn.Module) -> ZeroModule:
        wrapped = wrap_module(model, self.comm, self._config)
        self._reducer = wrapped.reducer
        return wrapped

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's accumulation window (and ``toggle_model(sync_grad=False)``): no collective runs."""
        if self._reducer is None:
            yield None
            return
        with self._reducer.no_sync():
            yield None

    def _optimizer_index(self, optimizer: Optimizer) -> int:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return next(i for i, opt in enumerate(self.optimizers) if opt is inner)

    def _clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        assert self._sharded is not None
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return self._sharded.clip_grad_norm_(inner, max_norm)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._sharded is not None:
            index = self._optimizer_index(optimizer)
            self._sharded.after_step(self.optimizers[index], index)
        return output

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Stages 1-2: the consolidated state of the original parameters (a collective: all ranks call it)."""
        if self._sharded is None:
            return super().optimizer_state(optimizer)
        index = self._optimizer_index(optimizer)
        return self._sharded.full_state_dict(self.optimizers[index], index)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._sharded is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        for index, (optimizer, state) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            self._sharded.load_full_state_dict(optimizer, index, state)
        _optimizers_to_device(self.optimizers, self.root_device)

    def memory_report(self) -> MemoryReport:
        """Model-state bytes held by this rank now: parameters, gradients, optimizer state."""
        assert self.lightning_module is not None
        grads = self._reducer.grad_tensors() if self._reducer is not None else []
        return measure(self.lightning_module, grads, self.optimizers)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        assert self.lightning_module is not None
        self._ledger.begin_step(self.lightning_module.trainer.global_step)

    @override
    def teardown(self) -> None:
        if self._reducer is not None:
            self._reducer.remove_hooks()
            self._reducer = None
        if self._sharded is not None:
            remove_sharded_clipping(self.precision_plugin)
        if isinstance(self.model, ZeroModule):
            self.model = self.lightning_module
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
