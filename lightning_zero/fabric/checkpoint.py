"""``fabric.save`` and ``fabric.load`` in terms of the run's checkpoints: the user's state dict
mapped to roles (model, optimizers, LR schedulers, the rest) and back (see [Note: Fabric state
keys] in ``state.py``). The files are written and read by the run (``runtime.py``), as the Trainer's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_zero import checkpoint as checkpoints
from lightning_zero.checkpoint.layout import UserKeyedCheckpoint, as_trainer_layout
from lightning_zero.checkpoint.states import model_state, optimizer_state
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import Engine
from lightning_zero.fabric import state as fstate
from lightning_zero.runtime import ZeroRun

Filter = Mapping[str, Callable[[str, Any], bool]]


class Glue(Protocol):
    """What these functions use of the Fabric strategy (``ZeroFabricStrategy``)."""

    _run: ZeroRun
    _module: nn.Module | None
    _optimizers: list[Optimizer]
    root_device: torch.device
    checkpoint_io: CheckpointIO
    precision: Precision
    config: ZeroConfig

    def _ready(self) -> Engine: ...

    def _owns(self, module: Any) -> bool: ...

    def _index(self, optimizer: Any, key: str | None = None) -> int: ...


def save(strategy: Glue, path: Any, state: Mapping[str, Any], storage_options: Any, filter: Filter) -> None:
    """``fabric.save``: the Trainer's checkpoint format; a full file written by rank 0 or a sharded
    directory written by every rank, complete or absent. All ranks call it."""
    strategy._ready()
    sharded = strategy.config.state_dict_type == "sharded"
    if sharded and filter:
        raise ValueError("filter: a sharded checkpoint holds whole models only; use state_dict_type='full'")
    if sharded and storage_options is not None:
        raise TypeError("storage_options: sharded checkpoints are written by DCP, not CheckpointIO")
    run = strategy._run
    path = run.shared_path(path, strategy.root_device)
    checkpoint = _entries(strategy, state, sharded, filter)
    run.save(checkpoint, path, strategy._module, strategy.checkpoint_io, storage_options)


def load(
    strategy: Glue,
    path: Any,
    state: dict[str, Any] | None,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """``fabric.load``: a checkpoint written by either glue, either form, any stage and world size,
    or a full file of Fabric's DDP, into the objects of ``state``; returns the entries not asked for."""
    run = strategy._run
    path = run.shared_path(path, strategy.root_device)
    roles = roles_of(strategy, state or {}, saving=False)
    try:
        checkpoint = run.read(path, strategy.checkpoint_io, weights_only, fall_back=False)
    except UserKeyedCheckpoint as err:  # Fabric's DDP wrote it: the keys are the state's
        if not state:
            return dict(err.entries)
        record = fstate.user_keys_record(roles)
        checkpoint = {**as_trainer_layout(err.entries, record), fstate.ROLES: record}
    if not state:
        if isinstance(checkpoint.get(fstate.MODEL), checkpoints.ShardedModelState):
            raise checkpoints.CheckpointError(
                f"{path} is a sharded checkpoint: it loads into objects, fabric.load(path, {{'model': model, ...}}), "
                "or turns into one file with: lightning-zero consolidate PATH OUT.ckpt"
            )
        return fstate.as_saved(checkpoint)
    if strict:
        fstate.check_requested(state, roles, checkpoint, path)
    _load_roles(strategy, checkpoint, state, roles, strict)
    for key, obj in state.items():
        if key in roles.keys() or key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if isinstance(obj, _Stateful):
            obj.load_state_dict(value)
        else:
            state[key] = value
    return fstate.as_saved(_without_stand_ins(checkpoint))


def load_raw(
    strategy: Glue,
    path: Any,
    obj: nn.Module | Optimizer,
    strict: bool,
    weights_only: bool | None,
) -> None:
    """``fabric.load_raw``: a bare state dict (a module's, or an optimizer's single-process one).
    Weights only unless ``weights_only=False`` says the caller trusts the file: Lightning would read
    ``None`` as ``False`` for a remote path ([Note: what loading runs] in checkpoint/unpickle.py)."""
    path = strategy._run.shared_path(path, strategy.root_device)
    raw = strategy.checkpoint_io.load_checkpoint(path, weights_only=weights_only is not False)
    if isinstance(obj, Optimizer):
        strategy._ready().load_optimizer_state(obj, strategy._index(obj), raw)
    elif strategy._owns(obj):
        strategy._run.load_model(strategy._module, raw, strict=strict)
    else:
        obj.load_state_dict(raw, strict=strict)


def roles_of(strategy: Glue, state: Mapping[str, Any], *, saving: bool) -> fstate.Roles:
    """Which of the user's keys hold the model, the optimizers and the LR schedulers (a save
    needs the model; a load reads what is asked for)."""
    model, optimizers, schedulers = None, {}, []
    for key, obj in state.items():
        if strategy._owns(obj):
            if model is not None:
                raise ValueError(f"the model is in the state twice, under {model!r} and {key!r}")
            model = key
        elif isinstance(obj, Optimizer):
            index = strategy._index(obj, key)
            if index in optimizers:
                raise ValueError(
                    f"one optimizer is in the state twice, under {optimizers[index]!r} and {key!r}"
                )
            optimizers[index] = key
        elif fstate.is_scheduler(obj):
            schedulers.append(key)
    if model is None and saving:
        raise ValueError(
            "the state holds no model set up by this strategy: pass it like "
            "fabric.save(path, {'model': model, 'optimizer': optimizer, ...}) (the object fabric.setup returned)"
        )
    count = len(strategy._optimizers)
    if saving and optimizers and len(optimizers) != count:
        raise ValueError(
            f"the state holds {len(optimizers)} of the {count} optimizers set up: a checkpoint "
            "holds all of them (optimizer_states, in set-up order) or none"
        )
    return fstate.Roles(model, optimizers, schedulers)


def _entries(strategy: Glue, state: Mapping[str, Any], sharded: bool, filter: Filter) -> dict[str, Any]:
    """What ``fabric.save`` writes: the full form under the user's keys, as Fabric's DDP writes it;
    the sharded form in the Trainer's layout; either with the precision plugin's state and the record."""
    roles = roles_of(strategy, state, saving=True)
    precision = strategy.precision
    precision_key, precision_state = type(precision).__qualname__, precision.state_dict()
    fstate.check_user_keys(state, roles, precision_key if precision_state else None)
    module, engine, optimizers = strategy._module, strategy._ready(), strategy._optimizers
    index_of = {key: i for i, key in roles.optimizers.items()}
    checkpoint: dict[str, Any] = {}
    for key, obj in state.items():
        if sharded and key in roles.keys():
            continue  # filed under the Trainer's keys below
        if key == roles.model:
            checkpoint[key] = model_state(module, engine, sharded=False)
        elif key in index_of:
            checkpoint[key] = optimizer_state(module, engine, obj, index_of[key], sharded=False)
        else:
            checkpoint[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
    if sharded:
        checkpoint[fstate.MODEL] = model_state(module, engine, sharded=True)
        if roles.optimizers:
            checkpoint[fstate.OPTIMIZERS] = [
                optimizer_state(module, engine, optimizers[i], i, sharded=True)
                for i in sorted(roles.optimizers)
            ]
        checkpoint[fstate.SCHEDULERS] = [state[key].state_dict() for key in roles.lr_schedulers]
    checkpoint = {key: _filtered(key, filter, value) for key, value in checkpoint.items()}
    if precision_state:
        checkpoint[precision_key] = precision_state
    checkpoint.update(fstate.lightning_entries(roles, user_keys=not sharded))
    return checkpoint


def _load_roles(
    strategy: Glue,
    checkpoint: dict[str, Any],
    state: Mapping[str, Any],
    roles: fstate.Roles,
    strict: bool,
) -> None:
    """The model, the optimizers and LR schedulers asked for (each rank its part of the model and the
    optimizers; sharded: read in place), and the precision plugin's state (the fp16 loss scale)."""
    run, module = strategy._run, strategy._module
    if roles.model is not None and fstate.MODEL in checkpoint:
        run.load_model(module, checkpoint.pop(fstate.MODEL), strict=strict)
    if roles.optimizers and fstate.OPTIMIZERS in checkpoint:
        states = checkpoint.pop(fstate.OPTIMIZERS)
        run.load_optimizers(
            module, strategy._optimizers, states, strategy.root_device, sorted(roles.optimizers)
        )
    saved = checkpoint.get(fstate.SCHEDULERS, [])
    for key, scheduler_state in zip(roles.lr_schedulers, saved):
        state[key].load_state_dict(scheduler_state)
    if roles.lr_schedulers:
        checkpoint.pop(fstate.SCHEDULERS, None)
    key = type(strategy.precision).__qualname__  # filed under its class name, as the Trainer does
    if key in checkpoint:
        strategy.precision.load_state_dict(checkpoint.pop(key))


def _filtered(key: str | None, filter: Filter, value: Any) -> Any:
    """Fabric's ``save(..., filter={key: fn})``: the items of a dict entry for which ``fn`` is true."""
    if key not in filter or not isinstance(value, Mapping):
        return value
    return {k: v for k, v in value.items() if filter[key](k, v)}


def _without_stand_ins(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint's model and optimizer entries that were not loaded: they stand for data
    only a load reads, so they are left out of what ``fabric.load`` returns."""
    if isinstance(checkpoint.get(fstate.MODEL), checkpoints.ShardedModelState):
        del checkpoint[fstate.MODEL]
    if any(isinstance(s, checkpoints.ShardedOptimizerState) for s in checkpoint.get(fstate.OPTIMIZERS, [])):
        del checkpoint[fstate.OPTIMIZERS]
    return checkpoint
