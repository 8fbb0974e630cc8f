"""Checkpoint integrity in one process: flipped bytes are caught and named, a damaged checkpoint falls
back to the previous intact one, leftovers of interrupted saves are removed.

Before the checksums, 16 flipped bytes in a full checkpoint's ``exp_avg_sq`` loaded without a
word and the loss was NaN from the next step.
"""

from __future__ import annotations

import logging
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_zero import checkpoint as C
from lightning_zero.comm import Communicator
from tests.unit.test_checkpoint import _save_sharded, _trained

IO = TorchCheckpointIO()


def _full(step: int) -> dict:
    model, optimizer = _trained(seed=step)
    return {
        "global_step": step,
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
    }


def _save_full(path: Path, step: int) -> dict:
    checkpoint = _full(step)
    C.save_full(dict(checkpoint), str(path), Communicator(), IO)
    return checkpoint


def _record_data_offset(path: Path, info: zipfile.ZipInfo) -> int:
    """Where a stored zip record's bytes start in the file."""
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len


def _flip(path: Path, offset: int, count: int = 16) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(count))
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _flip_in_tensor(path: Path, tensor: torch.Tensor) -> None:
    """Flip 16 bytes in the middle of the record that holds ``tensor``'s storage."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and archive.read(i) == raw)
    _flip(path, _record_data_offset(path, info) + info.file_size // 2)


def test_flipped_bytes_in_a_full_checkpoint_name_the_file_and_the_tensor(tmp_path):
    path = tmp_path / "last.ckpt"
    saved = _save_full(path, step=1)
    exp_avg_sq = saved["optimizer_states"][0]["state"][0]["exp_avg_sq"]
    assert C.read(path, IO)["global_step"] == 1  # intact: loads, the checksums entry dropped
    _flip_in_tensor(path, exp_avg_sq)
    torch.load(path, weights_only=False)  # torch itself notices nothing
    with pytest.raises(
        C.CheckpointError,
        match=r"last\.ckpt is damaged: tensor optimizer_states/0/state/0/exp_avg_sq does not match its checksum",
    ):
        C.read(path, IO)
    assert C.read(path, IO, verify=False)["global_step"] == 1  # verify_checkpoints=False: as before


def test_flipped_bytes_in_the_pickle_are_caught_by_its_zip_checksum(tmp_path):
    path = tmp_path / "last.ckpt"
    _save_full(path, step=1)
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    _flip(path, _record_data_offset(path, info) + info.file_size - 40, count=1)  # inside the pickle
    with pytest.raises(C.CheckpointError, match=r"record \S+data\.pkl does not match its checksum"):
        C.read(path, IO)


def test_flipped_bytes_in_a_shard_name_the_file_and_the_tensor(tmp_path):
    model, optimizer = _trained()
    path = _save_sharded(tmp_path / "last.ckpt", model, optimizer)
    _, metadata = C.inspect_sharded(path)
    index, info = max(metadata.storage_data.items(), key=lambda item: item[1].length)
    _flip(path / info.relative_path, info.offset + info.length // 2)
    message = rf"{info.relative_path} is damaged: the chunk of tensor {index.fqn} at offset"
    with pytest.raises(C.CheckpointError, match=message):
        C.read(path, IO)
    with pytest.raises(C.CheckpointError, match=message):
        C.consolidate(path, tmp_path / "out.ckpt")


def test_a_damaged_last_checkpoint_falls_back_to_its_previous_version(tmp_path, caplog):
    path = tmp_path / "last.ckpt"
    _save_full(path, step=1)
    second = _save_full(path, step=2)  # the first kept as .last.ckpt.previous
    assert sorted(p.name for p in tmp_path.iterdir()) == [".last.ckpt.previous", "last.ckpt"]
    _flip_in_tensor(path, second["state_dict"]["emb.weight"])
    with caplog.at_level(logging.WARNING):
        checkpoint = C.read_or_fallback(path, IO)
    assert checkpoint["global_step"] == 1
    assert (
        "last.ckpt cannot be loaded" in caplog.text and "damaged: tensor state_dict/emb.weight" in caplog.text
    )
    assert (
        f"loading the previous intact checkpoint {tmp_path / '.last.ckpt.previous'} (step 1)" in caplog.text
    )


def test_a_damaged_or_missing_hpc_checkpoint_falls_back_to_the_latest_intact_one(tmp_path):
    _save_full(tmp_path / "hpc_ckpt_1.ckpt", step=1)
    second = _save_full(tmp_path / "hpc_ckpt_2.ckpt", step=2)
    _flip_in_tensor(tmp_path / "hpc_ckpt_2.ckpt", second["state_dict"]["emb.weight"])
    assert C.read_or_fallback(tmp_path / "hpc_ckpt_2.ckpt", IO)["global_step"] == 1
    # a save of hpc_ckpt_3 killed before its rename: Lightning's resume picks number 3 from the leftover
    (tmp_path / ".hpc_ckpt_3.ckpt.partial").write_bytes(b"half")
    assert C.read_or_fallback(tmp_path / "hpc_ckpt_3.ckpt", IO)["global_step"] == 1


def test_an_explicit_path_falls_back_only_to_its_own_previous_version(tmp_path):
    _save_full(tmp_path / "epoch=1.ckpt", step=1)
    third = _save_full(tmp_path / "epoch=3.ckpt", step=3)
    _flip_in_tensor(tmp_path / "epoch=3.ckpt", third["state_dict"]["emb.weight"])
    with pytest.raises(C.CheckpointError, match="damaged"):
        C.read_or_fallback(tmp_path / "epoch=3.ckpt", IO)  # not silently epoch=1: another checkpoint


def test_leftovers_of_interrupted_saves_are_removed_by_the_next_save(tmp_path):
    (tmp_path / ".a.ckpt.partial").mkdir()  # a sharded save, killed
    (tmp_path / ".a.ckpt.partial" / "__0_0.distcp").write_bytes(b"x" * 100)
    (tmp_path / ".b.ckpt.partial").write_bytes(b"x" * 100)  # a full save, killed
    _save_full(tmp_path / "c.ckpt", step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]
    assert C.remove_stale_partials(tmp_path / "missing") == []


def test_a_flipped_byte_in_a_record_written_while_gathered_names_its_tensor(tmp_path):
    """Tensors streamed into a full file are checked by their zip records' CRC32 (split over the
    ranks: each checks every N-th record); the error names the tensor by its path."""
    from lightning_zero.checkpoint.verify import verify_records

    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8)}}, path)
    verify_records(path)  # intact
    data = bytearray(path.read_bytes())
    at = data.find(torch.arange(64, dtype=torch.float32).numpy().tobytes()[:16])
    data[at + 8] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(C.CheckpointError, match=r"tensor state_dict/w \(record .*data/\d+\) does not match"):
        verify_records(path)
    checked = []
    for rank in range(2):  # the two ranks' shares: exactly one of them holds the damaged record
        try:
            verify_records(path, rank=rank, world_size=2)
        except C.CheckpointError:
            checked.append(rank)
    assert len(checked) == 1
