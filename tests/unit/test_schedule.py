"""The learned schedule of collectives expected without a check ([Note: learned schedule] in
lightning_zero/comm/checks.py): what it expects, when, and what it never expects."""

from __future__ import annotations

from lightning_zero.comm.checks import MAX_KNOWN, TRUST_AFTER, Schedule

# stage 3's step for three units: one unit's all-gather is followed by different collectives in
# forward and in backward, so one collective alone cannot tell what comes next
STEP = [
    ("all_gather", 576, "unit=body"),
    ("all_gather", 72, "unit=head"),
    ("all_gather", 72, "unit=extra"),
    ("all_gather", 72, "unit=extra"),
    ("all_gather", 72, "unit=head"),
    ("reduce_scatter", 72, "unit=extra"),
    ("all_gather", 576, "unit=body"),
    ("reduce_scatter", 72, "unit=head"),
    ("reduce_scatter", 576, "unit=body"),
]


def _run(schedule: Schedule, steps: list[list[tuple]], expectable=lambda sig: True) -> list[str]:
    """'E' where the collective was expected (issued unchecked), 'C' where it was checked."""
    marks = []
    for step in steps:
        for sig in step:
            if schedule.expected() == sig:
                schedule.followed(sig)
                marks.append("E")
            else:
                schedule.checked(sig, expectable=expectable(sig))
                marks.append("C")
    return marks


def test_a_repeated_step_is_expected_after_it_was_checked_twice():
    marks = _run(Schedule(), [STEP] * 5)
    per_step = [marks[i : i + len(STEP)] for i in range(0, len(marks), len(STEP))]
    assert TRUST_AFTER == 2
    assert all(m == "C" for m in per_step[0] + per_step[1])  # learned over two steps
    assert all(m == "E" for m in per_step[3] + per_step[4]), per_step


def test_a_change_is_checked_and_learned_again():
    schedule = Schedule()
    _run(schedule, [STEP] * 4)
    changed = [STEP[1], STEP[0], *STEP[2:]]
    marks = _run(schedule, [changed])
    assert marks[0] == "C"  # not the expected one: checked (the deviation)
    assert _run(schedule, [changed] * 3)[-len(STEP) :] == ["E"] * len(STEP)


def test_never_expected_when_turned_off_or_not_expectable():
    assert set(_run(Schedule(trust_after=None), [STEP] * 5)) == {"C"}
    lightning = ("lightning", 0, "lightning/reduce")
    marks = _run(Schedule(), [[*STEP, lightning]] * 5, expectable=lambda sig: sig != lightning)
    assert all(m == "C" for m in marks[len(STEP) :: len(STEP) + 1])  # Lightning's own, every step
    assert marks[-2] == "E"


def test_names_made_anew_every_step_never_grow_it_without_end():
    schedule = Schedule()
    steps = [
        [("all_reduce", 4, f"step={i}/bucket=0"), ("all_reduce", 4, "bucket=1")] for i in range(3 * MAX_KNOWN)
    ]
    marks = _run(schedule, steps)
    assert set(marks) == {"C"}  # nothing repeats: everything checked
    assert len(schedule._next) <= MAX_KNOWN
