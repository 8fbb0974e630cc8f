"""ShardedUnit: one stage-3 wrap unit, its parameters at rest and gathered, its gradient reduction.

[Note: gathered and sharded]
Each parameter of a unit has two objects. At rest the module holds the *sharded* parameter: a
DTensor whose local tensor views this rank's rows in the unit's flat shard ([Note: parameters at
rest] in dtensor.py; [Note: row layout] in flat_param.py). That is what the user's optimizer
steps, what ``model.parameters()`` and ``model.state_dict()`` give between steps, and the only
copy of the values: no other copy is kept and nothing is ever copied back into it. To run, the
unit all-gathers the shards (cast to the compute dtype under a mixed-precision policy) into a
buffer of its own, copies them into ``full`` (the unsharded parameters' storage, parameter-major)
and puts the *unsharded* parameters (plain ``nn.Parameter`` views of ``full``, the same objects
every time) into the modules in place of the sharded ones, so ``self.fc.weight`` is a plain
tensor in forward and backward. To free, the modules get the sharded parameters back and the
storage of ``full`` is resized to zero; the views stay valid and see values again when the unit
is gathered into the same storage before its backward. A gather still in flight is waited before
any free. The unsharded parameters' gradients are the unit's own: when its backward is over they
are copied into the ReduceScatter's input (cast to the reduce dtype) and dropped, and this rank's
reduced rows become (or are added into) the sharded parameters' ``.grad`` (DTensors).

[Note: unit states]
Each unit is in one training state (as FSDP keeps one per parameter group), and the schedule in
``sharded_module.py`` reads it instead of guessing from the order of hooks:

    IDLE --pre-forward--> FORWARD --post-forward--> IDLE --pre-backward--> PRE_BACKWARD
         --its backward over--> POST_BACKWARD --end of backward--> IDLE

Whether the parameters are gathered is separate: ``gathered`` (a complete ``full``), or a gather in
flight (``gather_handle``), or sharded. A unit in PRE_BACKWARD stays gathered until its gradients
went out, even when activation checkpointing runs its forward again in the middle of its backward.

[Note: secondary shards]
With ``secondary_shard_size`` s (ZeRO++'s hpZ), a unit freed after a forward with gradients first
keeps a *secondary* copy of what it computed with: the ranks form groups of s consecutive ranks
(one node, or a divisor of it), and the rank at position j of its group keeps the rank-major rows
of the shards of ranks [j x N/s, (j+1) x N/s), cut out of ``full`` (N/s x S elements in the
compute dtype). An AllGather inside the group then lays out all N shards rank-major, as the
AllGather over all N ranks would: the unit's gather in backward runs on the node's links. The
copy is of the gathered values, never a source: the shard stays the only thing stepped and
checkpointed. It is used only while the shard is as it was when it was cut (its ``generation``),
and dropped when the unit's backward is over, at the end of backward, after an optimizer step and
on teardown, so it costs 1/s of the unit's gathered bytes per rank from the end of its forward to
its backward (counted with the gathered bytes). Values gathered in int8 stay those values: the
backward computes with exactly what the forward did.
"""

from __future__ import annotations

import weakref
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.comm import Communicator, Handle
from lightning_zero.comm.quantize import BlockLayout, Int8Reduction, WireQuantization
from lightning_zero.memory import GatherMeter
from lightning_zero.precision import PrecisionPolicy
from lightning_zero.zero.dtensor import Writes, laid_out, layout_like, local_of, sharded_param
from lightning_zero.zero.flat_param import FlatParameter

Slots = list[tuple[nn.Module, str]]  # where a parameter is registered: (module, attribute name)


class TrainingState(Enum):
    IDLE = "idle"  # between uses (sharded, or kept gathered from forward into backward)
    FORWARD = "forward"  # its forward is running
    PRE_BACKWARD = "pre_backward"  # its backward began: gathered, gradients arriving
    POST_BACKWARD = "post_backward"  # its gradients went out; done for this backward


_GRAD_GET = Tensor.grad.__get__  # compared with ==: each access makes another method-wrapper


class _ShowsTwinGrad(nn.Parameter):
    """A gathered parameter whose twin at rest holds a gradient (the last step's, until
    ``zero_grad``): reading its ``.grad`` gives that one while it has none of its own, as the
    parameter does under DDP. Given to a unit's gathered parameters only while they are in the
    modules outside its backward (see :meth:`ShardedUnit.mirror_grads`); every op runs as on a
    plain parameter."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if out is None and func == _GRAD_GET:
            return args[0]._zero_sharded.grad
        return out


def is_at_rest(p: Tensor) -> bool:
    """The parameter is a stage-3 parameter at rest (its values live in its unit's shard)."""
    return hasattr(p, "_zero_name") and hasattr(p, "placements")


class UnitFlat:
    """One flat space of a unit: its parameters of one dtype, trainable or frozen, gathered and
    freed together with the unit's other spaces (see [Note: gathered and sharded]).

    Args:
        name: the unit's name, with a suffix for a frozen space.
        params: (name, parameter), layout order; their current values are sharded.
        comm, label: collectives and their name prefix.
        mesh: the DTensor mesh of the parameters at rest ([Note: the DTensor mesh]).
        trainable: the parameters get gradients (reduce-scattered) and optimizer state.
        policy: mixed precision: a trainable space computes in ``param_dtype`` and its shard (what
            the optimizer steps) holds fp32 masters; None (or a frozen space): its own dtype.
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
        mesh: Any,
        trainable: bool,
        policy: PrecisionPolicy | None,
        device: torch.device,
        broadcast: bool,
        quantize: WireQuantization | None = None,
    ) -> None:
        self.name = name
        self.comm = comm
        self.secondary_comm = comm.secondary if comm.world_size > 1 else None  # [Note: secondary shards]
        self.secondary: Tensor | None = None  # 1D, N/s x S: the rows this rank keeps for backward
        self.secondary_of: tuple | None = None  # (the shard's generation, lossy) when it was cut
        self.label = label
        self.trainable = trainable
        self.names = [n for n, _ in params]
        self.originals = [weakref.ref(p) for _, p in params]  # the parameters the model had before
        flat = FlatParameter(
            name,
            [p for _, p in params],
            torch.empty(0),
            world_size=comm.world_size,
            rank=comm.rank,
            rows=True,
        )
        values = flat.full_from_params()  # 1D, N x S, where the parameters are
        if broadcast:  # on the device: a collective backend (NCCL) may take no host tensors
            values = values.to(device)
            comm.broadcast(values, src=0, name=f"{label}/broadcast/unit={name}")
        cast = policy if trainable else None
        self.compute_dtype = cast.param_dtype if cast is not None else values.dtype  # gathered dtype
        stored = cast.master_dtype if cast is not None else values.dtype
        flat.shard = flat.own_chunk(values).to(device=device, dtype=stored, copy=True)  # 1D, S: the values
        del values
        self.flat = flat
        self.writes = Writes()  # in-place ops on the parameters at rest (see generation)
        self.sharded = [  # at rest: DTensors over this rank's rows of the shard
            sharded_param(
                flat.local_view(i, flat.shard), mesh, shape, replicated=flat.replicated[i],
                requires_grad=trainable, name=n,
            )
            for i, (n, shape) in enumerate(zip(self.names, flat.shapes))
        ]  # fmt: skip
        flat.params = self.sharded
        self.grad_layouts: dict[torch.dtype, list] = {}  # per dtype, each gradient's (add_reduced)
        self.full = torch.empty(flat.padded_numel, dtype=self.compute_dtype, device=device)
        self.unsharded = [  # gathered: plain parameters viewing `full`, the same objects every time
            nn.Parameter(self.full[o : o + s.numel()].view(s), requires_grad=trainable)
            for o, s in zip(flat.offsets, flat.shapes)
        ]
        for u, p in zip(self.unsharded, self.sharded):
            p._zero_writes = self.writes
            u._zero_sharded = p  # checkpoints name a parameter by its sharded object
            p._zero_unsharded = u  # a gradient hook on it also goes on its gathered form
        self.full.untyped_storage().resize_(0)  # 1D, N x S: storage allocated only while gathered
        # one parameter, or one rank: the AllGather's layout is the parameters' (no copy out)
        self.direct = comm.world_size == 1 or (len(flat.shapes) == 1 and not flat.replicated[0])
        self.gather_out: Tensor | None = None  # 1D, N x S: the AllGather's output in flight
        self.gather_in: Tensor | None = None  # its input: the shard, or its cast (kept until done)
        self.gather_handle: Handle | None = None  # in-flight AllGather
        self.gathered = False  # the unsharded parameters hold the values
        self.full_version = 0  # `full`'s version counter when its gather finished
        self.version: int | None = None  # the shard's version when gathered for writing back
        self.accumulated: list[Tensor | None] | None = None  # no_sync: gradients kept in the reduce dtype
        self.count: Any = _no_count  # (bytes) -> None: the unit's meter of gathered bytes
        self.out_bytes = 0  # bytes counted for the AllGather's output in flight
        self.gather_name = ""  # the AllGather in flight's name (its fallback's stem)
        self.wire: BlockLayout | None = None  # int8 all-gathers ([Note: quantized communication])
        if (
            quantize is not None
            and quantize.weights
            and comm.world_size > 1
            and flat.shard.is_floating_point()
        ):
            self.wire = BlockLayout(flat.chunks, quantize.block)
            self.guard = quantize.guard_for(f"weights of unit {name!r}", comm)
        self.quantized = False  # the AllGather in flight sends int8 blocks
        self.incoming_lossy = False  # the AllGather in flight brings values rounded to int8 once
        self.lossy = False  # the gathered values are the shards' int8 rounding

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered parameters."""
        return self.full.numel() * self.full.element_size()

    def start_gather(self, label: str, comm: Communicator) -> None:
        """Start the AllGather (nothing if gathered or under way already)."""
        if self.gathered or self.gather_handle is not None:
            return
        self.gather_name = f"{label}/all_gather/unit={self.name}"
        if self._secondary_current():
            self._start_full(self.secondary_comm, "/secondary", self.secondary, lossy=self.secondary_of[1])
            return
        self.drop_secondary()
        shard = self.flat.shard.detach()
        if self.wire is not None and self.guard.quantize_now():
            packed, figure = self.wire.quantize(shard.view(1, -1), measure=self.guard.threshold is not None)
            self.wire.set_figures(packed, figure)
            self.gather_in = packed.view(-1)
            self.gather_out = torch.empty(
                self.comm.world_size * self.wire.nbytes, dtype=torch.uint8, device=shard.device
            )
            self.quantized = True
            self._issue_gather(comm, self.gather_out.numel(), "/int8")
            return
        self._start_full(comm)

    def _start_full(
        self, comm: Communicator, suffix: str = "", source: Tensor | None = None, *, lossy: bool = False
    ) -> None:
        """The AllGather in the compute dtype (``suffix``: "/fallback" after the guard refused int8)
        of the shard, or of ``source``: the secondary rows (``lossy``: rounded to int8 once)."""
        shard = self.flat.shard.detach() if source is None else source
        self.gather_in = shard if shard.dtype == self.compute_dtype else shard.to(self.compute_dtype)
        self.incoming_lossy = lossy
        if self.direct:
            self.full.untyped_storage().resize_(self.nbytes)
            self.gather_out = self.full
        else:
            self.gather_out = torch.empty_like(self.full, memory_format=torch.contiguous_format)
        self._issue_gather(comm, self.nbytes, suffix)

    def _issue_gather(self, comm: Communicator, out_bytes: int, suffix: str = "") -> None:
        self.out_bytes = out_bytes
        self.count(out_bytes)
        with torch.autograd._unsafe_preserve_version_counter(self.full):  # see finish_gather
            self.gather_handle = comm.all_gather(
                self.gather_out, self.gather_in, name=self.gather_name + suffix
            )

    def finish_gather(self) -> None:
        """Wait for the AllGather and lay its output out as the parameters."""
        if self.gather_handle is None:
            return
        self.gather_handle.wait()
        self.gather_handle = None
        if self.quantized:
            self._finish_quantized()
            return
        if not self.direct:  # `full` allocated, filled, then the AllGather's buffer freed
            self._fill_full(lambda: self.flat.copy_out(self.gather_out, self.full))
        self._gathered(lossy=self.incoming_lossy)

    def _fill_full(self, fill: Any) -> None:
        """Allocate `full`, ``fill()`` it, then the AllGather's output is freed."""
        self.full.untyped_storage().resize_(self.nbytes)
        self.count(self.nbytes)
        # the values autograd saved come back: not a change it must detect (as FSDP2 does)
        with torch.autograd._unsafe_preserve_version_counter(self.full):
            fill()
        self.count(-self.out_bytes)

    def _gathered(self, *, lossy: bool = False) -> None:
        self.gather_out = self.gather_in = None
        self.out_bytes = 0
        self.gathered = True
        self.lossy = lossy
        self.full_version = self.full._version  # moves only when the user writes into the parameters

    def _finish_quantized(self) -> None:
        """The int8 AllGather's output dequantized into the parameters, or, when the guard refuses
        its figures (every rank alike), dropped and gathered again in full precision."""
        self.quantized = False
        n, wire = self.comm.world_size, self.wire
        values, figures = wire.dequantize(self.gather_out.view(n, wire.nbytes))
        if not self.guard.accept(figures):
            del values
            self.count(-self.out_bytes)
            self.gather_out = self.gather_in = None
            self.out_bytes = 0
            self._start_full(self.comm, "/fallback")
            self.finish_gather()
            return
        by_rank = self.flat.shard_numel

        def fill() -> None:
            if self.direct:
                self.full.view(n, by_rank).copy_(values)
                return
            self.flat.copy_out(values.to(self.compute_dtype).view(-1), self.full)

        self._fill_full(fill)
        self._gathered(lossy=True)

    def make_exact(self) -> None:
        """``gathered()``: the user reads and writes the weights themselves there, so values
        gathered in int8 are gathered again in full precision (in place: autograd's saved views
        stay valid)."""
        self.finish_gather()
        if not (self.gathered and self.lossy):
            return
        self.count(-self.nbytes)  # counted again as the exact gather fills `full`
        self.gathered = False
        self._start_full(self.comm, "/exact")
        self.finish_gather()

    def keep_secondary(self) -> None:
        """Before a free after forward: keep this rank's secondary rows (see [Note: secondary
        shards]); the ones kept already stand while the shard is unchanged."""
        if self.secondary_comm is None or not self.gathered:
            return
        if self._secondary_current():
            return
        self.drop_secondary()
        n, flat = self.comm.world_size, self.flat
        per = n // self.secondary_comm.world_size
        first = self.secondary_comm.rank * per
        rows = [
            self.full[n * o : n * (o + c)].view(n, c)[first : first + per]
            for o, c in zip(flat.local_offsets, flat.chunks)
        ]
        self.secondary = torch.cat(rows, dim=1).view(-1)
        self.secondary_of = (self.generation(), self.lossy)
        self.count(self.secondary.numel() * self.secondary.element_size())

    def _secondary_current(self) -> bool:
        """A secondary copy is kept and the shard is as it was when the copy was cut."""
        return self.secondary is not None and self.secondary_of[0] == self.generation()

    def drop_secondary(self) -> None:
        if self.secondary is not None:
            self.count(-self.secondary.numel() * self.secondary.element_size())
        self.secondary = self.secondary_of = None

    def generation(self) -> tuple[int, int]:
        """Changes whenever the shard's values change: writes through plain tensors bump its version
        counter; writes through the parameters at rest (DTensor runs the local op below autograd,
        where no version counter moves: an optimizer step, ``p.mul_``) are counted by them."""
        return self.flat.shard._version, self.writes.count

    def mark_for_write_back(self) -> None:
        """``gathered()``: values the user writes into the gathered parameters go to the shard when
        the unit is freed, unless the shard changed meanwhile (an optimizer step)."""
        self.version = self.generation()

    def free(self) -> None:
        """Release the gathered values (writing back what ``gathered()``'s user changed)."""
        if self.gather_handle is not None:
            self.finish_gather()
        if self.version is not None and self.gathered:
            self._write_back()
        self.version = None
        self._release_storage()

    def take_written(self) -> None:
        """Before an optimizer step: values the user wrote into the gathered parameters (the root
        kept through a step, scaled between backward and the step) go into the shard, which the
        optimizer steps; the rows the user did not change stay as they are."""
        if not self.gathered or self.full._version == self.full_version:
            return
        self._copy_rows_back()
        self.full_version = self.full._version
        if self.version is not None:
            self.version = self.generation()

    def _write_back(self) -> None:
        """This rank's rows of the gathered parameters into the shard, where they differ from it
        and the shard is as it was when gathered (see :meth:`mark_for_write_back`)."""
        if self.generation() != self.version:
            return
        self._copy_rows_back()

    def _copy_rows_back(self) -> None:
        """Element by element: a value the user did not change keeps the shard's own (an fp32
        master under a bf16 gather, the exact value under an int8 one)."""
        flat = self.flat
        with torch.no_grad():
            as_gathered = self._as_gathered()
            for i, (start, stop, offset) in enumerate(flat.slices):
                held = self.full[flat.offsets[i] + offset : flat.offsets[i] + offset + stop - start]
                mine = flat.shard[start:stop]
                changed = held != as_gathered[start:stop]
                if changed.any():
                    mine.copy_(torch.where(changed, held.to(mine.dtype), mine))

    def _as_gathered(self) -> Tensor:
        """This rank's shard as its gather delivered it (1D, S, the compute dtype): cast, or
        rounded to int8 and back the same way."""
        shard = self.flat.shard.detach()
        if not self.lossy:
            return shard.to(self.compute_dtype)
        packed, _ = self.wire.quantize(shard.view(1, -1), measure=False)
        values, _ = self.wire.dequantize(packed)
        return values.view(-1).to(self.compute_dtype)

    def release(self, *, wait: bool) -> None:
        """Teardown: no gather left in flight (waited, unless after a failure)."""
        if self.gather_handle is not None:
            if wait:
                self.gather_handle.wait()
            if self.gather_out is not self.full:
                self.count(-self.out_bytes)
        self.gather_handle = self.gather_out = self.gather_in = None
        self.quantized, self.out_bytes = False, 0
        self.drop_secondary()
        self._release_storage()

    def _release_storage(self) -> None:
        storage = self.full.untyped_storage()
        self.count(-storage.nbytes())
        storage.resize_(0)
        self.gathered = False

    # -- gradients -----------------------------------------------------------------------------

    def keep_grads(self, reduce_dtype: torch.dtype) -> None:
        """``no_sync`` with unsharded accumulation: this backward's gradients join those kept in the
        reduce dtype, where it differs from the compute dtype (FSDP2's accumulated gradients);
        otherwise autograd accumulates them in place on the unsharded parameters."""
        if reduce_dtype == self.compute_dtype:
            return
        kept = self.accumulated if self.accumulated is not None else [None] * len(self.unsharded)
        for i, u in enumerate(self.unsharded):
            if u.grad is not None:
                kept[i] = u.grad.to(reduce_dtype) if kept[i] is None else kept[i].add_(u.grad)
                u.grad = None
        self.accumulated = kept

    def gradients(self) -> list[Tensor | None]:
        """The unit's whole gradients of this window (kept and fresh), the unsharded ``.grad`` dropped."""
        grads = [u.grad for u in self.unsharded]
        if self.accumulated is not None:
            grads = [
                k if g is None else g if k is None else k.add_(g) for g, k in zip(grads, self.accumulated)
            ]
            self.accumulated = None
        for u in self.unsharded:
            u.grad = None
        return grads

    def add_reduced(self, reduced: Tensor, used: list[bool] | None = None) -> list[bool]:
        """This rank's reduced rows (1D, S) as the sharded parameters' gradients: a view of
        ``reduced`` where ``.grad`` is None, else added into it (the window: [Note: gradient
        window] in flat_param.py). Returns, per parameter, whether it held a gradient before."""
        held = [p.grad is not None for p in self.sharded]
        dtype = self.flat.shard.dtype
        if reduced.dtype != dtype:
            reduced = reduced.to(dtype)
        layouts = self.grad_layouts.get(dtype)
        if layouts is None:  # once per dtype: the parameters at rest are the same objects all run
            layouts = self.grad_layouts[dtype] = [layout_like(p, dtype) for p in self.sharded]
        with torch.no_grad():
            for i, p in enumerate(self.sharded):
                part = self.flat.local_view(i, reduced)
                if held[i]:
                    local_of(p.grad).add_(part)
                else:
                    p.grad = laid_out(part, layouts[i])
        return held


class ShardedUnit:
    """One wrap unit: its flat spaces (trainable parameters, frozen ones per dtype), gathered or
    sharded together, and its backward bookkeeping.

    Args:
        name: the module path ("" for the root).
        module: the wrapped module.
        params: (name, parameter) of every parameter the unit owns, trainable and frozen.
        slots: id(parameter) -> every (module, attribute) it is registered under.
        comm: collectives.
        label: prefix of the collectives' names.
        mesh: the DTensor mesh of the parameters at rest.
        policy: mixed precision for the trainable parameters (see :class:`UnitFlat`), or None.
        reduce_dtype: gradients on the wire; None: the parameters' compute dtype.
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
        slots: dict[int, Slots],
        comm: Communicator,
        label: str,
        *,
        mesh: Any,
        policy: PrecisionPolicy | None = None,
        reduce_dtype: torch.dtype | None = None,
        meter: GatherMeter | None = None,
        buffer_meter: GatherMeter | None = None,
        device: torch.device | None = None,
        broadcast: bool = False,
        quantize: WireQuantization | None = None,
    ) -> None:
        self.name = name or "root"  # module path; "root" for the whole model
        self.module = module  # the wrapped module
        self.comm = comm
        self.label = label
        device = device if device is not None else params[0][1].device
        trainable = [(n, p) for n, p in params if p.requires_grad]
        _check_uniform(self.name, trainable)
        self.flats: list[UnitFlat] = []  # the trainable space first, then frozen ones by dtype
        options = {
            "policy": policy,
            "device": device,
            "broadcast": broadcast,
            "mesh": mesh,
            "quantize": quantize,
        }
        groups = [(self.name, trainable, True)] if trainable else []
        for dtype, frozen in _by_dtype([(n, p) for n, p in params if not p.requires_grad]).items():
            suffix = "" if dtype is None else f"-{str(dtype).split('.')[-1]}"
            groups.append((f"{self.name}/frozen{suffix}", frozen, False))
        self.slots: list[list[Slots]] = []  # per flat, per parameter: where the module holds it
        for flat_name, members, is_trainable in groups:
            self.slots.append([slots[id(p)] for _, p in members])
            self.flats.append(UnitFlat(flat_name, members, comm, label, trainable=is_trainable, **options))
        self.trainable = self.flats[0] if trainable else None  # reduce-scattered, stepped
        self.names = [n for n, _ in trainable]  # trainable parameter names (relative to the root)
        compute = self.trainable.compute_dtype if self.trainable else None
        self.reduce_dtype = reduce_dtype or compute  # on the wire
        self.state = TrainingState.IDLE  # see [Note: unit states]
        self.pinned = False  # kept gathered until the end of backward (see ZeroThree.gathered)
        self.held = False  # inside gathered(): not freed by the forward's hooks
        self.in_use = False  # the modules hold the unsharded parameters
        self.end_backward()
        self.reduce_handle: Handle | None = None  # in-flight ReduceScatter
        self.reduce_in: Tensor | None = None  # 1D, N x S: its input, kept alive until done
        self.reduce_out: Tensor | None = None  # 1D, S: its output
        self.held_before: list[bool] = []  # per trainable parameter: had a gradient before the last add
        self.grad_copies = 0  # gradients copied into a ReduceScatter's input
        self.forward_versions: list[int] | None = None  # the shards' versions its last forward saw
        self.meter = meter  # shared gathered-bytes count
        self.buffer_meter = buffer_meter  # gradient buffers of the model's units alive, now and at most
        self.wire: BlockLayout | None = None  # int8 gradient reductions ([Note: quantized communication])
        self.int8: Int8Reduction | None = None
        if quantize is not None and quantize.grads and comm.world_size > 1 and self.trainable is not None:
            self.wire = BlockLayout(self.trainable.flat.chunks, quantize.block)
            self.guard = quantize.guard_for(f"gradients of unit {self.name!r}", comm)
            self.int8 = Int8Reduction(self.wire, self.guard)
        for flat in self.flats:
            flat.count = self._count
        self._swap(sharded=True)

    @property
    def flat(self) -> FlatParameter | None:
        """The trainable flat space (the optimizer's), None for a unit of frozen parameters only."""
        return self.trainable.flat if self.trainable is not None else None

    @property
    def params(self) -> list[nn.Parameter]:
        """The trainable parameters as gathered (their gradient hooks drive the backward)."""
        return self.trainable.unsharded if self.trainable is not None else []

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
        return [f.flat.shard for f in self.flats]

    # -- gather and free -----------------------------------------------------------------------

    def gather(self, *, wait: bool = True) -> None:
        """Start (and by default finish) the AllGathers; finished, the modules hold the unsharded
        parameters."""
        for flat in self.flats:
            flat.start_gather(self.label, self.comm)
        if wait:
            self.finish_gather()

    def finish_gather(self) -> None:
        for flat in self.flats:
            flat.finish_gather()
        if self.gathered and not self.in_use:
            self._swap(sharded=False)

    def make_exact(self) -> None:
        for flat in self.flats:
            flat.make_exact()

    def keep_secondary(self) -> None:
        for flat in self.flats:
            flat.keep_secondary()

    def drop_secondary(self) -> None:
        for flat in self.flats:
            flat.drop_secondary()

    def mark_for_write_back(self) -> None:
        for flat in self.flats:
            flat.mark_for_write_back()

    def take_written(self) -> None:
        for flat in self.flats:
            flat.take_written()

    def note_forward_values(self) -> None:
        """A forward with gradients ran: its backward must see the same values (see
        :meth:`check_forward_values`)."""
        self.forward_versions = [f.generation() for f in self.flats]

    def check_forward_values(self) -> None:
        """Its backward begins: the parameters must be as its forward saw them. A change made in
        place at rest in between (a hook scaling weights, an optimizer step) would make backward
        gather the new values: refused, as autograd refuses a saved tensor changed in place."""
        versions, self.forward_versions = self.forward_versions, None
        if versions is None or versions == [f.generation() for f in self.flats]:
            return
        names = ", ".join(n for f in self.flats for n in f.names[:4])
        raise RuntimeError(
            f"stage 3: the parameters of unit {self.name!r} ({names}, ...) were changed in place after its "
            "forward and before its backward, which would compute with the new values: one of the variables "
            "needed for gradient computation has been modified by an inplace operation. Change parameters "
            "before the forward or after the optimizer step (under DDP autograd refuses this too)."
        )

    def reshard(self, *, force: bool = False) -> None:
        """The modules get the sharded parameters back and the gathered values are released (see
        [Note: gathered and sharded]); a pinned or held unit stays unless forced."""
        if (self.pinned or self.held) and not force:
            return
        self.pinned = self.held = False
        if self.in_use:
            self._swap(sharded=True)
        for flat in self.flats:
            flat.free()

    def release(self, *, wait: bool = True) -> None:
        """Teardown: the sharded parameters in the modules, nothing gathered or in flight."""
        if self.in_use:
            self._swap(sharded=True)
        for flat in self.flats:
            flat.release(wait=wait)

    def _swap(self, *, sharded: bool) -> None:
        for flat, slots in zip(self.flats, self.slots):
            params = flat.sharded if sharded else flat.unsharded
            for p, where in zip(params, slots):
                for module, attr in where:
                    module._parameters[attr] = p
        self.in_use = not sharded
        if sharded:
            self.mirror_grads(False)

    def mirror_grads(self, on: bool) -> None:
        """While the modules hold the gathered parameters outside the unit's backward, those whose
        twin at rest holds a gradient show it (see :class:`_ShowsTwinGrad`); off before backward
        accumulates into them, and when the unit is freed."""
        for flat in self.flats:
            for u, p in zip(flat.unsharded, flat.sharded):
                shows = on and p.grad is not None
                if shows != (type(u) is _ShowsTwinGrad):
                    u.__class__ = _ShowsTwinGrad if shows else nn.Parameter

    def put_whole(self, values: list[list[Tensor]]) -> None:
        """Teardown with the whole values: per flat, per parameter, a plain parameter of its own
        in every module slot (and in the flat space, for checkpoints saved after fitting)."""
        for flat, slots, whole in zip(self.flats, self.slots, values):
            for i, (value, where) in enumerate(zip(whole, slots)):
                param = nn.Parameter(value, requires_grad=flat.trainable)
                for module, attr in where:
                    module._parameters[attr] = param
                flat.flat.params[i] = param
        self.in_use = False

    def _count(self, nbytes: int) -> None:
        if self.meter is not None:
            self.meter.add(nbytes)

    # -- backward bookkeeping ------------------------------------------------------------------

    def note_grad(self, position: int) -> bool:
        """Trainable parameter ``position`` accumulated its gradient; False if it had in this round."""
        self.used[position] = True
        if self.seen[position]:
            return False
        self.seen[position] = True
        self.pending -= 1
        return True

    def new_round(self) -> None:
        """Gradients arrive after the unit's went out: another recomputed call's (see [Note: calls
        and their backward] in sharded_module.py)."""
        self.state = TrainingState.PRE_BACKWARD
        self.pending = len(self.params)
        self.seen = [False] * len(self.params)

    @property
    def has_frozen(self) -> bool:
        return any(not f.trainable for f in self.flats)

    @property
    def done(self) -> bool:
        """Its backward is over: every trainable gradient arrived and backward went through every
        followed call to its inputs (see [Note: calls and their backward] in sharded_module.py)."""
        return self.pending == 0 and self.inputs_pending == 0

    def end_backward(self) -> None:
        """Back to IDLE, ready for the next backward."""
        self.state = TrainingState.IDLE
        self.pending = len(self.params)  # trainable parameters whose gradient is not yet accumulated
        self.used = [False] * len(self.params)  # got a gradient in this backward (this rank)
        self.seen = [False] * len(self.params)  # got it in this round (see new_round)
        self.rounds = 0  # ReduceScatters issued in this backward
        self.inputs_pending = 0  # followed calls whose inputs' gradients are still to come
        self.nograd_calls = 0  # calls without gradients (reentrant checkpointing recomputes them)

    # -- gradients -----------------------------------------------------------------------------

    def keep_grads(self) -> None:
        """``no_sync`` with unsharded accumulation: see :meth:`UnitFlat.keep_grads`."""
        if self.trainable is not None:
            self.trainable.keep_grads(self.reduce_dtype)

    def reduce_scatter(self, divide: tuple[float, float]) -> None:
        """Start the ReduceScatter of the unit's gradients: copied (cast to the reduce dtype) into
        its input in the layout of the shards, divided by ``divide[0]`` first (the rest of the
        mean, ``divide[1]``, follows the reduction: see ``gradient_divisors``)."""
        space = self.trainable
        grads = space.gradients()
        buffer = torch.empty(space.flat.padded_numel, dtype=self.reduce_dtype, device=space.full.device)
        self._count_buffer(buffer.numel() * buffer.element_size())
        space.flat.scatter_into(grads, buffer)
        self.grad_copies += sum(g is not None for g in grads)
        del grads
        if divide[0] != 1:
            buffer.div_(divide[0])
        self.divide_after = divide[1]
        self.reduce_in = buffer
        self.reduce_out = torch.empty(space.flat.shard_numel, dtype=buffer.dtype, device=buffer.device)
        name = f"{self.label}/reduce_scatter/unit={self.name}"
        if self.int8 is not None and self.guard.quantize_now():
            self.reduce_handle = self.int8.start(self.comm, buffer, name)
            self._count_buffer(self.int8.nbytes)
            return
        self.reduce_handle = self.comm.reduce_scatter(self.reduce_out, buffer, name=name, scratch_input=True)

    def _count_buffer(self, nbytes: int) -> None:
        if self.buffer_meter is not None:
            self.buffer_meter.add(nbytes)

    def finish_reduce(self) -> None:
        """Wait for the ReduceScatter, hand its output to the sharded parameters' gradients, free
        the input buffer."""
        if self.reduce_handle is None:
            return
        self.reduce_handle.wait()
        if self.int8 is not None and self.int8.nbytes:  # an int8 reduction was in flight
            self._count_buffer(-self.int8.nbytes)
            self.int8.finish(self.comm, self.reduce_out, self.reduce_in)
        out = self.reduce_out
        if self.comm.replicate is not None:  # hybrid: the group's shard summed over the replicas
            name = f"{self.label}/all_reduce/unit={self.name}/replicas"
            self.comm.replicate.all_reduce(out, name=name, async_op=False)
        if out.dtype != self.trainable.flat.shard.dtype:
            out = out.to(self.trainable.flat.shard.dtype)
        if self.divide_after != 1:
            out.div_(self.divide_after)
        self.held_before = self.trainable.add_reduced(out)
        self._count_buffer(-self.reduce_in.numel() * self.reduce_in.element_size())
        self.reduce_handle = self.reduce_in = self.reduce_out = None

    def drop_unused(self, used: list[bool]) -> None:
        """After the reduction: a parameter no rank used in this backward, and that had no gradient
        from earlier in the window, keeps ``.grad = None`` (the optimizer skips it)."""
        for p, was_used, held in zip(self.trainable.sharded, used, self.held_before):
            if not was_used and not held:
                p.grad = None

    def drop_reduce(self) -> None:
        """Abort: forget a finished ReduceScatter without adding it into the gradients."""
        self._count_buffer(-self.reduce_in.numel() * self.reduce_in.element_size())
        if self.int8 is not None and self.int8.nbytes:
            self._count_buffer(-self.int8.nbytes)
            self.int8.drop()
        self.reduce_handle = self.reduce_in = self.reduce_out = None

    def drop_grad_buffer(self) -> None:
        """Abort: the gradients of a backward that raised are dropped."""
        if self.trainable is not None:
            self.trainable.gradients()


def _no_count(nbytes: int) -> None:
    pass


def gradient_divisors(wire_dtype: torch.dtype, mean_over: int) -> tuple[float, float]:
    """How the mean over ``mean_over`` ranks is taken: (before the reduction, after it). In fp32
    all before (as DDP divides each bucket); in a 16-bit dtype split about sqrt(N), as FSDP does,
    so that small gradients do not underflow before the sum nor large ones overflow in it."""
    if wire_dtype not in (torch.bfloat16, torch.float16) or mean_over == 1:
        return float(mean_over), 1.0
    before = 1
    while mean_over % (before * 2) == 0 and mean_over / (before * 2) >= before * 2:
        before *= 2
    return float(before), mean_over / before


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
