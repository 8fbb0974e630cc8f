"""Hybrid sharding (``shard_size``) on 4 CPU ranks posing as 2 nodes of 2 (docs/planning.md).

Every fit of this file runs in one set of 4 processes (tests/matrix/runner.py), which Lightning sees
as ``num_nodes=2`` x ``devices=2``; the matrix's module and data (3 micro-batches per rank and epoch). Compared, per case:

- stages 1-3 with ``shard_size=2`` (one shard group per node) end where zero0 ends (fp32: to 1e-6;
  bf16-mixed: within a few bf16 roundings, see BF16_TOL), with accumulation and clipping, and the 4
  ranks hold exactly equal weights;
- the ledger files every gather and reduce-scatter of the shard groups under the intra-node link
  and only the replicate groups' all-reduces under the inter-node link, in the bytes the ring model
  gives for an all-reduce of 1/K of every flat space; at stage 3 that is at least 2x less
  inter-node traffic than full sharding on the same model;
- a checkpoint written with one shard size resumes with another (and another stage), in both
  forms, and the resumed run ends where the uninterrupted zero0 run ends.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lightning_zero import ZeroStrategy
from lightning_zero.planning import hybrid_traffic
from tests.fabric import jobs
from tests.matrix.lit import BATCH, Case, MatrixModule
from tests.matrix.runner import run_jobs

WORLD, NODES = 4, 2
BLOCK = "tests.matrix.lit.Block"
FP32_TOL = 1e-6
# bf16-mixed reduces bf16 gradients: hybrid sharding rounds each sum of 4 after 2 ranks (inside the
# group) and again after 4 (across the groups), where zero0 rounds once; observed 4.5e-4 after 3 steps
# (full sharding at stage 3: 5.4e-4), against weights of order 1 whose bf16 spacing is 4e-3 to 8e-3
BF16_TOL = 2e-3
CASES = (Case(), Case(accumulate=3, clip=0.05), Case(precision="bf16-mixed"))
VARIANTS = ((0, None), (1, 2), (2, 2), (3, 2), (1, None), (2, None), (3, None), (3, "auto"))  # (stage, K)
FABRIC = ((None, None), (2, 2), (3, 2))  # Fabric's ddp, then hybrid stages
HPZ = {"secondary_shard_size": "node"}  # ZeRO++'s hpZ (docs/quantized.md)
INT8 = {"quantize_weights": True, "quantize_grads": True, "quantize_block": 32}
RESUMES = (  # (stage, shard_size, form) that saves after epoch 1 -> (stage, shard_size) that resumes
    ((3, 2, "full"), (2, None)),
    ((3, 2, "sharded"), (3, None)),
    ((2, None, "sharded"), (1, 2)),
    ((1, 2, "full"), (3, 2)),
)


def _strategy(stage: int, shard_size: int | None, form: str = "full", **more: Any) -> ZeroStrategy:
    options: dict[str, Any] = {"state_dict_type": form, **more}
    if stage == 3:
        options["wrap_policy"] = BLOCK
    if shard_size is not None:
        options["shard_size"] = shard_size
    return ZeroStrategy(stage=stage, **options)


class MemoryAfterFirstStep(Callback):
    """The model-state bytes this rank holds after the first optimizer step (strategy.memory_report)."""

    def __init__(self) -> None:
        self.report = None

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        if self.report is None and trainer.global_step == 1:
            self.report = trainer.strategy.memory_report()


def _trainer(
    strategy: ZeroStrategy, case: Case, root: str, epochs: int, callbacks: list | None = None
) -> Trainer:
    return Trainer(
        callbacks=callbacks or [],
        strategy=strategy,
        accelerator="cpu",
        devices=WORLD // NODES,
        num_nodes=NODES,
        precision=case.precision,
        max_epochs=epochs,
        accumulate_grad_batches=case.accumulate,
        gradient_clip_val=case.clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def fit(stage: int, shard_size: int | str | None, case: Case, root: str, **more: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MatrixModule(case, per_rank=BATCH)
    strategy = _strategy(stage, shard_size, **more)
    memory = MemoryAfterFirstStep()
    _trainer(strategy, case, root, epochs=1, callbacks=[memory]).fit(model)
    chosen = strategy._run.fitted.comm.world_size  # K: the size of the group the engine sharded over
    ledger = strategy.ledger
    records = [(r.op, r.name, r.wire_bytes, r.link, r.group_size) for r in ledger.records if r.step == 1]
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "params": _params(model),
        "links": ledger.link_bytes(1),
        "records": records,
        "psi": psi,
        "k": chosen,
        "memory": memory.report,
    }


def auto_report(root: str) -> dict[str, Any]:
    """``shard_size="auto"``'s choice made directly, with its printed report."""
    import torch.distributed as dist

    from lightning_zero.comm import Communicator
    from lightning_zero.comm.mesh import choose_automatically

    comm = Communicator()
    comm.watch_faults()
    reports: list[str] = []
    k = choose_automatically(comm, 3, 2, MatrixModule(Case()), torch.device("cpu"), reports.append)
    return {"k": k, "report": "\n".join(reports), "rank": dist.get_rank()}


def save_then_resume(saver: tuple, resumer: tuple, folder: str, root: str) -> dict[str, Any]:
    """Two epochs: the first under ``saver``, saved after fit in its form; the second resumed from
    that file under ``resumer``."""
    stage, shard_size, form = saver
    path = os.path.join(folder, f"s{stage}-k{shard_size}-{form}.ckpt")
    torch.manual_seed(0)
    first = MatrixModule(Case(), per_rank=BATCH)
    trainer = _trainer(_strategy(stage, shard_size, form), Case(), root, epochs=1)
    trainer.fit(first)
    trainer.save_checkpoint(path)
    torch.manual_seed(1)  # other initial weights: the checkpoint must bring them back
    second = MatrixModule(Case(), per_rank=BATCH)
    _trainer(_strategy(*resumer), Case(), root, epochs=2).fit(second, ckpt_path=path)
    return {"params": _params(second)}


def fabric_fit(stage: int | None, shard_size: int | None, root: str, **more: Any) -> dict[str, Any]:
    """A hand-written Fabric loop (tests/fabric/jobs.py): 4 micro-batches, accumulation over 2
    (no_backward_sync), clipping by norm; stage None: Fabric's own ddp."""
    options = {"shard_size": shard_size, **more} if shard_size is not None else more
    fabric = L.Fabric(
        strategy=jobs.strategy(stage, **options), accelerator="cpu", devices=WORLD // NODES, num_nodes=NODES
    )
    fabric.launch()
    loop = jobs.Loop(accumulate=2, clip=("norm", 0.05))
    model, optimizer = jobs.set_up(fabric, loop)
    jobs.train(fabric, model, optimizer, loop, range(4), Counter())
    return {"params": jobs.full_params(fabric, model)}


def uninterrupted(root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MatrixModule(Case(), per_rank=BATCH)
    _trainer(_strategy(0, None), Case(), root, epochs=2).fit(model)
    return {"params": _params(model)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hsdp")
    todo: dict[tuple, Any] = {}
    for case in CASES:
        for stage, shard_size in VARIANTS:
            todo[("fit", case, stage, shard_size)] = functools.partial(fit, stage, shard_size, case)
    for saver, resumer in RESUMES:
        todo[("resume", saver, resumer)] = functools.partial(save_then_resume, saver, resumer, str(root))
    todo[("uninterrupted",)] = uninterrupted
    todo[("auto",)] = auto_report
    for stage, shard_size in FABRIC:
        todo[("fabric", stage, shard_size)] = functools.partial(fabric_fit, stage, shard_size)
    for case in CASES:  # secondary shards over each node, full sharding (and int8 on the wire)
        todo[("hpz", case)] = functools.partial(fit, 3, None, case, **HPZ)
        todo[("hpz-int8", case)] = functools.partial(fit, 3, None, case, **HPZ, **INT8)
        todo[("int8", case)] = functools.partial(fit, 3, None, case, **INT8)
    todo[("fabric-hpz",)] = functools.partial(fabric_fit, 3, None, **HPZ)
    ranks = run_jobs(list(todo.values()), str(root / "ranks"), world=WORLD, timeout=900, nodes=NODES)
    return {key: [r[i] for r in ranks] for i, key in enumerate(todo)}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_hybrid_sharding_trains_as_zero0_on_every_stage(runs):
    errors = []
    for case in CASES:
        reference = runs[("fit", case, 0, None)][0]["params"]
        for stage, shard_size in VARIANTS[1:]:
            ranks = runs[("fit", case, stage, shard_size)]
            for r in range(1, WORLD):
                if (d := _max_diff(ranks[r]["params"], ranks[0]["params"])) != 0.0:
                    errors.append(f"{case.name} zero{stage} k={shard_size}: rank {r} differs by {d:.1e}")
            d = _max_diff(ranks[0]["params"], reference)
            if case.precision == "32-true":
                if d > FP32_TOL:
                    errors.append(f"{case.name} zero{stage} k={shard_size}: {d:.2e} from zero0")
            elif d > BF16_TOL:
                errors.append(f"{case.name} zero{stage} k={shard_size}: {d:.2e} from zero0")
    assert not errors, "\n".join(errors)


def test_only_the_replicas_all_reduce_crosses_nodes(runs):
    """Stage by stage, the inter-node bytes of a step are the replicate all-reduces of the shards:
    2 (R-1)/R x padded space / K x 4 bytes per flat space, R = K = 2; everything else stays inside
    the node, as the planner predicts; at stage 3 the inter-node bytes are at least 2x fewer than full sharding's."""
    for stage in (1, 2, 3):
        records = runs[("fit", Case(), stage, 2)][0]["records"]
        inter = [r for r in records if r[3] == "inter"]
        assert inter and all(r[0] == "all_reduce" and r[1].endswith("/replicas") for r in inter), inter
        assert all(r[3] == "intra" for r in records if not r[1].endswith("/replicas"))
        assert all(r[4] == 2 for r in inter)  # R = 2 ranks per replicate group
        run = runs[("fit", Case(), stage, 2)][0]
        links = run["links"]
        assert links["inter"] == pytest.approx(sum(r[2] for r in inter))
        # the planner's figure (Ψ exactly; the flat spaces pad each to a multiple of K: rel 1e-3)
        plan = hybrid_traffic(
            run["psi"], WORLD, stage, ranks_per_node=2, shard_size=2, param_bytes=4, grad_bytes=4
        )
        assert links["inter"] == pytest.approx(plan.inter, rel=1e-3), (links, plan)
        full = runs[("fit", Case(), stage, None)][0]["links"]
        assert set(full) == {"inter"}  # full sharding over 2 nodes: every collective crosses
        if stage == 3:
            assert full["inter"] >= 2 * links["inter"], (full, links)


def test_memory_per_rank_divides_by_the_shard_size(runs):
    """fp32, SGD with momentum: the sharded terms (stage 3's parameters, the optimizer state) hold
    1/K of the model with K = 2, twice what full sharding (K = N = 4) holds, up to padding, and so
    do stage 2's reduced gradients (kept until zero_grad); the unsharded terms (stages 1-2's
    parameters, stage 1's gradient buckets) are the same."""
    pad = 4 * WORLD * 8  # < N padding elements per flat space, 4 bytes each, a few spaces
    for stage in (1, 2, 3):
        hybrid = runs[("fit", Case(), stage, 2)][0]["memory"]
        full = runs[("fit", Case(), stage, None)][0]["memory"]
        psi = runs[("fit", Case(), stage, 2)][0]["psi"]
        assert abs(hybrid.optimizer_states - 4 * psi / 2) <= pad, (stage, hybrid)
        assert abs(hybrid.optimizer_states - 2 * full.optimizer_states) <= 2 * pad, (stage, hybrid, full)
        if stage == 3:
            assert abs(hybrid.parameters - 4 * psi / 2) <= pad, hybrid
            assert abs(hybrid.parameters - 2 * full.parameters) <= 2 * pad, (hybrid, full)
        elif stage == 2:
            assert hybrid.parameters == full.parameters
            assert abs(hybrid.gradients - 2 * full.gradients) <= 2 * pad, (hybrid, full)
        else:
            assert hybrid.parameters == full.parameters


def test_a_checkpoint_resumes_with_another_shard_size_and_stage(runs):
    reference = runs[("uninterrupted",)][0]["params"]
    errors = []
    for saver, resumer in RESUMES:
        ranks = runs[("resume", saver, resumer)]
        d = _max_diff(ranks[0]["params"], reference)
        if d > FP32_TOL:
            errors.append(f"saved by {saver}, resumed by {resumer}: {d:.2e} from the uninterrupted zero0 run")
        if any(_max_diff(r["params"], ranks[0]["params"]) != 0.0 for r in ranks[1:]):
            errors.append(f"saved by {saver}, resumed by {resumer}: the ranks differ")
    assert not errors, "\n".join(errors)


def test_auto_chooses_one_shard_size_on_every_rank_from_measured_links(runs):
    """``shard_size="auto"``: every rank takes the same valid K (1, 2 or 4 here), trains as zero0, and
    the choice is printed with the measured links and the planner's table of alternatives."""
    for case in CASES:
        chosen = {r["k"] for r in runs[("fit", case, 3, "auto")]}
        assert len(chosen) == 1 and chosen <= {1, 2, 4}, chosen
    direct = runs[("auto",)]
    assert len({r["k"] for r in direct}) == 1
    report = direct[0]["report"]
    assert f"shard_size='auto' chose {direct[0]['k']}" in report, report
    assert "links measured: inside a node" in report and "across nodes" in report, report
    for k in (1, 2, 4):  # the planner's table: one row per valid K
        assert any(line.split()[:1] == [str(k)] for line in report.splitlines()), report


def test_a_fabric_loop_with_hybrid_sharding_trains_as_fabric_ddp(runs):
    reference = runs[("fabric", None, None)][0]["params"]
    for stage, shard_size in FABRIC[1:]:
        ranks = runs[("fabric", stage, shard_size)]
        assert _max_diff(ranks[0]["params"], reference) <= FP32_TOL, (stage, shard_size)
        assert all(_max_diff(r["params"], ranks[0]["params"]) == 0.0 for r in ranks[1:])


def test_a_shard_size_that_does_not_fit_is_refused_at_setup(tmp_path):
    from lightning_zero.comm.mesh import resolve_shard_size

    with pytest.raises(ValueError, match="does not divide the world size 4"):
        resolve_shard_size(3, 4, 2, stage=3)
    with pytest.raises(ValueError, match="span nodes unevenly"):
        resolve_shard_size(3, 6, 2, stage=2)
    with pytest.raises(ValueError, match="stage 0 shards nothing"):
        ZeroStrategy(stage=0, shard_size=2)
    assert resolve_shard_size("node", 8, 4, stage=1) == 4
    assert resolve_shard_size(None, 8, 4, stage=0) == 8


def test_secondary_shards_gather_inside_the_node_and_train_as_without(runs):
    """``secondary_shard_size="node"`` at stage 3 with full sharding over 2 nodes: each unit's
    backward all-gather runs inside the node (the forward's still across), the inter-node bytes
    drop by those gathers, and the fit is bit for bit the fit without it, with int8 on the wire
    too, under the Trainer and Fabric."""
    for case in CASES:
        hpz, full = runs[("hpz", case)], runs[("fit", case, 3, None)]
        for mine, theirs in zip(hpz, full):
            assert _max_diff(mine["params"], theirs["params"]) == 0.0, case.name
        for mine, theirs in zip(runs[("hpz-int8", case)], runs[("int8", case)]):
            assert _max_diff(mine["params"], theirs["params"]) == 0.0, case.name
        records = hpz[0]["records"]
        if not full[0]["records"]:
            continue  # one optimizer step per epoch: no step 1 to count
        kept = [r for r in records if r[0] == "all_gather" and r[1].endswith("/secondary")]
        assert kept and all(r[3] == "intra" and r[4] == 2 for r in kept), kept
        assert all(r[3] == "inter" for r in records if r not in kept)
        # a gather of P bytes sends 3/4 P per rank across 4 ranks, 1/2 P inside a node's 2
        moved = 1.5 * sum(r[2] for r in kept)
        assert hpz[0]["links"]["inter"] == pytest.approx(full[0]["links"]["inter"] - moved, rel=1e-6)
    fabric = runs[("fabric-hpz",)]
    assert _max_diff(fabric[0]["params"], runs[("fabric", None, None)][0]["params"]) <= FP32_TOL
    assert all(_max_diff(r["params"], fabric[0]["params"]) == 0.0 for r in fabric[1:])
