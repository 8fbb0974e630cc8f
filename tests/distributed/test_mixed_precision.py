"""bf16 parameters and gradients with fp32 master weights: memory per rank, bytes on the wire, accuracy."""

from __future__ import annotations

import contextlib

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


def _train(
    rank: int,
    world: int,
    stage: int,
    precision: str,
    steps: int = 3,
    sgd: bool = False,
    reduce_dtype: str | None = None,
    micro: int = 1,
    synced: bool = False,
    unsharded: bool = False,
) -> dict:
    """``steps`` optimizer steps of ``micro`` micro-batches each (the first ones under no_sync, or,
    ``synced``, every one a synchronised backward: several backward passes before one step)."""
    model = models.build_stack(seed=100 + rank)
    comm = Communicator()
    broadcast_module_states(model, comm, label="t")
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1) if sgd else torch.optim.Adam(model.parameters(), lr=1e-2)
    )
    options = {"wrap_policy": BLOCK} if stage == 3 else {}
    if unsharded and stage >= 2:
        options["accumulate_unsharded"] = True
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001, **options)
    engine = make_engine(config, comm, resolve_policy(None, reduce_dtype, precision))
    wrapped = engine.setup(model, [optimizer])
    batches = models.global_batches(steps * micro, world)
    for step in range(steps):
        comm.ledger.begin_step(step)
        for m in range(micro):
            with engine.no_sync() if m < micro - 1 and not synced else contextlib.nullcontext():
                wrapped(*models.rank_slice(batches[step * micro + m], rank)).backward()
        during = measure(model, engine.grad_tensors(), [])
        optimizer.step()
        engine.after_step(optimizer, 0)
        after = measure(model, engine.grad_tensors(), [optimizer], extra_params=engine.param_tensors())
        optimizer.zero_grad()
    between = measure(model, engine.grad_tensors(), [optimizer], extra_params=engine.param_tensors())
    comm.ledger.begin_step(-1)
    state = engine.module_state_dict(model)
    return {
        "between": between,
        "grads_during_step": during.gradients,
        "grads_after_step": after.gradients,  # held by the optimizer's parameters until zero_grad
        "dtype": str(model.emb.weight.dtype),  # stage 3: the parameter at rest, the fp32 master
        "shard": sum(f.flat.shard_numel for u in engine.zero3.units for f in u.flats) if stage == 3 else 0,
        "state": {k: v.clone() for k, v in state.items()},
        "reduce_bytes": sum(
            r.payload_bytes for r in comm.ledger.for_step(1) if r.op in ("all_reduce", "reduce_scatter")
        ),
    }


def _all(
    rank: int,
    world: int,
    precision: str,
    sgd: bool = False,
    reduce_dtype=None,
    micro: int = 1,
    synced=False,
    unsharded=False,
    stages=(0, 1, 2, 3),
) -> dict:
    options = {
        "sgd": sgd,
        "reduce_dtype": reduce_dtype,
        "micro": micro,
        "synced": synced,
        "unsharded": unsharded,
    }
    return {stage: _train(rank, world, stage, precision, **options) for stage in stages}


PSI = sum(p.numel() for p in models.build_stack(0).parameters())


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_model_state_memory_per_rank(tmp_path, world):
    r = run_ranks(_all, world, tmp_path, "bf16-mixed")[0]
    pad = 2 * 4 * world * 12  # padding: < N elements per bucket or unit, at most 4 bytes each, < 12 of them
    steps = 4 * 40  # Adam's 0-dim step counters, 4 bytes per bucket or unit
    for stage in (0, 1, 2):
        assert r[stage]["dtype"] == "torch.bfloat16"
    assert r[3]["dtype"] == "torch.float32"  # at rest the DTensor is the fp32 master; gathered bf16
    mem = {s: r[s]["between"] for s in range(4)}
    # persistent state between steps: bf16 params (2), bf16 grad buckets (2) for stages 0-1, fp32 master + Adam (12)
    assert mem[0].parameters == 2 * PSI and mem[0].gradients == 2 * PSI
    assert 12 * PSI <= mem[0].optimizer_states <= 12 * PSI + steps
    assert 2 * PSI <= mem[1].parameters <= 2 * PSI + pad and 2 * PSI <= mem[1].gradients <= 2 * PSI + pad
    assert 12 * PSI / world <= mem[1].optimizer_states <= 12 * PSI / world + 3 * pad + steps
    assert 2 * PSI <= mem[2].parameters <= 2 * PSI + pad and mem[2].gradients == 0
    assert 12 * PSI / world <= mem[2].optimizer_states <= 12 * PSI / world + 3 * pad + steps
    # stage 3 keeps one copy of its values, the fp32 shard the optimizer steps (the gathers cast it)
    shard = r[3]["shard"]  # elements per rank, rows padded to N (see [Note: row layout])
    assert PSI / world <= shard <= PSI / world + 4 * 12 * world
    assert mem[3].parameters == 4 * shard and mem[3].gradients == 0
    assert 8 * shard <= mem[3].optimizer_states <= 8 * shard + steps
    # during the step the shard gradient is accumulated in fp32 (4 bytes per element of the shard)
    assert 4 * PSI / world <= r[2]["grads_during_step"] <= 4 * PSI / world + 2 * pad
    assert 4 * PSI / world <= r[3]["grads_during_step"] <= 4 * PSI / world + 2 * pad
    # right after the step (before zero_grad, which Lightning calls only in the next step) stages
    # 1-3 still hold their fp32 shard gradients, as DDP holds its gradients until zero_grad; stage
    # 0 drops its masters' gradients at once and keeps its bf16 buckets
    assert r[0]["grads_after_step"] == 2 * PSI
    assert 2 * PSI + 4 * PSI / world <= r[1]["grads_after_step"] <= 2 * PSI + 4 * PSI / world + 2 * pad
    assert 4 * PSI / world <= r[2]["grads_after_step"] <= 4 * PSI / world + 2 * pad
    assert r[3]["grads_after_step"] == 4 * r[3]["shard"]


@pytest.mark.slow  # bf16 halves the bytes of every stage: a byte count, not a parity check
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


def _reference(world: int, steps: int, micro: int, lr: float = 0.1) -> dict:
    """One process, no collectives: bf16 forward/backward of each rank's micro-batches, gradients
    summed in fp32, an SGD step on fp32 masters, masters rounded into the bf16 model. One thread,
    as each rank has: CPU kernels split their reductions (LayerNorm's weight gradient, matmuls) by
    thread, and a bf16 result rounds differently for another split."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_steps(world, steps, micro, lr)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(world: int, steps: int, micro: int, lr: float) -> dict:
    model = models.build_stack(seed=100)
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(torch.bfloat16)
    batches = models.global_batches(steps * micro, world)
    for step in range(steps):
        total = {n: torch.zeros_like(m) for n, m in masters.items()}
        for m in range(micro):
            for rank in range(world):
                model.zero_grad()
                model(*models.rank_slice(batches[step * micro + m], rank)).backward()
                for n, p in model.named_parameters():
                    total[n] += p.grad.float() / world
        with torch.no_grad():
            for n, p in model.named_parameters():
                masters[n] -= lr * total[n]
                p.copy_(masters[n])
    return masters


@pytest.mark.parametrize(
    ("micro", "synced"),
    [
        pytest.param(1, False, marks=pytest.mark.slow),
        pytest.param(2, False, marks=pytest.mark.slow),
        (2, True),
    ],
)
def test_fp32_reduce_of_bf16_gradients(tmp_path, micro, synced):
    """reduce_dtype fp32 under bf16 parameters: every stage equals a reference that sums the bf16
    gradients in fp32 (to fp32 rounding), also with two synchronised backward passes before a step
    (each sum added to the last, none replacing it), and the bytes on the wire are fp32's."""
    r = run_ranks(_all, 2, tmp_path, "bf16-mixed", True, "fp32", micro, synced)[0]
    bf16 = run_ranks(_all, 2, tmp_path, "bf16-mixed", True, None, micro, synced)[0]
    reference = _reference(2, steps=3, micro=micro)
    for stage in (0, 1, 2, 3):
        assert r[stage]["dtype"] == ("torch.float32" if stage == 3 else "torch.bfloat16")
        assert max_diff(r[stage]["state"], reference) <= 1e-6, stage
        assert r[stage]["reduce_bytes"] == 2 * bf16[stage]["reduce_bytes"], stage
    if not synced:  # one AllReduce per optimizer step, however many micro-batches
        assert r[0]["reduce_bytes"] == 4 * PSI
    # the reference tells the two apart: summing in bf16 rounds the sum to 8 bits of mantissa
    assert max_diff(bf16[0]["state"], reference) > 1e-6


@pytest.mark.slow  # the default suite keeps the fp32-reduce parity
def test_fp32_reduce_memory(tmp_path):
    """fp32 buckets: 4 bytes of gradient per element in stages 0-1 (stage 0's master gradients are
    the bucket slots themselves, no second copy); stages 2-3 unchanged."""
    r = run_ranks(_all, 2, tmp_path, "bf16-mixed", False, "fp32")[0]
    pad = 2 * 4 * 2 * 12
    assert r[0]["between"].gradients == 4 * PSI and r[0]["grads_during_step"] == 4 * PSI
    assert 4 * PSI <= r[1]["between"].gradients <= 4 * PSI + pad
    assert r[2]["between"].gradients == 0 and r[3]["between"].gradients == 0
    for stage in (2, 3):
        assert 4 * PSI / 2 <= r[stage]["grads_during_step"] <= 4 * PSI / 2 + 2 * pad


def test_unsharded_accumulation_sums_in_the_reduce_dtype(tmp_path):
    """Stages 2-3 with accumulate_unsharded, bf16 parameters, reduce_dtype fp32, two micro-batches
    per step (the first under no_sync): the micro-batches' bf16 gradients are summed in fp32 (stage
    3 keeps them in an fp32 buffer per parameter, as FSDP2 does), so both stages equal the
    reference that sums in fp32; summed in bf16 they would not."""
    r = run_ranks(_all, 2, tmp_path, "bf16-mixed", True, "fp32", 2, False, True, (2, 3))[0]
    reference = _reference(2, steps=3, micro=2)
    for stage in (2, 3):
        assert max_diff(r[stage]["state"], reference) <= 1e-6, stage
