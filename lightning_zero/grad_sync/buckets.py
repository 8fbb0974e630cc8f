"""BucketPlan: which parameter's gradient goes into which flat bucket, at which offset.

Pure data: no process group, no autograd. The reducer turns a plan into storage and hooks.

[Note: bucket order]
Gradients become ready roughly in reverse registration order (the last layer's first), so the
initial plan walks the parameters backwards. Parameters are kept apart by key (dtype, device and
any extra key the caller gives): one bucket holds one dtype on one device. A bucket closes once
its size reaches its cap; the first bucket of each key has a smaller cap so that the first
collective starts early in backward. Buckets are launched strictly in plan order on every rank
(see [Note: same collectives everywhere] in reducer.py). After the first step the plan is rebuilt
once from the order in which gradients actually became ready, so that the first bucket to fill
is the first one sent.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch


class ParamInfo(NamedTuple):
    index: int  # registration index of the parameter among the synchronised ones
    numel: int  # number of elements
    dtype: torch.dtype  # gradient dtype
    device: torch.device  # gradient device
    key: Hashable = None  # extra split key (e.g. optimizer param group); None for none


class BucketSpec(NamedTuple):
    params: tuple[int, ...]  # registration indices, in bucket order
    offsets: tuple[int, ...]  # start element of each parameter in the flat bucket
    numel: int  # elements used by the parameters
    padded_numel: int  # elements allocated: numel rounded up to a multiple of pad_to
    dtype: torch.dtype
    device: torch.device


def plan_buckets(
    params: Sequence[ParamInfo],
    *,
    cap_bytes: int,
    first_cap_bytes: int,
    order: Sequence[int] | None = None,
    pad_to: int = 1,
) -> list[BucketSpec]:
    """Assign parameters to buckets.

    Args:
        params: the parameters, indexed by ``ParamInfo.index``.
        cap_bytes: a bucket closes once it holds at least this many bytes.
        first_cap_bytes: the same for the first bucket of each (dtype, device, key).
        order: registration indices in the order gradients became ready; ``None`` means reverse
            registration order. Parameters missing from it follow in reverse registration order.
        pad_to: each bucket's allocation is rounded up to a multiple of this (the world size for
            the sharded stages, so that every rank owns an equal slice).

    Returns:
        The buckets in launch order.
    """
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be > 0 bytes, got {cap_bytes} and {first_cap_bytes}")
    by_index = {p.index: p for p in params}
    sequence = _walk_order(by_index, order)
    open_buckets: dict[Hashable, list[ParamInfo]] = {}  # key -> params of its open bucket
    open_bytes: dict[Hashable, int] = {}  # key -> bytes in its open bucket
    closed_per_key: dict[Hashable, int] = {}  # key -> buckets already closed
    closed: list[list[ParamInfo]] = []
    for info in sequence:
        key = (info.dtype, info.device, info.key)
        open_buckets.setdefault(key, []).append(info)
        open_bytes[key] = open_bytes.get(key, 0) + info.numel * _itemsize(info.dtype)
        cap = first_cap_bytes if closed_per_key.get(key, 0) == 0 else cap_bytes
        if open_bytes[key] >= cap:
            closed.append(open_buckets.pop(key))
            open_bytes[key] = 0
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
    closed.extend(b for b in open_buckets.values() if b)
    position = {info.index: i for i, info in enumerate(sequence)}
    closed.sort(key=lambda bucket: position[bucket[0].index])
    return [_spec(bucket, pad_to) for bucket in closed]


def _walk_order(by_index: dict[int, ParamInfo], order: Sequence[int] | None) -> list[ParamInfo]:
    seen: set[int] = set()
    sequence: list[ParamInfo] = []
    for index in order or ():
        if index not in by_index:
            raise ValueError(f"bucket order names parameter index {index}, which is not synchronised")
        if index not in seen:
            seen.add(index)
            sequence.append(by_index[index])
    for index in sorted(by_index, reverse=True):
        if index not in seen:
            sequence.append(by_index[index])
    return sequence


def _spec(bucket: list[ParamInfo], pad_to: int) -> BucketSpec:
    offsets, total = [], 0
    for info in bucket:
        offsets.append(total)
        total += info.numel
    padded = -(-total // pad_to) * pad_to
    first = bucket[0]
    return BucketSpec(
        tuple(p.index for p in bucket), tuple(offsets), total, padded, first.dtype, first.device
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
