"""Checkpoint files in one process, no process group: round trips, consolidation, and clear errors
for truncated, incomplete and foreign checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_zero import checkpoint as C
from lightning_zero.cli import main
from lightning_zero.comm import Communicator
from tests.distributed import models


def _trained(seed: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """TinyLM with a tied head and a buffer; AdamW with two groups, stepped twice."""
    model = models.build(seed=seed, tied=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "lr": 5e-3}], lr=1e-2)
    for batch in models.global_batches(2, 1, seed=seed):
        model(*batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _save_sharded(path: Path, model, optimizer) -> Path:
    """What ZeroStrategy(state_dict_type="sharded") writes, from one process."""
    checkpoint = {
        "epoch": 4,
        "global_step": 2,
        "loops": {"fit_loop": {"epoch_progress": 4}},
        "lr_schedulers": [{"last_epoch": 2}],
        "callbacks": {"SomeCallback": {"best": 1.0}},
        "state_dict": C.sharded_model_state(model, None),
        "optimizer_states": [C.sharded_optimizer_state(model, None, optimizer, 0)],
    }
    C.save_sharded(checkpoint, path, Communicator(), C.layout_of(model, None, 0, 1))
    return path


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_sharded_round_trip_and_consolidation(tmp_path):
    model, optimizer = _trained()
    path = _save_sharded(tmp_path / "last.ckpt", model, optimizer)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # the partial directory renamed away
    assert {"meta.pt", ".metadata"} <= set(os.listdir(path))
    assert main(["consolidate", str(path), str(tmp_path / "full.ckpt")]) == 0
    full = torch.load(tmp_path / "full.ckpt", weights_only=False)
    assert list(full["state_dict"]) == list(model.state_dict())  # original names, order, the tied alias
    assert _max_diff(full["state_dict"], model.state_dict()) == 0.0
    assert full["state_dict"]["head.weight"] is full["state_dict"]["emb.weight"]
    expected = optimizer.state_dict()
    got = full["optimizer_states"][0]
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for i, entry in expected["state"].items():
        assert _max_diff(got["state"][i], entry) == 0.0
    assert (full["epoch"], full["loops"], full["lr_schedulers"]) == (
        4,
        {"fit_loop": {"epoch_progress": 4}},
        [{"last_epoch": 2}],
    )
    # --weights-only: no optimizer, scheduler or callback state
    assert main(["consolidate", str(path), str(tmp_path / "w.ckpt"), "--weights-only"]) == 0
    weights = torch.load(tmp_path / "w.ckpt", weights_only=False)
    assert not {"optimizer_states", "lr_schedulers", "callbacks"} & set(weights)
    assert _max_diff(weights["state_dict"], model.state_dict()) == 0.0


def test_sharded_load_into_a_fresh_model_and_optimizer(tmp_path):
    model, optimizer = _trained()
    path = _save_sharded(tmp_path / "a.ckpt", model, optimizer)
    fresh, fresh_opt = _trained(seed=11)
    checkpoint = C.read(path, TorchCheckpointIO())
    assert isinstance(checkpoint["state_dict"], C.ShardedModelState) and checkpoint["epoch"] == 4
    C.load_model_state(fresh, None, Communicator(), checkpoint["state_dict"])
    C.load_sharded_optimizer(fresh, None, Communicator(), fresh_opt, checkpoint["optimizer_states"][0])
    assert _max_diff(fresh.state_dict(), model.state_dict()) == 0.0
    for i, entry in optimizer.state_dict()["state"].items():
        assert _max_diff(fresh_opt.state_dict()["state"][i], entry) == 0.0


def test_a_model_that_does_not_match_is_refused_with_the_keys(tmp_path):
    model, optimizer = _trained()
    path = _save_sharded(tmp_path / "a.ckpt", model, optimizer)
    other = models.build(seed=1, unused=True)  # has extra.* and side.*, no tie
    with pytest.raises(C.CheckpointError, match=r"missing 4 key\(s\) \['extra.bias'"):
        C.load_model_state(other, None, Communicator(), C.read(path, TorchCheckpointIO())["state_dict"])


def test_truncated_shard_file_names_the_file(tmp_path):
    model, optimizer = _trained()
    path = _save_sharded(tmp_path / "a.ckpt", model, optimizer)
    shard = path / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(
        C.CheckpointError, match=rf"{shard} is truncated: \d+ bytes, its chunks end at byte \d+"
    ):
        C.read(path, TorchCheckpointIO())
    assert main(["consolidate", str(path), str(tmp_path / "out.ckpt")]) == 2
    assert not (tmp_path / "out.ckpt").exists()
    shard.unlink()
    with pytest.raises(C.CheckpointError, match=rf"{shard} is missing: .* model\."):
        C.read(path, TorchCheckpointIO())


@pytest.mark.parametrize(("name", "what"), [("meta.pt", "rank 0's entries"), (".metadata", "DCP's index")])
def test_incomplete_directory_names_what_is_missing(tmp_path, name, what):
    path = _save_sharded(tmp_path / "a.ckpt", *_trained())
    (path / name).unlink()
    with pytest.raises(C.CheckpointError, match=rf"not a complete sharded checkpoint: {name} \({what}"):
        C.read(path, TorchCheckpointIO())


def test_foreign_directory_and_truncated_meta(tmp_path):
    path = _save_sharded(tmp_path / "a.ckpt", *_trained())
    torch.save({"epoch": 1}, path / "meta.pt")  # e.g. another strategy's sharded checkpoint
    with pytest.raises(C.CheckpointError, match="has no 'lightning_zero' layout entry"):
        C.read(path, TorchCheckpointIO())
    (path / "meta.pt").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(C.CheckpointError, match=rf"cannot read {path / 'meta.pt'} \(\d+ bytes\): truncated"):
        C.read(path, TorchCheckpointIO())


def test_full_file_truncated_or_foreign(tmp_path):
    model, _ = _trained()
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": model.state_dict(), "epoch": 0}, good)
    assert C.read(good, TorchCheckpointIO())["epoch"] == 0
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(
        C.CheckpointError, match=rf"cannot read the checkpoint file {cut} \(\d+ bytes\): truncated"
    ):
        C.read(cut, TorchCheckpointIO())
    bare = tmp_path / "bare.pt"
    torch.save(model.state_dict(), bare)
    with pytest.raises(
        C.CheckpointError, match=rf"{bare} is not a Lightning checkpoint: it has no 'state_dict'"
    ):
        C.read(bare, TorchCheckpointIO())
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint")
    with pytest.raises(C.CheckpointError, match=rf"cannot read the checkpoint file {text}"):
        C.read(text, TorchCheckpointIO())
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        C.read(tmp_path / "absent.ckpt", TorchCheckpointIO())


def test_replacing_keeps_the_old_checkpoint_until_the_new_one_is_complete(tmp_path):
    first = _save_sharded(tmp_path / "last.ckpt", *_trained(seed=3))
    old = (first / "__0_0.distcp").read_bytes()
    # a save that stops between its two renames: the old one under .NAME.previous, NAME absent
    os.rename(first, tmp_path / ".last.ckpt.previous")
    assert C.resolve(tmp_path / "last.ckpt") == tmp_path / ".last.ckpt.previous"
    os.rename(tmp_path / ".last.ckpt.previous", first)
    # a later save replaces it and keeps the old one beside it (keep_previous_checkpoint)
    model, optimizer = _trained(seed=4)
    _save_sharded(first, model, optimizer)
    assert sorted(os.listdir(tmp_path)) == [".last.ckpt.previous", "last.ckpt"]
    assert (first / "__0_0.distcp").read_bytes() != old
    assert (tmp_path / ".last.ckpt.previous" / "__0_0.distcp").read_bytes() == old
    C.remove(first, TorchCheckpointIO())
    assert os.listdir(tmp_path) == []


def test_full_save_replaces_atomically(tmp_path):
    path = tmp_path / "last.ckpt"
    io = TorchCheckpointIO()
    C.save_full({"state_dict": {}, "epoch": 0}, str(path), Communicator(), io)
    C.save_full({"state_dict": {}, "epoch": 1}, str(path), Communicator(), io)
    assert sorted(os.listdir(tmp_path)) == [".last.ckpt.previous", "last.ckpt"]
    assert torch.load(path, weights_only=False)["epoch"] == 1
    assert torch.load(tmp_path / ".last.ckpt.previous", weights_only=False)["epoch"] == 0
    C.save_full({"state_dict": {}, "epoch": 2}, str(path), Communicator(), io, keep_previous=False)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_state_dict_type_is_checked_where_it_enters():
    from hydra import compose, initialize_config_dir

    from lightning_zero import ZeroConfig, ZeroStrategy
    from lightning_zero.config import register_hydra_schema

    assert ZeroConfig().state_dict_type == "full"
    assert ZeroStrategy(stage=3, state_dict_type="sharded").config.state_dict_type == "sharded"
    with pytest.raises(
        ValueError, match=r"state_dict_type must be one of \['full', 'sharded'\], got 'shards'"
    ):
        ZeroConfig(state_dict_type="shards")
    register_hydra_schema()
    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base=None):
        for stage in range(4):
            cfg = compose("config", overrides=[f"strategy=zero{stage}", "strategy.state_dict_type=sharded"])
            assert cfg.strategy.state_dict_type == "sharded"
        assert compose("config").strategy.state_dict_type == "full"


def test_full_checkpoints_hold_host_tensors():
    """A full checkpoint loads onto the CPU wherever it was saved: device tensors are copied to the
    host before writing, host tensors kept as they are (tests/gpu checks a CUDA model's file)."""
    from collections import OrderedDict

    from lightning_zero.checkpoint.writer import on_host

    state = {"state_dict": OrderedDict(w=torch.ones(2)), "opt": [{"m": torch.zeros(3)}], "step": 3}
    moved = on_host(state)
    assert isinstance(moved["state_dict"], OrderedDict) and moved["step"] == 3
    assert moved["state_dict"]["w"] is state["state_dict"]["w"]  # already on the host: not copied
