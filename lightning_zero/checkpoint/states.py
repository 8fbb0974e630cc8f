"""What a save puts in a checkpoint for the model and each optimizer, in either form (the writer's
lay-out step), asked of the engine in one place for both glues (the Trainer's strategy and
Fabric's): the full form whole, the values that live in shards as
:class:`~lightning_zero.streamed.Streamed` stand-ins gathered while the file is written (see [Note:
streamed full checkpoints]); the sharded form as this rank's slices, without copies (see [Note:
sharded layout] in ``layout.py``)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.format import CheckpointError, Piece, _box, _hyper, _Kept
from lightning_zero.checkpoint.layout import _group_params, _named_groups, _names, _slots
from lightning_zero.comm import Communicator
from lightning_zero.streamed import Resolver, Streamed
from lightning_zero.streamed import Source as StreamSource
from lightning_zero.zero.dtensor import local_of
from lightning_zero.zero.flat_param import full_optimizer_state, original_indices


def model_state(module: nn.Module, engine: Any, *, sharded: bool) -> dict[str, Any]:
    """The model's entry. Full form: the whole model under the original names, values that live in
    shards as Streamed tensors (see [Note: streamed full checkpoints]); sharded form: this rank's
    slices. Every rank calls it."""
    if sharded:
        return sharded_model_state(module, engine)
    engine.take_back()  # see [Note: taking back parameter changes] in engines.py
    if engine.streams_values:
        return streamed_model_state(module, engine)
    return engine.module_state_dict(module)


def optimizer_state(
    module: nn.Module, engine: Any, optimizer: Optimizer, index: int, *, sharded: bool
) -> dict:
    """The ``index``-th optimizer's entry: as one process has it (full form; its per-element
    state as Streamed tensors at stages 1-3), or this rank's slices by parameter name (sharded)."""
    if sharded:
        return sharded_optimizer_state(module, engine, optimizer, index)
    if engine.sharded:
        return streamed_optimizer_state(engine, optimizer, index)
    return engine.optimizer_state(optimizer, index)


# --------------------------------------------------------------------------- the full form: streamed


def gather_optimizer_state(
    engine: Any, optimizer: Optimizer, index: int, comm: Communicator
) -> dict[str, Any]:
    """Stages 1-3: the optimizer's state as one process has it, assembled in rank 0's memory only
    (the others return ``{}``), one flat space and one state name at a time; every rank calls it.
    Checkpoints do not use it: they write the state while gathering it (:func:`streamed_optimizer_state`)."""
    groups = engine.group_params(optimizer, index)
    return full_optimizer_state(optimizer, index, engine.flat_spaces(), groups, comm, engine.label, dst=0)


def streamed_model_state(module: nn.Module, engine: Any) -> dict[str, Any]:
    """The full form's model state with stand-ins for the parameters that live in shards: the
    values the optimizer holds (fp32 masters under a policy), written as they are gathered."""
    stand_ins: dict[int, Any] = {}
    resolve = resolver(engine)
    for s, space in enumerate(engine.param_spaces()):
        for i, (p, shape) in enumerate(zip(space.params, space.shapes)):
            stand_ins[id(p)] = Streamed(StreamSource(s, i, None), shape, space.shard.dtype, resolve)
    state = module.state_dict(keep_vars=True)
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in stand_ins:
            state[name] = stand_ins[id(p)]
    return {
        k: v.detach() if isinstance(v, Tensor) and not isinstance(v, Streamed) else v
        for k, v in state.items()
    }


def resolver(engine: Any) -> Resolver:
    """What a :class:`Streamed` of ``engine``'s spaces gathers its values with (every rank)."""
    return Resolver(functools.partial(_all_gather_space, engine), engine.param_spaces())


def streamed_optimizer_state(engine: Any, optimizer: Optimizer, index: int) -> dict[str, Any]:
    """Stages 1-3: the optimizer's state as one process has it, per-element states as stand-ins
    gathered while the file is written; step counts and other scalars as they are."""
    groups = engine.group_params(optimizer, index)
    ids = original_indices(groups)
    resolve = resolver(engine)
    state: dict[int, dict[str, Any]] = {}
    for s, space in enumerate(engine.param_spaces()):
        for i, sub in space.optimizer_subs(index).items():
            entry = state.setdefault(ids[id(space.params[i])], {})
            for sname, value in optimizer.state.get(sub, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and sname != "step":
                    source = StreamSource(s, i, (index, sname))
                    entry[sname] = Streamed(source, space.shapes[i], value.dtype, resolve)
                else:
                    entry[sname] = value.to("cpu", copy=True) if isinstance(value, Tensor) else value
    param_groups = [
        {**_hyper(g), "params": [ids[id(p)] for p in ps]} for g, ps in zip(optimizer.param_groups, groups)
    ]
    return {"state": dict(sorted((k, v) for k, v in state.items() if v)), "param_groups": param_groups}


def _gather_space(engine: Any, comm: Communicator, space: int, what: tuple[int, str] | None) -> Tensor | None:
    """The full padded values of one flat space (its parameters, or one per-element state of one
    optimizer), on rank 0 only; every rank calls it. Gathered in the group the engine shards over
    (with hybrid sharding, every shard group gathers its copy: the ranks stay in step, and rank 0
    is the first group's first rank)."""
    chunk = _own_values(engine, space, what)
    group = engine.comm
    full = (
        torch.empty(engine.param_spaces()[space].padded_numel, dtype=chunk.dtype, device=chunk.device)
        if group.rank == 0
        else None
    )
    group.gather(full, chunk, dst=0, name=f"{engine.label}/gather/checkpoint")
    return full if comm.rank == 0 else None


def _all_gather_space(engine: Any, space: int, what: tuple[int, str] | None) -> Tensor:
    """As :func:`_gather_space`, on every rank (a :class:`Streamed` used as a tensor)."""
    chunk = _own_values(engine, space, what)
    full = torch.empty(engine.param_spaces()[space].padded_numel, dtype=chunk.dtype, device=chunk.device)
    engine.comm.all_gather(full, chunk, name=f"{engine.label}/all_gather/checkpoint_tensor", async_op=False)
    return full


def _own_values(engine: Any, space: int, what: tuple[int, str] | None) -> Tensor:
    """This rank's chunk (1D, shard_numel) of one space's parameters or per-element state."""
    flat = engine.param_spaces()[space]
    if what is None:
        chunk = flat.shard.detach()
    else:
        index, sname = what
        optimizer = engine.optimizer_of(index)
        values = {i: optimizer.state.get(sub, {}).get(sname) for i, sub in flat.optimizer_subs(index).items()}
        sample = next(v for v in values.values() if v is not None)
        chunk = torch.zeros(flat.shard_numel, dtype=sample.dtype, device=sample.device)
        for i, value in values.items():
            if value is not None:
                chunk[flat.slices[i].start : flat.slices[i].stop].copy_(local_of(value).reshape(-1))
    return chunk


# --------------------------------------------------------------------------- the sharded form: slices


def sharded_model_state(module: nn.Module, engine: Any) -> dict[str, Any]:
    """This rank's part of the model, without copies: state-dict key -> Piece, tensor or object.

    Parameters are flattened (see [Note: sharded layout]); a parameter of a flat space of which
    this rank holds nothing is left out; tied parameters appear under their first name only.
    """
    names = _names(module)
    slots = _slots(module, engine)
    state: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if key in names.aliases:
            continue
        slot = slots.get(key)
        if slot is not None:
            if slot.piece is not None or slot.whole is not None:
                state[key] = slot.piece if slot.piece is not None else slot.whole.reshape(-1)
        elif isinstance(value, Tensor):
            is_param = id(value) in names.of
            state[key] = value.detach().reshape(-1) if is_param else value.detach()
        else:
            state[key] = _box(value)
    return state


def sharded_optimizer_state(
    module: nn.Module, engine: Any, optimizer: Optimizer, index: int
) -> dict[str, Any]:
    """This rank's part of an optimizer's state, by parameter name (no copies).

    ``{"state": {name: {state name: Piece | tensor | object}}, "param_groups": [...]}``, the
    groups' ``params`` given as names.
    """
    names = _names(module).of
    groups = _group_params(engine, optimizer, index)
    if any(id(p) not in names for params in groups for p in params):
        raise CheckpointError(
            f"{type(optimizer).__name__} {index} steps tensors that are not parameters of "
            f"{type(module).__name__} (after fitting, a sharded stage's optimizer keeps the shards it "
            "stepped): save checkpoints while fitting, e.g. with ModelCheckpoint"
        )
    if engine is not None and engine.sharded:
        state = _sub_shard_pieces(engine, optimizer, index, names)
    else:
        state = _whole_states(optimizer, names, groups)
    return {"state": state, "param_groups": _named_groups(optimizer, groups, names)}


def _whole_states(optimizer: Optimizer, names: dict[int, str], groups: list) -> dict[str, dict[str, Any]]:
    """Stage 0: each parameter's state as it is, per-element tensors flattened."""
    state: dict[str, dict[str, Any]] = {}
    for group, params in zip(optimizer.param_groups, groups):
        for stepped, p in zip(group["params"], params):
            for sname, value in optimizer.state.get(stepped, {}).items():
                state.setdefault(names[id(p)], {})[sname] = _whole_item(sname, value, stepped.shape)
    return state


def _whole_item(sname: str, value: Any, shape: torch.Size) -> Any:
    if not isinstance(value, Tensor):
        return _Kept(value)
    if sname != "step" and value.shape == shape:  # per-element, as flat_param's rule has it
        return value.detach().reshape(-1)
    return value.detach() if value.dim() == 0 else _Kept(value.detach())


def _sub_shard_pieces(engine: Any, optimizer: Optimizer, index: int, names: dict[int, str]) -> dict:
    """Stages 1-3: per parameter, its sub-shard's state: per-element state as a Piece of the
    parameter's flattening (left out where this rank holds none of it), scalars as they are."""
    state: dict[str, dict[str, Any]] = {}
    for flat in engine.flat_spaces():
        for i, sub in flat.optimizer_subs(index).items():
            start, stop, offset = flat.slices[i]
            for sname, value in optimizer.state.get(sub, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    if start == stop:
                        continue
                    item = Piece(local_of(value).detach().reshape(-1), offset, flat.shapes[i].numel())
                else:
                    item = value.detach() if isinstance(value, Tensor) else _Kept(value)
                state.setdefault(names[id(flat.params[i])], {})[sname] = item
    return state
