"""Regressions of stages 0-2's gradient reducer found by the fuzzer, and the mechanisms behind them.

Two programs failed at zero0-2 with "became ready twice": reentrant activation checkpointing of a
function that uses a root parameter it does not take as an input (every nested backward accumulates
into it: see [Note: late gradients] in ``grad_sync/reducer.py``), and an error raised inside backward,
caught by the user, then training on (see [Note: a backward that raised]). The first two tests run
them through the fuzzer's check; the check covers zero0-3, these tests keep to zero0-2.

The others train a small model on two ranks with the engines directly and compare with the same
model trained in one process on the whole batch: every bucket holds one parameter, so that the
order in which buckets are sent matters, and a probe in backward counts the buckets already sent.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import make_engine
from lightning_zero.grad_sync import broadcast_module_states
from lightning_zero.grad_sync.backward import EndOfBackward
from lightning_zero.grad_sync.reducer import LateGradientError
from tests.distributed.harness import run_ranks
from tests.fuzz.check import problems, run_programs
from tests.fuzz.program import Boom, Program, _RaiseInBackward

CAPTURED = Program(checkpointing="reentrant", captured=True)
CAUGHT = Program(manual=1, backward_error=True)
OURS = ("zero0", "zero1", "zero2")  # stage 3 has a reducer of its own
DIM, ROWS, STEPS, TOL = 8, 6, 3, 1e-5  # features, rows per rank, optimizer steps, fp32 tolerance


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory) -> dict:
    return run_programs([CAPTURED, CAUGHT], str(tmp_path_factory.mktemp("reducer")))


def _our_problems(program: Program, outcomes: dict) -> list[str]:
    return [line for line in problems(program, outcomes) if line.startswith(OURS)]


def test_reentrant_checkpointing_with_a_captured_root_parameter(fuzzed):
    assert not _our_problems(CAPTURED, fuzzed[CAPTURED])


def test_error_caught_inside_backward_then_training_on(fuzzed):
    assert not _our_problems(CAUGHT, fuzzed[CAUGHT])


# -- the mechanisms, on two ranks ------------------------------------------------------------------


class Probe(torch.autograd.Function):
    """Identity; its backward records how many buckets the reducer has sent so far."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, log: list, reducer: object) -> torch.Tensor:
        ctx.log, ctx.reducer = log, reducer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reducer is not None:
            ctx.log.append(sum(b.handle is not None for b in ctx.reducer.buckets))
        return grad, None, None


class Captured(nn.Module):
    """Input layer, three blocks that multiply by ``gain`` (reentrant checkpointing: ``gain`` is not an
    input of the checkpointed function), head. ``gain_last``: ``gain`` is registered after the head, so
    that it comes first in the initial plan (reverse registration order); else before the blocks."""

    def __init__(self, *, gain_last: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, DIM)
        scale = nn.Module()  # holds gain, registered where gain_last says
        scale.gain = nn.Parameter(1 + 0.1 * torch.randn(DIM))
        if not gain_last:
            self.scale = scale
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.head = nn.Linear(DIM, 1)
        if gain_last:
            self.scale = scale
        self.mode = "reentrant"  # reentrant | plain (no checkpointing)
        self.reducer = None  # the probe's reducer (None: no probe)
        self.sent: list[int] = []  # per backward: buckets sent when the blocks' backward is done

    def _block(self, block: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(block(x)) * self.scale.gain

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, boom: bool = False) -> torch.Tensor:
        x = Probe.apply(self.inp(x), self.sent, self.reducer)  # (B, C)
        for i, block in enumerate(self.blocks):
            if self.mode == "plain":
                x = self._block(block, x)
            else:
                x = checkpoint(self._block, block, x, use_reentrant=True)
            if boom and i == 1:
                x = _RaiseInBackward.apply(x)
        return F.mse_loss(self.head(x), y)


def _data(rank: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, this rank's rows (None: both ranks' rows, the reference's batch)."""
    g = torch.Generator().manual_seed(7)
    steps = [
        (torch.randn(2 * ROWS, DIM, generator=g), torch.randn(2 * ROWS, 1, generator=g)) for _ in range(STEPS)
    ]
    if rank is None:
        return steps
    return [(x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS]) for x, y in steps]


def _reference(gain_last: bool, modes: list[str]) -> dict[str, torch.Tensor]:
    model = Captured(gain_last=gain_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for (x, y), mode in zip(_data(None), modes):
        model.mode = mode
        optimizer.zero_grad()
        model(x, y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _setup(stage: int, gain_last: bool):
    model = Captured(gain_last=gain_last)
    comm = Communicator()
    broadcast_module_states(model, comm, label="t")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = ZeroConfig(stage=stage, bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)  # a bucket per parameter
    engine = make_engine(config, comm)
    wrapped = engine.setup(model, [optimizer])
    model.reducer = wrapped.sync
    return model, engine, wrapped, optimizer, comm


def _step(engine, optimizer) -> None:
    optimizer.step()
    engine.after_step(optimizer, 0)
    optimizer.zero_grad()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _held_from(model: Captured) -> int:
    """Plan position of the first bucket that waits for the end of backward: gain's (late) or the
    input layer's (its gradients come after the probe)."""
    late = {id(model.scale.gain), id(model.inp.weight), id(model.inp.bias)}
    return min(b.index for b in model.reducer.buckets if any(id(p) in late for p in b.params))


def _train(stage: int, gain_last: bool, rank: int) -> dict:
    model, engine, wrapped, optimizer, comm = _setup(stage, gain_last)
    for step, (x, y) in enumerate(_data(rank)):
        comm.ledger.begin_step(step)
        loss = wrapped(x, y)
        engine.prepare_backward()
        loss.backward()
        _step(engine, optimizer)
    late = [r.step for r in comm.ledger.records if r.name.endswith("/late")]
    return {"params": _params(model), "sent": model.sent, "held_from": _held_from(model), "late": late}


def _overlap(rank: int, world: int, stage: int) -> dict:
    """Train with ``gain`` registered before the blocks (as usual)."""
    return _train(stage, False, rank)


def _set_aside(rank: int, world: int, stage: int) -> dict:
    """Train with ``gain`` first in the plan: its bucket is sent after its first gradient in the first
    backward, before the next nested backward adds more (stage 2 sets that aside)."""
    return _train(stage, True, rank)


def _graph_changes(rank: int, world: int, stage: int) -> dict:
    """``gain`` first in the plan; the first step without checkpointing (``gain`` gets its gradient
    once), the next ones reentrant: its bucket was sent before the next gradient came."""
    model, engine, wrapped, optimizer, _ = _setup(stage, gain_last=True)
    errors = []
    for step, (x, y) in enumerate(_data(rank)):
        model.mode = "plain" if step == 0 else "reentrant"
        for _ in range(2):  # a step whose backward raised is run again
            loss = wrapped(x, y)
            engine.prepare_backward()
            try:
                loss.backward()
            except LateGradientError as err:
                errors.append((step, str(err)))
                optimizer.zero_grad()
                continue
            break
        _step(engine, optimizer)
    return {"params": _params(model), "errors": errors}


def _raised_then_next_backward(rank: int, world: int, stage: int) -> dict:
    """In the second step, a backward raises inside and is caught; the user clears the gradients and
    runs the backward of a loss computed before it, with no forward and no ``prepare_backward`` in
    between (as Fabric does), so the reducer notices at the next gradient hook."""
    model, engine, wrapped, optimizer, _ = _setup(stage, gain_last=False)
    caught = 0
    for step, (x, y) in enumerate(_data(rank)):
        if step == 1:
            failing, loss = wrapped(x, y, boom=True), wrapped(x, y)
            try:
                failing.backward()
            except Boom:
                caught += 1
            optimizer.zero_grad()
        else:
            loss = wrapped(x, y)
            engine.prepare_backward()
        loss.backward()
        _step(engine, optimizer)
    return {"params": _params(model), "caught": caught}


def _all(rank: int, world: int) -> dict:
    jobs = {
        "overlap": _overlap,
        "set_aside": _set_aside,
        "graph": _graph_changes,
        "raised": _raised_then_next_backward,
    }
    return {(name, stage): job(rank, world, stage) for name, job in jobs.items() for stage in (0, 1, 2)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    return run_ranks(_all, 2, str(tmp_path_factory.mktemp("mechanisms")))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_late_parameter_holds_only_its_bucket(trained, stage):
    reference = _reference(False, ["reentrant"] * STEPS)
    for rank in trained:
        run = rank[("overlap", stage)]
        assert _max_diff(run["params"], reference) <= TOL
        # the first backward learns (stages 0-1 send nothing before its end); then every bucket before
        # gain's (late) or the input layer's is sent while the blocks' backward is still running
        first, *steady = run["sent"]
        assert first == (0 if stage <= 1 else run["held_from"])
        assert run["held_from"] >= 4 and steady == [run["held_from"]] * (STEPS - 1)
        assert run["late"] == []  # nothing came after its bucket was sent


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradient_arriving_after_its_bucket_was_sent_in_the_first_backward(trained, stage):
    reference = _reference(True, ["reentrant"] * STEPS)
    for rank in trained:
        run = rank[("set_aside", stage)]
        assert _max_diff(run["params"], reference) <= TOL
        if stage == 2:  # gain's bucket (the first) went out after its first gradient: the rest was set
            assert run["sent"][0] >= 1 and run["late"] == [0]  # aside and reduced at the end, once
        else:  # nothing sent before the end of the first backward
            assert run["sent"][0] == 0 and run["late"] == []
        # from then on gain's bucket is held; at stages 1-2 it is the first, so the others wait with it
        assert run["sent"][1:] == ([run["held_from"]] if stage == 0 else [0]) * (STEPS - 1)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_graph_that_makes_a_parameter_late_after_the_first_step(trained, stage):
    reference = _reference(True, ["plain"] + ["reentrant"] * (STEPS - 1))
    for rank in trained:
        run = rank[("graph", stage)]
        if stage == 0:  # the rebuilt plan put gain (ready last) at the end: its bucket was not sent yet
            assert run["errors"] == []
        else:  # registration order: gain's bucket first, sent after its first gradient of step 1
            assert [step for step, _ in run["errors"]] == [1]
            assert "gain" in run["errors"][0][1] and "use_reentrant=False" in run["errors"][0][1]
        # the step run again, its bucket now held, gives the reference's numbers
        assert _max_diff(run["params"], reference) <= TOL


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_backward_after_one_that_raised_without_a_forward_between(trained, stage):
    reference = _reference(False, ["reentrant"] * STEPS)
    for rank in trained:
        run = rank[("raised", stage)]
        assert run["caught"] == 1
        assert _max_diff(run["params"], reference) <= TOL


# -- EndOfBackward, in one process -----------------------------------------------------------------


def _noting(end: EndOfBackward) -> nn.Parameter:
    w = nn.Parameter(torch.ones(3))
    w.register_post_accumulate_grad_hook(lambda p: end.note())
    return w


def test_end_of_backward_after_a_backward_that_raised():
    calls, raised = [], []
    end = EndOfBackward(lambda: calls.append("end"), on_raise=lambda: raised.append(True))
    w = _noting(end)
    (w * 2).sum().backward()
    assert calls == ["end"] and not end.raised()
    with pytest.raises(Boom):  # w's hook fires, then the backward raises
        (w * _RaiseInBackward.apply(torch.ones(3, requires_grad=True)) * w).sum().backward()
    assert calls == ["end"] and raised == [True] and not end.queued
    assert end.raised() and not end.raised()  # asking forgets it
    (w * 2).sum().backward()
    assert calls == ["end", "end"]


def test_end_of_backward_raised_inside_a_nested_backward():
    calls = []
    end = EndOfBackward(lambda: calls.append("end"))
    w = _noting(end)
    x = torch.ones(3, requires_grad=True)
    # the second nested backward notes (its wrap-up deferred to the outer task), the first raises
    y = checkpoint(lambda h: _RaiseInBackward.apply(h * w), x, use_reentrant=True)
    y = checkpoint(lambda h: h * w, y, use_reentrant=True)
    with pytest.raises(Boom):
        y.sum().backward()
    assert calls == [] and end.raised()
    y = checkpoint(lambda h: h * w, x, use_reentrant=True)
    checkpoint(lambda h: h * w, y, use_reentrant=True).sum().backward()
    assert calls == ["end"]  # once, at the end of the outermost backward
