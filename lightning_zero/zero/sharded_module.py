"""Stage 3: one ShardedUnit per wrap unit; gather before use, free after, reduce-scatter gradients.

[Note: gathered and sharded]
Between uses a unit holds only ``flat.shard`` (1D, padded_numel / N): this rank's slice of the
unit's flat parameter, which the optimizer's sub-shards alias. To run, the unit resizes the
storage of ``full`` (1D, padded_numel) back, all-gathers the shards into it and points each
original parameter's ``.data`` at its view of ``full``; so ``self.fc.weight`` works unchanged in
forward. To free, the parameters point at an empty placeholder (a stray access outside a
gathered region fails with a shape error instead of reading freed memory) and the storage of
``full`` is resized to zero, which releases it even while autograd still holds views of it; the
unit gathers into the same storage again before its backward, so those views see the values again.

[Note: the schedule]
Forward: a unit is gathered in its forward pre-hook (the next unit in forward order is already
in flight when prefetch is on) and freed in its forward hook, except the root unit, which
finishes forward last and which backward needs at once: 2L-1 AllGathers per step for L units.
The forward hook registers a hook on the unit's outputs that fires when backward reaches them:
the unit is gathered again there (the next unit in backward order prefetched). When every
parameter of the unit has accumulated its gradient, the unit's gradients are copied into a flat
buffer, reduce-scattered, and the unit freed. An end-of-backward callback waits for the
reduce-scatters, adds each shard into the fp32 shard gradient (accumulating across
micro-batches), and frees whatever is still gathered.

Every rank runs the same units in the same order, so the collectives match (see [Note: same
collectives everywhere] in grad_sync/reducer.py).
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_zero.comm import Communicator, Handle
from lightning_zero.grad_sync.reducer import sync_suspended
from lightning_zero.zero.flat_param import FlatParameter, full_parameters, state_dict_with
from lightning_zero.zero.wrap import WrapPolicy, select_units


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
    """One wrap unit: its flat parameter, gathered or sharded, and its backward bookkeeping."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[tuple[str, nn.Parameter]],
        keys: list,
        comm: Communicator,
        label: str,
        masters: dict[int, Tensor] | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        order = sorted(range(len(params)), key=lambda i: (_key_order(keys[i]), i))
        self.name = name or "root"  # module path; "root" for the whole model
        self.module = module  # the wrapped module
        self.names = [params[i][0] for i in order]  # parameter names, layout order
        self.comm = comm
        self.label = label
        _check_uniform(self.name, [params[i] for i in order])
        ordered = [params[i][1] for i in order]
        self.flat = FlatParameter(
            self.name,
            ordered,
            [keys[i] for i in order],
            torch.empty(0),
            world_size=comm.world_size,
            rank=comm.rank,
        )
        full = self.flat.full_from_params()  # 1D, padded_numel: storage reused for every gather
        self.param_shard = self.flat.own_chunk(full).clone()  # 1D, S, param dtype: what gathers read
        # the optimizer's values: the same tensor, or an fp32 master (see [Note: mixed precision])
        self.flat.shard = self.flat.master_shard(masters) if masters else self.param_shard
        self.flat.sub_shards = self.flat._make_sub_shards()
        self.full = full
        self.views = [full[o : o + p.numel()].view_as(p) for o, p in zip(self.flat.offsets, ordered)]
        self.placeholder = torch.empty(0, dtype=full.dtype, device=full.device)  # .data while sharded
        self.reduce_dtype = reduce_dtype or full.dtype  # gradients on the wire
        self.gathered = False  # params point into a complete `full`
        self.meter: GatherMeter | None = None  # shared by the units of one model, set by ZeroThree
        self.gather_handle: Handle | None = None  # in-flight AllGather
        self.pending = len(ordered)  # parameters whose gradient is not yet accumulated this backward
        self.reduce_handle: Handle | None = None  # in-flight ReduceScatter
        self.reduce_out: Tensor | None = None  # 1D, shard_numel: its output
        self.reduce_in: Tensor | None = None  # 1D, padded_numel: its input, kept alive until done
        self.shard_grad: Tensor | None = None  # 1D, shard_numel, fp32: accumulated shard gradient
        self.reshard()

    @property
    def params(self) -> list[nn.Parameter]:
        return self.flat.params

    def after_step(self) -> None:
        """Copy the stepped master shard into the shard the next gather reads; let go of the
        consumed shard gradient (the optimizer's zero_grad frees it; the next window starts anew)."""
        if self.param_shard is not self.flat.shard:
            with torch.no_grad():
                self.param_shard.copy_(self.flat.shard)
        self.shard_grad = None

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
            self._finish_gather()

    def _finish_gather(self) -> None:
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None
            for p, view in zip(self.params, self.views):
                p.data = view
            self.gathered = True

    def reshard(self) -> None:
        """Free the full parameters (see [Note: gathered and sharded])."""
        self._finish_gather()
        for p in self.params:
            p.data = self.placeholder
        self._free_full()

    def release(self) -> None:
        """Teardown: the parameters hold values of their own now; free ``full`` for good."""
        self._finish_gather()
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
        """Add the reduced shard into the fp32 shard gradient; give the sub-shards their views."""
        if self.reduce_handle is None:
            return
        self.reduce_handle.wait()
        out = self.reduce_out.float()
        consumed = any(s.grad is None for s in self.flat.sub_shards.values())  # zero_grad ran
        if self.shard_grad is None or consumed:
            self.shard_grad = out
            for key, sub in self.flat.sub_shards.items():
                start = self.flat.sub_shard_offset(key)
                sub.grad = self.shard_grad[start : start + sub.numel()].to(sub.dtype)
        else:
            self.shard_grad.add_(out)
        self.reduce_handle = self.reduce_in = self.reduce_out = None


def _key_order(key: Hashable) -> tuple:
    return (1, ()) if key is None else (0, key)


def _check_uniform(unit: str, params: Sequence[tuple[str, nn.Parameter]]) -> None:
    kinds = {(p.dtype, p.device) for _, p in params}
    if len(kinds) > 1:
        listing = ", ".join(f"{n} ({p.dtype}, {p.device})" for n, p in params)
        raise ValueError(
            f"unit {unit!r} mixes dtypes or devices, which one flat parameter cannot hold: {listing}. "
            "Convert the module to one dtype and device, or wrap the differing parts as units of their own."
        )


class ZeroThree:
    """Stage 3 for one model: its units, their hooks, and the prefetch schedule.

    Args:
        root: the LightningModule.
        comm: collectives.
        policy: which modules become units (see ``wrap.py``).
        keys: id(parameter) -> (optimizer index, group index) for the trainable parameters.
        prefetch: gather the next unit(s) while the current one computes.
        prefetch_limit: how many units ahead may be in flight at once.
        reshard_after_forward: free non-root units after forward (else keep them for backward).
        accumulate_unsharded: inside ``no_sync()`` keep full gradients, reduce-scatter once.
        masters: id(parameter) -> its fp32 master value (mixed precision), or None.
        reduce_dtype: dtype of the gradients on the wire; None: the parameters' own.
    """

    def __init__(
        self,
        root: nn.Module,
        comm: Communicator,
        policy: WrapPolicy | None,
        keys: dict[int, Hashable],
        *,
        prefetch: bool = True,
        prefetch_limit: int = 1,
        reshard_after_forward: bool = True,
        accumulate_unsharded: bool = False,
        label: str = "zero3",
        masters: dict[int, Tensor] | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.comm = comm
        self.label = label
        self.prefetch = prefetch
        self.prefetch_limit = prefetch_limit
        self.reshard_after_forward = reshard_after_forward
        self.accumulate_unsharded = accumulate_unsharded
        self.sync_enabled = True  # False inside no_sync() when accumulate_unsharded
        self.reduce_dtype = reduce_dtype  # gradients on the wire; None: the parameters' own
        self.units = self._build_units(root, select_units(root, policy), keys, masters)
        self.root_unit = self.units[0] if self.units and self.units[0].module is root else None
        self.forward_order: list[ShardedUnit] = []  # as observed in the first training forward
        self._recording = True  # recording the forward order
        self._finalize_queued = False  # end-of-backward callback queued
        self._unit_of = {id(p): u for u in self.units for p in u.params}  # id(param) -> its unit
        self.meter = GatherMeter()  # full parameters held gathered, now and at most
        for unit in self.units:
            unit.meter = self.meter
        self._handles = self._register_hooks(root)

    def _build_units(
        self, root: nn.Module, unit_modules: list, keys: dict, masters: dict | None
    ) -> list[ShardedUnit]:
        owner = _owning_units(root, unit_modules)
        units = []
        for name, module in unit_modules:
            params = owner.items_for(name)
            if params:
                unit_keys = [keys.get(id(p)) for _, p in params]
                units.append(
                    ShardedUnit(
                        name, module, params, unit_keys, self.comm, self.label, masters, self.reduce_dtype
                    )
                )
        return units

    def _register_hooks(self, root: nn.Module) -> list:
        handles = []
        for unit in self.units:
            if unit is not self.root_unit:
                handles.append(unit.module.register_forward_pre_hook(self._pre_forward_hook(unit)))
                handles.append(unit.module.register_forward_hook(self._post_forward_hook(unit)))
            for p in unit.params:
                handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        if self.root_unit is not None:
            for module in _root_param_owners(root, self.units):
                handles.append(module.register_forward_pre_hook(lambda *_: self._gather_root()))
        return handles

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- forward -------------------------------------------------------------------------------

    def _gather_root(self) -> None:
        if self.root_unit is not None:
            self.root_unit.gather()

    def prepare_forward(self) -> None:
        """The root's forward starts (training, validation or any other call through the wrapper)."""
        if self.root_unit is not None and self._recording and torch.is_grad_enabled():
            self.forward_order = [self.root_unit]
        self._gather_root()

    def finish_forward(self, output: Any) -> None:
        """The root's forward ended: keep the root for backward, or free it when none follows."""
        if self._recording and torch.is_grad_enabled() and self.forward_order:
            self._recording = False
        if self.root_unit is None:
            return
        if _grad_tensors(output):
            self._register_pre_backward(self.root_unit, output)
        else:
            self.root_unit.reshard()

    def _pre_forward_hook(self, unit: ShardedUnit):
        def hook(module: nn.Module, args: Any) -> None:
            unit.gather()
            if self._recording and torch.is_grad_enabled() and unit not in self.forward_order:
                self.forward_order.append(unit)
            self._prefetch(unit, self.forward_order)

        return hook

    def _post_forward_hook(self, unit: ShardedUnit):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            needs_backward = bool(_grad_tensors(output))
            if needs_backward:
                self._register_pre_backward(unit, output)
            if not needs_backward or self.reshard_after_forward:
                unit.reshard()

        return hook

    def _prefetch(self, unit: ShardedUnit, order: list[ShardedUnit]) -> None:
        if not self.prefetch or self._recording or unit not in order:
            return
        start = order.index(unit) + 1
        for nxt in order[start : start + self.prefetch_limit]:
            if nxt is not self.root_unit:
                nxt.gather(wait=False)

    # -- backward ------------------------------------------------------------------------------

    def _register_pre_backward(self, unit: ShardedUnit, output: Any) -> None:
        tensors = _grad_tensors(output)
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda grads: self._pre_backward(unit), mode="any"
        )

    def _pre_backward(self, unit: ShardedUnit) -> None:
        if not self._finalize_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            self._finalize_queued = True
        unit.gather()
        self._prefetch(unit, self._backward_order())

    def _backward_order(self) -> list[ShardedUnit]:
        """The root first (its output is the loss), then the other units in reverse forward order."""
        rest = [u for u in self.forward_order if u is not self.root_unit][::-1]
        return ([self.root_unit] if self.root_unit is not None else []) + rest

    def _on_grad_ready(self, param: Tensor) -> None:
        unit = self._unit_of[id(param)]
        unit.pending -= 1
        if unit.pending == 0:
            self._unit_backward_done(unit)

    def _unit_backward_done(self, unit: ShardedUnit) -> None:
        if self.sync_enabled:
            unit.reduce_scatter()
        unit.reshard()

    def _finalize(self) -> None:
        """End of backward: reduce what is left (unused parameters as zeros), wait, free."""
        self._finalize_queued = False
        for unit in self.units:
            if unit.pending > 0:  # some or all of its parameters got no gradient in this backward
                self._unit_backward_done(unit)
        for unit in self.units:
            unit.finish_reduce()
            unit.pending = len(unit.params)
            if unit.gathered:
                unit.reshard()

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """With ``accumulate_unsharded``: full gradients accumulate locally, no collective runs."""
        with sync_suspended(self, honoured=self.accumulate_unsharded):
            yield

    # -- whole-model views ---------------------------------------------------------------------

    @contextmanager
    def gathered(self) -> Generator[None, None, None]:
        """All units gathered inside (every rank must enter it together)."""
        for unit in self.units:
            unit.gather()
        try:
            yield
        finally:
            for unit in self.units:
                unit.reshard()

    def full_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """The module's state dict with full parameters (the optimizer's values), one unit at a time."""
        return state_dict_with(module, full_parameters([u.flat for u in self.units], self.comm, self.label))

    def after_step(self) -> None:
        for unit in self.units:
            unit.after_step()

    def release(self) -> None:
        for unit in self.units:
            unit.release()

    def grad_tensors(self) -> list[Tensor]:
        return [u.shard_grad for u in self.units if u.shard_grad is not None]

    def shard_tensors(self) -> list[Tensor]:
        """The persistent parameter shards (what gathers read; fp32 masters are optimizer state)."""
        return [u.param_shard for u in self.units]


def _grad_tensors(output: Any) -> list[Tensor]:
    if not torch.is_grad_enabled():
        return []
    return [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]


class _Ownership:
    """Which unit owns which trainable parameter: the innermost unit whose subtree holds it."""

    def __init__(self) -> None:
        self.params: dict[str, list[tuple[str, nn.Parameter]]] = {}  # unit name -> params

    def items_for(self, unit: str) -> list[tuple[str, nn.Parameter]]:
        return self.params.get(unit, [])


def _owning_units(root: nn.Module, unit_modules: list[tuple[str, nn.Module]]) -> _Ownership:
    unit_names = [n for n, _ in unit_modules]
    owner_of_param: dict[int, str] = {}
    first_name: dict[int, str] = {}
    ownership = _Ownership()
    for name, p in root.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
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
            ownership.params.setdefault(unit, []).append((name, p))
    return ownership


def _root_param_owners(root: nn.Module, units: list[ShardedUnit]) -> list[nn.Module]:
    """Modules outside every non-root unit that hold root parameters directly."""
    root_params = {id(p) for p in units[0].params}
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
