"""Stage 3's parameters at rest are DTensors: what that means for the user's code.

- every parameter at rest is a ``DTensor`` (Shard(0); a 0-dim one Replicate), so is its gradient,
  and ``torch.distributed.checkpoint`` saves ``model.state_dict()`` at N=2 and loads it at N=4 and
  into a plain model;
- a no-grad call of the model inside a step (a teacher) frees each unit when it returns: the
  gathered bytes stay at the root plus two blocks, and every block is reduced during backward;
- ``gathered()`` around a manual-optimization step trains as one process does (the old write-back
  copied the stale gathered root over the stepped shard);
- Fabric's ``clip_gradients`` that raises on a non-finite norm leaves the gradients as they were;
- Fabric's ``get_module_state_dict`` gathers one unit at a time to rank 0.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import make_engine
from lightning_zero.zero.unit import gradient_divisors
from tests.compare import max_diff
from tests.distributed import models
from tests.distributed.harness import run_ranks

BLOCK = "tests.distributed.models.Block"


class WithScalar(models.TinyStack):
    """The stack with a learnable 0-dim temperature at the root (replicated at rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens, targets) * self.temperature


def _engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options):
    engine = make_engine(ZeroConfig(stage=3, wrap_policy=BLOCK, **options), Communicator())
    return engine, engine.setup(model, [optimizer])


def _save_at_rest(rank: int, world: int, path: str) -> dict:
    torch.manual_seed(3)
    model = WithScalar()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, wrapped = _engine(model, optimizer)
    batch = models.global_batches(1, world)[0]
    wrapped(*models.rank_slice(batch, rank)).backward()
    at_rest = {n: (type(p).__name__, tuple(map(repr, p.placements))) for n, p in model.named_parameters()}
    grads = {n: type(p.grad).__name__ for n, p in model.named_parameters()}
    optimizer.step()
    state = model.state_dict()
    dcp.save(state, checkpoint_id=path)
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in state.items()}
    return {"at_rest": at_rest, "grads": grads, "whole": whole}


def _load_at_rest(rank: int, world: int, path: str) -> dict:
    torch.manual_seed(99)  # other initial values: what is compared comes from the checkpoint
    model = WithScalar()
    _engine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in model.state_dict().items()
    }


def test_parameters_at_rest_are_dtensors_and_dcp_reshards_them(tmp_path):
    path = str(tmp_path / "dcp")
    for sub in ("save", "load4"):
        (tmp_path / sub).mkdir()
    saved = run_ranks(_save_at_rest, 2, tmp_path / "save", path)[0]
    for name, (kind, placements) in saved["at_rest"].items():
        assert kind == "ZeroDTensor", name
        assert placements == (("Replicate()",) if name == "temperature" else ("Shard(dim=0)",)), name
    assert all(kind == "ZeroDTensor" for kind in saved["grads"].values()), saved["grads"]
    for loaded in run_ranks(_load_at_rest, 4, tmp_path / "load4", path):
        assert max_diff(loaded, saved["whole"]) == 0.0
    torch.manual_seed(99)
    plain = WithScalar()
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)  # one process, a plain model
    assert max_diff(plain.state_dict(), saved["whole"]) == 0.0


def _teacher(rank: int, world: int, teacher: bool) -> dict:
    model = models.build_stack(seed=1, blocks=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, wrapped = _engine(model, optimizer)
    ledger = engine.comm.ledger
    orders = []
    for step, batch in enumerate(models.global_batches(3, world)):
        ledger.begin_step(step)
        engine.zero3.meter.reset()
        tokens, targets = models.rank_slice(batch, rank)
        loss = wrapped(tokens, targets)
        if teacher:  # a no-grad call of the whole model inside the step, between forward and backward
            with torch.no_grad():
                taught = model(tokens, targets)
            loss = loss + 0.0 * taught
        loss.backward()
        optimizer.step()
        engine.after_step(optimizer, 0)
        optimizer.zero_grad()
        orders.append([r.op for r in ledger.for_step(step) if "/unit=blocks" in r.name])
    sizes = {u.name: u.nbytes for u in engine.zero3.units}
    return {"peak": engine.zero3.meter.peak, "sizes": sizes, "orders": orders}


@pytest.mark.parametrize("teacher", [False, True])
def test_a_no_grad_call_in_a_step_keeps_the_gathered_bound(tmp_path, teacher):
    r = run_ranks(_teacher, 2, tmp_path, teacher)[0]
    block = max(v for k, v in r["sizes"].items() if k != "root")
    # the root through the step, one block computing, the next in flight (prefetch)
    assert r["peak"] == r["sizes"]["root"] + 2 * block, r
    for order in r["orders"]:  # every block is reduced during backward, before the last is gathered
        last_gather = max(i for i, op in enumerate(order) if op == "all_gather")
        assert "reduce_scatter" in order[:last_gather], order


def _manual_gathered(rank: int | None, world: int, use_gathered: bool) -> dict:
    """Manual optimization with ``gathered()`` around the whole step, as people write it."""
    model = models.build_stack(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank is None:  # one process: both ranks' samples
        engine, wrapped = None, model
    else:
        engine, wrapped = _engine(model, optimizer)
    for batch in models.global_batches(3, world):
        parts = (
            [models.rank_slice(batch, r) for r in range(world)]
            if rank is None
            else [models.rank_slice(batch, rank)]
        )
        inside = engine.gathered() if engine is not None and use_gathered else contextlib.nullcontext()
        with inside:
            loss = sum(wrapped(*part) for part in parts) / len(parts)
            loss.backward()
            optimizer.step()
            if engine is not None:
                engine.after_step(optimizer, 0)
            optimizer.zero_grad()
    state = engine.full_state_dict(model, rank0_only=False) if engine is not None else model.state_dict()
    return {k: v.clone() for k, v in state.items()}


def test_gathered_around_a_manual_step_trains_as_one_process(tmp_path):
    reference = _manual_gathered(None, 2, False)
    for state in run_ranks(_manual_gathered, 2, tmp_path, True):
        assert max_diff(state, reference) <= 1e-6


def test_gradient_divisors_split_the_mean_in_16_bits():
    assert gradient_divisors(torch.float32, 64) == (64.0, 1.0)  # fp32: all before the sum, as DDP
    assert gradient_divisors(torch.bfloat16, 64) == (8.0, 8.0)  # about sqrt(N) before, the rest after
    assert gradient_divisors(torch.bfloat16, 8) == (2.0, 4.0)
    assert gradient_divisors(torch.float16, 2) == (1.0, 2.0)
    assert gradient_divisors(torch.bfloat16, 1) == (1.0, 1.0)


OPTIMIZERS = {  # built-in elementwise optimizers, with the options that keep per-element state
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
}


def _steps_on_local_rows(rank: int | None, world: int, name: str) -> dict:
    """Four steps of ``name`` on the stack with a replicated 0-dim parameter; with ranks, the calls
    into ZeroDTensor.__torch_function__ made by each step."""
    torch.manual_seed(5)
    model = WithScalar()
    optimizer = OPTIMIZERS[name](model.parameters())
    engine, wrapped = (None, model) if rank is None else _engine(model, optimizer)
    calls = []
    for batch in models.global_batches(4, world):
        parts = (
            [models.rank_slice(batch, r) for r in range(world)]
            if rank is None
            else [models.rank_slice(batch, rank)]
        )
        (sum(wrapped(*part) for part in parts) / len(parts)).backward()
        with _counting_dispatch() as count:
            optimizer.step()
        calls.append(count[0])
        if engine is not None:
            engine.after_step(optimizer, 0)
        optimizer.zero_grad()
    if engine is None:
        return {"params": {k: v.clone() for k, v in model.state_dict().items()}}
    states = {key: type(v).__name__ for s in optimizer.state.values() for key, v in s.items()}
    return {
        "params": {k: v.clone() for k, v in engine.full_state_dict(model, rank0_only=False).items()},
        "calls": calls,
        "parameters": sum(len(g["params"]) for g in optimizer.param_groups),
        "held": [type(p).__name__ for g in optimizer.param_groups for p in g["params"]],
        "states": states,
    }


@contextlib.contextmanager
def _counting_dispatch():
    from lightning_zero.zero.dtensor import ZeroDTensor

    original = ZeroDTensor.__dict__["__torch_function__"]
    count = [0]

    def counting(cls, func, types, args=(), kwargs=None):
        count[0] += 1
        return original.__func__(cls, func, types, args, kwargs)

    ZeroDTensor.__torch_function__ = classmethod(counting)
    try:
        yield count
    finally:
        ZeroDTensor.__torch_function__ = original


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_step_runs_on_local_rows_as_one_process(tmp_path, name):
    """After its first step a built-in optimizer steps plain aliases of the local rows (see [Note:
    the step on local rows]): the same values as one process, parameters and state laid out at rest
    again afterwards, a few DTensor calls per parameter instead of one per op."""
    reference = _steps_on_local_rows(None, 2, name)["params"]
    for r in run_ranks(_steps_on_local_rows, 2, tmp_path, name):
        assert max_diff(r["params"], reference) <= 1e-6
        assert set(r["held"]) == {"ZeroDTensor"}
        assert {k: v for k, v in r["states"].items() if k != "step"} == dict.fromkeys(
            (k for k in r["states"] if k != "step"), "ZeroDTensor"
        ), r["states"]
        first, later = r["calls"][0], max(r["calls"][1:])
        assert later <= 4 * r["parameters"] < first, r["calls"]


def _raising_step(rank: int, world: int) -> dict:
    """The second step of Adam raises inside its update (after the closure, on the local rows)."""
    adam = sys.modules["torch.optim.adam"]
    model = WithScalar()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, wrapped = _engine(model, optimizer)
    raised = None
    for step, batch in enumerate(models.global_batches(2, world)):
        wrapped(*models.rank_slice(batch, rank)).backward()
        real = adam._single_tensor_adam
        if step == 1:
            adam._single_tensor_adam = _raises
        try:
            optimizer.step()
        except RuntimeError as error:
            raised = str(error)
            engine.step_ended(0)  # what both strategies do when a step raises
        finally:
            adam._single_tensor_adam = real
        optimizer.zero_grad()
    return {
        "raised": raised,
        "held": [type(p).__name__ for g in optimizer.param_groups for p in g["params"]],
        "states": {type(v).__name__ for s in optimizer.state.values() for k, v in s.items() if k != "step"},
    }


def _raises(*args, **kwargs):
    raise RuntimeError("planted failure inside the step")


def test_a_step_that_raises_leaves_the_parameters_at_rest(tmp_path):
    for r in run_ranks(_raising_step, 2, tmp_path):
        assert r["raised"] == "planted failure inside the step"
        assert set(r["held"]) == {"ZeroDTensor"} and r["states"] == {"ZeroDTensor"}, r
