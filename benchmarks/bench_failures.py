"""How long each fault takes to end every rank: the figures of docs/failures.md.

    python benchmarks/bench_failures.py            # every fault once, 2 CPU ranks (gloo)
    python benchmarks/bench_failures.py --only killed,sigterm

Each fault runs the training scenario of the fault tests (tests/integration/fault_scenarios.py:
a small regression model, ZeroStrategy on 2 processes started like torchrun starts them) and
reports, per rank, the exit status and the seconds from the fault to that rank's exit. "The
fault" is the moment the rank that misbehaves prints the last step before it (the error, the
kill, the NaN, the last batch follow within milliseconds), or the moment the signal is sent.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.ranks import Ranks, exit_times, start  # noqa: E402


def marked(ranks: Ranks, rank: int, text: str) -> float:
    """Seconds from start until rank ``rank`` printed ``text`` (the fault follows at once)."""
    ranks.wait_for_text(rank, text, timeout=240)
    return time.monotonic() - ranks.started


def unused(out: Path) -> tuple[Ranks, float]:
    ranks = start("unused", 2, out, model={"unused_on": 0, "unused_from": 2}, max_steps=6)
    return ranks, marked(ranks, 0, "rank 0 step 2\n")  # the next backward raises


def killed(out: Path) -> tuple[Ranks, float]:
    ranks = start("killed", 2, out, kill={"rank": 1, "step": 3, "signal": "SIGKILL"}, max_steps=8)
    return ranks, marked(ranks, 1, "rank 1 step 3\n")  # killed as the next batch starts


def sigterm(out: Path) -> tuple[Ranks, float]:
    ranks = start("sigterm", 2, out, max_steps=40, default_samples=16)
    marked(ranks, 1, "rank 1 step 3\n")
    ranks.procs[1].send_signal(signal.SIGTERM)
    return ranks, time.monotonic() - ranks.started


def sigterm_in_save(out: Path) -> tuple[Ranks, float]:
    options = dict(
        signal_in_save={"rank": 0, "signal": "SIGTERM", "times": 2}, checkpoint_every=2, max_steps=8
    )
    ranks = start("sigterm-in-save", 2, out, default_samples=16, **options)
    return ranks, marked(ranks, 0, "signals itself while saving")


def nan_stop(out: Path) -> tuple[Ranks, float]:
    options = dict(strategy={"stage": 2, "nonfinite_grads": "stop"}, model={"nan_on": 1, "nan_at": 3})
    ranks = start("nan-stop", 2, out, max_steps=6, **options)
    return ranks, marked(ranks, 1, "rank 1 step 3\n")  # the next loss is NaN


def uneven(out: Path) -> tuple[Ranks, float]:
    ranks = start("uneven", 2, out, samples={"0": 64, "1": 48}, distributed_sampler=False, max_steps=20)
    return ranks, marked(ranks, 1, "rank 1 step 5\n")  # the next batch is rank 1's last


FAULTS = {
    "unused": (unused, "a parameter unused on rank 0 (UnusedParametersError)"),
    "killed": (killed, "rank 1 SIGKILLed at step 3"),
    "sigterm": (sigterm, "SIGTERM to rank 1 during training"),
    "sigterm_in_save": (sigterm_in_save, "SIGTERM (twice) to rank 0 while it writes a full checkpoint"),
    "nan_stop": (nan_stop, "NaN loss on rank 1, nonfinite_grads=stop"),
    "uneven": (uneven, "rank 0 has 8 batches, rank 1 has 6"),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(FAULTS), help="comma-separated: " + ", ".join(FAULTS))
    args = parser.parse_args()
    print("| fault | rank 0: status, s after the fault | rank 1: status, s after the fault |")
    print("|---|---|---|")
    for name in args.only.split(","):
        run, label = FAULTS[name]
        with tempfile.TemporaryDirectory() as tmp:
            ranks, fault_at = run(Path(tmp))
            ended = exit_times(ranks)
        codes = [p.returncode for p in ranks.procs]
        cells = [f"{code}, {end - fault_at:.1f}" for code, end in zip(codes, ended)]
        print(f"| {label} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
