"""The non-finite guard: a NaN or inf on any rank is one decision for every rank.

[Note: non-finite guard]
Without a guard a NaN loss on one rank spreads to every rank's weights through the gradient
reduction, and the fit ends with status 0 (torch DDP does the same). With ``nonfinite_grads``
set, every optimizer step runs as follows: Lightning's closure (forward, backward with its
reductions, clipping) runs first; then each rank sets two bits, a non-finite loss of its own
micro-batch and a non-finite value in the gradients it holds (stage 0: the averaged gradients;
stages 1-3: its shard), and one AllReduce of N int64 (a control collective, see
[Note: bounded ledger]) gives every rank every rank's bits. If any bit is set:

- ``"skip"``: every rank drops the gradients of the optimizer's parameters and does not call
  ``optimizer.step``, so weights and optimizer state (moments, step counts) stay exactly as they
  were; Lightning still counts the step (``global_step``, LR schedulers advance). The monitor logs
  the count as ``zero/skipped_steps``.
- ``"stop"``: every rank raises :class:`NonFiniteGradientError`, naming the step and the ranks
  whose loss (the ranks that produced it) or gradients were not finite.

With fp16 loss scaling (``ZeroGradScaler``) the scaler already skips such steps, every rank
agreeing; the guard then stands aside.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.zero.dtensor import local_of

log = logging.getLogger(__name__)

LOSS, GRADS = 1, 2  # this rank's bits: its loss, the gradients it holds


class NonFiniteGradientError(RuntimeError):
    """A NaN or inf in the loss or the gradients of a rank, with ``nonfinite_grads="stop"``."""


def is_finite(tensors: list[Tensor]) -> bool:
    """Whether every element of every tensor is finite (one device sync)."""
    if not tensors:
        return True
    flags = torch.stack([torch.isfinite(t).all() for t in tensors])
    return bool(flags.all())


class NonFiniteGuard:
    """See [Note: non-finite guard].

    Args:
        comm: the strategy's communicator (the agreement is one of its control collectives).
        action: ``"skip"`` or ``"stop"``.
        label: prefix of the collective's name, e.g. ``"zero2"``.
    """

    def __init__(self, comm: Communicator, action: str, label: str) -> None:
        self.comm = comm
        self.action = action
        self.label = label
        self.skipped_steps = 0  # optimizer steps skipped over the guard's life

    @contextmanager
    def guarding(
        self, optimizer: Optimizer, *, step: int, device: torch.device
    ) -> Generator[None, None, None]:
        """Around Lightning's ``optimizer_step``: ``optimizer.step`` runs the closure, decides, steps."""
        original = optimizer.step

        def step_if_finite(closure: Any = None, **kwargs: Any) -> Any:
            loss = closure() if closure is not None else None
            if self.decide(optimizer, loss, step=step, device=device):
                return original(**kwargs)
            return loss

        optimizer.step = step_if_finite  # this call only: the class's step is untouched
        try:
            yield
        finally:
            del optimizer.step

    def decide(self, optimizer: Optimizer, loss: Any, *, step: int, device: torch.device) -> bool:
        """True: step. False: skip (the gradients dropped). Raises with ``"stop"``."""
        grads = [local_of(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        flags = (0 if not isinstance(loss, Tensor) or is_finite([loss.detach()]) else LOSS) | (
            0 if is_finite(grads) else GRADS
        )
        table = self.comm.agree(flags, name=f"{self.label}/agree/nonfinite", device=device)
        if not any(table):
            return True
        what = describe(table, step)
        if self.action == "stop":
            raise NonFiniteGradientError(
                f"{what}. nonfinite_grads='stop' ends the run on every rank; 'skip' would skip such steps"
            )
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        self.skipped_steps += 1
        if self.comm.rank == 0:
            log.warning(f"{what}: step skipped on every rank ({self.skipped_steps} skipped so far)")
        return False


def describe(table: list[int], step: int) -> str:
    """``step 12: non-finite loss on rank(s) 1; non-finite gradients on rank(s) 0, 1``."""
    parts = []
    for bit, what in ((LOSS, "loss"), (GRADS, "gradients")):
        ranks = [r for r, f in enumerate(table) if f & bit]
        if ranks:
            parts.append(f"non-finite {what} on rank(s) {', '.join(map(str, ranks))}")
    return f"step {step}: {'; '.join(parts)}"
