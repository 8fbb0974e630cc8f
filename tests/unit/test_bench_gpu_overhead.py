"""benchmarks/bench_gpu_overhead.py without a GPU: its peak table, FLOPs, ratios, and that it
exits cleanly where there is no CUDA device (``make gpu-check`` on a CPU machine)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_gpu_overhead as bench


def test_peak_table_takes_the_most_specific_name_and_an_override():
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3", None) == (989.0, "table: H100")
    assert bench.peak_tflops("NVIDIA H100 PCIe", None) == (756.0, "table: H100 PCIe")
    assert bench.peak_tflops("NVIDIA L40S", None) == (362.0, "table: L40S")
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB", None)[0] == 312.0
    assert bench.peak_tflops("Tesla T4", None) == (None, "unknown for 'Tesla T4': pass --peak-tflops")
    assert bench.peak_tflops("Tesla T4", 65.0) == (65.0, "--peak-tflops")


def test_flops_per_token_and_mfu():
    assert bench.flops_per_token(1000, 2, 8, 16) == 6 * 1000 + 12 * 2 * 8 * 16
    runs = [
        {"variant": v, "repeat": r, "median_step_s": s}
        for r, (auto, zero) in enumerate([(0.010, 0.0101), (0.020, 0.0206)], start=1)
        for v, s in (("auto", auto), ("zero2", zero))
    ]
    auto, zero2 = bench.summarize(runs, ["auto", "zero2"], tokens=1000, flops=1e9, peak=100.0)
    assert auto.paired == 1.0 and zero2.step_ms == pytest.approx(15.35)
    assert (zero2.paired_min, zero2.paired_max) == (pytest.approx(1.01), pytest.approx(1.03))
    assert zero2.paired == pytest.approx(1.02)  # the median of the per-repeat ratios
    assert auto.mfu == pytest.approx(1e9 * 1000 / 0.015 / 100e12)
    assert "| zero2 | 15.35 |" in bench.table([auto, zero2])
    assert "| met |" in bench.table([zero2._replace(paired=1.01)])
    assert "| **not met** |" in bench.table([zero2._replace(paired=1.05)])
    assert bench.summarize(runs, ["zero2"], tokens=1000, flops=1e9, peak=None)[0].mfu is None


def test_arguments_are_checked():
    with pytest.raises(SystemExit, match="unknown"):
        bench.parse_args(["--models", "gpt_huge"])
    with pytest.raises(SystemExit, match="--stages"):
        bench.parse_args(["--stages", "4"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run")
def test_without_cuda_it_says_so_and_exits_0(capsys, tmp_path):
    assert bench.main(["--out-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == bench.NO_GPU
    assert list(tmp_path.iterdir()) == []  # no result files without measurements


def test_a_budget_runs_the_repeats_that_fit_and_says_how_many(monkeypatch):
    """``--budget-s`` (``make gpu-check``'s default): a repeat starts only if it would end within the
    budget by the longest repeat so far; the first always runs; the report names what was left."""
    now = [0.0]
    seconds = {"gpt_small": 10.0, "gpt_10m": 15.0}  # each run of a variant, by model

    def fake_run(variant, model, repeat, args, workdir):
        now[0] += seconds[model]
        cfg = {"n_layer": 2, "n_embd": 8, "block_size": 16}
        return {"variant": variant, "model": model, "repeat": repeat, "config": cfg, "num_parameters": 100,
                "median_step_s": 0.01, "wall_s": seconds[model]}  # fmt: skip

    monkeypatch.setattr(bench, "run_one", fake_run)
    monkeypatch.setattr(bench, "machine", lambda: {"gpu": "NVIDIA H100", "torch": "t", "cuda": "c"})
    # two variants: a repeat of gpt_small takes 20 s, of gpt_10m 30 s
    args = bench.parse_args(
        ["--models", "gpt_small,gpt_10m", "--stages", "0", "--repeats", "3", "--budget-s", "50"]
    )
    payload = bench.measure(args, clock=lambda: now[0])
    assert payload["models"]["gpt_small"]["repeats_done"] == 2  # a third would end at 60 s
    assert payload["models"]["gpt_10m"]["repeats_done"] == 0  # 40 s gone, 20 s more estimated: 60
    assert "gpt_small: 2 of 3 repeats fitted in --budget-s 50" in payload["report"]
    assert "gpt_10m: 0 of 3 repeats" in payload["report"]
    assert len(payload["runs"]) == 4 and "rows" not in payload["models"]["gpt_10m"]
    everything = bench.measure(bench.parse_args(["--models", "gpt_small", "--stages", "0", "--repeats", "3"]),
                               clock=lambda: now[0])  # fmt: skip
    assert everything["models"]["gpt_small"]["repeats_done"] == 3 and "fitted" not in everything["report"]
    with pytest.raises(SystemExit, match="--budget-s"):
        bench.parse_args(["--budget-s", "0"])
