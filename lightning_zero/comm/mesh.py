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

from typing import Any, NamedTuple

import torch.distributed as dist

NODE = "node"  # shard_size="node": one shard group per node


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


def sharding_comm(comm: Any, shard_size: int | str | None, stage: int, num_nodes: int) -> Any:
    """The communicator the engine shards over: ``comm`` itself (full sharding), or with K < N its
    shard group's, carrying the replicate group's as ``replicate`` (see [Note: hybrid comms] in
    ``collectives.py``). Sets the links the ledger files each group's collectives under. Collective
    the first time a shape is asked for in a process (the groups are made once, then kept)."""
    n = comm.world_size
    if num_nodes < 1 or n % num_nodes:
        raise ValueError(f"{n} ranks cannot be spread evenly over {num_nodes} nodes")
    g = n // num_nodes
    comm.link = "inter" if spans_nodes(list(range(n)), g) else "intra"
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
