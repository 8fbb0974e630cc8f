"""One engine per kind of stage: what the strategy asks of a stage, in one place.

The strategy (Lightning glue) calls the same methods whatever the stage; each engine answers
with its own mechanism: stage 0 a GradReducer that all-reduces buckets, stages 1-2 a reducer that
reduce-scatters plus ShardedParams, stage 3 ZeroThree's units.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.grad_sync import ZeroModule, trainable_parameters, wrap_module
from lightning_zero.zero.flat_param import clip_grad_norm_, full_optimizer_state, load_full_optimizer_state
from lightning_zero.zero.optimizer import (
    ShardedParams,
    check_state_shapes,
    param_group_keys,
    shard_optimizer_in_place,
)
from lightning_zero.zero.sharded_module import ZeroThree
from lightning_zero.zero.wrap import make_policy


class Engine:
    """Stage 0: plain data parallelism. The base of the others."""

    sharded = False  # optimizer state lives in shards (stages 1-3)

    def __init__(self, config: ZeroConfig, comm: Communicator) -> None:
        self.config = config
        self.comm = comm
        self.label = f"zero{config.stage}"  # prefix of collective names
        self.wrapped: ZeroModule | None = None  # the root wrapper, once set up

    def setup(self, module: nn.Module, optimizers: Sequence[Optimizer]) -> ZeroModule:
        """Wrap ``module``; ``optimizers`` exist already for the sharded stages."""
        self.wrapped = wrap_module(module, self.comm, self.config)
        return self.wrapped

    @property
    def needs_optimizers_first(self) -> bool:
        return self.sharded

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        with self.wrapped.sync.no_sync():
            yield

    def after_step(self, optimizer: Optimizer, index: int) -> None:
        """After the optimizer stepped (stages 1-2 all-gather the updated parameters here)."""

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        return clip_grad_norm_(optimizer, max_norm, self.comm, self.label)

    def optimizer_state(self, optimizer: Optimizer, index: int) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: Optimizer, index: int, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return module.state_dict()

    def grad_tensors(self) -> list[Tensor]:
        return self.wrapped.sync.grad_tensors() if self.wrapped is not None else []

    def param_tensors(self) -> list[Tensor]:
        """Parameter storage beyond the module's own parameters (stage 3: shards, gathered units)."""
        return []

    def teardown(self) -> None:
        if self.wrapped is not None:
            self.wrapped.sync.remove_hooks()


class ShardedOptimizerEngine(Engine):
    """Stages 1-2: optimizer state (and, for 2, gradients) sharded; parameters whole."""

    sharded = True

    def setup(self, module: nn.Module, optimizers: Sequence[Optimizer]) -> ZeroModule:
        named = trainable_parameters(module)
        keys = param_group_keys(optimizers, [p for _, p in named], [n for n, _ in named])
        self.wrapped = wrap_module(module, self.comm, self.config, keys=keys)
        self.params = ShardedParams(self.wrapped.sync, self.comm)  # flat buckets and shards
        for index, optimizer in enumerate(optimizers):
            self.params.shard_optimizer(optimizer, index)
        return self.wrapped

    def after_step(self, optimizer: Optimizer, index: int) -> None:
        self.params.after_step(optimizer, index)

    def optimizer_state(self, optimizer: Optimizer, index: int) -> dict[str, Any]:
        return self.params.full_state_dict(optimizer, index)

    def load_optimizer_state(self, optimizer: Optimizer, index: int, state: dict[str, Any]) -> None:
        self.params.load_full_state_dict(optimizer, index, state)


class FullyShardedEngine(Engine):
    """Stage 3: parameters, gradients and optimizer state sharded per wrap unit."""

    sharded = True

    def setup(self, module: nn.Module, optimizers: Sequence[Optimizer]) -> ZeroModule:
        cfg = self.config
        named = trainable_parameters(module)
        params = [p for _, p in named]
        keys = dict(zip(map(id, params), param_group_keys(optimizers, params, [n for n, _ in named])))
        self.zero3 = ZeroThree(  # units, hooks and schedule
            module,
            self.comm,
            make_policy(cfg.wrap_policy, cfg.min_num_params),
            keys,
            prefetch=cfg.prefetch,
            prefetch_limit=cfg.prefetch_limit,
            reshard_after_forward=cfg.reshard_after_forward,
            accumulate_unsharded=cfg.accumulate_unsharded,
            label=self.label,
        )
        spaces = [u.flat for u in self.zero3.units]
        self.original_groups = {  # optimizer index -> its groups' original parameters
            i: shard_optimizer_in_place(opt, i, spaces) for i, opt in enumerate(optimizers)
        }
        self._checked: set[int] = set()  # optimizers whose state shapes were checked
        self.wrapped = ZeroModule(module, self.zero3, self.comm, broadcast_buffers=cfg.broadcast_buffers)
        return self.wrapped

    def after_step(self, optimizer: Optimizer, index: int) -> None:
        if index not in self._checked:
            check_state_shapes(optimizer)
            self._checked.add(index)

    def optimizer_state(self, optimizer: Optimizer, index: int) -> dict[str, Any]:
        spaces = [u.flat for u in self.zero3.units]
        return full_optimizer_state(
            optimizer, index, spaces, self.original_groups[index], self.comm, self.label
        )

    def load_optimizer_state(self, optimizer: Optimizer, index: int, state: dict[str, Any]) -> None:
        spaces = [u.flat for u in self.zero3.units]
        load_full_optimizer_state(optimizer, index, spaces, self.original_groups[index], state)

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return self.zero3.full_state_dict(module)

    def param_tensors(self) -> list[Tensor]:
        return self.zero3.shard_tensors() + [u.full for u in self.zero3.units if u.gathered]

    def teardown(self) -> None:
        self.zero3.remove_hooks()
        self.zero3.materialize()


def make_engine(config: ZeroConfig, comm: Communicator) -> Engine:
    if config.stage == 0:
        return Engine(config, comm)
    if config.stage in (1, 2):
        return ShardedOptimizerEngine(config, comm)
    return FullyShardedEngine(config, comm)
