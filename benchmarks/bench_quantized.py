"""Stage 3 with int8 on the wire against stage 3 in full precision: bytes counted, accuracy, the guard.

    python benchmarks/bench_quantized.py                        # bytes (2 and 4 ranks), accuracy, guard
    python benchmarks/bench_quantized.py --parts bytes          # only the ledger's bytes
    python benchmarks/bench_quantized.py --report benchmarks/results/quantized.json

Every run is one ``_run_one.py`` process (gpt_small, fork, gloo), ``zero3`` or ``zero3-int8``
(``quantize_weights`` and ``quantize_grads``; ``zero3-int8w`` / ``zero3-int8g`` one of them):

- bytes: a few steps at 2 and at 4 ranks, fp32 and bf16-mixed; the ledger's all-gather and
  reduce-scatter payload bytes of the last step, and their ratios (full / int8);
- accuracy: ``--steps`` steps (400) at 2 ranks, fp32 and bf16-mixed, then the validation loss of
  the fitted weights over the held-out split, int8 against full precision;
- guard: the int8 run with outlier weights (3 values of one block's first MLP layer set to 1e4
  times its mean magnitude, ``--outliers``), against the full-precision run with the same weights:
  the units whose guard fell back, and the validation loss;
- spread (not in the default parts): the guard's two runs again from starts perturbed by
  ``--perturb`` (every weight times 1 + eps x N(0, 1)): how far the outlier model's loss moves
  from a tiny change of its start, the noise floor of the guard's comparison.

The step time of int8 against full precision is ``bench_step_time.py --strategies
zero3,zero3-int8 --baseline zero3`` (interleaved); the slowed link is ``bench_hsdp_link.py
--variants full,zeropp``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_ONE = REPO_ROOT / "benchmarks" / "_run_one.py"
PRECISIONS = ("32-true", "bf16-mixed")


def run(strategy: str, precision: str, devices: int, steps: int, out: Path, *extra: str) -> dict[str, Any]:
    command = [sys.executable, str(RUN_ONE), "--strategy", strategy, "--precision", precision]
    command += ["--devices", str(devices), "--steps", str(steps), "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    record = json.loads(out.read_text())
    record["warnings"] = [line for line in done.stderr.splitlines() if "quantized communication" in line]
    return record


def bytes_part(tmp: Path, steps: int) -> list[dict[str, Any]]:
    rows = []
    for devices in (2, 4):
        for precision in PRECISIONS:
            comm = {}
            for strategy in ("zero3", "zero3-int8"):
                record = run(
                    strategy, precision, devices, steps, tmp / f"b_{strategy}_{precision}_{devices}.json"
                )
                comm[strategy] = record["ranks"][0]["last_step_comm"]
            full, int8 = comm["zero3"], comm["zero3-int8"]
            row = {"devices": devices, "precision": precision}
            for op in ("all_gather", "reduce_scatter"):
                row[op] = {
                    "full": full[op],
                    "int8": int8[op],
                    "ratio": full[op]["payload_bytes"] / int8[op]["payload_bytes"],
                }
            rows.append(row)
    return rows


def accuracy_part(tmp: Path, steps: int) -> list[dict[str, Any]]:
    rows = []
    for precision in PRECISIONS:
        losses = {}
        for strategy in ("zero3", "zero3-int8"):
            record = run(strategy, precision, 2, steps, tmp / f"a_{strategy}_{precision}.json", "--validate")
            losses[strategy] = record["val_loss"]
        fallbacks = {k: v for k, v in record["ranks"][0].get("fallbacks", {}).items() if v}  # the int8 run's
        rows.append({"precision": precision, "steps": steps, **losses, "int8_fallbacks": fallbacks})
    return rows


def guard_part(tmp: Path, steps: int) -> dict[str, Any]:
    out = {}
    for strategy in ("zero3", "zero3-int8"):
        record = run(strategy, "32-true", 2, steps, tmp / f"g_{strategy}.json", "--validate", "--outliers")
        out[strategy] = {
            "val_loss": record["val_loss"],
            "fallbacks": {k: v for k, v in record["ranks"][0].get("fallbacks", {}).items() if v},
            "warnings": record["warnings"][:4],
        }
    return out


def spread_part(tmp: Path, steps: int, perturbations: list[float]) -> list[dict[str, Any]]:
    """The guard's runs again with every weight perturbed by a relative ``eps`` before fit (both
    runs alike): how far the outlier model's loss moves from a tiny change of its start, full
    precision and int8 alike, the noise floor against which int8's difference is read."""
    rows = []
    for eps in perturbations:
        row: dict[str, Any] = {"perturb": eps}
        for strategy in ("zero3", "zero3-int8"):
            extra = ("--validate", "--outliers", "--perturb", str(eps))
            record = run(strategy, "32-true", 2, steps, tmp / f"s_{strategy}_{eps}.json", *extra)
            row[strategy] = record["val_loss"]
            row[f"{strategy}_fallbacks"] = {
                k: v for k, v in record["ranks"][0].get("fallbacks", {}).items() if v
            }
        rows.append(row)
    return rows


def report(results: dict[str, Any]) -> str:
    lines = []
    if "bytes" in results:
        lines += ["| ranks | precision | all-gather B/step full | int8 | ratio | reduce-scatter B/step full | int8 | ratio |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in results["bytes"]:
            ag, rs = r["all_gather"], r["reduce_scatter"]
            lines.append(
                f"| {r['devices']} | {r['precision']} | {ag['full']['payload_bytes']:,} | {ag['int8']['payload_bytes']:,} "
                f"| {ag['ratio']:.2f} | {rs['full']['payload_bytes']:,} | {rs['int8']['payload_bytes']:,} | {rs['ratio']:.2f} |"
            )
        lines.append("")
    if "accuracy" in results:
        lines += ["| precision | steps | val loss full | val loss int8 | int8 / full - 1 | guard fallbacks (int8) |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in results["accuracy"]:
            lines.append(
                f"| {r['precision']} | {r['steps']} | {_losses(r)} | {r['int8_fallbacks'] or 'none'} |"
            )
        lines.append("")
    if "guard" in results:
        g = results["guard"]
        rel = g["zero3-int8"]["val_loss"] / g["zero3"]["val_loss"] - 1
        lines += [
            "| outlier weights | val loss | fallbacks |",
            "|---|---|---|",
            f"| full precision | {g['zero3']['val_loss']:.4f} | - |",
            f"| int8, guarded | {g['zero3-int8']['val_loss']:.4f} ({rel:+.2%}) | {g['zero3-int8']['fallbacks']} |",
            "",
        ]
    if "spread" in results:
        lines += ["| outlier weights, start perturbed by | val loss full | val loss int8 | int8 / full - 1 | int8 fallbacks |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in results["spread"]:
            lines.append(f"| {r['perturb']:g} | {_losses(r)} | {r['zero3-int8_fallbacks']} |")
        guarded = results.get("guard", {})  # the unperturbed start, when it ran too
        full, int8 = (
            [r[k] for r in results["spread"]] + ([guarded[k]["val_loss"]] if guarded else [])
            for k in ("zero3", "zero3-int8")
        )
        lines.append("")
        lines.append(
            f"full precision over {len(full)} starts: {min(full):.4f} to {max(full):.4f} "
            f"(mean {statistics.mean(full):.4f}, range {max(full) / min(full) - 1:.2%}); "
            f"int8 over {len(int8)}: {min(int8):.4f} to {max(int8):.4f} (mean {statistics.mean(int8):.4f}); "
            f"int8 mean / full mean - 1: {statistics.mean(int8) / statistics.mean(full) - 1:+.2%}"
        )
    return "\n".join(lines)


def _losses(row: dict[str, Any]) -> str:
    """The cells: full precision's loss, int8's, and int8's relative difference."""
    full, int8 = row["zero3"], row["zero3-int8"]
    return f"{full:.4f} | {int8:.4f} | {int8 / full - 1:+.2%}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--parts", default="bytes,accuracy,guard", help="comma-separated: bytes, accuracy, guard, spread"
    )
    p.add_argument(
        "--perturb",
        default="1e-5,1e-4,1e-3",
        help="spread: relative perturbations of the start, comma-separated (one full and one int8 run each)",
    )
    p.add_argument("--steps", type=int, default=400, help="optimizer steps of the accuracy and guard runs")
    p.add_argument("--bytes-steps", type=int, default=4, help="optimizer steps of the bytes runs")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--report", type=Path, default=None, help="print the tables of a --json file; run nothing")
    args = p.parse_args(argv)
    if args.report is not None:
        print(report(json.loads(args.report.read_text())["results"]))
        return
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = set(parts) - {"bytes", "accuracy", "guard", "spread"}
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; known: bytes, accuracy, guard, spread")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_quantized_") as tmp:
        if "bytes" in parts:
            results["bytes"] = bytes_part(Path(tmp), args.bytes_steps)
        if "accuracy" in parts:
            results["accuracy"] = accuracy_part(Path(tmp), args.steps)
        if "guard" in parts:
            results["guard"] = guard_part(Path(tmp), args.steps)
        if "spread" in parts:
            eps = [float(x) for x in args.perturb.split(",") if x.strip()]
            results["spread"] = spread_part(Path(tmp), args.steps, eps)
    print(report(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"argv": argv or sys.argv[1:], "results": results}, indent=1))


if __name__ == "__main__":
    main()
