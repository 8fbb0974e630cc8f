"""Peak memory of every phase of a big-model run: zero3 (built on the meta device) against zero0.

A stack of MLP blocks (``tests/bigmodel/lit.py``), AdamW in fp32, 2 CPU ranks: setup (the model
built in ``configure_model`` and sharded), the steps, a full and a sharded checkpoint saved after
fit, a resume from the full one, and the teardown; for each, the peak resident memory per rank
above the process's start, beside 16Ψ/N. ``--adapters R`` freezes the base and trains rank-R
adapters instead (the fine-tuning case).

    python benchmarks/bench_big_model.py --width 1024 --blocks 24            # 201M parameters
    python benchmarks/bench_big_model.py --width 1024 --blocks 24 --adapters 16

``--whole-run ddp,zero0,zero1,zero2,zero3`` measures instead the run a user makes (the fit, one full
save, the end of the Trainer) with each strategy as given, Lightning's ``ddp`` included, every
option at its default: the whole-run peak per rank above the process's start against the formulas
(16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N in fp32), and each stage's saving against ``ddp``'s.

    python benchmarks/bench_big_model.py --width 1024 --blocks 12 --whole-run ddp,zero0,zero1,zero2,zero3
    python benchmarks/bench_big_model.py --width 1024 --blocks 12 --adapters 16 --whole-run ddp,zero3
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: `tests` importable

import torch  # noqa: E402

from tests.bigmodel.lit import (  # noqa: E402
    BigModule,
    Phases,
    Shape,
    psi,
    quiet_trainer,
    reset_peak,
    rss_mb,
    zero_strategy,
)
from tests.bigmodel.test_stage3_big import run_phases  # noqa: E402
from tests.matrix.runner import run_jobs  # noqa: E402

# model state per rank in fp32 AdamW, in units of Ψ bytes, at N ranks (frozen weights: 4 bytes each,
# sharded at stage 3 only)
FORMULAS = {
    "ddp": lambda n: 16.0,
    "zero0": lambda n: 16.0,
    "zero1": lambda n: 8 + 8 / n,
    "zero2": lambda n: 4 + 12 / n,
    "zero3": lambda n: 16 / n,
}


def measure(shape: Shape, stage: int, world: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        shared = Path(folder) / "shared"
        shared.mkdir()
        job = functools.partial(run_phases, shape, stage, str(shared))
        ranks = run_jobs([job], str(Path(folder) / "ranks"), world=world, timeout=3600)
    return {phase: max(r[0][phase] for r in ranks) for phase in ranks[0][0]}


def run_user(strategy: str, shape: Shape, shared: str, root: str) -> dict:
    """One rank of the run a user makes: ``strategy`` ("ddp" or "zeroK") with its defaults (stage
    3 with ``Block`` units), the fit, one full save, the Trainer dropped; peak MiB above the
    process's start per phase."""
    torch.set_num_threads(1)
    reset_peak()
    phases = Phases(baseline=rss_mb())
    torch.manual_seed(0)
    chosen = "ddp" if strategy == "ddp" else zero_strategy(int(strategy.removeprefix("zero")))
    trainer = quiet_trainer(chosen, root, callbacks=[phases])
    trainer.fit(BigModule(shape))
    trainer.save_checkpoint(os.path.join(shared, f"{strategy}.ckpt"))
    phases.measure("save full")
    del trainer
    gc.collect()
    phases.measure("teardown")
    return phases.peaks


def measure_user(shape: Shape, strategy: str, world: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        shared = Path(folder) / "shared"
        shared.mkdir()
        job = functools.partial(run_user, strategy, shape, str(shared))
        ranks = run_jobs([job], str(Path(folder) / "ranks"), world=world, timeout=3600)
    return {"phases": [r[0] for r in ranks], "whole_run": [max(r[0].values()) for r in ranks]}


def user_table(shape: Shape, world: int, results: dict) -> str:
    """Whole-run peaks against the formulas, and each strategy's saving against ddp's."""
    trainable, frozen = psi(shape)
    mb = 2**20
    weights = 4 * (trainable + frozen) / mb

    def formula(name: str) -> float:
        sharded_frozen = 4 * frozen / (world if name == "zero3" else 1)
        return (FORMULAS[name](world) * trainable + sharded_frozen) / mb

    lines = [
        f"Ψ = {trainable / 1e6:.1f}M trainable + {frozen / 1e6:.1f}M frozen, N = {world}, fp32 AdamW; "
        f"full fp32 weights {weights:.0f} MiB",
        "",
        "| strategy | whole-run peak, rank 0 / 1 (MiB) | formula (MiB) | peak / formula | peak / fp32 weights "
        "| saving vs ddp (measured / theory) |",
        "|---|---|---|---|---|---|",
    ]
    ddp = max(results["ddp"]["whole_run"]) if "ddp" in results else None
    for name, result in results.items():
        peak = max(result["whole_run"])
        saving = "-"
        if ddp is not None and name != "ddp":
            theory = formula("ddp") - formula(name)
            saving = f"{ddp - peak:.0f} / {theory:.0f} ({(ddp - peak) / theory:.0%})" if theory else "-"
        lines.append(
            f"| {name} | {' / '.join(f'{v:.0f}' for v in result['whole_run'])} | {formula(name):.0f} "
            f"| {peak / formula(name):.2f} | {peak / weights:.2f} | {saving} |"
        )
    return "\n".join(lines)


def table(shape: Shape, world: int, results: dict) -> str:
    trainable, frozen = psi(shape)
    mb = 2**20
    lines = [
        f"Ψ = {trainable / 1e6:.1f}M trainable + {frozen / 1e6:.1f}M frozen, N = {world}: "
        f"16Ψ/N = {16 * trainable / world / mb:.0f} MB (+ frozen 4Ψ_f/N = {4 * frozen / world / mb:.0f} MB), "
        f"16Ψ = {16 * trainable / mb:.0f} MB (+ {4 * frozen / mb:.0f} MB)",
        "",
        "| phase | " + " | ".join(f"zero{s} peak (MB)" for s in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for phase in next(iter(results.values())):
        lines.append(f"| {phase} | " + " | ".join(f"{results[s][phase]:.0f}" for s in results) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--adapters", type=int, default=0)
    parser.add_argument("--stages", default="3,0")
    parser.add_argument("--whole-run", default="", help="strategies of the user's run, e.g. ddp,zero3")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    shape = Shape(width=args.width, blocks=args.blocks, tokens=8, adapters=args.adapters, micro_batches=2)
    if args.whole_run:
        results = {name: measure_user(shape, name, 2) for name in args.whole_run.split(",")}
        print(user_table(shape, 2, results))
        if args.out is not None:
            args.out.write_text(json.dumps({"shape": shape._asdict(), "whole_run": results}, indent=2))
        return
    results = {int(s): measure(shape, int(s), 2) for s in args.stages.split(",")}
    print(table(shape, 2, results))
    if args.out is not None:
        args.out.write_text(json.dumps({"shape": shape._asdict(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
