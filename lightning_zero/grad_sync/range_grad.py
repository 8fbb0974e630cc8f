"""Stages 1-2: a parameter's reduced gradient as a tensor of the parameter's shape.

[Note: gradients of whole parameters]
At stages 1-2 the parameters are whole but their reduced gradients are sharded: a bucket's
ReduceScatter leaves rank r one contiguous range of the bucket ([Note: flat space] in
flat_param.py), so what a rank holds of a parameter's gradient is one range of its flattening,
possibly empty. After a synchronised backward each parameter's ``.grad`` is a :class:`RangeGrad`:
a tensor of the parameter's shape, dtype and device whose values are that range, a view of the
shard gradient the optimizer's sub-shards step on. It behaves as the whole gradient DDP would
show, as DTensor does for stage 3: elementwise ops (``mul_``, ``clamp_``, ``abs``, ``isfinite``)
run on the range (in place: what the optimizer steps changes), full reductions (``norm()``,
``sum()``, ``max()``, ``all()``) reduce the ranges over the shard group and give the global value
as a plain tensor, and anything else (``clone()`` into a plain tensor of another shape, indexing,
a matmul) first gathers the whole gradient (an AllGather of the bucket's shard gradient). Reads
that reduce or gather are collectives: every rank runs them, as every rank runs Lightning's hooks.
Before the optimizer steps, a ``.grad`` the user replaced (``p.grad = p.grad * 0.5``) or dropped
(``p.grad = None``) is taken into the shard gradient (:func:`take_into_shards`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

aten = torch.ops.aten

_FULL_REDUCTIONS = {  # op -> (how the ranges combine, how a local part is made); None: as the op
    aten.sum.default: "sum",
    aten.mean.default: "mean",
    aten.max.default: "max",
    aten.min.default: "min",
    aten.amax.default: "max",
    aten.amin.default: "min",
    aten.all.default: "min",
    aten.any.default: "max",
    aten.linalg_vector_norm.default: "norm",
}


class RangeGrad(Tensor):
    """The reduced gradient of a whole parameter of which this rank holds one range (see [Note:
    gradients of whole parameters]).

    Args:
        local: this rank's range (1D), a view of the shard gradient.
        shape: the parameter's shape.
        offset: where the range starts in the parameter's flattening.
        whole: () -> the whole gradient as a plain tensor of ``shape`` (a collective).
        comm: the group the ranges are spread over (reductions).
        name: the parameter's name; with ``label``, its reductions' collectives are named
            ``zero2/at_rest/sum/grad=blocks.0.fc.weight``.
        label: prefix of the collectives' names.
        dtype: the dtype it shows (the parameter's: under a mixed-precision policy the range is the
            fp32 shard gradient the optimizer steps, the parameter bf16); ``local``'s by default.
    """

    local: Tensor
    offset: int
    whole: Any
    comm: Any
    param: str
    label: str

    @staticmethod
    def __new__(
        cls,
        local: Tensor,
        shape: torch.Size,
        offset: int,
        whole: Any,
        comm: Any,
        name: str,
        label: str,
        dtype: torch.dtype | None = None,
    ) -> RangeGrad:
        out = Tensor._make_wrapper_subclass(cls, shape, dtype=dtype or local.dtype, device=local.device)
        out.local, out.offset, out.whole, out.comm, out.param, out.label = (
            local,
            offset,
            whole,
            comm,
            name,
            label,
        )
        return out

    @property
    def _local_tensor(self) -> Tensor:
        """This rank's part, under the name DTensor gives it (what memory reports and clipping read)."""
        return self.local

    def __repr__(self) -> str:
        return (
            f"RangeGrad(elements {self.offset}..{self.offset + self.local.numel()} of "
            f"{tuple(self.shape)}: {self.local})"
        )

    def _like(self, local: Tensor) -> RangeGrad:
        dtype = self.dtype if local.dtype == self.local.dtype else local.dtype
        return RangeGrad(local, self.shape, self.offset, self.whole, self.comm, self.param, self.label, dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        grads = [t for t in leaves if isinstance(t, RangeGrad)]
        first = grads[0]
        if func in (aten.detach.default, aten.alias.default):
            return first._like(first.local.detach())
        if func in _FULL_REDUCTIONS and _no_dims(args, kwargs):
            return _reduce(func, first, args, kwargs)
        if torch.Tag.pointwise in func.tags and _same_layout(leaves, first):
            locals_ = [t.local if isinstance(t, RangeGrad) else t for t in leaves]
            args_, kwargs_ = tree_unflatten(locals_, spec)
            out = func(*args_, **kwargs_)
            if func._schema.is_mutable:
                return args[0]
            return first._like(out) if isinstance(out, Tensor) and out.shape == first.local.shape else out
        if func is aten.copy_.default and isinstance(args[0], RangeGrad):
            source = args[1]
            part = source.local if isinstance(source, RangeGrad) else _range_of(source, args[0])
            args[0].local.copy_(part)
            return args[0]
        if func in (aten.clone.default, aten._to_copy.default) and _keeps_layout(kwargs):
            return first._like(func(first.local, **kwargs))
        plain = tree_map_only(RangeGrad, lambda t: t.whole().to(t.dtype), (args, kwargs))
        return func(*plain[0], **plain[1])


def _no_dims(args: tuple, kwargs: dict) -> bool:
    """The reduction covers every element (no ``dim`` given, or every dim)."""
    dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
    return dim is None or dim == [] or dim == ()


def _same_layout(leaves: list, first: RangeGrad) -> bool:
    """Every tensor operand is a RangeGrad over the same range, or a scalar."""
    for t in leaves:
        if isinstance(t, RangeGrad):
            if t.offset != first.offset or t.local.numel() != first.local.numel() or t.shape != first.shape:
                return False
        elif isinstance(t, Tensor) and t.dim() > 0:
            return False
    return True


def _keeps_layout(kwargs: dict) -> bool:
    """A copy that changes at most dtype (and not the device or layout)."""
    return all(k in ("dtype", "memory_format") for k in kwargs)


def _range_of(whole: Tensor, like: RangeGrad) -> Tensor:
    return whole.reshape(-1)[like.offset : like.offset + like.local.numel()].to(like.local.dtype)


def _reduce(func: Any, grad: RangeGrad, args: tuple, kwargs: dict) -> Tensor:
    """A reduction over every element: this rank's range reduced, then combined over the group."""
    how = _FULL_REDUCTIONS[func]
    local = grad.local
    name = f"{func.__name__.split('.')[0]}/grad={grad.param}"
    if how == "norm":
        ord = kwargs.get("ord", args[1] if len(args) > 1 else 2)
        if ord in (math.inf, -math.inf):
            part = local.abs().amax() if local.numel() else local.new_zeros(())
            if ord == -math.inf:
                part = local.abs().amin() if local.numel() else local.new_full((), math.inf)
            return _combine(grad, part.float(), "max" if ord == math.inf else "min", name).to(grad.dtype)
        part = local.float().abs().pow(ord).sum()
        return _combine(grad, part, "sum", name).pow(1.0 / ord).to(grad.dtype)
    if how in ("sum", "mean"):
        part = local.sum(dtype=torch.float64 if local.is_floating_point() else None)
        total = _combine(grad, part, "sum", name)
        out = total / grad.numel() if how == "mean" else total
        return out.to(kwargs.get("dtype") or grad.dtype)
    empty = {"max": -math.inf, "min": math.inf}[how]
    if local.numel():
        part = func(local).to(torch.float64)
    else:
        part = torch.full((), empty, dtype=torch.float64, device=local.device)
    out = _combine(grad, part, how, name)
    return out.to(torch.bool) if func in (aten.all.default, aten.any.default) else out.to(grad.dtype)


def _combine(grad: RangeGrad, part: Tensor, op: str, what: str) -> Tensor:
    part = part.clone()
    grad.comm.all_reduce(part, name=f"{grad.label}/at_rest/{what}", async_op=False, op=op)
    return part


def take_into_shards(space: Any, params: list, subs: dict[int, list]) -> None:
    """Before an optimizer step: what the user made of each parameter's ``.grad`` since backward
    becomes what its sub-shards step (see [Note: gradients of whole parameters]): a RangeGrad over
    other storage is copied in, a plain whole tensor gives its range, None drops the sub-shards'."""
    for i, p in enumerate(params):
        grad = p.grad
        start, stop, offset = space.slices[i]
        for sub in subs.get(i, ()):
            if grad is None:
                sub.grad = None
            elif sub.grad is None:
                continue
            elif isinstance(grad, RangeGrad):
                if grad.local.data_ptr() != sub.grad.data_ptr() or grad.local.numel() != sub.grad.numel():
                    sub.grad.copy_(grad.local)
            else:
                sub.grad.copy_(grad.reshape(-1)[offset : offset + stop - start])
