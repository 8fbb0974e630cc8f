"""Fabric's checkpoint state and the Trainer's checkpoint dict: one file format for both glues.

[Note: Fabric state keys]
``fabric.save(path, state)`` takes the user's own dict, e.g. ``{"model": model, "optimizer":
optimizer, "scheduler": scheduler, "iter_num": 3}``. Each object is saved in its *role*: the model
this strategy set up as the whole model's state dict under the original names (the sharded form:
this rank's slices), its optimizers as the state one process has (original parameter indices; all
of them, or none: a weights-only save), LR schedulers and other objects with ``state_dict()`` as
that, everything else as it is; the precision plugin's state, when it has one (the fp16 loss scale),
under the plugin's class name, where the Trainer files it.

The full form keeps the user's keys, as Fabric's DDP writes them: ``torch.load(path)["model"]`` is
the model's plain state dict and ``["optimizer"]`` the plain optimizer's ``state_dict()``. One entry
is added, ``lightning_zero_fabric``: the user's key of each role, ``{"model": "model",
"optimizers": ["optimizer"], "lr_schedulers": ["scheduler"], "layout": "user keys", "lightning":
<version>}``, from which the checkpoint package reads the file in the Trainer's layout (see [Note:
two layouts of the full file] in checkpoint/layout.py): a Trainer resumes it. The sharded form is
written in the Trainer's layout (``state_dict``, ``optimizer_states`` numbered in set-up order,
``lr_schedulers`` in ``state`` order, ``pytorch-lightning_version``) with the same record, without
``"layout"``.

A full file under the user's keys without the record, as Fabric's DDP writes it, loads by the keys
of the state it is loaded into (the model's key holds its state dict, each optimizer's key its
``state_dict()``), as Fabric's DDP loads it; ``fabric.load(path)`` returns its entries as they are.

Loading maps the roles back whatever the user's keys are now: the model in ``state`` takes
``state_dict``, the i-th optimizer set up takes ``optimizer_states[i]``, the j-th LR scheduler in
``state`` takes ``lr_schedulers[j]``; other keys are looked up by name. A Trainer checkpoint has the
same roles (and no ``lightning_zero_fabric``), so it loads the same way; what is not asked for
(``global_step``, ``loops``, ``callbacks``, ...) comes back in the remainder.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import lightning
from torch.optim.lr_scheduler import LRScheduler

from lightning_zero.checkpoint.format import FABRIC_RECORD, INTEGRITY_KEY, USER_KEYS

MODEL = "state_dict"  # the Trainer's key of the model state
OPTIMIZERS = "optimizer_states"  # ... of the optimizers' states, a list
SCHEDULERS = "lr_schedulers"  # ... of the LR schedulers' states, a list
VERSION = "pytorch-lightning_version"  # the Trainer reads it before anything else
ROLES = FABRIC_RECORD  # the user's keys of the entries above (a Fabric save)
RESERVED = (MODEL, OPTIMIZERS, SCHEDULERS, VERSION, ROLES, INTEGRITY_KEY)  # not available as the user's keys


class Roles(NamedTuple):
    """The user's keys of the entries the Trainer knows by name."""

    model: str | None  # key of the strategy's model
    optimizers: dict[int, str]  # optimizer index (set-up order) -> its key
    lr_schedulers: list[str]  # keys of the LR schedulers, in ``state`` order

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizers": [self.optimizers[i] for i in sorted(self.optimizers)],
            "lr_schedulers": list(self.lr_schedulers),
        }

    def keys(self) -> set[str]:
        return {k for k in (self.model, *self.optimizers.values(), *self.lr_schedulers) if k is not None}


def is_scheduler(obj: Any) -> bool:
    return isinstance(obj, LRScheduler)


def check_user_keys(state: Mapping[str, Any], roles: Roles, precision_key: str | None) -> None:
    """The user's other keys must not collide with the entries the roles are saved under."""
    taken = set(RESERVED) | ({precision_key} if precision_key else set())
    clash = sorted((set(state) - roles.keys()) & taken)
    if clash:
        raise KeyError(
            f"state key(s) {clash} are where a Lightning checkpoint keeps the model, optimizers, LR schedulers, "
            "precision state or checksums (see [Note: Fabric state keys]): rename them in the dict passed to "
            "fabric.save"
        )


def lightning_entries(roles: Roles, *, user_keys: bool) -> dict[str, Any]:
    """What every Fabric save adds for the Trainer: the user's keys of the roles and the Lightning
    version (``user_keys``: the entries are under the user's keys, the version in the record)."""
    if user_keys:
        return {ROLES: user_keys_record(roles)}
    return {VERSION: lightning.__version__, ROLES: roles.as_dict()}


def user_keys_record(roles: Roles) -> dict[str, Any]:
    """The record of a full file under the user's keys (see [Note: two layouts of the full file])."""
    return {**roles.as_dict(), "layout": USER_KEYS, "lightning": lightning.__version__}


def as_saved(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The entries of a checkpoint Fabric saved under the keys the user saved them with (those that
    are still there: a load takes out what it restored); a Trainer checkpoint, which has no record
    of such keys, as it is."""
    roles = checkpoint.pop(ROLES, None)
    if roles is None:
        return checkpoint
    checkpoint.pop(VERSION, None)
    if roles["model"] is not None and MODEL in checkpoint:
        checkpoint[roles["model"]] = checkpoint.pop(MODEL)
    for key, value in zip(roles["optimizers"], checkpoint.pop(OPTIMIZERS, [])):
        checkpoint[key] = value
    for key, value in zip(roles["lr_schedulers"], checkpoint.pop(SCHEDULERS, [])):
        checkpoint[key] = value
    return checkpoint


def check_requested(
    requested: Mapping[str, Any], roles: Roles, checkpoint: Mapping[str, Any], path: Any
) -> None:
    """Strict loading: every object asked for has its entry in the checkpoint."""
    missing = [repr(k) for k in requested if k not in roles.keys() and k not in checkpoint]
    if roles.model is not None and MODEL not in checkpoint:
        missing.append(f"{roles.model!r} (as {MODEL!r})")
    saved = len(checkpoint.get(OPTIMIZERS, []))
    missing += [
        f"{key!r} (as {OPTIMIZERS}[{i}])" for i, key in sorted(roles.optimizers.items()) if i >= saved
    ]
    saved = len(checkpoint.get(SCHEDULERS, []))
    missing += [f"{key!r} (as {SCHEDULERS}[{j}])" for j, key in enumerate(roles.lr_schedulers) if j >= saved]
    if missing:
        raise KeyError(
            f"the checkpoint {path} holds no entry for {', '.join(missing)}; it holds "
            f"{sorted(map(str, checkpoint))[:12]}. Pass strict=False to load what it has"
        )
