"""bf16 parameters and gradients with fp32 master weights: memory per rank, bytes on the wire, accuracy."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import make_engine
from lightning_zero.grad_sync import broadcast_module_states
from lightning_zero.memory import measure
from lightning_zero.precision import resolve_policy
from tests.compare import max_diff
from tests.distributed import models
from tests.distributed.harness import run_ranks

BLOCK = "tests.distributed.models.Block"


def _train(rank: int, world: int, stage: int, precision: str, steps: int = 3, sgd: bool = False) -> dict:
    model = models.build_stack(seed=100 + rank)
    comm = Communicator()
    broadcast_module_states(model, comm, label="t")
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1) if sgd else torch.optim.Adam(model.parameters(), lr=1e-2)
    )
    options = {"wrap_policy": BLOCK} if stage == 3 else {}
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001, **options)
    engine = make_engine(config, comm, resolve_policy(None, None, precision))
    wrapped = engine.setup(model, [optimizer])
    batches = models.global_batches(steps, world)
    for step, batch in enumerate(batches):
        comm.ledger.begin_step(step)
        wrapped(*models.rank_slice(batch, rank)).backward()
        during = measure(model, engine.grad_tensors(), [])
        optimizer.step()
        engine.after_step(optimizer, 0)
        optimizer.zero_grad()
    between = measure(model, engine.grad_tensors(), [optimizer], extra_params=engine.param_tensors())
    comm.ledger.begin_step(-1)
    state = engine.module_state_dict(model)
    return {
        "between": between,
        "grads_during_step": during.gradients,
        "dtype": str(model.emb.weight.dtype),  # stage 3: the placeholder has the gathered dtype
        "state": {k: v.clone() for k, v in state.items()},
        "reduce_bytes": sum(
            r.payload_bytes for r in comm.ledger.for_step(1) if r.op in ("all_reduce", "reduce_scatter")
        ),
    }


def _all(rank: int, world: int, precision: str, sgd: bool = False) -> dict:
    return {stage: _train(rank, world, stage, precision, sgd=sgd) for stage in (0, 1, 2, 3)}


PSI = sum(p.numel() for p in models.build_stack(0).parameters())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_state_memory_per_rank(tmp_path, world):
    r = run_ranks(_all, world, tmp_path, "bf16-mixed")[0]
    pad = 2 * 4 * world * 12  # padding: < N elements per bucket or unit, at most 4 bytes each, < 12 of them
    steps = 4 * 40  # Adam's 0-dim step counters, 4 bytes per bucket or unit
    for stage in (0, 1, 2, 3):
        assert r[stage]["dtype"] == "torch.bfloat16"
    mem = {s: r[s]["between"] for s in range(4)}
    # persistent state between steps: bf16 params (2), bf16 grad buckets (2) for stages 0-1, fp32 master + Adam (12)
    assert mem[0].parameters == 2 * PSI and mem[0].gradients == 2 * PSI
    assert 12 * PSI <= mem[0].optimizer_states <= 12 * PSI + steps
    assert 2 * PSI <= mem[1].parameters <= 2 * PSI + pad and 2 * PSI <= mem[1].gradients <= 2 * PSI + pad
    assert 12 * PSI / world <= mem[1].optimizer_states <= 12 * PSI / world + 3 * pad + steps
    assert 2 * PSI <= mem[2].parameters <= 2 * PSI + pad and mem[2].gradients == 0
    assert 12 * PSI / world <= mem[2].optimizer_states <= 12 * PSI / world + 3 * pad + steps
    assert 2 * PSI / world <= mem[3].parameters <= 2 * PSI / world + pad and mem[3].gradients == 0
    assert 12 * PSI / world <= mem[3].optimizer_states <= 12 * PSI / world + 3 * pad + steps
    # during the step the shard gradient is accumulated in fp32 (4 bytes per element of the shard)
    assert 4 * PSI / world <= r[2]["grads_during_step"] <= 4 * PSI / world + 2 * pad
    assert 4 * PSI / world <= r[3]["grads_during_step"] <= 4 * PSI / world + 2 * pad


def test_bytes_on_the_wire_halve(tmp_path):
    bf16 = run_ranks(_all, 2, tmp_path, "bf16-mixed")[0]
    fp32 = run_ranks(_all, 2, tmp_path, "32-true")[0]
    for stage in (0, 1, 2, 3):
        assert bf16[stage]["reduce_bytes"] * 2 == fp32[stage]["reduce_bytes"]
    assert fp32[0]["reduce_bytes"] == 4 * PSI


def test_stages_agree_and_checkpoints_hold_fp32_masters(tmp_path):
    # SGD: an update linear in the gradient, so a difference shows the reduction, not Adam's
    # normalisation (which turns any difference in a near-zero gradient into one of size lr)
    r = run_ranks(_all, 2, tmp_path, "bf16-mixed", True)[0]
    fp32 = run_ranks(_all, 2, tmp_path, "32-true", True)[0][0]["state"]
    for stage in (0, 1, 2, 3):
        assert all(v.dtype == torch.float32 for v in r[stage]["state"].values())  # fp32 masters, not bf16
    for stage in (1, 2, 3):
        # bf16 sums of the same two bf16 gradients, in another order: within bf16 rounding of lr x grad
        assert max_diff(r[stage]["state"], r[0]["state"]) <= 1e-3, stage
    # bf16 compute stays close to fp32 compute over three steps
    assert max_diff(r[0]["state"], fp32) <= 1e-2
