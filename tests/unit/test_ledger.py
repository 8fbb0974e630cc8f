"""CommLedger: bounded memory, exact aggregates, O(new records) reads (see [Note: bounded ledger])."""

from __future__ import annotations

import time
import tracemalloc

import pytest
import torch

from lightning_zero.callbacks import _Window
from lightning_zero.comm import CommLedger, OpTotals
from tests.unit.fakes import FakeInterval


def _run(ledger: CommLedger, steps: int, *, per_step: int = 3) -> None:
    for step in range(steps):
        ledger.begin_step(step)
        for b in range(per_step):
            ledger.record("all_reduce", f"zero0/all_reduce/bucket={b}", 400, 4)
        ledger.add_wait("all_reduce", 0.001)


def test_detail_window_and_step_aggregates_are_bounded_totals_exact():
    ledger = CommLedger(max_records=10, max_steps=4)
    _run(ledger, 100)
    assert len(ledger.records) == 10 and ledger.recorded == 300
    assert [r.step for r in ledger.records] == [96, 96, 97, 97, 97, 98, 98, 98, 99, 99, 99][1:]
    assert ledger.steps() == [96, 97, 98, 99]
    assert ledger.totals(step=99) == {"all_reduce": OpTotals(3, 1200, 3 * 600.0)}
    assert ledger.totals(step=3) == {}  # dropped with its step
    assert ledger.totals() == {"all_reduce": OpTotals(300, 120_000, 300 * 600.0)}  # the whole run
    assert ledger.wait_totals()["all_reduce"] == pytest.approx(0.1)
    assert ledger.wait_seconds(99) == {"all_reduce": pytest.approx(0.001)}
    assert set(ledger.waits) == {(s, "all_reduce") for s in (96, 97, 98, 99)}
    assert ledger.totals(step=99, prefix="zero0/all_reduce/bucket=2") == {
        "all_reduce": OpTotals(1, 400, 600.0)
    }


def test_records_since_returns_only_what_is_new():
    ledger = CommLedger(max_records=5)
    _run(ledger, 1)
    mark = ledger.recorded
    ledger.record("broadcast", "zero0/broadcast/buffers", 8, 4)
    assert [r.name for r in ledger.records_since(mark)] == ["zero0/broadcast/buffers"]
    assert ledger.records_since(ledger.recorded) == []
    _run(ledger, 3)  # more than the window since the mark: what is left of it
    assert len(ledger.records_since(mark)) == 5


def test_control_collectives_are_counted_apart():
    ledger = CommLedger()
    ledger.record_control(16, 4)
    assert ledger.control == OpTotals(1, 16, 24.0) and ledger.totals() == {} and ledger.recorded == 0


def test_memory_stays_flat_over_a_long_run():
    """20k steps of 3 records each: the ledger holds the same bytes after 4k steps as after 20k."""
    ledger = CommLedger(max_records=1_000, max_steps=100)
    tracemalloc.start()
    _run(ledger, 4_000)
    early, _ = tracemalloc.get_traced_memory()
    _run(ledger, 16_000)
    late, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert late - early < 64 * 1024, (early, late)  # 48k more records (7 MB unbounded): no growth


def test_a_monitor_window_costs_the_collectives_of_its_step_not_the_run():
    """Opening and closing the monitor's window takes as long after 200k records as after 300."""
    ledger = CommLedger(max_records=1_000_000, max_steps=100_000)

    def window_time() -> float:
        start = time.perf_counter()
        for _ in range(200):
            window = _Window(step=ledger.step, ledger=ledger)
            ledger.record("all_reduce", "zero0/all_reduce/bucket=0", 400, 4)
            ledger.add_wait("all_reduce", 0.001)
            window.pause()
        return time.perf_counter() - start

    _run(ledger, 100)
    short = window_time()
    _run(ledger, 70_000)
    long = window_time()
    assert long < 3 * short + 0.05, (short, long)
    assert len(window_records := _Window(step=0, ledger=ledger).records) == 0 and window_records == []


# --------------------------------------------------------------------------- how waits are timed


def test_stream_waits_are_filed_under_their_step_once_their_events_have_run():
    ledger = CommLedger()
    early, late = FakeInterval(0.25), FakeInterval(0.5)
    ledger.record("reduce_scatter", "zero2/reduce_scatter/bucket=0", 400, 2)
    ledger.add_stream_wait("reduce_scatter", early)  # step 0
    assert len(ledger.pending) == 1 and ledger.timing == "cuda-events"
    ledger.begin_step(1)
    ledger.record("all_gather", "zero2/all_gather/params/bucket=0", 400, 2)
    early.complete = True
    ledger.add_stream_wait("all_gather", late)  # files the complete one first, without blocking
    assert list(ledger.pending) == [(1, "all_gather", late)] and not early.blocked
    assert ledger.wait_seconds(1) == {"all_gather": 0.5}  # a read settles: the host waits for `late`
    assert late.blocked and not ledger.pending
    assert ledger.wait_seconds(0) == {"reduce_scatter": 0.25}
    assert ledger.wait_totals() == {"reduce_scatter": 0.25, "all_gather": 0.5}
    ledger.add_wait("broadcast", 0.125)  # a host-timed wait beside them
    assert ledger.timing == "cuda-events + wall-clock"
    assert ledger.wait_timings() == {"cuda-events": 2, "wall-clock": 1}
    ledger.clear()
    assert ledger.timing is None and not ledger.pending and ledger.wait_totals() == {}


def test_a_stream_wait_of_a_dropped_step_counts_in_the_run_totals_only():
    ledger = CommLedger(max_steps=1)
    ledger.record("all_reduce", "zero0/all_reduce/bucket=0", 400, 2)
    ledger.add_stream_wait("all_reduce", FakeInterval(0.25))
    ledger.begin_step(1)
    ledger.record("all_reduce", "zero0/all_reduce/bucket=0", 400, 2)  # step 0's aggregates dropped
    ledger.settle()
    assert ledger.wait_seconds(0) == {} and ledger.wait_seconds(1) == {}
    assert ledger.wait_totals() == {"all_reduce": 0.25}


class FakeComm:
    """What a Handle asks of its Communicator: a ledger, and a wait that takes 20 ms of the host."""

    def __init__(self, calls: list[str]) -> None:
        self.ledger = CommLedger()
        self.calls = calls  # the order of events, shared with FakeStreamInterval

    def wait_for(self, work, issued) -> None:
        self.calls.append("wait")
        time.sleep(0.02)


def test_a_handle_times_cpu_waits_with_the_clock_and_cuda_waits_on_the_stream(monkeypatch):
    from lightning_zero.comm import Handle, waiting

    calls: list[str] = []

    class FakeStreamInterval(FakeInterval):
        def __init__(self, device: torch.device) -> None:
            super().__init__(0.004)
            calls.append(f"start on {device}")

        def close(self) -> FakeStreamInterval:
            calls.append("end")
            return self

    monkeypatch.setattr(waiting, "StreamInterval", FakeStreamInterval)
    cpu = FakeComm(calls)
    Handle(object(), cpu, "all_reduce", None, torch.device("cpu")).wait()
    assert cpu.ledger.wait_totals()["all_reduce"] >= 0.02 and cpu.ledger.timing == "wall-clock"
    assert calls == ["wait"]

    calls.clear()
    gpu = FakeComm(calls)
    Handle(object(), gpu, "reduce_scatter", None, torch.device("cuda", 1)).wait()
    assert calls == ["start on cuda:1", "wait", "end"]  # the events bracket the wait
    assert len(gpu.ledger.pending) == 1  # not read on the training path
    assert gpu.ledger.wait_totals() == {"reduce_scatter": 0.004} and gpu.ledger.timing == "cuda-events"

    control = FakeComm(calls)
    Handle(object(), control, None, None, torch.device("cuda", 0)).wait()  # a control collective
    assert control.ledger.timing is None and control.ledger.wait_totals() == {}
