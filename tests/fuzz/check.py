"""Fit programs at every stage on two ranks and in one process, and say what differs."""

from __future__ import annotations

import functools

from tests.fuzz.program import Outcome, Program, fit
from tests.matrix.runner import run_jobs

STAGES = (0, 1, 2, 3)
TOL = 1e-5  # fp32: the stages add the same terms in other orders
BF16_TOL = 2e-2  # bf16-mixed: bf16 parameters with fp32 masters against autocast over fp32 ones


def run_programs(programs: list[Program], out_dir: str) -> dict[Program, dict]:
    """Per program: {None: the reference's outcome, stage: [rank 0's, rank 1's]}. Every fit of the
    list runs in one pair of processes; the reference on rank 0 alone, in a Trainer of one device."""
    jobs, keys = [], []
    for program in programs:
        for stage in (None, *STAGES):
            jobs.append(functools.partial(fit, program, stage))
            keys.append((program, stage))
    timeout = 60 + 25 * len(jobs)
    ranks = run_jobs(jobs, out_dir, world=2, timeout=timeout)
    out: dict[Program, dict] = {}
    for i, (program, stage) in enumerate(keys):
        out.setdefault(program, {})[stage] = ranks[0][i] if stage is None else [ranks[0][i], ranks[1][i]]
    return out


def _diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(((a[k] - b[k]).abs().max().item() for k in a), default=0.0)


def _relative_diff(a: dict, b: dict) -> float:
    """As :func:`_diff`, each difference relative to the reference's magnitude (bf16 rounds relatively)."""
    if a.keys() != b.keys():
        return float("inf")
    return max((((a[k] - b[k]).abs() / (1 + b[k].abs())).max().item() for k in a), default=0.0)


def _list_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def _list_relative_diff(a: list[float], b: list[float]) -> float:
    """As :func:`_list_diff`, each difference relative to the reference's value (bf16 rounds relatively)."""
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)


def problems(program: Program, outcomes: dict) -> list[str]:
    """What is wrong with the program's fits (an empty list when nothing is)."""
    reference: Outcome = outcomes[None]
    if reference.error:
        return [f"{program.name}: the reference raised {reference.error}"]
    out = []
    for stage in STAGES:
        ranks: list[Outcome] = outcomes[stage]
        name = f"zero{stage} {program.name}"
        errors = [f"{name}: rank {r} raised {res.error}" for r, res in enumerate(ranks) if res.error]
        if errors:
            out += errors
            continue
        out += _compare(name, ranks, reference, TOL if program.precision == "32-true" else BF16_TOL)
    return out


def _compare(name: str, ranks: list[Outcome], reference: Outcome, tol: float) -> list[str]:
    out = []
    first = ranks[0]
    against = _diff if tol == TOL else _relative_diff  # against the reference
    against_list = _list_diff if tol == TOL else _list_relative_diff
    if (d := _diff(first.params, ranks[1].params)) != 0.0:
        out.append(f"{name}: the ranks' parameters after fit differ by {d:.2e}")
    if (d := against(first.params, reference.params)) > tol:
        out.append(f"{name}: parameters after fit differ from the reference by {d:.2e}")
    mean = [(a + b) / 2 for a, b in zip(first.losses, ranks[1].losses)]
    if len(first.losses) != len(ranks[1].losses) or against_list(mean, reference.losses) > tol:
        out.append(f"{name}: losses {mean} differ from the reference's {reference.losses}")
    if first.count != reference.count:
        out.append(
            f"{name}: a callback counts {first.count} parameter elements, the reference {reference.count}"
        )
    if (d := against(first.ema, reference.ema)) > tol:
        out.append(f"{name}: the EMA callback's copy differs from the reference's by {d:.2e}")
    val = [(a + b) / 2 for a, b in zip(first.val_losses, ranks[1].val_losses)]
    if len(first.val_losses) != len(ranks[1].val_losses) or against_list(val, reference.val_losses) > tol:
        out.append(f"{name}: validation losses {val} differ from the reference's {reference.val_losses}")
    relative = [a / max(1.0, abs(b)) for a, b in zip(first.norms, reference.norms)]
    scaled = [b / max(1.0, abs(b)) for b in reference.norms]
    if len(first.norms) != len(reference.norms) or _list_diff(relative, scaled) > max(tol, 1e-4):
        out.append(f"{name}: the norms a callback logged {first.norms} differ from {reference.norms}")
    for r, res in enumerate(ranks):
        if len(res.hook_states) != len(reference.hook_states) or any(
            against(a, b) > tol for a, b in zip(res.hook_states, reference.hook_states)
        ):
            out.append(f"{name}: rank {r}'s on_save_checkpoint saw another state_dict than the reference's")
    if reference.saved is not None:
        saved = first.saved or {}
        for key, want in reference.saved.items():
            if key not in saved or against(saved[key], want) > (1e-2 if key == "export" else tol):
                out.append(f"{name}: the saved file's {key!r} differs from the reference's")
    return out


def assert_all_like_reference(results: dict[Program, dict]) -> None:
    found = [p for program, outcomes in results.items() for p in problems(program, outcomes)]
    assert not found, f"{len(found)} problem(s):\n" + "\n".join(found)
