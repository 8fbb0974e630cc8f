"""Step time of the ZeRO strategies against Lightning's own, on CPU processes (gloo), interleaved.

    python benchmarks/bench_step_time.py                          # zero0,ddp,zero1,zero2 on gpt_small
    python benchmarks/bench_step_time.py --json bench.json        # also write every run as JSON
    python benchmarks/bench_step_time.py --strategies zero3,fsdp,zero0 --baseline fsdp
    python benchmarks/bench_step_time.py --model gpt_tiny --repeats 2 --steps 30 --warmup 5
    python benchmarks/bench_step_time.py --strategies zero0,zero1 --baseline zero0 --precisions 32-true,bf16-mixed

For each repeat r = 1..R and each variant, in that order (A B C A B C ...), one training run of
the example GPT is started as a fresh process (``benchmarks/_run_one.py``). A variant is a strategy
at a precision (``Trainer(precision=...)``); the variants are every strategy in the list, each in
every precision of ``--precisions`` (default: 32-true only). Rank 0 times every optimizer step; a
run's figure is the median of its steps after the first ``--warmup``. A variant's figure is the
median of its R run figures; its ratio is that divided by the baseline's (the ``--baseline``
strategy at the first precision). The paired ratio divides each run by the baseline's run of the
same repeat (run moments apart, so it shares the machine's load of the moment) and takes the
median over repeats. With several precisions, a further table divides each variant by the same
strategy at the first precision, paired in the same way.
On a shared machine a step takes one of two times, depending on whether another job holds the
cores at that moment; the 10th-percentile step time (p10) of a run estimates the uncontended
mode, and the CPU time per step (rank 0's process, all threads) the work done whatever the load;
both are reported beside the median.

Speed goals are checked here, never in tests; see docs/benchmarks.md for the columns, the
caveats of CPU and gloo, and measured results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_ONE = Path(__file__).resolve().parent / "_run_one.py"  # one timed training run
MIB = 1024 * 1024
QUANTIZED = {  # stage 3 with int8 on the wire (docs/quantized.md): name -> ZeroConfig options
    "zero3-int8": {"quantize_weights": True, "quantize_grads": True},
    "zero3-int8w": {"quantize_weights": True},
    "zero3-int8g": {"quantize_grads": True},
}
STRATEGY_NAMES = (
    "auto",
    "ddp",
    "fsdp",
    "zero0",
    "zero1",
    "zero2",
    "zero3",
    *QUANTIZED,
)  # what a run can be given
PRECISION_NAMES = ("32-true", "bf16-mixed")  # Trainer(precision=...) a run can be given
DEFAULT_PRECISION = "32-true"  # also the precision of records written before --precisions existed


class Variant(NamedTuple):
    """What one run trains: a strategy at a precision."""

    strategy: str
    precision: str = DEFAULT_PRECISION


class Summary(NamedTuple):
    strategy: str
    step_ms: float  # median over repeats of each run's median step time (rank 0), ms
    run_ms_min: float  # fastest run's median step time, ms
    run_ms_max: float  # slowest run's median step time, ms
    ratio: float  # step_ms / the baseline's step_ms
    paired_ratio: float  # median over repeats of (run / baseline run of the same repeat)
    paired_min: float  # smallest per-repeat ratio
    paired_max: float  # largest per-repeat ratio
    p10_ms: float  # median over repeats of each run's 10th-percentile step time, ms
    p10_ratio: float  # p10_ms / the baseline's p10_ms
    cpu_ms: float  # median over repeats of each run's median CPU time per step (rank 0), ms
    cpu_ratio: float  # cpu_ms / the baseline's cpu_ms
    peak_rss_mib: list[float]  # per rank: median over repeats of ru_maxrss, MiB
    model_state_mib: list[dict[str, float]]  # per rank: parameters, gradients, optimizer_states, MiB
    memory_source: str  # "memory_report" (ZeroStrategy) or "measure" (baselines, same counting)
    wire_mib_per_step: float | None  # ZeroStrategy: logical bytes one rank sends in the last step, MiB
    precision: str = DEFAULT_PRECISION  # Trainer(precision=...) of the variant's runs


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """What one run is given: read here and by ``_run_one.py``, which this script passes them to."""
    p.add_argument("--model", default="gpt_small", help="configs/model/<name>.yaml: gpt_tiny | gpt_small")
    p.add_argument(
        "--model-arg", action="append", default=[], metavar="KEY=VALUE", help="override a model field"
    )
    p.add_argument("--batch-size", type=int, default=16, help="samples per batch on each rank")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="ddp and zero0-2 bucket cap, MiB")
    p.add_argument("--wrap-policy", default="examples.gpt.Block", help="zero3 / fsdp unit class")
    p.add_argument("--devices", type=int, default=2, help="CPU processes per run")
    p.add_argument("--start-method", default="fork", choices=("fork", "spawn"))
    p.add_argument("--seed", type=int, default=1234)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", default="zero0,ddp,zero1,zero2", help="comma-separated, run in this order")
    p.add_argument("--baseline", default="ddp", help="strategy the ratios divide by (at the first precision)")
    p.add_argument(
        "--precisions",
        default=DEFAULT_PRECISION,
        help=f"comma-separated, each strategy runs in each, in this order: {', '.join(PRECISION_NAMES)}",
    )
    p.add_argument("--repeats", type=int, default=4, help="runs per variant (interleaved)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=10, help="first steps of a run left out of its median")
    add_run_arguments(p)
    p.add_argument("--json", type=Path, default=None, help="write the summary and every run here")
    p.add_argument(
        "--also-vs",
        default="auto",
        help="comma-separated strategies for extra ratio tables; auto: zero0 when listed and not the baseline",
    )
    p.add_argument("--report", type=Path, default=None, help="print the tables of a --json file; run nothing")
    args = p.parse_args(argv)
    if args.report is not None:
        return args
    args.strategies = split_list(args.strategies)
    args.precisions = split_list(args.precisions)
    check_args(args)
    return args


def split_list(text: str) -> list[str]:
    """``"a, b,"`` -> ``["a", "b"]``."""
    return [s.strip() for s in text.split(",") if s.strip()]


def check_names(flag: str, names: list[str], known: tuple[str, ...]) -> None:
    """Refuse an empty list, an unknown name or a name given twice in the list of ``flag``."""
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        problem = f"unknown {unknown}" if unknown else "no name given"
        raise SystemExit(f"{flag}: {problem}; known: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise SystemExit(f"{flag} lists a name twice: {names}")


def check_args(args: argparse.Namespace) -> None:
    """Refuse a bad combination before the first run starts, naming what to change."""
    check_names("--strategies", args.strategies, STRATEGY_NAMES)
    check_names("--precisions", args.precisions, PRECISION_NAMES)
    if args.baseline not in args.strategies:
        raise SystemExit(f"--baseline {args.baseline!r} must be one of --strategies {args.strategies}")
    if "auto" in args.strategies and args.devices != 1:
        raise SystemExit(
            "auto is the one-device baseline (Lightning's SingleDeviceStrategy): use --devices 1"
        )
    if args.repeats < 1 or args.devices < 1:
        raise SystemExit(f"--repeats and --devices must be >= 1, got {args.repeats}, {args.devices}")
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if any(s.startswith("zero3") for s in args.strategies) and not zero3_registered():
        raise SystemExit("zero3 is not registered by this lightning_zero build; leave it out of --strategies")


def zero3_registered() -> bool:
    """Whether importing lightning_zero registers ``zero3`` (asked in a child: keeps this process light)."""
    code = "import lightning_zero; from lightning.pytorch.strategies import StrategyRegistry as R; print('zero3' in R)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    return done.returncode == 0 and done.stdout.strip().endswith("True")


def child_env(devices: int) -> dict[str, str]:
    """The environment of a run: one intra-op thread per core and rank, unless set by the caller."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // devices)))
    env["PYTHONWARNINGS"] = "ignore"
    return env


def variants(strategies: list[str], precisions: list[str]) -> list[Variant]:
    """Every strategy in every precision, in run order: a strategy's precisions run back to back."""
    return [Variant(s, p) for s in strategies for p in precisions]


def variant_of(record: dict[str, Any]) -> Variant:
    """The variant of a run record (one from before ``--precisions`` ran at the default precision)."""
    return Variant(record["strategy"], record.get("precision", DEFAULT_PRECISION))


def variant_name(variant: Variant, mixed: bool) -> str:
    """The strategy, followed by the precision when the runs mix precisions."""
    return f"{variant.strategy} {variant.precision}" if mixed else variant.strategy


def run_command(
    variant: Variant, out: Path, args: argparse.Namespace, extra: tuple[str, ...] = ()
) -> list[str]:
    """The command of one run; ``extra``: further arguments of ``_run_one.py`` (e.g. ``--guard off``)."""
    cmd = [sys.executable, str(RUN_ONE), "--strategy", variant.strategy, "--precision", variant.precision]
    cmd += list(extra)
    cmd += ["--out", str(out)]
    cmd += ["--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
    cmd += ["--bucket-cap-mb", str(args.bucket_cap_mb), "--wrap-policy", args.wrap_policy]
    cmd += ["--devices", str(args.devices), "--start-method", args.start_method, "--seed", str(args.seed)]
    for item in args.model_arg:
        cmd += ["--model-arg", item]
    return cmd


def run_one(
    variant: Variant, repeat: int, args: argparse.Namespace, workdir: Path, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Run one training in a fresh process; return its record with the run's median step time."""
    tag = "_".join(a.lstrip("-") for a in extra)
    out = workdir / f"r{repeat}_{variant.strategy}_{variant.precision}{'_' + tag if tag else ''}.json"
    start = time.perf_counter()
    command = run_command(variant, out, args, extra)
    env = child_env(args.devices)
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=900)
    if done.returncode != 0 or not out.is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise SystemExit(
            f"run {' '.join(variant)} (repeat {repeat}) failed with exit code {done.returncode}:\n{tail}"
        )
    record = json.loads(out.read_text())
    record["repeat"] = repeat
    record["wall_s"] = time.perf_counter() - start
    rank0 = record["ranks"][0]
    timed = rank0["step_times_s"][args.warmup :]  # rank 0, after warm-up
    record["median_step_s"] = statistics.median(timed)
    record["p10_step_s"] = percentile(timed, 0.10)
    record["median_cpu_s"] = statistics.median(rank0["cpu_times_s"][args.warmup :])
    return record


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linearly interpolated (q=0.5 is the median)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def median_ms(runs: list[dict[str, Any]], key: str) -> float:
    """Median over ``runs`` of the per-run figure ``key`` (seconds), in ms."""
    return statistics.median(r[key] for r in runs) * 1e3


def against(base: Variant) -> Callable[[Variant], Variant]:
    """Reference for :func:`summarize`: every variant divides by ``base``."""
    return lambda variant: base


def against_precision(precision: str) -> Callable[[Variant], Variant]:
    """Reference for :func:`summarize`: every variant divides by its own strategy at ``precision``."""
    return lambda variant: variant._replace(precision=precision)


def summarize(
    runs: list[dict[str, Any]], variants: list[Variant], reference: Callable[[Variant], Variant]
) -> list[Summary]:
    """One :class:`Summary` per variant from the runs of all repeats; ratios over ``reference(variant)``."""
    by = {(variant_of(r), r["repeat"]): r for r in runs}
    repeats = sorted({r["repeat"] for r in runs})
    rows = []
    for variant in variants:
        mine = [by[variant, k] for k in repeats]
        base = [by[reference(variant), k] for k in repeats]
        medians = [r["median_step_s"] * 1e3 for r in mine]
        paired = [m["median_step_s"] / b["median_step_s"] for m, b in zip(mine, base)]
        rows.append(
            Summary(
                strategy=variant.strategy,
                precision=variant.precision,
                step_ms=median_ms(mine, "median_step_s"),
                run_ms_min=min(medians),
                run_ms_max=max(medians),
                ratio=median_ms(mine, "median_step_s") / median_ms(base, "median_step_s"),
                paired_ratio=statistics.median(paired),
                paired_min=min(paired),
                paired_max=max(paired),
                p10_ms=median_ms(mine, "p10_step_s"),
                p10_ratio=median_ms(mine, "p10_step_s") / median_ms(base, "p10_step_s"),
                cpu_ms=median_ms(mine, "median_cpu_s"),
                cpu_ratio=median_ms(mine, "median_cpu_s") / median_ms(base, "median_cpu_s"),
                peak_rss_mib=peak_rss(mine),
                model_state_mib=model_state(mine[-1]),
                memory_source=mine[-1]["ranks"][0]["memory_source"],
                wire_mib_per_step=wire_per_step(mine[-1]),
            )
        )
    return rows


def peak_rss(runs: list[dict[str, Any]]) -> list[float]:
    """Per rank, the median over runs of the rank's peak resident set size, MiB."""
    ranks = range(len(runs[0]["ranks"]))
    return [statistics.median(r["ranks"][i]["peak_rss_kib"] for r in runs) / 1024 for i in ranks]


def model_state(run: dict[str, Any]) -> list[dict[str, float]]:
    """Per rank, the model-state bytes after the last optimizer step, MiB."""
    return [{k: v / MIB for k, v in rank["memory_report"].items()} for rank in run["ranks"]]


def wire_per_step(run: dict[str, Any]) -> float | None:
    """Rank 0's logical bytes sent in the last step (ring model, see lightning_zero.comm.ledger), MiB."""
    comm = run["ranks"][0]["last_step_comm"]
    if comm is None:
        return None
    return sum(op["wire_bytes"] for op in comm.values()) / MIB


def row_names(rows: list[Summary]) -> list[str]:
    """The first column of a table: strategy names, with the precision when the rows mix precisions."""
    mixed = len({r.precision for r in rows}) > 1
    return [variant_name(Variant(r.strategy, r.precision), mixed) for r in rows]


def state_cell(row: Summary) -> str:
    """Rank 0's parameters / gradients / optimizer states, MiB; ``*``: counted by ``measure``."""
    state = row.model_state_mib[0]
    mark = "" if row.memory_source == "memory_report" else "*"
    return f"{state['parameters']:.2f} / {state['gradients']:.2f} / {state['optimizer_states']:.2f}{mark}"


def wire_cell(row: Summary) -> str:
    return "-" if row.wire_mib_per_step is None else f"{row.wire_mib_per_step:.2f}"


def paired_cell(row: Summary) -> str:
    return f"{row.paired_ratio:.3f} ({row.paired_min:.3f}-{row.paired_max:.3f})"


def timing_table(rows: list[Summary], baseline: str) -> str:
    """Markdown: step times and their ratios against ``baseline``."""
    lines = [
        f"| strategy | step ms (median) | run medians min-max | ratio vs {baseline} "
        "| paired ratio (min-max) | p10 step ms | p10 ratio | CPU ms/step | CPU ratio |",
        "|" + "---|" * 9,
    ]
    for name, r in zip(row_names(rows), rows):
        lines.append(
            f"| {name} | {r.step_ms:.1f} | {r.run_ms_min:.1f}-{r.run_ms_max:.1f} | {r.ratio:.3f} "
            f"| {paired_cell(r)} | {r.p10_ms:.1f} | {r.p10_ratio:.3f} | {r.cpu_ms:.1f} | {r.cpu_ratio:.3f} |"
        )
    return "\n".join(lines)


def memory_table(rows: list[Summary]) -> str:
    """Markdown: peak RSS, model-state bytes and logical traffic per rank."""
    lines = [
        "| strategy | peak RSS MiB per rank | params / grads / optim MiB (rank 0) | sent MiB/step |",
        "|" + "---|" * 4,
    ]
    for name, r in zip(row_names(rows), rows):
        rss = " / ".join(f"{m:.0f}" for m in r.peak_rss_mib)
        lines.append(f"| {name} | {rss} | {state_cell(r)} | {wire_cell(r)} |")
    return "\n".join(lines)


def precision_table(rows: list[Summary], reference: str) -> str:
    """Markdown: each variant against its own strategy at the ``reference`` precision.

    ``rows`` come from :func:`summarize` with :func:`against_precision` (``reference``): time and
    work relative to the same strategy, and the model state and traffic the precision changes.
    """
    lines = [
        f"| strategy | precision | step ms (median) | paired ratio vs {reference} (min-max) | CPU ms/step "
        "| CPU ratio | params / grads / optim MiB (rank 0) | model state MiB per rank | sent MiB/step |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        per_rank = " / ".join(f"{sum(rank.values()):.2f}" for rank in r.model_state_mib)
        lines.append(
            f"| {r.strategy} | {r.precision} | {r.step_ms:.1f} | {paired_cell(r)} | {r.cpu_ms:.1f} "
            f"| {r.cpu_ratio:.3f} | {state_cell(r)} | {per_rank} | {wire_cell(r)} |"
        )
    return "\n".join(lines)


def source_revision() -> dict[str, Any]:
    """The checkout's commit and whether the code under test differs from it (read-only git queries)."""

    def git(*cmd: str) -> str:
        done = subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=REPO_ROOT)
        return done.stdout.strip() if done.returncode == 0 else ""

    status = git("status", "--porcelain", "--", "lightning_zero", "examples", "configs")
    return {"commit": git("rev-parse", "HEAD") or None, "uncommitted_changes": bool(status)}


def machine(devices: int) -> dict[str, Any]:
    """Where and with what the benchmark ran."""
    import lightning
    import torch

    return {
        **source_revision(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "backend": "gloo",
        "omp_num_threads": child_env(devices)["OMP_NUM_THREADS"],  # intra-op threads per rank
    }


def progress_line(record: dict[str, Any], repeats: int) -> str:
    return (
        f"repeat {record['repeat']}/{repeats}  {record['strategy']:<6} {record['precision']:<10}"
        f"  median step {record['median_step_s'] * 1e3:7.1f} ms  p10 {record['p10_step_s'] * 1e3:7.1f} ms"
        f"  CPU {record['median_cpu_s'] * 1e3:7.1f} ms  (run {record['wall_s']:.1f} s)"
    )


def extra_references(also_vs: str, strategies: list[str], baseline: str) -> list[str]:
    """The strategies named by ``--also-vs`` that the runs include, baseline excluded."""
    names = ["zero0"] if also_vs == "auto" else [s.strip() for s in also_vs.split(",") if s.strip()]
    return [n for n in names if n in strategies and n != baseline]


def print_report(payload: dict[str, Any], also_vs: str = "auto") -> list[Summary]:
    """Print the tables of a benchmark's JSON payload; return its rows (against its baseline)."""
    settings, runs = payload["settings"], payload["runs"]
    precisions = settings.get("precisions", [DEFAULT_PRECISION])
    every = variants(settings["strategies"], precisions)
    mixed = len(precisions) > 1
    rows = [Summary(**row) for row in payload["summary"]]
    print(timing_table(rows, variant_name(Variant(settings["baseline"], precisions[0]), mixed)))
    print()
    for name in extra_references(also_vs, settings["strategies"], settings["baseline"]):
        reference = Variant(name, precisions[0])
        print(timing_table(summarize(runs, every, against(reference)), variant_name(reference, mixed)))
        print()
    if mixed:
        print(precision_table(summarize(runs, every, against_precision(precisions[0])), precisions[0]))
        print()
    print(memory_table(rows))
    if any(r.memory_source != "memory_report" for r in rows):
        print("\n\\* baseline memory counted with lightning_zero.memory.measure (see docs/benchmarks.md)")
    print(
        f"\n{len(payload['runs'])} runs in {payload['total_s'] / 60:.1f} min"
        f" ({' '.join([settings['model'], *settings['model_arg']])}, {', '.join(precisions)},"
        f" batch {settings['batch_size']},"
        f" {settings['steps']} steps, rank 0's steps after the first {settings['warmup']})"
    )
    return rows


def main(argv: list[str] | None = None) -> list[Summary]:
    args = parse_args(argv)
    if args.report is not None:
        return print_report(json.loads(args.report.read_text()), args.also_vs)
    setting = machine(args.devices)  # before the runs: the code they run is the code at the start
    every = variants(args.strategies, args.precisions)
    baseline = Variant(args.baseline, args.precisions[0])
    runs = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_step_time_") as tmp:
        for repeat in range(1, args.repeats + 1):
            for variant in every:
                record = run_one(variant, repeat, args, Path(tmp))
                runs.append(record)
                print(progress_line(record, args.repeats), file=sys.stderr, flush=True)
    summary = [r._asdict() for r in summarize(runs, every, against(baseline))]
    payload = result_payload(args, setting, started, summary=summary, runs=runs)
    if args.json is not None:
        args.json.write_text(json.dumps(payload))
    return print_report(payload, args.also_vs)


def result_payload(
    args: argparse.Namespace, setting: dict[str, Any], started: float, **parts: Any
) -> dict[str, Any]:
    """What a benchmark writes with ``--json``: its settings, the machine, its total time and
    ``parts`` (the summary, the runs, ...)."""
    return {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": setting,
        "total_s": time.perf_counter() - started,
        **parts,
    }


if __name__ == "__main__":
    main()
