"""Hybrid sharding (HSDP): the layout of shard and replicate groups, traffic split into intra- and
inter-node bytes, the alpha-beta step time, and the choice of ``shard_size="auto"``.

Pure arithmetic, no process group. Byte counts follow the ring model of
:func:`lightning_zero.comm.wire_bytes` (see [Note: ring factors] in ``comm.py``), so that the
engine's ledger, filing each collective as intra- or inter-node, compares to these figures exactly.

[Note: hybrid layout]
N ranks form R = N/K shard groups of K consecutive ranks: rank r sits in shard group r // K, at
position r % K. Each shard group shards the model states as stages 1-3 do; the R ranks at the same
position form a replicate group {i, i+K, ..., i+(R-1)K}. Nodes hold G consecutive ranks (a job of
N <= G ranks is one node of N). A group is inter-node when its ranks sit on more than one node:

- a shard group stays in one node iff K <= G and G % K == 0;
- a replicate group (R > 1) spans nodes whenever there is more than one node.

K must divide N, and divide G or be a multiple of it: otherwise some shard groups straddle a node
boundary and others do not. K = N is full sharding, the stages as they are; on more than one node
every one of its collectives is inter-node. K = 1 replicates everything (plain DP over N).

[Note: hybrid step]
Per bucket (stages 1-2) or wrap unit (stage 3) of V gradient bytes, one rank sends:

- ReduceScatter of the gradients over the shard group: (K-1)/K x V;
- AllReduce of the reduced shard, V/K bytes, over the replicate group: 2(R-1)/R x V/K;
- AllGather of the parameters over the shard group, (K-1)/K of their bytes per gather: once after
  the optimizer step at stages 1-2, 2L-1 times for L units at stage 3.

Stage 0 AllReduces the gradients over all N ranks. A collective over a group of one rank is not
issued: no bytes, no latency, no call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

# step_traffic's own counts of calls and gathers: K = N agrees with it by construction
from lightning_zero.planning.comm import _collective_calls, _params_gathered, gather_factor
from lightning_zero.planning.memory import STAGES, check_shard_size, divisors, model_state_memory

AUTO = "auto"  # shard_size value that asks choose_shard_size
NODE = "node"  # shard_size value for one shard group per node: K = G
TIE_TOLERANCE = 1e-9  # relative: predicted times this close are a tie


# --------------------------------------------------------------------------- layout


class HybridLayout(NamedTuple):
    world_size: int  # N, data-parallel ranks
    shard_size: int  # K, ranks per shard group
    replicas: int  # R = N / K, shard groups (the ranks of one replicate group)
    ranks_per_node: int  # G, consecutive ranks per node (N when the job fits one node)
    nodes: int  # N / G
    shard_spans_nodes: bool  # a shard group has ranks on more than one node
    replicate_spans_nodes: bool  # a replicate group has ranks on more than one node


def hybrid_layout(
    world_size: int, ranks_per_node: int, *, shard_size: int | None = None, stage: int | None = None
) -> HybridLayout:
    """The groups of hybrid sharding with K = ``shard_size`` (None: N), see [Note: hybrid layout].

    Raises:
        ValueError: N not a multiple of G, K not dividing N, shard groups spanning nodes unevenly,
            or K < N at stage 0; the message names the values that would do.
    """
    n, g = world_size, _ranks_per_node(world_size, ranks_per_node)
    k = check_shard_size(n, shard_size, stage)
    if g % k and k % g:
        raise ValueError(
            f"shard groups of K = {k} ranks would span nodes of G = {g} ranks unevenly (some groups "
            f"inside a node, some across two): K must divide G or be a multiple of it; use one of "
            f"{list(valid_shard_sizes(n, g))}"
        )
    replicas, nodes = n // k, n // g
    return HybridLayout(n, k, replicas, g, nodes, k > g, replicas > 1 and nodes > 1)


def valid_shard_sizes(world_size: int, ranks_per_node: int) -> tuple[int, ...]:
    """Every K that divides N and divides G or is a multiple of it, ascending (N included)."""
    g = _ranks_per_node(world_size, ranks_per_node)
    return tuple(k for k in divisors(world_size) if g % k == 0 or k % g == 0)


def _ranks_per_node(world_size: int, ranks_per_node: int) -> int:
    """G, checked; a job of N <= G ranks is one node of N ranks."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be an int >= 1, got {ranks_per_node!r}")
    if world_size > ranks_per_node and world_size % ranks_per_node:
        raise ValueError(
            f"the world size N = {world_size} is not a multiple of the ranks per node G = {ranks_per_node}: "
            "every node must hold the same number of ranks"
        )
    return min(ranks_per_node, world_size)


# --------------------------------------------------------------------------- traffic


class GroupTraffic(NamedTuple):
    op: str  # all_reduce | reduce_scatter | all_gather, as the ledger names them
    group: str  # "shard" (K ranks), "replicate" (R ranks) or "world" (N ranks, stage 0)
    group_size: int  # ranks in the group: the ledger's group_size
    spans_nodes: bool  # the group has ranks on more than one node: inter-node
    calls: int  # collectives of this kind per step
    payload: float  # bytes of the logical tensors per step: the ledger's payload_bytes
    wire: float  # bytes one rank sends per step: the ledger's wire_bytes


class HybridTraffic(NamedTuple):
    stage: int  # 0 = plain DP, 1-3 = ZeRO stage
    layout: HybridLayout  # N, K, R, G and which groups span nodes
    collectives: tuple[GroupTraffic, ...]  # one entry per kind of collective issued in a step
    intra: float  # bytes one rank sends per step on groups inside one node
    inter: float  # bytes one rank sends per step on groups that span nodes
    intra_calls: int  # collectives per step on groups inside one node
    inter_calls: int  # collectives per step on groups that span nodes

    @property
    def total(self) -> float:
        """Bytes one rank sends per step, intra- and inter-node."""
        return self.intra + self.inter

    def wire(self, op: str) -> float:
        """Bytes one rank sends per step with ``op`` (the ledger's per-op wire bytes)."""
        return sum(c.wire for c in self.collectives if c.op == op)


def hybrid_traffic(
    psi: float,
    world_size: int,
    stage: int,
    *,
    ranks_per_node: int,
    shard_size: int | None = None,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    groups: int | None = None,
    secondary_shard_size: int | None = None,
    secondary_bytes: float | None = None,
) -> HybridTraffic:
    """Bytes and collectives one rank issues per step with shard size K (see [Note: hybrid step]).

    With K = N (``shard_size=None``) the per-op bytes are :func:`~lightning_zero.planning.step_traffic`'s.

    Args:
        psi: Ψ, trainable parameters.
        world_size: N ranks.
        stage: 0 (plain DP) to 3.
        ranks_per_node: G, consecutive ranks per node.
        shard_size: K, ranks per shard group; None: N (full sharding).
        param_bytes: bytes per parameter element that is gathered.
        grad_bytes: bytes per gradient element that is reduced.
        groups: flat buckets (stages 0-2) or wrap units L (stage 3); None: one call per
            collective type and, at stage 3, two AllGathers of every parameter (as step_traffic).
        secondary_shard_size: stage 3's secondary shards (hpZ) over groups of s consecutive ranks:
            the backward AllGathers (L-1 units: the root's gather serves both) run in the group of
            s, in ``secondary_bytes`` per element (default ``param_bytes``: what forward computed
            with, in the compute dtype, where ``param_bytes`` may be int8's); None: off.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if groups is not None and groups < 1:
        raise ValueError(f"groups (buckets or wrap units) must be >= 1 or None, got {groups}")
    layout = hybrid_layout(world_size, ranks_per_node, shard_size=shard_size, stage=stage)
    kinds = _stage_collectives(psi, stage, layout, param_bytes, grad_bytes, groups)
    if secondary_shard_size is not None and stage == 3:
        kinds = _secondary_gathers(
            kinds, psi, layout, secondary_shard_size, groups, secondary_bytes or param_bytes
        )
    issued = tuple(c for c in kinds if c.group_size > 1)
    inter = [c for c in issued if c.spans_nodes]
    intra = [c for c in issued if not c.spans_nodes]
    return HybridTraffic(
        stage,
        layout,
        issued,
        sum(c.wire for c in intra),
        sum(c.wire for c in inter),
        sum(c.calls for c in intra),
        sum(c.calls for c in inter),
    )


def _stage_collectives(
    psi: float, stage: int, layout: HybridLayout, p: float, g: float, groups: int | None
) -> list[GroupTraffic]:
    """Every kind of collective of one step, groups of one rank included."""
    n, k, r = layout.world_size, layout.shard_size, layout.replicas
    world_spans = layout.nodes > 1
    if stage == 0:
        return [_group("all_reduce", "world", n, world_spans, groups or 1, g * psi)]
    calls = _collective_calls(stage, groups)  # ReduceScatters + AllGathers
    units = groups or 1
    gathers = calls - units  # 1 per bucket at stages 1-2; 2L-1 (2 without groups) at stage 3
    return [
        _group("reduce_scatter", "shard", k, layout.shard_spans_nodes, units, g * psi),
        _group("all_reduce", "replicate", r, layout.replicate_spans_nodes, units, g * psi / k),
        _group(
            "all_gather",
            "shard",
            k,
            layout.shard_spans_nodes,
            gathers,
            _params_gathered(stage, groups) * p * psi,
        ),
    ]


def _secondary_gathers(
    kinds: list[GroupTraffic], psi: float, layout: HybridLayout, s: int, groups: int | None, b: float
) -> list[GroupTraffic]:
    """Stage 3 with secondary shards: the forward AllGathers stay in the shard group, the backward
    ones move to the secondary group of s ranks (one node when s divides G)."""
    if layout.shard_size % s or s < 1:
        raise ValueError(f"secondary_shard_size={s} must divide the shard group of {layout.shard_size} ranks")
    forward, g = groups or 1, layout.ranks_per_node
    gathers = [c for c in kinds if c.op == "all_gather"][0]
    backward = gathers.calls - forward
    spans = s > g
    return [c for c in kinds if c.op != "all_gather"] + [
        _group(
            "all_gather",
            "shard",
            gathers.group_size,
            gathers.spans_nodes,
            forward,
            gathers.payload / (_params_gathered(3, groups)),
        ),
        _group("all_gather", "secondary", s, spans, backward, b * psi * (_params_gathered(3, groups) - 1)),
    ]


def secondary_shard_memory(psi: float, secondary_shard_size: int, param_bytes: float = 2) -> float:
    """Bytes per rank that stage 3's secondary shards hold at the end of forward (every unit's
    copy, 1/s of its gathered parameters; see [Note: secondary shards] in zero/unit.py)."""
    return psi * param_bytes / secondary_shard_size


def _group(op: str, group: str, size: int, spans: bool, calls: int, payload: float) -> GroupTraffic:
    factor = 2.0 if op == "all_reduce" else 1.0  # as the ledger's _WIRE_FACTOR
    return GroupTraffic(op, group, size, spans, calls, payload, factor * gather_factor(size) * payload)


# --------------------------------------------------------------------------- time


class Link(NamedTuple):
    alpha: float  # s, fixed cost of one collective on a group of this kind
    bandwidth: float  # bytes/s: ring wire bytes one rank sends per second on such a group


# bytes a backend sends for an op, as a multiple of the ring model's, at stages 1-2: gloo
# reduce-scatters a bucket into its own chunk by all-reducing it (measured: docs/benchmarks.md,
# "Hybrid sharding on a slowed link"); stage 3's units are exchanged at the ring's bytes
# ([Note: collectives in place] in comm/inplace.py)
BACKEND_WIRE_FACTORS: dict[str, dict[str, float]] = {"gloo": {"reduce_scatter": 2.0}}


def hybrid_comm_time(
    traffic: HybridTraffic, *, intra: Link, inter: Link, backend: str | None = None, int8_grads: bool = False
) -> float:
    """Seconds the step's collectives occupy the links, one after another (alpha-beta):

        intra_calls x alpha_intra + intra / W_intra + inter_calls x alpha_inter + inter / W_inter

    A collective is charged at the inter-node link whenever its group spans nodes, all of its
    bytes. Not the exposed time: overlap with compute is not modelled. ``backend``: the bytes it
    really sends where they differ from the ring model's (BACKEND_WIRE_FACTORS: gloo's
    reduce-scatter of a bucket at stages 1-2 sends an all-reduce's); None: the ring model.
    ``int8_grads``: the gradient reductions are ``quantize_grads``' all-to-alls, which every
    backend sends at the ring's bytes (``traffic`` sized with int8's ``grad_bytes``), as stage 3's
    exchanges of unit gradients do.
    """
    _check_link("intra", intra)
    _check_link("inter", inter)
    factors = BACKEND_WIRE_FACTORS.get(backend or "", {})
    if int8_grads or traffic.stage == 3:
        factors = {op: f for op, f in factors.items() if op != "reduce_scatter"}
    seconds = 0.0
    for c in traffic.collectives:
        link = inter if c.spans_nodes else intra
        seconds += c.calls * link.alpha + factors.get(c.op, 1.0) * c.wire / link.bandwidth
    return seconds


def _check_link(name: str, link: Link) -> None:
    if not link.bandwidth > 0:
        raise ValueError(f"the {name}-node link's bandwidth must be > 0 bytes/s, got {link.bandwidth}")
    if not link.alpha >= 0:
        raise ValueError(f"the {name}-node link's alpha must be >= 0 s, got {link.alpha}")


# --------------------------------------------------------------------------- the choice of K


class ShardOption(NamedTuple):
    shard_size: int  # K
    replicas: int  # R = N / K
    memory: float  # model-state bytes per rank
    intra: float  # bytes one rank sends per step inside a node
    inter: float  # bytes one rank sends per step across nodes
    seconds: float | None  # predicted communication per step, s (None: no links given)
    fits: bool | None  # memory <= the budget (None: no budget given)


class ShardChoice(NamedTuple):
    shard_size: int  # the K chosen
    fits: bool  # whether it fits the budget (False: nothing fits; the least memory was taken)
    options: tuple[ShardOption, ...]  # every valid K, ascending


def evaluate_shard_size(
    psi: float,
    world_size: int,
    stage: int,
    *,
    shard_size: int | None,
    ranks_per_node: int,
    intra: Link | None = None,
    inter: Link | None = None,
    memory_budget: float | None = None,
    groups: int | None = None,
    backend: str | None = None,
    int8_grads: bool = False,
    **memory_options: Any,
) -> ShardOption:
    """Memory per rank, bytes per link and predicted seconds for one K (None: N).

    ``memory_options`` are the keyword arguments of
    :func:`~lightning_zero.planning.model_state_memory` (``k``, ``param_bytes``, ``grad_bytes``,
    ...); ``param_bytes`` and ``grad_bytes`` size the traffic too. ``seconds`` needs both links.
    """
    bytes_per = {key: memory_options.get(key, 2) for key in ("param_bytes", "grad_bytes")}
    traffic = hybrid_traffic(
        psi,
        world_size,
        stage,
        ranks_per_node=ranks_per_node,
        shard_size=shard_size,
        groups=groups,
        **bytes_per,
    )
    k = traffic.layout.shard_size
    mem = model_state_memory(psi, world_size, stage, shard_size=k, **memory_options).total
    seconds = (
        None
        if intra is None or inter is None
        else hybrid_comm_time(traffic, intra=intra, inter=inter, backend=backend, int8_grads=int8_grads)
    )
    fits = None if memory_budget is None else mem <= memory_budget
    return ShardOption(k, traffic.layout.replicas, mem, traffic.intra, traffic.inter, seconds, fits)


def choose_shard_size(
    psi: float,
    world_size: int,
    stage: int,
    *,
    ranks_per_node: int,
    intra: Link,
    inter: Link,
    memory_budget: float | None,
    groups: int | None = None,
    backend: str | None = None,
    int8_grads: bool = False,
    **memory_options: Any,
) -> ShardChoice:
    """``shard_size="auto"``: the valid K with the least predicted communication whose model states
    fit ``memory_budget`` bytes per rank (None: no limit).

    Times within a relative 1e-9 of the fastest tie; the tie goes to the largest K (the least
    memory per rank). If no K fits, the choice is K = N, the least memory, with ``fits=False``.
    Arguments as for :func:`evaluate_shard_size`.

    Raises:
        ValueError: at stage 0, which shards nothing.
    """
    if stage == 0:
        raise ValueError("shard_size='auto' needs stage 1, 2 or 3: stage 0 shards nothing, its K is N")
    if memory_budget is not None and not memory_budget > 0:
        raise ValueError(f"memory_budget must be > 0 bytes per rank or None, got {memory_budget}")
    options = tuple(
        evaluate_shard_size(
            psi,
            world_size,
            stage,
            shard_size=k,
            ranks_per_node=ranks_per_node,
            intra=intra,
            inter=inter,
            memory_budget=memory_budget,
            groups=groups,
            backend=backend,
            int8_grads=int8_grads,
            **memory_options,
        )
        for k in valid_shard_sizes(world_size, ranks_per_node)
    )
    fitting = [o for o in options if o.fits is not False]
    if not fitting:
        return ShardChoice(world_size, False, options)
    fastest = min(o.seconds for o in fitting)
    tied = [o for o in fitting if o.seconds <= fastest * (1 + TIE_TOLERANCE)]
    return ShardChoice(max(o.shard_size for o in tied), True, options)


# --------------------------------------------------------------------------- the table

SHARD_TABLE_HEADERS = ("K", "R", "memory GB", "fits", "intra GB", "inter GB", "comm ms")


def shard_table_rows(options: Sequence[ShardOption]) -> list[tuple[str, ...]]:
    """One row of cells per option, under :data:`SHARD_TABLE_HEADERS` (bytes as GB = 1e9)."""
    return [
        (
            str(o.shard_size),
            str(o.replicas),
            f"{o.memory / 1e9:.4g}",
            "-" if o.fits is None else ("yes" if o.fits else "no"),
            f"{o.intra / 1e9:.4g}",
            f"{o.inter / 1e9:.4g}",
            "-" if o.seconds is None else f"{o.seconds * 1e3:.4g}",
        )
        for o in options
    ]


def format_shard_table(choice: ShardChoice) -> str:
    """The alternatives of :func:`choose_shard_size` as plain text, the choice marked: for logs."""
    rows = [SHARD_TABLE_HEADERS, *shard_table_rows(choice.options)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(SHARD_TABLE_HEADERS))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for i, option in enumerate(choice.options, start=1):
        if option.shard_size == choice.shard_size:
            lines[i] += "  <- chosen" if choice.fits else "  <- chosen (nothing fits: the least memory)"
    return "\n".join(lines)
