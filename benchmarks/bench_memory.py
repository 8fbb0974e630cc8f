"""Peak resident memory per rank, per phase of a whole run, as a user measures it: every strategy.

    python benchmarks/bench_memory.py                                   # N=2, fp32 and bf16-mixed
    python benchmarks/bench_memory.py --devices 2,4 --json benchmarks/results/memory_gpt_17m.json \\
        --plot docs/images/memory_gpt_17m.png
    python benchmarks/bench_memory.py --strategies zero0,zero3 --allocator default   # glibc's defaults
    python benchmarks/bench_memory.py --report benchmarks/results/memory_gpt_17m.json

The example GPT (default: 10 layers, width 384, 6 heads, context 128: 17.8M parameters with the
corpus' 65 characters), AdamW, ``--steps`` optimizer steps, then ``trainer.save_checkpoint`` (a
full checkpoint, every rank taking part) and the end of ``fit`` (teardown). Each run is N fresh
processes started here with Lightning's environment variables, as ``popen`` (``ZeroStrategy``'s
default launcher) or torchrun start them: nothing is inherited from a launching process. No
``MALLOC_*`` or ``GLIBC_TUNABLES`` variable reaches them unless ``--env`` gives one.

Each rank samples ``/proc/self/status``: at every phase boundary it reads ``VmHWM`` (the peak
resident size since the last boundary) and ``VmRSS`` (resident now), then resets the peak
(``/proc/self/clear_refs``). Phases: ``setup`` (from the imports done to the first batch: the
model and data built, the process group, the strategy's setup, the optimizer), then per step
``forward`` (from the previous batch's end: data, ``training_step``), ``backward`` (with the
gradient reduction), ``step`` (clipping, optimizer step, stages 1-2's gather), and ``save`` and
``teardown``. The whole-run peak is the largest of them. The same runs with a tiny model
(``--baseline-model-arg``) give the per-process baseline (interpreter, torch, Lightning, gloo,
corpus); the peak above it is the model-state part (and activations), compared with the ZeRO
formulas.

``--allocator package`` (default): the zero strategies run with the package's CPU allocator
setting (``ZeroConfig.cpu_allocator="tuned"``, lightning_zero/allocator.py), applied when the
Trainer sets up (Lightning's ``setup`` hook, before ``configure_model`` and the strategy's setup);
``ddp`` and ``fsdp`` run with glibc's defaults, as a user of them has. ``default``: nobody tunes.
``tuned-all``: every strategy tuned (separates the allocator from the sharding).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

MIB = 1024 * 1024
STRATEGIES = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp")
PRECISIONS = ("32-true", "bf16-mixed")
ALLOCATORS = ("package", "default", "tuned-all")
GPT_17M = ["n_layer=10", "n_embd=384", "n_head=6"]  # on gpt_small: 17.8M parameters
TINY = ["n_layer=1", "n_embd=32", "n_head=2"]  # the baseline: 0.02M parameters, same data
PHASES = ("setup", "forward", "backward", "step", "save", "teardown")
TRAINING = ("setup", "forward", "backward", "step")  # the phases of a run without save and teardown


# ---------------------------------------------------------------------------------------------
# inside a rank


def proc_status_mb(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Start a new ``VmHWM`` at the current resident size (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class PhaseMeter:
    """Peak and end-of-phase resident MiB of each phase (max over its occurrences)."""

    def __init__(self) -> None:
        self.peak: dict[str, float] = {}  # phase -> largest VmHWM seen at its end
        self.end: dict[str, float] = {}  # phase -> VmRSS at its (last) end
        self.start_mb = proc_status_mb("VmRSS")  # resident after the imports
        reset_peak()

    def close(self, phase: str) -> None:
        """End ``phase`` now: record its peak and what stays resident, and start the next."""
        self.peak[phase] = max(self.peak.get(phase, 0.0), proc_status_mb("VmHWM"))
        self.end[phase] = proc_status_mb("VmRSS")
        reset_peak()


def phase_callback(meter: PhaseMeter, save_path: str, allocator: str) -> Any:
    import lightning as L

    from lightning_zero.allocator import tune_cpu_allocator

    class Phases(L.Callback):
        """Closes the meter's phases at Lightning's hooks; saves a full checkpoint at train end."""

        def __init__(self) -> None:
            self.step_s: list[float] = []  # wall seconds per optimizer step
            self._t0 = 0.0
            self.state: dict[str, Any] = {}

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            if allocator == "tuned":  # where the strategy applies it: before configure_model and setup
                tune_cpu_allocator("tuned", device_type="cpu")

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            meter.close("setup" if not self.step_s and "setup" not in meter.peak else "forward")
            self._t0 = time.perf_counter()

        def on_before_backward(self, *args: Any) -> None:
            meter.close("forward")

        def on_after_backward(self, *args: Any) -> None:
            meter.close("backward")

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            meter.close("step")
            self.step_s.append(time.perf_counter() - self._t0)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            from benchmarks._run_one import model_state

            self.state = model_state(trainer)["memory_report"]
            trainer.save_checkpoint(save_path)
            meter.close("save")

    return Phases()


def build_strategy(name: str, allocator: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_zero
    from benchmarks.fsdp_cpu import CPUFSDPStrategy
    from examples.gpt import Block

    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if name == "fsdp":
        # its full save (FULL_STATE_DICT) ends in a segmentation fault on CPU here: the sharded form
        return CPUFSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")
    stage = int(name.removeprefix("zero"))
    extra = {"wrap_policy": "examples.gpt.Block"} if stage == 3 else {}
    cpu_allocator = "default" if allocator == "default" else "tuned"
    return lightning_zero.ZeroStrategy(stage=stage, cpu_allocator=cpu_allocator, **extra)


def worker(args: argparse.Namespace) -> None:
    """One rank: train, save, tear down; write ``<out>.rank<r>``."""
    import lightning as L

    from benchmarks._run_one import model_config
    from examples.data import CharDataModule
    from examples.gpt import GPTLightning
    from tests.bigmodel.lit import quiet_trainer

    meter = PhaseMeter()
    rank = int(os.environ["RANK"])
    L.seed_everything(args.seed, verbose=False)
    cfg = model_config(args.model, args.model_arg)
    n = args.world
    data = CharDataModule(
        block_size=cfg["block_size"],
        batch_size=args.batch_size,
        num_train_samples=args.steps * args.batch_size * n,
        seed=args.seed,
    )
    model = GPTLightning(vocab_size=data.vocab_size, **cfg)
    psi = sum(p.numel() for p in model.parameters())  # before fit: fsdp leaves its shards in the module
    tuned = args.allocator == "tuned-all" or (
        args.allocator == "package" and args.strategy != "ddp" and args.strategy != "fsdp"
    )
    phases = phase_callback(meter, args.save, "tuned" if tuned else "default")
    trainer = quiet_trainer(
        build_strategy(args.strategy, args.allocator),
        os.path.dirname(args.save),
        devices=n,
        max_epochs=None,
        callbacks=[phases],
        precision=args.precision,
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=data)
    meter.close("teardown")
    write_rank_record(args, rank, meter, phases, psi)


def write_rank_record(args: argparse.Namespace, rank: int, meter: PhaseMeter, phases: Any, psi: int) -> None:
    from lightning_zero.allocator import cpu_allocator_state

    state = cpu_allocator_state()
    record = {
        "rank": rank,
        "num_parameters": psi,
        "start_mb": meter.start_mb,
        "peak_mb": meter.peak,
        "end_mb": meter.end,
        "whole_run_peak_mb": max(meter.peak.values()),
        "step_s": phases.step_s,
        "model_state": phases.state,
        "allocator": state._asdict() if state is not None else None,
    }
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(record))


# ---------------------------------------------------------------------------------------------
# the driver


class Run:
    """What one run trains."""

    def __init__(self, strategy: str, precision: str, world: int, model_args: list[str], kind: str) -> None:
        self.strategy, self.precision, self.world = strategy, precision, world
        self.model_args = model_args  # --model-arg values of the run
        self.kind = kind  # "model" or "baseline"

    def key(self) -> str:
        return f"{self.kind}/{self.strategy}/{self.precision}/N={self.world}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, extra: dict[str, str]) -> dict[str, str]:
    """The user's environment without malloc variables, plus Lightning's rank variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    threads = str(max(1, (os.cpu_count() or 1) // world))
    env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", threads), MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0")
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), PYTHONPATH=str(REPO_ROOT), **extra)
    return env


def launch(run: Run, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Start the run's ranks, wait for them, and merge their records."""
    out = folder / "run.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out)]
    cmd += ["--strategy", run.strategy, "--precision", run.precision, "--world", str(run.world)]
    cmd += ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--model", args.model]
    cmd += ["--allocator", args.allocator, "--save", str(folder / "last.ckpt"), "--seed", str(args.seed)]
    for item in run.model_args:
        cmd += ["--model-arg", item]
    extra = dict(item.split("=", 1) for item in args.env)
    port = free_port()
    start = time.perf_counter()
    procs = [
        subprocess.Popen(cmd, env=rank_env(r, run.world, port, extra), cwd=REPO_ROOT)
        for r in range(run.world)
    ]
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        raise SystemExit(f"{run.key()}: ranks exited with {codes}")
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(run.world)]
    return {
        "key": run.key(),
        "strategy": run.strategy,
        "precision": run.precision,
        "world": run.world,
        "kind": run.kind,
        "model_args": run.model_args,
        "wall_s": time.perf_counter() - start,
        "ranks": ranks,
    }


def plan(args: argparse.Namespace) -> list[Run]:
    runs = []
    for world in args.devices:
        for precision in args.precisions:
            if args.baseline:
                runs += [
                    Run(s, precision, world, args.baseline_model_arg, "baseline") for s in args.strategies
                ]
            runs += [Run(s, precision, world, args.model_arg, "model") for s in args.strategies]
    return runs


def machine() -> dict[str, Any]:
    import lightning
    import torch

    from lightning_zero.allocator import glibc_version

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "glibc": glibc_version(),
        "commit": commit.stdout.strip(),
        "load_avg": os.getloadavg(),
    }


# ---------------------------------------------------------------------------------------------
# the tables


def formulas(psi: int, world: int, precision: str) -> dict[str, float]:
    """Model-state MiB per rank by the ZeRO formulas (fp32: 4+4+8 bytes; bf16-mixed: 2+2+12)."""
    n = world
    if precision == "32-true":
        per = {"zero0": 16, "zero1": 8 + 8 / n, "zero2": 4 + 12 / n, "zero3": 16 / n}
    else:
        per = {"zero0": 16, "zero1": 4 + 12 / n, "zero2": 2 + 14 / n, "zero3": 16 / n}
    per.update(ddp=16, fsdp=16 / n)  # Lightning's ddp/fsdp keep fp32 parameters under autocast
    return {k: v * psi / MIB for k, v in per.items()}


def summarise(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (precision, N, strategy): peaks per rank, baseline, per-phase maxima over ranks."""
    runs = {r["key"]: r for r in record["runs"]}
    rows = []
    for run in record["runs"]:
        if run["kind"] != "model":
            continue
        base = runs.get(run["key"].replace("model/", "baseline/", 1))
        psi = run["ranks"][0]["num_parameters"]
        peaks = [r["whole_run_peak_mb"] for r in run["ranks"]]
        base_peak = max(r["whole_run_peak_mb"] for r in base["ranks"]) if base else None
        rows.append(
            {
                "strategy": run["strategy"],
                "precision": run["precision"],
                "world": run["world"],
                "psi": psi,
                "peaks": peaks,
                "training_peaks": [max(r["peak_mb"][p] for p in TRAINING) for r in run["ranks"]],
                "baseline": base_peak,
                "above_baseline": max(peaks) - base_peak if base_peak is not None else None,
                "formula": formulas(psi, run["world"], run["precision"])[run["strategy"]],
                "phases": {p: max(r["peak_mb"].get(p, 0.0) for r in run["ranks"]) for p in PHASES},
                "end": {p: max(r["end_mb"].get(p, 0.0) for r in run["ranks"]) for p in PHASES},
                "step_s": statistics.median(run["ranks"][0]["step_s"][1:] or run["ranks"][0]["step_s"]),
            }
        )
    return rows


def peer(rows: list[dict[str, Any]], row: dict[str, Any], strategy: str) -> dict[str, Any] | None:
    """The row of ``strategy`` at ``row``'s precision and N."""
    return next(
        (
            r
            for r in rows
            if (r["strategy"], r["precision"], r["world"]) == (strategy, row["precision"], row["world"])
        ),
        None,
    )


def saving(
    rows: list[dict[str, Any]], row: dict[str, Any], key: str = "peaks", reference: str = "ddp"
) -> tuple[float, float] | None:
    """(reference's peak - this peak, reference's formula - this formula), largest rank of each;
    None where the formulas give no saving."""
    ref = peer(rows, row, reference)
    if ref is None or ref["formula"] <= row["formula"] or row["strategy"] == reference:
        return None
    return max(ref[key]) - max(row[key]), ref["formula"] - row["formula"]


def _saving_cell(rows: list[dict[str, Any]], row: dict[str, Any], key: str, reference: str = "ddp") -> str:
    pair = saving(rows, row, key, reference)
    if pair is None:
        return "-"
    measured, theory = pair
    return f"{measured:.0f} / {theory:.0f} ({100 * measured / theory:.0f}%)"


def tables(record: dict[str, Any]) -> str:
    """The whole-run table (peaks, baseline, formula, saving against ddp) and the per-phase table."""
    rows = summarise(record)
    lines = [
        "| N | precision | strategy | whole-run peak MiB per rank | training peak (setup to step) | "
        "baseline (tiny model) | whole-run above baseline | formula (model state) | "
        "saving vs ddp, whole run: measured / theory | same, training | saving vs zero0, whole run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = "-" if row["baseline"] is None else f"{row['baseline']:.0f}"
        above = "-" if row["above_baseline"] is None else f"{row['above_baseline']:.0f}"
        lines.append(
            f"| {row['world']} | {row['precision']} | {row['strategy']} | "
            f"{' / '.join(f'{p:.0f}' for p in row['peaks'])} | "
            f"{' / '.join(f'{p:.0f}' for p in row['training_peaks'])} | {base} | {above} | "
            f"{row['formula']:.0f} | {_saving_cell(rows, row, 'peaks')} | "
            f"{_saving_cell(rows, row, 'training_peaks')} | {_saving_cell(rows, row, 'peaks', 'zero0')} |"
        )
    lines += [
        "",
        "| N | precision | strategy | " + " | ".join(PHASES) + " | step s |",
        "|---|---|---|" + "---|" * (len(PHASES) + 1),
    ]
    for row in rows:
        cells = " | ".join(f"{row['phases'][p]:.0f}" for p in PHASES)
        lines.append(
            f"| {row['world']} | {row['precision']} | {row['strategy']} | {cells} | {row['step_s']:.2f} |"
        )
    return "\n".join(lines)


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarise(record)
    groups = sorted({(r["world"], r["precision"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, (world, precision) in zip(axes[0], groups):
        sel = [r for r in rows if r["world"] == world and r["precision"] == precision]
        x = range(len(sel))
        base = [r["baseline"] or 0.0 for r in sel]
        ax.bar(
            x,
            [max(r["peaks"]) - b for r, b in zip(sel, base)],
            bottom=base,
            color="tab:blue",
            label="measured peak",
        )
        ax.bar(x, base, color="lightgray", label="baseline (tiny model)")
        ax.scatter(
            x,
            [b + r["formula"] for r, b in zip(sel, base)],
            color="tab:red",
            zorder=3,
            marker="_",
            s=600,
            label="baseline + formula",
        )
        ax.set_xticks(list(x), [r["strategy"] for r in sel])
        ax.set_title(f"N = {world}, {precision}")
        ax.set_ylabel("whole-run peak RSS per rank, MiB")
    axes[0][0].legend(loc="lower left", fontsize=8)
    psi = rows[0]["psi"] / 1e6
    allocator = {"package": "zeroK: the package's CPU allocator setting; ddp, fsdp: glibc's defaults"}.get(
        record["settings"].get("allocator", ""), f"allocator: {record['settings'].get('allocator')}"
    )
    fig.suptitle(f"GPT {psi:.1f}M parameters, CPU (gloo), no malloc variables; {allocator}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, run in this order")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--devices", default="2", help="comma-separated world sizes N")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--model", default="gpt_small", help="configs/model/<name>.yaml")
    p.add_argument(
        "--model-arg", action="append", default=None, help=f"KEY=VALUE (default: {' '.join(GPT_17M)})"
    )
    p.add_argument("--baseline-model-arg", action="append", default=None, help=f"(default: {' '.join(TINY)})")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the tiny-model runs")
    p.add_argument("--allocator", default="package", choices=ALLOCATORS)
    p.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE given to the ranks (e.g. MALLOC_ARENA_MAX=2)"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG of the whole-run peaks against the formulas")
    p.add_argument("--report", type=Path, default=None, help="print the tables of a --json file; run nothing")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model_arg = args.model_arg if args.model_arg is not None else GPT_17M
    args.baseline_model_arg = args.baseline_model_arg if args.baseline_model_arg is not None else TINY
    if not args.worker and args.report is None:
        args.strategies = args.strategies.split(",")
        args.precisions = args.precisions.split(",")
        args.devices = [int(n) for n in args.devices.split(",")]
        bad = [s for s in args.strategies if s not in STRATEGIES] + [
            q for q in args.precisions if q not in PRECISIONS
        ]
        if bad:
            p.error(f"unknown strategy or precision {bad}; known: {STRATEGIES} {PRECISIONS}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.report is not None:
        record = json.loads(args.report.read_text())
    else:
        record = {
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": machine(),
            "runs": [],
        }
        for run in plan(args):
            with tempfile.TemporaryDirectory(prefix="bench_memory_") as folder:
                result = launch(run, args, Path(folder))
            record["runs"].append(result)
            peaks = " / ".join(f"{r['whole_run_peak_mb']:.0f}" for r in result["ranks"])
            print(f"{run.key()}: whole-run peak {peaks} MiB ({result['wall_s']:.0f} s)", flush=True)
            if args.json is not None:  # keep what is done if a later run fails
                args.json.write_text(json.dumps(record, indent=1))
    print(tables(record))
    if args.plot is not None:
        plot(record, args.plot)


if __name__ == "__main__":
    main()
