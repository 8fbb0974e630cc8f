"""Who holds what: parameter names (tied ones), the parts of flat spaces in this rank's shard, the
layout meta.pt records, and the checks of keys and shapes a load makes."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.format import FORMAT, FORMAT_VERSION, CheckpointError, Piece, _hyper
from lightning_zero.zero.flat_param import FlatParameter

# --------------------------------------------------------------------------- names and layout


class _Names(NamedTuple):
    of: dict[int, str]  # id(param) -> its first name (registration order), the saved one
    aliases: dict[str, str]  # another name of a tied parameter -> its first name


def _names(module: nn.Module) -> _Names:
    of: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in of:
            aliases[name] = of[id(p)]
        else:
            of[id(p)] = name
    return _Names(of, aliases)


class _Overlap(NamedTuple):
    """The part of one parameter of a flat space that lies in this rank's shard."""

    param: nn.Parameter
    position: int  # the parameter's position in its flat space
    numel: int  # elements of the whole parameter
    start: int  # first element inside the shard (1D, shard_numel)
    stop: int  # one past the last
    offset: int  # the first element's index in the parameter's flattening


def _overlaps(flat: FlatParameter) -> list[_Overlap]:
    """This rank's part of every parameter of ``flat`` (empty parts left out)."""
    return [
        _Overlap(p, i, shape.numel(), start, stop, offset)
        for i, (p, shape, (start, stop, offset)) in enumerate(zip(flat.params, flat.shapes, flat.slices))
        if start < stop
    ]


def _spaces(engine: Any) -> list[FlatParameter]:
    """The flat spaces holding parameter values (frozen ones too, at stage 3)."""
    return engine.param_spaces() if engine is not None else []


class _Slot(NamedTuple):
    """Where a parameter's value lives on this rank when it is not simply the module's parameter."""

    shape: torch.Size  # the parameter's shape
    piece: Piece | None  # flat space: the part in this rank's shard (None: no part here)
    whole: Tensor | None  # kept whole but stepped as another tensor (an fp32 master)


def _slots(module: nn.Module, engine: Any) -> dict[str, _Slot]:
    """name -> slot for the parameters in flat spaces or with a whole master (first names only)."""
    names = _names(module).of
    slots: dict[str, _Slot] = {}
    for flat in _spaces(engine):
        parts = {id(o.param): o for o in _overlaps(flat)}
        for p, shape in zip(flat.params, flat.shapes):
            o = parts.get(id(p))
            piece = Piece(flat.shard.detach()[o.start : o.stop], o.offset, o.numel) if o else None
            slots[names[id(p)]] = _Slot(shape, piece, None)
    if engine is not None:
        for pid, master in engine.whole_values().items():
            slots[names[pid]] = _Slot(master.shape, None, master.detach())
    return slots


def layout_of(module: nn.Module, engine: Any, stage: int, world_size: int) -> dict[str, Any]:
    """What meta.pt records besides Lightning's entries: parameter shapes, aliases, key order."""
    names = _names(module)
    slots = _slots(module, engine)
    shapes = {
        name: list(slots[name].shape if name in slots else p.shape) for name, p in module.named_parameters()
    }
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "stage": stage,  # of the run that wrote it (informative: any stage reads it)
        "world_size": world_size,  # likewise
        "keys": list(module.state_dict(keep_vars=True).keys()),  # the model's state-dict keys, in order
        "shapes": shapes,  # parameter (first name) -> shape; saved flattened
        "aliases": names.aliases,  # tied parameters' other names -> first name
        "optimizers": None,  # per optimizer: param groups, parameters by name (set by save_sharded)
    }


def _group_params(engine: Any, optimizer: Optimizer, index: int) -> list[list[nn.Parameter]]:
    if engine is None:
        return [list(g["params"]) for g in optimizer.param_groups]
    return engine.group_params(optimizer, index)


def _named_groups(optimizer: Optimizer, groups: list, names: dict[int, str]) -> list[dict[str, Any]]:
    return [
        {**_hyper(group), "params": [names[id(p)] for p in params]}
        for group, params in zip(optimizer.param_groups, groups)
    ]


def _check_keys(module: nn.Module, given: set[str], strict: bool, source: Any) -> None:
    expected = set(module.state_dict(keep_vars=True))
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"the checkpoint {source} does not match {type(module).__name__}: "
            f"missing {len(missing)} key(s) {missing[:8]}, unexpected {len(unexpected)} key(s) {unexpected[:8]}. "
            "Set LightningModule.strict_loading = False to load only the keys both have"
        )


def _check_shape(key: str, saved: Any, here: Any, source: Any) -> None:
    if tuple(saved) != tuple(here):
        raise CheckpointError(
            f"{source}: {key} has shape {tuple(saved)} in the checkpoint, {tuple(here)} here"
        )
