"""Nothing lost: a rank killed in the middle of a sharded save leaves the previous checkpoint, which
resumes exactly; consolidation reproduces the full-format save; the full save holds the optimizer
state on rank 0 only."""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

from lightning_zero import checkpoint as C
from lightning_zero.cli import main
from lightning_zero.streamed import Streamed
from tests.integration.test_checkpoint_resume import (
    EPOCHS,
    SAMPLES,
    LitResume,
    assert_continues_exactly,
    fit,
)


class KillDuringSave(Callback):
    """Rank ``rank`` writes half of its shard file in the ``nth`` sharded save, then is SIGKILLed."""

    def __init__(self, rank: int, nth: int) -> None:
        self.rank = rank
        self.nth = nth

    def setup(self, trainer, pl_module, stage):  # in the rank's own process
        if trainer.global_rank != self.rank:
            return
        original, calls, rank, nth = FileSystemWriter.write_data, itertools.count(1), self.rank, self.nth

        def write_data(writer, plan, planner):
            future = original(writer, plan, planner)
            if next(calls) == nth:
                future.wait()
                for shard in Path(writer.path).glob(f"__{rank}_*.distcp"):
                    os.truncate(shard, shard.stat().st_size // 2)
                os.kill(os.getpid(), signal.SIGKILL)
            return future

        FileSystemWriter.write_data = write_data


def _every_epoch_as(dirpath: Path, name: str) -> ModelCheckpoint:
    """A checkpoint at every epoch end, each replacing the previous one under the same name."""
    return ModelCheckpoint(dirpath=dirpath, filename=name, save_top_k=-1, enable_version_counter=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return fit(tmp_path_factory.mktemp("reference"), 0, 1, "full", epochs=EPOCHS)


def test_rank_killed_during_a_sharded_save_leaves_the_previous_checkpoint(tmp_path, reference):
    ckpt_dir = tmp_path / "ckpt"
    with pytest.raises(Exception, match="SIGKILL|signal 9|exit"):
        checkpoint = _every_epoch_as(ckpt_dir, "latest")
        fit(
            tmp_path / "killed",
            2,
            2,
            "sharded",
            epochs=EPOCHS,
            checkpoint=checkpoint,
            callbacks=[KillDuringSave(1, 2)],
        )
    last, partial = ckpt_dir / "latest.ckpt", ckpt_dir / ".latest.ckpt.partial"
    assert sorted(os.listdir(ckpt_dir)) == [".latest.ckpt.partial", "latest.ckpt"]
    with pytest.raises(C.CheckpointError, match="not a complete sharded checkpoint"):
        C.inspect_sharded(partial)  # the interrupted save never became a checkpoint
    meta, _ = C.inspect_sharded(last)
    assert meta["epoch"] == 0 and meta["global_step"] == SAMPLES // 8 // 2  # the first epoch's, intact
    # it resumes, on other ranks and stage, as if nothing had happened; the next save clears the leftover
    final = fit(
        tmp_path / "resumed",
        3,
        4,
        "sharded",
        epochs=EPOCHS,
        ckpt_path=last,
        checkpoint=_every_epoch_as(ckpt_dir, "latest"),
    )
    assert_continues_exactly(final, reference)
    assert sorted(os.listdir(ckpt_dir)) == [".latest.ckpt.previous", "latest.ckpt"]  # the leftover cleared
    assert C.inspect_sharded(last)[0]["epoch"] == EPOCHS - 1


def _flip_in_largest_chunk(path: Path) -> str:
    """Flip 16 bytes in the middle of the largest chunk of a sharded checkpoint; its file's name."""
    _, metadata = C.inspect_sharded(path)
    info = max(metadata.storage_data.values(), key=lambda i: i.length)
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        data = f.read(16)
        f.seek(info.offset + info.length // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    return info.relative_path


def test_a_damaged_last_checkpoint_resumes_from_the_previous_one_exactly(tmp_path, reference):
    """Bytes flipped in last.ckpt (sharded, zero2 on 2 ranks): ckpt_path="last" resumes from the
    kept previous version, with a warning, and the run ends as the uninterrupted one."""
    ckpt_dir = tmp_path / "ckpt"
    fit(tmp_path / "first", 2, 2, "sharded", epochs=2, checkpoint=_every_epoch_as(ckpt_dir, "last"))
    damaged = _flip_in_largest_chunk(ckpt_dir / "last.ckpt")
    with pytest.raises(C.CheckpointError, match=rf"{damaged} is damaged: the chunk of tensor"):
        C.consolidate(ckpt_dir / "last.ckpt", tmp_path / "out.ckpt")
    checkpoint = _every_epoch_as(ckpt_dir, "last")
    final = fit(tmp_path / "resumed", 2, 2, "sharded", epochs=EPOCHS, ckpt_path="last", checkpoint=checkpoint)
    assert_continues_exactly(final, reference)  # from epoch 0's checkpoint, nothing lost
    assert C.inspect_sharded(ckpt_dir / "last.ckpt")[0]["epoch"] == EPOCHS - 1


class OptimizerBytes(Callback):
    """Per rank: tensor bytes of the optimizer state Lightning is about to save (Streamed tensors,
    written while gathered, hold none)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        states = checkpoint.get("optimizer_states", [])
        held = sum(
            v.numel() * v.element_size()
            for s in states
            for entry in s.get("state", {}).values()
            for v in entry.values()
            if isinstance(v, torch.Tensor) and not isinstance(v, Streamed)
        )
        torch.save(held, self.out / f"optimizer_bytes{trainer.global_rank}.pt")


def test_consolidated_zero3_equals_the_full_save_and_full_save_is_rank0_only(tmp_path):
    fit(tmp_path / "full", 3, 2, "full", epochs=2, callbacks=[OptimizerBytes(tmp_path)])
    fit(tmp_path / "sharded", 3, 2, "sharded", epochs=2)
    out = tmp_path / "consolidated.ckpt"
    assert main(["consolidate", str(tmp_path / "sharded" / "ckpt" / "last.ckpt"), str(out)]) == 0
    got = torch.load(out, weights_only=False)
    ref = torch.load(tmp_path / "full" / "ckpt" / "last.ckpt", weights_only=False)
    assert list(got["state_dict"]) == list(ref["state_dict"])  # original names, tied ones too
    assert all(torch.equal(got["state_dict"][k], ref["state_dict"][k]) for k in ref["state_dict"])
    a, b = got["optimizer_states"][0], ref["optimizer_states"][0]
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][i][k], v) for i, e in b["state"].items() for k, v in e.items())
    assert (got["lr_schedulers"], got["global_step"], got["epoch"]) == (
        ref["lr_schedulers"],
        ref["global_step"],
        ref["epoch"],
    )
    loaded = LitResume.load_from_checkpoint(out)  # one plain process
    assert all(torch.equal(p, ref["state_dict"][n]) for n, p in loaded.named_parameters())
    # no rank held the optimizer state whole: AdamW's moments were stand-ins, gathered one unit at a
    # time while rank 0 wrote the file; only the step counters were in memory
    steps = 4 * len(list(loaded.parameters()))
    assert (
        torch.load(tmp_path / "optimizer_bytes0.pt") == torch.load(tmp_path / "optimizer_bytes1.pt") == steps
    )
