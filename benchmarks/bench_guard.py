"""What the desync guard costs: step time with it on and off, and resident memory over a long run.

    python benchmarks/bench_guard.py step-time                 # zero0-3, guard on vs off, gpt_small
    python benchmarks/bench_guard.py step-time --repeats 6 --json guard_steps.json
    python benchmarks/bench_guard.py rss                       # zero2 vs ddp, 3000 steps of gpt_tiny
    python benchmarks/bench_guard.py rss --strategies zero2,zero3,ddp --steps 3000
    python benchmarks/bench_guard.py host                      # the guard's host time per step, counted

``step-time``: for each repeat and each stage, one run with the guard on (as shipped) and one with
it off (``_run_one.py --guard off``: no digest of the collectives, no agreement after each batch;
see ``guard_off`` there), back to back, so each pair shares the machine's load of the moment. The
figure per stage is the median over repeats of off/on's paired ratio of median step times, beside
the same ratio of CPU time per step (rank 0, all threads), which the load of other jobs moves less.

``rss``: each strategy trains ``--steps`` optimizer steps of a tiny model (fresh processes,
strategies interleaved per repeat); every rank samples its resident set size every
``--rss-every`` steps. The growth is the least-squares slope of RSS over steps after
``--settle`` steps (allocator pools and caches filled), in KiB per step, per rank; the figure is
each strategy's slope minus the reference's (``--reference``, default ddp), median over repeats.

``host``: what the guard costs on the host, counted rather than timed against a noisy step: the
microseconds one collective's fold into the digest adds (in-process, best of five runs of
``FOLDS`` calls), the median microseconds of one agreement between two gloo processes (after a
warm-up; the agreement also carries the signals and the last-batch flag, and stands in for
Lightning's own per-batch broadcast), and the collectives per step of each stage on ``--model``
(one short 2-rank run each, from the ledger). The guard's time per step is then
``collectives x fold + one agreement``, set beside the measured step time.

Results and what they mean: docs/benchmarks.md, "The desync guard".
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
    STRATEGY_NAMES,
    Variant,
    add_run_arguments,
    check_names,
    machine,
    result_payload,
    run_one,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("step-time", "rss", "host"))
    p.add_argument("--strategies", default=None, help="step-time: zero0,zero1,zero2,zero3; rss: zero2,ddp")
    p.add_argument(
        "--reference", default="ddp", help="rss: the strategy whose growth the others are compared to"
    )
    p.add_argument("--repeats", type=int, default=None, help="step-time: 4; rss: 2")
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per run (step-time: 30; rss: 3000)"
    )
    p.add_argument("--warmup", type=int, default=8, help="step-time: first steps left out of a run's median")
    p.add_argument("--rss-every", type=int, default=100, help="rss: sample every this many steps")
    p.add_argument("--settle", type=int, default=500, help="rss: steps before the slope is fitted")
    p.add_argument("--json", type=Path, default=None, help="write the summary and every run here")
    add_run_arguments(p)
    args = p.parse_args(argv)
    step_time = args.what in ("step-time", "host")
    args.strategies = [
        s.strip()
        for s in (args.strategies or ("zero0,zero1,zero2,zero3" if step_time else "zero2,ddp")).split(",")
    ]
    args.repeats = args.repeats or (4 if step_time else 2)
    args.steps = args.steps or (30 if step_time else 3000)
    if not step_time and args.model == "gpt_small" and "--model" not in (argv or sys.argv):
        args.model = "gpt_tiny"
    check_names("--strategies", args.strategies, STRATEGY_NAMES)
    if step_time and any(not s.startswith("zero") for s in args.strategies):
        raise SystemExit(f"step-time compares a ZeroStrategy with itself: --strategies {args.strategies}")
    if not step_time and args.reference not in args.strategies:
        raise SystemExit(f"--reference {args.reference!r} must be one of --strategies {args.strategies}")
    if args.start_method != "fork":
        raise SystemExit("--guard off is applied before the ranks fork: --start-method must be fork")
    if step_time and not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if not step_time and not 0 <= args.settle < args.steps - 2 * args.rss_every:
        raise SystemExit(f"--settle must leave at least 3 samples before --steps {args.steps}")
    return args


def step_time(args: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    runs = []
    for repeat in range(1, args.repeats + 1):
        for strategy in args.strategies:
            for guard in ("on", "off"):
                record = run_one(Variant(strategy), repeat, args, workdir, ("--guard", guard))
                runs.append(record)
                print(
                    f"repeat {repeat}/{args.repeats}  {strategy} guard {guard:<3}  median step "
                    f"{record['median_step_s'] * 1e3:7.2f} ms  CPU {record['median_cpu_s'] * 1e3:7.2f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    rows = []
    for strategy in args.strategies:
        pairs = [
            (on, off)
            for on in runs
            for off in runs
            if on["strategy"] == off["strategy"] == strategy
            and on["repeat"] == off["repeat"]
            and (on["guard"], off["guard"]) == ("on", "off")
        ]
        wall = [on["median_step_s"] / off["median_step_s"] for on, off in pairs]
        cpu = [on["median_cpu_s"] / off["median_cpu_s"] for on, off in pairs]
        rows.append(
            {
                "strategy": strategy,
                "on_ms": statistics.median(on["median_step_s"] for on, _ in pairs) * 1e3,
                "off_ms": statistics.median(off["median_step_s"] for _, off in pairs) * 1e3,
                "on_over_off": statistics.median(wall),
                "on_over_off_min": min(wall),
                "on_over_off_max": max(wall),
                "cpu_on_over_off": statistics.median(cpu),
            }
        )
    print(f"{'stage':<7}{'on ms':>9}{'off ms':>9}{'on/off':>9}{'range':>16}{'CPU on/off':>12}")
    for r in rows:
        print(
            f"{r['strategy']:<7}{r['on_ms']:9.2f}{r['off_ms']:9.2f}{r['on_over_off']:9.3f}"
            f"{r['on_over_off_min']:8.3f}-{r['on_over_off_max']:.3f}{r['cpu_on_over_off']:12.3f}"
        )
    return rows, runs


def host(args: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    fold_us = digest_cost_us()
    agree_us = agreement_cost_us(workdir)
    print(
        f"one collective folded into the digest: {fold_us:.3f} us; one agreement (2 gloo ranks): {agree_us:.0f} us"
    )
    rows, runs = [], []
    for strategy in args.strategies:
        record = run_one(Variant(strategy), 1, args, workdir)
        runs.append(record)
        calls = sum(op["calls"] for op in record["ranks"][0]["last_step_comm"].values())
        guard_us = calls * fold_us + agree_us
        step_us = record["median_step_s"] * 1e6
        rows.append(
            {
                "strategy": strategy,
                "collectives_per_step": calls,
                "fold_us": fold_us,
                "agreement_us": agree_us,
                "guard_us_per_step": guard_us,
                "step_ms": step_us / 1e3,
                "guard_share": guard_us / step_us,
            }
        )
    print(f"{'stage':<7}{'colls/step':>11}{'guard us/step':>15}{'step ms':>10}{'share':>9}")
    for r in rows:
        print(
            f"{r['strategy']:<7}{r['collectives_per_step']:11d}{r['guard_us_per_step']:15.1f}"
            f"{r['step_ms']:10.1f}{r['guard_share'] * 100:8.3f}%"
        )
    return rows, runs


AGREEMENTS = 2000  # timed per rank, after 100 to warm up


def agreement_cost_us(workdir: Path) -> float:
    """Median microseconds of one agreement (``Communicator.agree``) between two gloo processes."""
    from tests.distributed.fault_harness import run_ranks

    outcomes = run_ranks(_time_agreements, 2, workdir, AGREEMENTS, timeout=300)
    if any(o.result is None for o in outcomes):
        raise SystemExit(f"the agreement timing failed: {outcomes}")
    return max(float(o.result) for o in outcomes)


def _time_agreements(rank: int, world_size: int, count: int) -> float:
    import torch

    from lightning_zero.comm import Communicator

    comm = Communicator()
    comm.watch_faults(fault_wait_s=2.0)
    cpu = torch.device("cpu")
    for _ in range(100):
        comm.agree(0, name="bench/agree/batch", device=cpu)
    times = []
    for _ in range(count):
        start = time.perf_counter()
        comm.agree(0, name="bench/agree/batch", device=cpu)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


FOLDS = 200_000  # tracker.issue calls timed per variant


def digest_cost_us() -> float:
    """Microseconds one collective's fold into the digest adds to ``CollectiveTracker.issue``: the
    shipped ``issue`` against ``_run_one.guard_off``'s, best of five runs of FOLDS calls each."""
    import timeit

    from benchmarks import _run_one
    from lightning_zero import signals
    from lightning_zero.comm import tracker

    shipped = tracker.CollectiveTracker.issue, signals._StopAtStepEnd.on_train_batch_end
    names = [f"zero2/reduce_scatter/bucket={b}" for b in range(8)]

    def per_call() -> float:
        t = tracker.CollectiveTracker()
        calls = [(names[i % 8], 4096 * (i % 8)) for i in range(FOLDS)]

        def run() -> None:
            for name, nbytes in calls:
                t.issue("reduce_scatter", name, nbytes)
                if len(t.since) >= 64:
                    t.agreed()

        return min(timeit.repeat(run, number=1, repeat=5)) / FOLDS

    with_digest = per_call()
    _run_one.guard_off()
    try:
        without = per_call()
    finally:
        tracker.CollectiveTracker.issue, signals._StopAtStepEnd.on_train_batch_end = shipped
    return max(0.0, with_digest - without) * 1e6


def slope(samples: list[tuple[int, int]], settle: int) -> float:
    """Least-squares KiB per step of ``(step, rss_kib)`` samples from ``settle`` on."""
    points = [(s, r) for s, r in samples if s >= settle]
    if len(points) < 3:
        raise SystemExit(f"too few RSS samples after step {settle}: {samples}")
    mean_s = statistics.fmean(s for s, _ in points)
    mean_r = statistics.fmean(r for _, r in points)
    cov = sum((s - mean_s) * (r - mean_r) for s, r in points)
    return cov / sum((s - mean_s) ** 2 for s, _ in points)


def rss(args: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    runs = []
    extra = ("--rss-every", str(args.rss_every))
    for repeat in range(1, args.repeats + 1):
        for strategy in args.strategies:
            record = run_one(Variant(strategy), repeat, args, workdir, extra)
            record["slopes_kib_per_step"] = [slope(rank["rss_kib"], args.settle) for rank in record["ranks"]]
            runs.append(record)
            print(
                f"repeat {repeat}/{args.repeats}  {strategy:<6} RSS growth per rank "
                + ", ".join(f"{g:.3f}" for g in record["slopes_kib_per_step"])
                + f" KiB/step  ({record['wall_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    rows = []
    for strategy in args.strategies:
        mine = [r for r in runs if r["strategy"] == strategy]
        ref = {r["repeat"]: r for r in runs if r["strategy"] == args.reference}
        growth = [max(r["slopes_kib_per_step"]) for r in mine]
        over = [max(r["slopes_kib_per_step"]) - max(ref[r["repeat"]]["slopes_kib_per_step"]) for r in mine]
        rows.append(
            {
                "strategy": strategy,
                "growth_kib_per_step": statistics.median(growth),
                "over_reference": statistics.median(over),
                "over_reference_max": max(over),
                "end_rss_mib": statistics.median(r["ranks"][0]["rss_kib"][-1][1] for r in mine) / 1024,
            }
        )
    print(
        f"steps {args.steps}, slope after step {args.settle}, the larger rank's; reference {args.reference}"
    )
    print(f"{'strategy':<9}{'KiB/step':>10}{'over ref':>10}{'max over':>10}{'end RSS MiB':>13}")
    for r in rows:
        print(
            f"{r['strategy']:<9}{r['growth_kib_per_step']:10.3f}{r['over_reference']:10.3f}"
            f"{r['over_reference_max']:10.3f}{r['end_rss_mib']:13.1f}"
        )
    return rows, runs


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    setting = machine(args.devices)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_guard_") as tmp:
        measure = {"step-time": step_time, "rss": rss, "host": host}[args.what]
        rows, runs = measure(args, Path(tmp))
    if args.json is not None:
        args.json.write_text(json.dumps(result_payload(args, setting, started, summary=rows, runs=runs)))
    return rows


if __name__ == "__main__":
    main()
