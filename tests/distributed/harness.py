"""Spawn N gloo ranks on this machine and run a test function in each."""

from __future__ import annotations

import atexit
import faulthandler
import os
import tempfile
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_zero.comm.collectives import _FAILED
from lightning_zero.comm.faults import leave_without_destroying

# imported once by the server that forks test ranks (see start_method)
PRELOADED = [
    "torch",
    "torch.distributed",
    "lightning",
    "lightning_zero",
    "lightning_zero.fabric",
    "tests.matrix.runner",
]


def start_method() -> str:
    """How test ranks start: forked from a server that has imported torch, Lightning and the
    package once for the whole session, so a rank skips the seconds of imports a fresh
    interpreter pays (each rank is still its own process, with its own group and signals)."""
    mp.set_forkserver_preload(PRELOADED)
    return "forkserver"


class Inherited:
    """What a spawned rank inherits from the test and a forked one would not: the test's
    environment and its stdout and stderr (which pytest may be capturing). Pass one among a
    rank's arguments: unpickling it in the rank applies it, before the rank's own code runs."""

    def __reduce__(self):
        return (_inherit, (dict(os.environ), reduction.DupFd(1), reduction.DupFd(2)))


def _inherit(env: dict[str, str], out: Any, err: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    for target, sent in ((1, out), (2, err)):
        fd = sent.detach()
        os.dup2(fd, target)
        os.close(fd)


def _entry(
    rank: int, world_size: int, store: str, fn: Callable[..., Any], out_dir: str, args: tuple, _: None
) -> None:
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
    exit_as_a_program()


def exit_as_a_program() -> None:
    """A forked rank ends without the interpreter's exit, which would run the atexit handlers (the
    package's among them) in a spawned one: run them, as a rank that returned normally would."""
    atexit._run_exitfuncs()


def leave_after_expected_failures() -> None:
    """A test function that returned normally but let a fit fail on purpose (and caught the error):
    the package then ends the process with status 1 at exit, without destroying the group (see
    [Note: waiting without hanging] in lightning_zero/comm/waiting.py). The result is saved and
    is what the test checks: leave with status 0, the same way."""
    if _FAILED["comm"] is not None:
        leave_without_destroying(status=0)


def run_ranks(fn: Callable[..., Any], world_size: int, out_dir: str, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes (forked: see start_method);
    return each rank's result."""
    store = tempfile.mktemp(prefix="store-", dir=str(out_dir))
    mp.start_processes(
        _entry,
        args=(world_size, store, fn, str(out_dir), args, Inherited()),
        nprocs=world_size,
        join=True,
        start_method=start_method(),
    )
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
