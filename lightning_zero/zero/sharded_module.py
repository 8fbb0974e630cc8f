"""Stage 3 for one model: its units, their hooks, and the schedule of gathers and reduce-scatters.

[Note: the schedule]
Forward: a unit is gathered in its forward pre-hook (the next unit in forward order already in
flight when prefetch is on) and freed in its forward hook; the root unit (parameters outside every
other unit) is gathered when the step begins and kept for the whole step and its backward, so
2L-1 AllGathers run per step for L units. The forward hook registers a hook on the unit's outputs
that fires when backward reaches them: the unit enters PRE_BACKWARD, is gathered again, and the
next unit in backward order is prefetched. When every parameter of the unit has accumulated its
gradient, it enters POST_BACKWARD: the gradients are copied into a flat buffer, reduce-scattered
and the unit freed. ReduceScatters are issued in one fixed order on every rank (reverse forward
order, the root last; a unit finishing early waits for the ones before it), at most
``max_reduce_buffers`` at once: before another starts, the oldest is waited and its full-size
buffer freed. At the end of the outermost backward (see [Note: end of backward]) every unit not yet
reduced is reduced (missing gradients as zeros), all ReduceScatters are waited and added into the
shard gradients (see [Note: gradient window]), every gather still in flight is waited, every unit
but the kept root is freed and all return to IDLE: nothing is in flight across an optimizer step.

[Note: calls recomputed in backward]
Reentrant activation checkpointing runs a unit's forward without gradients and again, with them,
inside backward, once per call, each in a nested backward of its own. A unit whose forward ran
without gradients counts those calls (``deferred_calls``); each recomputation passes its inputs
through ``_PostBackward``, and the unit's backward is over only when every such call's backward
reached its inputs: a unit called twice, or one whose frozen weights compute its input's
gradient after its trainable gradients arrived, is not freed or reduced early.

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
Outside its gathers a unit's parameters are at rest (see [Note: parameters at rest] in unit.py):
what a parameter is can be read as for the whole parameter, and using it gathers its unit first.
Inside a step with gradients enabled (a penalty over ``self.parameters()`` in ``training_step``)
the touched units are gathered as in forward and stay gathered until the end of the next
backward, so the penalty's gradients reach them; :meth:`ZeroThree.gathered` does the same for
every unit at once.

[Note: gathered at rest]
Elsewhere (a callback keeping an EMA, a weight norm, an export hook) a touched unit is gathered
into a buffer of its own and kept until a unit outside the same operation is touched, or until
the next step, optimizer step, checkpoint or ``gathered()`` (``settle``): a loop over
``named_parameters()`` costs about one AllGather per unit, and no more than the units of one
operation are held at once. Freeing drops the buffer instead of resizing it, so a ``p.detach()``
the user kept stays readable (with the values of that moment, as a copy would have). A unit that
user code touched compares this rank's chunk with its shard when it is freed and takes back what
was changed in place (``p.mul_``, ``p.data.copy_(ema)``): the shard and the fp32 master then hold
the new values. Touching is a collective: every rank runs the code that reads parameters, as for
FSDP2's reductions.

Every rank runs the same units in the same order, so the collectives match (see [Note: same
collectives everywhere] in grad_sync/reducer.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from lightning_zero.comm import Communicator, Handle
from lightning_zero.grad_sync.backward import EndOfBackward
from lightning_zero.grad_sync.reducer import UnusedParametersError, sync_suspended
from lightning_zero.memory import GatherMeter
from lightning_zero.precision import PrecisionPolicy
from lightning_zero.zero.deferred import Initializer, post_order
from lightning_zero.zero.unit import ShardedUnit, TrainingState
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
        reduce_dtype: dtype of the gradients on the wire; None: the parameters' own.
        device: where shards and gathered parameters live (None: the parameters' device).
        broadcast: units take rank 0's values as they are sharded (a model built on every rank).
        initializer: the model was built on the meta device: gives each module its values as the
            units are built (see [Note: deferred initialisation]).
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
        options = {
            "policy": precision,
            "reduce_dtype": reduce_dtype,
            "device": device,
            "broadcast": broadcast,
        }
        self.units = self._build_units(root, select_units(root, policy), options, initializer)
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
        self._at_rest: list[
            ShardedUnit
        ] = []  # gathered because user code touched them (see [Note: gathered at rest])
        for unit in self.units:
            unit.on_touch = self.touch
        self._grad_handles = [  # on the parameters: the backward schedule
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for u in self.units for p in u.params
        ]

    def _build_units(
        self, root: nn.Module, unit_modules: list, options: dict, initializer: Initializer | None
    ) -> list[ShardedUnit]:
        """One unit per wrap module that owns parameters; a deferred model gets its values module by
        module, each unit sharded as soon as its modules have them."""
        owner = _owning_units(root, unit_modules)

        def build(name: str, module: nn.Module) -> ShardedUnit | None:
            params = owner.get(name, [])
            if not params:
                return None
            meters = {"meter": self.meter, "buffer_meter": self.buffer_meter}
            return ShardedUnit(name, module, params, self.comm, self.label, **meters, **options)

        if initializer is None:
            built = {name: build(name, module) for name, module in unit_modules}
        else:
            wanted, built = dict(unit_modules), {}
            with initializer:
                for name, module in post_order(root):  # children first: a unit after all its modules
                    initializer.materialize(name, module)
                    if name in wanted:
                        built[name] = build(name, module)
        return [built[name] for name, _ in unit_modules if built[name] is not None]

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
                handles.append(
                    module.register_forward_pre_hook(torch.compiler.disable(lambda *_: self._gather_root()))
                )
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
        for unit in self.units:
            unit.on_touch = None
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- forward -------------------------------------------------------------------------------

    def _gather_root(self) -> None:
        if self.root_unit is not None:
            self.root_unit.gather()

    def prepare_forward(self) -> None:
        """The root's forward starts (a step: training, evaluation, or any call through the wrapper)."""
        self._recover()
        self.settle()
        for unit in self.units:
            unit.deferred_calls = 0
        self._in_step = True
        if self.root_unit is not None and self._recording and torch.is_grad_enabled():
            self.forward_order = [self.root_unit]
        self._gather_root()

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
            if _in_backward():  # recomputed by activation checkpointing: no forward-order prefetch
                unit.gather()
                if (
                    unit.deferred_calls and torch.is_grad_enabled()
                ):  # see [Note: calls recomputed in backward]
                    unit.deferred_calls -= 1
                    wrapped = _PostBackward.wrap(args, kwargs, lambda: self._inputs_done(unit))
                    unit.inputs_pending += wrapped is not None
                    return wrapped
                return None
            self._recover()
            if not torch.is_grad_enabled():
                unit.deferred_calls += 1
            unit.state = FORWARD
            unit.gather()
            if self._recording and torch.is_grad_enabled() and unit not in self.forward_order:
                self.forward_order.append(unit)
            self._prefetch(unit, self.forward_order)
            if unit.has_frozen and torch.is_grad_enabled():  # its gradient hooks cannot tell its end
                wrapped = _PostBackward.wrap(args, kwargs, lambda: self._inputs_done(unit))
                unit.inputs_pending += wrapped is not None
                return wrapped
            return None

        return hook

    def _post_forward_hook(self, unit: ShardedUnit):
        @torch.compiler.disable
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward() and unit.state is PRE_BACKWARD:
                return  # recomputed in the middle of its own backward: it stays gathered
            if unit.state is FORWARD:
                unit.state = IDLE
            needs_backward = bool(_grad_tensors(output))
            if needs_backward:
                self._register_pre_backward(unit, output)
            if not needs_backward or self.reshard_after_forward:
                self._release(unit)

        return hook

    def _prefetch(self, unit: ShardedUnit, order: list[ShardedUnit]) -> None:
        """Start gathering the next units of ``order`` that still have a use ahead in this pass."""
        if not self.prefetch or self._recording or unit not in order:
            return
        start = order.index(unit) + 1
        for nxt in order[start : start + self.prefetch_limit]:
            if nxt is not self.root_unit and nxt.state is not POST_BACKWARD:
                nxt.gather(wait=False)

    def _release(self, unit: ShardedUnit) -> None:
        """Free a unit after use, unless it is the root during its step (or pinned)."""
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
        if unit.state is POST_BACKWARD:  # outputs of a second call whose gradients already went out
            return
        unit.state = PRE_BACKWARD
        unit.gather()
        unit.attach_grads()
        self._prefetch(unit, self._backward_order())

    def _backward_order(self) -> list[ShardedUnit]:
        """The root first (its output is the loss), then the other units in reverse forward order."""
        rest = [u for u in self.forward_order if u is not self.root_unit][::-1]
        return ([self.root_unit] if self.root_unit is not None else []) + rest

    def _on_grad_ready(self, param: Tensor) -> None:
        unit, position = self._unit_of[id(param)]
        self._end.note()
        if unit.used[position]:  # accumulated again (reentrant checkpointing, a second graph task)
            if unit.state is POST_BACKWARD:
                raise RuntimeError(
                    f"stage 3: parameter {unit.names[position]!r} got another gradient after the gradients of its "
                    f"unit {unit.name!r} went out in this backward. A parameter used inside several reentrant "
                    "activation-checkpointed segments belongs in the unit that contains all of them (the root, "
                    "by leaving its module out of the wrap policy), or use use_reentrant=False."
                )
            return
        unit.note_grad(position)
        if unit.done:
            self._unit_backward_done(unit)

    def _inputs_done(self, unit: ShardedUnit) -> None:
        """A unit holding frozen parameters: backward went through it to its inputs (the frozen
        weights are needed until then, also after every trainable gradient arrived)."""
        unit.inputs_pending -= 1
        if unit.done:
            self._unit_backward_done(unit)

    def _unit_backward_done(self, unit: ShardedUnit) -> None:
        if unit is self.root_unit:  # reduced at the end: see [Note: the root's gradients]
            return
        unit.state = POST_BACKWARD
        if self.sync_enabled:
            self._reduce_ready_units()
        self._release(unit)

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
        """Start the unit's ReduceScatter, first finishing the oldest ones beyond the buffer limit."""
        while len(self._reducing) >= self.max_reduce_buffers:
            self._reducing.popleft().finish_reduce()
        unit.reduce_scatter()
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
            used = self._globally_used() if self.find_unused_parameters else None
            while self._reducing:
                self._reducing.popleft().finish_reduce()
            self._next_reduce = 0
        for unit in self.units:
            unit.finish_gather()
            if unit is not self.root_unit or not self._in_step:
                unit.reshard(force=True)
            unit.end_backward()
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
                if unit.flat is not None:
                    unit.flat.drop_unused(mask)
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

    # -- parameters used at rest ---------------------------------------------------------------

    def touch(self, units: list[ShardedUnit]) -> None:
        """User code uses parameters of ``units`` at rest (see [Note: parameters outside forward]
        and [Note: gathered at rest])."""
        if self._in_step and torch.is_grad_enabled():
            for unit in units:
                unit.gather()
                unit.pinned = True
                unit.mark_touched()
            return
        self.settle(keep=units)
        for unit in units:
            if unit.gathered or unit.gather_handle is not None:  # in use by the step: its life is the step's
                unit.finish_gather()
                unit.mark_touched()
                continue
            unit.gather_at_rest()
            self._at_rest.append(unit)

    def settle(self, keep: list[ShardedUnit] = ()) -> None:
        """Free the units gathered at rest (but ``keep``), taking back in-place changes."""
        for unit in [u for u in self._at_rest if u not in keep]:
            self._at_rest.remove(unit)
            unit.reshard(force=True)

    @contextmanager
    def gathered(self) -> Generator[None, None, None]:
        """Every unit's full parameters inside (see [Note: parameters outside forward]); every rank
        must enter it together. Inside a step with gradients enabled the units stay gathered until
        the end of the next backward; otherwise they are freed on leaving."""
        self.settle()
        for unit in self.units:
            unit.gather(wait=False)
        for unit in self.units:
            unit.finish_gather()
            unit.mark_touched()  # what is loaded or changed inside is taken back
        try:
            yield
        finally:
            keep = self._in_step and torch.is_grad_enabled()
            for unit in self.units:
                if keep:
                    unit.pinned = True
                else:
                    self._release(unit)

    def param_spaces(self) -> list:
        """Every flat space holding parameter values: trainable and frozen (in-place changes made
        at rest taken back first, so that what reads the shards reads them)."""
        self.settle()
        return [f.flat for u in self.units for f in u.flats]

    def after_step(self) -> None:
        """The optimizer stepped the shards: what is gathered now holds the old values (the root kept
        for a manual step, units touched at rest), so it is freed and gathered again on next use."""
        self.settle()
        for unit in self.units:
            if unit.gathered or unit.gather_handle is not None:
                unit.reshard(force=True)
            unit.after_step()

    def release(self, *, wait: bool = True) -> None:
        if wait:
            self.settle()
        self._at_rest = []
        for unit in self.units:
            unit.release(wait=wait)

    def grad_tensors(self) -> list[Tensor]:
        return [u.flat.grad for u in self.units if u.flat is not None and u.flat.grad is not None]

    def shard_tensors(self) -> list[Tensor]:
        """The persistent parameter shards (what gathers read; fp32 masters are optimizer state)."""
        return [t for u in self.units for t in u.shard_tensors()]

    def in_flight(self) -> list[Handle]:
        """Collectives still in flight (none between steps)."""
        return [h for u in self.units for h in (u.gather_handle, u.reduce_handle) if h is not None]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the gradients of those inputs are
    computed, i.e. once backward went through the unit: the end of a frozen unit's backward."""

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


def _grad_tensors(output: Any) -> list[Tensor]:
    if not torch.is_grad_enabled():
        return []
    return [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]


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
    root_params = {id(p) for f in units[0].flats for p in f.flat.params}
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
