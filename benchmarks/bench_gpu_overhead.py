"""Overhead of the ZeRO strategies on one GPU against plain Lightning, in bf16 mixed precision.

    python benchmarks/bench_gpu_overhead.py                                # zero0-3 vs auto, gpt_small and gpt_10m
    python benchmarks/bench_gpu_overhead.py --models gpt_10m --stages 0,3 --repeats 6
    python benchmarks/bench_gpu_overhead.py --peak-tflops 312              # a GPU the table does not name
    python benchmarks/bench_gpu_overhead.py --out-dir benchmarks/results   # also write gpu_overhead.json and .md
    python benchmarks/bench_gpu_overhead.py --models gpt_10m --budget-s 180  # the repeats that fit in 180 s

On one GPU a stage has nobody to shard with, so ``Trainer(strategy="zeroK", devices=1)`` against
``Trainer(strategy="auto", devices=1)`` measures what the strategy's own machinery costs per step
(hooks, flat buffers, the ledger, its checks); the goal is a ratio of at most 1.02. For each model
and each repeat r = 1..R, every variant (auto, zero0, ..., zero3) trains once, in that order, each
in a fresh process (A B C A B C ...). A run records a CUDA event on the stream at the start of
every batch and one at the end: the distance between two is one step as the GPU ran it, with no
synchronisation inside the run. A run's figure is the median of its steps after ``--warmup``; a
variant's, the median over its runs; its paired ratio, the median over repeats of its run divided
by the auto run of the same repeat.

MFU (model FLOPs utilisation): 6Ψ + 12·L·C·T FLOPs per token (forward and backward through the
weights, and attention's scores and weighted sums; Ψ counts every parameter, embeddings
included), times the tokens of a step, divided by the step time and by the GPU's peak dense bf16
FLOP/s, from PEAK_BF16_TFLOPS by the device's name or from ``--peak-tflops``.

Without a CUDA device it says so and exits with status 0 (``make gpu-check`` passes on a CPU
machine). See docs/benchmarks.md, "GPU check".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: make `examples`, `benchmarks` importable
    sys.path.insert(0, str(REPO_ROOT))

MODELS = {  # name -> (configs/model/<base>.yaml, field overrides)
    "gpt_small": ("gpt_small", {}),  # 4 layers, width 128, 128 tokens: 0.8M parameters
    "gpt_10m": ("gpt_small", {"n_layer": 6, "n_embd": 384, "n_head": 6}),  # 6 layers, width 384: 10.8M
}
PEAK_BF16_TFLOPS = (  # (part of torch.cuda.get_device_name(), dense bf16 tensor-core TFLOP/s of the
    # vendor's datasheet); the first match wins, so a longer name comes before a name it contains
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("RTX 4090", 165.0),
)
GOAL = 1.02  # zeroK / auto on one GPU
NO_GPU = "no GPU: no CUDA device is present (torch.cuda.is_available() is False); nothing measured"


class Row(NamedTuple):
    variant: str  # "auto" or "zero0" .. "zero3"
    step_ms: float  # median over runs of each run's median step time
    run_min_ms: float  # fastest run's median
    run_max_ms: float  # slowest run's median
    paired: float  # median over repeats of run / the auto run of the same repeat
    paired_min: float
    paired_max: float
    tokens_per_s: float  # tokens of a step / step_ms
    mfu: float | None  # model FLOPs per second / the GPU's peak; None: peak unknown


def peak_tflops(device_name: str, override: float | None) -> tuple[float | None, str]:
    """The GPU's peak dense bf16 TFLOP/s and where it came from."""
    if override is not None:
        return override, "--peak-tflops"
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in device_name:
            return tflops, f"table: {part}"
    return None, f"unknown for {device_name!r}: pass --peak-tflops"


def flops_per_token(num_params: int, n_layer: int, n_embd: int, block_size: int) -> float:
    """Training FLOPs per token: 6Ψ for the weights, 12·L·C·T for attention (forward and backward)."""
    return 6.0 * num_params + 12.0 * n_layer * n_embd * block_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt_small,gpt_10m", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages, each against auto")
    p.add_argument("--repeats", type=int, default=4, help="runs per variant (interleaved)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=15, help="first steps of a run left out of its median")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--precision", default="bf16-mixed", help="Trainer(precision=...) of every run")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's peak dense bf16 TFLOP/s")
    p.add_argument("--out-dir", type=Path, default=None, help="write gpu_overhead.json and .md here")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no repeat that would end past this many seconds (by the longest repeat so far); "
        "the first always runs, the report says how many did",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one run of this variant
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)  # internal: its model
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)  # internal: its record
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.stages = [int(s) for s in args.stages.split(",") if s.strip()]
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        raise SystemExit(f"--models: unknown {unknown or 'empty list'}; known: {', '.join(MODELS)}")
    if not args.stages or any(s not in (0, 1, 2, 3) for s in args.stages):
        raise SystemExit(f"--stages must list stages 0-3, got {args.stages}")
    if args.budget_s is not None and args.budget_s <= 0:
        raise SystemExit(f"--budget-s must be positive, got {args.budget_s}")
    if args.repeats < 1 or not 0 <= args.warmup < args.steps:
        raise SystemExit(
            f"need --repeats >= 1 and 0 <= --warmup < --steps, got {args.repeats}, {args.warmup}"
        )


# --------------------------------------------------------------------------- one run (a child)


def model_config(name: str) -> dict[str, Any]:
    from benchmarks._run_one import model_config as read_config

    base, overrides = MODELS[name]
    return read_config(base, [f"{k}={v!r}" for k, v in overrides.items()])


def strategy_of(variant: str) -> Any:
    """``"auto"``, or a ZeroStrategy of the variant's stage (stage 3 wraps each transformer block)."""
    if variant == "auto":
        return "auto"
    from lightning_zero import ZeroStrategy

    stage = int(variant.removeprefix("zero"))
    return ZeroStrategy(stage=stage, **({"wrap_policy": "examples.gpt.Block"} if stage == 3 else {}))


def step_events_callback() -> Any:
    """A callback that records a CUDA event at the start of every batch and at the end of training,
    and reads their distances (seconds per step) once training is over."""
    from lightning.pytorch import Callback

    class StepEvents(Callback):
        def __init__(self) -> None:
            self.events: list[torch.cuda.Event] = []  # recorded on the current stream, not waited for
            self.step_s: list[float] = []  # filled at the end of training

        def _mark(self) -> None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

        def on_train_batch_start(self, *args: Any) -> None:
            self._mark()

        def on_train_end(self, *args: Any) -> None:
            self._mark()
            torch.cuda.synchronize()
            self.step_s = [a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:])]

    return StepEvents()


def run_child(args: argparse.Namespace) -> None:
    """One timed training run of ``args.run`` on ``args.model``; its record goes to ``args.out``."""
    import lightning as L

    from examples.data import CharDataModule
    from examples.gpt import GPTLightning
    from tests.bigmodel.lit import quiet_trainer

    L.seed_everything(args.seed, verbose=False)
    torch.set_float32_matmul_precision("high")  # the same for every variant
    cfg = model_config(args.model)
    data = CharDataModule(
        block_size=cfg["block_size"],
        batch_size=args.batch_size,
        num_train_samples=args.steps * args.batch_size,
        seed=args.seed,
    )
    model = GPTLightning(vocab_size=data.vocab_size, **cfg)
    timer = step_events_callback()
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as root:
        trainer = quiet_trainer(
            strategy_of(args.run),
            root,
            devices=1,
            max_epochs=None,
            callbacks=[timer],
            accelerator="cuda",
            precision=args.precision,
            max_steps=args.steps,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        trainer.fit(model, datamodule=data)
    num_params = sum(p.numel() for p in model.parameters())
    record = {"variant": args.run, "model": args.model, "config": cfg, "num_parameters": num_params}
    args.out.write_text(json.dumps({**record, "step_times_s": timer.step_s}))


# --------------------------------------------------------------------------- the benchmark


def run_one(variant: str, model: str, repeat: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Run one training in a fresh process; return its record with its median step time."""
    out = workdir / f"{model}_{variant}_r{repeat}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--run",
        variant,
        "--model",
        model,
        "--out",
        str(out),
    ]
    cmd += ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--precision", args.precision]
    cmd += ["--seed", str(args.seed)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=900)
    if done.returncode != 0 or not out.is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise SystemExit(f"run {variant} on {model} (repeat {repeat}) failed ({done.returncode}):\n{tail}")
    record = json.loads(out.read_text())
    record.update(repeat=repeat, wall_s=time.perf_counter() - start)
    record["median_step_s"] = statistics.median(record["step_times_s"][args.warmup :])
    return record


def summarize(
    runs: list[dict[str, Any]], variants: list[str], tokens: int, flops: float, peak: float | None
) -> list[Row]:
    """One Row per variant of one model's runs; ratios against the auto run of the same repeat."""
    by = {(r["variant"], r["repeat"]): r["median_step_s"] for r in runs}
    repeats = sorted({r["repeat"] for r in runs})
    rows = []
    for variant in variants:
        mine = [by[variant, k] for k in repeats]
        paired = [by[variant, k] / by["auto", k] for k in repeats]
        step = statistics.median(mine)
        mfu = flops * tokens / step / (peak * 1e12) if peak else None
        rows.append(
            Row(variant, step * 1e3, min(mine) * 1e3, max(mine) * 1e3, statistics.median(paired),
                min(paired), max(paired), tokens / step, mfu)
        )  # fmt: skip
    return rows


def table(rows: list[Row]) -> str:
    """Markdown: step times, the paired ratio against auto and the goal, throughput and MFU."""
    lines = [
        "| variant | step ms (median) | run medians min-max | paired ratio vs auto (min-max) | goal <= 1.02 "
        "| tokens/s | MFU |",
        "|" + "---|" * 7,
    ]
    for r in rows:
        goal = "-" if r.variant == "auto" else ("met" if r.paired <= GOAL else "**not met**")
        mfu = "-" if r.mfu is None else f"{r.mfu:.1%}"
        lines.append(
            f"| {r.variant} | {r.step_ms:.2f} | {r.run_min_ms:.2f}-{r.run_max_ms:.2f} "
            f"| {r.paired:.3f} ({r.paired_min:.3f}-{r.paired_max:.3f}) | {goal} | {r.tokens_per_s:,.0f} | {mfu} |"
        )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    from benchmarks.bench_step_time import source_revision

    props = torch.cuda.get_device_properties(0)
    return {
        **source_revision(),
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def measure(args: argparse.Namespace, clock: Any = time.perf_counter) -> dict[str, Any]:
    """Every model's interleaved runs, their rows and the report; with ``--budget-s``, the repeats
    that fit in it (a model none of whose repeats fits is left out and named)."""
    start, longest = clock(), 0.0  # the longest repeat so far: the estimate of the next one
    setting = machine()  # before the runs: the code they run is the code at the start
    peak, source = peak_tflops(setting["gpu"], args.peak_tflops)
    variants = ["auto", *(f"zero{s}" for s in args.stages)]
    payload: dict[str, Any] = {"settings": vars_of(args), "machine": setting, "peak_tflops": peak}
    payload.update(peak_source=source, models={}, runs=[])
    report = [
        f"{setting['gpu']}, torch {setting['torch']}, CUDA {setting['cuda']}, {args.precision}; peak {source}"
    ]
    with tempfile.TemporaryDirectory(prefix="bench_gpu_overhead_") as tmp:
        for model in args.models:
            runs = []
            for repeat in range(1, args.repeats + 1):
                began = clock()
                if args.budget_s is not None and longest and began - start + longest > args.budget_s:
                    break
                for variant in variants:
                    runs.append(record := run_one(variant, model, repeat, args, Path(tmp)))
                    print(progress_line(record, args.repeats), file=sys.stderr, flush=True)
                longest = max(longest, clock() - began)
            done = len(runs) // len(variants)
            payload["models"][model] = {"repeats_done": done}
            if done < args.repeats:
                report.append(
                    f"{model}: {done} of {args.repeats} repeats fitted in --budget-s {args.budget_s:g}"
                )
            if not runs:
                continue
            cfg, psi = runs[0]["config"], runs[0]["num_parameters"]
            flops = flops_per_token(psi, cfg["n_layer"], cfg["n_embd"], cfg["block_size"])
            tokens = args.batch_size * cfg["block_size"]
            rows = summarize(runs, variants, tokens, flops, peak)
            payload["models"][model].update(config=cfg, num_parameters=psi, flops_per_token=flops)
            payload["models"][model]["rows"] = [r._asdict() for r in rows]
            payload["runs"] += runs
            report += [
                "",
                f"{model}: Ψ = {psi:,}, {tokens:,} tokens per step, {flops:,.0f} FLOPs per token",
                table(rows),
            ]
    payload["report"] = "\n".join(report)
    return payload


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in ("run", "model", "out")
    }


def progress_line(record: dict[str, Any], repeats: int) -> str:
    return (
        f"repeat {record['repeat']}/{repeats}  {record['model']:<9} {record['variant']:<5}"
        f"  median step {record['median_step_s'] * 1e3:8.2f} ms  (run {record['wall_s']:.1f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run is not None:
        run_child(args)
        return 0
    if not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    payload = measure(args)
    print(payload["report"])
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "gpu_overhead.json").write_text(json.dumps(payload))
        (args.out_dir / "gpu_overhead.md").write_text(payload["report"] + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
