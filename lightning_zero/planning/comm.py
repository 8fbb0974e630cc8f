"""Communication per training step: volumes, times, the C/W threshold and the bucket model.

Pure arithmetic, no process group. Byte counts are what one rank sends under the ring algorithm,
the same convention as :func:`lightning_zero.comm.wire_bytes`, so theory and the ledger compare.

[Note: ring factors]
On N ranks a ring AllReduce of V bytes sends 2(N-1)/N x V bytes per rank; a ReduceScatter or an
AllGather of the full V bytes sends (N-1)/N x V. ``world_size=None`` means the large-N limit
(factor 1), the form in which the figures 2Ψ (DP, ZeRO-1/2) and 3Ψ (ZeRO-3) are usually quoted.

[Note: bus bandwidth]
``bandwidth`` W is the per-rank, one-direction bandwidth that pairs with the exact ring bytes: an
AllReduce of V bytes takes 2(N-1)/N x V / W. Inside one node that is the NVLink (or ICI axis)
figure. Across nodes an AllReduce runs in two segments, a ring over the g GPUs of a node and a ring
over the n nodes through the node's network egress, and takes as long as the slower one;
:func:`bus_bandwidth` folds both into one W.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

MIB = 2**20  # bytes; bucket caps are in MiB, as torch DDP's bucket_cap_mb
DEFAULT_ALPHA = 16e-6  # s; a small-message AllReduce on one 8xH100 node (nccl-tests)
DEFAULT_CAPS_MB = tuple(sorted({2.0**i for i in range(-4, 13)} | {25.0}))  # bucket sweep grid, MiB


# --------------------------------------------------------------------------- volumes and times


def gather_factor(world_size: int | None) -> float:
    """(N-1)/N: bytes per rank of a ReduceScatter or AllGather, per byte of the full tensor."""
    if world_size is None:
        return 1.0
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 or None (large-N limit), got {world_size!r}")
    return (world_size - 1) / world_size


def all_reduce_factor(world_size: int | None) -> float:
    """2(N-1)/N: bytes per rank of a ring AllReduce, per byte of the tensor."""
    return 2.0 * gather_factor(world_size)


def all_reduce_time(nbytes: float, world_size: int | None, bandwidth: float, *, alpha: float = 0.0) -> float:
    """Seconds for one ring AllReduce of ``nbytes``: alpha + 2(N-1)/N x nbytes / W.

    Args:
        nbytes: size of the tensor, bytes.
        world_size: N ranks (None: large-N limit).
        bandwidth: W, bytes/s per rank (see [Note: bus bandwidth]).
        alpha: fixed cost of one collective, s.
    """
    _positive("bandwidth", bandwidth)
    return alpha + all_reduce_factor(world_size) * nbytes / bandwidth


class Traffic(NamedTuple):
    stage: int  # 0 = plain DP, 1-3 = ZeRO stage
    world_size: int | None  # N; None = large-N limit
    all_reduce: float  # bytes sent per rank per step by AllReduce
    reduce_scatter: float  # bytes sent per rank per step by ReduceScatter
    all_gather: float  # bytes sent per rank per step by AllGather
    total: float  # sum of the three
    collectives: int  # collective calls per step (buckets for stages 0-2, units for stage 3)


def int8_wire_bytes(block: int = 256) -> float:
    """Bytes per element that stage 3's int8 collectives send (``quantize_weights``,
    ``quantize_grads``): one int8 value, plus one fp32 scale per ``block`` elements (the per-chunk
    figure of the accuracy guard, 4 bytes per rank and collective, is left out)."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    return 1 + 4 / block


def step_traffic(
    psi: float,
    world_size: int | None,
    stage: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    groups: int | None = None,
) -> Traffic:
    """Bytes one rank sends per optimizer step at one stage (see [Note: ring factors]).

    Stage 0 AllReduces the gradients (2Ψ); stages 1-2 ReduceScatter the gradients and AllGather the
    updated parameters (Ψ + Ψ); stage 3 AllGathers the parameters in forward and again in
    backward, and ReduceScatters the gradients (3Ψ).

    Args:
        psi: Ψ, trainable parameters.
        world_size: N ranks (None: large-N limit).
        stage: 0 (plain DP) to 3.
        param_bytes: bytes per parameter element that is gathered.
        grad_bytes: bytes per gradient element that is reduced.
        groups: flat buckets (stages 0-2) or wrap units L (stage 3). Stage 3 keeps the last unit
            gathered from forward into backward: 2L-1 AllGathers, counted as (2L-1)/L x Ψ for
            equal units. None: one call per collective type (1, 2 or 3 calls) and, for stage 3,
            the usual 2Ψ AllGather volume (every unit gathered twice).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be one of (0, 1, 2, 3), got {stage!r}")
    if groups is not None and groups < 1:
        raise ValueError(f"groups (buckets or wrap units) must be >= 1 or None, got {groups}")
    f = gather_factor(world_size)
    if stage == 0:
        all_reduce = 2 * f * psi * grad_bytes
        return Traffic(0, world_size, all_reduce, 0.0, 0.0, all_reduce, groups or 1)
    reduce_scatter = f * psi * grad_bytes
    all_gather = _params_gathered(stage, groups) * f * psi * param_bytes
    calls = _collective_calls(stage, groups)
    return Traffic(stage, world_size, 0.0, reduce_scatter, all_gather, reduce_scatter + all_gather, calls)


def _params_gathered(stage: int, groups: int | None) -> float:
    """Times the parameters are AllGathered per step (stages 1-3)."""
    if stage < 3:
        return 1.0  # the updated parameters, once after the optimizer step
    return 2.0 if groups is None else (2 * groups - 1) / groups  # forward + backward but the last unit


def _collective_calls(stage: int, groups: int | None) -> int:
    """ReduceScatter and AllGather calls per step (stages 1-3)."""
    if groups is None:
        return 2 if stage < 3 else 3
    return 2 * groups if stage < 3 else 3 * groups - 1


def traffic_time(traffic: Traffic, bandwidth: float, *, alpha: float = 0.0) -> float:
    """Seconds of communication for one step's traffic: total / W + alpha x collectives.

    This is the time the collectives occupy the network, not the exposed part: overlap with
    compute is what :func:`simulate_buckets` models.
    """
    _positive("bandwidth", bandwidth)
    return traffic.total / bandwidth + alpha * traffic.collectives


# --------------------------------------------------------------------------- hardware and C/W


class Hardware(NamedTuple):
    name: str  # preset name
    flops: float  # C: dense bf16 FLOP/s per chip
    link_bw: float  # bytes/s per chip, one direction, inside a node (NVLink) or over the DP ICI axes
    node_bw: float | None  # bytes/s per node, one direction, across nodes; None: one node/domain
    gpus_per_node: int  # chips that share one node's node_bw
    memory: float  # device memory, bytes
    source: str  # where the figures come from


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("h100", 9.9e14, 450e9, None, 8, 80e9, "NVLink 450 GB/s per GPU: C/W = 2200 in a node"),
        Hardware(
            "h100-cluster", 9.9e14, 450e9, 400e9, 8, 80e9, "8 x 400 Gbps = 400 GB/s per node: C/W = 2475"
        ),
        Hardware("h800", 9.9e14, 200e9, None, 8, 80e9, "NVLink 200 GB/s per GPU, one direction"),
        Hardware(
            "h800-cluster",
            9.9e14,
            200e9,
            400e9,
            8,
            80e9,
            "NVLink segment 200 GB/s x 8/7 = 229 GB/s: about 4300",
        ),
        Hardware(
            "a100", 3.12e14, 300e9, None, 8, 80e9, "datasheet: 312 TFLOP/s bf16; NVLink 600 GB/s both ways"
        ),
        Hardware(
            "a100-cluster", 3.12e14, 300e9, 200e9, 8, 80e9, "datasheet: 8 x 200 Gbps HDR = 200 GB/s per node"
        ),
        Hardware(
            "tpu-v5p", 4.59e14, 1.8e11, None, 1, 96e9, "459 TFLOP/s bf16; DP over one ICI axis: C/W = 2550"
        ),
        Hardware("tpu-v5p-3d", 4.59e14, 5.4e11, None, 1, 96e9, "DP over all three ICI axes: 2550 / 3 = 850"),
    )
}


def get_hardware(name: str) -> Hardware:
    """The preset called ``name`` (case-insensitive); see :data:`HARDWARE`."""
    key = name.lower()
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware preset {name!r}; expected one of {sorted(HARDWARE)}")
    return HARDWARE[key]


def bus_bandwidth(hardware: Hardware, *, world_size: int | None = None) -> float:
    """W for ring formulas on ``hardware`` with N ranks (see [Note: bus bandwidth]).

    Within one node (or a preset without ``node_bw``) W is the link bandwidth. Across n nodes of
    g GPUs the AllReduce takes 2V x max((g-1)/g / link_bw, (n-1)/n / node_bw), and W is chosen so
    that 2(N-1)/N x V / W equals it. ``world_size=None`` means many nodes: for the H800 the NVLink
    segment is then the bottleneck, W = 200 GB/s x 8/7 = 229 GB/s.
    """
    hw = hardware
    if hw.node_bw is None or (world_size is not None and world_size <= hw.gpus_per_node):
        return hw.link_bw
    nodes = None if world_size is None else math.ceil(world_size / hw.gpus_per_node)
    seconds_per_byte = max(gather_factor(hw.gpus_per_node) / hw.link_bw, gather_factor(nodes) / hw.node_bw)
    return gather_factor(world_size) / seconds_per_byte


class Threshold(NamedTuple):
    tokens_per_rank: float  # compute-bound when each rank processes more tokens per step
    flops: float  # C, FLOP/s per rank
    bandwidth: float  # W, bytes/s per rank
    ring_factor: float  # (N-1)/N, 1 in the large-N limit
    moe_factor: float  # E/k, 1 for a dense model


def comm_threshold(
    flops: float,
    bandwidth: float,
    *,
    world_size: int | None = None,
    experts: int = 1,
    top_k: int = 1,
) -> Threshold:
    """Tokens per rank above which the gradient AllReduce hides behind backward: C/W x (N-1)/N x E/k.

    Backward costs 4 x tokens x Ψ FLOPs per rank and the AllReduce 2 x 2Ψ x (N-1)/N bytes, so
    the model size cancels. An MoE layer computes with k of its E experts but synchronises the
    gradients of all E, which multiplies the threshold by E/k.

    Args:
        flops: C, FLOP/s per rank.
        bandwidth: W, bytes/s per rank.
        world_size: N, for the small-N correction (N-1)/N; None: large-N limit.
        experts: E, experts per MoE layer (1 for dense).
        top_k: k, experts each token is routed to.
    """
    _positive("flops", flops)
    _positive("bandwidth", bandwidth)
    if not 1 <= top_k <= experts:
        raise ValueError(f"need 1 <= top_k <= experts, got top_k={top_k}, experts={experts}")
    ring, moe = gather_factor(world_size), experts / top_k
    return Threshold(flops / bandwidth * ring * moe, flops, bandwidth, ring, moe)


def hardware_threshold(
    hardware: Hardware | str,
    *,
    world_size: int | None = None,
    experts: int = 1,
    top_k: int = 1,
) -> Threshold:
    """:func:`comm_threshold` for a preset: H100 across nodes about 2475, H800 about 4300."""
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    bw = bus_bandwidth(hw, world_size=world_size)
    return comm_threshold(hw.flops, bw, world_size=world_size, experts=experts, top_k=top_k)


def min_global_batch_tokens(threshold: Threshold, world_size: int) -> float:
    """Smallest global batch (tokens) that keeps ``world_size`` ranks compute-bound."""
    return threshold.tokens_per_rank * world_size


def max_dp_ranks(global_batch_tokens: float, threshold: Threshold) -> int:
    """Most data-parallel ranks a global batch of ``global_batch_tokens`` keeps compute-bound."""
    return math.floor(global_batch_tokens / threshold.tokens_per_rank)


# --------------------------------------------------------------------------- bucket model


class BucketTiming(NamedTuple):
    layers: tuple[int, int]  # [first, last) positions in backward order
    nbytes: float  # gradient bytes in the bucket
    ready: float  # s after backward starts: the bucket's last gradient is ready
    start: float  # s: the AllReduce starts (bucket full and the previous one done)
    end: float  # s: the AllReduce is done


class BucketSchedule(NamedTuple):
    bucket_cap_mb: float  # cap of the buckets after the first, MiB
    first_bucket_cap_mb: float  # cap of the first bucket, MiB
    buckets: tuple[BucketTiming, ...]  # in launch order
    backward: float  # s, total backward compute
    comm: float  # s, sum of the AllReduce times (latency included)
    exposed: float  # s, from the end of backward until the last AllReduce is done


class BucketRecommendation(NamedTuple):
    bucket_cap_mb: float  # the cap with the least exposed communication
    exposed: float  # s, its exposed communication
    sweep: tuple[BucketSchedule, ...]  # every cap tried, in grid order


def assign_buckets(
    layer_bytes: Sequence[float], *, cap_bytes: float, first_cap_bytes: float
) -> list[tuple[int, int]]:
    """Group layers (in backward order) into buckets as torch DDP does.

    A bucket closes as soon as it holds at least its cap; the first bucket's cap is
    ``first_cap_bytes``. A layer is never split. Returns [first, last) position pairs.
    """
    spans, start, size = [], 0, 0.0
    for i, nbytes in enumerate(layer_bytes):
        size += nbytes
        if size >= (first_cap_bytes if not spans else cap_bytes):
            spans.append((start, i + 1))
            start, size = i + 1, 0.0
    if start < len(layer_bytes):
        spans.append((start, len(layer_bytes)))
    return spans


def simulate_buckets(
    layer_sizes: Sequence[int],
    backward_times: Sequence[float],
    *,
    bucket_cap_mb: float,
    world_size: int,
    bandwidth: float,
    alpha: float = DEFAULT_ALPHA,
    grad_bytes: float = 2,
    first_bucket_cap_mb: float | None = 1.0,
) -> BucketSchedule:
    """Alpha-beta timeline of bucketed gradient AllReduce overlapped with backward.

    Layer i's gradients are ready when its backward ends (times accumulate in backward order).
    A bucket's AllReduce starts when its last gradient is ready and the previous bucket's AllReduce
    is done (one communication channel) and lasts alpha + 2(N-1)/N x bytes / W.

    Args:
        layer_sizes: parameters per layer, in backward order (last layer first).
        backward_times: backward compute time per layer, s, same order.
        bucket_cap_mb: bucket cap, MiB.
        world_size: N ranks.
        bandwidth: W, bytes/s per rank.
        alpha: fixed cost of one AllReduce, s.
        grad_bytes: bytes per gradient element.
        first_bucket_cap_mb: cap of the first bucket, MiB; None: the same as ``bucket_cap_mb``.
    """
    first_cap = bucket_cap_mb if first_bucket_cap_mb is None else first_bucket_cap_mb
    _check_layers(layer_sizes, backward_times, bucket_cap_mb, first_cap)
    layer_bytes = [n * grad_bytes for n in layer_sizes]
    ready_at = _cumulative(backward_times)
    spans = assign_buckets(layer_bytes, cap_bytes=bucket_cap_mb * MIB, first_cap_bytes=first_cap * MIB)
    buckets, free_at = [], 0.0
    for first, last in spans:
        nbytes = sum(layer_bytes[first:last])
        start = max(ready_at[last - 1], free_at)
        free_at = start + all_reduce_time(nbytes, world_size, bandwidth, alpha=alpha)
        buckets.append(BucketTiming((first, last), nbytes, ready_at[last - 1], start, free_at))
    backward = ready_at[-1]
    comm = sum(b.end - b.start for b in buckets)
    return BucketSchedule(
        bucket_cap_mb, first_cap, tuple(buckets), backward, comm, max(0.0, free_at - backward)
    )


def sweep_bucket_caps(
    layer_sizes: Sequence[int],
    backward_times: Sequence[float],
    *,
    world_size: int,
    bandwidth: float,
    alpha: float = DEFAULT_ALPHA,
    grad_bytes: float = 2,
    first_bucket_cap_mb: float | None = 1.0,
    caps_mb: Sequence[float] = DEFAULT_CAPS_MB,
) -> tuple[BucketSchedule, ...]:
    """:func:`simulate_buckets` for every cap in ``caps_mb`` (MiB), in that order."""
    return tuple(
        simulate_buckets(
            layer_sizes,
            backward_times,
            bucket_cap_mb=cap,
            world_size=world_size,
            bandwidth=bandwidth,
            alpha=alpha,
            grad_bytes=grad_bytes,
            first_bucket_cap_mb=first_bucket_cap_mb,
        )
        for cap in caps_mb
    )


def recommend_bucket_cap_mb(
    layer_sizes: Sequence[int],
    backward_times: Sequence[float],
    *,
    caps_mb: Sequence[float] = DEFAULT_CAPS_MB,
    **options: Any,
) -> BucketRecommendation:
    """The cap in ``caps_mb`` with the least exposed communication; ``options`` (``world_size``,
    ``bandwidth``, ``alpha``, ...) as for :func:`sweep_bucket_caps`.

    Caps within a relative 1e-9 of the minimum tie; the tie goes to the fewest buckets (the
    largest cap), which is the least sensitive to an underestimated alpha.
    """
    if not caps_mb:
        raise ValueError("caps_mb must name at least one bucket cap")
    sweep = sweep_bucket_caps(layer_sizes, backward_times, caps_mb=caps_mb, **options)
    best = min(s.exposed for s in sweep)
    tolerance = 1e-9 * (sweep[0].backward + sweep[0].comm)
    tied = [s for s in sweep if s.exposed <= best + tolerance]
    pick = min(tied, key=lambda s: (len(s.buckets), -s.bucket_cap_mb))
    return BucketRecommendation(pick.bucket_cap_mb, pick.exposed, sweep)


def backward_times_from_flops(
    layer_sizes: Sequence[int], *, tokens_per_rank: float, flops: float
) -> tuple[float, ...]:
    """Backward time per layer at peak: 4 x tokens x params / C (two matmuls per weight, 2 FLOPs each).

    Args:
        layer_sizes: parameters per layer.
        tokens_per_rank: tokens one rank processes in the micro-batch.
        flops: C, FLOP/s per rank (scale it by the expected MFU for a realistic figure).
    """
    _positive("tokens_per_rank", tokens_per_rank)
    _positive("flops", flops)
    return tuple(4.0 * tokens_per_rank * n / flops for n in layer_sizes)


def uniform_layers(psi: float, layers: int) -> tuple[int, ...]:
    """Ψ split into ``layers`` near-equal integer layers (a stand-in when no model is given)."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    base, extra = divmod(round(psi), layers)
    return tuple(base + (1 if i < extra else 0) for i in range(layers))


def _cumulative(values: Sequence[float]) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total)
    return out


def _check_layers(
    layer_sizes: Sequence[int], backward_times: Sequence[float], cap_mb: float, first_cap_mb: float
) -> None:
    if not layer_sizes:
        raise ValueError("layer_sizes is empty: the model has no trainable parameters")
    if len(layer_sizes) != len(backward_times):
        raise ValueError(
            f"layer_sizes and backward_times must have the same length, got {len(layer_sizes)} and {len(backward_times)}"
        )
    if cap_mb <= 0 or first_cap_mb <= 0:
        raise ValueError(
            f"bucket caps must be > 0 MiB, got bucket_cap_mb={cap_mb}, first_bucket_cap_mb={first_cap_mb}"
        )
    if min(backward_times) < 0:
        raise ValueError(f"backward_times must be >= 0 s, got {min(backward_times)}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
