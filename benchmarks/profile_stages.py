"""Where each strategy's step time goes: one profiled run per strategy, a table of milliseconds per step.

    python benchmarks/profile_stages.py                                   # gpt_small
    python benchmarks/profile_stages.py --model-arg n_layer=6 --model-arg n_embd=384 --batch-size 8

Each strategy runs ``_run_one.py --profile-from WARMUP`` (rank 0 under cProfile from that step on,
see ``StepProfile`` there) once, in this order; the table gives each bucket per step and the
package's most expensive functions. cProfile slows Python code, so compare strategies by bucket,
not with the timed runs of ``bench_step_time.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_step_time import add_run_arguments  # noqa: E402

BUCKETS = ("package python", "package tensor ops", "collectives", "rest")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", default="ddp,zero0,zero1,zero2,zero3,fsdp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps before profiling starts")
    p.add_argument("--json", type=Path, default=None, help="write every strategy's buckets here")
    add_run_arguments(p)
    args, _ = p.parse_known_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    passed = _without(given, ("--strategies", "--steps", "--warmup", "--json"))  # the rest: for the runs
    results = {}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory(prefix="profile_") as tmp:
        for name in args.strategies.split(","):
            out = Path(tmp) / f"{name}.json"
            command = [sys.executable, str(REPO_ROOT / "benchmarks" / "_run_one.py"), "--strategy", name]
            command += ["--out", str(out), "--steps", str(args.steps), "--profile-from", str(args.warmup)]
            subprocess.run(command + passed, check=True, env=env, cwd=REPO_ROOT)
            results[name] = json.loads(Path(f"{out}.profile.json").read_text())
    print(table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"argv": argv or sys.argv[1:], "results": results}, indent=1))


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less the given options and their values (``--opt V`` or ``--opt=V``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in options)):
            out.append(arg)
    return out


def table(results: dict) -> str:
    lines = ["| strategy | " + " | ".join(BUCKETS) + " | total |", "|---" * (len(BUCKETS) + 2) + "|"]
    for name, result in results.items():
        ms = result["ms_per_step"]
        cells = [f"{ms[b]:.1f}" for b in BUCKETS] + [f"{sum(ms.values()):.1f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, result in results.items():
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(result["top_package_ms"].items())[:4])
        if top:
            lines.append(f"- {name}: {top}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
