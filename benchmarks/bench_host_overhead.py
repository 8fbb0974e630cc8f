"""The strategy's host work per step, without a GPU: one CPU process, a model whose compute is small.

    python benchmarks/bench_host_overhead.py                       # auto, zero0-3; 4 interleaved repeats
    python benchmarks/bench_host_overhead.py --profile --json host.json
    python benchmarks/bench_host_overhead.py --strategies auto,zero3 --repeats 6
    python benchmarks/bench_host_overhead.py --precision bf16-mixed       # the GPU check's precision

With one device there is nobody to shard with, so what a stage adds to Lightning's own
single-device step (``strategy="auto"``) is its machinery alone: hooks, copies, bookkeeping. On a
GPU the same host time delays every kernel launch behind it; this run is the day-to-day proxy
for that cost (docs/benchmarks.md, "Host overhead on one device").

Every variant trains the example GPT at 12 blocks of width 64 (``--model gpt_tiny`` with the
overrides below; a step's compute is a few ms on one core) in a fresh process, variants
interleaved per repeat (``bench_step_time.run_one``). Per variant: the median step time, the paired
ratio to ``auto`` (each run divided by the ``auto`` run of its repeat, median over repeats), the
same ratio of CPU time, and the host microseconds a step adds (median of the paired differences),
also per stage-3 unit or per gradient bucket where the run has them. ``--profile`` adds one run per
variant under cProfile and prints where its package time goes (``_run_one.StepProfile``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_step_time import (  # noqa: E402
    PRECISION_NAMES,
    STRATEGY_NAMES,
    Variant,
    add_run_arguments,
    check_names,
    machine,
    result_payload,
    run_one,
)

MODEL_ARGS = ("n_layer=12", "n_head=4", "n_embd=64", "block_size=32")  # 12 blocks of width 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", default="auto,zero0,zero1,zero2,zero3", help="comma-separated; auto first")
    p.add_argument("--repeats", type=int, default=4, help="runs per variant (interleaved)")
    p.add_argument("--steps", type=int, default=80, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=15, help="first steps of a run left out of its median")
    p.add_argument("--profile", action="store_true", help="also one cProfile run per variant")
    p.add_argument(
        "--precision", default="32-true", choices=PRECISION_NAMES, help="Trainer(precision=) of every run"
    )
    p.add_argument("--json", type=Path, default=None, help="write the summary and every run here")
    add_run_arguments(p)
    p.set_defaults(model="gpt_tiny", batch_size=4, devices=1)
    args = p.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not args.model_arg:
        args.model_arg = list(MODEL_ARGS)
    check_names("--strategies", args.strategies, STRATEGY_NAMES)
    if args.strategies[0] != "auto":
        raise SystemExit(f"--strategies must start with auto (the baseline), got {args.strategies}")
    if args.devices != 1:
        raise SystemExit(
            "--devices must be 1: this measures the machinery alone (bench_step_time.py for N > 1)"
        )
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    return args


def summarize(runs: list[dict[str, Any]], strategies: list[str]) -> list[dict[str, Any]]:
    base = {r["repeat"]: r for r in runs if r["strategy"] == "auto"}
    rows = []
    for strategy in strategies:
        mine = [r for r in runs if r["strategy"] == strategy]
        ratio = [r["median_step_s"] / base[r["repeat"]]["median_step_s"] for r in mine]
        cpu = [r["median_cpu_s"] / base[r["repeat"]]["median_cpu_s"] for r in mine]
        added_us = [(r["median_step_s"] - base[r["repeat"]]["median_step_s"]) * 1e6 for r in mine]
        rank0 = mine[-1]["ranks"][0]
        per = rank0.get("units") or rank0.get("buckets")
        rows.append(
            {
                "strategy": strategy,
                "step_ms": statistics.median(r["median_step_s"] for r in mine) * 1e3,
                "ratio": statistics.median(ratio),
                "ratio_min": min(ratio),
                "ratio_max": max(ratio),
                "cpu_ratio": statistics.median(cpu),
                "added_us": statistics.median(added_us),
                "units": rank0.get("units"),
                "buckets": rank0.get("buckets"),
                "added_us_per_unit_or_bucket": statistics.median(added_us) / per if per else None,
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'variant':<8}{'step ms':>9}{'x auto':>8}{'range':>14}{'CPU x':>8}{'added us':>10}{'per unit/bucket':>17}"
    )
    for r in rows:
        count = f"{r['units']} units" if r["units"] else f"{r['buckets']} buckets" if r["buckets"] else ""
        per = r["added_us_per_unit_or_bucket"]
        per_cell = f"{per:.0f} ({count})" if per is not None else "-"
        print(
            f"{r['strategy']:<8}{r['step_ms']:9.2f}{r['ratio']:8.3f}{r['ratio_min']:7.3f}-{r['ratio_max']:.3f}"
            f"{r['cpu_ratio']:8.3f}{r['added_us']:10.0f}{per_cell:>17}"
        )


def profile(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One cProfile run per variant: milliseconds per step by bucket, and the top package entries."""
    found = {}
    extra = ("--profile-from", str(args.warmup))
    for strategy in args.strategies:
        run_one(Variant(strategy, args.precision), 0, args, workdir, extra)
        path = workdir / f"r0_{strategy}_{args.precision}_profile-from_{args.warmup}.json.profile.json"
        found[strategy] = json.loads(path.read_text())
        buckets = ", ".join(f"{k} {v:.2f}" for k, v in found[strategy]["ms_per_step"].items())
        print(f"{strategy} (cProfile, ms/step): {buckets}")
        for name, ms in found[strategy]["top_package_ms"].items():
            print(f"    {ms:7.3f}  {name}")
    return found


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    setting = machine(args.devices)
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_host_") as tmp:
        for repeat in range(1, args.repeats + 1):
            for strategy in args.strategies:
                record = run_one(Variant(strategy, args.precision), repeat, args, Path(tmp))
                runs.append(record)
                print(
                    f"repeat {repeat}/{args.repeats}  {strategy:<6} median step "
                    f"{record['median_step_s'] * 1e3:7.2f} ms  CPU {record['median_cpu_s'] * 1e3:7.2f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        rows = summarize(runs, args.strategies)
        print_table(rows)
        profiles = profile(args, Path(tmp)) if args.profile else {}
    if args.json is not None:
        args.json.write_text(
            json.dumps(result_payload(args, setting, started, summary=rows, profiles=profiles, runs=runs))
        )
    return rows


if __name__ == "__main__":
    main()
