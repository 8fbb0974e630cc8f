"""FlatParameter: some parameters laid end to end in one padded 1D space, split into N shards.

[Note: flat space]
A FlatParameter describes one flat space: its parameters at their offsets, padded to a multiple
of N, rank r owning elements [r*S, (r+1)*S) with S = padded_numel / N (``shard``, 1D). The part of
parameter i that lies in this rank's shard is one contiguous slice of the shard (possibly empty);
for every optimizer that holds parameter i, a *sub-shard* leaf tensor aliases that slice, and the
sub-shards are what the user's optimizer steps, one per original parameter, in the user's order.
So each parameter keeps its own optimizer state and step count as in a single process, a
parameter held by two optimizers is stepped by both, and a parameter whose gradient is None is
skipped by the optimizer, as it is without sharding. Empty sub-shards are kept so that every rank's
optimizer holds the same structure. Stages 1-2 use one FlatParameter per gradient bucket, stage 3
one per wrap unit.

[Note: gradient window]
``grad`` (1D, S, the shard's dtype) holds this rank's reduced gradient, summed over every
synchronised backward since the optimizer last consumed it: micro-batches, several backward
passes before one step, several losses. Each sub-shard's ``.grad`` is a view of its slice. A
slice is *consumed* when its sub-shard's ``.grad`` is None (the optimizer's ``zero_grad`` or the
release after a step): the next reduced gradient starts that slice from zero; every other slice
adds to what it holds. ``zero_grad(set_to_none=False)`` zeroes the views, hence the slices. A
parameter no rank used (``find_unused_parameters``) keeps ``.grad = None`` unless an earlier
backward of the window gave it one, so the optimizer skips it as it would without sharding.

The functions below move optimizer state between the sharded form (state of the sub-shards) and
the form a single process has (state of the original parameters, numbered as torch numbers them).
Every rank must call them together: per-element state is gathered flat space by flat space, so no
rank holds more than one flat space of full state beyond its shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_zero.comm import Communicator


class Slice(NamedTuple):
    """What this rank's shard holds of one parameter."""

    start: int  # first element inside the shard (1D, S)
    stop: int  # one past the last; start == stop when this rank holds none of it
    offset: int  # index of the first element in the parameter's flattening


class FlatParameter:
    """Layout of one flat space, this rank's shard of it, its sub-shards and their gradient.

    Args:
        name: readable name (the unit's module path, or ``bucket=3``).
        params: the original parameters, in layout order.
        shard: this rank's chunk of the values (1D, padded_numel / N).
        world_size, rank: N and this rank.
    """

    def __init__(
        self, name: str, params: Sequence[Parameter], shard: Tensor, *, world_size: int, rank: int
    ) -> None:
        self.name = name
        self.params = list(params)  # original parameters, layout order
        self.shapes = [p.shape for p in self.params]  # original shapes (stage 3 swaps .data out)
        self.offsets = _offsets(self.shapes)  # start element of each parameter
        self.numel = sum(s.numel() for s in self.shapes)  # elements used
        self.padded_numel = -(-self.numel // world_size) * world_size  # multiple of N
        self.shard_numel = self.padded_numel // world_size  # S
        self.rank = rank
        self.shard = shard  # 1D, S elements: this rank's values
        self.slices = [self._slice(o, s.numel()) for o, s in zip(self.offsets, self.shapes)]  # per param
        self.subs: dict[tuple[int, int], Parameter] = {}  # (optimizer index, param position) -> sub-shard
        self.grad: Tensor | None = None  # 1D, S, shard dtype: reduced gradient of the window
        self._lent = False  # grad aliases storage its producer reuses (stage 1's bucket): see keep_grad
        self._held_before: list[bool] = []  # per parameter: held a gradient before the last accumulation

    def _slice(self, offset: int, numel: int) -> Slice:
        begin = self.rank * self.shard_numel
        lo = min(max(offset, begin), begin + self.shard_numel)
        hi = max(min(offset + numel, begin + self.shard_numel), lo)
        return Slice(lo - begin, hi - begin, lo - offset)

    # -- sub-shards ------------------------------------------------------------------------------

    def sub_shard(self, optimizer_index: int, position: int) -> Parameter:
        """The leaf that optimizer ``optimizer_index`` steps for parameter ``position`` (made once)."""
        key = (optimizer_index, position)
        if key not in self.subs:
            start, stop, _ = self.slices[position]
            self.subs[key] = Parameter(self.shard[start:stop])
        return self.subs[key]

    def optimizer_subs(self, optimizer_index: int) -> dict[int, Parameter]:
        """position -> sub-shard, for the parameters optimizer ``optimizer_index`` holds."""
        return {i: s for (o, i), s in self.subs.items() if o == optimizer_index}

    def release_grads(self, optimizer_index: int) -> None:
        """After that optimizer's step: its sub-shards' gradients are consumed (see [Note: gradient
        window]); the shard gradient is freed once no sub-shard holds a view of it."""
        for (o, _), sub in self.subs.items():
            if o == optimizer_index:
                sub.grad = None
        if all(s.grad is None for s in self.subs.values()):
            self.grad, self._lent = None, False

    # -- the shard gradient ----------------------------------------------------------------------

    def accumulate_grad(self, reduced: Tensor, *, lend: bool = False) -> None:
        """Add this rank's reduced gradient (1D, S) into the window (see [Note: gradient window]);
        every sub-shard's ``.grad`` becomes a view of its slice.

        Args:
            reduced: the reduce-scatter's output for this rank.
            lend: ``reduced`` is storage its producer will overwrite later (call :meth:`keep_grad`
                before it does); it is adopted without a copy until then.
        """
        present = self._present()
        if self.grad is None or not any(present):
            if reduced.dtype == self.shard.dtype:
                self.grad, self._lent = reduced, lend
            else:
                self.grad, self._lent = reduced.to(self.shard.dtype), False
        else:
            self.keep_grad()
            for i, held in enumerate(present):
                if not held:
                    start, stop, _ = self.slices[i]
                    self.grad[start:stop].zero_()
            self.grad.add_(reduced)
        self._held_before = present
        for (_, i), sub in self.subs.items():
            sub.grad = self.grad[self.slices[i].start : self.slices[i].stop]

    def drop_unused(self, used: Sequence[bool]) -> None:
        """After :meth:`accumulate_grad`: a parameter no rank used in this backward, and that had no
        gradient from earlier in the window, keeps ``.grad = None`` (the optimizer skips it)."""
        for (_, i), sub in self.subs.items():
            if not used[i] and not self._held_before[i]:
                sub.grad = None

    def _present(self) -> list[bool]:
        """Per parameter: every sub-shard of it still holds its gradient (the slice is not consumed)."""
        present = [True] * len(self.params)
        for (_, i), sub in self.subs.items():
            if sub.grad is None:
                present[i] = False
        return present

    def keep_grad(self) -> None:
        """Give the shard gradient storage of its own before its lender writes over it."""
        if not self._lent:
            return
        self.grad, self._lent = self.grad.clone(), False
        for (_, i), sub in self.subs.items():
            if sub.grad is not None:
                sub.grad = self.grad[self.slices[i].start : self.slices[i].stop]

    # -- values ----------------------------------------------------------------------------------

    def full_from_params(self) -> Tensor:
        """The padded flat values of the parameters as they are now (1D, padded_numel)."""
        p0 = self.params[0]
        flat = torch.zeros(self.padded_numel, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets):
                flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
        return flat

    def own_chunk(self, flat: Tensor) -> Tensor:
        return flat[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    def master_shard(self, masters: dict[int, Tensor]) -> Tensor:
        """This rank's chunk of the master values (1D, S), from id(param) -> master tensor."""
        first = masters[id(self.params[0])]
        shard = torch.zeros(self.shard_numel, dtype=first.dtype, device=first.device)
        for p, (start, stop, offset) in zip(self.params, self.slices):
            shard[start:stop].copy_(masters[id(p)].reshape(-1)[offset : offset + stop - start])
        return shard


def full_parameters(spaces: Sequence[FlatParameter], comm: Communicator, label: str) -> dict[int, Tensor]:
    """id(param) -> its full value, gathered from the shards one flat space at a time.

    The shards hold the optimizer's values (fp32 masters under a mixed-precision policy).
    """
    values: dict[int, Tensor] = {}
    for space in spaces:
        full = torch.empty(space.padded_numel, dtype=space.shard.dtype, device=space.shard.device)
        comm.all_gather(full, space.shard.detach(), name=f"{label}/all_gather/state_dict", async_op=False)
        for p, shape, offset in zip(space.params, space.shapes, space.offsets):
            values[id(p)] = full[offset : offset + shape.numel()].view(shape).clone()
    return values


def state_dict_with(module: torch.nn.Module, values: dict[int, Tensor]) -> dict[str, Tensor]:
    """``module.state_dict()`` with the given parameter values, under every name a parameter has
    (sharded parameters are never read: see [Note: sharded parameters] in unit.py)."""
    state = module.state_dict(keep_vars=True)
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in values:
            state[name] = values[id(p)]
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in state.items()}


def _offsets(shapes: Sequence[torch.Size]) -> list[int]:
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        total += shape.numel()
    return offsets


def original_indices(groups: Sequence[Sequence[Parameter]]) -> dict[int, int]:
    """id(param) -> its index in a single-process ``optimizer.state_dict()`` (numbered in group order)."""
    ids: dict[int, int] = {}
    for params in groups:
        for p in params:
            ids.setdefault(id(p), len(ids))
    return ids


def full_optimizer_state(
    optimizer: Optimizer,
    optimizer_index: int,
    flats: Sequence[FlatParameter],
    original_groups: Sequence[Sequence[Parameter]],
    comm: Communicator,
    label: str,
    *,
    dst: int | None = None,
) -> dict[str, Any]:
    """The state of the original parameters, as ``optimizer.state_dict()`` of one process has it.

    ``dst`` None: every rank gets it (an AllGather per flat space and state name); a rank number:
    only that rank does, in CPU memory (a Gather; the others send their shards and get ``{}``).
    """
    ids = original_indices(original_groups)
    state: dict[int, dict[str, Any]] = {}
    for flat in flats:
        subs = flat.optimizer_subs(optimizer_index)
        names = sorted({name for s in subs.values() for name in optimizer.state.get(s, {})})
        for name in names:
            _unshard_one(optimizer, flat, subs, name, ids, state, comm, label, dst)
    if dst is not None and comm.rank != dst:
        return {}
    param_groups = []
    for group, params in zip(optimizer.param_groups, original_groups):
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = [ids[id(p)] for p in params]
        param_groups.append(saved)
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def _unshard_one(optimizer, flat, subs, name, ids, state, comm, label, dst) -> None:
    values = {i: optimizer.state.get(s, {}).get(name) for i, s in subs.items()}
    sample = next(v for v in values.values() if v is not None)
    full = None
    if _per_element(name, sample):
        chunk = torch.zeros(flat.shard_numel, dtype=sample.dtype, device=sample.device)
        for i, value in values.items():
            if value is not None:
                chunk[flat.slices[i].start : flat.slices[i].stop].copy_(value)
        if dst is None or comm.rank == dst:
            full = torch.empty(flat.padded_numel, dtype=sample.dtype, device=sample.device)
        if dst is None:
            comm.all_gather(full, chunk, name=f"{label}/all_gather/optimizer_state", async_op=False)
        else:
            comm.gather(full, chunk, dst=dst, name=f"{label}/gather/optimizer_state")
    if dst is not None and comm.rank != dst:
        return
    device = "cpu" if dst is not None else None
    for i, value in values.items():
        if value is None:
            continue
        p, shape, offset = flat.params[i], flat.shapes[i], flat.offsets[i]
        entry = state.setdefault(ids[id(p)], {})
        if full is not None:
            entry[name] = full[offset : offset + shape.numel()].view(shape).to(device, copy=True)
        else:
            entry[name] = value.to(device, copy=True) if isinstance(value, Tensor) else value


def _per_element(name: str, value: Any) -> bool:
    """Per-element state is a tensor shaped like its sub-shard (1D); a step count never is."""
    return isinstance(value, Tensor) and value.dim() > 0 and name != "step"


def load_full_optimizer_state(
    optimizer: Optimizer,
    optimizer_index: int,
    flats: Sequence[FlatParameter],
    original_groups: Sequence[Sequence[Parameter]],
    saved: dict[str, Any],
) -> None:
    """Load a single-process optimizer state (original parameters) into this rank's sub-shards."""
    if len(saved["param_groups"]) != len(original_groups):
        raise ValueError(
            f"checkpoint has {len(saved['param_groups'])} param groups for {type(optimizer).__name__}, "
            f"the optimizer has {len(original_groups)}"
        )
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    ids = original_indices(original_groups)
    saved_state = {int(k): v for k, v in saved["state"].items()}
    for flat in flats:
        for i, sub in flat.optimizer_subs(optimizer_index).items():
            entry = saved_state.get(ids[id(flat.params[i])])
            if entry:
                optimizer.state[sub] = _sub_shard_state(flat, i, sub, entry)


def _sub_shard_state(flat: FlatParameter, i: int, sub: Tensor, entry: dict[str, Any]) -> dict[str, Any]:
    start, stop, offset = flat.slices[i]
    state: dict[str, Any] = {}
    for name, value in entry.items():
        if isinstance(value, Tensor) and value.shape == flat.shapes[i] and name != "step":
            state[name] = value.reshape(-1)[offset : offset + stop - start].to(sub.device, copy=True)
        else:
            state[name] = value.clone() if isinstance(value, Tensor) else value
    return state


def clip_grad_norm_(optimizer: Optimizer, max_norm: float, comm: Communicator, label: str) -> Tensor:
    """Clip the sub-shard gradients by the norm of the whole, unsharded gradient.

    total = sqrt(AllReduce(sum of the shards' squares)); padding contributes zeros.
    """
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        squares += g.detach().float().pow(2).sum()
    comm.all_reduce(squares, name=f"{label}/all_reduce/grad_norm", async_op=False)
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total
