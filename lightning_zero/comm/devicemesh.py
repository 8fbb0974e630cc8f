"""The DeviceMesh that stage 3's DTensors live on, over the process groups a communicator uses.

[Note: the DTensor mesh]
A stage-3 parameter at rest is a DTensor (``zero/dtensor.py``). Its mesh is built from the groups
the engine already shards over, never new ones: full sharding a 1-D mesh over the shard group
(``Shard(0)``); hybrid sharding a 2-D mesh ``("replicate", "shard")`` over the replicate and shard
groups (``(Replicate(), Shard(0))``), the shard groups being blocks of consecutive ranks
([Note: shard groups and replicate groups] in ``mesh.py``), so replica i's shard j is world rank
i * K + j. The package's own collectives on those tensors (a norm read at rest, a full value)
still go through the :class:`Communicator`, checked and in the ledger; only DTensor's own
redistributions (an op DTensor cannot compute shard by shard) use the mesh's groups directly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

_MESHES: dict[tuple, DeviceMesh] = {}  # (group ids, device type) -> its mesh: one per process


def device_mesh(comm: Any, device: torch.device) -> DeviceMesh:
    """The mesh of ``comm``'s shard group (and its replicate group, under hybrid sharding)."""
    shard = comm.group if comm.group is not None else dist.group.WORLD
    replicate = comm.replicate.group if comm.replicate is not None else None
    key = (id(shard), id(replicate), device.type)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = _MESHES[key] = _build(comm, shard, replicate, device.type)
    return mesh


def _build(comm: Any, shard: Any, replicate: Any, device_type: str) -> DeviceMesh:
    if replicate is None:
        return DeviceMesh.from_group(shard, device_type)
    k, r = comm.world_size, comm.replicate.world_size
    layout = torch.arange(k * r, dtype=torch.int).view(r, k)  # replica i, shard j: world rank i*K + j
    return DeviceMesh.from_group(
        [replicate, shard], device_type, mesh=layout, mesh_dim_names=("replicate", "shard")
    )
