"""Many Trainer fits in one pair of processes: the ranks start once and run every fit in turn.

Each rank sets the environment Lightning reads for processes it did not launch (``LOCAL_RANK``,
``WORLD_SIZE``, ...) and starts the process group itself over a file store, so every Trainer finds
the group ready and only runs its fit. The one-process reference runs in a process of its own.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import Trainer

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroStrategy
from tests.distributed.harness import (
    Inherited,
    exit_as_a_program,
    leave_after_expected_failures,
    start_method,
)
from tests.matrix.lit import BATCH, WORLD, Case, MatrixModule

BLOCK = "tests.matrix.lit.Block"


class Run(NamedTuple):
    """One fit: a case under a stage (None: the one-process reference) and its options."""

    case: Case
    stage: int | None  # None: plain single-device Lightning, the reference
    save_after_fit: bool = False  # trainer.save_checkpoint after fit returns (full form)


class Result(NamedTuple):
    params: dict[str, torch.Tensor]  # name -> value (fp32 copy) after fit
    dtypes: dict[str, torch.dtype]  # name -> the module's parameter dtype after fit
    losses: list[float]  # per micro-batch, this rank's
    optimizer: dict | None  # the saved checkpoint's optimizer state (rank 0, save_after_fit)
    error: str | None  # the fit raised: its type and message


def _strategy(run: Run) -> Any:
    case = run.case
    options: dict[str, Any] = {"find_unused_parameters": case.unused}
    if run.stage == 3:
        options.update(wrap_policy=BLOCK, prefetch=case.prefetch)
    if run.stage == 3 and case.quantize:  # blocks of 32: the tiny parameters are a few blocks each
        options.update(quantize_weights=True, quantize_grads=True, quantize_block=32)
    elif run.stage in (1, 2) and case.quantize:  # stages 1-2 reduce gradients only
        options.update(quantize_grads=True, quantize_block=32)
    return ZeroStrategy(stage=run.stage, **options)


def _trainer(run: Run, root: str) -> Trainer:
    case = run.case
    automatic = not case.manual
    return Trainer(
        strategy=_strategy(run) if run.stage is not None else "auto",
        accelerator="cpu",
        devices=WORLD if run.stage is not None else 1,
        precision=case.precision,
        max_epochs=1,
        accumulate_grad_batches=case.accumulate if automatic else 1,
        gradient_clip_val=case.clip if automatic else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


def fit(run: Run, root: str) -> Result:
    per_rank = BATCH if run.stage is not None else BATCH * WORLD
    model = MatrixModule(run.case, per_rank=per_rank)
    trainer = _trainer(run, root)
    try:
        trainer.fit(torch.compile(model, backend="aot_eager") if run.case.compile == "module" else model)
        optimizer = _saved_optimizer(trainer, root) if run.save_after_fit else None
    except Exception as err:  # noqa: BLE001  (the test reports it)
        return Result({}, {}, model.losses, None, f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    return Result(params, dtypes, model.losses, optimizer, None)


def _saved_optimizer(trainer: Trainer, root: str) -> dict | None:
    path = os.path.join(root, "after_fit.ckpt")
    trainer.save_checkpoint(path)
    if trainer.global_rank != 0:
        return None
    return torch.load(path, weights_only=False)["optimizer_states"][0]


def _entry(
    rank: int, world: int, store: str, jobs: list[Callable[[str], Any]], out_dir: str, nodes: int, _: None
) -> None:
    faulthandler.enable(all_threads=True)  # a rank killed by a signal (a C++ abort) shows its stacks
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT="29500",  # read by Lightning's environment, never used: the group exists
            WORLD_SIZE=str(world),
            RANK=str(rank),
            LOCAL_RANK=str(rank % (world // nodes)),
            NODE_RANK=str(rank // (world // nodes)),
        )
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = []
    for i, job in enumerate(jobs):
        root = os.path.join(out_dir, f"job{i}")
        os.makedirs(root, exist_ok=True)
        results.append(job(root))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_after_expected_failures()
    exit_as_a_program()


def run_jobs(
    jobs: list[Callable[[str], Any]], out_dir: str, *, world: int, timeout: float, nodes: int = 1
) -> list[list[Any]]:
    """Run ``jobs`` (picklable callables of a scratch folder) in turn in ``world`` fresh processes
    sharing one process group; per rank, the results in order. ``nodes``: the ranks pose as that
    many nodes of ``world / nodes`` ranks each (the environment Lightning reads), on this machine."""
    os.makedirs(out_dir, exist_ok=True)
    store = tempfile.mktemp(prefix="store-", dir=out_dir)
    context = mp.start_processes(
        _entry,
        args=(world, store, jobs, out_dir, nodes, Inherited()),
        nprocs=world,
        join=False,
        start_method=start_method(),
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{len(jobs)} jobs on {world} ranks did not finish in {timeout:.0f} s")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def run_all(runs: list[Run], out_dir: str, *, world: int, timeout: float) -> list[list[Result]]:
    """Fit ``runs`` in ``world`` fresh processes; per rank, the results in order."""
    return run_jobs([functools.partial(fit, run) for run in runs], out_dir, world=world, timeout=timeout)
