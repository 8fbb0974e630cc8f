"""Spawn ranks with a process-group backend and a device each, and run a function in every rank.

The GPU counterpart of ``tests/distributed/harness.py``: ``run_on(fn, ["cuda:0", "cuda:1"],
"nccl", out_dir)`` runs ``fn(rank, world_size, device, *args)`` with rank r on ``cuda:r`` over
NCCL; ``["cuda:0", "cuda:0"]`` with ``"gloo"`` puts two ranks on one GPU. Each rank's result comes
back with its tensors on the CPU.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_zero.checkpoint.writer import on_host


def _entry(
    rank: int,
    devices: Sequence[str],
    backend: str,
    store: str,
    fn: Callable[..., Any],
    out_dir: str,
    args: tuple,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator and every bare "cuda" go there
    world_size = len(devices)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, device, *args)
        torch.save(on_host(result), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_on(
    fn: Callable[..., Any], devices: Sequence[str], backend: str, out_dir: Any, *args: Any
) -> list[Any]:
    """Run ``fn(rank, world_size, device, *args)`` in one spawned process per entry of ``devices``
    (rank r on ``devices[r]``) over ``backend``; return each rank's result."""
    out_dir = str(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    store = tempfile.mktemp(prefix="store-", dir=out_dir)  # a file store: no port to race for
    mp.spawn(_entry, args=(list(devices), backend, store, fn, out_dir, args), nprocs=len(devices), join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(len(devices))]
