"""K training steps of every stage on a device, through the engines, and the one-device reference.

Every rank builds ``models.TinyStack`` from its own seed and takes rank 0's values through the
strategy's broadcast; rank r trains on slice r of each global batch. The reference trains rank 0's
model on the whole global batch on one device: what N ranks of any stage must reproduce.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import make_engine
from lightning_zero.grad_sync import broadcast_module_states
from tests.distributed import models

STAGES = (0, 1, 2, 3)
STEPS = 4  # optimizer steps per run
BLOCK = "tests.distributed.models.Block"  # stage 3's wrap unit
STAGE_OPS = {  # the collectives a stage's training steps issue on the device's tensors
    0: ("broadcast", "all_reduce"),
    1: ("broadcast", "reduce_scatter", "all_gather"),
    2: ("broadcast", "reduce_scatter", "all_gather"),
    3: ("broadcast", "all_gather", "reduce_scatter"),
}


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _config(stage: int) -> ZeroConfig:
    options = {"wrap_policy": BLOCK} if stage == 3 else {}
    # about 1000 fp32 elements per bucket: several buckets
    return ZeroConfig(stage=stage, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001, **options)


def train(rank: int, world: int, device: torch.device, stage: int) -> dict[str, Any]:
    """STEPS steps of ``stage`` on ``device``: the full parameters after them, and the ledger's waits."""
    model = models.build_stack(seed=100 + rank).to(device)  # ranks start apart: the broadcast aligns them
    comm = Communicator()
    broadcast_module_states(model, comm, label="t")
    optimizer = _optimizer(model)
    engine = make_engine(_config(stage), comm)
    wrapped = engine.setup(model, [optimizer], device=device)  # stage 3 shards onto it
    for step, batch in enumerate(models.global_batches(STEPS, world)):
        comm.ledger.begin_step(step)
        tokens, targets = (t.to(device) for t in models.rank_slice(batch, rank))
        wrapped(tokens, targets).backward()
        optimizer.step()
        engine.after_step(optimizer, 0)
        optimizer.zero_grad()
    exposed_s, timing = sum(comm.ledger.wait_totals().values()), comm.ledger.timing  # of the steps
    state = engine.module_state_dict(model)  # stage 3 gathers: every rank takes part
    return {
        "params": {name: value.detach().clone() for name, value in state.items()},
        "devices": sorted({str(t.device) for t in (*state.values(), *optimizer_tensors(optimizer))}),
        "timing": timing,
        "exposed_s": exposed_s,
    }


def train_stages(rank: int, world: int, device: torch.device, stages: tuple[int, ...]) -> dict[int, Any]:
    return {stage: train(rank, world, device, stage) for stage in stages}


def reference(world: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Rank 0's model trained on the whole global batches on one device (no strategy)."""
    model = models.build_stack(seed=100).to(device)
    optimizer = _optimizer(model)
    for batch in models.global_batches(STEPS, world):
        tokens, targets = (t.to(device) for t in batch)
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The per-element tensors of the optimizer's state (moments), not its 0-dim step counts, which
    torch's Adam keeps on the host by design."""
    states = (v for state in optimizer.state.values() for v in state.values())
    return [v for v in states if isinstance(v, torch.Tensor) and v.dim() > 0]


def probe_ops(rank: int, world: int, device: torch.device) -> dict[str, str | None]:
    """Each collective the stages use, once, through the package on ``device``'s tensors: None where
    it ran and gave the right values, else what went wrong."""
    comm = Communicator()
    ones = torch.ones(world * 4, device=device)
    trials = {
        "broadcast": lambda: _broadcast(comm, torch.full((4,), float(rank), device=device)),
        "all_reduce": lambda: _all_reduce(comm, ones.clone(), world),
        "all_gather": lambda: _all_gather(comm, torch.full((4,), float(rank), device=device), world),
        "reduce_scatter": lambda: _reduce_scatter(comm, ones.clone(), world),
    }
    errors: dict[str, str | None] = {}
    for op, trial in trials.items():
        try:
            errors[op] = trial()
        except RuntimeError as err:  # the backend refused the op for these tensors
            errors[op] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return errors


def _broadcast(comm: Communicator, tensor: torch.Tensor) -> str | None:
    comm.broadcast(tensor, src=0, name="probe/broadcast")
    return None if tensor.eq(0).all() else f"broadcast gave {tensor.tolist()}, expected rank 0's zeros"


def _all_reduce(comm: Communicator, tensor: torch.Tensor, world: int) -> str | None:
    comm.all_reduce(tensor, name="probe/all_reduce").wait()
    return None if tensor.eq(world).all() else f"all_reduce gave {tensor.tolist()}, expected {world}s"


def _all_gather(comm: Communicator, shard: torch.Tensor, world: int) -> str | None:
    out = torch.empty(world * shard.numel(), device=shard.device)
    comm.all_gather(out, shard, name="probe/all_gather").wait()
    want = torch.arange(world, device=shard.device).repeat_interleave(shard.numel()).float()
    return None if out.eq(want).all() else f"all_gather gave {out.tolist()}, expected {want.tolist()}"


def _reduce_scatter(comm: Communicator, tensor: torch.Tensor, world: int) -> str | None:
    out = torch.empty(tensor.numel() // world, device=tensor.device)
    comm.reduce_scatter(out, tensor, name="probe/reduce_scatter").wait()
    return None if out.eq(world).all() else f"reduce_scatter gave {out.tolist()}, expected {world}s"
