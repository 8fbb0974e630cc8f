"""Stage 3 for one model: its units, their hooks, and the schedule of gathers and reduce-scatters.

[Note: the schedule]
Forward: a unit is gathered in its forward pre-hook (the next unit in forward order already in
flight when prefetch is on) and freed in its forward hook; the root unit (parameters outside every
other unit) is gathered when the step begins and kept for the whole step and its backward, so
2L-1 AllGathers run per step for L units. A call without gradients (a teacher, an evaluation
inside a step) frees its unit when it returns, whatever ``reshard_after_forward`` says. The
forward hook of a call with gradients registers a hook on its outputs that fires when backward
reaches them: the unit enters PRE_BACKWARD, is gathered again, and the next unit in backward order
is prefetched. When its backward is over (see [Note: calls and their backward]) it enters
POST_BACKWARD: its gradients are copied into a flat buffer in the shards' layout,
reduce-scattered, and the unit freed. ReduceScatters are issued in one fixed order on every rank
(reverse forward order, the root last; a unit finishing early waits for the ones before it), at
most ``max_reduce_buffers`` at once: before another starts, the oldest is waited and its full-size
buffer freed. At the end of the outermost backward (see [Note: end of backward]) every unit not yet
reduced is reduced (missing gradients as zeros), all ReduceScatters are waited and handed to the
sharded parameters' gradients, every gather still in flight is waited, every unit but the kept
root is freed and all return to IDLE: nothing is in flight across an optimizer step.

[Note: calls and their backward]
Within one backward, autograd accumulates a parameter's gradient once, after every use of it in
the graph contributed (its AccumulateGrad node waits for all of them): a unit's backward is over
when each of its trainable parameters accumulated, however many times it was called. A unit with
frozen parameters also needs them until backward went through it to its inputs, so each of its
calls passes its inputs (positional and keyword) that require grad through ``_PostBackward``,
whose backward tells the unit. Reentrant activation checkpointing runs a call without gradients
and again, with them, inside backward, in a nested backward of its own: each such recomputation
(a call in backward after one made without gradients) is followed through ``_PostBackward`` too,
and a unit called twice inside checkpointed segments is reduced once per segment, its second
reduction added to the first. A call without gradients that is never recomputed (a teacher, an
evaluation) changes nothing: its unit is freed when it returns and its backward is not waited for.

[Note: the root's gradients]
The root unit's gradients are reduced at the end of the outermost backward, never before: its
parameters may get gradients from several graph tasks (a root parameter captured by reentrant
activation checkpointing accumulates once per checkpointed segment), and the root is reduced last
in any case. Another unit's parameter that accumulates a second time is fine until the unit's
gradients went out; after that it is an error that names the parameter.

Activation checkpointing runs a unit's forward again inside backward. The hooks see it (they run
inside an autograd graph task) and then neither prefetch in forward order (the next unit in that
order already had its backward) nor free a unit whose backward is running; a unit recomputed
ahead of its own backward (a checkpoint spanning several units, or a reentrant one) is freed as
in forward and gathered again when its backward begins.

[Note: parameters outside forward]
Outside its gathers a unit's parameters are at rest ([Note: parameters at rest] in dtensor.py):
reading one reads the shards, reductions are collectives, nothing is gathered into the module.
:meth:`ZeroThree.gathered` puts every unit's whole parameters into the modules at once (a
collective): what the user writes into them there is written back into the shards when the unit
is freed, unless an optimizer step changed the shards since. Inside a step with gradients enabled
the units stay gathered until the end of the next backward, so a penalty's gradients reach them.
An optimizer step frees every gathered unit (the next use gathers the new values).

Every rank runs the same units in the same order, so the collectives match (see [Note: same
collectives everywhere] in grad_sync/reducer.py).
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from collections import deque
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from lightning_zero.comm import Communicator, Handle
from lightning_zero.comm.devicemesh import device_mesh
from lightning_zero.comm.quantize import WireQuantization
from lightning_zero.grad_sync.backward import EndOfBackward
from lightning_zero.grad_sync.reducer import UnusedParametersError, sync_suspended
from lightning_zero.memory import GatherMeter
from lightning_zero.precision import PrecisionPolicy
from lightning_zero.zero.deferred import Initializer, post_order
from lightning_zero.zero.dtensor import ZeroDTensor, local_of, register_mesh
from lightning_zero.zero.unit import ShardedUnit, Slots, TrainingState, gradient_divisors
from lightning_zero.zero.wrap import WrapPolicy, select_units

IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = (
    TrainingState.IDLE,
    TrainingState.FORWARD,
    TrainingState.PRE_BACKWARD,
    TrainingState.POST_BACKWARD,
)


def _in_backward() -> bool:
    """Inside an autograd graph task: a hook of backward, or a forward recomputed by checkpointing."""
    return torch._C._current_graph_task_id() != -1


class ZeroThree:
    """Stage 3 for one model: its units, their hooks, and the schedule (see [Note: the schedule]).

    Args:
        root: the LightningModule.
        comm: collectives.
        policy: which modules become units (see ``wrap.py``).
        prefetch: gather the next unit(s) while the current one computes.
        prefetch_limit: how many units ahead may be in flight at once.
        reshard_after_forward: free non-root units after forward (else keep them for backward).
        accumulate_unsharded: inside ``no_sync()`` keep full gradients, reduce-scatter once.
        find_unused_parameters: a parameter without gradient is reduced as zeros and, if no rank
            used it, not stepped; off: such a parameter is an error that names it.
        max_reduce_buffers: ReduceScatters (each with its unit's full-size gradient buffer) in
            flight at once.
        label: prefix of the collectives' names.
        precision: mixed precision of the trainable parameters (compute dtype, fp32 master shards).
        reduce_dtype: dtype of the gradients on the wire; None: the parameters' compute dtype.
        device: where shards and gathered parameters live (None: the parameters' device).
        broadcast: units take rank 0's values as they are sharded (a model built on every rank).
        initializer: the model was built on the meta device: gives each module its values as the
            units are built (see [Note: deferred initialisation]).
        quantize: int8 on the wire for weights and/or gradients ([Note: quantized communication]).
    """

    def __init__(
        self,
        root: nn.Module,
        comm: Communicator,
        policy: WrapPolicy | None,
        *,
        prefetch: bool = True,
        prefetch_limit: int = 1,
        reshard_after_forward: bool = True,
        accumulate_unsharded: bool = False,
        find_unused_parameters: bool = False,
        max_reduce_buffers: int = 2,
        label: str = "zero3",
        precision: PrecisionPolicy | None = None,
        reduce_dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        broadcast: bool = False,
        initializer: Initializer | None = None,
        quantize: WireQuantization | None = None,
    ) -> None:
        self.comm = comm
        self.label = label
        self.prefetch = prefetch
        self.prefetch_limit = prefetch_limit
        self.reshard_after_forward = reshard_after_forward
        self.accumulate_unsharded = accumulate_unsharded
        self.find_unused_parameters = find_unused_parameters
        self.max_reduce_buffers = max_reduce_buffers
        self.sync_enabled = True  # False inside no_sync() when accumulate_unsharded
        self.meter = GatherMeter()  # full parameters held gathered, now and at most
        self.buffer_meter = GatherMeter()  # full-size gradient buffers alive in backward, now and at most
        device = device if device is not None else _device_of(root)
        self.mesh = device_mesh(comm, device)  # where the parameters at rest live
        register_mesh(self.mesh, comm, label)
        options = {
            "policy": precision,
            "reduce_dtype": reduce_dtype,
            "device": device,
            "broadcast": broadcast,
            "mesh": self.mesh,
            "quantize": quantize,
        }
        unit_modules = select_units(root, policy)
        self.originals: dict[
            int, tuple[weakref.ref, Any, int]
        ] = {}  # id(param before) -> (it, flat, position)
        self.units = self._build_units(root, unit_modules, options, initializer)
        self.root_unit = self.units[0] if self.units and self.units[0].module is root else None
        self.forward_order: list[ShardedUnit] = []  # as observed in the first training forward
        self.reduce_order: list[ShardedUnit] | None = None  # fixed at the first backward
        self._recording = True  # recording the forward order
        self._in_step = False  # inside the root's forward (a training or evaluation step)
        self._next_reduce = 0  # position in reduce_order of the next ReduceScatter to issue
        self._reducing: deque[ShardedUnit] = deque()  # ReduceScatters in flight, oldest first
        self._end = EndOfBackward(self._finalize)  # the wrap-up, once per outermost backward
        self._unit_of = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        self._handles = self._register_hooks(root)  # forward hooks on modules: gather on use
        self._grad_handles = [  # on the unsharded parameters: the backward schedule
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for u in self.units for p in u.params
        ]
        self._guarded = _guard_moves(root, self.units)  # modules whose .to() / .cpu() check shards
        wire = self.units[0].reduce_dtype if self.units and self.units[0].reduce_dtype else torch.float32
        self.divide = gradient_divisors(wire, comm.mean_over)  # the mean: before and after the sum

    def quantize_fallbacks(self) -> int:
        """How often the accuracy guard of int8 communication fell back to full precision, over
        every unit's weights and gradients (see [Note: the accuracy guard] in comm/quantize.py)."""
        guards = [f.guard for u in self.units for f in u.flats if f.wire is not None]
        guards += [u.guard for u in self.units if u.wire is not None]
        return sum(g.fallbacks for g in guards)

    def _build_units(
        self, root: nn.Module, unit_modules: list, options: dict, initializer: Initializer | None
    ) -> list[ShardedUnit]:
        """One unit per wrap module that owns parameters; a deferred model gets its values module by
        module, each unit sharded as soon as its modules have them."""
        owner = _owning_units(root, unit_modules)
        slots = _param_slots(root)

        def build(name: str, module: nn.Module) -> ShardedUnit | None:
            params = owner.get(name, [])
            if not params:
                return None
            meters = {"meter": self.meter, "buffer_meter": self.buffer_meter}
            mine = {**options, "quantize": _root_wire(options["quantize"])} if module is root else options
            unit = ShardedUnit(name, module, params, slots, self.comm, self.label, **meters, **mine)
            for flat in unit.flats:
                for i, ref in enumerate(flat.originals):
                    if ref() is not None:
                        self.originals[id(ref())] = (ref, flat.flat, i)
            return unit

        if initializer is None:
            built = {name: build(name, module) for name, module in unit_modules}
        else:
            wanted, built = dict(unit_modules), {}
            with initializer:
                for name, module in post_order(root):  # children first: a unit after all its modules
                    initializer.materialize(name, module)
                    if name in wanted:
                        built[name] = unit = build(name, module)
                        if unit is not None:  # its values are in its shard: one unit on the host at a time
                            initializer.release(
                                [r() for f in unit.flats for r in f.originals if r() is not None]
                            )
        return [built[name] for name, _ in unit_modules if built[name] is not None]

    def sharded_of(self, p: Tensor) -> tuple[Any, int] | None:
        """(flat space, position) of a parameter as the model had it before it was sharded, or of
        a parameter at rest; None if it is no parameter of this model's units."""
        entry = self.originals.get(id(p))
        if entry is not None and entry[0]() is p:
            return entry[1], entry[2]
        for unit in self.units:
            for f in unit.flats:
                for i, q in enumerate(f.sharded):
                    if q is p:
                        return f.flat, i
        return None

    def _register_hooks(self, root: nn.Module) -> list:
        handles = []
        for unit in self.units:
            if unit is not self.root_unit:
                handles.append(
                    unit.module.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True)
                )
                handles.append(unit.module.register_forward_hook(self._post_forward_hook(unit)))
        if self.root_unit is not None:
            for module in _root_param_owners(root, self.units):
                handles.append(module.register_forward_pre_hook(self._root_pre_hook))
                handles.append(module.register_forward_hook(self._root_post_hook))
        return handles

    def remove_hooks(self, *, keep_forward: bool = False) -> None:
        """Remove the hooks; ``keep_forward``: only the gradient hooks, so that calling the module
        still gathers each unit. (A hook on a parameter that refers back to the units makes a cycle
        through autograd that Python's collector cannot see: those go in any case.)"""
        for h in self._grad_handles:
            h.remove()
        self._grad_handles = []
        if keep_forward:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        for module in self._guarded:
            module.__dict__.pop("_apply", None)
        self._guarded = []

    # -- forward -------------------------------------------------------------------------------

    def _gather_root(self) -> None:
        if self.root_unit is not None:
            self.root_unit.gather()

    def prepare_forward(self) -> None:
        """The root's forward starts (a step: training, evaluation, or any call through the wrapper)."""
        self._recover()
        for unit in self.units:
            unit.nograd_calls = 0
        self._in_step = True
        if self.root_unit is not None and self._recording and torch.is_grad_enabled():
            self.forward_order = [self.root_unit]
        # the root is gathered when a module holding root parameters runs (its pre-hook): until
        # then the step's code reads the root's parameters at rest (and their last gradients)

    def finish_forward(self, output: Any) -> None:
        """The root's forward ended: keep the root for the backward that follows, or free it."""
        self._in_step = False
        if self._recording and torch.is_grad_enabled() and self.forward_order:
            self._recording = False
            self._agree_forward_order()
        if self.root_unit is not None and _grad_tensors(output):
            self._register_pre_backward(self.root_unit, output)
            return
        for unit in self.units:  # no backward follows: nothing stays gathered
            if unit.pinned or unit is self.root_unit:
                unit.reshard(force=True)

    def _agree_forward_order(self) -> None:
        """The first training forward's unit order decides prefetch and the ReduceScatter order:
        every rank must have seen the same one (one object all-gather, once)."""
        mine = [self.units.index(u) for u in self.forward_order]
        orders = self.comm.all_gather_object(mine, name=f"{self.label}/agree/unit_order")
        for rank, order in enumerate(orders):
            if order != orders[0]:
                theirs, first = ([self.units[i].name for i in o] for o in (order, orders[0]))
                raise RuntimeError(
                    f"stage 3: the first training forward ran the wrap units in another order on rank {rank} "
                    f"({', '.join(theirs)}) than on rank 0 ({', '.join(first)}). Prefetch and the order of the "
                    "ReduceScatters follow that order and must be the same on every rank: make the first "
                    "training step take the same path through the model on every rank."
                )

    def abort_forward(self) -> None:
        """The step raised: leave the step, run nothing collective (peers may be gone)."""
        self._in_step = False

    def _pre_forward_hook(self, unit: ShardedUnit):
        @torch.compiler.disable  # collectives and storage changes run eagerly, also in a compiled module
        def hook(module: nn.Module, args: Any, kwargs: dict) -> Any:
            if module is not unit.module:  # a copy of the module (copy.deepcopy): its own parameters
                return None
            if _in_backward():  # recomputed by activation checkpointing: no forward-order prefetch
                unit.gather()
                if unit.nograd_calls and torch.is_grad_enabled():  # see [Note: calls and their backward]
                    unit.nograd_calls -= 1
                    return self._follow_call(unit, args, kwargs)
                return None
            self._recover()
            unit.state = FORWARD
            unit.gather()
            unit.mirror_grads(False)  # it computes with them: plain parameters
            cast = _cast_inputs(unit, args, kwargs)
            args, kwargs = cast if cast is not None else (args, kwargs)
            if not torch.is_grad_enabled():
                unit.nograd_calls += 1
                return cast
            if self._recording and unit not in self.forward_order:
                self.forward_order.append(unit)
            self._prefetch(unit, self.forward_order)
            followed = self._follow_call(unit, args, kwargs) if unit.has_frozen else None
            return followed if followed is not None else cast

        return hook

    def _follow_call(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> Any:
        """A call whose backward must reach its inputs before the unit's is over (see [Note: calls
        and their backward]): its inputs through ``_PostBackward``."""
        wrapped = _PostBackward.wrap(args, kwargs, lambda: self._inputs_done(unit))
        unit.inputs_pending += wrapped is not None
        return wrapped

    def _post_forward_hook(self, unit: ShardedUnit):
        @torch.compiler.disable
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if module is not unit.module:
                return
            if _in_backward() and unit.state is PRE_BACKWARD:
                return  # recomputed in the middle of its own backward: it stays gathered
            if unit.state is FORWARD:
                unit.state = IDLE
            needs_backward = bool(_grad_tensors(output))
            if needs_backward:
                self._register_pre_backward(unit, output)
                unit.note_forward_values()
            if not needs_backward or self.reshard_after_forward:
                if needs_backward and not (unit.pinned or unit.held or unit is self.root_unit):
                    unit.keep_secondary()  # its backward gathers inside the group: [Note: secondary shards]
                self._release(unit)
            if unit.in_use:  # kept gathered until its backward: .grad shows the last gradient
                unit.mirror_grads(True)

        return hook

    @torch.compiler.disable
    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        """Before a module that holds root parameters."""
        root = self.root_unit
        if not (root.gathered or root.gather_handle is not None):
            root.gather()  # the first module of the step holding root parameters
        root.mirror_grads(False)  # the module computes with them: plain parameters

    @torch.compiler.disable
    def _root_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        """After a module that holds root parameters."""
        root = self.root_unit
        if not self._in_step and not _in_backward() and not _grad_tensors(output):
            self._release(root)  # called outside a step, nothing to differentiate: freed at once
        elif root.in_use and not _in_backward():
            root.mirror_grads(True)  # between its modules, .grad shows the last gradient (as DDP)

    def _prefetch(self, unit: ShardedUnit, order: list[ShardedUnit]) -> None:
        """Start gathering the next units of ``order`` that still have a use ahead in this pass."""
        if not self.prefetch or self._recording or unit not in order:
            return
        start = order.index(unit) + 1
        for nxt in order[start : start + self.prefetch_limit]:
            if nxt is not self.root_unit and nxt.state is not POST_BACKWARD:
                nxt.gather(wait=False)

    def _release(self, unit: ShardedUnit) -> None:
        """Free a unit after use, unless it is the root during its step (or pinned, or held)."""
        if unit is self.root_unit and self._in_step:
            return
        unit.reshard()

    # -- backward ------------------------------------------------------------------------------

    def _register_pre_backward(self, unit: ShardedUnit, output: Any) -> None:
        tensors = _grad_tensors(output)
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda grads: self._pre_backward(unit), mode="any"
        )

    def _pre_backward(self, unit: ShardedUnit) -> None:
        self._end.note()
        if unit.state is POST_BACKWARD:  # a recomputed call in a graph task of its own: a new round
            unit.new_round()
        unit.check_forward_values()
        unit.state = PRE_BACKWARD
        unit.gather()
        unit.mirror_grads(False)  # autograd accumulates into the gathered parameters now
        self._prefetch(unit, self._backward_order())

    def _backward_order(self) -> list[ShardedUnit]:
        """The root first (its output is the loss), then the other units in reverse forward order."""
        rest = [u for u in self.forward_order if u is not self.root_unit][::-1]
        return ([self.root_unit] if self.root_unit is not None else []) + rest

    def _on_grad_ready(self, param: Tensor) -> None:
        unit, position = self._unit_of[id(param)]
        self._end.note()
        if unit.state is POST_BACKWARD and unit is not self.root_unit:
            unit.new_round()  # another recomputed call's gradients: see [Note: calls and their backward]
        if not unit.note_grad(position):  # again in this round (the root: several graph tasks)
            return
        if unit.done:
            self._unit_backward_done(unit)

    def _inputs_done(self, unit: ShardedUnit) -> None:
        """Backward went through one call of the unit to its inputs (see [Note: calls and their
        backward])."""
        unit.inputs_pending -= 1
        if unit.done and unit.state is not POST_BACKWARD:
            self._unit_backward_done(unit)

    def _unit_backward_done(self, unit: ShardedUnit) -> None:
        if unit is self.root_unit:  # reduced at the end: see [Note: the root's gradients]
            return
        unit.state = POST_BACKWARD
        if not self.sync_enabled:
            unit.keep_grads()
        elif unit.rounds:  # a later round: its place in the order is passed
            self._reduce(unit)
        else:
            self._reduce_ready_units()
        self._release(unit)
        unit.drop_secondary()

    def _plan_reduce_order(self) -> list[ShardedUnit]:
        """The order of the ReduceScatters, the same on every rank; fixed at the first backward."""
        if self.reduce_order is None:
            others = [u for u in self.units if u is not self.root_unit]
            seen = [u for u in reversed(self.forward_order) if u is not self.root_unit]
            rest = [u for u in reversed(others) if u not in seen]
            order = seen + rest + ([self.root_unit] if self.root_unit is not None else [])
            self.reduce_order = [u for u in order if u.trainable is not None]
        return self.reduce_order

    def _reduce_ready_units(self) -> None:
        order = self._plan_reduce_order()
        while self._next_reduce < len(order) and order[self._next_reduce].state is POST_BACKWARD:
            self._reduce(order[self._next_reduce])
            self._next_reduce += 1

    def _reduce(self, unit: ShardedUnit) -> None:
        """Start the unit's ReduceScatter, first finishing the oldest ones beyond the buffer limit
        (and the unit's own previous one, in a later round)."""
        while len(self._reducing) >= self.max_reduce_buffers or unit in self._reducing:
            self._reducing.popleft().finish_reduce()
        unit.reduce_scatter(self.divide)
        unit.rounds += 1
        self._reducing.append(unit)

    def _recover(self) -> None:
        """A forward starts while the last backward never reached its end: it raised (and the user
        caught the error). Finish what it left in flight (every rank raised at the same point, so
        the collectives match), drop its gradients (as ``zero_grad`` would), and start afresh."""
        if _in_backward() or not self._end.raised(idle=True):  # see [Note: a backward that raised]
            return
        while self._reducing:
            unit = self._reducing.popleft()
            unit.reduce_handle.wait()
            unit.drop_reduce()
        self._next_reduce = 0
        for unit in self.units:
            unit.finish_gather()
            unit.drop_secondary()
            unit.drop_grad_buffer()
            if unit is not self.root_unit or not self._in_step:
                unit.reshard(force=True)
            unit.end_backward()

    def _finalize(self) -> None:
        """End of the outermost backward (see [Note: the schedule])."""
        if self.sync_enabled:
            missing = [(u, i) for u in self.units for i, used in enumerate(u.used) if not used]
            for unit in self._plan_reduce_order()[self._next_reduce :]:
                unit.state = POST_BACKWARD
            self._reduce_ready_units()
            for unit in self.units:  # a later round cut short (see [Note: calls and their backward])
                if unit.rounds and unit.state is PRE_BACKWARD and any(unit.seen):
                    self._reduce(unit)
            used = self._globally_used() if self.find_unused_parameters else None
            while self._reducing:
                self._reducing.popleft().finish_reduce()
            self._next_reduce = 0
        else:
            for unit in self.units:
                if unit.state is not POST_BACKWARD:
                    unit.keep_grads()
        for unit in self.units:
            unit.finish_gather()
            unit.drop_secondary()
            if unit is not self.root_unit or not self._in_step:
                unit.reshard(force=not unit.held)
            unit.end_backward()
            if unit.in_use:  # kept gathered (a manual step, gathered()): .grad shows the reduced one
                unit.mirror_grads(True)
        if self.sync_enabled:
            self._check_unused(missing, used)

    def _globally_used(self) -> list[list[bool]]:
        """Per unit and parameter: some rank used it in this backward (one small AllReduce)."""
        flags = [f for u in self.units for f in u.used]
        device = self.units[0].flats[0].full.device
        used = torch.tensor(flags, dtype=torch.int32, device=device)
        self.comm.world.all_reduce(used, name=f"{self.label}/all_reduce/used_map", async_op=False)
        counts, out = used.tolist(), []
        for unit in self.units:
            out.append([c > 0 for c in counts[: len(unit.params)]])
            counts = counts[len(unit.params) :]
        return out

    def _check_unused(self, missing: list, used: list[list[bool]] | None) -> None:
        if used is not None:
            for unit, mask in zip(self.units, used):
                if unit.trainable is not None:
                    unit.drop_unused(mask)
            return
        if missing:
            names = [u.names[i] for u, i in missing]
            raise UnusedParametersError(
                f"{len(names)} parameter(s) that require grad got no gradient in this backward: "
                f"{', '.join(names[:20])}{' ...' if len(names) > 20 else ''}. Every rank must reduce every "
                "parameter each step. Either make sure they take part in the loss, freeze them "
                "(requires_grad=False) before training, or pass find_unused_parameters=True to the strategy."
            )

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """With ``accumulate_unsharded``: full gradients accumulate locally, no collective runs."""
        with sync_suspended(self, honoured=self.accumulate_unsharded):
            yield

    # -- whole-model views ---------------------------------------------------------------------

    @contextmanager
    def gathered(self) -> Generator[None, None, None]:
        """Every unit's whole parameters in the modules inside (see [Note: parameters outside
        forward]); every rank must enter it together. Inside a step with gradients enabled the units
        stay gathered until the end of the next backward; otherwise they are freed on leaving, what
        was written into them written back into the shards."""
        for unit in self.units:
            unit.gather(wait=False)
        for unit in self.units:
            unit.finish_gather()
            unit.make_exact()
            unit.mark_for_write_back()
            unit.mirror_grads(True)  # .grad shows the last gradient, as the parameter's under DDP
            unit.held = True
        try:
            yield
        finally:
            keep = self._in_step and torch.is_grad_enabled()
            for unit in self.units:
                if not unit.held:  # freed inside (an optimizer step)
                    continue
                unit.held = False
                if keep:
                    unit.pinned = True
                else:
                    self._release(unit)

    def param_spaces(self) -> list:
        """Every flat space holding parameter values: trainable and frozen."""
        return [f.flat for u in self.units for f in u.flats]

    def take_written(self) -> None:
        """Before an optimizer step: what the user wrote into gathered parameters goes to the shards."""
        for unit in self.units:
            unit.take_written()

    def after_step(self) -> None:
        """The optimizer stepped the shards: what is gathered now holds the old values (the root kept
        for a manual step, units inside ``gathered()``), so it is freed and gathered again on use."""
        for unit in self.units:
            unit.drop_secondary()
            if unit.gathered or unit.gather_handle is not None:
                unit.reshard(force=True)

    def release(self, *, wait: bool = True) -> None:
        for unit in self.units:
            unit.release(wait=wait)

    def grad_tensors(self) -> list[Tensor]:
        """The gradients of the parameters at rest (their local rows)."""
        return [
            local_of(p.grad) for u in self.units for f in u.flats for p in f.sharded if p.grad is not None
        ]

    def shard_tensors(self) -> list[Tensor]:
        """The persistent parameter shards (the values at rest; fp32 masters under a policy)."""
        return [t for u in self.units for t in u.shard_tensors()]

    def in_flight(self) -> list[Handle]:
        """Collectives still in flight (none between steps)."""
        return [h for u in self.units for h in (u.gather_handle, u.reduce_handle) if h is not None]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the gradients of those inputs are
    computed, i.e. once backward went through the call (see [Note: calls and their backward])."""

    @staticmethod
    def forward(ctx: Any, done: Any, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.done = done
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple:
        ctx.done()
        return (None, *grads)

    @classmethod
    def wrap(cls, args: tuple, kwargs: dict, done: Any) -> tuple[tuple, dict] | None:
        """``(args, kwargs)`` with every tensor that requires grad passed through, positional and
        keyword alike (``layer(hidden_states=h)``); None if there is none."""
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, a in enumerate(leaves) if isinstance(a, Tensor) and a.requires_grad]
        if not positions:
            return None
        for i, t in zip(positions, cls.apply(done, *(leaves[i] for i in positions))):
            leaves[i] = t
        return tree_unflatten(leaves, spec)


def _cast_inputs(unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A unit computing in a dtype of its own (a mixed-precision policy): its floating inputs in that
    dtype (``block(x)`` from a hook, on fp32 data), as FSDP2 casts forward inputs to its
    ``param_dtype``; None when nothing changes."""
    flat = unit.trainable
    if flat is None or flat.compute_dtype == flat.flat.shard.dtype:
        return None
    leaves, spec = tree_flatten((args, kwargs))
    dtype = flat.compute_dtype
    if not any(isinstance(t, Tensor) and t.is_floating_point() and t.dtype != dtype for t in leaves):
        return None
    leaves = [t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in leaves]
    return tree_unflatten(leaves, spec)


def _grad_tensors(output: Any) -> list[Tensor]:
    if not torch.is_grad_enabled():
        return []
    return [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]


def _device_of(module: nn.Module) -> torch.device:
    real = [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
    return real[0].device if real else torch.device("cpu")


def _param_slots(root: nn.Module) -> dict[int, Slots]:
    """id(parameter) -> every (module, attribute) holding it (a tied parameter has several)."""
    slots: dict[int, Slots] = {}
    for module in root.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, attr))
    return slots


def _root_wire(quantize: WireQuantization | None) -> WireQuantization | None:
    """The root unit's int8 traffic: its gradients as every unit's, its weights never. The root
    stays gathered through the step, where the user's code reads and writes it (an EMA taken after
    the forward, a weight scaled after backward): those must see and change the exact values, as
    under ddp, not their int8 rounding, which a write would carry into the shard (see [Note:
    quantized communication] in comm/quantize.py)."""
    if quantize is None or not quantize.weights:
        return quantize
    return dataclasses.replace(quantize, weights=False) if quantize.grads else None


def _owning_units(root: nn.Module, unit_modules: list[tuple[str, nn.Module]]) -> dict[str, list]:
    """unit name -> (name, parameter) of the parameters it owns, trainable and frozen: the innermost
    unit whose subtree holds every use of the parameter (a parameter tied across units, such as
    two blocks sharing a weight, belongs to the unit that contains both: often the root, which is
    gathered for the whole step)."""
    unit_names = [n for n, _ in unit_modules]
    names: dict[int, list[str]] = {}  # id(param) -> every name it has
    params: dict[int, nn.Parameter] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    ownership: dict[str, list] = {}
    for pid, all_names in names.items():
        unit = max(
            (u for u in unit_names if u == "" or all(n.startswith(u + ".") for n in all_names)),
            key=len,
            default="",
        )
        ownership.setdefault(unit, []).append((all_names[0], params[pid]))
    return ownership


def _root_param_owners(root: nn.Module, units: list[ShardedUnit]) -> list[nn.Module]:
    """Modules outside every non-root unit that hold root parameters directly."""
    root_params = {id(p) for f in units[0].flats for p in f.sharded}
    nested = {id(u.module) for u in units[1:]}
    owners = []
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in nested:
            continue
        if any(id(p) in root_params for p in module.parameters(recurse=False)):
            owners.append(module)
        stack.extend(module.children())
    return owners


# -- moving a sharded module -------------------------------------------------------------------


def _guard_moves(root: nn.Module, units: list[ShardedUnit]) -> list[nn.Module]:
    """Every module holding parameters of a unit gets an ``_apply`` of its own (see :func:`_apply`)."""
    holders = {id(m): m for u in units for slots in u.slots for where in slots for m, _ in where}
    for module in holders.values():
        module._apply = types.MethodType(_apply, module)
    return list(holders.values())


def _apply(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
    """``Module._apply`` (``.to()``, ``.cpu()``, ``.float()``) for a module holding stage-3
    parameters at rest: they stay as they are where ``fn`` would not change them (the same device
    and dtype), and a change is refused (their storage is the unit's shard); the rest of the
    module is converted as usual."""
    sharded = {k: p for k, p in self._parameters.items() if isinstance(p, ZeroDTensor)}
    for key, p in sharded.items():
        probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
        if (probe.dtype, probe.device) != (p.dtype, p.device):
            raise ValueError(
                f"stage 3: {type(self).__name__}.{key} is sharded (its values live in its unit's shard on "
                f"{p.device}, {p.dtype}), so it cannot be moved or cast to {probe.device}, {probe.dtype}. Move "
                "or cast the model before fitting, or after it with the whole weights (gather_at_teardown=True)."
            )
    if not sharded:
        return type(self)._apply(self, fn, recurse)
    saved = dict(self._parameters)
    for key in sharded:
        del self._parameters[key]
    try:
        type(self)._apply(self, fn, recurse)
    finally:
        converted = dict(self._parameters)
        self._parameters.clear()
        for key in saved:
            self._parameters[key] = sharded[key] if key in sharded else converted[key]
    return self
