"""The differential fuzzer: random programs at zero0-3 on two ranks against one process.

Hypothesis draws :class:`~tests.fuzz.program.Program`s: tied and shared parameters (at the root,
across units), a block called twice, keyword-argument calls, a frozen weight with a trainable
adapter in one unit, both kinds of activation checkpointing (with a captured root parameter),
unused branches, manual optimization with 1-3 steps per batch returning the loss, penalties over
``self.parameters()``, callbacks reading and copying parameters, ``on_save_checkpoint`` edits, and
an error raised and caught inside backward, and Lightning's own callbacks (ModelSummary,
EMAWeightAveraging, ModelCheckpoint). Each program fits at every stage and once with plain
Lightning in one process; ``check.problems`` lists what differs.

The default suite runs a fixed corpus (derandomized, one batch of programs in one pair of
processes); ``make test-slow`` runs many more, each example a batch of its own. Every failure found
becomes a named program in ``test_regressions.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.fuzz.check import assert_all_like_reference, run_programs
from tests.fuzz.program import ZERO3_OPTIONS, Program

CORPUS = 6  # programs in the default suite's corpus


@st.composite
def programs(draw: st.DrawFn) -> Program:
    blocks = draw(st.integers(1, 3))
    manual = draw(st.sampled_from([0, 0, 1, 2, 3]))
    backward_error = manual > 0 and draw(st.booleans())
    checkpointing = draw(st.sampled_from(["none", "nonreentrant", "reentrant"]))
    optimizer = draw(st.sampled_from(["sgd", "adamw"]))
    # bf16 with SGD and automatic optimization only: Adam's normalised step, and several manual
    # steps per batch at this learning rate, turn bf16 rounding into differences above the tolerance
    bf16_ok = optimizer == "sgd" and manual == 0
    precision = draw(st.sampled_from(["32-true", "bf16-mixed"])) if bf16_ok else "32-true"
    return Program(
        blocks=blocks,
        tie=draw(st.sampled_from(["none", "root", "across"] if blocks > 1 else ["none", "root"])),
        twice=draw(st.booleans()),
        kwargs=draw(st.booleans()),
        adapter=draw(st.booleans()),
        checkpointing=checkpointing,
        captured=draw(st.booleans()),
        unused=draw(st.booleans()),
        manual=manual,
        accumulate=1 if manual else draw(st.sampled_from([1, 2])),
        clip=None if manual else draw(st.sampled_from([None, 0.5])),
        penalty=draw(st.sampled_from([0.0, 0.01])),
        optimizer=optimizer,
        ema=draw(st.booleans()),
        save_hook=draw(st.booleans()),
        backward_error=backward_error,
        lightning_callbacks=draw(st.booleans()),
        sharded_checkpoint=draw(st.booleans()),
        validate=draw(st.booleans()),
        precision=precision,
        zero3=draw(st.sampled_from(list(ZERO3_OPTIONS))),
    )


_QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]


@settings(
    max_examples=1,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],
    suppress_health_check=_QUIET,
)
@given(corpus=st.lists(programs(), min_size=CORPUS, max_size=CORPUS, unique=True))
def test_seed_corpus(corpus, tmp_path):
    assert_all_like_reference(run_programs(corpus, str(tmp_path / "corpus")))


@pytest.mark.slow
@settings(max_examples=25, database=None, deadline=None, suppress_health_check=_QUIET)
@given(batch=st.lists(programs(), min_size=3, max_size=3, unique=True))
def test_random_programs(batch, tmp_path_factory):
    assert_all_like_reference(run_programs(batch, str(tmp_path_factory.mktemp("fuzz"))))
