"""What the GPU tests need, and the marks that skip them where it is missing (fast: no CUDA call
beyond asking whether there is a device)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

NO_CUDA = "no CUDA device is present (torch.cuda.is_available() is False)"


def gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing(n: int, nccl: bool) -> str | None:
    """Why a test that needs ``n`` CUDA devices (and NCCL) cannot run here; None when it can."""
    count = gpu_count()
    if count == 0:
        return NO_CUDA
    if count < n:
        return f"needs {n} CUDA devices, {count} present"
    if nccl and not (dist.is_available() and dist.is_nccl_available()):
        return "this torch build has no NCCL backend"
    return None


def requires_gpus(n: int, *, nccl: bool = False) -> pytest.MarkDecorator:
    """Skip unless at least ``n`` CUDA devices are present (and NCCL, with ``nccl``), saying what is missing."""
    reason = missing(n, nccl)
    return pytest.mark.skipif(reason is not None, reason=reason or "")
