"""ShardedUnit: one stage-3 wrap unit, its flat parameter gathered or sharded, its gradient reduction.

[Note: gathered and sharded]
Between uses a unit holds only ``param_shard`` (1D, padded_numel / N): this rank's slice of the
unit's flat parameter, in the parameters' dtype; the optimizer steps ``flat.shard``, the same
tensor or an fp32 master (see [Note: mixed precision]). To run, the unit resizes the storage of
``full`` (1D, padded_numel) back, all-gathers the shards into it and points each original
parameter's ``.data`` at its view of ``full``; so ``self.fc.weight`` works unchanged in forward.
To free, the parameters point at an empty placeholder and the storage of ``full`` is resized to
zero, which releases it even while autograd still holds views of it; the unit gathers into the
same storage again before its backward, so those views see the values again. Nothing may hold a
view of ``full`` while it is freed (reading one would read released memory): the parameters
always move to the placeholder first, and a gather still in flight is waited before any free.

[Note: unit states]
Each unit is in one training state (as FSDP keeps one per parameter group), and the schedule in
``sharded_module.py`` reads it instead of guessing from the order of hooks:

    IDLE --pre-forward--> FORWARD --post-forward--> IDLE --pre-backward--> PRE_BACKWARD
         --all its gradients accumulated--> POST_BACKWARD --end of backward--> IDLE

Whether the parameters are gathered is separate: ``gathered`` (a complete ``full``), or a gather in
flight (``gather_handle``), or sharded. A unit in PRE_BACKWARD stays gathered until its gradients
went out, even when activation checkpointing runs its forward again in the middle of its backward.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_zero.comm import Communicator, Handle
from lightning_zero.zero.flat_param import FlatParameter

# [Note: sharded parameters]
# While its unit is sharded a parameter's class is a subclass of its own whose __torch_function__
# lets through only what describes the tensor (shape, dtype, device, requires_grad, .grad, .data,
# numel, storage) and raises, naming the parameter, for anything that would compute with it: a
# penalty over self.parameters() or a weight norm outside the unit's forward fails at once instead of
# summing empty placeholders. Gathering gives the parameter its own class back, so forward and
# backward run on plain parameters at no cost.
_DESCRIBE = {
    getattr(getattr(torch.Tensor, name), accessor)
    for name in (
        "shape",
        "dtype",
        "device",
        "requires_grad",
        "grad",
        "data",
        "is_leaf",
        "layout",
        "ndim",
        "grad_fn",
    )
    for accessor in ("__get__", "__set__")
    if hasattr(getattr(torch.Tensor, name), accessor)
} | {
    getattr(torch.Tensor, name)
    for name in (
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "is_floating_point",
        "is_complex",
        "untyped_storage",
        "data_ptr",
        "is_contiguous",
        "requires_grad_",
        "__repr__",
        "__hash__",
        "__format__",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "__reduce_ex__",
    )
}


class _Sharded:
    """Mixed into a parameter's class while it is sharded (see [Note: sharded parameters])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _DESCRIBE or torch.compiler.is_compiling():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        used = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, _Sharded))
        raise RuntimeError(
            f"stage 3: parameter {getattr(used, '_zero_name', '?')!r} is sharded here (this rank holds a 1/N "
            f"slice of it; its wrap unit is gathered only for its own forward and backward), so "
            f"{getattr(func, '__name__', func)} cannot compute with it. Read or use parameters outside their "
            "unit's forward (a penalty over self.parameters(), a weight norm) inside `with "
            "trainer.strategy.gathered():` on every rank (a penalty's gradients then reach them), or leave that "
            "module out of the wrap policy so that it belongs to the root unit, gathered for the whole step."
        )


@functools.cache
def _sharded_class(cls: type) -> type:
    return type(f"Sharded{cls.__name__}", (_Sharded, cls), {"_zero_base": cls})


def _mark_sharded(p: nn.Parameter) -> None:
    if not isinstance(p, _Sharded):
        p.__class__ = _sharded_class(type(p))


def _mark_whole(p: nn.Parameter) -> None:
    if isinstance(p, _Sharded):
        p.__class__ = type(p)._zero_base


class TrainingState(Enum):
    IDLE = "idle"  # between uses (sharded, or kept gathered from forward into backward)
    FORWARD = "forward"  # its forward is running
    PRE_BACKWARD = "pre_backward"  # its backward began: gathered, gradients arriving
    POST_BACKWARD = "post_backward"  # its gradients went out; done for this backward


class GatherMeter:
    """Bytes of full parameters held gathered right now, and the most held at once since a reset."""

    def __init__(self) -> None:
        self.now = 0  # bytes gathered (storage resized up) at this moment
        self.peak = 0  # the most at once since reset()

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def reset(self) -> None:
        self.peak = self.now


class ShardedUnit:
    """One wrap unit: its flat parameter, gathered or sharded, and its backward bookkeeping.

    Args:
        name: the module path ("" for the root).
        module: the wrapped module.
        params: (name, parameter) of the trainable parameters the unit owns, layout order.
        comm: collectives.
        label: prefix of the collectives' names.
        masters: id(parameter) -> fp32 master value under a mixed-precision policy, or None.
        reduce_dtype: gradients on the wire; None: the parameters' own dtype.
        meter: counts the bytes gathered, shared by the units of one model.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[tuple[str, nn.Parameter]],
        comm: Communicator,
        label: str,
        *,
        masters: dict[int, Tensor] | None = None,
        reduce_dtype: torch.dtype | None = None,
        meter: GatherMeter | None = None,
    ) -> None:
        self.name = name or "root"  # module path; "root" for the whole model
        self.module = module  # the wrapped module
        self.names = [n for n, _ in params]  # parameter names (relative to the root), layout order
        for n, p in params:
            p._zero_name = n  # named in the error for computing with it while sharded
        self.comm = comm
        self.label = label
        _check_uniform(self.name, params)
        self.flat = FlatParameter(
            self.name, [p for _, p in params], torch.empty(0), world_size=comm.world_size, rank=comm.rank
        )
        full = self.flat.full_from_params()  # 1D, padded_numel: storage reused for every gather
        self.param_shard = self.flat.own_chunk(full).clone()  # 1D, S, param dtype: what gathers read
        # the optimizer's values: the same tensor, or an fp32 master (see [Note: mixed precision])
        self.flat.shard = self.flat.master_shard(masters) if masters else self.param_shard
        self.full = full
        self.views = [full[o : o + s.numel()].view(s) for o, s in zip(self.flat.offsets, self.flat.shapes)]
        self.placeholder = torch.empty(0, dtype=full.dtype, device=full.device)  # .data while sharded
        self.reduce_dtype = reduce_dtype or full.dtype  # gradients on the wire
        self.meter: GatherMeter | None = None  # shared gathered-bytes count (set once sharded)
        self.state = TrainingState.IDLE  # see [Note: unit states]
        self.gathered = False  # params point into a complete `full`
        self.gather_handle: Handle | None = None  # in-flight AllGather
        self.pinned = False  # kept gathered until the end of backward (see ZeroThree.gathered)
        self.pending = len(self.params)  # parameters whose gradient is not yet accumulated this backward
        self.used = [False] * len(self.params)  # got a gradient in this backward (this rank)
        self.reduce_handle: Handle | None = None  # in-flight ReduceScatter
        self.reduce_in: Tensor | None = None  # 1D, padded_numel: its input, kept alive until done
        self.reduce_out: Tensor | None = None  # 1D, shard_numel: its output
        self.reshard(force=True)
        self.meter = meter

    @property
    def params(self) -> list[nn.Parameter]:
        return self.flat.params

    @property
    def busy(self) -> bool:
        """A collective of this unit is in flight."""
        return self.gather_handle is not None or self.reduce_handle is not None

    def after_step(self) -> None:
        """Copy the stepped master shard into the shard the next gather reads."""
        assert self.gather_handle is None, (
            f"unit {self.name}: a gather is in flight across the optimizer step"
        )
        if self.param_shard is not self.flat.shard:
            with torch.no_grad():
                self.param_shard.copy_(self.flat.shard)

    # -- gather and free -----------------------------------------------------------------------

    def gather(self, *, wait: bool = True) -> None:
        """Start (and by default finish) the AllGather that makes the parameters usable."""
        if not self.gathered and self.gather_handle is None:
            storage = self.full.untyped_storage()
            storage.resize_(self.full.numel() * self.full.element_size())
            self._count(storage.nbytes())
            name = f"{self.label}/all_gather/unit={self.name}"
            self.gather_handle = self.comm.all_gather(self.full, self.param_shard, name=name)
        if wait:
            self.finish_gather()

    def finish_gather(self) -> None:
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None
            for p, view in zip(self.params, self.views):
                _mark_whole(p)
                p.data = view
            self.gathered = True

    def reshard(self, *, force: bool = False) -> None:
        """Free the full parameters (see [Note: gathered and sharded]); a pinned unit stays unless forced."""
        if self.pinned and not force:
            return
        self.pinned = False
        self.finish_gather()
        for p in self.params:
            p.data = self.placeholder
            _mark_sharded(p)
        self._free_full()

    def release(self, *, wait: bool = True) -> None:
        """Teardown: the parameters hold values of their own now (no view of ``full``, or their
        placeholders after a failure, when nothing is waited); free it."""
        if self.gather_handle is not None and wait:
            self.gather_handle.wait()
        self.gather_handle = None
        for p in self.params:
            _mark_whole(p)
        self._free_full()

    def _free_full(self) -> None:
        storage = self.full.untyped_storage()
        self._count(-storage.nbytes())
        storage.resize_(0)
        self.gathered = False

    def _count(self, nbytes: int) -> None:
        if self.meter is not None:
            self.meter.add(nbytes)

    # -- gradients -----------------------------------------------------------------------------

    def note_grad(self, position: int) -> bool:
        """Parameter ``position`` accumulated its gradient; True once the unit's last one did."""
        self.used[position] = True
        self.pending -= 1
        return self.pending == 0

    def reduce_scatter(self) -> None:
        """Copy the unit's gradients into a flat buffer, free them, start the ReduceScatter."""
        flat = torch.zeros(self.flat.padded_numel, dtype=self.reduce_dtype, device=self.full.device)
        for p, offset in zip(self.params, self.flat.offsets):
            if p.grad is not None:
                flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        flat.div_(self.comm.world_size)
        self.reduce_in = flat
        self.reduce_out = torch.empty(self.flat.shard_numel, dtype=flat.dtype, device=flat.device)
        name = f"{self.label}/reduce_scatter/unit={self.name}"
        self.reduce_handle = self.comm.reduce_scatter(self.reduce_out, flat, name=name)

    def finish_reduce(self) -> None:
        """Wait for the ReduceScatter, add its output into the shard gradient, free the buffer."""
        if self.reduce_handle is None:
            return
        self.reduce_handle.wait()
        self.flat.accumulate_grad(self.reduce_out)
        self.reduce_handle = self.reduce_in = self.reduce_out = None

    def end_backward(self) -> None:
        """Back to IDLE, ready for the next backward."""
        self.state = TrainingState.IDLE
        self.pending = len(self.params)
        self.used = [False] * len(self.params)


def _check_uniform(unit: str, params: list[tuple[str, nn.Parameter]]) -> None:
    kinds = {(p.dtype, p.device) for _, p in params}
    if len(kinds) > 1:
        listing = ", ".join(f"{n} ({p.dtype}, {p.device})" for n, p in params)
        raise ValueError(
            f"unit {unit!r} mixes dtypes or devices, which one flat parameter cannot hold: {listing}. "
            "Convert the module to one dtype and device, or wrap the differing parts as units of their own."
        )
