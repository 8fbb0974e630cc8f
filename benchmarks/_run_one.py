"""One timed training run of the example GPT on CPU processes (gloo); writes a JSON record.

    python benchmarks/_run_one.py --strategy zero1 --out /tmp/zero1.json
    python benchmarks/_run_one.py --strategy fsdp --model gpt_tiny --steps 20 --out /tmp/fsdp.json
    python benchmarks/_run_one.py --strategy zero2 --precision bf16-mixed --out /tmp/zero2_bf16.json

``bench_step_time.py`` runs this script once per (repeat, strategy, precision), so every run starts
in a fresh interpreter. Inside, ``Trainer(accelerator="cpu", devices=N, precision=P)`` launches the
ranks with the chosen start method (fork by default, the same for every strategy). Each rank times
its optimizer steps with a :class:`StepTimer` (``perf_counter`` from ``on_train_batch_start`` to
``on_train_batch_end``, no barrier; beside it the process's CPU time over the same interval) and,
at the end of training, records its peak RSS and its model-state bytes into ``OUT.rank<r>``; the
launching process merges these files into ``OUT``.

No validation, no checkpointing, no logger, no progress bar: only training steps are run.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: make `examples`, `benchmarks` importable
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, Strategy  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import lightning_zero  # noqa: E402
from benchmarks.bench_step_time import (  # noqa: E402
    DEFAULT_PRECISION,
    PRECISION_NAMES,
    QUANTIZED,
    STRATEGY_NAMES,
    add_run_arguments,
)
from benchmarks.fsdp_cpu import CPUFSDPStrategy  # noqa: E402
from examples.data import CharDataModule  # noqa: E402
from examples.gpt import GPTLightning  # noqa: E402
from lightning_zero.memory import measure  # noqa: E402
from tests.bigmodel.lit import quiet_trainer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", required=True, choices=STRATEGY_NAMES)
    p.add_argument("--out", required=True, type=Path, help="JSON file written by this run")
    p.add_argument(
        "--precision", default=DEFAULT_PRECISION, choices=PRECISION_NAMES, help="Trainer(precision=)"
    )
    p.add_argument("--steps", type=int, default=50, help="optimizer steps")
    p.add_argument(
        "--profile-from",
        type=int,
        default=None,
        metavar="STEP",
        help="rank 0 profiles its steps from STEP on (cProfile) into OUT.profile.json and OUT.pstats (see StepProfile)",
    )
    p.add_argument(
        "--guard",
        default="on",
        choices=("on", "off"),
        help="off: a ZeroStrategy run without its desync guard, to measure what the guard costs (see guard_off)",
    )
    p.add_argument(
        "--rss-every",
        type=int,
        default=0,
        metavar="STEPS",
        help="every rank records its resident set size every STEPS optimizer steps (0: not sampled)",
    )
    p.add_argument(
        "--validate", action="store_true", help="after fit, the validation loss over the held-out split"
    )
    p.add_argument(
        "--outliers",
        action="store_true",
        help="before fit, 3 weights of blocks[1]'s first MLP layer set to 1e4 times its mean magnitude (the guard's test)",
    )
    p.add_argument(
        "--perturb",
        type=float,
        default=0.0,
        metavar="EPS",
        help="before fit, every weight multiplied by 1 + EPS x N(0, 1), seeded apart from the run "
        "(how far a run's result moves from a tiny change of its start: the noise floor of a comparison)",
    )
    add_run_arguments(p)
    return p.parse_args(argv)


def guard_off() -> None:
    """Take the desync guard out of this process's ZeroStrategy runs (a measuring switch, not an option).

    The guard is two things ([Note: digest since the last agreement] in comm/tracker.py, [Note:
    steps agreed] in signals.py): every collective folded into a running digest and kept in the
    entries since the last agreement, and the agreement after every training batch that compares
    digests and step and backward counts. Off, collectives are numbered as before but not folded or
    kept, and no agreement runs after a batch (Lightning's own per-batch SIGTERM broadcast stays
    replaced, so the off run issues one collective per batch fewer than ddp). The per-collective
    check on gloo, which predates the guard, runs in both.
    """
    import time as _time

    from lightning_zero import signals
    from lightning_zero.comm import tracker

    def issue(self: tracker.CollectiveTracker, op: str, name: str, nbytes: int) -> tracker.Issued:
        self.seq += 1
        self.last, self.last_at = tracker.Issued(self.seq, op, name, nbytes), _time.monotonic()
        self.recent.append(self.last)
        return self.last

    def batch_end(self: Any, trainer: L.Trainer, *args: Any) -> None:
        self.boundary.after_batch(trainer)

    tracker.CollectiveTracker.issue = issue
    signals._StopAtStepEnd.on_train_batch_end = batch_end


def model_config(name: str, overrides: list[str]) -> dict[str, Any]:
    """The fields of ``configs/model/<name>.yaml``, with ``KEY=VALUE`` overrides applied."""
    path = REPO_ROOT / "configs" / "model" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(f.stem for f in path.parent.glob("*.yaml"))
        raise SystemExit(f"--model {name!r}: no {path}; known models: {', '.join(known)}")
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in cfg:
            raise SystemExit(f"--model-arg must be KEY=VALUE with KEY one of {sorted(cfg)}, got {item!r}")
        cfg[key] = ast.literal_eval(value)
    return cfg


def import_object(dotted: str) -> Any:
    """``"examples.gpt.Block"`` -> the class ``Block``."""
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def build_strategy(name: str, args: argparse.Namespace) -> Strategy | str:
    """The strategy object for ``name``; every one is launched with ``args.start_method``
    (``"auto"``: Lightning's choice, one device: its SingleDeviceStrategy, nothing launched)."""
    if name == "auto":
        return "auto"
    if name == "ddp":
        return DDPStrategy(start_method=args.start_method, bucket_cap_mb=args.bucket_cap_mb)
    if name == "fsdp":
        unit = import_object(args.wrap_policy)
        return CPUFSDPStrategy(start_method=args.start_method, auto_wrap_policy={unit})
    stage = int(name.removeprefix("zero")[0])
    extra = {"wrap_policy": args.wrap_policy, **QUANTIZED.get(name, {})} if stage == 3 else {}
    return lightning_zero.ZeroStrategy(
        stage=stage, start_method=args.start_method, bucket_cap_mb=args.bucket_cap_mb, **extra
    )


class StepTimer(L.Callback):
    """Wall time of every optimizer step on this rank, and the rank's state after the last one.

    Args:
        out: the run's JSON path; this rank writes ``<out>.rank<r>`` when training ends.
    """

    def __init__(self, out: Path, rss_every: int = 0) -> None:
        self.out = out  # the run's JSON file (rank files sit next to it)
        self.step_times: list[float] = []  # wall seconds per optimizer step, in order
        self.cpu_times: list[float] = []  # CPU seconds of this process (all threads) per step
        self.main_cpu_times: list[float] = []  # of those, the training thread's (the rest: the backend's)
        self.rss_every = rss_every  # sample the resident set size every this many steps (0: never)
        self.rss_kib: list[tuple[int, int]] = []  # (optimizer steps done, resident KiB)
        self._start: tuple[float, float, float] | None = None  # perf_counter, process_time, thread_time

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start = (time.perf_counter(), time.process_time(), time.thread_time())

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        assert self._start is not None
        wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
        self.step_times.append(wall - self._start[0])
        self.cpu_times.append(cpu - self._start[1])
        self.main_cpu_times.append(main - self._start[2])
        if self.rss_every and len(self.step_times) % self.rss_every == 0:
            self.rss_kib.append((len(self.step_times), resident_kib()))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {
            "rank": trainer.global_rank,
            "step_times_s": self.step_times,
            "cpu_times_s": self.cpu_times,
            "main_cpu_times_s": self.main_cpu_times,
            "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,  # KiB on Linux
            "rss_kib": self.rss_kib,
            "num_threads": torch.get_num_threads(),
            **model_state(trainer),
        }
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(record))


def resident_kib() -> int:
    """This process's resident set size now, KiB (Linux: /proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


class StepProfile(L.Callback):
    """Where rank 0's step time goes, from ``cProfile`` over steps ``start`` to the end.

    Every profiled call's own time (not its callees') falls in one bucket: ``package python``
    (functions of ``lightning_zero``), ``package tensor ops`` (torch calls made directly by them:
    copies, fills, views, flattening), ``collectives`` (``torch.distributed`` calls and the waits
    on their handles or on the locks a wait blocks on, wherever called from) and ``rest`` (the model, autograd, the optimizer,
    Lightning). cProfile slows Python code down, so the buckets are compared between strategies,
    not to the timed runs.
    """

    def __init__(self, out: Path, start: int) -> None:
        self.out, self.start = out, start
        self.profile: Any = None
        self.steps = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 0 and batch_idx == self.start:
            import cProfile

            self.profile = cProfile.Profile()
            self.profile.enable()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.profile is not None:
            self.steps += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profile is None:
            return
        self.profile.disable()
        Path(f"{self.out}.profile.json").write_text(json.dumps(profile_buckets(self.profile, self.steps)))
        self.profile.dump_stats(f"{self.out}.pstats")  # the whole profile, for `python -m pstats`


def profile_buckets(profile: Any, steps: int) -> dict[str, Any]:
    """Milliseconds per step in each bucket of :class:`StepProfile`, and the top package entries."""
    import pstats

    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, callers)
    package = f"{os.sep}lightning_zero{os.sep}"
    buckets = dict.fromkeys(("package python", "package tensor ops", "collectives", "rest"), 0.0)
    top: dict[str, float] = {}
    for (filename, _, name), (_, _, own, _, callers) in stats.items():
        if package in filename:
            bucket = "package python"
            key = f"{filename.split(package)[-1]}:{name}"
            top[key] = top.get(key, 0.0) + own
        elif f"{os.sep}torch{os.sep}distributed{os.sep}" in filename or any(w in name for w in _WAITS):
            bucket = "collectives"
        elif filename == "~" and any(package in caller[0] for caller in callers):
            bucket = "package tensor ops"
            # a builtin called from several places: charge the share called from the package
            total = sum(c[2] for c in callers.values()) or 1.0
            mine = sum(c[2] for caller, c in callers.items() if package in caller[0])
            buckets["rest"] += own * (1 - mine / total)
            own *= mine / total
        else:
            bucket = "rest"
        buckets[bucket] += own
    per_step = {k: v * 1e3 / max(steps, 1) for k, v in buckets.items()}
    ranked = sorted(top.items(), key=lambda kv: -kv[1])[:8]
    return {
        "steps": steps,
        "ms_per_step": per_step,
        "top_package_ms": {k: v * 1e3 / max(steps, 1) for k, v in ranked},
    }


# issuing and waiting: c10d's own calls, and the locks a wait in slices (or a waiter thread) blocks on
_WAITS = ("_distributed_c10d", "'acquire' of '_thread.lock'", "'acquire' of '_thread.RLock'")


def model_state(trainer: L.Trainer) -> dict[str, Any]:
    """Model-state bytes on this rank and, for ZeroStrategy, the last step's collectives.

    ``memory_report`` is the strategy's own account. For the baselines the same counting
    (``lightning_zero.memory.measure``: distinct storages of parameters, their ``.grad`` and the
    optimizer state) is applied to the wrapped model; torch DDP's gradient buckets and FSDP's
    unsharded padding buffers are not parameters or grads there, so they are not counted.
    """
    strategy = trainer.strategy
    if isinstance(strategy, lightning_zero.ZeroStrategy):
        report = strategy.memory_report()
        ledger = strategy.ledger
        last = ledger.steps()[-1] if ledger.steps() else None
        comm = {op: t._asdict() for op, t in ledger.totals(step=last).items()} if last is not None else {}
        return {
            "memory_report": report._asdict(),
            "memory_source": "memory_report",
            "last_step_comm": comm,
            "wait_s": dict(ledger.wait_totals()),  # per op, the whole run's time blocked in waits
            "fallbacks": fallbacks(strategy),
            **units_and_buckets(strategy),
        }
    params = list(trainer.model.parameters())
    report = measure(trainer.model, [p.grad for p in params if p.grad is not None], trainer.optimizers)
    return {"memory_report": report._asdict(), "memory_source": "measure", "last_step_comm": None}


def validation_loss(model: L.LightningModule, data: L.LightningDataModule, root: str) -> float:
    """The fitted weights' loss over the held-out split, in this (the launching) process on one
    device: the launcher has copied rank 0's weights back into ``model``."""
    trainer = quiet_trainer("auto", root, devices=1)
    return float(trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"])


def fallbacks(strategy: Any) -> dict[str, int]:
    """Stage 3 with int8 on the wire: per unit and kind, how often the accuracy guard fell back."""
    zero3 = getattr(strategy._run.state_engine, "zero3", None)
    out: dict[str, int] = {}
    for unit in zero3.units if zero3 is not None else ():
        if unit.trainable is not None and unit.trainable.wire is not None:
            out[f"{unit.name}/weights"] = unit.trainable.guard.fallbacks
        if unit.wire is not None:
            out[f"{unit.name}/grads"] = unit.guard.fallbacks
    return out


def units_and_buckets(strategy: Any) -> dict[str, int | None]:
    """How many stage-3 units and gradient buckets the run's engine holds (None: it has none)."""
    engine = strategy._run.state_engine
    zero3 = getattr(engine, "zero3", None)
    sync = getattr(getattr(engine, "wrapped", None), "sync", None)
    return {
        "units": len(zero3.units) if zero3 is not None else None,
        "buckets": len(sync.buckets) if zero3 is None and hasattr(sync, "buckets") else None,
    }


def merge_rank_files(out: Path, devices: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Read ``<out>.rank<r>`` for every rank, delete them, and write the merged record to ``out``."""
    ranks = []
    for rank in range(devices):
        part = Path(f"{out}.rank{rank}")
        if not part.is_file():
            raise SystemExit(f"rank {rank} wrote no record ({part}); did training finish?")
        ranks.append(json.loads(part.read_text()))
        part.unlink()
    record = {**meta, "ranks": ranks}
    out.write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    L.seed_everything(args.seed, workers=True, verbose=False)
    cfg = model_config(args.model, args.model_arg)
    data = CharDataModule(
        block_size=cfg["block_size"],
        batch_size=args.batch_size,
        num_train_samples=args.steps * args.batch_size * args.devices,  # one epoch = the run
        seed=args.seed,
    )
    model = GPTLightning(vocab_size=data.vocab_size, **cfg)
    if args.outliers:
        with torch.no_grad():
            weight = model.model.blocks[1].mlp.c_fc.weight
            weight[0, :3] = 1e4 * weight.abs().mean()
    if args.perturb:
        noise = torch.Generator().manual_seed(args.seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + args.perturb * torch.randn(p.shape, generator=noise))
    if args.guard == "off":
        guard_off()
    timer = StepTimer(args.out, args.rss_every)
    with tempfile.TemporaryDirectory(prefix="bench_") as root:
        trainer = quiet_trainer(
            build_strategy(args.strategy, args),
            root,
            devices=args.devices,
            max_epochs=None,
            callbacks=[timer]
            if args.profile_from is None
            else [timer, StepProfile(args.out, args.profile_from)],
            precision=args.precision,
            max_steps=args.steps,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        start = time.perf_counter()
        trainer.fit(model, datamodule=data)
        fit_s = time.perf_counter() - start
        val_loss = validation_loss(model, data, root) if args.validate else None
    num_params = sum(p.numel() for p in model.parameters())
    meta = {
        "strategy": args.strategy,
        "precision": args.precision,
        "model": args.model,
        "model_config": cfg,
        "num_parameters": num_params,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "bucket_cap_mb": args.bucket_cap_mb,
        "wrap_policy": args.wrap_policy,
        "devices": args.devices,
        "start_method": args.start_method,
        "seed": args.seed,
        "guard": args.guard,
        "fit_s": fit_s,
        "val_loss": val_loss,
        "outliers": args.outliers,
        "perturb": args.perturb,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    merge_rank_files(args.out, args.devices, meta)


if __name__ == "__main__":
    main()
