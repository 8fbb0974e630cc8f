"""Model-state memory per rank for plain data parallelism (stage 0) and ZeRO stages 1-3.

Pure arithmetic on Ψ (the number of trainable parameters) and N (the data-parallel world size);
activations, temporary full parameters and allocator overhead are not counted.

[Note: the k convention]
As in the ZeRO paper, ``k`` is the number of bytes per parameter that belong to the optimizer,
*including the fp32 master copy of the parameters* when training in mixed precision. Mixed-precision
Adam keeps a 4-byte master weight and two 4-byte moments, so k = 12 and, with 2-byte parameters and
gradients, a replica holds (2 + 2 + 12) Ψ = 16Ψ bytes. SGD with momentum keeps one 4-byte momentum:
k = 4 + 4 = 8 with a master copy, k = 4 without one (fp32 training, where the parameters themselves
are the fp32 weights and ``param_bytes`` is 4). :func:`optimizer_k` returns these presets; any other
optimizer is a free ``k``.

Per rank, with p = param_bytes, g = grad_bytes:

    stage 0 (DP)      (p + g + k) Ψ                       7.5B, k = 12, N = 64: 120 GB
    stage 1           (p + g) Ψ + k Ψ / N                                         31.4 GB
    stage 2           p Ψ + (g + k) Ψ / N                                         16.6 GB
    stage 3           (p + g + k) Ψ / N                                           1.88 GB

An fp32 gradient-accumulation buffer adds 4Ψ at stages 0-1 and 4Ψ/N at stages 2-3 (the sharded
stages only accumulate their own slice). Frozen parameters Ψ_f (a fine-tuned model's base) have
no gradient and no optimizer state: f Ψ_f bytes (f = 2 or 4) at stages 0-2, f Ψ_f / N at stage 3,
which shards them with the trainable ones. GB here is 1e9 bytes, as in the ZeRO paper.

[Note: shard size]
Hybrid sharding (``shard_size`` K, see [Note: hybrid layout] in ``hybrid.py``) shards the states
over a group of K ranks and replicates that group N/K times, so every /N above becomes /K:
stage 1 (p + g) Ψ + k Ψ / K, stage 2 p Ψ + (g + k) Ψ / K, stage 3 (p + g + k) Ψ / K; with bf16 and
Adam 4Ψ + 12Ψ/K, 2Ψ + 14Ψ/K and 16Ψ/K. ``shard_size=None`` is K = N (full sharding). Stage 0 shards
nothing and takes no K other than N.
"""

from __future__ import annotations

from typing import NamedTuple

GB = 1e9  # bytes; the unit of the ZeRO paper's table
STAGES = (0, 1, 2, 3)  # stage 0 is plain data parallelism
FP32_ACCUM_BYTES = 4  # bytes per parameter of an fp32 gradient-accumulation buffer

_STATE_BYTES = {  # optimizer state per parameter in fp32, without the master copy
    "adam": 8,  # first and second moment
    "adamw": 8,  # same states as Adam
    "sgd_momentum": 4,  # momentum buffer
    "sgd": 0,  # no state
}
_MASTER_BYTES = 4  # fp32 master copy of a parameter kept by mixed-precision training


class MemoryEstimate(NamedTuple):
    stage: int  # 0 = plain DP, 1-3 = ZeRO stage
    world_size: int  # N, the data-parallel ranks
    params: float  # bytes of (low-precision) parameters per rank
    grads: float  # bytes of gradients per rank
    optimizer: float  # bytes of optimizer state (incl. fp32 master copy) per rank
    grad_accum: float  # bytes of the fp32 gradient-accumulation buffer per rank (0 if off)
    total: float  # sum of the above, bytes per rank
    shard_size: int  # K, the ranks one copy of the states is sharded over (N: full sharding)


def optimizer_k(name: str, *, master_copy: bool = True) -> int:
    """Bytes of optimizer state per parameter (the ZeRO paper's k) for a named optimizer.

    Args:
        name: ``adam``, ``adamw``, ``sgd_momentum`` or ``sgd`` (case-insensitive).
        master_copy: count a 4-byte fp32 master copy of the parameters (mixed precision). Turn off
            for fp32 training, where the parameters are the fp32 weights.

    Returns:
        k: 12 for Adam/AdamW, 8 for SGD with momentum, 4 for plain SGD with a master copy;
        8, 4 and 0 without one.
    """
    key = name.lower().replace("-", "_")
    if key not in _STATE_BYTES:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {sorted(_STATE_BYTES)} or a number k")
    return _STATE_BYTES[key] + (_MASTER_BYTES if master_copy else 0)


def model_state_memory(
    psi: float,
    world_size: int,
    stage: int,
    *,
    shard_size: int | None = None,
    k: float = 12,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    fp32_grad_accum: bool = False,
    frozen: float = 0,
    frozen_bytes: float = 2,
) -> MemoryEstimate:
    """Model-state bytes per rank at one stage (see [Note: the k convention]).

    Args:
        psi: Ψ, trainable parameters.
        world_size: N, data-parallel ranks.
        stage: 0 (plain DP) to 3.
        shard_size: K, ranks per shard group under hybrid sharding (see [Note: shard size]);
            None: N.
        k: optimizer bytes per parameter, fp32 master copy included (Adam: 12).
        param_bytes: bytes per parameter element (2 for bf16/fp16).
        grad_bytes: bytes per gradient element (2 for bf16/fp16).
        fp32_grad_accum: add an fp32 gradient-accumulation buffer.
        frozen: Ψ_f, frozen parameters (counted with the parameters: no gradient, no optimizer state).
        frozen_bytes: bytes per frozen element (they keep their own dtype: 2 or 4).

    Returns:
        The estimate, split by category, in bytes.
    """
    _check(psi, world_size, stage, k)
    shards = check_shard_size(world_size, shard_size, stage)  # K: the sharded terms divide by it
    if frozen < 0:
        raise ValueError(f"frozen parameters must be >= 0, got {frozen}")
    params = (psi * param_bytes + frozen * frozen_bytes) / (shards if stage >= 3 else 1)
    grads = psi * grad_bytes / (shards if stage >= 2 else 1)
    optimizer = psi * k / (shards if stage >= 1 else 1)
    accum = psi * FP32_ACCUM_BYTES / (shards if stage >= 2 else 1) if fp32_grad_accum else 0.0
    total = params + grads + optimizer + accum
    return MemoryEstimate(stage, world_size, params, grads, optimizer, accum, total, shards)


def check_shard_size(world_size: int, shard_size: int | None, stage: int | None = None) -> int:
    """K for ``shard_size`` on N = ``world_size`` ranks: None gives N; K must divide N, and stage 0
    (which shards nothing) takes only N.

    Raises:
        ValueError: naming the bad K and the values that would do.
    """
    if shard_size is None:
        return world_size
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be an int >= 1 or None (N = {world_size}), got {shard_size!r}")
    if world_size % shard_size:
        raise ValueError(
            f"shard_size K = {shard_size} does not divide the world size N = {world_size}: the ranks must "
            f"form N/K equal shard groups; use one of {divisors(world_size)}"
        )
    if stage == 0 and shard_size != world_size:
        raise ValueError(
            f"stage 0 shards nothing, so it takes no shard_size below the world size: got K = {shard_size} "
            f"with N = {world_size}; use stage 1-3 for hybrid sharding, or shard_size=None"
        )
    return shard_size


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def memory_by_stage(psi: float, world_size: int, **options: float | bool | None) -> list[MemoryEstimate]:
    """:func:`model_state_memory` for stages 0-3; ``options`` are its keyword arguments."""
    return [model_state_memory(psi, world_size, stage, **options) for stage in STAGES]


def stages_that_fit(
    psi: float, world_size: int, device_memory: float, **options: float | bool | None
) -> tuple[int, ...]:
    """Stages whose model states fit in ``device_memory`` bytes per rank (activations not counted).

    Args:
        psi: Ψ, trainable parameters.
        world_size: N, data-parallel ranks.
        device_memory: bytes available per rank.
        options: keyword arguments of :func:`model_state_memory`.
    """
    if device_memory <= 0:
        raise ValueError(f"device_memory must be > 0 bytes, got {device_memory}")
    return tuple(m.stage for m in memory_by_stage(psi, world_size, **options) if m.total <= device_memory)


def max_params(device_memory: float, world_size: int, stage: int, **options: float | bool | None) -> float:
    """Largest Ψ whose model states fit in ``device_memory`` bytes per rank at ``stage``.

    Args:
        device_memory: bytes available per rank.
        world_size: N, data-parallel ranks.
        stage: 0 (plain DP) to 3.
        options: keyword arguments of :func:`model_state_memory`.
    """
    per_param = model_state_memory(1.0, world_size, stage, **options).total
    return device_memory / per_param


def _check(psi: float, world_size: int, stage: int, k: float) -> None:
    if psi <= 0:
        raise ValueError(f"psi (trainable parameters) must be > 0, got {psi}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if k < 0:
        raise ValueError(f"k (optimizer bytes per parameter) must be >= 0, got {k}")
