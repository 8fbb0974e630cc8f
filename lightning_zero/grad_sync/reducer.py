"""GradReducer: bucketed, asynchronous gradient synchronisation driven by autograd hooks.

[Note: gradient storage]
Each bucket owns one flat tensor (1D, ``padded_numel`` elements). A parameter's ``.grad`` is a
view into its bucket's slot, attached before every training forward (``prepare_forward``), so
autograd accumulates straight into bucket storage and there is no second copy of the gradients.
If something replaced ``.grad`` (``zero_grad(set_to_none=True)`` followed by a backward before
the next forward, or user code), the ready hook copies the new tensor into the slot and points
``.grad`` back at it. The reducer owns the flat tensors; they live as long as the reducer.

[Note: same collectives everywhere]
Every rank must issue the same collectives, of the same sizes, in the same order. Buckets are
therefore launched strictly in plan order: a full bucket waits until all earlier buckets have
been launched. At the end of a synchronised backward every bucket not yet launched (one holding a
parameter that got no gradient) is launched too, before any error is raised, so a rank that
fails does not leave its peers inside an unmatched collective. The rebuilt plan after the first
step comes from rank 0's observed order, broadcast to all.

[Note: sharded gradients]
Stages 1 and 2 reduce-scatter each bucket instead of all-reducing it (bucket padded to a multiple
of N; rank r owns chunk r). Stage 1 keeps the full bucket as gradient storage, as stage 0 does, and
reduce-scatters in place: afterwards chunk r of the bucket holds rank r's summed shard, the rest of
the bucket is scratch, and the parameters' ``.grad`` are cleared. The shard gradient of bucket b
(``spaces[b].grad``, see [Note: gradient window] in zero/flat_param.py) then borrows chunk r
without a copy; before anything writes into the bucket again (the next forward's views, another
backward's gradients) the reducer gives it storage of its own (``keep_grad``), so a second
synchronised backward before the step adds to it instead of overwriting it. Stage 2 attaches no
views: the ready hook adds a parameter's fresh ``.grad`` into a bucket allocated on demand and
drops the ``.grad`` at once; the bucket is freed as soon as its reduce-scatter completed, so only
the 1/N shard gradients outlive the backward. Where the bucket starts its shard gradient's window
(nothing held: after ``zero_grad`` or the step), stage 2 reduce-scatters into new storage of a
shard's size, which becomes the shard gradient, instead of into chunk r of the bucket: on gloo that
is an exchange, half the bytes of the in-place all-reduce (see [Note: collectives in place] in
comm/inplace.py), and no copy out of the bucket. A bucket that adds to a window (a micro-batch
after the first, without ``no_sync``) reduces in place and adds its chunk.

[Note: reduce dtype]
With a ``reduce_dtype`` other than the parameters' dtype (bf16 or fp16 parameters, fp32 on the
wire), a gradient cannot be a view of its bucket. The buckets are then in ``reduce_dtype`` and the
ready hook adds each fresh ``.grad`` into its slot and drops it, as stage 2 does; stages 0 and 1
keep their buckets between steps, zeroed lazily by the first addition after the reduced values
were consumed: a slot whose consumer dropped its gradient (``consumed(i)``: the fp32 master's
``.grad`` is None after the step or ``zero_grad``) is zeroed before the next addition, every other
slot keeps adding, across micro-batches and across several synchronised backwards before a step.
Stage 0 hands the reduced bucket slots themselves to the fp32 master gradients
(``reduced_grads``), no copy.

[Note: no_sync]
Inside ``no_sync()`` the hooks only keep ``.grad`` in bucket storage and note which parameters
were used; no collective runs. The first synchronised backward after the window then reduces the
accumulated sum, because the slots were never cleared in between.

[Note: late gradients]
A parameter's hook normally fires once per backward, when its gradient is complete. Under reentrant
activation checkpointing (``use_reentrant=True``) a parameter that the checkpointed function uses
without taking it as an input (captured by the closure, ``block(x) * self.gain``) is accumulated by
every nested backward that recomputes it, and its hook fires each time: its gradient is complete
only at the end of the outermost backward. Such a parameter is *late*: its bucket is *held*, sent
only at the end of the outermost backward (the buckets after it, in plan order, wait with it), and
nothing is ever added into a bucket whose collective is in flight. The reducer learns which
parameters are late from the first synchronised backward: stages 0 and 1 send nothing before its end
(their buckets are persistent, so this costs one step's overlap and no memory; stage 0 then rebuilds
its plan with the late parameters last); stage 2, whose memory bound forbids holding every bucket,
sends as usual and keeps a gradient that arrives after its bucket was sent aside, in its own
tensor; at the end every rank learns the others' such buckets (one control collective, in that
backward only) and reduce-scatters the set-aside gradients of those buckets, added into the shard
gradients. A parameter first seen late in a later backward (the graph changed) is held from then on;
if its bucket had already been sent, this backward's gradients cannot be made right (stages 0-1:
autograd wrote into the bucket being reduced), so it raises ``LateGradientError`` naming it, after
every collective completed.

[Note: a backward that raised]
A backward that raises (an error inside it, caught by the user, training going on) never reaches
its wrap-up (see the note of that name in backward.py). The reducer notices at the next training
forward, before the next backward (Lightning's ``pre_backward``) or at the next gradient hook,
whichever comes first, and aborts: it waits for every collective the failed backward sent (every
rank raised at the same place, so they match), discards their results and resets its per-backward
state, so the next backward is a fresh one. What the failed backward accumulated is a partial
gradient, as in plain PyTorch: stage 0 leaves it in ``.grad`` (buckets already sent hold their
average over ranks) for the user's ``zero_grad`` (under a policy the optimizer steps fp32 masters,
whose ``zero_grad`` cannot reach the parameters' bucket views: there it is dropped, as if the
user had cleared it, ``drop_on_abort``); stages 1-2 drop what their buckets hold (the
parameters' ``.grad`` are bucket views no optimizer sees), while the shard gradients keep what was
handed on before, which the optimizer's ``zero_grad`` clears. Parameters marked used only by the
failed backward are unmarked (``find_unused_parameters``).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Generator, Hashable, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.utils._pytree import tree_leaves

from lightning_zero.comm import Communicator, Handle
from lightning_zero.comm.quantize import BlockLayout, Int8Reduction, WireQuantization
from lightning_zero.grad_sync.backward import EndOfBackward
from lightning_zero.grad_sync.buckets import BucketSpec, ParamInfo, _itemsize, plan_buckets
from lightning_zero.grad_sync.range_grad import RangeGrad
from lightning_zero.memory import GatherMeter


@contextmanager
def sync_suspended(sync: Any, *, honoured: bool) -> Generator[None, None, None]:
    """``no_sync`` for any stage (``sync``: a GradReducer or ZeroThree).

    ``sync.sync_enabled`` is off inside, unless the stage does not honour no_sync (it
    reduce-scatters every micro-batch so that no full gradient outlives a backward), in which case
    nothing changes. See [Note: no_sync].
    """
    if not honoured:
        yield
        return
    previous = sync.sync_enabled
    sync.sync_enabled = False
    try:
        yield
    finally:
        sync.sync_enabled = previous


class UnusedParametersError(RuntimeError):
    """A parameter that requires grad got no gradient in a synchronised backward."""


class LateGradientError(RuntimeError):
    """A parameter got more gradient after its bucket was sent (see [Note: late gradients])."""


if TYPE_CHECKING:
    from lightning_zero.zero.flat_param import FlatParameter


class Bucket:
    """Flat gradient storage for some parameters, plus its state in the current backward."""

    def __init__(
        self, index: int, spec: BucketSpec, params: Sequence[Parameter], *, persistent: bool
    ) -> None:
        self.index = index  # position in launch order
        self.spec = spec  # which parameters, at which offsets
        self.params = list(params)  # the parameters whose gradients live here, in slot order
        self.flat: Tensor | None = None  # 1D, padded_numel; None while freed (stage 2)
        self.views: list[Tensor] = []  # param-shaped views into self.flat, one per parameter
        self.pending = len(self.params)  # parameters not yet ready in this backward
        self.handle: Handle | None = None  # the in-flight collective, None when not launched
        self.shard_out: Tensor | None = None  # 1D, padded_numel / N: reduce-scatter output
        self.persistent = persistent  # storage kept between steps (stages 0-1)
        self.stale = False  # stage 1: holds a reduce-scatter's leftovers; zero before the next addition
        self.handed_on = False  # its reduced shard went into the shard gradient in this backward
        self.int8: Int8Reduction | None = None  # stages 1-2, quantize_grads: its int8 reduction
        self.held = False  # holds a late parameter: sent at the end of backward ([Note: late gradients])
        if persistent:
            self.allocate()

    def allocate(self) -> Tensor:
        """The flat storage, zero-filled when (re)allocated or stale."""
        if self.flat is None:
            self.flat = torch.zeros(self.spec.padded_numel, dtype=self.spec.dtype, device=self.spec.device)
            self.views = [
                self.flat[o : o + p.numel()].view_as(p) for o, p in zip(self.spec.offsets, self.params)
            ]
        elif self.stale:
            self.flat.zero_()
        self.stale = False
        return self.flat

    def release(self) -> None:
        """The reduced values were handed on: free the storage (stage 2), or mark it for zeroing."""
        if self.persistent:
            self.stale = True
        else:
            self.flat, self.views = None, []

    def reset(self) -> None:
        self.pending = len(self.params)
        self.handle = None
        self.shard_out = None
        self.handed_on = False
        if self.int8 is not None:
            self.int8.drop()


class GradReducer:
    """Synchronises the gradients of ``named_params`` across the ranks of ``comm``.

    Args:
        named_params: (name, parameter) pairs that require grad, each parameter once, in
            registration order.
        comm: the communicator whose ledger records every collective.
        cap_bytes: bucket cap in bytes.
        first_cap_bytes: cap of the first bucket in bytes.
        find_unused_parameters: reduce missing gradients as zeros instead of raising.
        label: prefix of the collectives' names (e.g. ``"zero0"``).
        stage: 0 all-reduces buckets; 1 and 2 reduce-scatter them (see [Note: sharded gradients]).
        keys: per parameter, an extra bucket split key (None: split by dtype and device only).
        accumulate_unsharded: stage 2 only: inside ``no_sync()`` keep full local gradients and
            reduce-scatter once per window (less traffic, more memory) instead of every micro-batch.
        reduce_dtype: dtype of the buckets (on the wire); None: the parameters' dtype (see
            [Note: reduce dtype]).
        max_reduce_buffers: stage 2: full-size buckets alive at once, the ones in flight and the
            ones filling; a bucket about to be allocated first finishes the oldest reduce-scatter
            and frees its bucket.
        quantize: stages 1-2 with ``grads``: each bucket's reduce-scatter goes as int8 chunks (see
            [Note: quantized communication] in comm/quantize.py), guarded per bucket.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, Parameter]],
        comm: Communicator,
        *,
        cap_bytes: int,
        first_cap_bytes: int,
        find_unused_parameters: bool = False,
        label: str = "zero0",
        stage: int = 0,
        keys: Sequence[Hashable] | None = None,
        accumulate_unsharded: bool = False,
        reduce_dtype: torch.dtype | None = None,
        max_reduce_buffers: int = 2,
        quantize: WireQuantization | None = None,
    ) -> None:
        self.names = [name for name, _ in named_params]  # registration index -> name
        self.params = [p for _, p in named_params]  # registration index -> parameter
        self.comm = comm
        self.cap_bytes = cap_bytes
        self.first_cap_bytes = first_cap_bytes
        self.find_unused_parameters = find_unused_parameters
        self.label = label
        self.stage = stage  # 0: all-reduce; 1, 2: reduce-scatter into shards
        self.keys = list(keys) if keys is not None else [None] * len(self.params)  # bucket split keys
        self.pad_to = comm.world_size if stage >= 1 else 1  # buckets divisible into N shards
        self.reduce_dtype = reduce_dtype  # bucket dtype; None: each parameter's own
        # gradients are views of bucket storage (stages 0-1, same dtype), else added into it
        self.attach_views = stage <= 1 and all(reduce_dtype in (None, p.dtype) for p in self.params)
        self.honours_no_sync = stage <= 1 or accumulate_unsharded  # no_sync skips the collectives
        self.on_reduced: Callable[[], None] | None = None  # called after each synchronised backward
        self.drop_on_abort = False  # stage 0 under a policy: a raised backward's gradients are dropped
        self.consumed: Callable[[int], bool] | None = None  # stage 0 added slots: consumer dropped it
        self.spaces: list[FlatParameter] | None = None  # stages 1-2: bucket -> its shard's flat space
        self.before_forward: Callable[[], Any] | None = None  # stages 1-2: parameters assigned by hand taken
        self.sync_enabled = True  # False inside no_sync()
        self.buckets: list[Bucket] = []  # in launch order
        self._slot: dict[int, tuple[Bucket, int]] = {}  # param index -> (bucket, slot in bucket)
        self._index = {id(p): i for i, p in enumerate(self.params)}  # id(param) -> index
        self._used = [False] * len(self.params)  # got a gradient since the last sync
        self._window_used = [False] * len(self.params)  # some rank used it since its gradient was consumed
        self._zeroed = [False] * len(self.params)  # stage 0 added slots: zeroed for the running window
        self._dropped: set[int] = set()  # no rank used them in the gradient window
        self._ready = [False] * len(self.params)  # got a gradient in this synced backward
        self._ready_order: list[int] = []  # indices in ready order, recorded until the rebuild
        self._rebuilt = False  # whether the plan was rebuilt from the observed order
        self._next_launch = 0  # index of the next bucket to launch
        self.max_reduce_buffers = max_reduce_buffers
        self.quantize = quantize if quantize is not None and quantize.grads and stage >= 1 else None
        self._int8_fallbacks = 0  # of buckets rebuilt since
        self._in_flight: deque[Bucket] = deque()  # stage 2: launched buckets not yet handed on, oldest first
        # stage 2: bytes of bucket storage allocated, now and at most (with quantize_grads, at stages
        # 1-2, also the int8 reductions' packed chunks in flight)
        self.buffer_meter = GatherMeter()
        self.grad_copies = 0  # gradients copied or added into a bucket (not accumulated there by autograd)
        self._late = [False] * len(self.params)  # complete only at the end ([Note: late gradients])
        self._learning = True  # no synchronised backward has reached its end yet
        self._set_aside: dict[int, Tensor] = {}  # stage 2: index -> gradient come after its bucket was sent
        self._late_after_send: list[int] = []  # indices accumulated again after their bucket was sent
        self._used_before: list[bool] = list(self._used)  # _used when this synchronised backward began
        # the wrap-up, once per outermost backward; told when a backward raised
        self._end = EndOfBackward(self._finalize, on_raise=self._on_raise)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self._build(self._plan())

    # -- plan and storage -------------------------------------------------------------------

    def _plan(self, order: Sequence[int] | None = None) -> list[BucketSpec]:
        infos = [
            ParamInfo(i, p.numel(), self.reduce_dtype or p.dtype, p.device, k)
            for i, (p, k) in enumerate(zip(self.params, self.keys))
        ]
        return plan_buckets(
            infos,
            cap_bytes=self.cap_bytes,
            first_cap_bytes=self.first_cap_bytes,
            order=order,
            pad_to=self.pad_to,
        )

    def _build(self, specs: list[BucketSpec]) -> None:
        """Allocate buckets for ``specs``, moving what the parameters accumulated into the new slots."""
        held = self._held_grads()
        self.buckets = [
            Bucket(i, s, [self.params[j] for j in s.params], persistent=self.stage <= 1)
            for i, s in enumerate(specs)
        ]
        self._slot = {j: (b, k) for b in self.buckets for k, j in enumerate(b.spec.params)}
        for bucket in self.buckets:
            bucket.held = any(self._late[j] for j in bucket.spec.params)
        for i, grad in held.items():
            bucket, k = self._slot[i]
            bucket.views[k].copy_(grad)
            if self.attach_views:
                self.params[i].grad = bucket.views[k]

    def _held_grads(self) -> dict[int, Tensor]:
        """What each parameter accumulated so far: its ``.grad`` (views), or its slot (added into)."""
        if self.attach_views:
            return {i: p.grad for i, p in enumerate(self.params) if p.grad is not None}
        return {i: b.views[k] for i, (b, k) in self._slot.items() if b.flat is not None}

    def _writable(self, bucket: Bucket) -> Tensor:
        """The bucket's storage, about to be written: a shard gradient borrowing it gets its own
        first (see [Note: sharded gradients])."""
        if self.spaces is not None and bucket.persistent:
            self.spaces[bucket.index].keep_grad()
        if bucket.flat is None:
            self._make_room()
            self.buffer_meter.add(bucket.spec.padded_numel * _itemsize(bucket.spec.dtype))
        return bucket.allocate()

    def _make_room(self) -> None:
        """Stage 2, before a bucket is allocated: hand on the oldest reductions until at most
        ``max_reduce_buffers`` full-size buckets are alive with it, those still filling counted."""
        filling = sum(1 for b in self.buckets if b.flat is not None and b.handle is None)
        while self._in_flight and len(self._in_flight) + filling >= self.max_reduce_buffers:
            self._hand_on(self._in_flight.popleft())

    def grad_tensors(self) -> list[Tensor]:
        """Every tensor that holds gradient storage now (for memory accounting)."""
        flats = [b.flat for b in self.buckets if b.flat is not None]
        shards = [s.grad for s in self.spaces or () if s.grad is not None]
        return flats + shards + [p.grad for p in self.params if p.grad is not None]

    def reduced_grads(self, dtype: torch.dtype | None = None) -> list[tuple[Parameter, Tensor | None]]:
        """Stage 0, after a synchronised backward: each parameter's averaged gradient, a view of its
        bucket (converted to ``dtype`` with one copy per bucket), None where no rank used it."""
        out = []
        for bucket in self.buckets:
            flat = bucket.flat if dtype in (None, bucket.flat.dtype) else bucket.flat.to(dtype)
            for j, offset in zip(bucket.spec.params, bucket.spec.offsets):
                p = self.params[j]
                dropped = p.grad is None if self.attach_views else j in self._dropped
                out.append((p, None if dropped else flat[offset : offset + p.numel()].view_as(p)))
        return out

    def bucket_specs(self) -> list[BucketSpec]:
        return [b.spec for b in self.buckets]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- forward side ------------------------------------------------------------------------

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate gradients locally; no collective runs.

        Stage 2 (unless ``accumulate_unsharded``) reduce-scatters every micro-batch instead, so that
        no full gradient outlives a backward: then this context changes nothing.
        """
        with sync_suspended(self, honoured=self.honours_no_sync):
            yield

    def abort_forward(self) -> None:
        """The step raised: nothing to undo."""

    def prepare_forward(self) -> None:
        """A forward begins: a backward that raised is noticed (see [Note: a backward that raised]);
        the gradients stay as they are (as under DDP, no ``.grad`` appears before a backward)."""
        if self._end.raised(idle=True):
            self._abort()
        if self.before_forward is not None:
            self.before_forward()

    def finish_forward(self, output: object) -> None:
        """When backward reaches this forward's outputs, before any parameter of it accumulates:
        the gradients go into their buckets (:meth:`attach_grads`). Until then ``.grad`` is what the
        user left (None after ``zero_grad``, as under DDP)."""
        if torch.is_grad_enabled():
            self.attach_when_backward_starts(tree_leaves(output))

    def attach_when_backward_starts(self, outputs: list) -> None:
        """:meth:`attach_grads` when backward first reaches one of ``outputs``."""
        tensors = [t for t in outputs if isinstance(t, Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: self.attach_grads(), mode="any")

    def drop_reduced(self) -> None:
        """The parameters' reduced gradients are dropped (``zero_grad``, or a backward begins): what
        they showed lives on in the shard gradients the optimizer steps."""
        for p in self.params:
            if isinstance(p.grad, RangeGrad):
                p.grad = None

    def attach_grads(self) -> None:
        """As a backward starts (its first node, before any parameter accumulates): point every
        ``.grad`` at its bucket slot, so that autograd accumulates into the bucket with no second
        copy: a cleared gradient's slot is zeroed (one ``zero_`` per bucket when all its gradients
        were cleared, as ``zero_grad`` leaves them), a replaced one copied in; a reduced gradient of
        stages 1-2 is dropped first (it lives on in the shard gradient). Idempotent: after it the
        gradients are the buckets' views. The last backward raised: it is cleaned up first, as the
        next gradient hook would (see [Note: a backward that raised])."""
        if self._end.raised():
            self._abort(in_backward=True)
        self.drop_reduced()
        if not self.attach_views:
            return
        for bucket in self.buckets:
            grads = [p.grad for p in bucket.params]
            if all(g is None for g in grads):
                self._writable(bucket).zero_()
                for p, view in zip(bucket.params, bucket.views):
                    p.grad = view
                for j in bucket.spec.params:
                    self._window_used[j] = False
                continue
            for k, (p, grad) in enumerate(zip(bucket.params, grads)):
                view = bucket.views[k]
                if grad is None:
                    self._writable(bucket)
                    view.zero_()
                    p.grad = view
                    self._window_used[bucket.spec.params[k]] = False
                elif grad.data_ptr() != view.data_ptr():
                    self._writable(bucket)
                    view.copy_(grad)
                    p.grad = view
                    self.grad_copies += 1

    # -- backward side -----------------------------------------------------------------------

    def _on_grad_ready(self, param: Tensor) -> None:
        i = self._index[id(param)]
        if self._end.raised():  # the last backward raised (see [Note: a backward that raised])
            self._abort(in_backward=True)
        if self.sync_enabled:
            if not self._end.queued:  # the first gradient of this backward
                self._used_before = list(self._used)
            self._end.note()
            if self._ready[i]:
                self._ready_again(i, param)
                return
        self._store_grad(i, param)
        self._used[i] = True
        if not self.sync_enabled:
            return
        self._ready[i] = True
        if not self._rebuilt and self.stage == 0:  # only stage 0 rebuilds; elsewhere it would grow forever
            self._ready_order.append(i)
        self._slot[i][0].pending -= 1
        self._launch_ready_buckets()

    def _ready_again(self, i: int, param: Tensor) -> None:
        """Parameter ``i`` was accumulated again in this backward: it is late, its bucket held from now
        on (see [Note: late gradients]); what arrived is added to its slot, or set aside if its bucket
        was already sent."""
        self._late[i] = True
        bucket, k = self._slot[i]
        bucket.held = True
        if bucket.handle is None:  # not sent yet: it goes out at the end of backward
            self._store_grad(i, param)
            return
        if self.attach_views or not self._learning:
            # autograd wrote into the bucket being reduced, or no other rank would reduce it set aside
            self._late_after_send.append(i)
            if not self.attach_views:
                param.grad = None
            return
        grad = param.grad.to(bucket.spec.dtype)
        param.grad = None
        if i in self._set_aside:
            self._set_aside[i].add_(grad)
        else:
            self._set_aside[i] = grad

    def _store_grad(self, i: int, param: Tensor) -> None:
        """Make bucket storage hold the gradient (see [Note: gradient storage])."""
        bucket, k = self._slot[i]
        if param.grad is None:
            return
        if not self.attach_views:
            self._writable(bucket)
            self._start_window(i)
            bucket.views[k].add_(param.grad)
            param.grad = None
            self.grad_copies += 1
            return
        view = bucket.views[k]
        if param.grad.data_ptr() != view.data_ptr():
            self._writable(bucket)
            view.copy_(param.grad)
            param.grad = view
            self.grad_copies += 1

    def _start_window(self, i: int) -> None:
        """Stage 0 added slots: zero slot ``i`` once its consumer dropped the last reduced value."""
        if self.consumed is None or self._zeroed[i] or not self.consumed(i):
            return
        bucket, k = self._slot[i]
        bucket.views[k].zero_()
        self._zeroed[i] = True
        self._window_used[i] = False

    def _launch_ready_buckets(self) -> None:
        """Send every complete bucket in plan order, up to the first one not complete or held (see
        [Note: late gradients]: while learning, stages 0-1 hold every bucket)."""
        if self._learning and self.stage <= 1:
            return
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending or bucket.held:
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        if not bucket.persistent:  # bounded: finish the oldest before another full bucket goes out
            while len(self._in_flight) >= self.max_reduce_buffers:
                self._hand_on(self._in_flight.popleft())
            self._in_flight.append(bucket)
        flat = self._writable(bucket)
        flat.div_(self.comm.mean_over)
        if self.stage == 0:
            bucket.handle = self.comm.all_reduce(flat, name=f"{self.label}/all_reduce/bucket={bucket.index}")
            return
        size = flat.numel() // self.comm.world_size
        # in place, into this rank's chunk, which the shard gradient borrows (stage 1) or adds (stage 2)
        bucket.shard_out = flat[self.comm.rank * size : (self.comm.rank + 1) * size]
        name = f"{self.label}/reduce_scatter/bucket={bucket.index}"
        if self._int8(bucket) is not None and bucket.int8.guard.quantize_now():
            bucket.handle = bucket.int8.start(self.comm, flat, name)  # flat stays as it was
            self.buffer_meter.add(bucket.int8.nbytes)  # the packed chunks, sent and received
            return
        if not bucket.persistent and self.spaces[bucket.index].takes_new_grad(bucket.spec.dtype):
            bucket.shard_out = torch.empty_like(bucket.shard_out)  # stage 2: the shard gradient to be
        bucket.handle = self.comm.reduce_scatter(bucket.shard_out, flat, name=name, scratch_input=True)

    def _int8(self, bucket: Bucket) -> Int8Reduction | None:
        """The bucket's int8 reduction (made at its first use; a rebuilt bucket gets a new one)."""
        if self.quantize is None or self.comm.world_size == 1 or not bucket.spec.dtype.is_floating_point:
            return None
        if bucket.int8 is None:
            chunk = bucket.spec.padded_numel // self.comm.world_size
            guard = self.quantize.guard_for(f"gradients of bucket {bucket.index}", self.comm)
            bucket.int8 = Int8Reduction(BlockLayout([chunk], self.quantize.block), guard)
        return bucket.int8

    def _hand_on(self, bucket: Bucket) -> None:
        """Wait for a bucket's reduce-scatter, add its shard into the shard gradient, free it."""
        assert self.spaces is not None, "stages 1-2 need their flat spaces before the first backward"
        bucket.handle.wait()
        if bucket.int8 is not None and bucket.int8.nbytes:  # an int8 reduction was in flight
            self.buffer_meter.add(-bucket.int8.nbytes)
            bucket.int8.finish(self.comm, bucket.shard_out, bucket.flat)
        self._sum_over_replicas(bucket.shard_out, f"bucket={bucket.index}")
        space = self.spaces[bucket.index]
        borrowed = bucket.shard_out.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
        space.accumulate_grad(bucket.shard_out, lend=borrowed)  # a chunk of the bucket, or its own
        if not bucket.persistent:  # the shard gets storage of its own, and the bucket is freed
            space.keep_grad()
            bucket.shard_out = None
            self.buffer_meter.add(-bucket.flat.numel() * bucket.flat.element_size())
        bucket.release()
        bucket.handed_on = True

    def _sum_over_replicas(self, shard: Tensor, what: str) -> None:
        """Hybrid sharding: the group's reduced shard summed over the replicate group (see [Note:
        shard groups and replicate groups] in comm/mesh.py)."""
        if self.comm.replicate is not None:
            name = f"{self.label}/all_reduce/{what}/replicas"
            self.comm.replicate.all_reduce(shard, name=name, async_op=False)

    def _deliver_shards(self, used: list[bool] | None, set_aside: set[int]) -> None:
        """Hand on every bucket's reduced shard, and the reduced gradients set aside for the buckets in
        ``set_aside``; parameters no rank used keep no gradient."""
        for bucket in self.buckets:
            if not bucket.handed_on:
                self._hand_on(bucket)
            if bucket.index in set_aside:
                self._reduce_set_aside(bucket)
            if used is not None:
                self.spaces[bucket.index].drop_unused([used[j] for j in bucket.spec.params])
        self._in_flight.clear()
        for bucket in self.buckets:
            self._show_reduced(bucket)

    def _show_reduced(self, bucket: Bucket) -> None:
        """Each parameter's ``.grad``: its reduced gradient, of which this rank holds a range (see
        [Note: gradients of whole parameters] in grad_sync/range_grad.py); None where none is held."""
        space = self.spaces[bucket.index]
        present = space._present() if space.grad is not None else [False] * len(bucket.params)
        for k, p in enumerate(bucket.params):
            if not present[k]:
                p.grad = None
                continue
            start, stop, offset = space.slices[k]
            whole = functools.partial(_whole_grad, space, k, self.comm, self.label)
            name = self.names[bucket.spec.params[k]]
            local = space.grad[start:stop]
            p.grad = RangeGrad(local, p.shape, offset, whole, self.comm, name, self.label, p.dtype)

    def _finalize(self) -> None:
        """End of a synchronised backward: launch what is left, wait for everything, check."""
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        self._prepare_missing(missing)
        for bucket in self.buckets[self._next_launch :]:
            self._launch(bucket)
        used_map = self._launch_used_map() if self.find_unused_parameters else None
        set_aside = self._agree_set_aside() if self._learning and self.stage == 2 else set()
        self._learning = False
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
        if missing and not self.find_unused_parameters:
            self._reset_backward_state()
            raise UnusedParametersError(self._unused_message(missing))
        used = self._globally_used(used_map) if used_map is not None else None
        if self._late_after_send:
            message = self._late_message(self._late_after_send)
            self._abort()
            raise LateGradientError(message)
        if self.stage >= 1:
            self._deliver_shards(used, set_aside)
        else:
            self._drop_unused(used)
        if self.on_reduced is not None:
            self.on_reduced()
        if self.stage == 0 and not self._rebuilt:
            self._rebuild()
        self._reset_backward_state()
        self._used = [False] * len(self.params)
        self._zeroed = [False] * len(self.params)

    def _agree_set_aside(self) -> set[int]:
        """Stage 2, first backward: the buckets for which some rank set a late gradient aside (one
        control collective; see [Note: late gradients])."""
        mine = sorted({self._slot[i][0].index for i in self._set_aside})
        every = self.comm.all_gather_object(mine, name=f"{self.label}/late_gradients")
        return {b for buckets in every for b in buckets}

    def _reduce_set_aside(self, bucket: Bucket) -> None:
        """Reduce-scatter the gradients set aside for ``bucket`` (zeros where this rank has none) and
        add this rank's shard into the shard gradient, after the bucket's own."""
        flat = torch.zeros(bucket.spec.padded_numel, dtype=bucket.spec.dtype, device=bucket.spec.device)
        for j, offset in zip(bucket.spec.params, bucket.spec.offsets):
            if j in self._set_aside:
                flat[offset : offset + self.params[j].numel()].copy_(self._set_aside.pop(j).reshape(-1))
        flat.div_(self.comm.mean_over)
        shard = torch.empty(flat.numel() // self.comm.world_size, dtype=flat.dtype, device=flat.device)
        name = f"{self.label}/reduce_scatter/bucket={bucket.index}/late"
        self.comm.reduce_scatter(shard, flat, name=name, scratch_input=True).wait()
        self._sum_over_replicas(shard, f"bucket={bucket.index}/late")
        space = self.spaces[bucket.index]
        space.keep_grad()
        space.grad.add_(shard)

    def _prepare_missing(self, missing: list[int]) -> None:
        """Slots of parameters that got no gradient are reduced as they are: zeros, or the window's sum."""
        for i in missing:
            if self.attach_views:
                if self.params[i].grad is None:  # nothing accumulated: reduce zeros
                    bucket, k = self._slot[i]
                    self._writable(bucket)
                    bucket.views[k].zero_()
            else:
                self._writable(self._slot[i][0])
                self._start_window(i)

    def _reset_backward_state(self) -> None:
        self._in_flight.clear()
        for bucket in self.buckets:
            if bucket.int8 is not None:
                self.buffer_meter.add(-bucket.int8.nbytes)  # a reduction abandoned in flight (0: none)
            bucket.reset()
        self._ready = [False] * len(self.params)
        self._next_launch = 0
        self._set_aside = {}
        self._late_after_send = []

    # -- a backward that raised ([Note: a backward that raised]) ---------------------------------

    def _on_raise(self) -> None:
        """Told inside autograd's unwinding: stages 1-2 unhook the gradients from their bucket views
        at once, so that a next backward (before any forward) accumulates afresh. No collective here."""
        if self.stage >= 1 and self.attach_views:
            for p in self.params:
                p.grad = None

    def _abort(self, *, in_backward: bool = False) -> None:
        """The last synchronised backward raised: finish what it sent, drop the results, start afresh.
        ``in_backward``: called from the first hook of the next backward, after ``_on_raise`` (so the
        gradient autograd just accumulated is this backward's: it stays)."""
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()  # every rank raised at the same place: the collectives match
        if self.stage == 0 and self.drop_on_abort and not in_backward:
            # the optimizer steps fp32 masters, whose zero_grad cannot reach these: drop them here
            for p in self.params:
                p.grad = None
        if self.stage >= 1:
            if not in_backward:
                self._on_raise()
            for bucket in self.buckets:
                if bucket.flat is not None and not bucket.persistent:
                    self.buffer_meter.add(-bucket.flat.numel() * bucket.flat.element_size())
                if bucket.flat is not None:
                    bucket.release()
        self._reset_backward_state()
        self._used = list(self._used_before)
        self._zeroed = [False] * len(self.params)

    def _launch_used_map(self) -> tuple[Tensor, Handle]:
        device = self.params[0].device
        used = torch.tensor(self._used, dtype=torch.int32, device=device)
        return used, self.comm.world.all_reduce(used, name=f"{self.label}/all_reduce/used_map")

    def _globally_used(self, used_map: tuple[Tensor, Handle]) -> list[bool]:
        """Per parameter: some rank used it in this backward."""
        used, handle = used_map
        handle.wait()
        return [count > 0 for count in used.tolist()]

    def _drop_unused(self, used: list[bool] | None) -> None:
        """Stage 0: a parameter no rank used in the gradient window keeps ``.grad = None``, as torch
        DDP leaves it (see [Note: gradient window] in zero/flat_param.py)."""
        if used is None:
            self._window_used = [True] * len(self.params)
            self._dropped = set()
            return
        self._window_used = [a or b for a, b in zip(self._window_used, used)]
        self._dropped = {i for i, seen in enumerate(self._window_used) if not seen}
        if self.attach_views:
            for i in self._dropped:
                self.params[i].grad = None

    def _rebuild(self) -> None:
        """Rebuild the plan once, in the ready order rank 0 observed (see [Note: bucket order])."""
        self._rebuilt = True
        device = self.params[0].device
        late = [i for i in self._ready_order if self._late[i]]  # complete only at the end: sent last
        mine = [i for i in self._ready_order if not self._late[i]] + late
        order = self.comm.broadcast_object(mine, name=f"{self.label}/bucket_order", device=device)
        self._ready_order = []
        specs = self._plan(order)
        if specs != self.bucket_specs():
            self._int8_fallbacks = self.quantize_fallbacks()  # the new buckets' guards start afresh
            self._build(specs)

    def quantize_fallbacks(self) -> int:
        """How often the accuracy guard of the buckets' int8 reductions fell back to full precision."""
        return self._int8_fallbacks + sum(b.int8.guard.fallbacks for b in self.buckets if b.int8 is not None)

    def _late_message(self, late: list[int]) -> str:
        names = ", ".join(dict.fromkeys(self.names[i] for i in late))
        return (
            f"parameter(s) {names} got more gradient after their bucket was sent in this backward: their "
            "hook fired again, as under reentrant activation checkpointing (use_reentrant=True) of a function "
            "that uses them without taking them as inputs, in a backward whose graph differs from the first "
            "step's. This backward's gradients are wrong; their buckets are held for the end of backward from "
            "now on. Call zero_grad and run the step again, or checkpoint with use_reentrant=False."
        )

    def _unused_message(self, missing: list[int]) -> str:
        names = ", ".join(self.names[i] for i in missing[:20])
        more = f" (and {len(missing) - 20} more)" if len(missing) > 20 else ""
        return (
            f"{len(missing)} parameter(s) that require grad got no gradient in this backward: {names}{more}. "
            "Every rank must reduce every parameter each step. Either make sure they take part in the loss, "
            "freeze them (requires_grad=False) before training, or pass find_unused_parameters=True to the "
            "strategy (e.g. ZeroStrategy(find_unused_parameters=True) or strategy.find_unused_parameters=true)."
        )


def _whole_grad(space: FlatParameter, position: int, comm: Communicator, label: str) -> Tensor:
    """The whole reduced gradient of one parameter of ``space`` on every rank (an AllGather of the
    shard gradient; a collective)."""
    shard = space.grad if space.grad is not None else space.shard.new_zeros(space.shard_numel)
    full = torch.empty(space.padded_numel, dtype=shard.dtype, device=shard.device)
    comm.all_gather(full, shard, name=f"{label}/at_rest/gather/grad={space.name}", async_op=False)
    return space.value_of(full, position).clone()
