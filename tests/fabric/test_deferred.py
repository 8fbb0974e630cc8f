"""Deferred initialisation in Fabric at stage 3: ``fabric.init_module(empty_init=True)`` builds on the
meta device; setup gives the model the values a normal build has, on every rank, and training
continues as from the normal build."""

from __future__ import annotations

import functools

import lightning as L
import torch

import lightning_zero  # noqa: F401  (registers zero0..zero3 for Fabric)
from lightning_zero.fabric import ZeroFabricStrategy as ZeroStrategy
from tests.bigmodel.lit import Net, Rows, Shape
from tests.matrix.runner import run_jobs

SHAPE = Shape()


def _train(deferred: bool, root: str) -> dict:
    fabric = L.Fabric(
        strategy=ZeroStrategy(stage=3, wrap_policy="tests.bigmodel.lit.Block"), accelerator="cpu", devices=2
    )
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=deferred):
        net = Net(SHAPE)
    meta = any(p.is_meta for p in net.parameters())
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(net, optimizer)
    initial = fabric.strategy.full_state_dict(rank0_only=False)
    rows = Rows(4 * 2 * SHAPE.tokens, SHAPE.width)
    for step in range(4):
        start = (step * 2 + fabric.global_rank) * SHAPE.tokens
        x, y = rows.x[start : start + SHAPE.tokens], rows.y[start : start + SHAPE.tokens]
        fabric.backward(model(x, y))
        optimizer.step()
        optimizer.zero_grad()
    return {"meta": meta, "initial": initial, "final": fabric.strategy.full_state_dict(rank0_only=False)}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_init_module_empty_init_at_stage_3(tmp_path):
    jobs = [functools.partial(_train, deferred) for deferred in (False, True)]
    for normal, deferred in run_jobs(jobs, str(tmp_path), world=2, timeout=600):
        assert deferred["meta"] and not normal["meta"]
        assert _max_diff(deferred["initial"], normal["initial"]) == 0.0
        assert _max_diff(deferred["final"], normal["final"]) <= 1e-6
