"""Wrap policies: which modules become stage-3 units (one flat parameter each).

A policy is a module class (or several, given as classes or import paths such as
``"examples.gpt.Block"``), a parameter-count threshold (``min_num_params``), or any callable
``(module, name) -> bool``. Units may nest: a unit owns the parameters of its subtree that no
nested unit owns. Parameters outside every unit belong to the root unit (the whole model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_zero.imports import resolve_classes

WrapPolicy = Callable[[nn.Module, str], bool]


def make_policy(wrap_policy: Any = None, min_num_params: int | None = None) -> WrapPolicy | None:
    """A callable policy from the config's forms; ``None`` means a single root unit."""
    if wrap_policy is not None and min_num_params is not None:
        raise ValueError("give either wrap_policy or min_num_params, not both")
    if min_num_params is not None:
        return _size_policy(int(min_num_params))
    if wrap_policy is None:
        return None
    if callable(wrap_policy) and not isinstance(wrap_policy, type):
        return wrap_policy
    entries = [wrap_policy] if isinstance(wrap_policy, (str, type)) else list(wrap_policy)
    return _class_policy(resolve_classes(entries))


def _class_policy(classes: tuple[type, ...]) -> WrapPolicy:
    def policy(module: nn.Module, name: str) -> bool:
        return isinstance(module, classes)

    policy.classes = classes  # type: ignore[attr-defined]
    return policy


def _size_policy(min_num_params: int) -> WrapPolicy:
    def policy(module: nn.Module, name: str) -> bool:
        return sum(p.numel() for p in module.parameters()) >= min_num_params

    policy.min_num_params = min_num_params  # type: ignore[attr-defined]
    return policy


def select_units(root: nn.Module, policy: WrapPolicy | None) -> list[tuple[str, nn.Module]]:
    """(name, module) of every unit, root first (name ``""``), in registration order.

    A size policy is applied bottom-up: a module becomes a unit when the parameters not yet owned
    by a nested unit reach the threshold, as in size-based auto-wrapping elsewhere.
    """
    units: list[tuple[str, nn.Module]] = [("", root)]
    if policy is None:
        return units
    threshold = getattr(policy, "min_num_params", None)
    if threshold is not None:
        units += _size_units(root, threshold)
    else:
        units += [(n, m) for n, m in root.named_modules() if n and policy(m, n)]
        _check_classes_matched(root, policy, units)
    return units


def _size_units(root: nn.Module, threshold: int) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []
    owned: set[int] = set()
    modules = [(n, m) for n, m in root.named_modules() if n]
    for name, module in sorted(modules, key=lambda nm: -nm[0].count(".")):  # deepest first
        free = [p for p in module.parameters() if id(p) not in owned]
        if sum(p.numel() for p in free) >= threshold:
            chosen.append((name, module))
            owned.update(id(p) for p in free)
    order = {name: i for i, (name, _) in enumerate(root.named_modules())}
    return sorted(chosen, key=lambda nm: order[nm[0]])


def _check_classes_matched(root: nn.Module, policy: WrapPolicy, units: list) -> None:
    classes = getattr(policy, "classes", None)
    if classes is None or len(units) > 1:
        return
    found = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in root.modules()})
    wanted = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in classes)
    raise ValueError(
        f"wrap_policy classes {wanted} match no module of {type(root).__name__}; "
        f"module classes in the model: {', '.join(found)}"
    )
