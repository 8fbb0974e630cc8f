"""Peak memory of every phase of a big-model run: zero3 (built on the meta device) against zero0.

A stack of MLP blocks (``tests/bigmodel/lit.py``), AdamW in fp32, 2 CPU ranks: setup (the model
built in ``configure_model`` and sharded), the steps, a full and a sharded checkpoint saved after
fit, a resume from the full one, and the teardown; for each, the peak resident memory per rank
above the process's start, beside 16Ψ/N. ``--adapters R`` freezes the base and trains rank-R
adapters instead (the fine-tuning case).

    python benchmarks/bench_big_model.py --width 1024 --blocks 24            # 201M parameters
    python benchmarks/bench_big_model.py --width 1024 --blocks 24 --adapters 16
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from pathlib import Path

from tests.bigmodel.lit import Shape, psi
from tests.bigmodel.test_stage3_big import run_phases
from tests.matrix.runner import run_jobs


def measure(shape: Shape, stage: int, world: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        shared = Path(folder) / "shared"
        shared.mkdir()
        job = functools.partial(run_phases, shape, stage, str(shared))
        ranks = run_jobs([job], str(Path(folder) / "ranks"), world=world, timeout=3600)
    return {phase: max(r[0][phase] for r in ranks) for phase in ranks[0][0]}


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
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    shape = Shape(width=args.width, blocks=args.blocks, tokens=8, adapters=args.adapters, micro_batches=2)
    results = {int(s): measure(shape, int(s), 2) for s in args.stages.split(",")}
    print(table(shape, 2, results))
    if args.out is not None:
        args.out.write_text(json.dumps({"shape": shape._asdict(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
