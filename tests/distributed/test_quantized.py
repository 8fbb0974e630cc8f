"""Stage 3 with int8 on the wire ([Note: quantized communication]): the bytes the ledger counts
against the wire format, training against the same run in full precision, and the accuracy guard
fed outlier weights."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from lightning_zero.comm import Communicator
from lightning_zero.comm.mesh import sharding_comm
from lightning_zero.comm.quantize import BlockLayout
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import make_engine
from lightning_zero.grad_sync import broadcast_module_states
from tests.distributed import models
from tests.distributed.harness import run_ranks

BLOCK = "tests.distributed.models.Block"
Q_BLOCK = 32  # elements per int8 block: the tiny model's parameters are a few blocks each


def _train(rank: int, world: int, sc: dict) -> dict:
    model = models.build_stack(seed=100 + rank, **sc.get("model", {}))
    if sc.get("outlier"):  # a few values 1e4 times the rest, in one unit (before sharding: rank 0's count)
        with torch.no_grad():
            model.blocks[1].fc1.weight[0, :3] = 1e4 * model.blocks[1].fc1.weight.abs().mean()
    comm = Communicator()
    broadcast_module_states(model, comm, label="t")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    stage = sc.get("stage", 3)
    policy = {"wrap_policy": BLOCK} if stage == 3 else {}
    config = ZeroConfig(stage=stage, **policy, quantize_block=Q_BLOCK, **sc.get("zero3", {}))
    hybrid = config.shard_size or config.secondary_shard_size
    shards = (
        sharding_comm(comm, config.shard_size, 3, 2, secondary_shard_size=config.secondary_shard_size)
        if hybrid
        else comm
    )
    if sc.get("refuse_all"):  # the guard refuses every quantized collective: only fallbacks run
        from lightning_zero.comm.quantize import WireGuard

        accept = WireGuard.accept
        WireGuard.accept = lambda guard, figures: accept(guard, figures + 1.0)  # figures above any threshold
    engine = make_engine(config, shards)
    wrapped = engine.setup(model, [optimizer])
    accumulate = sc.get("accumulate", 1)
    batches = models.global_batches(sc["micro_batches"], world)
    losses, step = [], 0
    with _warnings() as warned:
        for batch, sync in zip(batches, models.sync_points(len(batches), accumulate)):
            comm.ledger.begin_step(step)
            with contextlib.nullcontext() if sync else engine.no_sync():
                loss = wrapped(*models.rank_slice(batch, rank))
                (loss / accumulate).backward()
            losses.append(loss.item())
            if sync:
                if sc.get("clip"):
                    engine.clip_grad_norm_(optimizer, sc["clip"])
                optimizer.step()
                engine.after_step(optimizer, 0)
                optimizer.zero_grad()
                step += 1
    comm.ledger.begin_step(-1)
    if stage < 3:
        buckets = {f"bucket={b.index}": b.spec.padded_numel for b in wrapped.sync.buckets}
        fallbacks = {b.index: b.int8.guard.fallbacks for b in wrapped.sync.buckets if b.int8 is not None}
        meter = engine.buffer_meter
        return {"params": engine.module_state_dict(model), "ledger": [r for r in comm.ledger.records if r.step >= 0],
                "losses": losses, "buckets": buckets, "grad_fallbacks": fallbacks,
                "buffers": None if meter is None else (meter.now, meter.peak)}  # fmt: skip
    units = engine.zero3.units
    probe = _probe_gathered(engine, model) if sc.get("probe") else None
    return {
        "probe": probe,
        "params": {k: v.clone() for k, v in engine.module_state_dict(model).items()},
        "ledger": [r for r in comm.ledger.records if r.step >= 0],
        "losses": losses,
        "chunks": {u.name: u.flat.chunks for u in units},
        "weight_fallbacks": {
            u.name: u.trainable.guard.fallbacks for u in units if u.trainable.wire is not None
        },
        "grad_fallbacks": {u.name: u.guard.fallbacks for u in units if u.wire is not None},
        "warned": warned,
    }


def _probe_gathered(engine, model) -> dict:
    """The values before, read inside ``gathered()`` (one element changed there), and after."""
    before = {k: v.clone() for k, v in engine.module_state_dict(model).items()}
    with engine.gathered():
        seen = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            model.blocks[0].fc1.weight[0, 0] += 1.0
    after = {k: v.clone() for k, v in engine.module_state_dict(model).items()}
    return {"before": before, "seen": seen, "after": after}


@contextlib.contextmanager
def _warnings():
    """The messages the guard logs while training."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning_zero.comm.quantize")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _runs(rank: int, world: int, variants: dict, sc: dict) -> dict:
    return {name: _train(rank, world, {**sc, "zero3": options}) for name, options in variants.items()}


def _step_bytes(result: dict, op: str, step: int = 1) -> dict[str, tuple[int, int]]:
    """Unit name -> (calls, payload bytes) of ``op`` in ``step``."""
    out: dict[str, tuple[int, int]] = {}
    for r in result["ledger"]:
        if r.step == step and r.op == op and "/unit=" in r.name:
            unit = r.name.split("unit=")[1].split("/")[0]
            calls, nbytes = out.get(unit, (0, 0))
            out[unit] = (calls + 1, nbytes + r.payload_bytes)
    return out


VARIANTS = {
    "full": {},
    "weights": {"quantize_weights": True},
    "grads": {"quantize_grads": True},
    "both": {"quantize_weights": True, "quantize_grads": True},
}


def test_bytes_follow_the_wire_format_and_training_follows_full_precision(tmp_path):
    world = 2
    sc = {"micro_batches": 6, "accumulate": 2, "clip": 1.0}
    results = run_ranks(_runs, world, tmp_path, VARIANTS, sc)
    for r in results:
        full, weights, grads, both = (r[k] for k in VARIANTS)
        packed = {u: world * BlockLayout(c, Q_BLOCK).nbytes for u, c in full["chunks"].items()}
        gathers, reduces = _step_bytes(full, "all_gather"), _step_bytes(full, "reduce_scatter")
        # every gather and reduction of a unit sends one packed chunk per rank, whatever the dtype;
        # the root's gathers stay in full precision (it stays gathered where user code reads it)
        int8_gathers = {u: (n, n * packed[u]) if u != "root" else (n, b) for u, (n, b) in gathers.items()}
        assert _step_bytes(weights, "all_gather") == int8_gathers
        assert _step_bytes(grads, "reduce_scatter") == {
            u: (n, n * packed[u]) for u, (n, _) in reduces.items()
        }
        assert _step_bytes(weights, "reduce_scatter") == reduces
        assert _step_bytes(grads, "all_gather") == gathers
        assert _step_bytes(both, "all_gather") == _step_bytes(weights, "all_gather")
        assert _step_bytes(both, "reduce_scatter") == _step_bytes(grads, "reduce_scatter")
        assert not any(x.name.endswith("/fallback") for x in both["ledger"])
        # training: close to the run in full precision, and the same model on every rank
        for variant in (weights, grads, both):
            assert variant["weight_fallbacks"] == {} or set(variant["weight_fallbacks"].values()) == {0}
            assert abs(variant["losses"][-1] - full["losses"][-1]) <= 0.01 * full["losses"][-1]
            for k, v in full["params"].items():
                err = (variant["params"][k] - v).norm() / v.norm().clamp_min(1e-3)
                assert err <= 0.05, (k, err.item())
    for k, v in results[0]["both"]["params"].items():
        assert torch.equal(v, results[1]["both"]["params"][k])


def test_gathered_shows_and_keeps_the_exact_values(tmp_path):
    """Inside ``gathered()`` the user reads the weights themselves, not their int8 rounding, and
    what the user writes there reaches the full-precision shards element by element: the values
    the user did not touch stay as they were (a unit gathered in int8 never writes its rounding
    back)."""
    sc = {"micro_batches": 2, "probe": True}
    for r in run_ranks(_runs, 2, tmp_path, {"weights": {"quantize_weights": True}}, sc):
        probe = r["weights"]["probe"]
        before, seen, after = probe["before"], probe["seen"], probe["after"]
        assert before.keys() == seen.keys() == after.keys()
        for k, v in before.items():
            assert torch.equal(seen[k], v), k
            expected = v.clone()
            if k == "blocks.0.fc1.weight":
                expected[0, 0] += 1.0
            assert torch.equal(after[k], expected), k


def test_guard_falls_back_for_the_unit_with_outliers(tmp_path):
    both = {"quantize_weights": True, "quantize_grads": True, "quantize_fallback_steps": 2}
    sc = {"micro_batches": 5, "outlier": True}
    for rank, r in enumerate(run_ranks(_runs, 2, tmp_path, {"both": both, "full": {}}, sc)):
        quantized, full = r["both"], r["full"]
        fallbacks = quantized["weight_fallbacks"]
        assert fallbacks["blocks.1"] >= 2  # tripped, then again when int8 was tried after 2 steps
        assert all(n == 0 for unit, n in fallbacks.items() if unit != "blocks.1")
        names = [x.name for x in quantized["ledger"] if x.name.endswith("/fallback")]
        assert names and all("unit=blocks.1/" in n for n in names)  # its gradients follow its weights
        # the world's rank 0 says so, once per fallback (every rank decides alike)
        warned = [m for m in quantized["warned"] if "weights of unit 'blocks.1'" in m]
        assert len(warned) == (fallbacks["blocks.1"] if rank == 0 else 0)
        # the unit never computed with its rounded weights: each of its int8 gathers was sent again
        gathers = [x.name for x in quantized["ledger"] if x.op == "all_gather" and "unit=blocks.1/" in x.name]
        tried = [n for n in gathers if n.endswith("/int8")]
        assert tried and len(tried) == sum(n.endswith("/fallback") for n in gathers) == fallbacks["blocks.1"]
        # and the run stays near full precision (AdamW turns the other units' rounding into moves
        # of about 1% of this tiny model's loss)
        assert abs(quantized["losses"][-1] - full["losses"][-1]) <= 0.03 * full["losses"][-1]


@pytest.mark.parametrize("stage", [3, 2])
def test_a_refused_collective_leaves_no_trace(tmp_path, stage):
    """Every quantized collective refused by the guard (weights and gradients, retried after one
    step): the run is bit for bit the run in full precision, so a fallback never lets rounded
    values reach the model."""
    both = {"quantize_grads": True, "quantize_fallback_steps": 1}
    if stage == 3:
        both["quantize_weights"] = True
    sc = {"micro_batches": 4, "stage": stage}
    (tmp_path / "q").mkdir()
    (tmp_path / "f").mkdir()
    refused = run_ranks(_runs, 2, tmp_path / "q", {"both": both}, {**sc, "refuse_all": True})
    full = run_ranks(_runs, 2, tmp_path / "f", {"full": {}}, sc)
    for q, f in zip(refused, full):
        q, f = q["both"], f["full"]
        assert sum(q["grad_fallbacks"].values()) >= 2
        if stage == 3:
            assert sum(q["weight_fallbacks"].values()) >= 2
        assert q["losses"] == f["losses"]
        for name, value in f["params"].items():
            assert torch.equal(q["params"][name], value), name


def test_options_are_checked():
    with pytest.raises(ValueError, match="applies to stage 3"):
        ZeroConfig(stage=2, quantize_weights=True)
    with pytest.raises(ValueError, match="applies to stages 1-3"):
        ZeroConfig(stage=0, quantize_grads=True)
    with pytest.raises(ValueError, match="quantize_block must be a multiple of 32"):
        ZeroConfig(stage=3, quantize_weights=True, quantize_block=100)
    with pytest.raises(ValueError, match="quantize_guard must be a share"):
        ZeroConfig(stage=3, quantize_weights=True, quantize_guard=2)


def test_hybrid_sharding_quantizes_inside_the_shard_group(tmp_path):
    """4 ranks posing as 2 nodes of 2, shard groups of 2: the int8 all-gathers and reductions run
    in the group, inside a node; the replicas' all-reduce of each reduced shard stays in full
    precision."""
    variants = {"full": {"shard_size": 2}, "both": {"shard_size": 2, **VARIANTS["both"]}}
    results = run_ranks(_runs, 4, tmp_path, variants, {"micro_batches": 4})
    for r in results:
        full, both = r["full"], r["both"]
        packed = {u: 2 * BlockLayout(c, Q_BLOCK).nbytes for u, c in both["chunks"].items()}
        gathers, reduces = _step_bytes(full, "all_gather"), _step_bytes(full, "reduce_scatter")
        int8_gathers = {u: (n, n * packed[u]) if u != "root" else (n, b) for u, (n, b) in gathers.items()}
        assert _step_bytes(both, "all_gather") == int8_gathers  # the root in full precision
        assert _step_bytes(both, "reduce_scatter") == {u: (n, n * packed[u]) for u, (n, _) in reduces.items()}
        assert _step_bytes(both, "all_reduce") == _step_bytes(full, "all_reduce") != {}
        int8 = [x for x in both["ledger"] if x.name.endswith("/int8")]
        assert int8 and all(x.group_size == 2 and x.link == "intra" for x in int8)
        assert abs(both["losses"][-1] - full["losses"][-1]) <= 0.01 * full["losses"][-1]
    for k, v in results[0]["both"]["params"].items():
        assert all(torch.equal(v, other["both"]["params"][k]) for other in results[1:])


def _gathers(result: dict, step: int = 1) -> list:
    """The all-gathers of the units but the root in ``step``."""
    return [
        r for r in result["ledger"]
        if r.step == step and r.op == "all_gather" and "/unit=" in r.name and "unit=root" not in r.name
    ]  # fmt: skip


def test_secondary_shards_keep_the_backward_gathers_inside_the_node(tmp_path):
    """4 ranks posing as 2 nodes of 2, every rank sharding (no hybrid): with secondary_shard_size=2
    each unit's backward all-gather runs in the rank's node, from the copy its forward left, and
    training is bit for bit the training without it, in full precision and with int8 weights and
    gradients (the backward computes with exactly what the forward did)."""
    quantized = VARIANTS["both"]
    variants = {
        "full": {},
        "hpz": {"secondary_shard_size": 2},
        "node": {"secondary_shard_size": "node"},
        "int8": quantized,
        "all": {"secondary_shard_size": 2, **quantized},
    }
    results = run_ranks(_runs, 4, tmp_path, variants, {"micro_batches": 4, "accumulate": 2})
    for r in results:
        full, hpz = _gathers(r["full"]), _gathers(r["hpz"])
        kept = [x for x in hpz if x.name.endswith("/secondary")]
        across = [x for x in hpz if not x.name.endswith("/secondary")]
        # one gather per unit and micro-batch crosses the nodes (forward), one stays inside (backward)
        assert len(full) == 2 * len(kept) == 2 * len(across) > 0
        assert all(x.group_size == 2 and x.link == "intra" for x in kept)
        assert all(x.group_size == 4 and x.link == "inter" for x in across)
        assert sorted(x.payload_bytes for x in hpz) == sorted(x.payload_bytes for x in full)
        assert [x.name for x in _gathers(r["node"])] == [x.name for x in hpz]
        int8_kept = [x for x in _gathers(r["all"]) if x.name.endswith("/secondary")]
        assert len(int8_kept) == len(kept)  # the int8 forward left its dequantized values
        for same, reference in (("hpz", "full"), ("node", "full"), ("all", "int8")):
            assert r[same]["losses"] == r[reference]["losses"]
            for k, v in r[reference]["params"].items():
                assert torch.equal(r[same]["params"][k], v), (same, k)


def test_secondary_shard_size_is_checked():
    with pytest.raises(ValueError, match="applies to stage 3"):
        ZeroConfig(stage=2, secondary_shard_size=2)
    with pytest.raises(ValueError, match="reshard_after_forward=false"):
        ZeroConfig(stage=3, secondary_shard_size=2, reshard_after_forward=False)
    with pytest.raises(ValueError, match=">= 2"):
        ZeroConfig(stage=3, secondary_shard_size=1)
    with pytest.raises(ValueError, match="quantize_weights with reshard_after_forward=false"):
        ZeroConfig(stage=3, quantize_weights=True, reshard_after_forward=False)
    from lightning_zero.comm.mesh import resolve_secondary_size

    with pytest.raises(ValueError, match="does not divide the shard group of 4"):
        resolve_secondary_size(3, 4, 4)
    with pytest.raises(ValueError, match="span nodes unevenly"):
        resolve_secondary_size(4, 8, 6)
    assert resolve_secondary_size("node", 8, 4) == 4
    assert resolve_secondary_size("node", 4, 4) is None  # one node: the shard group itself


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_reduce_their_buckets_in_int8(tmp_path, stage):
    """``quantize_grads`` at stages 1-2: every bucket's reduce-scatter sends one packed chunk per
    rank (a bucket's chunk is one segment: a rank's chunk of a flat bucket cuts parameters
    anywhere), the all-gathers stay as they were, and training follows full precision."""
    world, sc = 2, {"micro_batches": 6, "accumulate": 2, "clip": 1.0, "stage": stage}
    results = run_ranks(_runs, world, tmp_path, {"full": {}, "grads": {"quantize_grads": True}}, sc)
    for r in results:
        full, grads = r["full"], r["grads"]
        step = [x for x in grads["ledger"] if x.step == 1]
        reduces = [x for x in step if x.op == "reduce_scatter"]
        assert reduces and all(x.name.endswith("/int8") for x in reduces)
        for x in reduces:
            bucket = x.name.split("/")[-2]
            packed = BlockLayout([grads["buckets"][bucket] // world], Q_BLOCK).nbytes
            assert x.payload_bytes == world * packed, x
        gathers = [(x.name, x.payload_bytes) for x in step if x.op == "all_gather"]
        assert gathers == [
            (x.name, x.payload_bytes) for x in full["ledger"] if x.step == 1 and x.op == "all_gather"
        ]
        assert set(grads["grad_fallbacks"].values()) == {0}
        # the packed chunks in flight (sent and received) are counted, and freed by the end
        packed = [2 * world * BlockLayout([n // world], Q_BLOCK).nbytes for n in grads["buckets"].values()]
        now, peak = grads["buffers"]
        assert now == 0 and peak >= max(packed)
        if stage == 1:
            assert full["buffers"] is None  # full precision at stage 1: nothing transient
        else:  # at full precision's peak, int8 also holds the launched bucket's packed chunks
            assert peak >= full["buffers"][1] + min(packed)
        assert abs(grads["losses"][-1] - full["losses"][-1]) <= 0.01 * full["losses"][-1]
        for k, v in full["params"].items():
            assert (grads["params"][k] - v).norm() / v.norm().clamp_min(1e-3) <= 0.05, k
    for k, v in results[0]["grads"]["params"].items():
        assert torch.equal(v, results[1]["grads"]["params"][k])
