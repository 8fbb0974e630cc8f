"""Signals under ZeRO: a flag in the handler, a decision at the step boundary, taken by every rank.

[Note: signals at step boundaries]
Lightning's own SIGTERM handler broadcasts a tensor from inside the handler, and its SLURM
handler saves a checkpoint there: a collective at whatever point each rank happens to be (one in
its forward, one between two buckets, one writing a file), which under ZeRO, where saving is
itself a collective, hangs or saves half a step. With ``handle_signals`` the strategy replaces
Lightning's signal connector (:class:`StopSignals`): SIGTERM, SIGUSR1 and SIGINT only append to a
list. After every training batch (its optimizer step, and the user's callbacks, done) all ranks
exchange a few bits each (:meth:`StepBoundary.agree`:
one AllReduce of a host table of N rows on the communicator's gloo side group, which replaces
Lightning's own per-batch broadcast of its SIGTERM flag; on a GPU it costs no device-to-host
synchronisation, and it checks that the ranks are at the same collective, see [Note: checked
issue] in ``comm/checks.py``):
which signals each rank has received, and whether this was its last batch of the epoch. A signal
on any rank makes every rank stop after the optimizer step under way when it arrived: at the end
of that batch everywhere (of the accumulation window's last batch, inside one), save ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir`` (full or sharded, as
configured), ask SLURM to requeue the job when SLURM sent its requeue signal (SIGUSR1 by default,
``SLURMEnvironment.requeue_signal``), print why, and leave fit with status 128 + the signal's
number (143 for SIGTERM, 138 for SIGUSR1, 130 for SIGINT) through :class:`~lightning_zero.faults.AgreedStop`.

A second SIGTERM or SIGINT during a save changes nothing (the save completes; SLURM's SIGKILL
comes after its grace time anyway); outside a save it raises KeyboardInterrupt at once (a rank
that never reaches a step boundary, say stuck or in a long validation, can still be ended, and
the fault board tells the other ranks why). A second SIGUSR1 changes nothing. A SIGUSR1 handler installed by someone else
(``examples.slurm.callbacks.RequeueOnSignal``) is left in place. Outside fit (validate, test,
predict) a signal makes Lightning's evaluation loop stop on that rank at its next batch.

The same bits catch uneven data: ranks that do not all reach their last batch at the same batch
would pair up their collectives wrongly (a hang, or gradients averaged across different steps);
every rank raises :class:`UnevenBatchesError` at the end of the last batch they share, before any
collective of the next.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Generator
from contextlib import contextmanager
from types import FrameType
from typing import Any, NamedTuple

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn

from lightning_zero.comm import Communicator
from lightning_zero.comm.faults import CollectivesStopped
from lightning_zero.faults import AgreedStop

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # what the strategy takes over
SIGNAL_BITS = {signal.SIGTERM: 1, signal.SIGUSR1: 2, signal.SIGINT: 4}  # this rank's flags
LAST_BATCH = 8  # this rank is at its last batch of the epoch
FLAG_BITS = 16  # the flags above live in the low bits; the counts of [Note: steps agreed] above them
COUNT_BITS = 20  # each count is agreed modulo 2**20 (a desync shows within a batch, long before a wrap)
_COUNT_MASK = (1 << COUNT_BITS) - 1


def with_counts(flags: int, steps: int, backwards: int) -> int:
    """``flags`` with this rank's optimizer steps and backward passes in the bits above them."""
    return flags | (steps & _COUNT_MASK) << FLAG_BITS | (backwards & _COUNT_MASK) << (FLAG_BITS + COUNT_BITS)


def counts_of(flags: int) -> tuple[int, int]:
    """(optimizer steps, backward passes) packed by :func:`with_counts`."""
    return flags >> FLAG_BITS & _COUNT_MASK, flags >> (FLAG_BITS + COUNT_BITS) & _COUNT_MASK


class UnevenBatchesError(RuntimeError):
    """The ranks do not have the same number of batches in an epoch."""


class StopSignals(_SignalConnector):
    """Lightning's signal connector for a trainer with this strategy: the handlers only take note.

    See [Note: signals at step boundaries]. ``received`` lists the signals in arrival order.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        super().__init__(trainer)
        self.received: list[int] = []  # signal numbers, in arrival order
        self.saving = 0  # > 0 while a checkpoint is written: a second signal waits for it

    def register_signal_handlers(self) -> None:
        self.received_sigterm = False
        self._original_handlers = self._get_current_signal_handlers()
        for signum in STOP_SIGNALS:
            if signum == signal.SIGUSR1 and self._has_python_handler(signum):
                continue  # someone else's requeue handler (RequeueOnSignal): theirs
            self._register_signal(signum, self._on_signal)

    @staticmethod
    def _has_python_handler(signum: int) -> bool:
        handler = signal.getsignal(signum)
        return callable(handler) and handler is not signal.default_int_handler

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        repeated = signum in self.received
        self.received.append(signum)
        if repeated and signum != signal.SIGUSR1 and not self.saving:
            # asked twice, and not inside a save (which completes): leave now, the peers are told why
            reason = f"{signal.Signals(signum).name} received twice: leaving at once, without a checkpoint"
            os.write(
                2, f"lightning_zero: rank {self.trainer.global_rank}: {reason}\n".encode()
            )  # no buffered IO here
            raise KeyboardInterrupt(reason)
        if self.trainer.state.fn != TrainerFn.FITTING:  # validate/test/predict: Lightning's loops stop
            self.received_sigterm = True

    def bits(self) -> int:
        flags = 0
        for signum in self.received:
            flags |= SIGNAL_BITS.get(signum, 0)
        return flags


class StopRequest(NamedTuple):
    step: int  # global step when the ranks agreed
    signals: dict[int, list[str]]  # rank -> names of the signals it received


def names_of(flags: int) -> list[str]:
    return [s.name for s, bit in SIGNAL_BITS.items() if flags & bit]


class StepBoundary:
    """The per-batch agreement and what follows from it (see [Note: signals at step boundaries]).

    Args:
        comm: the strategy's communicator (the agreement is one of its control collectives).
        label: prefix of the collective's name, e.g. ``"zero2"``.
    """

    def __init__(self, comm: Communicator, label: str) -> None:
        self.comm = comm
        self.label = label
        self.connector: StopSignals | None = None  # installed on the trainer, or None (handle_signals off)
        self.stop: StopRequest | None = None  # agreed: stop at the next optimizer-step boundary
        self.trainer: pl.Trainer | None = None  # the trainer it is installed on
        self._step_at_start = -1  # global_step when the current batch started

    def install(self, trainer: pl.Trainer, *, handle_signals: bool, backwards: Callable[[], int]) -> None:
        """Take over Lightning's signal handling for this run (and its per-batch broadcast)."""
        self.stop, self._step_at_start, self.trainer = None, -1, trainer
        if handle_signals:
            self.connector = StopSignals(trainer)
            trainer._signal_connector = self.connector
            # Lightning's own per-batch broadcast of its SIGTERM flag: replaced by the agreement
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast
        if not any(isinstance(c, _StopAtStepEnd) for c in trainer.callbacks):
            trainer.callbacks.append(_StopAtStepEnd(self, backwards))

    @contextmanager
    def saving(self) -> Generator[None, None, None]:
        """Around a checkpoint save: a second signal lets it complete."""
        if self.connector is not None:
            self.connector.saving += 1
        try:
            yield
        finally:
            if self.connector is not None:
                self.connector.saving -= 1

    def uninstall(self) -> None:
        if self.trainer is not None:
            self.trainer.callbacks[:] = [
                c for c in self.trainer.callbacks if not isinstance(c, _StopAtStepEnd)
            ]
        self.connector, self.trainer = None, None

    def begin(self, trainer: pl.Trainer) -> None:
        """Before a training batch (no collective): where the batch starts."""
        self._step_at_start = trainer.global_step

    def agree(self, trainer: pl.Trainer, batch_idx: int, backwards: int) -> None:
        """After a training batch: every rank's signals, last-batch flag, optimizer steps and
        backward passes, on every rank (see [Note: steps agreed])."""
        flags = self.connector.bits() if self.connector is not None else 0
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            flags |= LAST_BATCH
        flags = with_counts(flags, trainer.global_step, backwards)
        table = self.comm.agree(flags, name=f"{self.label}/agree/batch", device=trainer.strategy.root_device)
        check_counts(table, f"at the end of batch {batch_idx}")
        table = [f & ((1 << FLAG_BITS) - 1) for f in table]
        check_even(table, trainer, batch_idx, self._step_at_start)
        signalled = {r: names_of(f) for r, f in enumerate(table) if names_of(f)}
        if signalled and self.stop is None:
            self.stop = StopRequest(trainer.global_step, signalled)
            if trainer.is_global_zero:
                print(f"lightning_zero: {describe_signals(signalled)}: stopping after this step", flush=True)

    def after_batch(self, trainer: pl.Trainer) -> None:
        """After a training batch: at an optimizer-step boundary with a stop agreed, save and leave."""
        if self.stop is None or trainer.global_step == self._step_at_start:
            return  # nothing asked, or inside an accumulation window
        if 0 <= trainer.max_steps <= trainer.global_step:
            print(
                f"lightning_zero: rank {trainer.global_rank}: the last step is done, fit ends as planned",
                flush=True,
            )
            return
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        trainer.save_checkpoint(path)  # every rank, at the same step
        # rank 0's outcome on every rank: nobody leaves before the job is requeued (srun's
        # --kill-on-bad-exit would end rank 0 in the middle of `scontrol requeue`)
        requeued = trainer.strategy.broadcast(self._requeue(trainer, path), src=0)
        first = next(s for names in self.stop.signals.values() for s in names)
        message = (
            f"lightning_zero: rank {trainer.global_rank} stops: {describe_signals(self.stop.signals)} "
            f"at step {self.stop.step}; checkpoint saved at step {trainer.global_step}: {path}{requeued}"
        )
        print(message, file=sys.stderr, flush=True)
        raise AgreedStop(128 + signal.Signals[first].value)

    def _requeue(self, trainer: pl.Trainer, path: str) -> str:
        """Rank 0 asks SLURM to requeue the job, when SLURM sent its requeue signal."""
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
            return ""
        wanted = signal.Signals(environment.requeue_signal or signal.SIGUSR1).name
        if not any(wanted in names for names in self.stop.signals.values()):
            return f"; not requeued ({wanted} is SLURM's requeue signal, the job's end is SLURM's to decide)"
        if not trainer.is_global_zero:
            return ""  # rank 0's outcome is broadcast
        return requeue_slurm_job(path)


def requeue_slurm_job(path: str) -> str:
    """``scontrol requeue`` this job; the outcome, for the stop message."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    # printed first: once SLURM has the request, SIGTERM may end this process at any moment
    print(f"lightning_zero: saved {path}; requeueing SLURM job {job_id}", flush=True)
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"; `scontrol requeue {job_id}` failed: {err}"
    if result.returncode != 0:
        return f"; `scontrol requeue {job_id}` failed: {result.stderr.strip()}"
    return f"; SLURM job {job_id} requeued"


def describe_signals(signalled: dict[int, list[str]]) -> str:
    by_signal: dict[str, list[int]] = {}
    for rank, names in sorted(signalled.items()):
        for name in names:
            by_signal.setdefault(name, []).append(rank)
    return "; ".join(f"{name} received by rank(s) {_ranks(ranks)}" for name, ranks in by_signal.items())


def _ranks(ranks: list[int]) -> str:
    return (
        ", ".join(map(str, ranks))
        if len(ranks) <= 8
        else f"{', '.join(map(str, ranks[:8]))} and {len(ranks) - 8} more"
    )


def check_counts(table: list[int], where: str) -> None:
    """[Note: steps agreed] Every rank took as many optimizer steps and backward passes as the others
        before this batch (under Fabric: this training forward); else :class:`CollectivesStopped` on
        every rank, naming the counts.

        A rank that skips ``optimizer.step()`` (a condition true on some ranks only), runs a backward
        the others do not, or returns None from ``training_step`` on its own (Lightning then skips its
        backward and step) is out of step with the others; its collectives may still pair with theirs
        (stage 3 issues none at the step) and the run would end with a wrong model and exit 0. The
        per-batch agreement, which every rank makes once per batch whatever it skipped, carries each
        rank's counts, so the ranks stop together at the end of that batch, on every backend (``where``
    says where: "at the end of batch 2", "before training forward 4"). Fabric has no
        batches: its glue agrees the counts before every training forward (grad mode on, the model in
        training mode), one small all-reduce of host memory on the side group."""
    counts = [counts_of(f) for f in table]
    if len(set(counts)) == 1:
        return
    first = counts[0]
    apart = [r for r, c in enumerate(counts) if c != first]
    what = "optimizer steps" if any(c[0] != first[0] for c in counts) else "backward passes"
    listing = "; ".join(
        f"rank {r}: {c[0]} optimizer steps, {c[1]} backward passes" for r, c in enumerate(counts)
    )
    raise CollectivesStopped(
        f"the ranks are out of step (a desync) {where}: they took different numbers of "
        f"{what} ({listing}; rank(s) {_ranks(apart)} differ from rank 0). Every rank must run the same "
        "backward passes and optimizer steps: an optimizer.step() or manual_backward() skipped on some ranks, "
        "or a training_step that returns None on some ranks only, trains each rank on other gradients"
    )


def check_even(table: list[int], trainer: pl.Trainer, batch_idx: int, step: int | None = None) -> None:
    """Every rank at its last batch, or none: else :class:`UnevenBatchesError` on every rank.
    ``step``: the global step the batch started at (None: the trainer's now)."""
    last = [r for r, f in enumerate(table) if f & LAST_BATCH]
    if not last or len(last) == len(table):
        return
    more = [r for r, f in enumerate(table) if not f & LAST_BATCH]
    raise UnevenBatchesError(
        f"the ranks have different numbers of training batches in epoch {trainer.current_epoch}: rank(s) "
        f"{_ranks(last)} reach their last batch at batch {batch_idx} (step {trainer.global_step if step is None else step}), rank(s) "
        f"{_ranks(more)} have more. Every rank must run as many batches per epoch as the others, or their "
        "collectives pair up wrongly (a hang, or gradients of different steps averaged). Use Lightning's "
        "DistributedSampler (use_distributed_sampler=True pads the ranks to equal length), give every "
        "rank's sampler the same length, or set limit_train_batches to the shortest rank's count"
    )


def _no_broadcast() -> None:
    """Lightning's per-batch SIGTERM broadcast, replaced by :meth:`StepBoundary.agree`."""


class _StopAtStepEnd(Callback):
    """Runs :meth:`StepBoundary.after_batch` after the user's callbacks (ModelCheckpoint included)."""

    def __init__(self, boundary: StepBoundary, backwards: Callable[[], int]) -> None:
        self.boundary = boundary
        self.backwards = backwards  # the backward passes this rank ran so far

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.boundary.agree(trainer, batch_idx, self.backwards())  # signals, last batches, counts
        self.boundary.after_batch(trainer)
