"""A Fabric program ends without tearing its strategy down; its process must still exit cleanly.

A watchdog thread left beating when the interpreter finalizes can be inside a torch call and then
abort the process (see [Note: no daemon thread in torch at exit] in lightning_zero/comm/watchdog.py).
Whether it does is a race, so the test checks the cause, which is deterministic: at the last
atexit handler (registered before the Fabric existed, so it runs after the package's own), no
watchdog thread is alive in either rank.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
from collections import Counter
from typing import Any

import torch.distributed as dist

from tests.fabric import jobs
from tests.matrix.runner import run_jobs


def _threads_at_exit(path: str) -> None:
    names = [t.name for t in threading.enumerate() if t.is_alive()]
    with open(path, "w") as f:
        json.dump(names, f)


def _train_and_leave(out_dir: str, root: str) -> dict[str, Any]:
    atexit.register(_threads_at_exit, os.path.join(out_dir, f"threads{dist.get_rank()}.json"))
    fabric = jobs.make_fabric(3)
    model, optimizer = jobs.set_up(fabric, jobs.Loop())
    jobs.train(fabric, model, optimizer, jobs.Loop(), range(2), Counter())
    running = [t.name for t in threading.enumerate() if t.name == "lightning_zero-watchdog"]
    return {"running": running}  # the program ends here, as a Fabric script does


def test_a_fabric_program_leaves_no_watchdog_thread_at_exit(tmp_path):
    ranks = run_jobs(
        [functools.partial(_train_and_leave, str(tmp_path))], str(tmp_path), world=2, timeout=120
    )
    for rank, (result,) in enumerate(ranks):
        assert result["running"], f"rank {rank}: no watchdog ran during training; nothing was tested"
        with open(tmp_path / f"threads{rank}.json") as f:
            at_exit = json.load(f)
        assert "lightning_zero-watchdog" not in at_exit, f"rank {rank}: threads alive at exit {at_exit}"
