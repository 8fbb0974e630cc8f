"""Desyncs in a real Trainer run end on every rank, named; long healthy waits never do.

Two ranks started the way torchrun starts them, one of them out of step on purpose:

- with default options, at stage 3, rank 0 sums a parameter of one unit at rest and rank 1 one of
  another unit: two all-reduces of the partial sums under one sequence number, named after the
  parameters (the check before each collective stops both, naming both and the cause);
- rank 0 logs a value with ``sync_dist=True`` that rank 1 does not: Lightning's own all-reduce on
  rank 0, the next batch's agreement on rank 1, found apart by the watchdog (``watchdog_s``);
- the same reads with no check before each collective (as on NCCL): the two all-reduces have one
  size, pair and complete; the agreement after the batch compares what each rank issued (the
  digest) and names the first collective that differs;
- the margin: a slow step, a long checkpoint save and a long validation, each several times
  ``watchdog_s`` long, are reported as waits and never stop the run.

    python -m tests.integration.test_desync_trainer OUT_DIR OPTIONS_JSON   # one rank (LOCAL_RANK set)
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from tests.distributed.fault_harness import free_port
from tests.integration.fault_scenarios import Net, data
from tests.integration.ranks import REPO_ROOT, RankRun, Ranks, finish

HOST = socket.gethostname()
BOUND_S = 20  # from the fault to each rank's exit (the watchdog's time and fault_wait_s included)


def start_ranks(module: str, world_size: int, out: Path, *args: str) -> Ranks:
    """``python -m module OUT *args`` in ``world_size`` ranks, with torchrun's environment."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0"}
    env.update(WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in [n for n in env if n.startswith("SLURM_")]:
        del env[name]
    procs, logs = [], []
    for rank in range(world_size):
        logs.append(out / f"rank{rank}.log")
        with open(logs[-1], "w") as f:
            cmd = [sys.executable, "-m", module, str(out), *args]
            procs.append(
                subprocess.Popen(
                    cmd,
                    env={**env, "LOCAL_RANK": str(rank)},
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    cwd=REPO_ROOT,
                )
            )
    return Ranks(procs, logs, time.monotonic())


def finish_all(ranks: Ranks, *, timeout: float) -> list[RankRun]:
    return finish(ranks, timeout=timeout)


class Logged(Net):
    """Rank ``log_on`` logs a synced value at step ``log_at`` (its peers do not); a validation
    step that sleeps ``val_sleep_s`` on rank ``val_slow_on`` at its first batch."""

    def __init__(self, log_on: int | None = None, log_at: int = -1, val_slow_on: int | None = None):
        super().__init__()
        self.log_on, self.log_at, self.val_slow_on = log_on, log_at, val_slow_on

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == self.log_on and self.global_step == self.log_at:
            print(f"rank {self.global_rank} logs alone at wall {time.time():.3f}", flush=True)
            self.log("rank_only", loss.detach(), sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        if self.global_rank == self.val_slow_on and batch_idx == 0:
            print(f"rank {self.global_rank} validates slowly", flush=True)
            time.sleep(3.0)
        x, y = batch
        self.log(
            "val_loss", torch.nn.functional.mse_loss(self.head(torch.relu(self.body(x))), y), sync_dist=True
        )


class SkipsStep(Net):
    """Manual optimization; at batch ``skip_at`` rank ``skip_on`` alone skips ``opt.step()`` (a
    condition true on one rank), the others step."""

    def __init__(self, skip_on: int, skip_at: int):
        super().__init__()
        self.automatic_optimization = False
        self.skip_on, self.skip_at = skip_on, skip_at

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        if self.global_rank == self.skip_on and batch_idx == self.skip_at:
            print(f"rank {self.global_rank} skips its step at wall {time.time():.3f}", flush=True)
        else:
            opt.step()
        opt.zero_grad()


class Unchecked(Callback):
    """No collective is checked before it is issued, as on NCCL ([Note: checked issue])."""

    def setup(self, trainer, pl_module, stage) -> None:
        trainer.strategy.comm.check_issue = False


class Misbehave(Callback):
    """At step ``at``: each rank computes with a parameter at rest of unit ``touch[rank]``; rank
    ``slow_on`` sleeps ``slow_s`` in its training batch."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rank, step = trainer.global_rank, trainer.global_step
        touch = self.options.get("touch")
        if touch and touch[rank] and step == self.options["at"]:
            print(
                f"rank {rank} uses {touch[rank]}.weight at step {step}, at wall {time.time():.3f}", flush=True
            )
            getattr(pl_module, touch[rank]).weight.sum()
        if self.options.get("slow_on") == rank and step == self.options["at"]:
            print(f"rank {rank} computes slowly at step {step}", flush=True)
            time.sleep(3.0)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        rank, touch = trainer.global_rank, self.options.get("touch_before_backward")
        if touch and touch[rank] and trainer.global_step == self.options["at"]:
            print(
                f"rank {rank} uses {touch[rank]}.weight before backward, at wall {time.time():.3f}",
                flush=True,
            )
            getattr(pl_module, touch[rank]).weight.sum()

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        print(f"rank {trainer.global_rank} step {trainer.global_step}", flush=True)


def slow_saves_on(rank: int, seconds: float) -> None:
    """Rank ``rank`` takes ``seconds`` longer to write every full checkpoint."""
    from lightning_zero.checkpoint import writer

    def slowed(original):
        def write(*args, **kwargs):
            if int(os.environ["LOCAL_RANK"]) == rank:
                print(f"rank {rank} saves slowly", flush=True)
                time.sleep(seconds)
            return original(*args, **kwargs)

        return write

    writer._write_synced = slowed(writer._write_synced)
    writer.write_streamed = slowed(writer.write_streamed)


def main(out: Path, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    if "slow_save_on" in options:
        slow_saves_on(options["slow_save_on"], 3.0)
    callbacks: list[Callback] = [Misbehave(options)]
    if options.get("unchecked"):
        callbacks.append(Unchecked())
    if options.get("checkpoint_at"):
        every = options["checkpoint_at"]
        callbacks.append(
            ModelCheckpoint(dirpath=out / "ckpt", save_top_k=0, save_last=True, every_n_train_steps=every)
        )
    trainer = Trainer(
        strategy=ZeroStrategy(**options["strategy"]),
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=options.get("max_steps", 6),
        logger=False,
        enable_checkpointing=bool(options.get("checkpoint_at")),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=out,
        val_check_interval=options.get("val_every", 1.0),
        limit_val_batches=2,
        num_sanity_val_steps=0,
    )
    model = SkipsStep(**options["skips"]) if "skips" in options else Logged(**options.get("model", {}))
    val = data(32, 8) if options.get("val_every") else None
    trainer.fit(model, train_dataloaders=data(128, 8), val_dataloaders=val)
    print(f"rank {trainer.global_rank} finished at step {trainer.global_step}", flush=True)


def _run(tmp_path: Path, **options: Any) -> list[RankRun]:
    return finish_all(start_ranks(__name__, 2, tmp_path, json.dumps(options)), timeout=150)


def _seconds_after_fault(tmp_path: Path, **options: Any) -> tuple[list[RankRun], list[float]]:
    """The runs, and each rank's exit in seconds after the first ``at wall T`` a rank printed."""
    ranks = start_ranks(__name__, 2, tmp_path, json.dumps(options))
    wall_at_start = time.time()
    runs = finish_all(ranks, timeout=150)
    faults = [float(t) for run in runs for t in re.findall(r"at wall (\d+\.\d+)", run.output)]
    assert faults, runs[0].output[-4000:]
    after = [wall_at_start + run.seconds - min(faults) for run in runs]
    print(f"seconds from the fault to each rank's exit: {', '.join(f'{t:.1f}' for t in after)}")
    return runs, after


def _printed_report(output: str) -> str:
    """The desync report as printed where it was found (before the traceback repeats it)."""
    found = output.find(", checked before issuing it; the ranks are out of step (a desync)")
    assert found >= 0, output[-4000:]
    start = output.rfind("\n", 0, found) + 1
    lines = output[start:].splitlines()
    return "\n".join([lines[0], *[line for line in lines[1:3] if line.startswith("  rank ")]])


def test_reads_at_rest_of_different_parameters_at_stage_3_stop_every_rank_named(tmp_path):
    touch = {"touch": ["body", "head"], "at": 2}
    runs, after = _seconds_after_fault(
        tmp_path, strategy={"stage": 3, "wrap_policy": "torch.nn.Linear"}, **touch
    )
    for run in runs:
        assert run.returncode == 1, run.output[-4000:]  # not -6: nothing reached gloo
        report = _printed_report(run.output)
        assert "the ranks are out of step (a desync)" in report
        assert re.search(
            rf"rank 0 \({HOST}\) waits in all_reduce #(\d+) zero3/at_rest/sum/body.weight \(", report
        )
        assert re.search(
            rf"rank 1 \({HOST}\) waits in all_reduce #(\d+) zero3/at_rest/sum/head.weight \(", report
        )
        assert f"rank(s) {1 - run.rank} are elsewhere" in report
        assert "a stage-3 parameter read at rest" in run.output and "full_state_dict()" in run.output
        numbers = re.findall(r"waits in all_reduce #(\d+)", report)
        assert len(numbers) == 2 and numbers[0] == numbers[1], report  # one sequence number, two collectives
    assert max(after) < BOUND_S, after


def test_a_desync_after_the_schedule_is_learned_stops_every_rank_named(tmp_path):
    """At step 5 every collective of a step is expected without a check ([Note: learned schedule]
    in lightning_zero/comm/checks.py): between forward and backward rank 0 issues backward's
    collectives unchecked, rank 1 first gathers a unit at rest and posts it; both stop, named,
    nothing aborted."""
    touch = {"touch_before_backward": [None, "body"], "at": 5}
    runs, after = _seconds_after_fault(
        tmp_path, strategy={"stage": 3, "wrap_policy": "torch.nn.Linear"}, max_steps=7, **touch
    )
    for run in runs:
        assert run.returncode == 1, run.output[-4000:]  # not -6: nothing reached gloo
        assert "CollectivesStopped" in run.output and "the ranks are out of step (a desync)" in run.output
        assert "rank(s) 1 issued another collective under its number" in run.output, run.output[-4000:]
        mine = re.search(rf"rank 0 \({HOST}\) waits in \w+ #(\d+) zero3/\w+/unit=", run.output)
        theirs = re.search(
            rf"rank 1 \({HOST}\) waits in all_reduce #(\d+) zero3/at_rest/sum/body.weight \(", run.output
        )
        assert mine and theirs and mine[1] == theirs[1], run.output[-4000:]
    assert "Received data size" not in runs[0].output + runs[1].output
    assert max(after) < BOUND_S, after


def test_same_size_reads_of_different_parameters_are_named_at_the_agreement_with_checks_off(tmp_path):
    """Case 3 in a Trainer, as on NCCL (no check per collective, watchdog off): the partial sums of
    two parameters pair up and complete; the batch's agreement finds the digests apart on every
    rank and names each rank's first collective that differs."""
    runs, after = _seconds_after_fault(
        tmp_path,
        strategy={"stage": 3, "wrap_policy": "torch.nn.Linear", "watchdog_s": None},
        touch=["body", "head"],
        at=2,
        unchecked=True,
    )
    for run in runs:
        assert run.returncode == 1, run.output[-4000:]  # not -6: nothing reached gloo
        assert "CollectivesStopped" in run.output, run.output[-4000:]
        assert re.search(r"out of step \(a desync\) at agree #\d+ zero3/agree/batch", run.output), run.output[
            -4000:
        ]
        first = re.search(r"rank 0: all_reduce #(\d+) zero3/at_rest/sum/body.weight \(", run.output)
        theirs = re.search(r"rank 1: all_reduce #(\d+) zero3/at_rest/sum/head.weight \(", run.output)
        assert first and theirs and first[1] == theirs[1], run.output[-4000:]  # paired, completed
        assert "finished at step" not in run.output
    assert max(after) < 5, after


@pytest.mark.parametrize("stage", [1, 3])
def test_a_step_skipped_by_one_rank_stops_every_rank_within_seconds(tmp_path, stage):
    """Case 1 (stage 3: no collective at the step, so only the batch's agreement of step and
    backward counts sees it) and case 5 (stage 1: the others wait in the all-gathers after the
    step, which the learned schedule issued unchecked, and the agreement posts its deviation):
    every rank stops, named, within 5 s of the skip, with the default watchdog."""
    extra = {"wrap_policy": "torch.nn.Linear"} if stage == 3 else {}
    runs, after = _seconds_after_fault(
        tmp_path, strategy={"stage": stage, **extra}, skips={"skip_on": 1, "skip_at": 2}
    )
    for run in runs:
        assert run.returncode == 1, run.output[-4000:]
        assert "CollectivesStopped" in run.output and "out of step (a desync)" in run.output, run.output[
            -4000:
        ]
        assert "finished at step" not in run.output
        if stage == 3:
            assert "rank 0: 3 optimizer steps" in run.output and "rank 1: 2 optimizer steps" in run.output
    assert max(after) < 5, after


def test_a_collective_skipped_by_one_rank_is_found_by_the_watchdog(tmp_path):
    runs, after = _seconds_after_fault(
        tmp_path, strategy={"stage": 2, "watchdog_s": 2.0}, model={"log_on": 0, "log_at": 2}
    )
    for run in runs:
        assert run.returncode == 1, run.output[-4000:]
        assert "the ranks are out of step (a desync)" in run.output, run.output[-4000:]
        assert re.search(
            rf"rank 0 \({HOST}\) waits in lightning #(\d+) lightning/reduce float32\[\] \(4 B\)", run.output
        )
        assert re.search(rf"rank 1 \({HOST}\) waits in \w+ #(\d+) zero2/\S+ \(\d+ B\)", run.output)
    assert max(after) < BOUND_S, (
        after
    )  # watchdog_s, the answers, fault_wait_s for rank 0 (in Lightning's wait)


@pytest.mark.slow  # about 30 s of deliberate waits (make test-slow)
def test_long_steps_saves_and_validation_are_never_a_desync(tmp_path):
    """Three waits of 3 s against a watchdog at 0.5 s: reported while they last, nothing stopped."""
    runs = _run(
        tmp_path,
        strategy={"stage": 3, "wrap_policy": "torch.nn.Linear", "watchdog_s": 0.5},
        model={"val_slow_on": 1},
        slow_on=1,
        at=1,
        slow_save_on=0,
        checkpoint_at=4,
        val_every=5,
        max_steps=6,
    )
    for run in runs:
        assert run.returncode == 0, run.output[-4000:]
        assert f"rank {run.rank} finished at step 6" in run.output
        # the report's words, not "desync" alone: the script's own path (in Lightning's srun hint) has it
        assert "out of step (a desync)" not in run.output and "CollectivesStopped" not in run.output
    rank0, rank1 = (run.output for run in runs)
    slow = "some ranks are not in a collective: they are slow, or blocked elsewhere"
    # the slow step (rank 1 sleeps at the batch's start, after both agreed the last batch): rank 0
    # waits in the first collective of the step, its first unit's all-gather, while rank 1 computes
    assert re.search(
        rf"{slow}:\n  rank 0 \({HOST}\) waits in all_gather #\d+ zero3/all_gather/unit=\w+ .*\n"
        rf"  rank 1 \({HOST}\) is not in a collective: its last was agree #\d+ zero3/agree/batch",
        rank0,
    )
    assert "rank 1 computes slowly at step 1" in rank1
    # the long save: rank 1 waits in the gather of the checkpoint while rank 0 writes
    assert "rank 0 saves slowly" in rank0
    assert re.search(rf"{slow}:\n.*\n  rank 1 \({HOST}\) waits in gather #\d+ zero3/gather/checkpoint", rank1)
    # the long validation (after step 5): rank 0 waits in a unit's all-gather while rank 1 sleeps
    assert "rank 1 validates slowly" in rank1
    during_validation = rank0[rank0.index("rank 0 step 5") : rank0.index("rank 0 step 6")]
    assert re.search(
        rf"{slow}:\n  rank 0 \({HOST}\) waits in all_gather #\d+ zero3/all_gather/unit=", during_validation
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
