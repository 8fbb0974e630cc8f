"""One engine per kind of stage: what the strategy asks of a stage, in one place.

The strategy (Lightning glue) calls the same methods whatever the stage; each engine answers
with its own mechanism: stage 0 a GradReducer that all-reduces buckets, stages 1-2 a reducer that
reduce-scatters plus ShardedParams, stage 3 ZeroThree's units.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.grad_sync import ZeroModule, trainable_parameters, wrap_module
from lightning_zero.precision import PrecisionPolicy, cast_parameters
from lightning_zero.zero.flat_param import (
    FlatParameter,
    clip_grad_norm_,
    full_optimizer_state,
    full_parameters,
    load_full_optimizer_state,
    state_dict_with,
)
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

    def __init__(self, config: ZeroConfig, comm: Communicator, policy: PrecisionPolicy | None = None) -> None:
        self.config = config
        self.comm = comm
        self.policy = policy  # mixed precision; None: the module's own dtype, no master copy
        self.label = f"zero{config.stage}"  # prefix of collective names
        self.wrapped: ZeroModule | None = None  # the root wrapper, once set up
        self.masters: dict[int, nn.Parameter] = {}  # stage 0 with a policy: id(param) -> fp32 master

    def setup(self, module: nn.Module, optimizers: Sequence[Optimizer]) -> ZeroModule:
        """Wrap ``module``; ``optimizers`` exist already for the sharded stages and under a policy."""
        initial = cast_parameters(module, self.policy)
        self.wrapped = wrap_module(module, self.comm, self.config, reduce_dtype=self._reduce_dtype)
        if initial:
            self._use_masters(module, optimizers, initial)
        return self.wrapped

    def _use_masters(self, module: nn.Module, optimizers: Sequence[Optimizer], initial: dict) -> None:
        """Stage 0 under a policy: the optimizers step whole fp32 masters (see [Note: mixed precision])."""
        self.params = [p for _, p in trainable_parameters(module)]  # the bf16 parameters
        self.masters = {id(p): nn.Parameter(initial[id(p)]) for p in self.params}
        for optimizer in optimizers:
            if optimizer.state:
                raise ValueError(
                    f"{type(optimizer).__name__} already holds state; cannot give it master weights"
                )
            for group in optimizer.param_groups:
                group["params"] = [self.masters[id(p)] for p in group["params"]]
        self.wrapped.sync.on_reduced = self._grads_to_masters

    def _grads_to_masters(self) -> None:
        for p, grad in self.wrapped.sync.reduced_grads():
            self.masters[id(p)].grad = None if grad is None else grad.to(self.policy.master_dtype)

    @property
    def _reduce_dtype(self) -> torch.dtype | None:
        return self.policy.reduce_dtype if self.policy is not None else None

    @property
    def needs_optimizers_first(self) -> bool:
        return self.sharded or self.policy is not None

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        with self.wrapped.sync.no_sync():
            yield

    def after_step(self, optimizer: Optimizer, index: int) -> None:
        """After the optimizer stepped: masters into the parameters; stages 1-2 all-gather them."""
        if not self.masters:
            return
        self.values_loaded()
        for group in optimizer.param_groups:  # the fp32 master gradients: freed now, not at zero_grad
            for master in group["params"]:
                master.grad = None

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        return clip_grad_norm_(optimizer, max_norm, self.comm, self.label)

    def optimizer_state(self, optimizer: Optimizer, index: int) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: Optimizer, index: int, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full model under the original names, parameters as the optimizer holds them."""
        return state_dict_with(module, self._master_values())

    def _master_values(self) -> dict[int, Tensor]:
        """id(param) -> full master value (empty when the parameters are their own masters)."""
        return {i: m.detach().clone() for i, m in self.masters.items()}

    def _restore_masters(self) -> None:
        """Teardown under a policy: the module gets its full-precision values back."""
        values = self._master_values()
        for p in getattr(self, "params", []):
            p.data = values[id(p)]

    def grad_tensors(self) -> list[Tensor]:
        return self.wrapped.sync.grad_tensors() if self.wrapped is not None else []

    def param_tensors(self) -> list[Tensor]:
        """Parameter storage beyond the module's own parameters (stage 3: shards, gathered units)."""
        return []

    def teardown(self) -> None:
        if self.wrapped is not None:
            self.wrapped.sync.remove_hooks()
            if self.policy is not None:
                self._restore_masters()

    # -- what checkpoints read and write (lightning_zero/checkpoint.py) -------------------------

    def flat_spaces(self) -> list[FlatParameter]:
        """The flat spaces whose ``shard`` holds the optimizer's values of their parameters."""
        return []

    def whole_values(self) -> dict[int, Tensor]:
        """id(param) -> the whole tensor the optimizer steps for it, where that is not the parameter
        itself (stage 0 under a policy: its fp32 master)."""
        return dict(self.masters)

    def group_params(self, optimizer: Optimizer, index: int) -> list[list[nn.Parameter]]:
        """The module's parameters of each param group of ``optimizer``, in the user's order."""
        param_of = {id(self.masters[id(p)]): p for p in getattr(self, "params", []) if id(p) in self.masters}
        return [[param_of.get(id(q), q) for q in group["params"]] for group in optimizer.param_groups]

    def values_loaded(self) -> None:
        """Shards and masters were overwritten (a step, a checkpoint): bring the module's parameters in line."""
        if not self.masters:
            return
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.masters[id(p)])
                p.grad = None  # consumed through the master; the optimizer's zero_grad does not reach it


class ShardedOptimizerEngine(Engine):
    """Stages 1-2: optimizer state (and, for 2, gradients) sharded; parameters whole."""

    sharded = True

    def setup(self, module: nn.Module, optimizers: Sequence[Optimizer]) -> ZeroModule:
        named = trainable_parameters(module)
        keys = param_group_keys(optimizers, [p for _, p in named], [n for n, _ in named])
        initial = cast_parameters(module, self.policy)
        self.wrapped = wrap_module(module, self.comm, self.config, keys=keys, reduce_dtype=self._reduce_dtype)
        self.sharded_params = ShardedParams(self.wrapped.sync, self.comm, initial)  # flat buckets, shards
        self.params = [p for _, p in named]  # the module's trainable parameters
        for index, optimizer in enumerate(optimizers):
            self.sharded_params.shard_optimizer(optimizer, index)
        return self.wrapped

    def after_step(self, optimizer: Optimizer, index: int) -> None:
        self.sharded_params.after_step(optimizer, index)

    def optimizer_state(self, optimizer: Optimizer, index: int) -> dict[str, Any]:
        return self.sharded_params.full_state_dict(optimizer, index)

    def load_optimizer_state(self, optimizer: Optimizer, index: int, state: dict[str, Any]) -> None:
        self.sharded_params.load_full_state_dict(optimizer, index, state)

    def _master_values(self) -> dict[int, Tensor]:
        if not self.sharded_params.masters:
            return {}
        return full_parameters(self.sharded_params.spaces, self.comm, self.label)

    def flat_spaces(self) -> list[FlatParameter]:
        return self.sharded_params.spaces

    def whole_values(self) -> dict[int, Tensor]:
        return {}

    def group_params(self, optimizer: Optimizer, index: int) -> list[list[nn.Parameter]]:
        return self.sharded_params.original_groups[index]

    def values_loaded(self) -> None:
        """Every bucket's shard into the parameters: this rank's chunk, then an in-place AllGather."""
        sp = self.sharded_params
        handles = []
        with torch.no_grad():
            for b, (flat, space) in enumerate(zip(sp.flats, sp.spaces)):
                own = space.own_chunk(flat)
                if own.data_ptr() != space.shard.data_ptr():  # a separate fp32 master
                    own.copy_(space.shard)
                name = f"{self.label}/all_gather/params/bucket={b}"
                handles.append(self.comm.all_gather(flat, own, name=name))
        for handle in handles:
            handle.wait()


class FullyShardedEngine(Engine):
    """Stage 3: parameters, gradients and optimizer state sharded per wrap unit."""

    sharded = True

    def setup(self, module: nn.Module, optimizers: Sequence[Optimizer]) -> ZeroModule:
        cfg = self.config
        named = trainable_parameters(module)
        params = [p for _, p in named]
        keys = dict(zip(map(id, params), param_group_keys(optimizers, params, [n for n, _ in named])))
        initial = cast_parameters(module, self.policy)
        self.params = params  # the module's trainable parameters
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
            masters=initial,
            reduce_dtype=self._reduce_dtype,
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
        for unit in self.zero3.units:
            unit.flat.release_grads(index)
        self.zero3.after_step()

    def optimizer_state(self, optimizer: Optimizer, index: int) -> dict[str, Any]:
        spaces = [u.flat for u in self.zero3.units]
        return full_optimizer_state(
            optimizer, index, spaces, self.original_groups[index], self.comm, self.label
        )

    def load_optimizer_state(self, optimizer: Optimizer, index: int, state: dict[str, Any]) -> None:
        spaces = [u.flat for u in self.zero3.units]
        load_full_optimizer_state(optimizer, index, spaces, self.original_groups[index], state)

    def _master_values(self) -> dict[int, Tensor]:
        return full_parameters([u.flat for u in self.zero3.units], self.comm, self.label)

    def param_tensors(self) -> list[Tensor]:
        return self.zero3.shard_tensors() + [u.full for u in self.zero3.units if u.gathered]

    def teardown(self) -> None:
        """Leave a whole module: every parameter gets its full value in storage of its own."""
        self.zero3.remove_hooks()
        self._restore_masters()
        self.zero3.release()

    def flat_spaces(self) -> list[FlatParameter]:
        return [u.flat for u in self.zero3.units]

    def whole_values(self) -> dict[int, Tensor]:
        return {}

    def group_params(self, optimizer: Optimizer, index: int) -> list[list[nn.Parameter]]:
        return self.original_groups[index]

    def values_loaded(self) -> None:
        """The shards the next gathers read follow the loaded (master) shards."""
        self.zero3.after_step()


def make_engine(config: ZeroConfig, comm: Communicator, policy: PrecisionPolicy | None = None) -> Engine:
    if config.stage == 0:
        return Engine(config, comm, policy)
    if config.stage in (1, 2):
        return ShardedOptimizerEngine(config, comm, policy)
    return FullyShardedEngine(config, comm, policy)
