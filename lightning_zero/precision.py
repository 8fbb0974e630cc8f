"""Gradient clipping by the global norm when gradients are sharded (stages 1-2).

Lightning clips through the precision plugin (``clip_gradients`` -> ``clip_grad_by_norm``), which
on its own would take the norm of this rank's shard only. :func:`install_sharded_clipping` gives
the strategy's plugin a subclass of its own class whose ``clip_grad_by_norm`` takes the norm of the
whole gradient: sqrt(AllReduce(sum of the shards' squares)). Keeping the plugin's class in the MRO
keeps Lightning's isinstance checks (mixed precision, scalers) working. ``"value"`` clipping is
elementwise and needs nothing: the plugin clips the local shard.
"""

from __future__ import annotations

import functools
from typing import Any

from lightning.pytorch.plugins.precision import Precision
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
