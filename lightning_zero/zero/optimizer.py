"""Stages 1-2: parameters in flat buckets, the user's optimizer stepping on this rank's shard.

[Note: shard layout]
The parameter buckets have the layout of the gradient buckets (``BucketSpec``): one flat tensor
per bucket, padded to a multiple of N, split into N equal contiguous chunks; rank r owns chunk r
of every bucket, so shards are balanced to the element. The module's own parameters become views
into the flat tensors (``p.data`` points into them), and the sub-shards of bucket b alias slices
of chunk r (see [Note: flat space] in flat_param.py). The optimizer steps the sub-shards in place,
which updates chunk r of the model's parameters directly; an in-place AllGather per bucket then
brings every rank the other chunks. The flat tensors are owned by :class:`ShardedParams`.

[Note: optimizer in place]
The user's optimizer object is kept: each ``param_groups[i]["params"]`` list is replaced by the
sub-shards of its parameters, in the same order (parameters that take no part in training, frozen
ones, are left out: they never have a gradient); everything else in the group (lr, betas, weight
decay, what a scheduler changes) is untouched. Lightning's ``trainer.optimizers`` and the LR
schedulers therefore keep working on the same object. Its state is per sub-shard; the checkpoint
form is consolidated back to the original parameters so that a plain single process can load it.

[Note: elementwise optimizers]
Sharding an optimizer is exact only if its update of an element depends on that element's
gradient and state alone (and on scalars): then stepping each rank's slice equals stepping the
whole parameter. SGD, Adam and their kin are; LAMB and LARS (trust ratio over the whole
parameter), Adafactor (factored second moments), Shampoo, Muon and LBFGS are not. The sharded
stages accept the optimizers in :data:`ELEMENTWISE` and those a user declares with
:func:`mark_elementwise` or ``ZeroConfig.elementwise_optimizers``, and refuse any other at setup.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.grad_sync import GradReducer
from lightning_zero.grad_sync.range_grad import take_into_shards
from lightning_zero.imports import resolve_optimizer_classes  # noqa: F401  (re-exported)
from lightning_zero.zero.flat_param import (
    FlatParameter,
    clip_grad_norm_,
    full_optimizer_state,
    load_full_optimizer_state,
)

ELEMENTWISE: tuple[type, ...] = tuple(  # exact when sharded (foreach and fused variants included)
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta")
)
_DECLARED: set[type] = set()  # classes declared elementwise by users (mark_elementwise)


class ShardingError(ValueError):
    """The optimizer or model cannot be sharded; the message says why and what to use instead."""


def mark_elementwise(cls: type) -> type:
    """Declare an optimizer class elementwise (see [Note: elementwise optimizers]); usable as a
    class decorator. Its per-element state must be shaped like the parameter it belongs to."""
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(f"mark_elementwise takes a torch.optim.Optimizer subclass, got {cls!r}")
    _DECLARED.add(cls)
    return cls


def check_shardable(optimizer: Optimizer, declared: Sequence[type] = ()) -> None:
    """Refuse an optimizer that is not known to be elementwise (see [Note: elementwise optimizers])."""
    cls = type(optimizer)
    if cls in ELEMENTWISE or cls in _DECLARED or cls in declared:
        return
    base = next((b for b in ELEMENTWISE if issubclass(cls, b)), None)
    # a subclass that keeps its base's update (torch wraps step() in profiling hooks per class)
    if base is not None and inspect.unwrap(cls.step) is inspect.unwrap(base.step):
        return
    raise ShardingError(
        f"{cls.__module__}.{cls.__qualname__} is not known to be elementwise, so the sharded stages "
        "cannot split its state (an update that looks at whole parameters - trust ratios, factored or "
        "matrix-shaped state - would change). Use stage 0 (strategy='zero0') for it, or, if each element's "
        "update depends only on that element, declare it: lightning_zero.mark_elementwise(YourOptimizer) "
        "or ZeroConfig(elementwise_optimizers=['your.module.YourOptimizer'])."
    )


def shard_optimizer_in_place(
    optimizer: Optimizer, optimizer_index: int, spaces: Sequence[FlatParameter]
) -> list[list[Parameter]]:
    """Give each param group the sub-shards of its parameters (see [Note: optimizer in place]);
    return the original groups' parameters."""
    if optimizer.state:
        raise ShardingError(f"{type(optimizer).__name__} already holds state; shard it before its first step")
    where = {id(p): (space, i) for space in spaces for i, p in enumerate(space.params)}
    original = [list(g["params"]) for g in optimizer.param_groups]
    for group, params in zip(optimizer.param_groups, original):
        group["params"] = [
            where[id(p)][0].sub_shard(optimizer_index, where[id(p)][1]) for p in params if id(p) in where
        ]
    return original


class ShardedParams:
    """Stages 1-2: flat parameter buckets, this rank's shards, and the in-place optimizer wrapping.

    Args:
        reducer: the gradient reducer; its buckets define the layout (see [Note: shard layout]).
        comm: collectives for the AllGather of updated parameters and the norm AllReduce.
        masters: id(param) -> fp32 master value under a mixed-precision policy, else None.
    """

    def __init__(
        self, reducer: GradReducer, comm: Communicator, masters: dict[int, Tensor] | None = None
    ) -> None:
        self.reducer = reducer
        self.comm = comm
        self.label = reducer.label  # prefix of the collectives' names
        self.flats: list[Tensor] = []  # per bucket: 1D, padded to a multiple of N; owns the params
        self.spaces: list[FlatParameter] = []  # per bucket: layout, shard, sub-shards, shard gradient
        self.original_groups: dict[int, list[list[Parameter]]] = {}  # optimizer -> groups' params
        self._checked: set[int] = set()  # optimizers whose state shapes were checked
        self.masters = bool(masters)  # shards are separate fp32 masters (see [Note: mixed precision])
        self._views: list[tuple[Parameter, Tensor]] = []  # each parameter and its view of its bucket
        self._layout(masters or {})

    def _layout(self, masters: dict[int, Tensor]) -> None:
        for b, bucket in enumerate(self.reducer.buckets):
            space = FlatParameter(
                f"bucket={b}",
                bucket.params,
                torch.empty(0),
                world_size=self.comm.world_size,
                rank=self.comm.rank,
            )
            flat = space.full_from_params()
            with torch.no_grad():
                for p, offset in zip(bucket.params, space.offsets):
                    p.data = flat[offset : offset + p.numel()].view_as(p)
                    self._views.append((p, p.data))
            space.shard = space.master_shard(masters) if masters else space.own_chunk(flat)
            self.flats.append(flat)
            self.spaces.append(space)
        self.reducer.spaces = self.spaces

    def rebind(self) -> bool:
        """[Note: parameters assigned by hand] ``p.data = value`` (a user re-initialising or loading a
        weight by hand) makes the parameter stop viewing its bucket, so the optimizer's steps, which
        update the bucket, would no longer reach it: it would stay at the value for the rest of the
        run. Before every forward and every step the value is taken into the bucket and the
        parameter views it again, so it trains on as under DDP. Returns whether any was taken."""
        taken = False
        for p, view in self._views:
            if p.data_ptr() == view.data_ptr():
                continue
            if p.shape != view.shape:
                raise ValueError(
                    f"a parameter of shape {tuple(view.shape)} was assigned a tensor of shape {tuple(p.shape)} "
                    "(p.data = ...): its shape is fixed by the flat bucket it lives in; assign a value of "
                    "the same shape"
                )
            with torch.no_grad():
                view.copy_(p.data)
            p.data = view
            taken = True
        return taken

    def buckets_of(self, optimizer_index: int) -> list[int]:
        return [b for b, s in enumerate(self.spaces) if s.optimizer_subs(optimizer_index)]

    def shard_optimizer(self, optimizer: Optimizer, optimizer_index: int) -> None:
        """Replace the groups' parameters by their sub-shards (see [Note: optimizer in place]); its
        ``zero_grad`` also drops the parameters' reduced gradients (see [Note: gradients of whole
        parameters] in grad_sync/range_grad.py)."""
        self.original_groups[optimizer_index] = shard_optimizer_in_place(
            optimizer, optimizer_index, self.spaces
        )
        _also_on_zero_grad(optimizer, lambda: self._drop_grads(optimizer_index))

    def _drop_grads(self, optimizer_index: int) -> None:
        """``zero_grad``: the parameters' reduced gradients go, and the shard gradients no
        sub-shard holds any more are freed."""
        self.reducer.drop_reduced()
        for space in self.spaces:
            space.release_grads(optimizer_index)

    def take_user_grads(self, optimizer_index: int) -> None:
        """Before that optimizer's step: what the user made of its parameters' ``.grad`` (scaled,
        replaced, dropped) is what its sub-shards step."""
        for space in self.spaces:
            subs = {i: [sub] for i, sub in space.optimizer_subs(optimizer_index).items()}
            if subs:
                take_into_shards(space, space.params, subs)

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
        """The gradients stay until the optimizer's ``zero_grad``, as under DDP."""
        if optimizer_index not in self._checked:
            check_state_shapes(optimizer)
            self._checked.add(optimizer_index)
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


class _AlsoDropsReduced:
    """Mixed into an optimizer's class: ``zero_grad`` also drops what ``_zero_drop`` drops (through
    a wrapper that imitates the optimizer's class too, such as Fabric's, which calls the class's
    ``zero_grad`` with itself and reaches the optimizer's attributes)."""

    _zero_drop: Any  # () -> None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]
        if set_to_none:
            self._zero_drop()


@functools.cache
def _dropping(cls: type) -> type:
    # the base's names: messages, and pickle, see the user's class
    namespace = {"_zero_base": cls, "__qualname__": cls.__qualname__, "__module__": cls.__module__}
    return type(cls.__name__, (_AlsoDropsReduced, cls), namespace)


def _also_on_zero_grad(optimizer: Optimizer, drop: Any) -> None:
    """``optimizer.zero_grad()`` (set to None) also calls ``drop()``: the instance gets a class of its
    own that keeps the user's in its MRO (isinstance checks and the class's step unchanged)."""
    base = getattr(type(optimizer), "_zero_base", type(optimizer))
    optimizer.__class__ = _dropping(base)
    optimizer._zero_drop = drop


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
