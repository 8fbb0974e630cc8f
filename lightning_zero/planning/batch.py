"""Global batch planning: gbs = mbs x grad_acc x dp.

The order the planner follows: fix the global batch (in tokens) and the sequence length, which
gives the global batch in samples; take the largest micro-batch that fits one rank; the
data-parallel size dp is what the cluster offers; gradient accumulation fills the rest:
grad_acc = gbs / (mbs x dp). Example: 4M tokens of 4k sequences = 1024 samples, mbs = 2 on 128
ranks: grad_acc = 1024 / (2 x 128) = 4; on 512 ranks grad_acc = 1 and a step is 4x faster.

A grad_acc below 1 means more ranks than the batch can feed: use fewer ranks, a larger global
batch, or a smaller micro-batch (at the cost of per-rank efficiency).

:func:`accumulate_grad_batches` is the same arithmetic for a config; :func:`register_resolvers`
makes it the OmegaConf resolver ``zero_grad_acc``::

    trainer:
      accumulate_grad_batches: ${zero_grad_acc:${data.global_batch},${data.batch_size},${trainer.devices}}

An optional fourth argument multiplies the world size by the number of nodes
(``${zero_grad_acc:...,${trainer.devices},${trainer.num_nodes}}``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

RESOLVER_NAME = "zero_grad_acc"  # OmegaConf resolver registered by register_resolvers()


class BatchPlanWarning(UserWarning):
    """The requested global batch cannot be met exactly with the given ranks and micro-batch."""


class BatchPlan(NamedTuple):
    global_batch: int  # samples per optimizer step actually planned: micro_batch x grad_acc x dp
    micro_batch: int  # samples per rank per forward/backward (mbs)
    grad_acc: int  # micro-batches accumulated per optimizer step
    dp: int  # data-parallel ranks
    seq_len: int | None  # tokens per sample, if known
    global_batch_tokens: int | None  # global_batch x seq_len, if seq_len is known
    requested_global_batch: int  # samples asked for
    grad_acc_exact: float  # requested / (max micro-batch x dp); below 1: too many ranks
    warnings: tuple[str, ...]  # why the plan differs from the request, empty if it does not


def plan_batch(
    global_batch_tokens: float,
    *,
    seq_len: int,
    max_micro_batch: int,
    dp: int,
    round_to_power_of_two: bool = False,
) -> BatchPlan:
    """Micro-batch and gradient accumulation for a global batch given in tokens.

    Args:
        global_batch_tokens: target tokens per optimizer step.
        seq_len: tokens per sample.
        max_micro_batch: largest micro-batch that fits one rank.
        dp: data-parallel ranks.
        round_to_power_of_two: round the global batch in samples to the nearest power of two
            (4M tokens / 4096 = 976.6 -> 1024); otherwise to the nearest integer.
    """
    _check_positive(seq_len=seq_len)
    if not global_batch_tokens >= seq_len:
        raise ValueError(f"global_batch_tokens must be >= seq_len = {seq_len}, got {global_batch_tokens}")
    samples = global_batch_tokens / seq_len
    samples = 2 ** round(math.log2(samples)) if round_to_power_of_two else round(samples)
    return plan_batch_samples(samples, max_micro_batch=max_micro_batch, dp=dp, seq_len=seq_len)


def plan_batch_samples(
    global_batch: int, *, max_micro_batch: int, dp: int, seq_len: int | None = None
) -> BatchPlan:
    """Micro-batch and gradient accumulation for a global batch given in samples.

    The planner keeps the global batch exact when it can: it takes the largest micro-batch up to
    ``max_micro_batch`` such that micro_batch x dp divides the global batch. When no micro-batch
    does (the global batch is not a multiple of dp, or is smaller than dp), it warns with a
    :class:`BatchPlanWarning` and plans the nearest global batch it can.

    Args:
        global_batch: target samples per optimizer step.
        max_micro_batch: largest micro-batch that fits one rank.
        dp: data-parallel ranks.
        seq_len: tokens per sample, to report the batch in tokens.
    """
    _check_positive(global_batch=global_batch, max_micro_batch=max_micro_batch, dp=dp)
    exact = global_batch / (max_micro_batch * dp)
    notes = []
    if exact < 1:
        notes.append(
            f"grad_acc = {global_batch} / ({max_micro_batch} x {dp}) = {exact:.3g} < 1: more ranks than the "
            "global batch can feed; use fewer ranks, a larger global batch or a smaller micro-batch"
        )
    mbs, acc, note = _fit_micro_batch(global_batch, max_micro_batch, dp)
    notes.extend(n for n in [note] if n)
    for message in notes:
        warnings.warn(message, BatchPlanWarning, stacklevel=2)
    planned = mbs * acc * dp
    tokens = planned * seq_len if seq_len else None
    return BatchPlan(planned, mbs, acc, dp, seq_len, tokens, global_batch, exact, tuple(notes))


def _fit_micro_batch(global_batch: int, max_micro_batch: int, dp: int) -> tuple[int, int, str | None]:
    """(micro_batch, grad_acc, note): the largest exact micro-batch, else the nearest batch."""
    for mbs in range(max_micro_batch, 0, -1):
        if global_batch % (mbs * dp) == 0:
            note = None
            if mbs < max_micro_batch and global_batch >= max_micro_batch * dp:
                note = (
                    f"micro-batch lowered from {max_micro_batch} to {mbs} so that {global_batch} = {mbs} x "
                    f"{global_batch // (mbs * dp)} x {dp}; a global batch that is a multiple of "
                    f"{max_micro_batch * dp} keeps micro-batch {max_micro_batch}"
                )
            return mbs, global_batch // (mbs * dp), note
    mbs = max(1, min(max_micro_batch, global_batch // dp))
    acc = max(1, round(global_batch / (mbs * dp)))
    note = (
        f"global batch {global_batch} is not a multiple of dp = {dp}; planned {mbs * acc * dp} = "
        f"{mbs} x {acc} x {dp} instead"
    )
    return mbs, acc, note


def accumulate_grad_batches(global_batch: int, micro_batch: int, world_size: int) -> int:
    """grad_acc = global_batch / (micro_batch x world_size), for a Trainer's accumulate_grad_batches.

    Args:
        global_batch: samples per optimizer step over all ranks.
        micro_batch: samples per rank per forward/backward (the DataLoader's batch size).
        world_size: data-parallel ranks (devices x nodes). A list of device ids counts its length.

    Raises:
        ValueError: an argument is not a positive integer, or the division is not exact.
    """
    global_batch = _as_count("global_batch", global_batch)
    micro_batch = _as_count("micro_batch", micro_batch)
    world_size = _as_count("world_size", world_size)
    per_step = micro_batch * world_size
    if global_batch % per_step:
        raise ValueError(
            f"global_batch {global_batch} is not divisible by micro_batch x world_size = {micro_batch} x "
            f"{world_size} = {per_step}; choose a global batch that is a multiple of {per_step}"
        )
    return global_batch // per_step


def register_resolvers() -> None:
    """Register the OmegaConf resolver ``zero_grad_acc`` (idempotent: safe to call repeatedly)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver(RESOLVER_NAME, _resolve_grad_acc, replace=True)


def _resolve_grad_acc(global_batch: Any, micro_batch: Any, devices: Any, num_nodes: Any = 1) -> int:
    world_size = _as_count("devices", devices) * _as_count("num_nodes", num_nodes)
    return accumulate_grad_batches(global_batch, micro_batch, world_size)


def _as_count(name: str, value: Any) -> int:
    """A positive int from an int, a digit string, or a list of device ids (its length)."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        value = len(value)
    elif isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_positive(**values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
