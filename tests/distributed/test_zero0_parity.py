"""zero0 against torch DDP and a single process: parameters after K steps, and counted collectives."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.grad_sync import UnusedParametersError, broadcast_module_states, wrap_module
from tests.compare import max_diff
from tests.distributed import models
from tests.distributed.harness import run_ranks

TOL = 1e-6


def _side_flags(rank: int, step: int, scenario: dict) -> bool:
    """The 'side' layer is used on rank 0 only: locally unused on the other ranks."""
    return scenario["model"].get("unused", False) and rank == 0 and step % 2 == 0


def _train_zero(rank: int, world: int, scenario: dict) -> dict:
    model = models.build(seed=100 + rank, **scenario["model"])  # ranks start different on purpose
    comm = Communicator()
    broadcast_module_states(model, comm, label="zero0")
    wrapped = wrap_module(model, comm, ZeroConfig(**scenario["config"]))
    opt = models.make_optimizer(scenario["optimizer"], [p for p in model.parameters() if p.requires_grad])
    batches = models.global_batches(scenario["micro_batches"], world)
    syncs = models.sync_points(len(batches), scenario["accumulate"])
    step, blocked_calls, buckets_per_step = 0, 0, []
    for i, (batch, sync) in enumerate(zip(batches, syncs)):
        comm.ledger.begin_step(step)
        before = len(comm.ledger.records)
        buckets_before = len(wrapped.sync.buckets)
        ctx = contextlib.nullcontext() if sync else wrapped.sync.no_sync()
        with ctx:
            loss = wrapped(*models.rank_slice(batch, rank), use_side=_side_flags(rank, i, scenario))
            (loss / scenario["accumulate"]).backward()
        if not sync:
            blocked_calls += len(comm.ledger.records) - before
            continue
        buckets_per_step.append(buckets_before)
        opt.step()
        opt.zero_grad()
        step += 1
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "ledger": list(comm.ledger.records),
        "blocked_calls": blocked_calls,
        "buckets_per_step": buckets_per_step,
        "grad_bytes": grad_bytes,
        "steps": step,
    }


def _train_ddp(rank: int, world: int, scenario: dict) -> dict:
    model = models.build(seed=100, **scenario["model"])
    ddp = DistributedDataParallel(
        model, find_unused_parameters=scenario["config"].get("find_unused_parameters", False)
    )
    opt = models.make_optimizer(scenario["optimizer"], [p for p in model.parameters() if p.requires_grad])
    batches = models.global_batches(scenario["micro_batches"], world)
    for i, (batch, sync) in enumerate(zip(batches, models.sync_points(len(batches), scenario["accumulate"]))):
        ctx = contextlib.nullcontext() if sync else ddp.no_sync()
        with ctx:
            loss = ddp(*models.rank_slice(batch, rank), use_side=_side_flags(rank, i, scenario))
            (loss / scenario["accumulate"]).backward()
        if sync:
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero_and_ddp(rank: int, world: int, scenario: dict) -> dict:
    return {"zero": _train_zero(rank, world, scenario), "ddp": _train_ddp(rank, world, scenario)}


def _single_process(scenario: dict, world: int) -> dict:
    """One process, the concatenated global batch: what N ranks must reproduce."""
    model = models.build(seed=100, **scenario["model"])
    opt = models.make_optimizer(scenario["optimizer"], [p for p in model.parameters() if p.requires_grad])
    batches = models.global_batches(scenario["micro_batches"], world)
    for batch, sync in zip(batches, models.sync_points(len(batches), scenario["accumulate"])):
        (model(*batch) / scenario["accumulate"]).backward()
        if sync:
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _scenario(optimizer: str, accumulate: int = 1, micro_batches: int = 4, model=None, **config) -> dict:
    config.setdefault("bucket_cap_mb", 0.004)  # ~1000 fp32 elements: several buckets
    config.setdefault("first_bucket_cap_mb", 0.001)
    return {
        "optimizer": optimizer,
        "accumulate": accumulate,
        "micro_batches": micro_batches,
        "model": model or {},
        "config": config,
    }


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_parity_with_ddp_and_single_process(tmp_path, optimizer):
    scenario = _scenario(optimizer, micro_batches=4)
    results = run_ranks(_zero_and_ddp, 2, tmp_path, scenario)
    single = _single_process(scenario, 2)
    for r in results:
        assert max_diff(r["zero"]["params"], r["ddp"]) <= TOL
        assert max_diff(r["zero"]["params"], single) <= TOL
    assert max_diff(results[0]["zero"]["params"], results[1]["zero"]["params"]) == 0.0


def test_accumulation_uneven_epoch_no_collective_in_window(tmp_path):
    # 7 micro-batches, accumulate 4: steps after micro-batch 4 and 7 (end of epoch), like Lightning
    scenario = _scenario("adamw", accumulate=4, micro_batches=7)
    results = run_ranks(_zero_and_ddp, 2, tmp_path, scenario)
    single = _single_process(scenario, 2)
    for r in results:
        assert r["zero"]["steps"] == 2
        assert r["zero"]["blocked_calls"] == 0
        assert max_diff(r["zero"]["params"], r["ddp"]) <= TOL
        assert max_diff(r["zero"]["params"], single) <= TOL


def test_counted_collectives_equal_buckets_and_gradient_bytes(tmp_path):
    scenario = _scenario("sgd", micro_batches=3)
    zero = run_ranks(_zero_and_ddp, 2, tmp_path, scenario)[0]["zero"]
    for step, num_buckets in enumerate(zero["buckets_per_step"]):
        reduces = [
            r for r in zero["ledger"] if r.step == step and r.name.startswith("zero0/all_reduce/bucket")
        ]
        assert num_buckets > 2
        assert len(reduces) == num_buckets
        assert sum(r.payload_bytes for r in reduces) == zero["grad_bytes"]
        assert sum(r.wire_bytes for r in reduces) == pytest.approx(2 * (2 - 1) / 2 * zero["grad_bytes"])
    # the bucket order is agreed once, on the first step only
    orders = [r for r in zero["ledger"] if r.name.startswith("zero0/bucket_order")]
    assert orders and {r.step for r in orders} == {0}


def test_frozen_and_tied_parameters(tmp_path):
    scenario = _scenario("adamw", micro_batches=3, model={"tied": True, "frozen": True})
    results = run_ranks(_zero_and_ddp, 2, tmp_path, scenario)
    single = _single_process(scenario, 2)
    zero = results[0]["zero"]
    assert max_diff(zero["params"], results[0]["ddp"]) <= TOL
    assert max_diff(zero["params"], single) <= TOL
    # tied weight reduced once: bytes == unique trainable parameter bytes
    step0 = [r for r in zero["ledger"] if r.step == 1 and r.name.startswith("zero0/all_reduce/bucket")]
    assert sum(r.payload_bytes for r in step0) == zero["grad_bytes"]
    frozen_model = models.build(0, tied=True, frozen=True)
    assert zero["grad_bytes"] == 4 * sum(p.numel() for p in frozen_model.parameters() if p.requires_grad)


def _unused_error(rank: int, world: int, scenario: dict) -> str:
    try:
        _train_zero(rank, world, scenario)
    except UnusedParametersError as err:
        return str(err)
    return ""


def test_unused_parameter_error_names_it(tmp_path):
    scenario = _scenario("sgd", micro_batches=2, model={"unused": True})
    messages = run_ranks(_unused_error, 2, tmp_path, scenario)
    for message in messages:
        assert "extra.weight" in message and "extra.bias" in message
        assert "find_unused_parameters=True" in message


def test_find_unused_parameters_matches_ddp(tmp_path):
    scenario = _scenario("adamw", micro_batches=4, model={"unused": True}, find_unused_parameters=True)
    results = run_ranks(_zero_and_ddp, 2, tmp_path, scenario)
    for r in results:
        assert max_diff(r["zero"]["params"], r["ddp"]) <= TOL
    initial = models.build(seed=100, unused=True)
    # globally unused: untouched by AdamW (grad stays None, as with DDP)
    assert torch.equal(results[0]["zero"]["params"]["extra.weight"], initial.extra.weight.detach())
    # used on rank 0 only: updated on every rank
    assert not torch.equal(results[1]["zero"]["params"]["side.weight"], initial.side.weight.detach())


def test_buffers_follow_rank_zero(tmp_path):
    scenario = _scenario("sgd", micro_batches=2)
    results = run_ranks(_zero_and_ddp, 2, tmp_path, scenario)
    # 'seen' counts forwards: broadcast from rank 0 before each synced forward, then incremented
    assert [r["zero"]["buffers"]["seen"].item() for r in results] == [2.0, 2.0]


@pytest.mark.slow  # 2 ranks run by default
def test_four_ranks(tmp_path):
    scenario = _scenario("adamw", accumulate=2, micro_batches=5)
    results = run_ranks(_zero_and_ddp, 4, tmp_path, scenario)
    single = _single_process(scenario, 4)
    for r in results:
        assert max_diff(r["zero"]["params"], r["ddp"]) <= TOL
        assert max_diff(r["zero"]["params"], single) <= TOL
