"""Every stage against a one-process reference, over the ways people train.

Factors: precision {32-true, bf16-mixed, bf16-true} x accumulate {1, 3} x activation checkpointing
{none, non-reentrant, reentrant} x {automatic, manual with two backward passes}, each case under
zero0, zero1, zero2 and zero3 with prefetch on and off; plus clipping, frozen parameters, unused
parameters with weight decay, AdamW (fp32 only: Adam's normalised step turns bf16 rounding into
lr-sized differences), torch.compile (each block in the default suite; the whole net and the
LightningModule under ``slow``), and a full checkpoint saved after ``fit`` returned. The default
suite runs a set of cases that covers every pair of factor values (all-pairs); ``-m slow`` runs the
whole product. All fits of one suite share one pair of processes (tests/matrix/runner.py).

What is compared, per case and variant: both ranks end with the same parameters (exactly); the
parameters equal the reference's (fp32: to 1e-5, and zero0's to 1e-6; bf16: within a few bf16
roundings, since the stages round sums in different orders: stages 2-3 add each micro-batch's
reduced shard in fp32, zero0 adds the local bf16 gradients before reducing once); the
mean of the ranks' losses equals the reference's loss at every micro-batch; frozen parameters end
with their dtype and values; after fit, a saved checkpoint's optimizer state equals the reference's.
"""

from __future__ import annotations

import itertools

import pytest

from tests.matrix.lit import Case
from tests.matrix.runner import Result, Run, run_all

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
ACCUMULATE = (1, 3)
CHECKPOINTING = ("none", "nonreentrant", "reentrant")
MANUAL = (False, True)
VARIANTS = ((0, True), (1, True), (2, True), (3, True), (3, False))  # (stage, prefetch)
EXTRAS = (  # options on top of a base case, each once
    Case(clip=0.05),
    Case(manual=True, clip=0.05, accumulate=3),
    Case(frozen=True, precision="bf16-mixed"),
    Case(frozen=True, checkpointing="nonreentrant"),
    Case(unused=True, accumulate=3),
    Case(unused=True, optimizer="adamw", manual=True),
    Case(compile="blocks"),
)
COMPILED = (  # slow: each compiles its graphs (aot_eager) afresh in every process
    Case(compile="net"),
    Case(compile="module", accumulate=3),
    Case(compile="blocks", checkpointing="nonreentrant", precision="bf16-mixed"),
)
SAVE_AFTER_FIT = (Case(), Case(optimizer="adamw", accumulate=3, checkpointing="reentrant"))


def all_pairs() -> list[Case]:
    """A small set of cases in which every pair of values of two factors appears (greedy)."""
    factors = (PRECISIONS, ACCUMULATE, CHECKPOINTING, MANUAL)
    full = list(itertools.product(*factors))
    uncovered = {
        (i, a, j, b) for i, j in itertools.combinations(range(4), 2) for a in factors[i] for b in factors[j]
    }
    chosen = []
    while uncovered:
        best = max(
            full,
            key=lambda row: sum(
                (i, row[i], j, row[j]) in uncovered for i, j in itertools.combinations(range(4), 2)
            ),
        )
        chosen.append(best)
        uncovered -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(4), 2)}
    return [Case(precision=p, accumulate=a, checkpointing=c, manual=m) for p, a, c, m in chosen]


def full_product() -> list[Case]:
    rows = itertools.product(PRECISIONS, ACCUMULATE, CHECKPOINTING, MANUAL)
    return [Case(precision=p, accumulate=a, checkpointing=c, manual=m) for p, a, c, m in rows]


def _runs(cases: list[Case]) -> tuple[list[Run], list[Run]]:
    references = [Run(c, None, save_after_fit=c in SAVE_AFTER_FIT) for c in cases]
    runs = [
        Run(c._replace(prefetch=prefetch), stage, save_after_fit=c in SAVE_AFTER_FIT)
        for c in cases
        for stage, prefetch in VARIANTS
    ]
    return references, runs


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _tolerances(case: Case) -> tuple[float, float]:
    """(parameters, losses) against the reference. bf16 keeps 8 bits: parameters of order 1 within a
    few roundings; bf16-true losses near 3.6 are bf16 numbers themselves, 1/64 apart."""
    if case.precision == "32-true":
        return 1e-5, 1e-5
    return 2e-2, 4e-2 if case.precision == "bf16-true" else 2e-2


def _check(run: Run, ranks: list[Result], reference: Result, zero0: Result | None) -> list[str]:
    """What is wrong with one fit (an empty list when nothing is)."""
    name = f"zero{run.stage}{'' if run.case.prefetch else '-noprefetch'} {run.case.name}"
    errors = [f"{name}: rank {r} raised {res.error}" for r, res in enumerate(ranks) if res.error]
    if errors or reference.error:
        return errors + ([f"reference raised {reference.error}"] if reference.error else [])
    tol, loss_tol = _tolerances(run.case)
    out = []
    if _max_diff(ranks[0].params, ranks[1].params) != 0.0:
        out.append(f"{name}: ranks differ by {_max_diff(ranks[0].params, ranks[1].params):.2e}")
    if (d := _max_diff(ranks[0].params, reference.params)) > tol:
        out.append(f"{name}: parameters differ from the reference by {d:.2e} (> {tol:.0e})")
    if zero0 is not None and tol < 1e-4 and (d := _max_diff(ranks[0].params, zero0.params)) > 1e-6:
        out.append(f"{name}: parameters differ from zero0's by {d:.2e}")
    mean = [(a + b) / 2 for a, b in zip(ranks[0].losses, ranks[1].losses)]
    if (
        len(mean) != len(reference.losses)
        or max(abs(a - b) for a, b in zip(mean, reference.losses)) > loss_tol
    ):
        out.append(f"{name}: losses {mean} differ from the reference's {reference.losses}")
    if ranks[0].dtypes != reference.dtypes:
        out.append(f"{name}: parameter dtypes after fit {ranks[0].dtypes} differ from the reference's")
    if run.save_after_fit:
        out += _check_saved(name, ranks[0].optimizer, reference.optimizer, tol)
    return out


def _check_saved(name: str, saved: dict | None, reference: dict | None, tol: float) -> list[str]:
    if saved is None or saved["state"].keys() != reference["state"].keys():
        return [f"{name}: the checkpoint saved after fit holds other optimizer entries than the reference's"]
    worst = max(
        (v.float() - reference["state"][i][k].float()).abs().max().item()
        for i, entry in saved["state"].items()
        for k, v in entry.items()
    )
    return [f"{name}: optimizer state saved after fit differs by {worst:.2e}"] if worst > tol else []


def _run_matrix(cases: list[Case], tmp_path) -> None:
    references, runs = _runs(cases)
    ref = dict(
        zip(cases, run_all(references, str(tmp_path / "reference"), world=1, timeout=60 + 20 * len(cases))[0])
    )
    ranks = run_all(runs, str(tmp_path / "ranks"), world=2, timeout=120 + 10 * len(runs))
    zero0 = {run.case._replace(prefetch=True): ranks[0][i] for i, run in enumerate(runs) if run.stage == 0}
    errors = []
    for i, run in enumerate(runs):
        base = run.case._replace(prefetch=True)
        other = zero0[base] if run.stage else None
        errors += _check(run, [ranks[0][i], ranks[1][i]], ref[base], other)
    assert not errors, f"{len(errors)} of {len(runs)} fits are off:\n" + "\n".join(errors)


def test_all_pairs_and_extras(tmp_path):
    cases = all_pairs() + [c for c in EXTRAS + SAVE_AFTER_FIT]
    assert len(all_pairs()) <= 10
    _run_matrix(list(dict.fromkeys(cases)), tmp_path)


@pytest.mark.slow
def test_full_product(tmp_path):
    _run_matrix(full_product(), tmp_path)


@pytest.mark.slow
def test_compiled(tmp_path):
    """torch.compile of each block, of the whole net (units inside the compiled region) and of the
    LightningModule (Lightning compiles its steps): the reference's parameters at every stage."""
    _run_matrix(list(COMPILED), tmp_path)
