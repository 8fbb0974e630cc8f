"""Stages 1-2: parameters in flat buckets, the user's optimizer stepping on this rank's shard.

[Note: shard layout]
The parameter buckets have the layout of the gradient buckets (``BucketSpec``): one flat tensor
per bucket, padded to a multiple of N, split into N equal contiguous chunks; rank r owns chunk r
of every bucket, so shards are balanced to the element. The module's own parameters become views
into the flat tensors (``p.data`` points into them), and the shard parameter of bucket b is a
leaf tensor aliasing chunk r of that bucket. The optimizer steps the shard parameters in place,
which updates chunk r of the model's parameters directly; an in-place AllGather per bucket then
brings every rank the other chunks. The flat tensors are owned by :class:`ShardedParams`.

[Note: optimizer in place]
The user's optimizer object is kept: its ``param_groups[i]["params"]`` lists are replaced by the
shard parameters of the buckets belonging to group i, everything else in the group (lr, betas,
weight decay, what a scheduler changes) is untouched. Lightning's ``trainer.optimizers`` and the
LR schedulers therefore keep working on the same object. Its state is per shard; the checkpoint
form is consolidated back to the original parameters (``full_state_dict``) so that a plain single
process can load it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.grad_sync import GradReducer
from lightning_zero.zero.flat_param import (
    FlatParameter,
    clip_grad_norm_,
    full_optimizer_state,
    load_full_optimizer_state,
)

UNSHARDABLE = (torch.optim.LBFGS,)  # step re-evaluates closures over whole parameters


class ShardingError(ValueError):
    """The optimizer or model cannot be sharded; the message says why and what to use instead."""


def param_group_keys(
    optimizers: Sequence[Optimizer], params: Sequence[Parameter], names: Sequence[str]
) -> list:
    """Per parameter, ``(optimizer index, group index)``; ``None`` for one no optimizer updates."""
    where: dict[int, tuple[int, int]] = {}
    for oi, optimizer in enumerate(optimizers):
        _refuse_unshardable(optimizer)
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in where:
                    raise ShardingError(
                        f"a parameter appears in two optimizer param groups: {where[id(p)]} and {(oi, gi)}"
                    )
                where[id(p)] = (oi, gi)
    return [where.get(id(p)) for p in params]


def _refuse_unshardable(optimizer: Optimizer) -> None:
    if isinstance(optimizer, UNSHARDABLE):
        raise ShardingError(
            f"{type(optimizer).__name__} cannot be sharded: its step evaluates the closure over whole "
            "parameters. Use stage 0 (strategy='zero0') for it."
        )


class ShardedParams:
    """Stages 1-2: flat parameter buckets, this rank's shards, and the in-place optimizer wrapping.

    Args:
        reducer: the gradient reducer; its buckets define the layout (see [Note: shard layout]).
        comm: collectives for the AllGather of updated parameters and the norm AllReduce.
    """

    def __init__(
        self, reducer: GradReducer, comm: Communicator, masters: dict[int, Tensor] | None = None
    ) -> None:
        self.reducer = reducer
        self.comm = comm
        self.label = reducer.label  # prefix of the collectives' names
        self.flats: list[Tensor] = []  # per bucket: 1D, padded to a multiple of N; owns the params
        self.spaces: list[FlatParameter] = []  # per bucket: layout, shard and sub-shard
        self.original_groups: dict[int, list[list[Parameter]]] = {}  # optimizer -> groups' params
        self._checked: set[int] = set()  # optimizers whose state shapes were checked
        self.masters = bool(masters)  # shards are separate fp32 masters (see [Note: mixed precision])
        self._layout(masters or {})

    def _layout(self, masters: dict[int, Tensor]) -> None:
        for b, bucket in enumerate(self.reducer.buckets):
            keys = [self.reducer.keys[i] for i in bucket.spec.params]
            space = FlatParameter(
                f"bucket={b}",
                bucket.params,
                keys,
                torch.empty(0),
                world_size=self.comm.world_size,
                rank=self.comm.rank,
            )
            flat = space.full_from_params()
            with torch.no_grad():
                for p, offset in zip(bucket.params, space.offsets):
                    p.data = flat[offset : offset + p.numel()].view_as(p)
            space.shard = space.master_shard(masters) if masters else space.own_chunk(flat)
            space.sub_shards = space._make_sub_shards()
            self.flats.append(flat)
            self.spaces.append(space)
        self.reducer.shard_params = [next(iter(s.sub_shards.values()), None) for s in self.spaces]

    def buckets_of(self, optimizer_index: int) -> list[int]:
        return [b for b, s in enumerate(self.spaces) if any(k[0] == optimizer_index for k in s.sub_shards)]

    def shard_optimizer(self, optimizer: Optimizer, optimizer_index: int) -> None:
        """Replace the groups' parameters by their shard parameters (see [Note: optimizer in place])."""
        self.original_groups[optimizer_index] = shard_optimizer_in_place(
            optimizer, optimizer_index, self.spaces
        )

    def all_gather_params(self, optimizer_index: int) -> None:
        """Every rank's updated chunk everywhere: one in-place AllGather per bucket, then wait."""
        handles = []
        for b in self.buckets_of(optimizer_index):
            own = self.spaces[b].own_chunk(self.flats[b])
            if self.masters:  # the updated fp32 master into this rank's chunk of the parameters
                own.copy_(self.spaces[b].shard)
            name = f"{self.label}/all_gather/params/bucket={b}"
            handles.append(self.comm.all_gather(self.flats[b], own, name=name))
        for handle in handles:
            handle.wait()

    def after_step(self, optimizer: Optimizer, optimizer_index: int) -> None:
        if optimizer_index not in self._checked:
            check_state_shapes(optimizer)
            self._checked.add(optimizer_index)
        for space in self.spaces:
            space.release_grads(optimizer_index)
        self.all_gather_params(optimizer_index)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        return clip_grad_norm_(optimizer, max_norm, self.comm, self.label)

    def full_state_dict(self, optimizer: Optimizer, optimizer_index: int) -> dict[str, Any]:
        """The optimizer's state for the original parameters, as a single process would have it."""
        groups = self.original_groups[optimizer_index]
        return full_optimizer_state(optimizer, optimizer_index, self.spaces, groups, self.comm, self.label)

    def load_full_state_dict(self, optimizer: Optimizer, optimizer_index: int, saved: dict[str, Any]) -> None:
        """Load a single-process optimizer state (original parameters) into this rank's shards."""
        load_full_optimizer_state(
            optimizer, optimizer_index, self.spaces, self.original_groups[optimizer_index], saved
        )


def shard_optimizer_in_place(
    optimizer: Optimizer, optimizer_index: int, spaces: Sequence[FlatParameter]
) -> list[list[Parameter]]:
    """Give each param group the sub-shards of its parameters; return the original groups' params."""
    if optimizer.state:
        raise ShardingError(f"{type(optimizer).__name__} already holds state; shard it before its first step")
    original = [list(g["params"]) for g in optimizer.param_groups]
    for gi, group in enumerate(optimizer.param_groups):
        key = (optimizer_index, gi)
        group["params"] = [s.sub_shards[key] for s in spaces if key in s.sub_shards]
    return original


def check_state_shapes(optimizer: Optimizer) -> None:
    """Sharded stages need per-element state shaped like the (sub-)shard, or scalars."""
    for shard, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != shard.shape:
                raise ShardingError(
                    f"{type(optimizer).__name__} keeps state {key!r} of shape {tuple(value.shape)} for a "
                    f"parameter shard of shape {tuple(shard.shape)}; sharded stages need per-element state "
                    "shaped like the parameter, or scalars. Use stage 0 (strategy='zero0') for this optimizer."
                )
