"""The hot path of a training step: no host synchronisation and no second gradient copy.

A device-to-host synchronisation stalls the host until the GPU catches up; on CPU there is nothing
to wait for, so the test counts the calls that would synchronise on a GPU (``.item()``,
``.tolist()``, ``.cpu()``, a tensor's truth value, ...) while every stage runs steps, through a
TorchFunctionMode that sees every torch call the package makes. After the first step (which
rebuilds stage 0's bucket plan from rank 0's observed order, one broadcast) there are none.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import make_engine
from lightning_zero.grad_sync import broadcast_module_states
from lightning_zero.precision import resolve_policy
from tests.distributed import models
from tests.distributed.harness import run_ranks

SYNCING = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.equal,
    torch.Tensor.nonzero,
}


def _inside_the_optimizer() -> bool:
    """Called from a torch optimizer's own step (its single-tensor path reads the step count with
    ``.item()``; on a GPU that count lives on the host): the user's choice of optimizer, not ours."""
    frame = sys._getframe(2)
    while frame is not None:
        if "torch/optim/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class CountSyncs(TorchFunctionMode):
    """Counts the calls that make the host wait for the device, by name (not the optimizer's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        moved_to_host = func is torch.Tensor.to and any(
            str(a) == "cpu" for a in (*args[1:], *(kwargs or {}).values())
        )
        if (func in SYNCING or moved_to_host) and not _inside_the_optimizer():
            name = getattr(func, "__name__", str(func))
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _steps(rank: int, world: int, stage: int, precision: str) -> dict:
    torch.manual_seed(0)
    model = models.build_stack(seed=0)
    comm = Communicator()
    broadcast_module_states(model, comm, label="t")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainable = sum(p.requires_grad for p in model.parameters())
    options = {"wrap_policy": "tests.distributed.models.Block"} if stage == 3 else {}
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001, **options)
    engine = make_engine(config, comm, resolve_policy(None, None, precision))
    wrapped = engine.setup(model, [optimizer])
    batches = models.global_batches(4, world)
    syncs, copies = [], []
    for i, batch in enumerate(batches):
        counter = CountSyncs()
        before = engine.grad_copies()
        with counter if i > 0 else contextlib.nullcontext():
            with engine.no_sync():  # an accumulation micro-batch, then a synchronised one
                wrapped(*models.rank_slice(batch, rank)).backward()
            optimizer.zero_grad()  # between forward and backward, as Lightning's closure does
            loss = wrapped(*models.rank_slice(batch, rank))
            engine.prepare_backward()
            loss.backward()
            engine.clip_grad_norm_(optimizer, 1.0) if engine.sharded else None
            optimizer.step()
            engine.after_step(optimizer, 0)
            optimizer.zero_grad()
        syncs.append(counter.calls)
        copies.append(engine.grad_copies() - before)
    return {"syncs": syncs[1:], "copies": copies[1:], "trainable": trainable}


# about 25 s each; the default suite counts the same through the Trainer at every stage
# (tests/integration/test_trainer_host_sync.py), so both precisions run in make test-slow
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_no_host_synchronisation_per_step(tmp_path, precision):
    for stage in (0, 1, 2, 3):
        for rank in run_ranks(_steps, 2, tmp_path, stage, precision):
            assert all(calls == {} for calls in rank["syncs"]), (stage, rank["syncs"])
            # a gradient lands in its bucket once, also with zero_grad between forward and backward;
            # stage 2 adds each fresh gradient into a bucket made on demand, by design; stage 3
            # copies each gradient once per backward from the gathered parameters into its unit's
            # ReduceScatter input, laid out as the shards (as FSDP2 does): two backward passes a
            # step, both reduced (accumulate_unsharded is off by default)
            if stage in (0, 1):
                assert rank["copies"] == [0, 0, 0], (stage, rank["copies"])
            elif stage == 3:
                assert rank["copies"] == [2 * rank["trainable"]] * 3, (stage, rank["copies"])
            else:
                assert all(c > 0 for c in rank["copies"])
