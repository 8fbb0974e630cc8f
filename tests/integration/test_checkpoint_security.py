"""Resuming from a checkpoint with a planted object runs nothing on any rank (2 gloo ranks).

Before: an object planted in a sharded checkpoint's ``meta.pt`` ran on every rank at
``trainer.fit(ckpt_path=...)``, and the resume then succeeded.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint.unpickle import read_dcp_metadata
from tests.integration.test_checkpoint_resume import fit
from tests.unit.test_checkpoint_security import REFUSED, Payload


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """``last.ckpt`` of one epoch of zero2 on 2 ranks, in each form."""
    root = tmp_path_factory.mktemp("saved")
    for kind in ("sharded", "full"):
        fit(root / kind, 2, 2, kind, epochs=1)
    return {kind: root / kind / "ckpt" / "last.ckpt" for kind in ("sharded", "full")}


def _plant_meta(path: Path, marker: Path) -> Path:
    meta = torch.load(path / "meta.pt", weights_only=False)
    meta.setdefault("hyper_parameters", {})["note"] = Payload(marker)
    torch.save(meta, path / "meta.pt")
    return path / "meta.pt"


def _plant_metadata(path: Path, marker: Path) -> Path:
    metadata = read_dcp_metadata(path)
    metadata.planner_data = Payload(marker)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return path / ".metadata"


def _plant_full(path: Path, marker: Path) -> Path:
    checkpoint = torch.load(path, weights_only=False)
    checkpoint.setdefault("hyper_parameters", {})["note"] = Payload(marker)
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize(
    ("kind", "plant"), [("sharded", _plant_meta), ("sharded", _plant_metadata), ("full", _plant_full)]
)
def test_a_resume_from_a_planted_checkpoint_runs_nothing_on_any_rank(tmp_path, saved, kind, plant):
    source = tmp_path / "last.ckpt"
    (shutil.copytree if kind == "sharded" else shutil.copy)(saved[kind], source)
    marker = tmp_path / "ran"
    file = plant(source, marker)
    with pytest.raises(BaseException) as caught:  # the first rank's error, as the launcher reports it
        fit(tmp_path / "resumed", 1, 2, kind, epochs=2, ckpt_path=source)
    assert not marker.exists()  # neither rank ran it
    message = str(caught.value)
    if plant is _plant_metadata:  # its checksum is compared before it is parsed: damaged, unread
        assert "CheckpointError" in message and f"{file} is damaged" in message, message
    else:
        assert "UnsafeCheckpointError" in message and str(file) in message and REFUSED in message, message
    assert not (tmp_path / "resumed" / "final.pt").exists()  # no rank went on training


def _fabric_load_planted(fabric, root: Path, form: str) -> None:
    """In each of 2 ranks: save, plant (rank 0), load; each rank writes what its load raised."""
    torch.set_num_threads(1)  # see LitResume.setup: OpenMP's thread team does not survive a fork
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    path = root / f"{form}.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    if fabric.global_rank == 0:
        planted = _plant_meta(path, root / "ran") if form == "sharded" else _plant_full(path, root / "ran")
        (root / "planted").write_text(str(planted))
    fabric.barrier()
    try:
        fabric.load(path, {"model": model, "optimizer": optimizer})
        outcome = "loaded"
    except Exception as err:
        outcome = f"{type(err).__name__}: {err}"
    (root / f"rank{fabric.global_rank}").write_text(outcome)


@pytest.mark.parametrize("form", ["sharded", "full"])
def test_fabric_load_of_a_planted_checkpoint_runs_nothing_and_every_rank_names_it(tmp_path, form):
    from lightning.fabric import Fabric

    from lightning_zero.fabric import ZeroFabricStrategy as ZeroStrategy

    strategy = ZeroStrategy(stage=2, state_dict_type=form, start_method="fork")
    Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(_fabric_load_planted, tmp_path, form)
    planted = (tmp_path / "planted").read_text()
    assert not (tmp_path / "ran").exists()
    for rank in (0, 1):
        outcome = (tmp_path / f"rank{rank}").read_text()
        assert outcome.startswith(f"UnsafeCheckpointError: {planted} holds an object"), outcome
        assert REFUSED in outcome
