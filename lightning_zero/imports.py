"""Options given as import paths (``package.module.Name``), resolved where the value enters.

A leaf module: the configuration checks its values with it without importing the engines, and
the engines resolve the same values with it when they are built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any


def import_object(path: str, *, option: str) -> Any:
    """The object ``path`` names; a ValueError naming ``option`` and the path if it does not import."""
    module_name, _, name = str(path).rpartition(".")
    if not module_name:
        raise ValueError(f"{option} {path!r} must be an import path like 'package.module.Name'")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{option} {path!r} cannot be imported: {err}") from err


def resolve_classes(entries: Iterable[str | type], *, option: str = "wrap_policy class") -> tuple[type, ...]:
    """Classes from classes or import paths."""
    classes = []
    for entry in entries:
        cls = entry if isinstance(entry, type) else import_object(entry, option=option)
        if not isinstance(cls, type):
            raise ValueError(f"{option} {entry!r} is not a class")
        classes.append(cls)
    return tuple(classes)


def resolve_optimizer_classes(entries: Iterable[str | type]) -> tuple[type, ...]:
    """Optimizer classes from classes or import paths (``elementwise_optimizers``)."""
    from torch.optim import Optimizer

    classes = resolve_classes(entries, option="elementwise_optimizers:")
    for cls in classes:
        if not issubclass(cls, Optimizer):
            raise ValueError(f"elementwise_optimizers: {cls!r} is not a torch.optim.Optimizer subclass")
    return classes


def resolve_init_fn(param_init_fn: Any) -> Callable | None:
    """A callable from a callable or an import path (``param_init_fn``)."""
    if param_init_fn is None or callable(param_init_fn):
        return param_init_fn
    fn = import_object(param_init_fn, option="param_init_fn")
    if not callable(fn):
        raise ValueError(f"param_init_fn {param_init_fn!r} is not callable")
    return fn
