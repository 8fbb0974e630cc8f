"""gloo's reduce-scatter and all-gather done in place ([Note: collectives in place] in
lightning_zero/comm/inplace.py): the same bits as torch's collectives, and no full-size copy."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from lightning_zero.comm import Communicator
from lightning_zero.comm.lent import LENT
from lightning_zero.comm.waiting import POLL_S
from tests.bigmodel.lit import peak_rss_mb, release_free_heap, reset_peak, rss_mb
from tests.distributed.harness import run_ranks

MIB = 2**20


def _values(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Values spread over many magnitudes, so that the order of a sum shows in its bits."""
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(numel, generator=g) * torch.logspace(-4, 4, numel)).to(dtype)


def _same_bits(rank: int, world: int) -> list[str]:
    """Where the package's reduce-scatter and all-gather differ from torch's (empty: nowhere); the
    reduce-scatter into an output of its own sums in rank order instead (an exchange)."""
    comm = Communicator()
    wrong = []
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (world * 5, world * 40_001):
            x = _values(rank, numel, dtype)
            expected = torch.empty(numel // world, dtype=dtype)
            dist.reduce_scatter_tensor(expected, x.clone())
            everyone = torch.empty(world * numel, dtype=dtype)
            dist.all_gather_into_tensor(everyone, x)
            mine = everyone.view(world, world, -1)[:, rank]  # every rank's chunk `rank`, in rank order
            in_rank_order = mine[0] + mine[1]
            for part in mine[2:]:
                in_rank_order += part
            apart = torch.empty_like(expected)  # the output is a tensor of its own: an exchange
            comm.reduce_scatter(apart, x.clone(), name="rs/apart", scratch_input=True).wait()
            flat = x.clone()  # the output is this rank's chunk of the input (stage 1)
            own = flat[rank * (numel // world) : (rank + 1) * (numel // world)]
            comm.reduce_scatter(own, flat, name="rs/own", scratch_input=True).wait()
            kept = x.clone()  # the input stays as it was: torch's own collective
            plain = torch.empty_like(expected)
            comm.reduce_scatter(plain, kept, name="rs/plain").wait()
            gathered = torch.empty(numel, dtype=dtype)
            comm.all_gather(gathered, expected, name="ag/apart").wait()
            full = torch.zeros(numel, dtype=dtype)  # the input is this rank's chunk of the output
            full[rank * (numel // world) : (rank + 1) * (numel // world)].copy_(expected)
            comm.all_gather(
                full, full[rank * (numel // world) : (rank + 1) * (numel // world)], name="ag/own"
            ).wait()
            reference = torch.empty(numel, dtype=dtype)
            dist.all_gather_into_tensor(reference, expected)
            checks = {
                "reduce-scatter into its own output": torch.equal(apart, in_rank_order),
                "reduce-scatter into the input's chunk": torch.equal(own, expected),
                "reduce-scatter that keeps its input": torch.equal(plain, expected) and torch.equal(kept, x),
                "all-gather": torch.equal(gathered, reference),
                "all-gather from the output's chunk": torch.equal(full, reference),
            }
            wrong += [f"{what} ({dtype}, {numel})" for what, ok in checks.items() if not ok]
    return wrong


@pytest.mark.parametrize("world", [2, 3])  # at N = 2 swaps, above sends and receives, broadcasts
def test_in_place_collectives_give_torch_s_bits(tmp_path, world):
    for wrong in run_ranks(_same_bits, world, tmp_path):
        assert wrong == []


def _transients(rank: int, world: int) -> dict[str, float]:
    """MiB the resident size rose above what the tensors themselves need, per collective."""
    comm = Communicator()
    numel = 64 * MIB // 4
    flat = torch.ones(numel)
    out = torch.ones(numel // world)
    rises = {}
    for name, run in (
        ("reduce-scatter", lambda: comm.reduce_scatter(out, flat, name="rs", scratch_input=True)),
        ("all-gather", lambda: comm.all_gather(flat, out, name="ag")),
    ):
        for _ in range(2):  # the second: gloo's own buffers exist already
            release_free_heap()
            start = rss_mb()
            reset_peak()
            run().wait()
            rises[name] = peak_rss_mb() - start
    return rises


def test_in_place_collectives_hold_no_full_size_copy(tmp_path):
    # torch's reduce_scatter_tensor and all_gather_into_tensor on gloo rise by the whole 64 MiB
    for rises in run_ranks(_transients, 2, tmp_path):
        assert all(rise < 8 for rise in rises.values()), rises


def _late_peer(rank: int, world: int) -> list[float]:
    """A reduce-scatter into an output of its own (sends and receives) whose peer comes later than a
    wait's slice, then an all-reduce: the group still works."""
    comm = Communicator()
    flat, out = torch.arange(4.0 * world) + rank, torch.empty(4)
    if rank == world - 1:
        time.sleep(2.5 * POLL_S)
    comm.reduce_scatter(out, flat, name="rs/late", scratch_input=True).wait()
    after = torch.ones(2)
    comm.all_reduce(after, name="ar/after").wait()
    return out.tolist() + after.tolist()


@pytest.mark.parametrize("world", [2, 3])
def test_an_exchange_waits_for_a_late_peer(tmp_path, world):
    """A gloo send or receive whose wait times out closes the connection and ends the group: above
    N = 2 the exchange is waited for without the slices a collective's wait takes; at N = 2 the
    swap is a collective, waited for in slices."""
    ranks = sum(range(world))
    for rank, got in enumerate(run_ranks(_late_peer, world, tmp_path)):
        expected = [world * (4.0 * rank + k) + ranks for k in range(4)]
        assert got == expected + [float(world)] * 2


def _where_temporaries_die(rank: int, world: int) -> dict[str, int]:
    """Collectives on temporaries dropped as soon as the wait returns (a table, a scratch buffer):
    on which threads their Python objects died (see [Note: tensors lent to the backend])."""
    comm = Communicator()
    main, threads = threading.get_ident(), {"main": 0, "other": 0}

    def died(_ref: weakref.ref) -> None:
        threads["main" if threading.get_ident() == main else "other"] += 1

    refs = []
    for i in range(150):
        numel = world * (4 + i % 7)
        t, out, flat, full = (
            torch.ones(numel),
            torch.empty(numel // world),
            torch.ones(numel),
            torch.zeros(numel),
        )
        refs += [weakref.ref(x, died) for x in (t, out, flat, full)]
        comm.all_reduce(t, name="temp/all_reduce").wait()
        comm.reduce_scatter(out, flat, name="temp/reduce_scatter", scratch_input=i % 2 == 0).wait()
        comm.all_gather(full, out, name="temp/all_gather").wait()
        comm.broadcast(out, name="temp/broadcast")
        del t, out, flat, full
    LENT.drain()
    return threads


def test_temporaries_lent_to_the_backend_die_on_the_waiting_thread(tmp_path):
    """Every tensor object the package hands to gloo is its own alias, kept until gloo lets go of
    it: a caller's temporary is never destroyed by gloo's worker thread, which could not take the
    GIL once the interpreter finalizes (the exit-time SIGABRT)."""
    for threads in run_ranks(_where_temporaries_die, 2, tmp_path):
        assert threads == {"main": 600, "other": 0}, threads
