"""zero1 and zero2 against zero0: parameters after K steps, collectives, memory, optimizer state."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.grad_sync import broadcast_module_states, wrap_module
from lightning_zero.memory import measure
from lightning_zero.zero import ShardedParams, ShardingError, check_shardable
from tests.compare import max_diff, state_diff
from tests.distributed import models
from tests.distributed.harness import run_ranks

TOL = 1e-6


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(groups, lr=1e-2)
    return torch.optim.AdamW(groups, lr=1e-2)


def _train(rank: int, world: int, stage: int, sc: dict) -> dict:
    model = models.build(seed=100 + rank, **sc.get("model", {}))
    comm = Communicator()
    broadcast_module_states(model, comm, label="t")
    opt = _optimizer(sc["optimizer"], model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    extra = sc.get("config", {}) if stage == 2 else {}  # stage-2 options
    cfg = ZeroConfig(stage=stage, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001, **extra)
    wrapped = wrap_module(model, comm, cfg)
    sharded = None
    if stage:
        sharded = ShardedParams(wrapped.sync, comm)
        sharded.shard_optimizer(opt, 0)
    batches = models.global_batches(sc["micro_batches"], world)
    syncs = models.sync_points(len(batches), sc["accumulate"])
    step, blocked, memory = 0, 0, None
    for batch, sync in zip(batches, syncs):
        comm.ledger.begin_step(step)
        before = len(comm.ledger.records)
        with contextlib.nullcontext() if sync else wrapped.sync.no_sync():
            (wrapped(*models.rank_slice(batch, rank)) / sc["accumulate"]).backward()
        if not sync:
            blocked += len(comm.ledger.records) - before
            continue
        if sc.get("clip"):
            if sharded:
                sharded.clip_grad_norm_(opt, sc["clip"])
            else:
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], sc["clip"])
        memory_before_step = measure(model, wrapped.sync.grad_tensors(), [opt])
        opt.step()
        if sharded:
            sharded.after_step(opt, 0)
        memory = measure(model, wrapped.sync.grad_tensors(), [opt])._replace(
            gradients=memory_before_step.gradients
        )
        opt.zero_grad()
        sched.step()
        step += 1
    full_state = sharded.full_state_dict(opt, 0) if sharded else opt.state_dict()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "ledger": list(comm.ledger.records),
        "blocked": blocked,
        "memory": memory,
        "state": full_state,
        "lr": [g["lr"] for g in opt.param_groups],
    }


def _all_stages(rank: int, world: int, stages: tuple, sc: dict) -> dict:
    return {stage: _train(rank, world, stage, sc) for stage in stages}


@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adam", marks=pytest.mark.slow), "adamw"])
def test_stages_match_zero0(tmp_path, optimizer):
    sc = {"optimizer": optimizer, "accumulate": 1, "micro_batches": 3}
    for r in run_ranks(_all_stages, 2, tmp_path, (0, 1, 2), sc):
        for stage in (1, 2):
            assert max_diff(r[stage]["params"], r[0]["params"]) <= TOL
            assert state_diff(r[stage]["state"], r[0]["state"]) <= TOL
            assert r[stage]["lr"] == r[0]["lr"]  # the scheduler reached the sharded step


@pytest.mark.slow  # 2 ranks run by default
def test_three_ranks_buckets_with_padding(tmp_path):
    # N = 3 divides no bucket here: the last rank's sub-shards stop before the padding
    sc = {"optimizer": "adamw", "accumulate": 2, "micro_batches": 4, "clip": 0.05}
    for r in run_ranks(_all_stages, 3, tmp_path, (0, 1, 2), sc):
        for stage in (1, 2):
            assert max_diff(r[stage]["params"], r[0]["params"]) <= TOL
            assert state_diff(r[stage]["state"], r[0]["state"]) <= TOL


@pytest.mark.slow  # 2 ranks run by default
def test_accumulation_and_norm_clipping_four_ranks(tmp_path):
    sc = {"optimizer": "adamw", "accumulate": 3, "micro_batches": 7, "clip": 0.05}
    results = run_ranks(_all_stages, 4, tmp_path, (0, 1, 2), sc)
    for r in results:
        for stage in (1, 2):
            assert max_diff(r[stage]["params"], r[0]["params"]) <= TOL
    zero1 = results[0][1]
    assert zero1["blocked"] == 0  # zero1 keeps no_sync: nothing inside the window
    assert results[0][2]["blocked"] > 0  # zero2 reduce-scatters every micro-batch by default


def test_zero2_accumulate_unsharded_uses_no_sync(tmp_path):
    sc = {"optimizer": "adamw", "accumulate": 2, "micro_batches": 4, "config": {"accumulate_unsharded": True}}
    r = run_ranks(_all_stages, 2, tmp_path, (0, 2), sc)[0]
    assert r[2]["blocked"] == 0
    assert max_diff(r[2]["params"], r[0]["params"]) <= TOL


def test_traffic_equals_zero0(tmp_path):
    sc = {"optimizer": "adam", "accumulate": 1, "micro_batches": 2}
    r = run_ranks(_all_stages, 2, tmp_path, (0, 1, 2), sc)[0]
    step = 1  # a steady-state step

    def total(records, op):
        return sum(x.payload_bytes for x in records if x.step == step and x.op == op and "/bucket=" in x.name)

    zero0 = total(r[0]["ledger"], "all_reduce")
    grad_bytes = sum(p.numel() * 4 for p in models.build(0).parameters())
    assert zero0 == grad_bytes
    for stage in (1, 2):
        rs, ag = total(r[stage]["ledger"], "reduce_scatter"), total(r[stage]["ledger"], "all_gather")
        wire = sum(x.wire_bytes for x in r[stage]["ledger"] if x.step == step and "/bucket=" in x.name)
        zero0_wire = sum(x.wire_bytes for x in r[0]["ledger"] if x.step == step and "/bucket=" in x.name)
        # padding to a multiple of N adds at most N-1 elements per bucket
        buckets = sum(1 for x in r[stage]["ledger"] if x.step == step and x.op == "reduce_scatter")
        assert grad_bytes <= rs == ag <= grad_bytes + 4 * (2 - 1) * buckets
        assert wire == pytest.approx(zero0_wire, rel=0.01)


def _memory(rank: int, world: int, sc: dict) -> dict:
    return {stage: _train(rank, world, stage, sc)["memory"] for stage in (0, 1, 2)}


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_memory_per_rank(tmp_path, world):
    sc = {"optimizer": "adam", "accumulate": 1, "micro_batches": 2}
    psi = sum(p.numel() for p in models.build(0).parameters())
    mem = run_ranks(_memory, world, tmp_path, sc)[0]
    pad = 4 * world * 40  # at most N-1 padding elements per bucket, < 40 buckets
    # fp32 params, fp32 grads, Adam: two moments (+ 0-dim steps, 4 bytes per bucket or parameter)
    assert mem[0].parameters == 4 * psi
    assert mem[0].gradients == 4 * psi
    assert 8 * psi <= mem[0].optimizer_states <= 8 * psi + 4 * 40
    for stage in (1, 2):
        assert 4 * psi <= mem[stage].parameters <= 4 * psi + pad
        assert 8 * psi / world <= mem[stage].optimizer_states <= 8 * psi / world + pad + 4 * 40
    assert 4 * psi <= mem[1].gradients <= 4 * psi + pad
    assert 4 * psi / world <= mem[2].gradients <= 4 * psi / world + pad


def _bad_optimizer(rank: int, world: int, kind: str) -> str:
    model = models.build(0)
    comm = Communicator()
    try:
        if kind == "lbfgs":
            check_shardable(torch.optim.LBFGS(model.parameters()))
        return ""
    except ShardingError as err:
        return str(err)
    finally:
        del comm


def test_lbfgs_is_refused_with_a_clear_error(tmp_path):
    message = run_ranks(_bad_optimizer, 2, tmp_path, "lbfgs")[0]
    assert "torch.optim.lbfgs.LBFGS is not known to be elementwise" in message and "zero0" in message


class RowNorms(torch.optim.Optimizer):
    """Keeps one number per row of each parameter: state shaped unlike the parameter."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["rows"] = torch.zeros(3)
                    p.add_(p.grad, alpha=-group["lr"])


def _custom_state(rank: int, world: int) -> str:
    model = models.build(0)
    comm = Communicator()
    opt = RowNorms(model.parameters())  # declared elementwise, yet its state says otherwise
    wrapped = wrap_module(model, comm, ZeroConfig(stage=1))
    sharded = ShardedParams(wrapped.sync, comm)
    sharded.shard_optimizer(opt, 0)
    wrapped(*models.rank_slice(models.global_batches(1, world)[0], rank)).backward()
    opt.step()
    try:
        sharded.after_step(opt, 0)
    except ShardingError as err:
        return str(err)
    return ""


def test_optimizer_state_shaped_unlike_the_parameter_is_refused(tmp_path):
    message = run_ranks(_custom_state, 2, tmp_path)[0]
    assert "RowNorms keeps state 'rows' of shape (3,)" in message and "zero0" in message


def _sent_per_bucket(rank: int, world: int) -> dict:
    """Stage 2 on gloo: per backward, how each bucket's reduce-scatter went to the backend, as
    (operation, elements this rank sends), against the bucket's padded size."""
    import torch.distributed as dist

    model = models.build(seed=100 + rank)
    comm = Communicator()
    broadcast_module_states(model, comm, label="t")
    opt = _optimizer("adamw", model)
    wrapped = wrap_module(model, comm, ZeroConfig(stage=2, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001))
    sharded = ShardedParams(wrapped.sync, comm)
    sharded.shard_optimizer(opt, 0)
    sizes = {b.spec.padded_numel for b in wrapped.sync.buckets}
    calls: list[tuple[str, int]] = []
    all_reduce, all_to_all = dist.all_reduce, dist.all_to_all_single

    def counted_all_reduce(tensor, *args, **kwargs):
        calls.append(("all_reduce", tensor.numel()))
        return all_reduce(tensor, *args, **kwargs)

    def counted_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        calls.append(("all_to_all", input.numel() - input_split_sizes[rank]))  # nothing to itself
        return all_to_all(output, input, output_split_sizes, input_split_sizes, **kwargs)

    dist.all_reduce, dist.all_to_all_single = counted_all_reduce, counted_all_to_all
    backwards = []
    try:
        for batch in models.global_batches(4, world):  # two micro-batches a step, no no_sync
            calls.clear()
            wrapped(*models.rank_slice(batch, rank)).backward()
            backwards.append([c for c in calls if c[0] == "all_to_all" or c[1] in sizes])
            if len(backwards) % 2 == 0:
                opt.step()
                sharded.after_step(opt, 0)
                opt.zero_grad()
    finally:
        dist.all_reduce, dist.all_to_all_single = all_reduce, all_to_all
    return {"backwards": backwards, "buckets": sorted(b.spec.padded_numel for b in wrapped.sync.buckets)}


def test_zero2_sends_half_a_bucket_where_it_starts_the_window(tmp_path):
    """A bucket whose shard gradient holds nothing is reduce-scattered into new storage, as an
    exchange of half the bucket (one all-to-all at N = 2); one that adds to the window (the second
    micro-batch without no_sync) all-reduces the whole bucket in place, as before."""
    for r in run_ranks(_sent_per_bucket, 2, tmp_path):
        halves = sorted(n // 2 for n in r["buckets"])
        for i, calls in enumerate(r["backwards"]):
            if i % 2 == 0:  # the window starts: the step or zero_grad consumed the shard gradients
                assert sorted(n for op, n in calls if op == "all_to_all") == halves, (i, calls)
                assert not [c for c in calls if c[0] == "all_reduce"], (i, calls)
            else:
                assert sorted(n for op, n in calls if op == "all_reduce") == r["buckets"], (i, calls)
