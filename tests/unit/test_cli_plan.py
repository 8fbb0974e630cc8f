"""``lightning-zero plan``: tables, JSON, plots and errors, called through ``main([...])``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero.cli import main
from lightning_zero.planning import backward_times_from_flops, recommend_bucket_cap_mb

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TINY_MODEL = """
from torch import nn


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 256)  # 256,000
        self.blocks = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])  # 4 x 65,792
        self.norm = nn.LayerNorm(256)  # 512
        self.head = nn.Linear(256, 1000)  # 257,000
"""
TINY_LAYERS = [257_000, 512, 65_792, 65_792, 65_792, 65_792, 256_000]  # backward order


@pytest.fixture
def tiny_model(tmp_path, monkeypatch):
    (tmp_path / "cli_tiny_model.py").write_text(TINY_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "cli_tiny_model:TinyNet"


def run_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_prints_the_zero_paper_table(capsys):
    assert main(["plan", "--params", "7.5B", "-n", "64", "--memory", "80GB"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "│ 64 " in line and "120" in line)
    assert [cell.strip() for cell in row.strip("│ ").split("│")][:5] == ["64", "120", "31.4", "16.6", "1.88"]
    assert "ZeRO-1, ZeRO-2, ZeRO-3" in row  # fits 80 GB


def test_plan_json_memory_and_traffic(capsys):
    data = run_json(capsys, "--params", "7.5e9", "-n", "64")
    totals = [m["total"] for m in data["memory"]]
    assert totals == pytest.approx([120e9, 31.40625e9, 16.640625e9, 1.875e9])
    assert data["inputs"]["psi"] == 7.5e9 and data["inputs"]["k"] == 12
    zero3 = data["traffic"][3]
    assert zero3["stage"] == 3 and zero3["total"] == pytest.approx(3 * 63 / 64 * 7.5e9 * 2)
    assert zero3["time_s"] is None  # no bandwidth given


def test_plan_counts_stage_3_with_int8_on_the_wire(capsys):
    data = run_json(capsys, "--params", "7.5e9", "-n", "64", "--quantize-weights", "--quantize-grads")
    plain, int8 = data["traffic"][3], data["traffic"][4]
    assert not plain["int8"] and int8["int8"] and int8["stage"] == 3
    per_element = 1 + 4 / 256  # an int8 value, a fp32 scale per block of 256
    assert int8["all_gather"] == pytest.approx(2 * 63 / 64 * 7.5e9 * per_element)
    assert int8["reduce_scatter"] == pytest.approx(63 / 64 * 7.5e9 * per_element)
    only_weights = run_json(
        capsys, "--params", "7.5e9", "-n", "64", "--quantize-weights", "--quantize-block", "64"
    )
    assert only_weights["traffic"][4]["all_gather"] == pytest.approx(2 * 63 / 64 * 7.5e9 * (1 + 4 / 64))
    assert only_weights["traffic"][4]["reduce_scatter"] == plain["reduce_scatter"]  # bf16 gradients, as given


def test_plan_several_world_sizes_and_optimizer(capsys):
    data = run_json(
        capsys, "--params", "70B", "-n", "8", "64", "--optimizer", "sgd_momentum", "--memory", "80GB"
    )
    assert data["inputs"]["k"] == 8 and data["inputs"]["world_sizes"] == [8, 64]
    by_n = {(m["world_size"], m["stage"]): m for m in data["memory"]}
    assert by_n[(64, 3)]["total"] == pytest.approx(12 * 70e9 / 64)  # (2 + 2 + 8) Ψ / N
    assert by_n[(64, 3)]["fits"] and not by_n[(8, 3)]["fits"]  # 105 GB on 8 ranks


def test_plan_threshold_for_a_preset(capsys):
    data = run_json(capsys, "--params", "8B", "-n", "16", "--hardware", "h100-cluster")
    large_n, sixteen = data["threshold"]
    assert large_n["world_size"] is None and large_n["tokens_per_rank"] == pytest.approx(2475)
    assert sixteen["tokens_per_rank"] == pytest.approx(1925)  # two nodes: NVLink is the bottleneck
    assert sixteen["min_global_batch_tokens"] == pytest.approx(16 * 1925)
    assert data["inputs"]["device_memory"] == 80e9  # from the preset
    dp = data["traffic"][0]  # 2 x 15/16 x 16 GB at W = 482 GB/s, + one alpha
    assert dp["time_s"] == pytest.approx(2 * 15 / 16 * 16e9 / sixteen["bandwidth"] + 16e-6)


def test_plan_threshold_with_given_c_and_w_and_moe(capsys):
    data = run_json(
        capsys,
        "--params",
        "1B",
        "--flops",
        "990T",
        "--bandwidth",
        "229GB/s",
        "--experts",
        "256",
        "--top-k",
        "8",
    )
    assert round(data["threshold"][0]["tokens_per_rank"], -3) == 138_000  # 32 x 4300


def test_plan_bucket_sweep_with_a_model(capsys, tiny_model):
    args = [
        "--model",
        tiny_model,
        "-n",
        "8",
        "--flops",
        "1e12",
        "--bandwidth",
        "1e9",
        "--alpha",
        "50us",
        "--tokens-per-rank",
        "512",
        "--bucket-caps",
        "0.01,0.5,1,2,100",
        "--first-bucket-cap-mb",
        "0.25",
    ]
    data = run_json(capsys, *args, "--bucket-sweep")
    assert data["inputs"]["psi"] == sum(TINY_LAYERS) and data["inputs"]["model"] == "TinyNet"
    times = backward_times_from_flops(TINY_LAYERS, tokens_per_rank=512, flops=1e12)
    rec = recommend_bucket_cap_mb(
        TINY_LAYERS,
        times,
        world_size=8,
        bandwidth=1e9,
        alpha=50e-6,
        first_bucket_cap_mb=0.25,
        caps_mb=[0.01, 0.5, 1, 2, 100],
    )
    buckets = data["buckets"]
    assert buckets["recommended_bucket_cap_mb"] == rec.bucket_cap_mb == 0.5
    exposed = [s["exposed_s"] for s in buckets["sweep"]]
    assert exposed[0] > exposed[1] < exposed[-1]  # 6 buckets pay 6 alphas; one big last bucket waits
    assert [s["exposed_s"] for s in buckets["sweep"]] == pytest.approx([s.exposed for s in rec.sweep])
    assert buckets["backward_s"] == pytest.approx(4 * 512 * sum(TINY_LAYERS) / 1e12)
    # the largest cap: [head] (514,000 bytes >= 0.25 MiB) is the first bucket, reduced from 0.53 ms to
    # 1.48 ms; the other 6 layers form the last bucket, ready when backward ends at 1.59 ms
    rest = sum(TINY_LAYERS[1:]) * 2
    assert buckets["sweep"][-1]["exposed_s"] == pytest.approx(50e-6 + 2 * 7 / 8 * rest / 1e9)


def test_plan_batch_table_and_warning(capsys):
    args = [
        "--params",
        "8B",
        "-n",
        "128",
        "512",
        "1024",
        "--global-batch-tokens",
        "4M",
        "--seq-len",
        "4096",
        "--micro-batch",
        "2",
        "--pow2",
    ]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert "grad_acc = 1024 / (2 x 1024) = 0.5 < 1" in out
    data = run_json(capsys, *args)
    assert [(b["dp"], b["micro_batch"], b["grad_acc"]) for b in data["batch"]] == [
        (128, 2, 4),
        (512, 2, 1),
        (1024, 1, 1),
    ]


def test_plan_writes_png_plots(tmp_path, capsys, tiny_model):
    plots = tmp_path / "plots"
    args = [
        "plan",
        "--model",
        tiny_model,
        "-n",
        "8",
        "--hardware",
        "h100",
        "--tokens-per-rank",
        "256",
        "--bucket-sweep",
        "--bucket-caps",
        "0.1,1,10",
        "--plot-dir",
        str(plots),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    for name in ("memory.png", "buckets.png"):
        path = plots / name
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert f"wrote {path}" in out


def test_plan_errors(capsys):
    assert main(["plan", "-n", "8"]) == 2
    assert "--params 7.5B or --model" in capsys.readouterr().err
    assert main(["plan", "--params", "1B", "--bucket-sweep"]) == 2
    assert "--bucket-sweep needs --hardware, or --flops and --bandwidth" in capsys.readouterr().err
    assert main(["plan", "--model", "torch.nn:Linear"]) == 2  # needs arguments
    assert "constructible with no arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--params", "7.5X"])
    assert exit_info.value.code == 2
    assert "cannot read '7.5X'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])  # a subcommand is required


def test_plan_plain_text_without_rich(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails: plain tables
    assert main(["plan", "--params", "7.5B", "-n", "64", "--memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "┃" not in out
    assert "64           120    31.4    16.6    1.88  ZeRO-1, ZeRO-2, ZeRO-3" in out


# The command must answer without the heavy libraries: importing torch and Lightning takes seconds of
# CPU (tens of seconds of wall time on a loaded machine), the planner itself a tenth of a second.
HEAVY = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "numpy", "hydra", "omegaconf")


def imported_modules(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run the installed ``lightning-zero`` console script with ``-X importtime``; its top-level imports."""
    script = Path(sys.executable).with_name("lightning-zero")
    assert script.is_file(), f"{script} is missing: install the package (make install)"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", str(script), *args], capture_output=True, text=True, timeout=120
    )
    lines = [
        line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    ]
    return result, {name.split(".")[0] for name in lines[1:]}  # lines[0] is the header


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--help"], "plan"),
        (["plan", "--help"], "--bucket-sweep"),
        (["plan", "--params", "7.5B", "-n", "64", "--memory", "80GB"], "ZeRO-1, ZeRO-2, ZeRO-3"),
        (["plan", "--params", "70B", "-n", "8", "64", "--hardware", "h100-cluster", "--json"], '"threshold"'),
    ],
    ids=["help", "plan-help", "plan-params", "plan-hardware-json"],
)
def test_command_answers_without_torch_or_lightning(args, expected):
    result, modules = imported_modules(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout
    assert "lightning_zero" in modules and "lightning_zero_cli" in modules
    assert sorted(modules.intersection(HEAVY)) == [], f"lightning-zero {' '.join(args)} imported them"


def test_command_imports_torch_for_a_model_only(tmp_path):
    result, modules = imported_modules("plan", "--model", "torch.nn:Transformer", "-n", "8", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["inputs"]["psi"] == 44_140_544
    assert "torch" in modules


def test_package_imported_by_the_command_loads_its_names_on_use():
    code = (
        "import lightning_zero_cli, sys\n"
        "lightning_zero_cli.DEFER_REGISTRATION = True\n"
        "import lightning_zero\n"
        "lightning_zero_cli.DEFER_REGISTRATION = False\n"
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules\n"
        "print(lightning_zero.ZeroConfig(stage=2).stage, lightning_zero.ZeroStrategy.__name__)\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print('zero2' in StrategyRegistry)\n"
        "import importlib; importlib.reload(lightning_zero)\n"
        "print('zero2' in StrategyRegistry)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["2", "ZeroStrategy", "False", "True"]


def test_plan_secondary_shards_move_the_backward_gathers_into_the_node(capsys):
    """N = 4 over 2 nodes of 2, Ψ = 1e6 in fp32: without secondary shards every collective crosses
    nodes (ReduceScatter 3/4 x 4 MB, two AllGathers 3/4 x 4 MB each: 9 MB); with s = 2 the backward
    AllGather runs inside the node (1/2 x 4 MB = 2 MB intra) and each rank keeps 4 MB / 2 of copies."""
    args = ("--params", "1e6", "-n", "4", "--param-bytes", "4", "--grad-bytes", "4", "--ranks-per-node", "2")
    rows = run_json(capsys, *args, "--secondary-shard-size", "node")["secondary"]
    without, secondary = rows
    assert (without["intra"], without["inter"], without["memory"]) == (0, pytest.approx(9e6), 0)
    assert secondary["secondary_shard_size"] == 2
    assert (secondary["intra"], secondary["inter"]) == (pytest.approx(2e6), pytest.approx(6e6))
    assert secondary["memory"] == pytest.approx(2e6)
    assert main(["plan", *args, "--secondary-shard-size", "3"]) != 0
    assert "must divide N = 4" in capsys.readouterr().err
