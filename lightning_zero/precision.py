"""Mixed precision the ZeRO way, and gradient clipping by the global norm over shards.

[Note: mixed precision]
With a policy (``param_dtype`` bf16), the module's parameters are bf16: forward, backward and
the gradient collectives run in bf16 (2 bytes per element on the wire). The optimizer never sees
them: it steps fp32 master copies (stage 0: whole; stages 1-3: this rank's shard), whose
gradients are the reduced bf16 gradients converted to fp32, and after each step the master
values are copied back into the bf16 parameters (stages 1-2: into this rank's chunk, then
all-gathered; stage 3: into the bf16 shard the next gather reads). Checkpoints carry the fp32
master values under the original parameter names, so a resume continues exactly and a plain fp32
LightningModule loads them.

Clipping:
Lightning clips through the precision plugin (``clip_gradients`` -> ``clip_grad_by_norm``), which
on its own would take the norm of this rank's shard only. :func:`install_sharded_clipping` gives
the strategy's plugin a subclass of its own class whose ``clip_grad_by_norm`` takes the norm of the
whole gradient: sqrt(AllReduce(sum of the shards' squares)). Keeping the plugin's class in the MRO
keeps Lightning's isinstance checks (mixed precision, scalers) working. ``"value"`` clipping is
elementwise and needs nothing: the plugin clips the local shard.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.optim import Optimizer


class _GlobalNormClipping:
    _zero_clip_fn: Any  # (optimizer, max_norm) -> total norm; set by install_sharded_clipping

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._zero_clip_fn(optimizer, float(clip_val))


@functools.cache
def _with_global_norm(cls: type) -> type:
    return type(f"GlobalNorm{cls.__name__}", (_GlobalNormClipping, cls), {"_zero_base": cls})


def install_sharded_clipping(plugin: Precision, clip_fn: Any) -> None:
    """Make ``plugin`` clip by ``clip_fn(optimizer, max_norm)`` (the global norm over shards)."""
    base = getattr(type(plugin), "_zero_base", type(plugin))
    plugin.__class__ = _with_global_norm(base)
    plugin._zero_clip_fn = clip_fn


def remove_sharded_clipping(plugin: Precision) -> None:
    base = getattr(type(plugin), "_zero_base", None)
    if base is not None:
        plugin.__class__ = base
        del plugin._zero_clip_fn


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # config names


class PrecisionPolicy(NamedTuple):
    param_dtype: torch.dtype  # what the module computes with (and its gradients)
    reduce_dtype: torch.dtype  # gradients on the wire
    master_dtype: torch.dtype  # the optimizer's copy of the parameters


def resolve_policy(
    param_dtype: str | None, reduce_dtype: str | None, lightning_precision: str
) -> PrecisionPolicy | None:
    """The policy for this run; ``None`` trains in the module's own dtype with no master copy.

    ``param_dtype`` None follows Lightning's flag: ``"bf16-mixed"`` -> bf16 parameters and
    gradients with fp32 master weights; ``"32-true"`` (and the ``*-true`` flags, which convert
    the module themselves) -> no policy. An explicit ``param_dtype`` overrides the flag.
    """
    if param_dtype is None:
        if lightning_precision in ("16-mixed", "16"):
            raise ValueError(
                "precision='16-mixed' (fp16 with loss scaling) is not supported by ZeroStrategy: "
                "use precision='bf16-mixed', or '32-true'"
            )
        param_dtype = "bf16" if lightning_precision == "bf16-mixed" else None
    if param_dtype is None or param_dtype == "fp32":
        if reduce_dtype not in (None, "fp32"):
            raise ValueError(f"reduce_dtype={reduce_dtype!r} needs param_dtype of the same dtype")
        return None
    if param_dtype == "fp16":
        raise ValueError(
            "param_dtype='fp16' needs loss scaling, which ZeroStrategy does not provide: use 'bf16'"
        )
    if reduce_dtype not in (None, param_dtype):
        raise ValueError(
            f"reduce_dtype must equal param_dtype ({param_dtype!r}) in this release, got {reduce_dtype!r}: "
            "gradients are reduced in the dtype autograd produces them"
        )
    dtype = DTYPES[param_dtype]
    return PrecisionPolicy(dtype, dtype, torch.float32)


def cast_parameters(module: nn.Module, policy: PrecisionPolicy | None) -> dict[int, torch.Tensor]:
    """Cast the floating-point parameters to the policy's dtype; return id -> fp32 values before the cast."""
    if policy is None:
        return {}
    masters = {}
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != policy.param_dtype:
            if p.requires_grad:
                masters[id(p)] = p.detach().to(policy.master_dtype, copy=True)
            p.data = p.data.to(policy.param_dtype)
    return masters
