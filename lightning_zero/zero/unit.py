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
import weakref
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_zero.comm import Communicator, Handle
from lightning_zero.memory import GatherMeter
from lightning_zero.precision import PrecisionPolicy
from lightning_zero.zero.flat_param import FlatParameter

# [Note: parameters at rest]
# While its unit is sharded a parameter is "at rest": its class is a subclass of its own, and its
# ``.data`` a tensor of the parameter's full shape, dtype and device whose storage holds no bytes.
# What describes the tensor (shape, numel, dtype, device, requires_grad, .grad, hooks) answers as
# for the whole parameter, so ModelSummary and code counting parameters see the model as it is. Any
# other use (``p.detach()``, ``p.norm()``, ``p.clone()``, ``p.data``, ``p.mul_(...)``, a penalty over
# ``self.parameters()``) first gathers the parameter's unit (an AllGather on every rank: code that
# reads parameters at rest runs on every rank, as it does for FSDP2's reductions and for
# ``gathered()``) and then runs on the whole parameter, so it gives the values plain training
# gives. The unit stays gathered for a while so that a loop over the parameters costs one gather
# per unit (see [Note: gathered at rest] in sharded_module.py). Gathering gives the parameter its
# own class back, so forward and backward run on plain parameters at no cost.
_PROPERTIES = (  # what a tensor is, not what it holds
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "layout", "ndim", "grad_fn",
    "is_meta", "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_nested", "itemsize", "nbytes", "_version",
)  # fmt: skip
_METHODS = (
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "untyped_storage",
    "data_ptr", "is_contiguous", "requires_grad_", "__repr__", "__hash__", "__format__",
    "register_hook", "register_post_accumulate_grad_hook", "get_device",
)  # fmt: skip
_DESCRIBE = {
    getattr(getattr(torch.Tensor, name), accessor)
    for name in _PROPERTIES
    if hasattr(torch.Tensor, name)
    for accessor in ("__get__", "__set__")
    if hasattr(getattr(torch.Tensor, name), accessor)
} | {getattr(torch.Tensor, name) for name in _METHODS}
_DESCRIBE.add(torch.Tensor.data.__set__)  # the unit points the parameter at its gathered view
_DESCRIBE.add(torch._has_compatible_shallow_copy_type)  # asked by Module._apply before it sets .data
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}  # Module.to / .cpu() on a sharded module


class _Sharded:
    """Mixed into a parameter's class while it is at rest (see [Note: parameters at rest])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _DESCRIBE or torch.compiler.is_compiling():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _MOVES and isinstance(args[0], _Sharded):
            with torch._C.DisableTorchFunctionSubclass():
                moved = func(torch.empty(0, dtype=args[0].dtype, device=args[0].device), *args[1:], **kwargs)
            if moved.dtype == args[0].dtype:  # where it lives, not what it holds (Module.to, .cpu())
                if moved.device == args[0].device:
                    return args[0]
                return rest_tensor(args[0].shape, moved.dtype, moved.device).as_subclass(
                    _sharded_class(Tensor)
                )
        used = [t for t in tree_leaves((args, kwargs)) if isinstance(t, _Sharded)]
        owners: dict[int, tuple[Any, list]] = {}
        for unit in {id(u): u for u in map(_unit_of, used) if u is not None}.values():
            if unit.on_touch is not None:
                owners.setdefault(id(unit.on_touch.__self__), (unit.on_touch, []))[1].append(unit)
        for touch, units in owners.values():
            touch(units)
        still = [t for t in used if isinstance(t, _Sharded)]
        if still:
            raise RuntimeError(
                f"stage 3: {getattr(still[0], '_zero_name', 'a parameter moved while sharded')!r} holds no values "
                f"here, so {getattr(func, '__name__', func)} cannot compute with it: its unit cannot be gathered "
                "now (training ended after a failure), or it is the empty stand-in a sharded parameter gives when "
                "moved to another device (use p.detach().to(device), which gathers first)."
            )
        return func(*args, **kwargs)


def _unit_of(p: Tensor) -> Any:
    unit = getattr(p, "_zero_unit", None)
    return unit() if unit is not None else None


def rest_tensor(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``shape`` whose storage holds no bytes: a parameter's ``.data`` at rest."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


@functools.cache
def _sharded_class(cls: type) -> type:
    return type(f"Sharded{cls.__name__}", (_Sharded, cls), {"_zero_base": cls})


def _mark_sharded(p: nn.Parameter) -> None:
    if not isinstance(p, _Sharded):
        p.__class__ = _sharded_class(type(p))


def _mark_whole(p: nn.Parameter) -> None:
    if isinstance(p, _Sharded):
        p.__class__ = type(p)._zero_base


def is_at_rest(p: Tensor) -> bool:
    """The parameter is sharded now: its values live in its unit's shards."""
    return isinstance(p, _Sharded)


class TrainingState(Enum):
    IDLE = "idle"  # between uses (sharded, or kept gathered from forward into backward)
    FORWARD = "forward"  # its forward is running
    PRE_BACKWARD = "pre_backward"  # its backward began: gathered, gradients arriving
    POST_BACKWARD = "post_backward"  # its gradients went out; done for this backward


class UnitFlat:
    """One flat space of a unit: its parameters of one dtype, trainable or frozen, gathered and
    freed together with the unit's other spaces (see [Note: gathered and sharded]).

    Args:
        name: the unit's name, with a suffix for a frozen space.
        params: (name, parameter), layout order; their current values are sharded.
        comm, label: collectives and their name prefix.
        trainable: the parameters get gradients (reduce-scattered) and optimizer state.
        policy: mixed precision: a trainable space computes in ``param_dtype`` and the optimizer
            steps an fp32 master shard; None (or a frozen space): the parameters' own dtype.
        device: where the shard and the gathered parameters live; the values may sit elsewhere
            (the host: only this rank's shard is moved).
        broadcast: take rank 0's values (a model built on every rank); False when every rank
            computed the same values (deferred initialisation).
    """

    def __init__(
        self,
        name: str,
        params: list[tuple[str, nn.Parameter]],
        comm: Communicator,
        label: str,
        *,
        trainable: bool,
        policy: PrecisionPolicy | None,
        device: torch.device,
        broadcast: bool,
    ) -> None:
        self.name = name
        self.trainable = trainable
        self.flat = FlatParameter(
            name, [p for _, p in params], torch.empty(0), world_size=comm.world_size, rank=comm.rank
        )
        values = self.flat.full_from_params()  # 1D, padded_numel, where the parameters are
        if broadcast:  # on the device: a collective backend (NCCL) may take no host tensors
            values = values.to(device)
            comm.broadcast(values, src=0, name=f"{label}/broadcast/unit={name}")
        own = self.flat.own_chunk(values)
        cast = policy if trainable else None
        dtype = cast.param_dtype if cast is not None else own.dtype
        self.param_shard = own.to(device=device, dtype=dtype, copy=True)  # 1D, S: what gathers read
        # the optimizer's values: the same tensor, or an fp32 master (see [Note: mixed precision])
        masters = own.to(device=device, dtype=cast.master_dtype, copy=True) if cast is not None else None
        self.flat.shard = masters if masters is not None else self.param_shard
        del values, own
        self.full = torch.empty(self.flat.padded_numel, dtype=self.param_shard.dtype, device=device)
        self.views = [
            self.full[o : o + s.numel()].view(s) for o, s in zip(self.flat.offsets, self.flat.shapes)
        ]
        self.full.untyped_storage().resize_(0)  # 1D, padded_numel: storage allocated only while gathered
        self.rests = [  # each parameter's .data at rest: its shape, no bytes (see [Note: parameters at rest])
            rest_tensor(shape, self.full.dtype, device) for shape in self.flat.shapes
        ]
        self.gather_handle: Handle | None = None  # in-flight AllGather
        self.gathered = False  # params point into a complete `full` (or `rest_buffer`)
        self.rest_buffer: Tensor | None = None  # 1D, padded_numel: values gathered at rest, else None
        self.touched = False  # user code used the parameters while gathered: take back in-place changes

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered parameters."""
        return self.full.numel() * self.full.element_size()

    def start_gather(self, label: str, comm: Communicator) -> int:
        """Allocate ``full`` and start the AllGather; the bytes allocated (0 if under way already)."""
        if self.gathered or self.gather_handle is not None:
            return 0
        self.full.untyped_storage().resize_(self.nbytes)
        self.gather_handle = comm.all_gather(
            self.full, self.param_shard, name=f"{label}/all_gather/unit={self.name}"
        )
        return self.nbytes

    def finish_gather(self) -> None:
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None
            for p, view in zip(self.flat.params, self.views):
                _mark_whole(p)
                p.data = view
            self.gathered = True

    def gather_at_rest(self, label: str, comm: Communicator) -> int:
        """Gather into a buffer of its own, not ``full`` (see [Note: gathered at rest] in
        sharded_module.py): what the parameters' users keep of it stays readable after the unit is
        freed again. The bytes allocated (0 if gathered already)."""
        if self.gathered or self.gather_handle is not None:
            self.finish_gather()
            return 0
        buffer = torch.empty_like(self.full, memory_format=torch.contiguous_format)
        buffer.untyped_storage().resize_(self.nbytes)
        comm.all_gather(buffer, self.param_shard, name=f"{label}/all_gather/at_rest/unit={self.name}").wait()
        self.rest_buffer = buffer
        for p, offset, shape in zip(self.flat.params, self.flat.offsets, self.flat.shapes):
            _mark_whole(p)
            p.data = buffer[offset : offset + shape.numel()].view(shape)
        self.gathered = True
        return self.nbytes

    def free(self) -> int:
        """Point the parameters at their rest tensors, release the gathered values (taking back
        what the user changed in place, when the unit was touched); the bytes released."""
        self.finish_gather()
        values = self.rest_buffer if self.rest_buffer is not None else self.full
        if self.touched and self.gathered:
            self._take_back(values)
        self.touched = False
        for p, rest in zip(self.flat.params, self.rests):
            p.data = rest
            _mark_sharded(p)
        if self.rest_buffer is not None:  # dropped, not resized: views the user kept stay readable
            self.rest_buffer, self.gathered = None, False
            return self.nbytes
        return self._release_storage()

    def _take_back(self, values: Tensor) -> None:
        """The parameters were changed in place while gathered (``p.mul_``, ``p.data.copy_``): this
        rank's chunk of them becomes the shard (and the fp32 master) the next gather reads."""
        own = self.flat.own_chunk(values)
        if torch.equal(own, self.param_shard):
            return
        with torch.no_grad():
            self.param_shard.copy_(own)
            if self.flat.shard is not None and self.flat.shard is not self.param_shard:
                self.flat.shard.copy_(own)

    def release(self, *, wait: bool) -> int:
        """Teardown: the parameters hold values of their own; after a failure, when nothing is
        waited, empty tensors (computing with one fails on its shape, never on freed memory)."""
        if self.gather_handle is not None and wait:
            self.gather_handle.wait()
        self.gather_handle = None
        self.rest_buffer = None
        for p in self.flat.params:
            if is_at_rest(p) and p.untyped_storage().nbytes() == 0:  # no values came
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            _mark_whole(p)
        return self._release_storage()

    def _release_storage(self) -> int:
        storage = self.full.untyped_storage()
        released = storage.nbytes()
        storage.resize_(0)
        self.gathered = False
        return released


class ShardedUnit:
    """One wrap unit: its flat spaces (trainable parameters, frozen ones per dtype), gathered or
    sharded together, and its backward bookkeeping.

    Args:
        name: the module path ("" for the root).
        module: the wrapped module.
        params: (name, parameter) of every parameter the unit owns, trainable and frozen.
        comm: collectives.
        label: prefix of the collectives' names.
        policy: mixed precision for the trainable parameters (see :class:`UnitFlat`), or None.
        reduce_dtype: gradients on the wire; None: the parameters' own dtype.
        meter: counts the bytes gathered, shared by the units of one model.
        buffer_meter: counts the bytes of full-size gradient buffers (reduce-scatter inputs) alive.
        device: where shards and gathered parameters live (the parameters' own device if None).
        broadcast: take rank 0's values (False after deferred initialisation, equal everywhere).
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[tuple[str, nn.Parameter]],
        comm: Communicator,
        label: str,
        *,
        policy: PrecisionPolicy | None = None,
        reduce_dtype: torch.dtype | None = None,
        meter: GatherMeter | None = None,
        buffer_meter: GatherMeter | None = None,
        device: torch.device | None = None,
        broadcast: bool = False,
    ) -> None:
        self.name = name or "root"  # module path; "root" for the whole model
        self.module = module  # the wrapped module
        self.comm = comm
        self.label = label
        self.on_touch: Any = None  # ZeroThree.touch: gathers units whose parameters are used at rest
        for n, p in params:
            p._zero_name = n  # named in errors
            p._zero_unit = weakref.ref(self)  # who gathers it when it is used at rest
        device = device if device is not None else params[0][1].device
        trainable = [(n, p) for n, p in params if p.requires_grad]
        _check_uniform(self.name, trainable)
        self.flats: list[UnitFlat] = []  # the trainable space first, then frozen ones by dtype
        options = {"policy": policy, "device": device, "broadcast": broadcast}
        if trainable:
            self.flats.append(UnitFlat(self.name, trainable, comm, label, trainable=True, **options))
        for dtype, frozen in _by_dtype([(n, p) for n, p in params if not p.requires_grad]).items():
            frozen_name = f"{self.name}/frozen" + ("" if dtype is None else f"-{str(dtype).split('.')[-1]}")
            self.flats.append(UnitFlat(frozen_name, frozen, comm, label, trainable=False, **options))
        self.trainable = self.flats[0] if trainable else None  # reduce-scattered, stepped
        self.names = [n for n, _ in trainable]  # trainable parameter names (relative to the root)
        self.reduce_dtype = reduce_dtype or (
            self.trainable.full.dtype if self.trainable else None
        )  # on the wire
        self.state = TrainingState.IDLE  # see [Note: unit states]
        self.pinned = False  # kept gathered until the end of backward (see ZeroThree.gathered)
        self.pending = len(self.params)  # trainable parameters whose gradient is not yet accumulated
        self.used = [False] * len(self.params)  # got a gradient in this backward (this rank)
        self.inputs_pending = 0  # calls whose inputs' gradients are still to come (units with frozen weights)
        self.deferred_calls = (
            0  # calls run without gradients, to be recomputed in backward (reentrant checkpointing)
        )
        self.grad_buffer: Tensor | None = None  # 1D, padded_numel: where its gradients accumulate in backward
        self.grad_copies = 0  # gradients copied into a buffer (not accumulated there by autograd)
        self.reduce_handle: Handle | None = None  # in-flight ReduceScatter
        self.reduce_in: Tensor | None = None  # 1D, padded_numel: its input, kept alive until done
        self.reduce_out: Tensor | None = None  # 1D, shard_numel: its output
        self.meter: GatherMeter | None = None
        self.buffer_meter = buffer_meter  # gradient buffers of the model's units alive, now and at most
        self.reshard(force=True)
        self.meter = meter  # shared gathered-bytes count (set once sharded)

    @property
    def flat(self) -> FlatParameter | None:
        """The trainable flat space (the optimizer's), None for a unit of frozen parameters only."""
        return self.trainable.flat if self.trainable is not None else None

    @property
    def params(self) -> list[nn.Parameter]:
        """The trainable parameters (gradient hooks, reduce-scatter)."""
        return self.trainable.flat.params if self.trainable is not None else []

    @property
    def gathered(self) -> bool:
        return all(f.gathered for f in self.flats)

    @property
    def gather_handle(self) -> Handle | None:
        return next((f.gather_handle for f in self.flats if f.gather_handle is not None), None)

    @property
    def nbytes(self) -> int:
        """Bytes of the unit's parameters when gathered."""
        return sum(f.nbytes for f in self.flats)

    def full_tensors(self) -> list[Tensor]:
        return [f.full for f in self.flats]

    def shard_tensors(self) -> list[Tensor]:
        return [f.param_shard for f in self.flats]

    def after_step(self) -> None:
        """Copy the stepped master shard into the shard the next gather reads."""
        assert self.gather_handle is None, (
            f"unit {self.name}: a gather is in flight across the optimizer step"
        )
        flat = self.trainable
        if flat is not None and flat.param_shard is not flat.flat.shard:
            with torch.no_grad():
                flat.param_shard.copy_(flat.flat.shard)

    # -- gather and free -----------------------------------------------------------------------

    def gather_at_rest(self) -> None:
        for flat in self.flats:
            self._count(flat.gather_at_rest(self.label, self.comm))
            flat.touched = True

    def mark_touched(self) -> None:
        for flat in self.flats:
            flat.touched = True

    def gather(self, *, wait: bool = True) -> None:
        """Start (and by default finish) the AllGathers that make the parameters usable."""
        for flat in self.flats:
            self._count(flat.start_gather(self.label, self.comm))
        if wait:
            self.finish_gather()

    def finish_gather(self) -> None:
        for flat in self.flats:
            flat.finish_gather()

    def reshard(self, *, force: bool = False) -> None:
        """Free the full parameters (see [Note: gathered and sharded]); a pinned unit stays unless forced."""
        if self.pinned and not force:
            return
        self.pinned = False
        for flat in self.flats:
            self._count(-flat.free())

    def release(self, *, wait: bool = True) -> None:
        """Teardown: see :meth:`UnitFlat.release`."""
        for flat in self.flats:
            self._count(-flat.release(wait=wait))

    def _count(self, nbytes: int) -> None:
        if self.meter is not None:
            self.meter.add(nbytes)

    # -- gradients -----------------------------------------------------------------------------

    def note_grad(self, position: int) -> None:
        """Trainable parameter ``position`` accumulated its gradient."""
        self.used[position] = True
        self.pending -= 1

    @property
    def has_frozen(self) -> bool:
        return any(not f.trainable for f in self.flats)

    @property
    def done(self) -> bool:
        """Its backward is over: every trainable gradient arrived and backward went through to its
        inputs (for a unit with frozen weights, which no gradient hook tracks)."""
        return self.pending == 0 and self.inputs_pending == 0 and self.deferred_calls == 0

    def attach_grads(self) -> None:
        """Its backward begins: the trainable parameters' ``.grad`` become views of one flat buffer
        (1D, padded_numel), so autograd accumulates there and the reduce-scatter sends it as it is,
        with no copy. A buffer kept from a ``no_sync`` micro-batch is reused: a gradient cleared since
        (``zero_grad``) zeroes its slot, one replaced is copied in. Gradients of another dtype on the
        wire (``reduce_dtype``) are added in at the end instead."""
        if self.trainable is None or self.reduce_dtype != self.trainable.full.dtype:
            return
        space, buffer = self.flat, self.grad_buffer
        if buffer is None:
            buffer = torch.zeros(
                space.padded_numel, dtype=self.reduce_dtype, device=self.trainable.full.device
            )
            self._count_buffer(buffer.numel() * buffer.element_size())
            self.grad_buffer = buffer
        for p, shape, offset in zip(self.params, space.shapes, space.offsets):
            view = buffer[offset : offset + shape.numel()].view(shape)
            if p.grad is None:
                view.zero_()  # no-op work on a fresh buffer; clears a kept one
            elif not _views(p.grad, buffer, offset):  # accumulated elsewhere (set by hand, or before)
                view.copy_(p.grad)
                self.grad_copies += 1
            p.grad = view

    def reduce_scatter(self) -> None:
        """Start the ReduceScatter of the unit's gradients (the buffer they accumulated in, or a
        copy where they did not), freeing the parameters' ``.grad``."""
        space, buffer = self.flat, self.grad_buffer
        if buffer is None:
            buffer = torch.zeros(
                space.padded_numel, dtype=self.reduce_dtype, device=self.trainable.full.device
            )
            self._count_buffer(buffer.numel() * buffer.element_size())
        attached = buffer is self.grad_buffer
        for p, shape, offset in zip(self.params, space.shapes, space.offsets):
            grad, region = p.grad, buffer[offset : offset + shape.numel()]
            if grad is None:
                if attached:  # cleared after it was attached: its slot holds stale values
                    region.zero_()
            elif not _views(grad, buffer, offset):  # the unit may be freed: use the shape
                region.copy_(grad.reshape(-1))
                self.grad_copies += 1
            p.grad = None
        buffer.div_(self.comm.mean_over)
        self.reduce_in, self.grad_buffer = buffer, None
        self.reduce_out = torch.empty(space.shard_numel, dtype=buffer.dtype, device=buffer.device)
        name = f"{self.label}/reduce_scatter/unit={self.name}"
        self.reduce_handle = self.comm.reduce_scatter(self.reduce_out, buffer, name=name, scratch_input=True)

    def _count_buffer(self, nbytes: int) -> None:
        if self.buffer_meter is not None:
            self.buffer_meter.add(nbytes)

    def finish_reduce(self) -> None:
        """Wait for the ReduceScatter, add its output into the shard gradient, free the buffer."""
        if self.reduce_handle is None:
            return
        self.reduce_handle.wait()
        if self.comm.replicate is not None:  # hybrid: the group's shard summed over the replicas
            name = f"{self.label}/all_reduce/unit={self.name}/replicas"
            self.comm.replicate.all_reduce(self.reduce_out, name=name, async_op=False)
        self.flat.accumulate_grad(self.reduce_out)
        self._count_buffer(-self.reduce_in.numel() * self.reduce_in.element_size())
        self.reduce_handle = self.reduce_in = self.reduce_out = None

    def drop_reduce(self) -> None:
        """Abort: forget a finished ReduceScatter without adding it into the shard gradient."""
        self._count_buffer(-self.reduce_in.numel() * self.reduce_in.element_size())
        self.reduce_handle = self.reduce_in = self.reduce_out = None

    def drop_grad_buffer(self) -> None:
        """Abort: the gradients of a backward that raised are dropped (``.grad`` None)."""
        for p in self.params:
            p.grad = None
        if self.grad_buffer is not None:
            self._count_buffer(-self.grad_buffer.numel() * self.grad_buffer.element_size())
            self.grad_buffer = None

    def end_backward(self) -> None:
        """Back to IDLE, ready for the next backward."""
        self.state = TrainingState.IDLE
        self.pending = len(self.params)
        self.used = [False] * len(self.params)
        self.inputs_pending = 0
        self.deferred_calls = 0


def _views(grad: Tensor, buffer: Tensor, offset: int) -> bool:
    """``grad`` is the view of ``buffer`` that starts at element ``offset``."""
    return grad.data_ptr() == buffer.data_ptr() + offset * buffer.element_size()


def _by_dtype(params: list[tuple[str, nn.Parameter]]) -> dict:
    """dtype -> the parameters of that dtype (frozen spaces: one per dtype, keys None when only one)."""
    groups: dict = {}
    for n, p in params:
        groups.setdefault(p.dtype, []).append((n, p))
    return groups if len(groups) > 1 else {None: params} if params else {}


def _check_uniform(unit: str, params: list[tuple[str, nn.Parameter]]) -> None:
    kinds = {(p.dtype, p.device) for _, p in params}
    if len(kinds) > 1:
        listing = ", ".join(f"{n} ({p.dtype}, {p.device})" for n, p in params)
        raise ValueError(
            f"unit {unit!r} mixes dtypes or devices among its trainable parameters, which one flat parameter "
            f"cannot hold: {listing}. Convert the module to one dtype and device, or wrap the differing parts "
            "as units of their own."
        )
