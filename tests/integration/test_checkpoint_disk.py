"""A checkpoint that cannot be written says so: a read-only folder is found at setup, a save that
does not fit on the disk writes nothing, a write that fails midway (a file size limit) removes its
partial file or directory; the previous checkpoint stays intact, and every rank raises the same
error naming the path, the bytes the save needed and the space free. Full and sharded forms, 2 gloo
ranks, on small tmpfs mounts (root) and under ``RLIMIT_FSIZE``.

Before, a full save on a full disk failed with ``[enforce fail at inline_container.cc:672]
unexpected pos ...``, nothing said ENOSPC, ``.NAME.partial`` stayed and the disk stayed full; a
read-only folder was found at the first save.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import resource
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Callback, Trainer

import lightning_zero.checkpoint as C
from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.disk import CheckpointWriteError
from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import make_engine
from tests.distributed import models
from tests.distributed.fault_harness import run_ranks
from tests.integration.test_checkpoint_resume import LitResume

IO = TorchCheckpointIO()
BOUND_S = 30  # from the rank's first collective to its end, on a loaded 2-core machine


@contextlib.contextmanager
def tmpfs(where: Path, *options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``where`` for the test (skipped where this process may not mount)."""
    where.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def _runs(tmp_path: Path) -> Path:
    (tmp_path / "runs").mkdir()
    return tmp_path / "runs"


def _comm() -> Communicator:
    comm = Communicator()
    comm.watch_faults(fault_wait_s=2.0)
    comm.all_reduce(torch.ones(4), name="warm-up", async_op=False)
    return comm


def _in_step(comm: Communicator) -> float:
    t = torch.ones(1)
    comm.all_reduce(t, name="after/save", async_op=False)
    return float(t.item())


def _raised(step) -> str:
    try:
        step()
    except CheckpointWriteError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


# --------------------------------------------------------------------------- read-only folders


def _check_folders(rank: int, world_size: int, read_only: str, writable: str) -> dict:
    comm = _comm()
    ro = Path(read_only)
    out = {
        "rank0": _raised(lambda: C.check_writable([writable, ro / "sub" / "ckpt"], comm)),
        "every": _raised(lambda: C.check_writable([ro], comm, every_rank=True)),
        "fine": _raised(lambda: C.check_writable([writable, Path(writable) / "new" / "dir"], comm)),
    }
    out["sum"] = _in_step(comm)
    return out


def test_a_read_only_checkpoint_folder_is_found_at_setup_on_every_rank(tmp_path):
    writable = tmp_path / "ok"
    writable.mkdir()
    with tmpfs(tmp_path / "ro", "ro", "size=1m") as ro:
        outcomes = run_ranks(_check_folders, 2, _runs(tmp_path), str(ro), str(writable), timeout=180)
    for o in outcomes:
        assert o.error is None, (o.error, o.stderr[-3000:])
        assert o.result["rank0"].startswith(
            f"CheckpointWriteError: cannot write checkpoints in {ro / 'sub' / 'ckpt'} (to be created in {ro}): "
            "read-only file system (EROFS)"
        ), o.result["rank0"]
        assert (
            "(found by rank(s) 0)" in o.result["rank0"] and "bytes) are free there now" in o.result["rank0"]
        )
        assert o.result["every"].startswith(
            f"CheckpointWriteError: cannot write checkpoints in {ro}: read-only"
        )
        assert o.result["every"].endswith("(found by rank(s) 0, 1)"), o.result["every"]
        assert o.result["fine"] == "no error" and o.result["sum"] == 2.0
        assert o.seconds < BOUND_S, o.seconds
    assert sorted(p.name for p in writable.iterdir()) == []  # the probes removed, nothing created


# --------------------------------------------------------------------------- a full disk


def _weights(kib: int, value: float) -> dict:
    return {"w": torch.full((kib * 256,), value)}  # fp32: kib KiB


def _save_on_full_disk(rank: int, world_size: int, root: str) -> dict:
    comm = _comm()
    full, sharded = Path(root) / "full" / "last.ckpt", Path(root) / "sharded" / "last.ckpt"
    C.save_full({"global_step": 1, "state_dict": _weights(64, 1.0)}, str(full), comm, IO)
    big = {"global_step": 2, "state_dict": _weights(2048, 2.0)}
    out = {"full": _raised(lambda: C.save_full(big, str(full), comm, IO))}
    model = models.build(seed=1)
    layout = C.layout_of(model, None, 0, world_size)
    C.save_sharded(
        {"global_step": 1, "state_dict": C.sharded_model_state(model, None)}, sharded, comm, layout
    )
    big = {
        "global_step": 2,
        "state_dict": {**C.sharded_model_state(model, None), "pad": torch.zeros(1 << 19)},
    }
    out["sharded"] = _raised(lambda: C.save_sharded(big, sharded, comm, layout))
    out["sum"] = _in_step(comm)
    out["steps"] = [C.read(p, IO, comm=comm)["global_step"] for p in (full, sharded)]
    return out


def test_a_save_that_does_not_fit_writes_nothing_and_names_the_space(tmp_path):
    with tmpfs(tmp_path / "disk", "size=1m") as disk:
        outcomes = run_ranks(_save_on_full_disk, 2, _runs(tmp_path), str(disk), timeout=180)
        left = {form: sorted(p.name for p in (disk / form).iterdir()) for form in ("full", "sharded")}
    for o in outcomes:
        assert o.error is None, (o.error, o.stderr[-3000:])
        full, sharded = o.result["full"], o.result["sharded"]
        assert full.startswith(
            f"CheckpointWriteError: cannot write the checkpoint {disk / 'full' / 'last.ckpt'}: no space left on "
            "device (ENOSPC): the save needs about 2.0 MiB (2097152 bytes: the tensors it writes) and"
        ), full
        assert f"are free in {disk / 'full'}. Nothing was written" in full
        assert sharded.startswith(
            f"CheckpointWriteError: cannot write the checkpoint {disk / 'sharded' / 'last.ckpt'}: no space left"
        ), sharded
        assert "the save needs about 2.0 MiB" in sharded  # the pad (and the model) once: DCP writes it once
        assert o.result["steps"] == [1, 1] and o.result["sum"] == 2.0  # the previous ones intact, in step
        assert o.seconds < BOUND_S, o.seconds
    assert left == {"full": ["last.ckpt"], "sharded": ["last.ckpt"]}  # no partial left


# --------------------------------------------------------------------------- a write that fails midway


def _file_size_limit(limit: int) -> None:
    """Writes past ``limit`` bytes fail with EFBIG (SIGXFSZ ignored: write() returns the error)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def _zero2(comm: Communicator, rank: int):
    model = models.build(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = make_engine(ZeroConfig(stage=2), comm)
    wrapped = engine.setup(model, [optimizer])
    loss = wrapped(*models.rank_slice(models.global_batches(1, 2)[0], rank))
    engine.prepare_backward()
    loss.backward()
    optimizer.step()
    engine.after_step(optimizer, 0)
    optimizer.zero_grad()
    return model, optimizer, engine


def _full_checkpoint(model, optimizer, engine, step: int) -> dict:
    return {
        "global_step": step,
        "state_dict": engine.module_state_dict(model),
        "optimizer_states": [C.streamed_optimizer_state(engine, optimizer, 0)],  # written while gathered
    }


def _fail_midway(rank: int, world_size: int, root: str) -> dict:
    comm = _comm()
    model, optimizer, engine = _zero2(comm, rank)
    full, sharded = Path(root) / "full" / "last.ckpt", Path(root) / "sharded" / "last.ckpt"
    C.save_full(_full_checkpoint(model, optimizer, engine, 1), str(full), comm, IO, engine=engine)
    layout = C.layout_of(model, engine, 2, world_size)
    state = lambda step: {  # noqa: E731
        "global_step": step,
        "state_dict": C.sharded_model_state(model, engine),
        "optimizer_states": [C.sharded_optimizer_state(model, engine, optimizer, 0)],
    }
    C.save_sharded(state(1), sharded, comm, layout)
    if rank == 0:  # rank 0 writes the full file: its limit falls in the streamed optimizer state
        _file_size_limit(full.stat().st_size * 2 // 3)
    checkpoint = _full_checkpoint(model, optimizer, engine, 2)
    out = {"full": _raised(lambda: C.save_full(checkpoint, str(full), comm, IO, engine=engine))}
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    if rank == 1:  # rank 1 writes its shard file
        _file_size_limit(1024)
    out["sharded"] = _raised(lambda: C.save_sharded(state(2), sharded, comm, layout))
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    out["sum"] = _in_step(comm)
    out["steps"] = [C.read(p, IO, comm=comm)["global_step"] for p in (full, sharded)]
    return out


def test_a_write_that_fails_midway_removes_its_partial_and_keeps_the_previous(tmp_path):
    root = tmp_path / "ckpt"
    outcomes = run_ranks(_fail_midway, 2, _runs(tmp_path), str(root), timeout=240)
    for o in outcomes:
        assert o.error is None, (o.error, o.stderr[-3000:])
        full, sharded = o.result["full"], o.result["sharded"]
        assert full.startswith(
            f"CheckpointWriteError: cannot write the checkpoint {root / 'full' / 'last.ckpt'}: file too large "
            "(EFBIG): the process's file size limit (ulimit -f) is"
        ), full
        assert "The save needed about" in full and "The partial file was removed" in full
        assert sharded.startswith(
            f"CheckpointWriteError: cannot write the checkpoint {root / 'sharded' / 'last.ckpt'}: file too large "
            "(EFBIG): the process's file size limit (ulimit -f) is 1024 bytes"  # rank 1's, on every rank
        ), sharded
        assert sharded.endswith("(the write failed on rank(s) 1)"), sharded
        assert o.result["steps"] == [1, 1] and o.result["sum"] == 2.0
        assert o.seconds < BOUND_S + 30, o.seconds
    for form in ("full", "sharded"):
        assert sorted(p.name for p in (root / form).iterdir()) == ["last.ckpt"], form


# --------------------------------------------------------------------------- found at setup


class CountSteps(Callback):
    def __init__(self) -> None:
        self.steps = 0  # training batches started

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps += 1


def _fit_into(root: str) -> dict:
    """In a process of its own (a fit leaves threads behind that a later forked rank would inherit)."""
    torch.set_num_threads(1)
    steps = CountSteps()
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2, state_dict_type="sharded"),  # its setup probes the folders
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[steps],
        default_root_dir=Path(root) / "run",
    )
    try:
        trainer.fit(LitResume())
    except C.CheckpointError as err:
        return {"error": f"{type(err).__name__}: {err}", "steps": steps.steps}
    return {"error": None, "steps": steps.steps}


def test_a_fit_into_a_read_only_folder_stops_at_setup(tmp_path):
    with tmpfs(tmp_path / "ro", "ro", "size=1m") as ro:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            out = pool.submit(_fit_into, str(ro)).result(timeout=300)
    assert out["error"].startswith(
        f"CheckpointWriteError: cannot write checkpoints in {ro / 'run'} (to be created in {ro}): read-only"
    ), out
    assert out["steps"] == 0  # before the first step, not at the first save
