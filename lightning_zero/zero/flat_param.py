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

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.zero.dtensor import like_param, local_of


class Slice(NamedTuple):
    """What this rank's shard holds of one parameter."""

    start: int  # first element inside the shard (1D, S)
    stop: int  # one past the last; start == stop when this rank holds none of it
    offset: int  # index of the first element in the parameter's flattening


class FlatParameter:
    """Layout of one flat space, this rank's shard of it, its sub-shards and their gradient.

    [Note: row layout]
    Stages 1-2 lay the parameters end to end and cut the space into N equal chunks (a parameter
    may straddle two ranks). Stage 3 (``rows=True``) shards each parameter by rows, as DTensor's
    ``Shard(0)`` does: parameter i of d0 rows gets c_i = ceil(d0 / N) rows per rank (the last
    ranks fewer, or none), and rank r's shard is its rows of every parameter, each padded to
    C_i = c_i x (elements per row): the shard of rank r holds parameter i at [L_i, L_i + C_i),
    L_i = C_0 + ... + C_{i-1}. An AllGather of the shards (``gathered``, 1D, N x S) is then
    rank-major; the unit's unsharded parameters live parameter-major in a buffer of the same size
    (parameter i at ``offsets[i]`` = N x L_i, padded to N x C_i), and one copy moves between the
    two (:meth:`copy_out`, :meth:`scatter_into`). A 0-dim parameter is replicated: every rank
    holds it (one element of every shard; the ReduceScatter of its gradient sums it on each).
    In both layouts the part of a parameter in a rank's shard is one contiguous range of its
    flattening (``slices``), which is all that checkpoints and optimizer state rely on.

    Args:
        name: readable name (the unit's module path, or ``bucket=3``).
        params: the original parameters, in layout order.
        shard: this rank's chunk of the values (1D, padded_numel / N).
        world_size, rank: N and this rank.
        rows: the row layout of stage 3 (see [Note: row layout]).
        shapes: the parameters' shapes (default: as they are now).
    """

    def __init__(
        self,
        name: str,
        params: Sequence[Parameter],
        shard: Tensor,
        *,
        world_size: int,
        rank: int,
        rows: bool = False,
        shapes: Sequence[torch.Size] | None = None,
    ) -> None:
        self.name = name
        self.params = list(params)  # original parameters, layout order (stage 3: those at rest)
        self.shapes = list(shapes) if shapes is not None else [p.shape for p in self.params]
        self.numels = [s.numel() for s in self.shapes]
        self.numel = sum(self.numels)  # elements used
        self.world_size = world_size  # N
        self.rank = rank
        self.rows = rows  # see [Note: row layout]
        self.replicated = [rows and len(s) == 0 for s in self.shapes]  # held whole by every rank
        if rows:
            self.chunks = [self._chunk(s) for s in self.shapes]  # C_i: elements per rank
            self.local_offsets = _offsets_of(self.chunks)  # L_i: where it starts in each shard
            self.shard_numel = sum(self.chunks)  # S
            self.offsets = [world_size * o for o in self.local_offsets]  # in the unsharded buffer
        else:
            self.offsets = _offsets_of(self.numels)  # start element of each parameter
            self.shard_numel = -(-self.numel // world_size)  # S
        self.padded_numel = self.shard_numel * world_size  # N x S
        self.shard = shard  # 1D, S elements: this rank's values
        self.slices = [self._slice(i) for i in range(len(self.shapes))]  # per param
        self.subs: dict[tuple[int, int], Parameter] = {}  # (optimizer index, param position) -> sub-shard
        self.grad: Tensor | None = None  # 1D, S, shard dtype: reduced gradient of the window
        self._lent = False  # grad aliases storage its producer reuses (stage 1's bucket): see keep_grad
        self._held_before: list[bool] = []  # per parameter: held a gradient before the last accumulation

    def _chunk(self, shape: torch.Size) -> int:
        if len(shape) == 0:
            return 1
        inner = math.prod(shape[1:])
        return -(-shape[0] // self.world_size) * inner

    def _slice(self, i: int) -> Slice:
        numel = self.numels[i]
        if self.rows:
            if self.replicated[i]:
                return Slice(self.local_offsets[i], self.local_offsets[i] + 1, 0)
            chunk = self.chunks[i]
            lo, hi = min(self.rank * chunk, numel), min((self.rank + 1) * chunk, numel)
            return Slice(self.local_offsets[i], self.local_offsets[i] + hi - lo, lo)
        offset, begin = self.offsets[i], self.rank * self.shard_numel
        lo = min(max(offset, begin), begin + self.shard_numel)
        hi = max(min(offset + numel, begin + self.shard_numel), lo)
        return Slice(lo - begin, hi - begin, lo - offset)

    def local_shape(self, i: int) -> torch.Size:
        """Row layout: the shape of this rank's rows of parameter ``i`` (its DTensor's local shape)."""
        shape = self.shapes[i]
        if self.replicated[i]:
            return shape
        rows = -(-shape[0] // self.world_size)
        held = max(0, min(rows, shape[0] - self.rank * rows))
        return torch.Size((held, *shape[1:]))

    def local_view(self, i: int, flat: Tensor) -> Tensor:
        """Parameter ``i``'s part of a 1D shard-shaped tensor (its values, its gradient), in its
        local shape (row layout) or flat."""
        start, stop, _ = self.slices[i]
        part = flat[start:stop]
        return part.view(self.local_shape(i)) if self.rows else part

    # -- between the layouts -----------------------------------------------------------------------

    def param_values(self, gathered: Tensor) -> list[Tensor]:
        """Each parameter's whole value, in its shape, from an AllGather of the shards (1D, N x S):
        views of it (flat layout) or copies (row layout)."""
        return [self.value_of(gathered, i) for i in range(len(self.shapes))]

    def value_of(self, gathered: Tensor, i: int) -> Tensor:
        """Parameter ``i``'s whole value from an AllGather of the shards (see :meth:`param_values`)."""
        if not self.rows:
            return gathered[self.offsets[i] : self.offsets[i] + self.numels[i]].view(self.shapes[i])
        by_rank = gathered.view(self.world_size, self.shard_numel)
        start = self.local_offsets[i]
        if self.replicated[i]:
            return by_rank[0, start].view(self.shapes[i])
        return by_rank[:, start : start + self.chunks[i]].reshape(-1)[: self.numels[i]].view(self.shapes[i])

    def copy_out(self, gathered: Tensor, full: Tensor) -> None:
        """Row layout: an AllGather of the shards (rank-major) into the unsharded buffer
        (parameter-major; see [Note: row layout]), one copy."""
        n = self.world_size
        outs = [full[n * o : n * (o + c)].view(n, c) for o, c in zip(self.local_offsets, self.chunks)]
        torch.split_with_sizes_copy(gathered.view(n, self.shard_numel), self.chunks, dim=1, out=outs)

    def scatter_into(self, values: Sequence[Tensor | None], out: Tensor) -> None:
        """Whole tensors shaped like the parameters (None: zeros) into ``out`` (1D, N x S) in the
        layout of an AllGather: rank r's shard at [r*S, (r+1)*S), padding zeroed; cast to ``out``'s
        dtype. What a ReduceScatter of ``out`` sums, rank by rank."""
        n, by_rank = self.world_size, out.view(self.world_size, self.shard_numel)
        if not self.rows:
            for v, o, k in zip(values, self.offsets, self.numels):
                if v is None:
                    out[o : o + k].zero_()
                else:
                    out[o : o + k].copy_(v.reshape(-1))
            out[self.numel :].zero_()
            return
        whole = [
            torch.zeros(sh, dtype=out.dtype, device=out.device) if v is None else v
            for v, sh in zip(values, self.shapes)
        ]
        torch._chunk_cat(
            [w.reshape(1) if w.dim() == 0 else w for w in whole], dim=0, num_chunks=n, out=by_rank
        )
        for i, start in enumerate(self.local_offsets):
            if self.replicated[i]:
                by_rank[:, start].copy_(whole[i].reshape(()).expand(n))

    def full_from_params(self) -> Tensor:
        """The parameters' values as they are now, in the layout of an AllGather (1D, padded_numel)."""
        p0 = self.params[0]
        flat = torch.empty(self.padded_numel, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            self.scatter_into([p.detach() for p in self.params], flat)
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

    # -- sub-shards ------------------------------------------------------------------------------

    def sub_shard(self, optimizer_index: int, position: int) -> Parameter:
        """The leaf that optimizer ``optimizer_index`` steps for parameter ``position`` (made once)."""
        key = (optimizer_index, position)
        if key not in self.subs:
            start, stop, _ = self.slices[position]
            # stage 3: the parameter at rest itself (a DTensor over its rows of the shard)
            self.subs[key] = self.params[position] if self.rows else Parameter(self.shard[start:stop])
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

    def takes_new_grad(self, dtype: torch.dtype) -> bool:
        """Whether the next reduced gradient, of ``dtype``, becomes the shard gradient as it is
        (nothing held in the window, the shard's dtype): it may be reduced straight into storage of
        its own."""
        return dtype == self.shard.dtype and self._starts_window(self._present())

    def _starts_window(self, present: list[bool]) -> bool:
        """Nothing is held in the window: the next reduced gradient starts it."""
        return self.grad is None or not any(present)

    def accumulate_grad(self, reduced: Tensor, *, lend: bool = False) -> None:
        """Add this rank's reduced gradient (1D, S) into the window (see [Note: gradient window]);
        every sub-shard's ``.grad`` becomes a view of its slice.

        Args:
            reduced: the reduce-scatter's output for this rank.
            lend: ``reduced`` is storage its producer will overwrite later (call :meth:`keep_grad`
                before it does); it is adopted without a copy until then.
        """
        present = self._present()
        if self._starts_window(present):
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


def full_parameters(spaces: Sequence[FlatParameter], comm: Communicator, label: str) -> dict[int, Tensor]:
    """id(param) -> its full value, gathered from the shards one flat space at a time.

    The shards hold the optimizer's values (fp32 masters under a mixed-precision policy).
    """
    values: dict[int, Tensor] = {}
    for space in spaces:
        full = torch.empty(space.padded_numel, dtype=space.shard.dtype, device=space.shard.device)
        comm.all_gather(full, space.shard.detach(), name=f"{label}/all_gather/state_dict", async_op=False)
        for p, value in zip(space.params, space.param_values(full)):
            values[id(p)] = value.clone() if not space.rows else value.contiguous()
    return values


def gather_values(
    space: FlatParameter, comm: Communicator, label: str, *, dst: int | None
) -> dict[int, Tensor]:
    """position -> the full value of each parameter of ``space`` (the shard's dtype), in CPU memory;
    ``dst`` a rank: only that rank gets them (a Gather; the others ``{}``), None: every rank."""
    shard = space.shard.detach()
    full = (
        torch.empty(space.padded_numel, dtype=shard.dtype, device=shard.device)
        if dst in (None, comm.rank)
        else None
    )
    if dst is None:
        comm.all_gather(full, shard, name=f"{label}/all_gather/state_dict", async_op=False)
    else:
        comm.gather(full, shard, dst=dst, name=f"{label}/gather/state_dict")
    if full is None:
        return {}
    return {i: value.to("cpu", copy=True) for i, value in enumerate(space.param_values(full))}


def state_dict_with(module: torch.nn.Module, values: dict[int, Tensor]) -> dict[str, Tensor]:
    """``module.state_dict()`` with the given parameter values, under every name a parameter has
    (sharded parameters are never read: see [Note: sharded parameters] in unit.py)."""
    state = module.state_dict(keep_vars=True)
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in values:
            state[name] = values[id(p)]
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in state.items()}


def _offsets_of(sizes: Sequence[int]) -> list[int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
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
                chunk[flat.slices[i].start : flat.slices[i].stop].copy_(local_of(value).reshape(-1))
        if dst is None or comm.rank == dst:
            full = torch.empty(flat.padded_numel, dtype=sample.dtype, device=sample.device)
        if dst is None:
            comm.all_gather(full, chunk, name=f"{label}/all_gather/optimizer_state", async_op=False)
        else:
            comm.gather(full, chunk, dst=dst, name=f"{label}/gather/optimizer_state")
    if dst is not None and comm.rank != dst:
        return
    device = "cpu" if dst is not None else None
    whole = flat.param_values(full) if full is not None else None
    for i, value in values.items():
        if value is None:
            continue
        entry = state.setdefault(ids[id(flat.params[i])], {})
        if whole is not None:
            entry[name] = whole[i].to(device, copy=True)
        else:
            entry[name] = local_of(value).to(device, copy=True) if isinstance(value, Tensor) else value


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
            part = value.reshape(-1)[offset : offset + stop - start].to(local_of(sub).device, copy=True)
            state[name] = like_param(sub, part.view(flat.local_shape(i))) if flat.rows else part
        else:
            state[name] = value.clone() if isinstance(value, Tensor) else value
    return state


def clip_grad_norm_(
    optimizer: Optimizer, max_norm: float, comm: Communicator, label: str, *, error_if_nonfinite: bool = False
) -> Tensor:
    """Clip the sub-shard gradients by the norm of the whole, unsharded gradient.

    total = sqrt(AllReduce(sum of the shards' squares)); padding contributes zeros, and a gradient
    every rank holds whole (stage 3's 0-dim parameters) counts once. ``error_if_nonfinite``: a
    non-finite total raises before any gradient is touched (as ``torch.nn.utils.clip_grad_norm_``).
    """
    grads, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                grads.append((local_of(p.grad), _held_whole(p.grad)))
    device = grads[0][0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g, whole in grads:
        square = g.detach().float().pow(2).sum()
        squares += square / comm.world_size if whole else square
    comm.all_reduce(squares, name=f"{label}/all_reduce/grad_norm", async_op=False)
    total = squares.sqrt()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of the gradients is {total.item()} (non-finite); the gradients are not usable "
            "and were left as they are. Pass error_if_nonfinite=False to clip anyway (the step then writes NaN/inf)"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _ in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total


def _held_whole(grad: Tensor) -> bool:
    """A stage-3 gradient every rank holds whole (a replicated 0-dim parameter's)."""
    return hasattr(grad, "placements") and not any(p.is_shard() for p in grad.placements)
