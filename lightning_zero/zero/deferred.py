"""Deferred (meta-device) initialisation at stage 3: a model built without memory, given values one
module at a time as its units are sharded.

[Note: deferred initialisation]
Under ``trainer.init_module(empty_init=True)`` and in ``configure_model`` the strategy creates
modules on the meta device (shapes and dtypes, no storage) and records rank 0's CPU random state.
At setup the modules are visited children first (the order constructors run in: a module's
children exist before its own ``reset_parameters`` runs at the end of its ``__init__``); each
module's own parameters and buffers get host memory and their values from the module's
``reset_parameters()`` and then, if given, ``param_init_fn(module)`` (for models that initialise
elsewhere, e.g. a GPT's ``_init_weights``). As soon as every module of a wrap unit has its
values, the unit is flattened, sharded and its full storage freed, so a rank never holds more than
its shards, the root unit's parameters and one unit. Every rank replays rank 0's random state, so
all ranks compute the same values without a collective, and those values equal what the same
model built normally, right where the context was entered, with rank 0's random state would hold
when its initialisation comes from ``reset_parameters`` alone. With ``param_init_fn`` the values
follow the same distributions but not the same numbers: built normally, every constructor's
``reset_parameters`` runs before the model's own init pass; here both run module by module. A
module holding meta tensors but neither ``reset_parameters`` nor a
``param_init_fn`` is an error that names it: its values would be whatever memory held.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

InitFn = Callable[[nn.Module], None]


def resolve_init_fn(param_init_fn: Any) -> InitFn | None:
    """A callable from a callable or a ``package.module.function`` import path."""
    if param_init_fn is None or callable(param_init_fn):
        return param_init_fn
    module_name, _, name = str(param_init_fn).rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"param_init_fn {param_init_fn!r} cannot be imported: {err}") from err
    if not callable(fn):
        raise ValueError(f"param_init_fn {param_init_fn!r} is not callable")
    return fn


def is_deferred(module: nn.Module) -> bool:
    """The module (or part of it) was built on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def post_order(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module, children before their parent (the order constructors end in)."""
    out: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, module))

    visit("", root)
    return out


class Initializer:
    """Gives meta modules host memory and values (see [Note: deferred initialisation]).

    Args:
        init_fn: called on every module that owns meta tensors, children first, after the
            module's own ``reset_parameters()`` (if it has one); None: that alone.
        rng_state: the CPU random state to initialise with (rank 0's, so all ranks agree).
    """

    def __init__(self, init_fn: InitFn | None, rng_state: torch.Tensor) -> None:
        self.init_fn = init_fn
        self.rng_state = rng_state
        self._saved: torch.Tensor | None = None  # the caller's random state, restored afterwards
        self._touched: set[int] = set()  # modules whose tensors (or their children's) were given values

    def __enter__(self) -> Initializer:
        self._saved = torch.get_rng_state()
        torch.set_rng_state(self.rng_state)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self._saved)

    def materialize(self, name: str, module: nn.Module) -> None:
        """Host memory and values for the module's own meta parameters and buffers; its init also
        runs when only its children had meta tensors (its ``reset_parameters`` may set theirs, as it
        does at the end of its ``__init__``)."""
        own = _own_meta(module)
        if not own and not any(id(c) in self._touched for c in module.children()):
            return
        self._touched.add(id(module))
        reset = getattr(module, "reset_parameters", None)
        if own and reset is None and self.init_fn is None:
            raise ValueError(
                f"module {name or '(root)'!r} ({type(module).__module__}.{type(module).__qualname__}) was built on the "
                f"meta device and holds {', '.join(own)}, but has no reset_parameters() to give them values. "
                "Pass param_init_fn (a callable taking a module, or its import path) to the strategy, "
                "or build the model outside init_module(empty_init=True) / configure_model."
            )
        _to_host(module)
        with torch.no_grad():
            if reset is not None:
                reset()
            if self.init_fn is not None:
                self.init_fn(module)
        if left := _own_meta(module):
            raise ValueError(
                f"module {name or '(root)'!r}: {', '.join(left)} still on the meta device after its init"
            )


def _to_host(module: nn.Module) -> None:
    """Uninitialised host memory for the module's own meta tensors. Parameters keep their identity
    (``swap_tensors``): optimizers and hooks made while the model was on the meta device still
    refer to them."""
    for p in module.parameters(recurse=False):
        if p.is_meta:
            torch.utils.swap_tensors(
                p, nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
            )
    for name, b in module.named_buffers(recurse=False):
        if b is not None and b.is_meta:
            module._buffers[name] = torch.empty_like(b, device="cpu")


def _own_meta(module: nn.Module) -> list[str]:
    """Names of the module's own (not its children's) parameters and buffers on the meta device."""
    own = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
    return [n for n, t in own if t is not None and t.is_meta]
