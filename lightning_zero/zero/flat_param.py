"""FlatParameter: some parameters laid end to end in one padded 1D space, split into N shards.

[Note: flat space]
A FlatParameter describes one flat space: its parameters at their offsets, padded to a multiple
of N, rank r owning elements [r*S, (r+1)*S) with S = padded_numel / N (``shard``, 1D). Parameters
are ordered by their optimizer param group, so each group occupies one contiguous range; the part
of that range inside this rank's shard is a *sub-shard*, a leaf tensor aliasing a slice of
``shard``, and the sub-shards are what the user's optimizer steps (possibly empty on some ranks;
empty sub-shards are kept so that every rank's optimizer holds the same structure). Stages 1-2 use
one FlatParameter per gradient bucket (one group each); stage 3 one per wrap unit.

The functions below move optimizer state between the sharded form (state of the sub-shards) and
the form a single process has (state of the original parameters, numbered as torch numbers them).
Every rank must call them together: per-element state is all-gathered flat space by flat space,
so no rank holds more than one flat space of full state beyond its shards.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_zero.comm import Communicator


class FlatParameter:
    """Layout of one flat space and this rank's shard of it.

    Args:
        name: readable name (the unit's module path, or ``bucket=3``).
        params: the original parameters, in layout order (grouped by key).
        keys: per parameter, its ``(optimizer index, group index)``, or ``None``.
        shard: this rank's chunk of the values (1D, padded_numel / N).
        world_size, rank: N and this rank.
    """

    def __init__(
        self,
        name: str,
        params: Sequence[Parameter],
        keys: Sequence[Hashable],
        shard: Tensor,
        *,
        world_size: int,
        rank: int,
    ) -> None:
        self.name = name
        self.params = list(params)  # original parameters, layout order
        self.keys = list(keys)  # per parameter: (optimizer, group) or None
        self.shapes = [p.shape for p in self.params]  # original shapes (stage 3 swaps .data out)
        self.offsets = _offsets(self.params)  # start element of each parameter
        self.numel = sum(p.numel() for p in self.params)  # elements used
        self.padded_numel = -(-self.numel // world_size) * world_size  # multiple of N
        self.shard_numel = self.padded_numel // world_size  # S
        self.rank = rank
        self.shard = shard  # 1D, S elements: this rank's values
        self.sub_shards = self._make_sub_shards()  # key -> leaf aliasing a slice of shard

    def _make_sub_shards(self) -> dict[Hashable, Parameter]:
        subs: dict[Hashable, Parameter] = {}
        for key, (lo, hi) in self.key_ranges().items():
            if key is not None:
                start, end = self._local(lo), self._local(hi)
                subs[key] = Parameter(self.shard[start:end])
        return subs

    def release_grads(self, optimizer_index: int) -> None:
        """After that optimizer's step: drop its sub-shards' gradients (their storage is freed
        unless a bucket still holds it), rather than keep them until the next ``zero_grad``."""
        for key, sub in self.sub_shards.items():
            if key[0] == optimizer_index:
                sub.grad = None

    def _local(self, index: int) -> int:
        """A flat-space index as an index into this rank's shard, clamped to it."""
        return min(max(index - self.rank * self.shard_numel, 0), self.shard_numel)

    def key_ranges(self) -> dict[Hashable, tuple[int, int]]:
        """Per key, the [lo, hi) element range of its parameters in the flat space."""
        ranges: dict[Hashable, tuple[int, int]] = {}
        for key, shape, offset in zip(self.keys, self.shapes, self.offsets):
            lo, _ = ranges.get(key, (offset, offset))
            ranges[key] = (lo, offset + shape.numel())
        return ranges

    def sub_shard_offset(self, key: Hashable) -> int:
        """Where the sub-shard of ``key`` starts inside ``shard``."""
        return self._local(self.key_ranges()[key][0])

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
        flat = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        for p, shape, offset in zip(self.params, self.shapes, self.offsets):
            flat[offset : offset + shape.numel()].copy_(masters[id(p)].reshape(-1))
        return self.own_chunk(flat).clone()


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
    """``module.state_dict()`` with the given parameter values, under every name a parameter has."""
    state = module.state_dict()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in values:
            state[name] = values[id(p)]
    return state


def _offsets(params: Sequence[Parameter]) -> list[int]:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
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
) -> dict[str, Any]:
    """The state of the original parameters, as ``optimizer.state_dict()`` of one process has it."""
    ids = original_indices(original_groups)
    state: dict[int, dict[str, Any]] = {}
    for flat in flats:
        subs = {k: s for k, s in flat.sub_shards.items() if k[0] == optimizer_index}
        names = sorted({name for s in subs.values() for name in optimizer.state.get(s, {})})
        for name in names:
            _unshard_one(optimizer, flat, subs, name, ids, state, comm, label)
    param_groups = []
    for group, params in zip(optimizer.param_groups, original_groups):
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = [ids[id(p)] for p in params]
        param_groups.append(saved)
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def _unshard_one(optimizer, flat, subs, name, ids, state, comm, label) -> None:
    values = {k: optimizer.state.get(s, {}).get(name) for k, s in subs.items()}
    sample = next(v for v in values.values() if v is not None)
    per_element = isinstance(sample, Tensor) and sample.dim() > 0
    if per_element:
        chunk = torch.zeros(flat.shard_numel, dtype=sample.dtype, device=sample.device)
        for key, value in values.items():
            if value is not None and value.numel():
                start = flat.sub_shard_offset(key)
                chunk[start : start + value.numel()].copy_(value)
        full = torch.empty(flat.padded_numel, dtype=sample.dtype, device=sample.device)
        comm.all_gather(full, chunk, name=f"{label}/all_gather/optimizer_state", async_op=False)
    for p, shape, key, offset in zip(flat.params, flat.shapes, flat.keys, flat.offsets):
        if key not in subs:
            continue
        entry = state.setdefault(ids[id(p)], {})
        if per_element:
            entry[name] = full[offset : offset + shape.numel()].view(shape).clone()
        else:
            value = values[key] if values[key] is not None else sample
            entry[name] = value.clone() if isinstance(value, Tensor) else value


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
        for key, sub in flat.sub_shards.items():
            if key[0] == optimizer_index:
                sub_state = _sub_shard_state(flat, key, sub, ids, saved_state)
                if sub_state:
                    optimizer.state[sub] = sub_state


def _sub_shard_state(flat: FlatParameter, key, sub: Tensor, ids: dict, saved_state: dict) -> dict[str, Any]:
    full: dict[str, Tensor] = {}  # per-element state, laid out like the flat space
    scalars: dict[str, Any] = {}  # step counts and other per-parameter scalars
    for p, shape, k, offset in zip(flat.params, flat.shapes, flat.keys, flat.offsets):
        if k != key:
            continue
        for name, value in saved_state.get(ids[id(p)], {}).items():
            if isinstance(value, Tensor) and value.shape == shape and name != "step":
                buf = full.setdefault(
                    name, torch.zeros(flat.padded_numel, dtype=value.dtype, device=sub.device)
                )
                buf[offset : offset + shape.numel()].copy_(value.reshape(-1))
            else:
                scalars.setdefault(name, value.clone() if isinstance(value, Tensor) else value)
    start = flat.sub_shard_offset(key)
    sliced = {name: flat.own_chunk(buf)[start : start + sub.numel()].clone() for name, buf in full.items()}
    return {**scalars, **sliced}


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
