"""Checkpoint save and load of the example GPT: time and peak memory per rank, full vs sharded.

    python benchmarks/bench_checkpoint.py                         # gpt_small, zero1 and zero3, N = 2 and 4
    python benchmarks/bench_checkpoint.py --stages 3 --world-sizes 4 --repeats 5 --json ckpt.json
    python benchmarks/bench_checkpoint.py --model-arg n_layer=8 --model-arg n_embd=256

For each (stage, N, form) a fresh interpreter (this script with ``--one``) trains the model
``--steps`` optimizer steps on N CPU processes (gloo, fork), so that the optimizer holds its state,
then, on every rank, ``--repeats`` times: ``trainer.save_checkpoint`` (the whole of Lightning's save:
gathering or slicing the state, writing, renaming), then the strategy's restore path as a resume
runs it (``load_checkpoint``, ``load_model_state_dict``, ``load_optimizer_state_dict``) into the
live model. Times are wall seconds per rank, the median over repeats. Peak memory is the rise of
the process's resident set during the phase: the kernel's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` at the start) minus the resident set at the start (``VmRSS``); the runs
set ``MALLOC_MMAP_THRESHOLD_`` so that large allocations are mapped and unmapped one by one and
the resident set follows the live tensors.

Forms: ``full`` (rank 0 writes one file, optimizer state gathered to rank 0 only), ``sharded``
(each rank writes its shards through torch.distributed.checkpoint), and ``full-allgather``: the
full form with the optimizer state consolidated the way it was before this release (every rank
all-gathers each flat space and keeps the whole consolidated state), for comparison.
Results in docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: make `examples`, `benchmarks` importable
    sys.path.insert(0, str(REPO_ROOT))

FORMS = ("full", "full-allgather", "sharded")  # what --forms accepts
MIB = 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="1,3", help="comma-separated ZeRO stages")
    p.add_argument("--world-sizes", default="2,4", help="comma-separated N (CPU processes)")
    p.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated, of {', '.join(FORMS)}")
    p.add_argument("--repeats", type=int, default=3, help="saves and loads per run (median reported)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps before the first save")
    p.add_argument("--model", default="gpt_small", help="configs/model/<name>.yaml")
    p.add_argument(
        "--model-arg", action="append", default=[], metavar="KEY=VALUE", help="override a model field"
    )
    p.add_argument("--batch-size", type=int, default=4, help="samples per batch on each rank")
    p.add_argument("--json", type=Path, default=None, help="also write every rank's figures here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one run, JSON spec
    return p.parse_args(argv)


# --------------------------------------------------------------------------- inside one run


def _memory_kib() -> dict[str, int]:
    status = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+)", status).group(1)) for key in ("VmRSS", "VmHWM")}


class Phase:
    """Wall time and peak resident-set rise of one phase of this process."""

    def __enter__(self) -> Phase:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.rss = _memory_kib()["VmRSS"]
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.start
        self.peak_mib = (_memory_kib()["VmHWM"] - self.rss) / 1024


def _strategy_class():
    import lightning_zero

    class AllGatherConsolidation(lightning_zero.ZeroStrategy):
        """The full form with the optimizer state consolidated on every rank (the previous way)."""

        def optimizer_state(self, optimizer):
            index = self._optimizer_index(optimizer)
            return self.engine.optimizer_state(self.optimizers[index], index)

    return AllGatherConsolidation


def _measure(trainer: Any, path: str, repeats: int) -> dict[str, Any]:
    strategy = trainer.strategy
    saves, loads = [], []
    for _ in range(repeats):
        strategy.barrier()
        with Phase() as save:
            trainer.save_checkpoint(path)
        saves.append(save)
        strategy.barrier()
        with Phase() as load:
            checkpoint = strategy.load_checkpoint(path)
            strategy.load_model_state_dict(checkpoint)
            strategy.load_optimizer_state_dict(checkpoint)
            del checkpoint
        loads.append(load)
    size = (
        sum(f.stat().st_size for f in Path(path).rglob("*")) if os.path.isdir(path) else os.path.getsize(path)
    )
    return {
        "rank": trainer.global_rank,
        "save_s": statistics.median(s.seconds for s in saves),
        "save_peak_mib": statistics.median(s.peak_mib for s in saves),
        "load_s": statistics.median(s.seconds for s in loads),
        "load_peak_mib": statistics.median(s.peak_mib for s in loads),
        "checkpoint_mib": size / MIB,
    }


def run_one(spec: dict[str, Any]) -> None:
    """One (stage, N, form): train, then save and load ``repeats`` times on every rank."""
    import lightning as L

    import lightning_zero
    from benchmarks._run_one import model_config
    from examples.data import CharDataModule
    from examples.gpt import GPTLightning

    cfg = model_config(spec["model"], spec["model_args"])
    data = CharDataModule(
        block_size=cfg["block_size"],
        batch_size=spec["batch_size"],
        num_train_samples=spec["steps"] * spec["batch_size"] * spec["world"],
    )
    kind = "sharded" if spec["form"] == "sharded" else "full"
    cls = _strategy_class() if spec["form"] == "full-allgather" else lightning_zero.ZeroStrategy
    extra = {"wrap_policy": "examples.gpt.Block"} if spec["stage"] == 3 else {}
    strategy = cls(stage=spec["stage"], state_dict_type=kind, start_method="fork", **extra)
    out = Path(spec["out"])

    class Measure(L.Callback):
        def on_train_end(self, trainer, pl_module):
            record = _measure(trainer, str(out.parent / "bench.ckpt"), spec["repeats"])
            record["params"] = params
            Path(f"{out}.rank{trainer.global_rank}").write_text(json.dumps(record))

    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=spec["world"],
        max_steps=spec["steps"],
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out.parent),
        callbacks=[Measure()],
    )
    model = GPTLightning(vocab_size=data.vocab_size, **cfg)
    params = sum(p.numel() for p in model.parameters())
    trainer.fit(model, datamodule=data)
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(spec["world"])]
    out.write_text(json.dumps(ranks))


# --------------------------------------------------------------------------- the sweep


def _launch(spec: dict[str, Any]) -> list[dict[str, Any]]:
    # every allocation over 64 KiB its own mapping, returned on free: the resident set follows the
    # live tensors, instead of the allocator reusing memory freed by training without a trace
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run {spec} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(Path(spec["out"]).read_text())


def _table(rows: list[dict[str, Any]]) -> str:
    """One line per (stage, N, form): times are the slowest rank's; peaks rank 0's and the largest
    of the other ranks' (rank 0 alone writes the full form)."""
    lines = [
        "| stage | N | form | save s | save peak MiB, rank 0 / others | load s | load peak MiB | on disk MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["stage"], r["world"], r["form"]) for r in rows))
    for stage, world, form in keys:
        group = [r for r in rows if (r["stage"], r["world"], r["form"]) == (stage, world, form)]
        rank0 = next(r for r in group if r["rank"] == 0)
        others = max((r["save_peak_mib"] for r in group if r["rank"] != 0), default=float("nan"))
        lines.append(
            f"| zero{stage} | {world} | {form} | {max(r['save_s'] for r in group):.2f} | "
            f"{rank0['save_peak_mib']:.0f} / {others:.0f} | {max(r['load_s'] for r in group):.2f} | "
            f"{max(r['load_peak_mib'] for r in group):.0f} | {rank0['checkpoint_mib']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one is not None:
        run_one(json.loads(args.one))
        return
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise SystemExit(f"--forms: unknown {unknown}; known: {', '.join(FORMS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as root:
        for stage in (int(s) for s in args.stages.split(",")):
            for world in (int(n) for n in args.world_sizes.split(",")):
                for form in forms:
                    run_dir = Path(root) / f"zero{stage}-{world}-{form}"
                    run_dir.mkdir()
                    spec = {
                        "stage": stage,
                        "world": world,
                        "form": form,
                        "repeats": args.repeats,
                        "steps": args.steps,
                        "model": args.model,
                        "model_args": args.model_arg,
                        "batch_size": args.batch_size,
                        "out": str(run_dir / "ranks.json"),
                    }
                    for rank in _launch(spec):
                        rows.append({"stage": stage, "world": world, "form": form, **rank})
                    print(f"zero{stage} N={world} {form}: done", file=sys.stderr, flush=True)
    params = rows[0]["params"] if rows else 0
    print(
        f"model {args.model} {' '.join(args.model_arg)}: {params:,} parameters "
        f"(fp32 weights {4 * params / MIB:.1f} MiB, AdamW moments {8 * params / MIB:.1f} MiB)"
    )
    print(_table(rows))
    if args.json is not None:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
