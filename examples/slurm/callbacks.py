"""Callbacks for SLURM jobs: step-boundary preemption for strategies that lack it, and a per-rank
record of a run.

``ZeroStrategy`` handles SLURM's signals itself (``handle_signals``, lightning_zero/signals.py:
SIGUSR1 saves and requeues, SIGTERM saves and stops), so ``examples/slurm/train.sbatch`` adds no
callback for it. ``RequeueOnSignal`` does the SIGUSR1 part for other strategies (Lightning's
``ddp``, say), whose own SLURM handler saves from inside the signal handler (see the Note below);
with a ZeroStrategy it takes SIGUSR1 over (the strategy leaves a SIGUSR1 handler installed by
someone else in place). ``RunDigest`` writes, for each rank, what the SLURM tests check: ranks,
world size, the validation losses and a hash of the final parameters:

    srun python examples/train.py +callbacks.digest._target_=examples.slurm.callbacks.RunDigest
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

log = logging.getLogger(__name__)

HPC_CKPT = re.compile(r"hpc_ckpt_(\d+)\.ckpt")  # the names Lightning's fit() resumes from under SLURM


# [Note: checkpointing on a signal, at a step boundary]
# SLURM announces the end of a job (its time limit with `--signal=USR1@90`, or `scancel --signal=USR1`)
# by sending SIGUSR1 to every task. Lightning's own handler (SLURMEnvironment(auto_requeue=True))
# saves `hpc_ckpt_<n>.ckpt` from inside the signal handler, i.e. wherever each rank happens to
# be: one rank in its forward, another between two gradient buckets. Under ZeRO stages 1-3 saving
# is itself a collective (the sharded optimizer state is gathered), so ranks entering it at
# different points issue collectives in different orders: a hang, or a checkpoint of a half-done
# step. So the handler here only records the signal. At the end of each optimizer step, all ranks
# agree whether any of them was signalled (one all-reduce of a flag) and, if so, all save the
# checkpoint together; rank 0 then asks SLURM to requeue the job and every rank leaves the run.
# The requeued job runs the same batch script again, and fit() resumes from the newest
# `hpc_ckpt_<n>.ckpt` in `default_root_dir`, which therefore must be the same folder in every
# attempt (train.sbatch names it after the job id).


def next_hpc_checkpoint(root: str | Path) -> Path:
    """``root/hpc_ckpt_<n+1>.ckpt`` for the highest ``n`` already in ``root`` (``n = 0`` when none)."""
    root = Path(root)
    versions = [int(m.group(1)) for p in root.glob("hpc_ckpt_*.ckpt") if (m := HPC_CKPT.fullmatch(p.name))]
    return root / f"hpc_ckpt_{max(versions, default=0) + 1}.ckpt"


def slurm_job_id() -> str | None:
    """The id ``scontrol requeue`` takes: ``<array job>_<task>`` in a job array, else the job id."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


class RequeueOnSignal(L.Callback):
    """On SIGUSR1 from SLURM: checkpoint at the next optimizer step on all ranks, requeue, leave.

    Active only when the trainer runs under Lightning's ``SLURMEnvironment`` (launched by
    ``srun``); elsewhere it does nothing. Its handler is installed before Lightning registers its
    own, which Lightning then leaves out. See [Note: checkpointing on a signal, at a step boundary].

    Args:
        signum: the signal SLURM sends (``--signal=USR1@90`` in the batch script), by name or number.
        check_every_n_steps: how often the ranks compare notes (an all-reduce of one number, and a
            host sync on GPUs); the save waits at most this many steps after the signal.
        exit_after_requeue: end this attempt (``SystemExit(0)`` on every rank) once the job is
            requeued, rather than train on until SLURM kills it.
    """

    def __init__(
        self, *, signum: int | str = "SIGUSR1", check_every_n_steps: int = 1, exit_after_requeue: bool = True
    ) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.signum = signal.Signals[signum] if isinstance(signum, str) else signal.Signals(signum)
        self.check_every_n_steps = check_every_n_steps  # optimizer steps between two agreements
        self.exit_after_requeue = exit_after_requeue
        self._signalled = False  # set by the handler on this rank
        self._installed = False  # our handler is in place (during fit under SLURM)
        self._previous_handler: Any = None  # what it replaced, restored at teardown
        self._last_checked_step = -1  # global_step at the last agreement

    @property
    def signalled(self) -> bool:
        return self._signalled

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if stage != "fit" or not isinstance(environment, SLURMEnvironment):
            return
        self._previous_handler = signal.signal(self.signum, self._on_signal)
        self._installed = True

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._installed:
            # None: the replaced handler was not set from Python; the default is the closest
            signal.signal(
                self.signum, self._previous_handler if self._previous_handler is not None else signal.SIG_DFL
            )
            self._installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True  # acted on at the next step boundary, by all ranks together

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self._installed or not self._at_check(trainer.global_step):
            return
        if not trainer.strategy.reduce_boolean_decision(self._signalled, all=False):
            return
        path = self._save_hpc_checkpoint(trainer)
        # A requeue ends this attempt with SIGTERM. Lightning's SIGTERM handler issues a collective
        # from inside the handler, out of step with the other ranks, so SIGTERM simply ends the
        # process from now on: the checkpoint is written.
        sigterm_handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)
        requeued = trainer.strategy.broadcast(self._requeue(trainer, path), src=0)
        if not requeued:
            signal.signal(signal.SIGTERM, sigterm_handler)
            self._signalled = False  # keep training; the next signal tries again
            return
        if self.exit_after_requeue:
            raise SystemExit(0)

    def _at_check(self, global_step: int) -> bool:
        """Once per optimizer step (not per micro-batch), every ``check_every_n_steps`` steps."""
        if global_step == self._last_checked_step or global_step % self.check_every_n_steps != 0:
            return False
        self._last_checked_step = global_step
        return True

    def _save_hpc_checkpoint(self, trainer: L.Trainer) -> Path:
        path = trainer.strategy.broadcast(next_hpc_checkpoint(trainer.default_root_dir), src=0)
        trainer.save_checkpoint(path)  # a collective under ZeRO: every rank is here, at the same step
        return path

    def _requeue(self, trainer: L.Trainer, path: Path) -> bool:
        """Rank 0 asks SLURM to requeue this job; True if it accepted."""
        if not trainer.is_global_zero:
            return False  # the decision is rank 0's, broadcast by the caller
        job_id = slurm_job_id()
        if job_id is None:
            log.warning("saved %s, but SLURM_JOB_ID is not set: cannot requeue", path)
            return False
        # printed first: once SLURM has the request, SIGTERM may end this process at any moment
        print(f"step {trainer.global_step}: saved {path}; requeueing SLURM job {job_id}", flush=True)
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
        if result.returncode != 0:
            log.warning("`scontrol requeue %s` failed, training on: %s", job_id, result.stderr.strip())
            return False
        return True


def parameter_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """Hash of names, dtypes, shapes and bytes of every tensor, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class RunDigest(L.Callback):
    """Writes ``digest_rank<r>.json`` per rank (and ``params.pt`` from rank 0) when fit ends.

    The JSON holds the rank's place (global, local and node rank, world size, number of nodes,
    cluster environment, SLURM job id, node name and restart count), the final global step, the SHA-256 of
    the module's state dict and every validation loss by step. The losses are part of the
    callback's checkpointed state, so a requeued run reports the losses of all its attempts.
    A run left through ``SystemExit`` (``RequeueOnSignal``) writes nothing.

    Args:
        out_dir: folder for the files; None: the trainer's ``default_root_dir``.
        save_params: rank 0 also saves the final state dict, for comparisons across runs.
    """

    def __init__(self, *, out_dir: str | None = None, save_params: bool = True) -> None:
        self.out_dir = out_dir
        self.save_params = save_params
        self._val_losses: dict[int, float] = {}  # global_step -> synchronised val_loss

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val_loss")
        if loss is None or (trainer.sanity_checking and trainer.global_step > 0):
            return  # a resumed run's sanity check repeats a validation already recorded
        self._val_losses[trainer.global_step] = float(loss)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        out_dir = Path(self.out_dir if self.out_dir is not None else trainer.default_root_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        # stage 3 holds 1/N of each parameter between steps: hash the whole model, gathered on
        # every rank together (the other strategies hold whole parameters; nothing to gather)
        gathered = getattr(trainer.strategy, "gathered", contextlib.nullcontext)
        with gathered():
            state = {
                k: v.detach().clone()
                for k, v in pl_module.state_dict().items()
                if isinstance(v, torch.Tensor)
            }
        record = self._record(trainer, parameter_sha256(state))
        (out_dir / f"digest_rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))
        if self.save_params and trainer.is_global_zero:
            torch.save({k: v.cpu() for k, v in state.items()}, out_dir / "params.pt")

    def _record(self, trainer: L.Trainer, sha256: str) -> dict[str, Any]:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        return {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "cluster_environment": type(environment).__name__,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_node": os.environ.get("SLURMD_NODENAME"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            "global_step": trainer.global_step,
            "param_sha256": sha256,
            "val_losses": sorted(self._val_losses.items()),
            "trainable_params": sum(
                p.numel() for p in trainer.lightning_module.parameters() if p.requires_grad
            ),
            "link_bytes": _link_bytes(trainer.strategy),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"val_losses": dict(self._val_losses)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._val_losses = {int(k): float(v) for k, v in state_dict["val_losses"].items()}


def _link_bytes(strategy: Any) -> dict[int, dict[str, float]]:
    """Per kept step, the wire bytes this rank sent over intra- and inter-node links (this package's
    strategies; see [Note: links] in lightning_zero/comm/ledger.py); empty for other strategies."""
    ledger = getattr(strategy, "ledger", None)
    if ledger is None or not hasattr(ledger, "link_bytes"):
        return {}
    return {step: ledger.link_bytes(step) for step in ledger.steps()}
