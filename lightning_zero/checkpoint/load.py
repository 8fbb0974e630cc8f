"""Loading a checkpoint's model and optimizer states into the model and optimizers as set up now,
any stage and world size (the later per-rank reads): full tensors, each slot taking its part; or a
sharded read's stand-ins, each rank reading only the chunks its own layout needs (see [Note:
sharded layout] in ``layout.py``), lay out -> unpickle (``unpickle.py``)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.optim import Optimizer

from lightning_zero.checkpoint.format import (
    MODEL_PREFIX,
    CheckpointError,
    Piece,
    _hyper,
    _is_per_element,
    _optimizer_prefix,
    _unbox,
)
from lightning_zero.checkpoint.layout import (
    ShardedModelState,
    ShardedOptimizerState,
    _check_keys,
    _check_shape,
    _destination,
    _group_params,
    _names,
    _slots,
)
from lightning_zero.checkpoint.unpickle import _load_items
from lightning_zero.comm import Communicator
from lightning_zero.zero.dtensor import like_param
from lightning_zero.zero.flat_param import original_indices


def load_model_state(
    module: nn.Module, engine: Any, comm: Communicator, state: Any, *, strict: bool = True
) -> None:
    """Load a checkpoint's model state (a full state dict or a :class:`ShardedModelState`) into
    ``module`` as set up now (any stage, any world size); every rank calls it."""
    if isinstance(state, ShardedModelState):
        _load_sharded_model(module, engine, comm, state, strict)
    else:
        _load_full_model(module, engine, state, strict)
    if engine is not None:
        engine.values_loaded()


def _load_full_model(module: nn.Module, engine: Any, state: Mapping[str, Any], strict: bool) -> None:
    """From full tensors: each slot takes its part; the rest goes through ``load_state_dict``."""
    _check_keys(module, set(state), strict, source="(a full state dict)")
    names = _names(module)
    slots = _slots(module, engine)
    rest = {}
    with torch.no_grad():
        for key, value in state.items():
            first = names.aliases.get(key, key)
            slot = slots.get(first)
            if slot is None:
                rest[key] = value
            elif key == first:  # a tied parameter's other names are written through its first
                _check_shape(key, value.shape, slot.shape, "the checkpoint")
                if slot.piece is not None:
                    part = value.reshape(-1)[slot.piece.offset : slot.piece.offset + slot.piece.local.numel()]
                    slot.piece.local.copy_(part)
                if slot.whole is not None:
                    slot.whole.copy_(value.reshape(slot.whole.shape))
    module.load_state_dict(rest, strict=False)


def _load_sharded_model(
    module: nn.Module, engine: Any, comm: Communicator, st: ShardedModelState, strict: bool
) -> None:
    """Each rank reads the chunks its slots cover, in place; the rest into fresh tensors."""
    _check_keys(module, st.keys(), strict, source=st.path)
    names = _names(module)
    slots = _slots(module, engine)
    dest: dict[str, Any] = {}  # DCP key -> where to read it
    rest: dict[str, tuple[str, Any]] = {}  # state-dict key -> (DCP key, current value)
    saved = st.keys()
    for key, value in module.state_dict(keep_vars=True).items():
        if key in names.aliases or key not in saved:
            continue
        first = st.layout["aliases"].get(key, key)
        fqn = MODEL_PREFIX + first
        slot = slots.get(key)
        if first in st.layout["shapes"]:
            _check_shape(key, st.layout["shapes"][first], slot.shape if slot else value.shape, st.path)
        if slot is None:
            md = st.metadata.state_dict_metadata[fqn]
            dest[fqn] = _destination(md, dtype=value.dtype if isinstance(value, Tensor) else None)
            rest[key] = (fqn, value)
        elif slot.piece is not None:
            dest[fqn] = slot.piece
        elif slot.whole is not None:
            dest[fqn] = slot.whole.view(-1)
    _load_items(comm, dest, st, name="checkpoint/load/model")
    values = {}
    for key, (fqn, value) in rest.items():
        loaded = _unbox(dest[fqn])
        values[key] = loaded.view(value.shape) if isinstance(value, Tensor) else loaded
    module.load_state_dict(values, strict=False)


# --------------------------------------------------------------------------- optimizers


def load_sharded_optimizer(
    module: nn.Module, engine: Any, comm: Communicator, optimizer: Optimizer, st: ShardedOptimizerState
) -> None:
    """Load optimizer ``st.index`` of a sharded checkpoint into ``optimizer`` as set up now:
    stages 1-3 read their sub-shards' slices, stage 0 whole tensors. Every rank calls it."""
    names = _names(module).of
    groups = _group_params(engine, optimizer, st.index)
    _check_groups(st, groups, names)
    index = _state_index(st.metadata, st.index, [names[id(p)] for params in groups for p in params])
    if engine is not None and engine.sharded:
        _load_sub_shards(engine, comm, optimizer, st, index, names)
        for group, saved in zip(optimizer.param_groups, st.param_groups):
            group.update(_hyper(saved))
        return
    named = _read_named_state(comm, st, index, local=False)
    ids = original_indices(groups)
    state = {ids[id(p)]: named[names[id(p)]] for params in groups for p in params if names[id(p)] in named}
    param_groups = [
        {**_hyper(saved), "params": [ids[id(p)] for p in params]}
        for saved, params in zip(st.param_groups, groups)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def _check_groups(st: ShardedOptimizerState, groups: list, names: dict[int, str]) -> None:
    where = f"{st.path} (optimizer {st.index})"
    if len(st.param_groups) != len(groups):
        raise CheckpointError(
            f"{where} has {len(st.param_groups)} param groups, the optimizer here {len(groups)}"
        )
    for g, (saved, params) in enumerate(zip(st.param_groups, groups)):
        here, there = {names[id(p)] for p in params}, set(saved["params"])
        if here != there:
            raise CheckpointError(
                f"{where}, param group {g} holds other parameters than the optimizer here: only in the "
                f"checkpoint {sorted(there - here)[:5]}, only here {sorted(here - there)[:5]}"
            )


def _state_index(metadata: Metadata, index: int, names: list[str]) -> dict[str, dict[str, str]]:
    """name -> {state name -> DCP key} for optimizer ``index`` (keys ``optim.<i>.<name>.<state>``).

    A parameter's name never continues with ``.`` into another parameter's name (a module cannot
    hold a parameter and a submodule of one name), so the prefix ``optim.<i>.<name>.`` is its own.
    """
    keys = sorted(k for k in metadata.state_dict_metadata if k.startswith(_optimizer_prefix(index)))
    out: dict[str, dict[str, str]] = {}
    for name in names:
        prefix = f"{_optimizer_prefix(index)}{name}."
        i = bisect_left(keys, prefix)
        while i < len(keys) and keys[i].startswith(prefix):
            out.setdefault(name, {})[keys[i][len(prefix) :]] = keys[i]
            i += 1
    return out


def _read_named_state(
    comm: Communicator, st: ShardedModelState, index: dict, *, local: bool
) -> dict[str, dict[str, Any]]:
    """Whole states by parameter name, per-element ones in the parameter's shape (CPU)."""
    mds = st.metadata.state_dict_metadata
    dest = {fqn: _destination(mds[fqn]) for entries in index.values() for fqn in entries.values()}
    _load_items(comm, dest, st, name="checkpoint/load/optimizer", local=local)
    out: dict[str, dict[str, Any]] = {}
    for name, entries in index.items():
        shape = st.layout["shapes"][name]
        out[name] = {
            sname: dest[fqn].view(shape) if _is_per_element(mds[fqn]) else _unbox(dest[fqn])
            for sname, fqn in entries.items()
        }
    return out


def _load_sub_shards(
    engine: Any, comm: Communicator, optimizer: Optimizer, st: ShardedOptimizerState, index: dict, names: dict
) -> None:
    dest: dict[str, Any] = {}
    builders = []
    for flat in engine.flat_spaces():
        for i, sub in flat.optimizer_subs(st.index).items():
            entries = index.get(names[id(flat.params[i])], {})
            if entries:
                builders.append((sub, _plan_sub_shard(flat, i, sub, entries, st.metadata, dest)))
    _load_items(comm, dest, st, name=f"checkpoint/load/optimizer={st.index}")
    for sub, build in builders:
        optimizer.state[sub] = build()


def _plan_sub_shard(flat, i, sub, entries, metadata, dest) -> Callable[[], dict]:
    """Register what one sub-shard reads into ``dest``; return what assembles its state after.

    Per-element states: a buffer shaped like the sub-shard, read from its slice of the parameter's
    flattening. Scalars (step): read whole; empty sub-shards get them too, as the optimizer gave them.
    """
    start, stop, offset = flat.slices[i]
    mds = metadata.state_dict_metadata
    per_element: dict[str, Tensor] = {}
    scalars: dict[str, str] = {}
    for sname, fqn in entries.items():
        md = mds[fqn]
        if not _is_per_element(md):
            dest.setdefault(fqn, _destination(md))
            scalars[sname] = fqn
            continue
        dtype = sub.dtype if md.properties.dtype.is_floating_point else md.properties.dtype
        buf = torch.zeros(stop - start, dtype=dtype, device=sub.device)
        if stop > start:
            dest[fqn] = Piece(buf, offset, flat.shapes[i].numel())
        per_element[sname] = buf

    def build() -> dict[str, Any]:
        state: dict[str, Any] = {
            k: like_param(sub, v.view(flat.local_shape(i))) if flat.rows else v
            for k, v in per_element.items()
        }
        for sname, fqn in scalars.items():
            value = _unbox(dest[fqn])
            if isinstance(value, Tensor) and value.dim() > 0:
                raise CheckpointError(
                    f"optimizer state {fqn} is a tensor of shape {tuple(value.shape)}, neither per-element nor "
                    "a scalar: a sharded stage cannot split it. Resume with stage 0 (strategy='zero0')"
                )
            state[sname] = value.clone() if isinstance(value, Tensor) else value
        return state

    return build
