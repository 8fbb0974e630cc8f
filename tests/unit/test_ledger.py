"""CommLedger: bounded memory, exact aggregates, O(new records) reads (see [Note: bounded ledger])."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from lightning_zero.callbacks import _Window
from lightning_zero.comm import CommLedger, OpTotals


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
