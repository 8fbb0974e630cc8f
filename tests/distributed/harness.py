"""Spawn N gloo ranks on this machine and run a test function in each."""

from __future__ import annotations

import faulthandler
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_zero.comm.collectives import _FAILED
from lightning_zero.comm.faults import leave_without_destroying


def _entry(rank: int, world_size: int, store: str, fn: Callable[..., Any], out_dir: str, args: tuple) -> None:
    faulthandler.enable(all_threads=True)  # a rank killed by a signal (a C++ abort) shows its stacks
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # a file store: no port to race for when several test runs share the machine
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        leave_after_expected_failures()
    finally:
        dist.destroy_process_group()


def leave_after_expected_failures() -> None:
    """A test function that returned normally but let a fit fail on purpose (and caught the error):
    the package then ends the process with status 1 at exit, without destroying the group (see
    [Note: waiting without hanging] in lightning_zero/comm/waiting.py). The result is saved and
    is what the test checks: leave with status 0, the same way."""
    if _FAILED["comm"] is not None:
        leave_without_destroying(status=0)


def run_ranks(fn: Callable[..., Any], world_size: int, out_dir: str, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return each rank's result."""
    store = tempfile.mktemp(prefix="store-", dir=str(out_dir))
    mp.spawn(_entry, args=(world_size, store, fn, str(out_dir), args), nprocs=world_size, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
