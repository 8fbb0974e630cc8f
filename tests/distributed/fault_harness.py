"""Run N gloo ranks as separate processes and collect each one's outcome, also when ranks fail,
hang or are killed: the exception it raised (type and message), its exit status, its stderr and
how long it took. For the fault tests, which need ranks that end badly on purpose."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    rank: int
    exitcode: int | None  # None: still running at the deadline (then killed)
    seconds: float | None  # from the rank's first collective to the end of fn; None: no record
    result: Any = None  # what fn returned
    error: str | None = None  # "TypeName: message" of what fn raised
    stderr: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out: str, fn: Callable, args: tuple) -> None:
    err = open(os.path.join(out, f"stderr{rank}.txt"), "w", buffering=1)
    os.dup2(err.fileno(), 2)
    sys.stderr = err
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    record: dict[str, Any] = {}
    start = time.monotonic()
    try:
        record["result"] = fn(rank, world_size, *args)
    except BaseException as e:  # the outcome under test
        record["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    record["seconds"] = time.monotonic() - start
    with open(os.path.join(out, f"outcome{rank}.json"), "w") as f:
        json.dump(record, f)
    # leave as a program would: the interpreter's exit, atexit handlers and all


def run_ranks(fn: Callable, world_size: int, out: Path, *args: Any, timeout: float = 120) -> list[Outcome]:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned ranks; every rank's Outcome."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, str(out), fn, args)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    outcomes = []
    for r, p in enumerate(procs):
        running = p.is_alive()
        if running:
            p.kill()
            p.join()
        outcomes.append(_outcome(r, None if running else p.exitcode, out))
    return outcomes


def _outcome(rank: int, exitcode: int | None, out: Path) -> Outcome:
    record_file, stderr_file = out / f"outcome{rank}.json", out / f"stderr{rank}.txt"
    record = json.loads(record_file.read_text()) if record_file.exists() else {}
    stderr = stderr_file.read_text() if stderr_file.exists() else ""
    return Outcome(rank, exitcode, record.get("seconds"), record.get("result"), record.get("error"), stderr)
