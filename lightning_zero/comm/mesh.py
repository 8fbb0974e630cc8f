"""Hybrid sharding: which ranks shard the model state together, and which replicate each other.

[Note: shard groups and replicate groups]
With ``shard_size`` K < N, the N ranks form R = N / K shard groups of K consecutive ranks
({0..K-1}, {K..2K-1}, ...). Each shard group holds one copy of the model state, sharded as stages
1-3 shard it over N ranks without this option; the R groups replicate each other. A rank's
replicate group is the R ranks at its position in every shard group ({i, i+K, i+2K, ...}).

Per bucket (stages 1-2) or unit (stage 3), gradients are reduce-scattered inside the shard group,
then the reduced shard (1/K of the bucket) is all-reduced across the replicate group; parameters
are all-gathered inside the shard group only. With K one node (the usual choice), every all-gather
and reduce-scatter stays on the node's links and only the all-reduce of Ψ/K per step crosses
nodes. Memory per rank follows the formulas with N replaced by K in the sharded terms.

Nodes are taken from the cluster environment (``num_nodes``; N / num_nodes ranks per node, in
consecutive blocks, as Lightning and SLURM number them), not from host names, so that a one-machine
run can stand in for several nodes. A shard group must not span nodes unevenly: K divides the
ranks per node G, or G divides K.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

NODE = "node"  # shard_size="node": one shard group per node
AUTO = "auto"  # shard_size="auto": chosen from the memory budget and the measured links
PROBE_BYTES = (4 * 1024, 4 * 2**20)  # all-reduce sizes timed per link: latency, then bandwidth
PROBE_REPEATS = 5  # timed all-reduces per size (the median counts), after one untimed


class Mesh(NamedTuple):
    """The shape of hybrid sharding on this rank.

    Attributes:
        world_size: N, every rank.
        shard_size: K, the ranks of one shard group.
        ranks_per_node: G, from the cluster environment.
        shard_group: this rank's shard group (None when K = N: the default group).
        replicate_group: this rank's replicate group (None when K = N: nothing to replicate).
    """

    world_size: int
    shard_size: int
    ranks_per_node: int
    shard_group: Any | None
    replicate_group: Any | None

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size

    @property
    def hybrid(self) -> bool:
        return self.shard_size < self.world_size


def resolve_shard_size(value: int | str | None, world_size: int, ranks_per_node: int, stage: int) -> int:
    """K for the option's ``value`` (None: N; ``"node"``: G), checked against the world and nodes.

    Raises:
        ValueError: K does not divide N, a shard group would span nodes unevenly, or the stage
            shards nothing (stage 0) while K < N.
    """
    if value is None:
        return world_size
    k = ranks_per_node if value == NODE else value
    if value == AUTO:
        raise ValueError("shard_size='auto' is resolved by sharding_comm, which measures the links")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"shard_size must be a positive number of ranks, 'node' or None, got {value!r}")
    if world_size % k:
        raise ValueError(
            f"shard_size={k} does not divide the world size {world_size}: the ranks form groups of "
            "shard_size consecutive ranks that replicate each other, so it must divide it"
        )
    if ranks_per_node % k and k % ranks_per_node:
        raise ValueError(
            f"shard_size={k} makes shard groups span nodes unevenly ({ranks_per_node} ranks per node): "
            "it must divide the ranks per node (groups inside a node) or be a multiple of it "
            "(groups of whole nodes)"
        )
    if k < world_size and stage == 0:
        raise ValueError(
            f"shard_size={k} with stage 0: stage 0 shards nothing, so there is nothing to shard inside "
            "a group; use stage 1, 2 or 3, or leave shard_size unset"
        )
    return k


def shard_ranks(rank: int, shard_size: int) -> list[int]:
    """The ranks of ``rank``'s shard group."""
    first = rank - rank % shard_size
    return list(range(first, first + shard_size))


def replicate_ranks(rank: int, shard_size: int, world_size: int) -> list[int]:
    """The ranks of ``rank``'s replicate group."""
    return list(range(rank % shard_size, world_size, shard_size))


def spans_nodes(ranks: list[int], ranks_per_node: int) -> bool:
    """Whether a group of ``ranks`` has members on more than one node."""
    return len({r // ranks_per_node for r in ranks}) > 1


def build_mesh(shard_size: int, world_size: int, ranks_per_node: int) -> Mesh:
    """Create the shard and replicate groups (collective: every rank calls it, in the same order)."""
    if shard_size >= world_size:
        return Mesh(world_size, world_size, ranks_per_node, None, None)
    shards = [shard_ranks(g * shard_size, shard_size) for g in range(world_size // shard_size)]
    replicas = [replicate_ranks(i, shard_size, world_size) for i in range(shard_size)]
    shard_group, _ = dist.new_subgroups_by_enumeration(shards, backend=dist.get_backend())
    replicate_group, _ = dist.new_subgroups_by_enumeration(replicas, backend=dist.get_backend())
    return Mesh(world_size, shard_size, ranks_per_node, shard_group, replicate_group)


_MESHES: dict[tuple[int, int, int], Mesh] = {}  # (K, N, G) -> its groups: one set per process


def sharding_comm(
    comm: Any,
    shard_size: int | str | None,
    stage: int,
    num_nodes: int,
    *,
    module: torch.nn.Module | None = None,
    device: torch.device | None = None,
    report: Callable[[str], None] | None = None,
    secondary_shard_size: int | str | None = None,
) -> Any:
    """The communicator the engine shards over: ``comm`` itself (full sharding), or with K < N its
    shard group's, carrying the replicate group's as ``replicate`` (see [Note: hybrid comms] in
    ``collectives.py``). Sets the links the ledger files each group's collectives under. Collective
    the first time a shape is asked for in a process (the groups are made once, then kept).
    ``shard_size="auto"`` measures the links and chooses K for ``module`` on ``device`` (see
    :func:`choose_automatically`); ``report`` prints the choice and its alternatives.
    ``secondary_shard_size``: the returned communicator carries the secondary group's as
    ``secondary`` (see [Note: secondary shards])."""
    group = _shard_group(comm, shard_size, stage, num_nodes, module, device, report)
    s = resolve_secondary_size(secondary_shard_size, group.world_size, comm.world_size // num_nodes)
    group.secondary = None if s is None else _secondary_group(comm, s, comm.world_size // num_nodes)
    return group


def _shard_group(comm, shard_size, stage, num_nodes, module, device, report) -> Any:  # noqa: ANN001
    n = comm.world_size
    if num_nodes < 1 or n % num_nodes:
        raise ValueError(f"{n} ranks cannot be spread evenly over {num_nodes} nodes")
    g = n // num_nodes
    comm.link = "inter" if spans_nodes(list(range(n)), g) else "intra"
    if shard_size == AUTO:
        if module is None or device is None:
            raise ValueError("shard_size='auto' needs the module and its device to choose")
        shard_size = choose_automatically(comm, stage, g, module, device, report) if comm.active else None
    k = resolve_shard_size(shard_size, n, g, stage)
    if k >= n or not comm.active:
        return comm
    mesh = _MESHES.get((k, n, g))
    if mesh is None:
        mesh = _MESHES[(k, n, g)] = build_mesh(k, n, g)
    me = comm.me
    shard = comm.subgroup(mesh.shard_group, link="inter" if spans_nodes(shard_ranks(me, k), g) else "intra")
    shard.mean_over = n
    replicas = replicate_ranks(me, k, n)
    shard.replicate = comm.subgroup(
        mesh.replicate_group, link="inter" if spans_nodes(replicas, g) else "intra"
    )
    return shard


# -- secondary shards (hpZ) -----------------------------------------------------------------------


def resolve_secondary_size(value: int | str | None, shard_size: int, ranks_per_node: int) -> int | None:
    """The secondary group's size for the option's ``value`` (``"node"``: G), or None where it
    changes nothing (off, or one group as large as the shard group).

    Raises:
        ValueError: it does not divide the shard group, or its groups would span nodes unevenly.
    """
    if value is None:
        return None
    s = ranks_per_node if value == NODE else value
    if shard_size % s:
        raise ValueError(
            f"secondary_shard_size={value!r} ({s} ranks) does not divide the shard group of {shard_size} ranks: "
            "each secondary group holds the unit once, sharded over its ranks, so it must divide it"
        )
    if ranks_per_node % s and s % ranks_per_node:
        raise ValueError(
            f"secondary_shard_size={s} makes the secondary groups span nodes unevenly ({ranks_per_node} ranks "
            "per node): it must divide the ranks per node, or be a multiple of it"
        )
    return s if s < shard_size else None


_SECONDARY: dict[tuple[int, int], Any] = {}  # (size, N) -> this process's secondary group


def _secondary_group(comm: Any, size: int, ranks_per_node: int) -> Any:
    """The communicator of this rank's secondary group: ``size`` consecutive ranks, inside its
    shard group (collective the first time a size is asked for in a process)."""
    n = comm.world_size
    group = _SECONDARY.get((size, n))
    if group is None:
        groups = [shard_ranks(first, size) for first in range(0, n, size)]
        group, _ = dist.new_subgroups_by_enumeration(groups, backend=dist.get_backend())
        _SECONDARY[(size, n)] = group
    ranks = shard_ranks(comm.me, size)
    return comm.subgroup(group, link="inter" if spans_nodes(ranks, ranks_per_node) else "intra")


# -- shard_size="auto" -----------------------------------------------------------------------------

_NODE_GROUPS: dict[tuple[int, int], tuple[Any, Any]] = {}  # (G, N) -> (this node's group, across nodes)


def choose_automatically(
    comm: Any,
    stage: int,
    ranks_per_node: int,
    module: torch.nn.Module,
    device: torch.device,
    report: Callable[[str], None] | None = None,
) -> int:
    """K for ``shard_size="auto"``: the planner's choice (``planning.hybrid.choose_shard_size``) for
    this model's trainable parameters, the memory of one rank's device, and the two links measured
    now: a few timed all-reduces inside this node and across the nodes (rank 0's figures, so that
    every rank chooses the same K). Collective."""
    from lightning_zero.planning.hybrid import Link, choose_shard_size, format_shard_table

    n, g = comm.world_size, ranks_per_node
    psi = sum(p.numel() for p in module.parameters() if p.requires_grad)
    element = max((p.element_size() for p in module.parameters() if p.requires_grad), default=4)
    within, across = _node_groups(g, n)
    fastest = Link(alpha=1e-9, bandwidth=1e15)  # a link no group of the plan crosses
    intra = measure_link(comm.subgroup(within, link="intra"), device, "intra") if g > 1 else fastest
    inter = measure_link(comm.subgroup(across, link="inter"), device, "inter") if n > g else fastest
    intra, inter = comm.broadcast_object((intra, inter), name="mesh/links", device=device, control=True)
    budget = _device_memory(device) / (g if device.type == "cpu" else 1)
    choice = choose_shard_size(
        psi,
        n,
        stage,
        ranks_per_node=g,
        intra=intra,
        inter=inter,
        memory_budget=budget,
        param_bytes=element,
        grad_bytes=element,
        backend=dist.get_backend(),
    )
    if report is not None:
        report(
            f"lightning_zero: shard_size='auto' chose {choice.shard_size} for {psi:,} trainable parameters "
            f"on {n} ranks ({g} per node), links measured: inside a node {intra.alpha * 1e6:.0f} us + "
            f"{intra.bandwidth / 1e9:.2f} GB/s, across nodes {inter.alpha * 1e6:.0f} us + "
            f"{inter.bandwidth / 1e9:.2f} GB/s, memory budget {budget / 2**30:.1f} GiB per rank\n"
            f"{format_shard_table(choice)}"
        )
    return choice.shard_size


def _node_groups(ranks_per_node: int, world_size: int) -> tuple[Any, Any]:
    """This rank's node group and its group across the nodes (made once per process)."""
    key = (ranks_per_node, world_size)
    if key not in _NODE_GROUPS:
        nodes = [shard_ranks(i * ranks_per_node, ranks_per_node) for i in range(world_size // ranks_per_node)]
        acrosses = [replicate_ranks(i, ranks_per_node, world_size) for i in range(ranks_per_node)]
        within, _ = dist.new_subgroups_by_enumeration(nodes, backend=dist.get_backend())
        across, _ = dist.new_subgroups_by_enumeration(acrosses, backend=dist.get_backend())
        _NODE_GROUPS[key] = (within, across)
    return _NODE_GROUPS[key]


def measure_link(group_comm: Any, device: torch.device, label: str) -> Any:
    """Alpha and bandwidth of the link ``group_comm``'s ranks share: the median time of all-reduces
    of PROBE_BYTES (counted apart in the ledger, as control collectives); bandwidth in the ring's
    wire bytes per rank, as the planner counts them."""
    from lightning_zero.planning.hybrid import Link

    n = group_comm.world_size
    medians = []
    for nbytes in PROBE_BYTES:
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        samples = []
        for i in range(PROBE_REPEATS + 1):
            start = time.perf_counter()
            group_comm.probe_all_reduce(tensor, name=f"mesh/probe/{label}")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first sets the connection up
                samples.append(time.perf_counter() - start)
        medians.append(statistics.median(samples))
    wire = [2 * (n - 1) / n * nbytes for nbytes in PROBE_BYTES]
    bandwidth = (wire[1] - wire[0]) / max(medians[1] - medians[0], 1e-9)
    return Link(alpha=max(medians[0] - wire[0] / bandwidth, 1e-9), bandwidth=bandwidth)


def _device_memory(device: torch.device) -> float:
    """Bytes of memory of ``device``: the GPU's, or the host's physical memory."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
