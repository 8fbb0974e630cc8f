"""Integrity errors name the damaged tensor, also among the views of one flat buffer (a stage 1-2
bucket: one storage record holds many parameters), and a fall-back says which file was loaded,
down to Lightning's own "Restored all states from the checkpoint at ..." line.

Before: a flip in a zero2 full file was named by the first tensor of the flat record
(``net.inp.weight``) although the damaged one was ``net.body.0.0.weight``, and after a fall-back
Lightning still said it had restored ``last.ckpt``.
"""

from __future__ import annotations

import logging
import multiprocessing
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero import checkpoint as C
from lightning_zero.checkpoint.checksum import add_full_checksums
from lightning_zero.checkpoint.format import INTEGRITY_KEY
from lightning_zero.checkpoint.verify import verify_records
from lightning_zero.comm import Communicator
from tests.integration.test_checkpoint_resume import LitResume
from tests.unit.test_checkpoint_integrity import _flip, _record_data_offset, _save_full

IO = TorchCheckpointIO()


class Net(nn.Module):
    """``inp`` first, ``body.0.0`` second: the order a bucket lays them out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.body = nn.Sequential(nn.Sequential(nn.Linear(16, 16)))


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        params = list(self.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params])  # 1D, one storage for all
        offset = 0
        for p in params:
            p.data = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.flat = flat


def _flat_file(path: Path) -> tuple[dict, Flat]:
    """A full file as a stage-2 save writes one: the model's parameters views of one flat buffer,
    an optimizer state written while gathered (checked by its zip record alone)."""
    model = Flat()
    checkpoint = {
        "global_step": 3,
        "state_dict": model.state_dict(),
        "optimizer_states": [{"state": {0: {"exp_avg": torch.full((16, 8), 0.5)}}, "param_groups": []}],
    }
    add_full_checksums(checkpoint)
    record = checkpoint[INTEGRITY_KEY]
    record["records"] = ["optimizer_states/0/state/0/exp_avg"]  # as a Streamed stand-in is recorded
    del record["tensors"]["optimizer_states/0/state/0/exp_avg"]
    torch.save(checkpoint, path)
    return checkpoint, model


def _flip_at(path: Path, model: Flat, tensor: torch.Tensor) -> None:
    """Flip 8 bytes inside ``tensor``, a view of the model's flat buffer, in the file."""
    raw = model.flat.numpy().tobytes()
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and archive.read(i) == raw)
    start = (tensor.storage_offset() + tensor.numel() // 2) * tensor.element_size()
    _flip(path, _record_data_offset(path, info) + start, count=8)


def test_a_flip_in_a_flat_record_names_the_damaged_tensor_not_the_first_of_the_record(tmp_path):
    path = tmp_path / "last.ckpt"
    _, model = _flat_file(path)
    assert C.read(path, IO)["global_step"] == 3  # intact
    _flip_at(path, model, model.net.body[0][0].weight)
    with pytest.raises(C.CheckpointError) as caught:
        C.read(path, IO)
    message = str(caught.value)
    assert "tensor state_dict/net.body.0.0.weight does not match its checksum" in message
    assert "net.inp.weight" not in message  # the first tensor of the record, which is intact
    assert "(1 of 4 tensors differ)" in message


def test_a_record_without_checksums_of_its_own_names_every_tensor_it_holds(tmp_path):
    """A plain torch.save file (no checksum entry): the zip CRC says which record is damaged, and
    every tensor stored in it is named, not the first one alone."""
    path = tmp_path / "plain.ckpt"
    model = Flat()
    torch.save({"state_dict": model.state_dict()}, path)
    verify_records(path)  # intact
    _flip_at(path, model, model.net.body[0][0].bias)
    with pytest.raises(C.CheckpointError) as caught:
        verify_records(path)
    assert (
        "tensors state_dict/net.inp.weight, state_dict/net.inp.bias, state_dict/net.body.0.0.weight, "
        "state_dict/net.body.0.0.bias (one storage record)" in str(caught.value)
    )


def test_a_streamed_record_is_still_named_by_its_tensor(tmp_path):
    path = tmp_path / "last.ckpt"
    checkpoint, _ = _flat_file(path)
    exp_avg = checkpoint["optimizer_states"][0]["state"][0]["exp_avg"]
    data = bytearray(path.read_bytes())
    at = data.find(exp_avg.numpy().tobytes())
    data[at + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(C.CheckpointError, match=r"tensor optimizer_states/0/state/0/exp_avg \(record"):
        C.read(path, IO)


def test_read_or_fallback_says_which_file_it_loaded(tmp_path, caplog):
    path = tmp_path / "last.ckpt"
    _save_full(path, step=1)
    loaded = C.read_or_fallback(path, IO)
    assert loaded.loaded_from == str(path) and not loaded.fell_back
    second = _save_full(path, step=2)
    weight = second["state_dict"]["emb.weight"]
    data = bytearray(path.read_bytes())
    at = data.find(weight.numpy().tobytes()[:64])
    data[at + 32] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        loaded = C.read_or_fallback(path, IO, comm=Communicator())
    assert loaded["global_step"] == 1 and loaded.fell_back
    assert loaded.loaded_from == str(tmp_path / ".last.ckpt.previous")
    assert f"loading the previous intact checkpoint {tmp_path / '.last.ckpt.previous'}" in caplog.text


class StartStep(Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step  # where the fit began: the restored checkpoint's step


def _fit(root: Path, epochs: int, ckpt_path=None) -> dict:
    started = StartStep()
    trainer = Trainer(
        strategy=ZeroStrategy(stage=1),  # its load_checkpoint names the file a fall-back loaded
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=root, filename="last", save_top_k=-1, enable_version_counter=False),
            started,
        ],
        default_root_dir=root,
    )
    trainer.fit(LitResume(), ckpt_path=ckpt_path)
    return {"step": started.step, "ckpt_path": trainer.ckpt_path}


def _fall_back_in_a_fit(root: str) -> dict:
    """In a process of its own: a fit leaves threads and a process group behind, which a later test
    that forks its ranks would inherit (a forked child then waits on a lock held by a thread)."""
    torch.set_num_threads(1)
    root = Path(root)
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    logging.getLogger("lightning.pytorch").addHandler(handler)  # Lightning's own: it does not propagate
    first = _fit(root, epochs=2)  # last.ckpt twice: the first kept as .last.ckpt.previous
    last, previous = root / "last.ckpt", root / ".last.ckpt.previous"
    kept = previous.exists()
    data = bytearray(last.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    last.write_bytes(bytes(data))
    lines.clear()
    resumed = _fit(root, epochs=3, ckpt_path=str(last))
    return {"first": first, "kept": kept, "resumed": resumed, "log": "\n".join(lines)}


def test_lightning_names_the_checkpoint_it_restored_after_a_fall_back(tmp_path):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        out = pool.submit(_fall_back_in_a_fit, str(tmp_path)).result(timeout=300)
    last, previous = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.previous"
    assert out["first"]["step"] == 0 and out["kept"]
    assert f"Restored all states from the checkpoint at {previous}" in out["log"], out["log"]
    assert f"Restored all states from the checkpoint at {last}" not in out["log"]
    assert f"loading the previous intact checkpoint {previous}" in out["log"]
    assert out["resumed"]["ckpt_path"] == str(previous)
    assert (
        out["resumed"]["step"] == 6
    )  # resumed from the first epoch's end (6 steps an epoch), not from scratch


def test_a_damaged_last_falls_back_to_the_newest_intact_checkpoint_not_to_its_older_previous(tmp_path):
    """``last.ckpt`` (step 14) damaged, its kept ``.last.ckpt.previous`` of step 8, and a top-k
    checkpoint of step 12 saved in between: step 12 is read. Before, the previous version came
    first whatever its age, and an intact newer checkpoint in the folder was passed over."""
    import os

    from lightning_zero.checkpoint.locate import fallbacks

    io = TorchCheckpointIO()
    steps = {".last.ckpt.previous": 8, "epoch=0-step=4.ckpt": 4, "epoch=2-step=12.ckpt": 12, "last.ckpt": 14}
    for name, step in steps.items():
        torch.save({"global_step": step, "state_dict": {"w": torch.full((2,), float(step))}}, tmp_path / name)
        os.utime(tmp_path / name, (1_000_000 + step, 1_000_000 + step))
    (tmp_path / "last.ckpt").write_bytes(b"damaged")
    os.utime(tmp_path / "last.ckpt", (1_000_014, 1_000_014))
    names = [p.name for p in fallbacks(tmp_path / "last.ckpt")]
    assert names == ["epoch=2-step=12.ckpt", ".last.ckpt.previous", "epoch=0-step=4.ckpt"]
    loaded = C.read_or_fallback(tmp_path / "last.ckpt", io)
    assert loaded.loaded_from == str(tmp_path / "epoch=2-step=12.ckpt")
