"""ZeroMonitor through the Trainer: logged bytes and memory equal the planner's, stage by stage.

Each test spawns its ranks once (the gloo harness) and runs one Trainer per strategy inside them:
with LOCAL_RANK set, Lightning joins the existing process group instead of launching processes,
so four stages cost one spawn. The slow set adds the example GPT at N = 2 and 4, Lightning's own
spawn launcher, and every sharded stage on 3 ranks, where flat spaces are padded. The metrics are read back from the
CSVLogger's metrics.csv, as a user would read them.
"""

from __future__ import annotations

import csv
import os
import time
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_zero import ZeroStrategy
from lightning_zero.callbacks import OPS, ZeroMonitor
from lightning_zero.planning import model_state_memory, step_traffic
from tests.distributed.harness import run_ranks
from tests.integration.lit import LitTiny

BLOCK = "tests.distributed.models.Block"
GPT_BLOCK = "examples.gpt.Block"
STEPS = 3  # optimizer steps per run
PARAM_BYTES = GRAD_BYTES = 4  # fp32 training
ADAM_K = 8  # Adam's two moments, no master copy (the parameters are the fp32 weights)
STRAGGLE_S = 0.2  # seconds rank 1 sleeps per training step in the straggler run


# --------------------------------------------------------------------------- models


def tiny_model() -> LitTiny:
    return LitTiny(stack=True)  # Ψ = 5,440; embedding tied to the head; 3 Blocks


class SlowRankTiny(LitTiny):
    """Rank 1 sleeps in every training step: a straggler."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            time.sleep(STRAGGLE_S)
        return super().training_step(batch, batch_idx)


def gpt_model():
    from examples.data import CharDataModule
    from examples.gpt import GPTLightning

    data = CharDataModule(block_size=16, batch_size=4, num_train_samples=256)
    model = GPTLightning(vocab_size=data.vocab_size, n_layer=2, n_head=2, n_embd=24, block_size=16)
    return model, data


def shape_of(module) -> tuple[int, int, int]:
    """Ψ, the elements outside every Block (stage 3's root unit) and the parameter tensors."""
    params = [p for p in module.parameters() if p.requires_grad]
    in_blocks = {
        id(p) for name, m in module.named_modules() if type(m).__name__ == "Block" for p in m.parameters()
    }
    root = sum(p.numel() for p in params if id(p) not in in_blocks)
    return sum(p.numel() for p in params), root, len(params)


def row_layout(module, n: int) -> tuple[int, int]:
    """Stage 3's Ψ and root unit as laid out over N ranks ([Note: row layout] in
    zero/flat_param.py): each parameter's first dimension rounded up to a multiple of N, a 0-dim
    one held by every rank. What its collectives move and its shards hold, padding included."""
    in_blocks = {
        id(p) for name, m in module.named_modules() if type(m).__name__ == "Block" for p in m.parameters()
    }

    def laid(p) -> int:
        return n if p.dim() == 0 else -(-p.shape[0] // n) * n * (p.numel() // p.shape[0])

    params = [p for p in module.parameters() if p.requires_grad]
    return sum(laid(p) for p in params), sum(laid(p) for p in params if id(p) not in in_blocks)


# --------------------------------------------------------------------------- runs inside the ranks


def _strategy(run: int | str, wrap: str):
    """A run is a stage, "ddp" (Lightning's own strategy) or "straggler" (stage 0, rank 1 slow)."""
    if run == "ddp":
        return "ddp"
    if run == "straggler":
        return ZeroStrategy(stage=0)
    if run == "zero3-int8":
        return ZeroStrategy(stage=3, wrap_policy=wrap, quantize_weights=True, quantize_grads=True)
    return ZeroStrategy(stage=run, wrap_policy=wrap) if run == 3 else ZeroStrategy(stage=run)


def run_name(run: int | str) -> str:
    return run if isinstance(run, str) else f"zero{run}"


def fit_all(rank: int, world_size: int, out_dir: str, stages: list, options: dict) -> dict:
    """One Trainer per stage in this rank; returns rank 0's warnings and seconds per run."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world_size))
    seconds, caught = {}, {}
    for stage in stages:
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            _fit_one(stage, world_size, out_dir, **options)
        caught[stage] = [str(w.message) for w in record if "ZeroMonitor" in str(w.message)]
        seconds[stage] = time.perf_counter() - start
    return {"seconds": seconds, "warnings": caught}


def _fit_one(
    stage, world_size: int, out_dir: str, *, model: str, accumulate: int, clip: float | None, summary=False
):
    module, data = gpt_model() if model == "gpt" else (tiny_model(), None)
    if stage == "straggler":
        module = SlowRankTiny(stack=True)
    trainer = Trainer(
        strategy=_strategy(stage, GPT_BLOCK if model == "gpt" else BLOCK),
        accelerator="cpu",
        devices=world_size,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        val_check_interval=2 * accumulate - 1,  # with accumulation: validations inside a step's window
        limit_val_batches=1,
        num_sanity_val_steps=1,  # collectives before the first step: not any step's
        logger=CSVLogger(out_dir, name=run_name(stage), version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ZeroMonitor(print_summary=summary)],
    )
    trainer.fit(module, datamodule=data)


def read_metrics(out_dir: Path, name: str) -> list[dict[str, float]]:
    """The ZeroMonitor rows of a run's metrics.csv, one per optimizer step, as floats."""
    with open(out_dir / name / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("zero/step_time_s")]
    return [{k: float(v) for k, v in r.items() if v != ""} for r in rows]


# --------------------------------------------------------------------------- predictions


def predicted_wire(stage: int, n: int, psi: int, root: int, accumulate: int) -> dict[str, float]:
    """Bytes one rank sends per step, by op, straight from planning.step_traffic."""
    kw = dict(param_bytes=PARAM_BYTES, grad_bytes=GRAD_BYTES)
    full = step_traffic(psi, n, stage, **kw)
    if stage == 0:
        return {"all_reduce": full.all_reduce}
    if stage < 3:
        reduce_times = accumulate if stage == 2 else 1  # stage 2 reduce-scatters every micro-batch
        return {"reduce_scatter": full.reduce_scatter * reduce_times, "all_gather": full.all_gather}
    # the root unit is kept from forward into backward (gathered once), the blocks twice
    gather = (
        step_traffic(psi - root, n, 3, **kw).all_gather + step_traffic(root, n, 3, groups=1, **kw).all_gather
    )
    return {"reduce_scatter": full.reduce_scatter * accumulate, "all_gather": gather * accumulate}


def check_traffic(
    rows, stage: int, n: int, psi: int, root: int, accumulate: int, *, clip: bool, laid: tuple[int, int]
) -> None:
    """Every step's wire bytes equal the plan within padding (stage 3: exactly, its sizes ``laid``
    out by rows, see row_layout); nothing unplanned ran."""
    if stage == 3:
        psi, root = laid
    want = predicted_wire(stage, n, psi, root, accumulate)
    for row in rows:
        for op in OPS:
            wire, payload, calls = (row[f"zero/{op}_{kind}"] for kind in ("wire_bytes", "bytes", "calls"))
            factor = (2 if op == "all_reduce" else 1) * (n - 1) / n  # ring bytes per payload byte
            if op in want:
                # stages 1-2: each collective's tensor pads by < N elements; stage 3: in `laid`
                padding = calls * (n - 1) * PARAM_BYTES if stage != 3 else 0
                assert want[op] <= wire <= want[op] + factor * padding, (
                    stage,
                    op,
                    row["step"],
                    wire,
                    want[op],
                )
                assert wire == pytest.approx(factor * payload)
            elif op == "all_reduce" and clip and stage > 0:
                assert calls == 1 and payload <= 8  # the global grad-norm all-reduce
            elif op == "broadcast" and stage == 0 and row["step"] == 0:
                assert calls == 2  # the rebuilt bucket order after the first backward (size, then bytes)
            else:
                assert calls == 0 and wire == 0, (stage, op, row["step"])
        assert row["zero/exposed_comm_s"] == pytest.approx(sum(row[f"zero/{op}_wait_s"] for op in OPS))
        assert row["zero/exposed_comm_cuda_events"] == 0.0  # CPU tensors: timed with the host's clock


def check_memory(
    rows, stage: int, n: int, psi: int, root: int, tensors: int, *, laid: tuple[int, int]
) -> None:
    if stage == 3:  # the sizes laid out by rows (see row_layout): padding included
        psi, root = laid
    want = model_state_memory(psi, n, stage, k=ADAM_K, param_bytes=PARAM_BYTES, grad_bytes=GRAD_BYTES)
    padding = tensors * (n - 1) if stage != 3 else 0  # elements: at most N - 1 per flat space
    scalars = 4 * tensors  # Adam's 0-dim step count, one per stepped tensor (or shard)
    for row in rows:
        assert want.params <= row["zero/mem_params_bytes"] <= want.params + padding * PARAM_BYTES
        assert want.grads <= row["zero/mem_grads_bytes"] <= want.grads + padding * GRAD_BYTES
        optim = row["zero/mem_optim_bytes"]
        assert want.optimizer < optim <= want.optimizer + padding * ADAM_K + scalars, (stage, optim, want)
        gathered = row["zero/mem_gathered_bytes"]
        if stage == 3:  # the root unit, held from the end of forward into backward
            assert gathered == root * PARAM_BYTES
        else:
            assert gathered == 0


def check_times(rows, n: int) -> None:
    for row in rows:
        assert row["zero/step_time_s"] > 0
        assert row["zero/busy_time_min_s"] <= row["zero/busy_time_max_s"] <= row["zero/step_time_s"]
        assert row["zero/busy_time_max_over_min"] >= 1.0 and row["zero/step_time_max_over_min"] >= 1.0


# --------------------------------------------------------------------------- tests


def test_monitor_two_ranks_every_stage_matches_planner(tmp_path, capfd):
    stages = [0, 1, 2, 3, "ddp", "straggler"]
    options = dict(model="tiny", accumulate=1, clip=None, summary=True)
    results = run_ranks(fit_all, 2, str(tmp_path), str(tmp_path), stages, options)
    psi, root, tensors = shape_of(tiny_model())
    laid = row_layout(tiny_model(), 2)
    assert (psi, root) == (5440, 544)
    for stage in stages[:4]:
        rows = read_metrics(tmp_path, f"zero{stage}")
        assert [r["step"] for r in rows] == list(range(STEPS))
        check_traffic(rows, stage, 2, psi, root, 1, clip=False, laid=laid)
        check_memory(rows, stage, 2, psi, root, tensors, laid=laid)
        check_times(rows, 2)
        assert results[0]["warnings"][stage] == []
    ddp = read_metrics(tmp_path, "ddp")
    assert len(ddp) == STEPS and not any(k.startswith("zero/mem_") for k in ddp[0])
    check_times(ddp, 2)
    assert len(results[0]["warnings"]["ddp"]) == 1  # once, on rank 0
    assert "keeps no communication ledger" in results[0]["warnings"]["ddp"][0]
    check_printed_summary(capfd.readouterr().out)
    check_straggler(read_metrics(tmp_path, "straggler"))


def check_straggler(rows) -> None:
    """Wall-clock step times agree (rank 0 waits for rank 1); busy times show the slow rank."""
    busy = sorted(r["zero/busy_time_max_over_min"] for r in rows)[len(rows) // 2]  # median step
    wall = sorted(r["zero/step_time_max_over_min"] for r in rows)[len(rows) // 2]
    exposed = sorted(r["zero/exposed_comm_s"] for r in rows)[len(rows) // 2]  # rank 0's
    assert busy > 2.0 and wall < 1.5, (busy, wall)
    assert exposed > 0.5 * STRAGGLE_S


def check_printed_summary(out: str) -> None:
    """Rank 0 printed one summary per run; the stage-3 one shows no difference to the plan."""
    for stage, runs in ((0, 2), (1, 1), (2, 1), (3, 1)):  # the straggler run is stage 0 too
        assert out.count(f"ZeroMonitor: predicted vs measured, Ψ = 5,440, N = 2, stage {stage}\n") == runs
    assert out.count("optimizer steps measured") == 6  # the ddp run prints its step times too
    timed = [line for line in out.splitlines() if "exposed communication timed with" in line]
    assert sum("wall-clock" in line for line in timed) == 5  # every ZeRO run, on CPU tensors
    assert sum("no collective waited" in line for line in timed) == 1  # the ddp run: no ledger
    stage3 = out[out.index("stage 3\n") :]
    gather = next(line for line in stage3.splitlines() if "all_gather" in line)
    assert gather.count("20.2 KiB") == 2 and gather.rstrip(" │").endswith("+0 B")  # wire: predicted, measured


@pytest.mark.slow  # the 2-rank monitor test runs by default
def test_monitor_four_ranks_accumulation_and_clipping(tmp_path):
    # stage 2 reduce-scatters and stage 3 gathers every micro-batch; the clip norm is one small all-reduce
    stages = [0, 1, 2, 3]
    options = dict(model="tiny", accumulate=2, clip=1.0)
    run_ranks(fit_all, 4, str(tmp_path), str(tmp_path), stages, options)
    psi, root, tensors = shape_of(tiny_model())
    laid = row_layout(tiny_model(), 4)
    for stage in stages:
        rows = read_metrics(tmp_path, f"zero{stage}")
        assert [r["step"] for r in rows] == list(range(STEPS))
        check_traffic(rows, stage, 4, psi, root, 2, clip=True, laid=laid)
        check_memory(rows, stage, 4, psi, root, tensors, laid=laid)
        check_times(rows, 4)


@pytest.mark.slow
def test_monitor_three_ranks_stage3_within_padding(tmp_path):
    # on 3 ranks, parameters whose rows do not divide by 3 pad (see row_layout)
    run_ranks(fit_all, 3, str(tmp_path), str(tmp_path), [3], dict(model="tiny", accumulate=1, clip=None))
    psi, root, tensors = shape_of(tiny_model())
    laid = row_layout(tiny_model(), 3)
    rows = read_metrics(tmp_path, "zero3")
    check_traffic(rows, 3, 3, psi, root, 1, clip=False, laid=laid)
    check_memory(rows, 3, 3, psi, root, tensors, laid=laid)
    laid_psi, laid_root = laid
    laid_blocks = laid_psi - laid_root
    assert laid_psi > psi and laid_root > root  # parameters whose rows do not divide by 3 pad
    for row in rows:  # exactly the figures laid out by rows
        assert row["zero/all_gather_bytes"] == 4 * (2 * laid_blocks + laid_root)
        assert row["zero/reduce_scatter_bytes"] == 4 * laid_psi
        assert row["zero/mem_params_bytes"] == 4 * laid_psi / 3
        assert row["zero/mem_gathered_bytes"] == 4 * laid_root


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_monitor_three_ranks_stages_1_2_within_padding(tmp_path, stage):
    run_ranks(fit_all, 3, str(tmp_path), str(tmp_path), [stage], dict(model="tiny", accumulate=1, clip=None))
    psi, root, tensors = shape_of(tiny_model())
    laid = row_layout(tiny_model(), 3)
    rows = read_metrics(tmp_path, f"zero{stage}")
    check_traffic(rows, stage, 3, psi, root, 1, clip=False, laid=laid)
    check_memory(rows, stage, 3, psi, root, tensors, laid=laid)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_monitor_gpt_matches_planner(tmp_path, world_size):
    stages = [0, 1, 2, 3]
    run_ranks(
        fit_all, world_size, str(tmp_path), str(tmp_path), stages, dict(model="gpt", accumulate=1, clip=None)
    )
    model, _ = gpt_model()
    psi, root, tensors = shape_of(model)
    laid = row_layout(model, world_size)
    for stage in stages:
        rows = read_metrics(tmp_path, f"zero{stage}")
        check_traffic(rows, stage, world_size, psi, root, 1, clip=False, laid=laid)
        check_memory(rows, stage, world_size, psi, root, tensors, laid=laid)


def test_monitor_logs_int8_bytes_and_the_guard(tmp_path):
    """Stage 3 with int8 weights and gradients: the logged bytes are the packed ones (under a
    quarter of fp32's and, on this small GPT, well over it: each parameter's rows are padded to
    whole blocks of 256, which its LayerNorms and biases of 12 elements per rank fill a twentieth
    of, and the root's all-gather stays in fp32; tests/distributed/test_quantized.py checks the
    exact format) and the guard's fallback count is logged (none on the healthy GPT)."""
    run_ranks(
        fit_all,
        2,
        str(tmp_path),
        str(tmp_path),
        [3, "zero3-int8"],
        dict(model="gpt", accumulate=1, clip=None),
    )
    full, int8 = read_metrics(tmp_path, "zero3"), read_metrics(tmp_path, "zero3-int8")
    assert len(full) == len(int8) == STEPS
    for a, b in zip(full, int8):
        assert b["zero/int8_fallbacks"] == 0 and "zero/int8_fallbacks" not in a
        for op in ("all_gather", "reduce_scatter"):
            assert a[f"zero/{op}_calls"] == b[f"zero/{op}_calls"]
            low = 1.5 if op == "all_gather" else 2.0  # the root's gathers in fp32
            assert low <= a[f"zero/{op}_bytes"] / b[f"zero/{op}_bytes"] <= 4.0


@pytest.mark.slow
def test_summary_through_lightning_spawn(tmp_path, capfd):
    # Lightning's own launcher: the callback is pickled into the workers, rank 0 prints
    trainer = Trainer(
        strategy=ZeroStrategy(stage=3, wrap_policy=BLOCK, start_method="spawn"),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        limit_val_batches=0,
        logger=CSVLogger(str(tmp_path), name="spawn", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ZeroMonitor()],
    )
    trainer.fit(tiny_model())
    out = capfd.readouterr().out
    assert "ZeroMonitor: predicted vs measured, Ψ = 5,440, N = 2, stage 3" in out
    traffic = next(line for line in out.splitlines() if "all_gather" in line)
    assert traffic.count("20.2 KiB") == 2 and "+0 B" in traffic  # wire predicted, measured, no diff
    rows = read_metrics(tmp_path, "spawn")
    assert [r["step"] for r in rows] == [0, 1]
    assert torch.tensor([r["zero/all_gather_wire_bytes"] for r in rows]).eq(20672).all()
