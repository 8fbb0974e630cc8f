"""Bucketed gradient synchronisation: the plan (pure), the hooks and the root wrapper."""

from lightning_zero.grad_sync.buckets import BucketSpec, ParamInfo, plan_buckets
from lightning_zero.grad_sync.module import (
    ZeroModule,
    broadcast_module_states,
    trainable_parameters,
    wrap_module,
)
from lightning_zero.grad_sync.reducer import GradReducer, UnusedParametersError

__all__ = [
    "BucketSpec",
    "GradReducer",
    "ParamInfo",
    "UnusedParametersError",
    "ZeroModule",
    "broadcast_module_states",
    "plan_buckets",
    "trainable_parameters",
    "wrap_module",
]
