"""Read Ψ and the per-layer gradient sizes from a real model, for the planner.

A "layer" here is a run of consecutive parameters (in registration order) owned by the same
module: a Linear's weight and bias, a LayerNorm's two vectors, a MultiheadAttention's input
projection. Its gradients become ready together in backward. Layers are listed in backward order,
the reverse of registration order, which is how gradient buckets are filled (see
[Note: bucket order] in lightning_zero/grad_sync/buckets.py).
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from torch import nn


class LayerSize(NamedTuple):
    name: str  # qualified name of the module that owns the parameters ("" for the root)
    numel: int  # trainable parameters in the layer


class ModelSummary(NamedTuple):
    name: str  # class name of the model
    psi: int  # Ψ, trainable parameters (shared parameters counted once)
    layers: tuple[LayerSize, ...]  # in backward order (reverse registration order)


def load_model(spec: str) -> nn.Module:
    """Import and instantiate a model class with no arguments.

    Args:
        spec: ``package.module:Class`` or ``package.module.Class``. A LightningModule whose layers
            are built in ``configure_model`` gets that hook called when it has no parameters yet.
    """
    module_path, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_path or not attr:
        raise ValueError(f"model must be 'package.module:Class' or 'package.module.Class', got {spec!r}")
    try:
        cls = getattr(importlib.import_module(module_path), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {attr!r} from {module_path!r} (model {spec!r}): {err}") from err
    try:
        model = cls()
    except TypeError as err:
        raise TypeError(f"model {spec!r} must be constructible with no arguments: {err}") from err
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {spec!r} must build a torch.nn.Module, got {type(model).__name__}")
    configure = getattr(model, "configure_model", None)
    if callable(configure) and not any(True for _ in model.parameters()):
        configure()
    return model


def summarize_model(model: nn.Module) -> ModelSummary:
    """Ψ and the layers (backward order) of ``model``'s trainable parameters."""
    owners: dict[int, str] = {}  # id(parameter) -> name of the first module that registers it
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), name)
    runs: list[list] = []  # [owner name, numel] per run of parameters with the same owner
    for param in model.parameters():  # registration order, each shared parameter once
        if not param.requires_grad:
            continue
        owner = owners[id(param)]
        if runs and runs[-1][0] == owner:
            runs[-1][1] += param.numel()
        else:
            runs.append([owner, param.numel()])
    layers = tuple(LayerSize(name, numel) for name, numel in reversed(runs))
    return ModelSummary(type(model).__name__, sum(layer.numel for layer in layers), layers)
