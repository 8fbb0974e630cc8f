"""Every decision about a checkpoint that leads to a collective is agreed first: a read that fails on
one rank only (a missing file on one node, an I/O error, a ``BadZipFile``) makes every rank fall
back, or every rank raise, together, in bounded time; the error names the rank that failed and why.

Before, the failing rank entered the fall-back branch and its collective alone while the others
went on to load the model (other collectives): the ranks were out of step, and a ``BadZipFile``
escaped the fall-back altogether on that rank only. 2 gloo ranks, the fault injected by
monkeypatching in one rank's process.
"""

from __future__ import annotations

import errno
import zipfile
from pathlib import Path

import torch
from lightning.fabric.plugins import TorchCheckpointIO

import lightning_zero.checkpoint as C
from lightning_zero.checkpoint import reader, unpickle
from lightning_zero.comm import Communicator
from tests.distributed import models
from tests.distributed.fault_harness import run_ranks

IO = TorchCheckpointIO()
BOUND_S = 30  # from the rank's first collective to its end, on a loaded 2-core machine


def _comm() -> Communicator:
    comm = Communicator()
    comm.watch_faults(fault_wait_s=2.0)
    comm.all_reduce(torch.ones(4), name="warm-up", async_op=False)
    return comm


def _in_step(comm: Communicator, value: float) -> float:
    """A collective after the decision: it completes only if every rank took the same path."""
    t = torch.tensor([value])
    comm.all_reduce(t, name="after/read", async_op=False)
    return float(t.item())


def _save_full_twice(comm: Communicator, path: Path) -> torch.Tensor:
    """last.ckpt at step 2, its step-1 version kept as .last.ckpt.previous; the step-1 weights."""
    first = None
    for step in (1, 2):
        weight = torch.full((64, 64), float(step))
        C.save_full({"global_step": step, "state_dict": {"w": weight}}, str(path), comm, IO)
        first = weight if first is None else first
    return first


def _fail_on(rank: int, target: str, error: BaseException):
    """A reader that raises ``error`` on ``rank`` for the checkpoint named ``target`` only."""
    original = unpickle._load

    def load(path, checkpoint_io, weights_only):
        if Path(str(path)).name == target:
            raise error
        return original(path, checkpoint_io, weights_only)

    return load


def _io_error_on_one_rank(rank: int, world_size: int, out: str) -> dict:
    comm = _comm()
    path = Path(out) / "ckpt" / "last.ckpt"
    _save_full_twice(comm, path)
    if rank == 1:
        unpickle._load = _fail_on(1, "last.ckpt", OSError(errno.EIO, "Input/output error"))
    loaded = C.read_or_fallback(path, IO, comm=comm)
    return {
        "step": loaded["global_step"],
        "from": loaded.loaded_from,
        "sum": _in_step(comm, loaded["global_step"]),
    }


def test_an_io_error_on_one_rank_makes_every_rank_fall_back_together(tmp_path):
    outcomes = run_ranks(_io_error_on_one_rank, 2, tmp_path, str(tmp_path), timeout=180)
    previous = str(tmp_path / "ckpt" / ".last.ckpt.previous")
    for o in outcomes:
        assert o.error is None, (o.error, o.stderr[-3000:])
        assert o.result == {"step": 1, "from": previous, "sum": 2.0}, o.result
        assert o.seconds < BOUND_S, o.seconds
    warning = outcomes[0].stderr
    assert "cannot be loaded (reading the checkpoint" in warning and "failed on rank(s) 1" in warning
    assert "Input/output error" in warning and f"loading the previous intact checkpoint {previous}" in warning


def _bad_zip_on_one_rank(rank: int, world_size: int, out: str) -> str:
    comm = _comm()
    path = Path(out) / "epoch=3.ckpt"
    C.save_full({"global_step": 3, "state_dict": {"w": torch.ones(8)}}, str(path), comm, IO)
    if rank == 1:

        def bad(p, *, only_pickle):  # raised outside any CheckpointError handler, as zipfile does
            raise zipfile.BadZipFile("Bad CRC-32 for file 'epoch=3/data.pkl'")

        reader.verify_zip_records = bad  # the name read() calls
    try:
        C.read_or_fallback(path, IO, comm=comm)
    except C.CheckpointError as err:
        _in_step(comm, 1.0)
        return f"{type(err).__name__}: {err}"
    return "loaded"


def test_a_bad_zip_on_one_rank_is_raised_on_every_rank_naming_that_rank(tmp_path):
    """An explicit name without a kept previous version: nothing to fall back to, every rank raises."""
    for o in run_ranks(_bad_zip_on_one_rank, 2, tmp_path, str(tmp_path), timeout=180):
        assert o.error is None, (o.error, o.stderr[-3000:])
        assert o.result.startswith("CheckpointError: reading the checkpoint "), o.result
        assert "failed on rank(s) 1 (rank 1: CheckpointError: cannot read" in o.result
        assert "BadZipFile: Bad CRC-32 for file 'epoch=3/data.pkl'" in o.result
        assert "rank(s) 0 succeeded. Every rank stops here together" in o.result
        assert o.seconds < BOUND_S, o.seconds


def _missing_shards_on_one_rank(rank: int, world_size: int, out: str) -> dict:
    comm = _comm()
    path = Path(out) / "ckpt" / "last.ckpt"
    model = models.build(seed=1)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    for step in (1, 2):
        checkpoint = {"global_step": step, "state_dict": C.sharded_model_state(model, None)}
        C.save_sharded(checkpoint, path, comm, C.layout_of(model, None, 0, world_size))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    original = reader.inspect_sharded
    if rank == 1:  # as if this node's copy of last.ckpt had lost a file

        def inspect(p, *, trusted=False, verify=True):
            if p.name == "last.ckpt":
                raise FileNotFoundError(f"{p / '__1_0.distcp'} is missing on this node")
            return original(p, trusted=trusted, verify=verify)

        reader.inspect_sharded = inspect
    loaded = C.read_or_fallback(path, IO, comm=comm)
    fresh = models.build(seed=2)
    C.load_model_state(fresh, None, comm, loaded["state_dict"])  # DCP: a collective of every rank
    same = all(torch.equal(fresh.state_dict()[k], v) for k, v in first.items())
    return {"step": loaded["global_step"], "from": loaded.loaded_from, "same": same}


def test_a_sharded_checkpoint_missing_a_file_on_one_rank_falls_back_on_every_rank(tmp_path):
    outcomes = run_ranks(_missing_shards_on_one_rank, 2, tmp_path, str(tmp_path), timeout=180)
    previous = str(tmp_path / "ckpt" / ".last.ckpt.previous")
    for o in outcomes:
        assert o.error is None, (o.error, o.stderr[-3000:])
        assert o.result == {"step": 1, "from": previous, "same": True}, o.result
        assert o.seconds < BOUND_S, o.seconds
    assert (
        "rank 1: FileNotFoundError:" in outcomes[0].stderr and "is missing on this node" in outcomes[0].stderr
    )


def _flip_in_a_zero2_file(rank: int, world_size: int, out: str) -> str:
    from tests.integration.test_checkpoint_disk import _full_checkpoint, _zero2

    comm = _comm()
    model, optimizer, engine = _zero2(comm, rank)
    path = Path(out) / "last.ckpt"
    checkpoint = _full_checkpoint(model, optimizer, engine, 1)
    flat = {v.untyped_storage().data_ptr() for v in checkpoint["state_dict"].values()}
    assert len(flat) < len(checkpoint["state_dict"])  # the parameters share a bucket's storage
    C.save_full(checkpoint, str(path), comm, IO, engine=engine)
    if rank == 0:
        data = bytearray(path.read_bytes())
        at = data.find(model.fc2.weight.detach().numpy().tobytes())  # fc2 lies after emb and fc1
        data[at + 64] ^= 0xFF
        path.write_bytes(bytes(data))
    comm.barrier(name="flipped")
    try:
        C.read(path, IO, comm=comm)
    except C.CheckpointError as err:
        _in_step(comm, 1.0)
        return str(err)
    return "loaded"


def test_a_flip_in_a_zero2_full_file_names_the_damaged_parameter_on_every_rank(tmp_path):
    for o in run_ranks(_flip_in_a_zero2_file, 2, tmp_path, str(tmp_path), timeout=180):
        assert o.error is None, (o.error, o.stderr[-3000:])
        assert "is damaged: tensor state_dict/fc2.weight does not match its checksum" in o.result, o.result
        assert "emb.weight" not in o.result  # the flat record's first tensor, intact
        assert o.seconds < BOUND_S, o.seconds
