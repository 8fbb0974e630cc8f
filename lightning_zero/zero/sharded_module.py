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

Activation checkpointing runs a unit's forward again inside backward. The hooks see it (they run
inside an autograd graph task) and then neither prefetch in forward order (the next unit in that
order already had its backward) nor free a unit whose backward is running; a unit recomputed
ahead of its own backward (a checkpoint spanning several units, or a reentrant one) is freed as
in forward and gathered again when its backward begins.

[Note: parameters outside forward]
Outside its gathers a unit's parameters hold empty placeholders, and any computation with one
raises an error that names it (see [Note: sharded parameters] in unit.py) instead of computing
with the placeholder; what a parameter is (shape of the placeholder, dtype, device, requires_grad)
can still be read. Code that needs whole parameters outside their unit's forward (a penalty over
all parameters, a weight norm) runs inside :meth:`ZeroThree.gathered` (every rank at once); with
gradients enabled inside a step the units then stay gathered until the end of the next backward,
so the penalty's gradients reach them. The root unit (parameters outside every other unit) is
gathered for the whole step and its backward.

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
from torch.utils._pytree import tree_leaves

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
                handles.append(unit.module.register_forward_pre_hook(self._pre_forward_hook(unit)))
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
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- forward -------------------------------------------------------------------------------

    def _gather_root(self) -> None:
        if self.root_unit is not None:
            self.root_unit.gather()

    def prepare_forward(self) -> None:
        """The root's forward starts (a step: training, evaluation, or any call through the wrapper)."""
        self._in_step = True
        if self.root_unit is not None and self._recording and torch.is_grad_enabled():
            self.forward_order = [self.root_unit]
        self._gather_root()

    def finish_forward(self, output: Any) -> None:
        """The root's forward ended: keep the root for the backward that follows, or free it."""
        self._in_step = False
        if self._recording and torch.is_grad_enabled() and self.forward_order:
            self._recording = False
        if self.root_unit is not None and _grad_tensors(output):
            self._register_pre_backward(self.root_unit, output)
            return
        for unit in self.units:  # no backward follows: nothing stays gathered
            if unit.pinned or unit is self.root_unit:
                unit.reshard(force=True)

    def abort_forward(self) -> None:
        """The step raised: leave the step, run nothing collective (peers may be gone)."""
        self._in_step = False

    def _pre_forward_hook(self, unit: ShardedUnit):
        @torch.compiler.disable  # collectives and storage changes run eagerly, also in a compiled module
        def hook(module: nn.Module, args: Any) -> None:
            if _in_backward():  # recomputed by activation checkpointing: no forward-order prefetch
                unit.gather()
                return
            unit.state = FORWARD
            unit.gather()
            if self._recording and torch.is_grad_enabled() and unit not in self.forward_order:
                self.forward_order.append(unit)
            self._prefetch(unit, self.forward_order)
            if unit.has_frozen and torch.is_grad_enabled():  # its gradient hooks cannot tell its end
                wrapped = _PostBackward.wrap(args, lambda: self._inputs_done(unit))
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
        self.comm.all_reduce(used, name=f"{self.label}/all_reduce/used_map", async_op=False)
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

    @contextmanager
    def gathered(self) -> Generator[None, None, None]:
        """Every unit's full parameters inside (see [Note: parameters outside forward]); every rank
        must enter it together. Inside a step with gradients enabled the units stay gathered until
        the end of the next backward; otherwise they are freed on leaving."""
        for unit in self.units:
            unit.gather(wait=False)
        for unit in self.units:
            unit.finish_gather()
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
        """Every flat space holding parameter values: trainable and frozen."""
        return [f.flat for u in self.units for f in u.flats]

    def after_step(self) -> None:
        for unit in self.units:
            unit.after_step()

    def release(self, *, wait: bool = True) -> None:
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
    def wrap(cls, args: tuple, done: Any) -> tuple | None:
        """``args`` with every tensor that requires grad passed through; None if there is none."""
        positions = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
        if not positions:
            return None
        out = list(args)
        for i, t in zip(positions, cls.apply(done, *(args[i] for i in positions))):
            out[i] = t
        return tuple(out)


def _grad_tensors(output: Any) -> list[Tensor]:
    if not torch.is_grad_enabled():
        return []
    return [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]


def _owning_units(root: nn.Module, unit_modules: list[tuple[str, nn.Module]]) -> dict[str, list]:
    """unit name -> (name, parameter) of the parameters it owns, trainable and frozen: the innermost
    unit whose subtree holds the parameter; a tied parameter must lie in one unit."""
    unit_names = [n for n, _ in unit_modules]
    owner_of_param: dict[int, str] = {}
    first_name: dict[int, str] = {}
    ownership: dict[str, list] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        unit = max((u for u in unit_names if u == "" or name.startswith(u + ".")), key=len)
        if id(p) in owner_of_param and owner_of_param[id(p)] != unit:
            raise ValueError(
                f"parameter {first_name[id(p)]!r} is shared with {name!r} across wrap units "
                f"{owner_of_param[id(p)] or 'root'!r} and {unit or 'root'!r}; a tied parameter must live in one "
                "unit. Change the wrap policy so that both modules are in the same unit (e.g. leave them "
                "unwrapped, in the root unit)."
            )
        if id(p) not in owner_of_param:
            owner_of_param[id(p)] = unit
            first_name[id(p)] = name
            ownership.setdefault(unit, []).append((name, p))
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
