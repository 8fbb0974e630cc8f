"""ZeroMonitor's pure parts: predictions, metrics, windows, formatting; and a single-process run."""

from __future__ import annotations

import csv
import math
import pickle

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_zero.callbacks import (
    OPS,
    FlatLayout,
    OpBytes,
    RunShape,
    StepSample,
    StepTimes,
    ZeroMonitor,
    _Window,
    format_bytes,
    format_diff,
    optimizer_state_k,
    plain_text,
    predict_memory,
    predict_traffic,
    print_sections,
    ratio,
    step_metrics,
    summary_sections,
    traffic_of,
)
from lightning_zero.comm import CommLedger
from lightning_zero.comm.ledger import OpTotals
from lightning_zero.memory import MemoryReport
from lightning_zero.planning import step_traffic
from tests.integration.lit import LitTiny
from tests.unit.fakes import FakeInterval

PSI = 1000


def shape(
    stage: int, n: int = 4, *, micro: int = 1, unsharded: bool = False, kept: int = 0, padded: int = PSI
):
    layout = FlatLayout(PSI, padded, kept, kept, 3)
    return RunShape(stage, n, 4, 4, "adam", 8.0, False, micro, unsharded, layout)


# --------------------------------------------------------------------------- predictions


def test_traffic_stage0_all_reduces_the_gradients_once():
    got = predict_traffic(shape(0, micro=4))  # no_sync inside the window: one reduction per step
    assert got.keys() == {"all_reduce"}
    assert got["all_reduce"].payload == 4 * PSI
    assert got["all_reduce"].wire == 2 * 3 / 4 * 4 * PSI  # 2(N-1)/N x 4Ψ


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_traffic_with_loss_scaling_adds_one_flag_all_reduce(stage):
    plain = predict_traffic(shape(stage))
    scaled = predict_traffic(shape(stage)._replace(found_inf=True))
    flag = scaled["all_reduce"].payload - plain.get("all_reduce", OpBytes(0.0, 0.0)).payload
    assert flag == 4.0  # one fp32 flag per optimizer step
    assert scaled["all_reduce"].wire - plain.get("all_reduce", OpBytes(0.0, 0.0)).wire == 2 * 3 / 4 * 4
    assert {k: v for k, v in scaled.items() if k != "all_reduce"} == {
        k: v for k, v in plain.items() if k != "all_reduce"
    }


@pytest.mark.parametrize(
    "stage, micro, unsharded, reduces", [(1, 2, False, 1), (2, 2, False, 2), (2, 2, True, 1)]
)
def test_traffic_stages_1_2(stage, micro, unsharded, reduces):
    got = predict_traffic(shape(stage, micro=micro, unsharded=unsharded))
    assert got["reduce_scatter"].payload == reduces * 4 * PSI
    assert got["reduce_scatter"].wire == reduces * 3 / 4 * 4 * PSI
    assert got["all_gather"].payload == 4 * PSI  # the updated parameters, once per step
    assert got["all_gather"].wire == 3 / 4 * 4 * PSI


def test_traffic_stage3_gathers_kept_units_once_and_the_rest_twice():
    got = predict_traffic(shape(3, kept=200))
    assert got["all_gather"].payload == (2 * 800 + 200) * 4
    assert got["all_gather"].wire == pytest.approx(3 / 4 * (2 * 800 + 200) * 4)
    assert got["reduce_scatter"].payload == 4 * PSI
    twice = predict_traffic(shape(3, kept=200, micro=2))  # every micro-batch gathers and reduces
    assert twice["all_gather"].payload == 2 * got["all_gather"].payload
    assert twice["reduce_scatter"].payload == 2 * got["reduce_scatter"].payload
    window = predict_traffic(shape(3, kept=200, micro=2, unsharded=True))  # one reduce-scatter per window
    assert window["reduce_scatter"] == got["reduce_scatter"]
    assert window["all_gather"] == twice["all_gather"]


def test_traffic_stage3_without_kept_units_is_the_planners_3_psi():
    got = predict_traffic(shape(3, kept=0))
    plan = step_traffic(PSI, 4, 3, param_bytes=4, grad_bytes=4)
    assert got["all_gather"].wire + got["reduce_scatter"].wire == pytest.approx(plan.total)
    assert plan.total == pytest.approx(3 * 3 / 4 * 4 * PSI)  # 3Ψ x (N-1)/N, 4-byte elements


def test_traffic_one_process_sends_nothing_and_padding_adds_elements():
    assert predict_traffic(shape(2, n=1)) == {}
    padded = predict_traffic(shape(1, padded=PSI + 3), padded=True)
    assert padded["reduce_scatter"].payload == 4 * (PSI + 3)


@pytest.mark.parametrize(
    "stage, params, grads, optimizer",
    [(0, 4000, 4000, 8000), (1, 4000, 4000, 2000), (2, 4000, 1000, 2000), (3, 1000, 1000, 2000)],
)
def test_memory_prediction_shards_by_stage(stage, params, grads, optimizer):
    got = predict_memory(shape(stage))  # fp32 Adam without master copy: 4 + 4 + 8 bytes per element
    assert (got.params, got.grads, got.optimizer) == (params, grads, optimizer)
    assert predict_memory(shape(stage, padded=PSI + 4), padded=True).params == params * (PSI + 4) / PSI


def _optimizer(cls, **kwargs):
    return cls([torch.nn.Parameter(torch.zeros(3))], lr=0.1, **kwargs)


def test_optimizer_k():
    fp32 = dict(state_bytes=4, master_copy=False)
    assert optimizer_state_k([_optimizer(torch.optim.Adam)], **fp32) == ("adam", 8)
    assert optimizer_state_k([_optimizer(torch.optim.AdamW)], **fp32) == ("adamw", 8)
    assert optimizer_state_k([_optimizer(torch.optim.SGD, momentum=0.9)], **fp32) == ("sgd_momentum", 4)
    assert optimizer_state_k([_optimizer(torch.optim.SGD)], **fp32) == ("sgd", 0)
    assert optimizer_state_k([_optimizer(torch.optim.Adam)], state_bytes=2, master_copy=False) == ("adam", 4)
    assert optimizer_state_k([_optimizer(torch.optim.Adam)], state_bytes=4, master_copy=True) == ("adam", 12)
    assert optimizer_state_k([_optimizer(torch.optim.Adam, amsgrad=True)], **fp32) == ("Adam", None)
    assert optimizer_state_k([_optimizer(torch.optim.RMSprop)], **fp32) == ("RMSprop", None)
    two = [_optimizer(torch.optim.Adam), _optimizer(torch.optim.Adam)]
    assert optimizer_state_k(two, **fp32) == ("2 optimizers", None)


# --------------------------------------------------------------------------- measurements


def _ledger() -> CommLedger:
    ledger = CommLedger()
    ledger.record("all_reduce", "zero0/all_reduce/bucket=0", 400, 4)
    ledger.add_wait("all_reduce", 0.5)
    return ledger


def test_traffic_of_sums_calls_and_bytes_per_op():
    ledger = _ledger()
    ledger.record("all_reduce", "zero0/all_reduce/bucket=1", 100, 4)
    ledger.record("broadcast", "zero0/broadcast/buffers", 8, 4)
    got = traffic_of(ledger.records)
    assert got == {"all_reduce": OpTotals(2, 500, 750.0), "broadcast": OpTotals(1, 8, 8.0)}
    assert got == ledger.totals()


def test_window_counts_only_what_happened_while_open():
    ledger = _ledger()  # before the window: not counted
    window = _Window(step=5, ledger=ledger)
    ledger.record("reduce_scatter", "zero2/reduce_scatter/bucket=0", 800, 4)
    ledger.add_wait("reduce_scatter", 0.25)
    window.pause()  # validation runs
    ledger.record("all_gather", "zero2/all_gather/unit=root", 800, 4)
    ledger.add_wait("all_gather", 1.0)
    window.resume()
    ledger.record("all_gather", "zero2/all_gather/params/bucket=0", 400, 4)
    window.pause()
    window.pause()  # twice is harmless
    assert [r.name for r in window.records] == [
        "zero2/reduce_scatter/bucket=0",
        "zero2/all_gather/params/bucket=0",
    ]
    assert dict(window.waits) == {"reduce_scatter": 0.25}
    assert window.timed == {"wall-clock": 1}  # the wait inside the window, not the one outside
    assert window.elapsed > 0 and window.step == 5
    assert _Window(step=0, ledger=None).records == []  # a strategy without a ledger


def test_window_settles_stream_timed_waits_when_it_closes():
    ledger = CommLedger()
    window = _Window(step=0, ledger=ledger)
    ledger.record("all_reduce", "zero0/all_reduce/bucket=0", 400, 4)
    interval = FakeInterval(0.125)
    ledger.add_stream_wait("all_reduce", interval)  # the GPU has not run its end event yet
    assert ledger.pending
    window.pause()
    assert interval.blocked and not ledger.pending  # the window's read waited for it
    assert dict(window.waits) == {"all_reduce": 0.125} and window.timed == {"cuda-events": 1}


def test_ratio():
    assert ratio(torch.tensor([2.0, 3.0, 6.0])) == 3.0
    assert ratio(torch.tensor([4.0])) == 1.0
    assert ratio(torch.tensor([0.0, 0.0])) == 1.0
    assert math.isinf(ratio(torch.tensor([0.0, 1.0])))


def _sample(memory: MemoryReport | None) -> StepSample:
    traffic = {"reduce_scatter": OpTotals(2, 800, 600.0)}
    times = torch.tensor([[0.2, 0.1], [0.25, 0.2]], dtype=torch.float64)  # (N, 2): wall, busy
    return StepSample(3, traffic, {"reduce_scatter": 0.05}, memory, 64, times)


def test_step_metrics_names_and_values():
    got = step_metrics(_sample(MemoryReport(100, 40, 200)))
    expected = {f"zero/{op}_{kind}" for op in OPS for kind in ("calls", "bytes", "wire_bytes", "wait_s")}
    expected |= {f"zero/mem_{c}_bytes" for c in ("params", "grads", "optim", "gathered")}
    expected |= {"zero/exposed_comm_s", "zero/step_time_s", "zero/step_time_max_over_min"}
    expected |= {"zero/exposed_comm_cuda_events"}
    expected |= {"zero/busy_time_max_s", "zero/busy_time_min_s", "zero/busy_time_max_over_min"}
    assert got.keys() == expected
    assert got["zero/reduce_scatter_calls"] == 2 and got["zero/reduce_scatter_bytes"] == 800
    assert got["zero/reduce_scatter_wire_bytes"] == 600 and got["zero/all_gather_calls"] == 0
    assert got["zero/exposed_comm_s"] == 0.05
    assert got["zero/exposed_comm_cuda_events"] == 0.0  # no timing given: not CUDA events
    on_gpu = _sample(MemoryReport(0, 0, 0))._replace(timing="cuda-events")
    assert step_metrics(on_gpu)["zero/exposed_comm_cuda_events"] == 1.0
    assert got["zero/step_time_s"] == 0.25 and got["zero/step_time_max_over_min"] == pytest.approx(1.25)
    assert got["zero/busy_time_max_over_min"] == pytest.approx(2.0)
    assert (got["zero/mem_params_bytes"], got["zero/mem_grads_bytes"], got["zero/mem_optim_bytes"]) == (
        100,
        40,
        200,
    )
    assert got["zero/mem_gathered_bytes"] == 64
    extra = _sample(MemoryReport(0, 0, 0))._replace(traffic={"gather": OpTotals(1, 48, 16.0)})
    assert step_metrics(extra)["zero/gather_bytes"] == 48  # an op outside OPS is logged too
    only_times = step_metrics(_sample(None))  # a strategy without a ledger
    assert sorted(only_times) == sorted(k for k in expected if "time" in k)


# --------------------------------------------------------------------------- formatting


def test_format_bytes_and_diff():
    assert format_bytes(None) == "-"
    assert format_bytes(2176) == "2,176 B"
    assert format_bytes(21760) == "21.2 KiB"
    assert format_bytes(3 * 2**20) == "3 MiB"
    assert format_bytes(1.5 * 2**30) == "1.5 GiB"
    assert format_diff(10, 4) == "+6 B" and format_diff(4, 10) == "-6 B" and format_diff(None, 1) == "-"


def _summary():
    run = shape(3, n=2, kept=200)
    traffic = {"all_gather": OpTotals(7, 7200, 3600.0), "reduce_scatter": OpTotals(4, 4000, 2000.0)}
    memory = MemoryReport(2000, 2000, 4016)
    return summary_sections(run, traffic, memory, 800, StepTimes(3, 0.012, 0.002, 1.1, "cuda-events"))


def test_summary_sections_put_prediction_next_to_measurement():
    header, traffic, memory, times = _summary()
    assert header.title == "ZeroMonitor: predicted vs measured, Ψ = 1,000, N = 2, stage 3"
    assert [r[0] for r in traffic.rows] == ["reduce_scatter", "all_gather"]
    assert traffic.rows[1] == ("all_gather", "7", "7,200 B", "7,200 B", "3,600 B", "3,600 B", "+0 B")
    assert any("logical" in note for note in traffic.notes)
    assert any("200 of Ψ gathered once" in note for note in traffic.notes)
    rows = {r[0]: r[1:] for r in memory.rows}
    assert rows["parameters"] == ("2,000 B", "2,000 B", "+0 B")  # 4Ψ / N
    assert rows["optimizer states"] == ("4,000 B", "4,016 B", "+16 B")  # 8Ψ / N, plus step counts
    assert rows["gathered units"] == ("-", "800 B", "-")
    assert any("adam k = 8 (no master copy)" in note for note in memory.notes)
    assert dict(times.rows)["mean step time (slowest rank)"] == "12 ms"
    assert dict(times.rows)["exposed communication timed with"] == "cuda-events"


def test_summary_without_ledger_has_step_times_only():
    sections = summary_sections(None, {}, None, 0, StepTimes(2, 0.01, 0.0, 1.0))
    assert [s.title for s in sections] == ["step times"]
    assert dict(sections[0].rows)["exposed communication timed with"] == "- (no collective waited)"


def test_plain_text_and_rich_printing(capsys):
    sections = _summary()
    text = plain_text(sections[1])
    assert text.splitlines()[0] == "traffic per optimizer step, one rank"
    assert "all_gather" in text and "+0 B" in text
    assert plain_text(summary_sections(shape(0, n=1), {}, MemoryReport(0, 0, 0), 0, StepTimes(1, 0, 0, 1))[1])
    print_sections(sections)
    out = capsys.readouterr().out
    assert "model-state memory per rank (rank 0)" in out and "reduce_scatter" in out


def test_monitor_pickles_for_spawned_workers():
    monitor = pickle.loads(pickle.dumps(ZeroMonitor(log_every_n_steps=3, print_summary=False)))
    assert (monitor.log_every_n_steps, monitor.print_summary) == (3, False)


def test_monitor_arguments_are_checked():
    with pytest.raises(ValueError, match="log_every_n_steps must be >= 1, got 0"):
        ZeroMonitor(log_every_n_steps=0)
    with pytest.raises(TypeError, match="log_every_n_steps must be an int"):
        ZeroMonitor(log_every_n_steps=1.5)


# --------------------------------------------------------------------------- any strategy


def test_single_process_run_logs_step_times_and_warns_once(tmp_path):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        logger=CSVLogger(str(tmp_path), name="single", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor := ZeroMonitor(log_every_n_steps=2)],
    )
    with pytest.warns(UserWarning, match="keeps no communication ledger") as record:
        trainer.fit(LitTiny(stack=True))
    assert sum("ZeroMonitor" in str(w.message) for w in record) == 1
    assert monitor.timing is None  # no collective waited
    with open(tmp_path / "single" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("zero/step_time_s")]
    assert [int(r["step"]) for r in rows] == [0, 2]  # every second optimizer step
    assert all(float(r["zero/step_time_max_over_min"]) == 1.0 for r in rows)
    assert not any(k.startswith("zero/mem") and v for r in rows for k, v in r.items())
