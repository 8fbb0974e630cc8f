"""Peak GPU memory per rank of every stage against the formulas (part of ``make gpu-check``).

    python benchmarks/bench_gpu_memory.py                              # zero0-3, 2 ranks, fp32 AdamW
    python benchmarks/bench_gpu_memory.py --width 2048 --blocks 8 --out-dir benchmarks/results

Two ranks: on two GPUs over NCCL when the machine has two, else both on ``cuda:0`` over gloo (each
process has its own caching allocator, so its figures are its own; a stage whose collectives gloo
cannot run on CUDA tensors is reported as skipped, with gloo's reason). For each stage, in fresh
processes, each rank builds the MLP stack of ``tests/bigmodel`` (``--blocks`` blocks of width
``--width``) on its device, takes rank 0's values, sets up the stage's engine (stage 3 with one
unit per block) and trains ``--steps`` steps of fp32 AdamW on 8 rows per step, so that activations
are small beside the model state. It reports, above what the process held before the model
existed: the peak of ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` during setup
(where stage 3 still builds the whole model before sharding it) and during the steps, against the
model state of the formulas in fp32: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N.

Without a CUDA device it says so and exits with status 0 (``make gpu-check`` passes on a CPU
machine). See docs/benchmarks.md, "GPU check".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: `tests` importable

import torch  # noqa: E402

from lightning_zero.comm import Communicator  # noqa: E402
from lightning_zero.config import ZeroConfig  # noqa: E402
from lightning_zero.engines import make_engine  # noqa: E402
from lightning_zero.grad_sync import broadcast_module_states  # noqa: E402
from tests.bigmodel.lit import Net, Shape, psi  # noqa: E402
from tests.gpu.harness import run_on  # noqa: E402
from tests.gpu.training import STAGE_OPS, probe_ops  # noqa: E402

STAGES = (0, 1, 2, 3)
ROWS = 8  # rows per step and rank
MIB = 2**20
FORMULAS = {0: lambda n: 16.0, 1: lambda n: 8 + 8 / n, 2: lambda n: 4 + 12 / n, 3: lambda n: 16 / n}


def _peaks(device: torch.device, allocated: int, reserved: int) -> dict[str, float]:
    torch.cuda.synchronize(device)
    return {
        "allocated_mib": (torch.cuda.max_memory_allocated(device) - allocated) / MIB,
        "reserved_mib": (torch.cuda.max_memory_reserved(device) - reserved) / MIB,
    }


def measure_stage(
    rank: int, world: int, device: torch.device, shape: dict, stage: int, steps: int
) -> dict[str, Any]:
    """One rank: setup and steps of ``stage`` on ``device``; peaks above the start, in MiB."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    torch.manual_seed(100 + rank)  # ranks start apart: the broadcast aligns them
    model = Net(Shape(**shape)).to(device)
    comm = Communicator()
    broadcast_module_states(model, comm, label="bench")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"wrap_policy": "tests.bigmodel.lit.Block"} if stage == 3 else {}
    engine = make_engine(ZeroConfig(stage=stage, **options), comm)
    wrapped = engine.setup(model, [optimizer], device=device)
    setup = _peaks(device, allocated, reserved)
    torch.cuda.reset_peak_memory_stats(device)
    g = torch.Generator().manual_seed(5 + rank)
    for step in range(steps):
        comm.ledger.begin_step(step)
        x = torch.randn(ROWS, shape["width"], generator=g).to(device)
        y = torch.randn(ROWS, generator=g).to(device)
        wrapped(x, y).backward()
        optimizer.step()
        engine.after_step(optimizer, 0)
        optimizer.zero_grad()
    return {"setup": setup, "steps": _peaks(device, allocated, reserved)}


def placement() -> tuple[list[str], str] | None:
    """The ranks' devices and the backend, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    if torch.cuda.device_count() >= 2 and torch.distributed.is_nccl_available():
        return ["cuda:0", "cuda:1"], "nccl"
    return ["cuda:0", "cuda:0"], "gloo"


def unsupported_stages(devices: list[str], backend: str, folder: Path) -> dict[int, str]:
    """Stages whose collectives the backend cannot run on CUDA tensors (gloo), with the reason."""
    if backend != "gloo":
        return {}
    ranks = run_on(probe_ops, devices, backend, folder / "probe")
    errors = {op: next((r[op] for r in ranks if r[op] is not None), None) for op in ranks[0]}
    skipped = {}
    for stage in STAGES:
        failed = [f"{op}: {errors[op]}" for op in STAGE_OPS[stage] if errors[op] is not None]
        if failed:
            skipped[stage] = "; ".join(failed)
    return skipped


def table(shape: dict, devices: list[str], backend: str, results: dict, skipped: dict) -> str:
    trainable, _ = psi(Shape(**shape))
    n = len(devices)
    lines = [
        f"Ψ = {trainable / 1e6:.1f}M (fp32 AdamW), N = {n} on {', '.join(devices)} over {backend}; "
        f"{torch.cuda.get_device_name(0)}; peaks per rank above the process's start, MiB (largest rank)",
        "",
        "| stage | formula | steps: allocated | steps: reserved | allocated / formula | setup: allocated | "
        "setup: reserved |",
        "|---|---|---|---|---|---|---|",
    ]
    for stage in STAGES:
        formula = FORMULAS[stage](n) * trainable / MIB  # FORMULAS: bytes per parameter
        if stage in skipped:
            lines.append(f"| zero{stage} | {formula:.0f} | skipped: {skipped[stage]} | | | | |")
            continue
        ranks = results[stage]
        steps_alloc = max(r["steps"]["allocated_mib"] for r in ranks)
        steps_reserved = max(r["steps"]["reserved_mib"] for r in ranks)
        setup_alloc = max(r["setup"]["allocated_mib"] for r in ranks)
        setup_reserved = max(r["setup"]["reserved_mib"] for r in ranks)
        lines.append(
            f"| zero{stage} | {formula:.0f} | {steps_alloc:.0f} | {steps_reserved:.0f} | "
            f"{steps_alloc / formula:.2f} | {setup_alloc:.0f} | {setup_reserved:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=None, help="also write gpu_memory.json and .md here")
    args = parser.parse_args()
    where = placement()
    if where is None:
        print("bench_gpu_memory: no CUDA device here; nothing measured (the GPU check runs where one is)")
        return
    devices, backend = where
    shape = {"width": args.width, "blocks": args.blocks, "tokens": ROWS}
    with tempfile.TemporaryDirectory() as folder:
        skipped = unsupported_stages(devices, backend, Path(folder))
        results = {
            stage: run_on(
                measure_stage, devices, backend, Path(folder) / f"zero{stage}", shape, stage, args.steps
            )
            for stage in STAGES
            if stage not in skipped
        }
    report = table(shape, devices, backend, results, skipped)
    print(report)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "shape": shape,
            "devices": devices,
            "backend": backend,
            "results": results,
            "skipped": skipped,
        }
        (args.out_dir / "gpu_memory.json").write_text(json.dumps(record, indent=2))
        (args.out_dir / "gpu_memory.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
