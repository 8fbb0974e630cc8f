"""Aliases lent to the backend are kept while it holds them and dropped, on the waiting thread, once
it let go ([Note: tensors lent to the backend] in lightning_zero/comm/lent.py). A saved tensor of an
autograd graph stands for the backend's hold: a C++ reference the caller does not see."""

from __future__ import annotations

import threading
import time
import weakref

import torch

from lightning_zero.comm.lent import Lent, lend


def _held_alias() -> tuple[torch.Tensor, torch.Tensor]:
    """An alias, and the graph output whose saved tensors hold it from C++."""
    alias = lend(torch.ones(4)[1:3])
    leaf = torch.ones(2, requires_grad=True)
    return alias, leaf * alias


def test_an_alias_is_a_tensor_of_its_own():
    caller = torch.zeros(8)
    alias = lend(caller[2:6])
    assert not alias._is_view() and alias.data_ptr() == caller[2:6].data_ptr()
    assert caller._use_count() == 1  # the alias holds the storage, not the caller's tensor


def test_kept_while_the_backend_holds_it_and_dropped_once_it_let_go():
    lent = Lent()
    alias, graph = _held_alias()
    ref = weakref.ref(alias)
    lent.give_back((alias,))
    del alias
    assert ref() is not None  # still held from C++: kept, so that its object does not die elsewhere
    lent.settle()
    assert ref() is not None
    del graph  # the backend let go
    lent.settle()
    assert ref() is None  # dropped here, on this thread
    free = lend(torch.ones(3))
    ref = weakref.ref(free)
    lent.give_back((free,))
    del free
    assert ref() is None  # not held: not kept at all


def test_drain_waits_a_bounded_time_for_a_hold_that_never_ends():
    lent = Lent()
    alias, graph = _held_alias()
    lent.give_back((alias,))
    start = time.monotonic()
    lent.drain(timeout_s=0.2)
    assert 0.2 <= time.monotonic() - start < 2.0
    assert not lent._kept


def test_quiesce_waits_for_a_running_thread_and_returns_when_all_are_idle():
    """At exit the other threads are given the GIL until none is running (bounded)."""
    from lightning_zero.comm.lent import quiesce

    stop = threading.Event()
    busy = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
    busy.start()
    try:
        start = time.monotonic()
        assert quiesce(timeout_s=0.1) is False  # a thread kept running: the wait is bounded
        assert time.monotonic() - start < 1.0
    finally:
        stop.set()
        busy.join()
    idle = threading.Thread(target=stop.wait)  # waits on a condition, as an idle backend thread
    idle.start()
    assert quiesce(timeout_s=1.0) is True
    idle.join()
