"""Reduce-scatter and all-gather without the full-size copy gloo makes of their tensors.

[Note: collectives in place]
gloo's flat-tensor reduce-scatter (``reduce_scatter_tensor``) clones its whole input when it is
launched, all-reduces the clone and copies chunk r of it into the output; its flat all-gather
(``all_gather_into_tensor``) gathers into a buffer of the output's size and copies that over. Each
collective in flight therefore holds a second copy of its full size: stage 1 launches every
bucket before it waits for any, so its backward held a second copy of all its gradients (4Ψ),
stage 2 one per reduce buffer, and the parameter all-gather after the step one per gloo worker
thread. On CPU tensors under gloo the Communicator does instead, with the same bits as a result:

- a reduce-scatter whose input the caller no longer needs (``scratch_input=True``; every bucket,
  unit buffer and set-aside gradient in the package) into chunk r of that input (stage 1's
  buckets, stage 2's where they add to a window) is an all-reduce *in* the input, which is what
  gloo runs on its clone;
- one into an output of its own (stage 3's units, set-aside gradients, stage 2's buckets into a
  new shard gradient) is an exchange: rank r sends chunk j to rank j and receives every other
  rank's chunk r, into the output and N-2 buffers of a chunk each, and sums them with its own in
  rank order when the wait returns. Each rank sends (N-1)/N of the input, what a ring
  reduce-scatter sends and half of what the all-reduce sends (gpt_small's stage 3: 2.0 against
  3.3 ms for its 4 MiB of gradients), and holds no full-size copy;
- an all-gather copies the input into chunk r of the output (unless it is that chunk already)
  and broadcasts every chunk from the rank that owns it, in place (N broadcasts, waited as one).

At N = 2 each of the last two is one swap with the other rank: an all-to-all in which a rank
sends nothing to itself, so that what it sends (the peer's chunk of the input, or its own chunk
of the output) and what it receives (into the output, or the peer's chunk of the output) are one
tensor each. It is one launch where the exchange takes a send and a receive and the all-gather
two broadcasts, and gloo runs it on its worker thread: gloo's sends and receives copy on the
calling thread, and every launch costs the training thread 0.1-0.4 ms (cProfile, gpt_small's
stage 3: 8.5 ms of launches per step before, 2.9 ms after).

The ledger still records one reduce-scatter or all-gather of the logical size (see [Note: logical
bytes] in ledger.py). NCCL writes its output directly: nothing changes on CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.lent import lend


def copies_in_backend(tensor: Tensor, group: Any | None) -> bool:
    """Whether ``group`` runs collectives on ``tensor`` with gloo (CPU tensors), whose reduce-scatter
    and all-gather copy their tensors whole (see [Note: collectives in place])."""
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def chunk_of(flat: Tensor, rank: int, world_size: int) -> Tensor:
    """Chunk ``rank`` of the 1D view of ``flat`` (its numel a multiple of ``world_size``)."""
    size = flat.numel() // world_size
    return flat.reshape(-1)[rank * size : (rank + 1) * size]


def same_tensor(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` are the same elements of the same storage (one is a view standing for the other)."""
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype


def all_reduce_for_scatter(output: Tensor, input: Tensor, *, rank: int, world_size: int, group: Any) -> Any:
    """Launch the all-reduce in ``input`` that stands for a reduce-scatter into ``output``, chunk
    ``rank`` of ``input``."""
    lent = lend(input)
    return Works([dist.all_reduce(lent, group=group, async_op=True)], lent=(lent,))


def reduce_scatter_by_exchange(
    output: Tensor, input: Tensor, *, rank: int, world_size: int, group: Any
) -> Any:
    """Launch the exchange that stands for a reduce-scatter of ``input`` into ``output`` (not a
    chunk of ``input``): chunk j to rank j, every other rank's chunk ``rank`` received; the
    returned work's :meth:`finish` sums them in rank order into ``output`` after the wait. At N = 2
    it is one swap (:func:`swap_with_peer`); above, sends and receives, waited for without a
    timeout: a gloo send or receive whose wait times out closes its connection to the peer, which
    ends the process group (measured: "Application timeout caused pair closure" on the next
    collective), so the Communicator waits for them on its waiter thread."""
    out = output.view(-1)
    peers = [j for j in range(world_size) if j != rank]
    extra = (
        ()
        if world_size == 2
        else torch.empty((world_size - 2, out.numel()), dtype=input.dtype, device=input.device)
    )
    received = dict(zip(peers, [out, *extra]))  # from the first peer into the output, the rest apart
    parts = [chunk_of(input, j, world_size) if j == rank else received[j] for j in range(world_size)]
    if world_size == 2:
        return swap_with_peer(
            chunk_of(input, peers[0], 2), out, rank=rank, group=group, sum_into=(out, parts)
        )
    works, lent = [], []
    for peer, into in received.items():
        dst = dist.get_global_rank(group, peer) if group is not None else peer
        lent += [lend(chunk_of(input, peer, world_size)), lend(into)]
        works.append(dist.isend(lent[-2], dst, group=group))
        works.append(dist.irecv(lent[-1], dst, group=group))
    return Works(works, sum_into=(out, parts), lent=tuple(lent), timed=False)


def all_gather_in_place(output: Tensor, input: Tensor, *, rank: int, world_size: int, group: Any) -> Any:
    """Launch an all-gather into ``output``: ``input`` copied into this rank's chunk, then one swap
    at N = 2 (:func:`swap_with_peer`), else one broadcast per chunk from the chunk's owner."""
    own = chunk_of(output, rank, world_size)
    if not same_tensor(own, input):
        own.copy_(input.reshape(-1))
    if world_size == 2:
        return swap_with_peer(own, chunk_of(output, 1 - rank, 2), rank=rank, group=group)
    works, chunks = [], []
    for owner in range(world_size):
        src = dist.get_global_rank(group, owner) if group is not None else owner
        chunks.append(lend(chunk_of(output, owner, world_size)))
        works.append(dist.broadcast(chunks[-1], src, group=group, async_op=True))
    return Works(works, lent=tuple(chunks))


def swap_with_peer(
    send: Tensor,
    recv: Tensor,
    *,
    rank: int,
    group: Any,
    sum_into: tuple[Tensor, list[Tensor]] | None = None,
) -> Any:
    """At N = 2: ``send`` to the other rank and the other rank's ``send`` received into ``recv``
    (as many elements), as one all-to-all that sends nothing to this rank itself; ``sum_into`` as
    :class:`Works`. Unlike a send or a receive, its wait may be given a timeout (measured: a peer
    later than ten slices leaves the group working)."""
    sizes = [0, 0]
    sizes[1 - rank] = send.numel()
    lent = (lend(send), lend(recv))
    work = dist.all_to_all_single(
        lent[1], lent[0], output_split_sizes=sizes, input_split_sizes=sizes, group=group, async_op=True
    )
    return Works([work], sum_into=sum_into, lent=lent)


class Works:
    """torch Works waited as one collective: ``wait`` (with a slice timeout, as gloo's) waits for
    each in turn, ``is_completed`` when all are; ``sum_into`` is an (output, parts) sum that
    :meth:`finish` makes after the last wait returned; ``timed``: whether ``wait`` may be given a
    timeout (not for sends and receives); ``lent``: the tensors the works were launched
    with (see [Note: tensors lent to the backend] in lent.py)."""

    def __init__(
        self,
        works: Sequence[Any],
        *,
        lent: tuple[Tensor, ...] = (),
        sum_into: tuple[Tensor, list[Tensor]] | None = None,
        timed: bool = True,
    ) -> None:
        self.works = list(works)  # the torch Works, in launch order
        self.timed = timed  # False: wait only without a timeout (see reduce_scatter_by_exchange)
        self.sum_into = sum_into  # (output, each rank's chunk in rank order; the output is one of two first)
        self.lent = lent  # the private aliases the backend holds until it drops the works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self.works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def finish(self) -> None:
        """After a successful wait, on the waiting thread: the reduce-scatter's output filled in."""
        if self.sum_into is not None:
            output, parts = self.sum_into
            torch.add(parts[0], parts[1], out=output)  # elementwise: the output may be either
            for part in parts[2:]:
                output.add_(part)
            self.sum_into = None
