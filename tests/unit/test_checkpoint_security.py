"""Nothing in a checkpoint runs when it is loaded, and every publishing rename is made durable.

Each crafted file carries a :class:`Payload`, a pickle that calls ``builtins.exec`` to create a
marker file. Every test first shows that a plain unpickling of that file does run it (so the file
is live), then that our loading refuses it, naming the file and the global, and runs nothing.
Before: an object planted in a sharded checkpoint's ``meta.pt`` ran on every rank at resume and
in ``consolidate``, one planted in DCP's ``.metadata`` before its checksum was checked.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from torch.distributed.checkpoint import FileSystemReader

from lightning_zero import checkpoint as C
from lightning_zero.checkpoint import checksum, verify
from lightning_zero.checkpoint.unpickle import read_dcp_metadata
from lightning_zero.cli import main
from lightning_zero.comm import Communicator
from tests.unit.test_checkpoint import _save_sharded, _trained

IO = TorchCheckpointIO()
REFUSED = "builtins.exec"  # the global every payload names


class Payload:
    """Unpickles as ``exec(<create marker>)``: code a checkpoint would run when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _live(marker: Path, load) -> None:
    """``load`` (an unguarded unpickling of the crafted file) runs the payload; the marker is reset."""
    load()
    assert marker.exists(), "the crafted file does not run its payload: the test would prove nothing"
    marker.unlink()


def _refused(marker: Path, file: Path, load) -> C.UnsafeCheckpointError:
    with pytest.raises(C.UnsafeCheckpointError) as caught:
        load()
    assert not marker.exists()
    assert str(file) in str(caught.value) and REFUSED in str(caught.value), str(caught.value)
    return caught.value


def _plant_in_meta(path: Path, marker: Path) -> Path:
    meta = torch.load(path / "meta.pt", weights_only=False)
    meta["hyper_parameters"] = {"lr": 0.1, "note": Payload(marker)}
    torch.save(meta, path / "meta.pt")  # its zip checksums match: only the allow-list stands in the way
    return path / "meta.pt"


def test_an_object_planted_in_a_full_file_is_refused_and_not_fallen_back_from(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "last.ckpt"
    model, _ = _trained()
    C.save_full({"global_step": 1, "state_dict": model.state_dict()}, str(path), Communicator(), IO)
    C.save_full(
        {"global_step": 2, "state_dict": model.state_dict(), "x": Payload(marker)},
        str(path),
        Communicator(),
        IO,
    )
    assert (tmp_path / ".last.ckpt.previous").is_file()  # an intact previous version is there
    _live(marker, lambda: torch.load(path, weights_only=False))
    error = _refused(marker, path, lambda: C.read(path, IO))
    assert "weights_only=False" in str(error)  # what to do if the file is trusted
    _refused(marker, path, lambda: C.read_or_fallback(path, IO))  # not damage: no silent fall-back
    _refused(marker, path, lambda: C.read(f"file://{path}", IO))  # a URL: Lightning's default there is unsafe
    assert C.read(path, IO, weights_only=False)["global_step"] == 2  # the caller's explicit trust
    assert marker.exists()


def test_an_object_planted_in_meta_pt_is_refused_by_read_and_consolidate(tmp_path, capsys):
    marker = tmp_path / "ran"
    path = _save_sharded(tmp_path / "a.ckpt", *_trained())
    meta = _plant_in_meta(path, marker)
    _live(marker, lambda: torch.load(meta, weights_only=False))
    _refused(marker, meta, lambda: C.read(path, IO))
    _refused(marker, meta, lambda: C.inspect_sharded(path))
    _refused(marker, meta, lambda: C.consolidate(path, tmp_path / "out.ckpt"))
    assert main(["consolidate", str(path), str(tmp_path / "out.ckpt")]) == 2
    assert not marker.exists() and not (tmp_path / "out.ckpt").exists()
    err = capsys.readouterr().err
    assert f"{meta} holds an object" in err and REFUSED in err
    assert main(["consolidate", str(path), str(tmp_path / "out.ckpt"), "--trusted"]) == 0
    assert marker.exists()  # --trusted: loaded as saved, as asked


def test_an_object_planted_in_dcp_metadata_is_found_damaged_before_it_is_parsed_and_refused_unverified(
    tmp_path,
):
    """The checksum is compared before ``.metadata`` is parsed (nothing of it is unpickled first):
    a planted object makes it damaged; read without verification, the allow-list refuses it."""
    marker = tmp_path / "ran"
    path = _save_sharded(tmp_path / "a.ckpt", *_trained())
    metadata = read_dcp_metadata(path)
    metadata.planner_data = Payload(marker)  # deep inside an otherwise valid index
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _live(marker, lambda: FileSystemReader(str(path)).read_metadata())  # DCP's own reader runs it
    file = path / ".metadata"
    for load in (lambda: C.read(path, IO), lambda: C.read(path, IO, weights_only=False)):
        with pytest.raises(C.CheckpointError, match=rf"{re.escape(str(file))} is damaged: it does not match"):
            load()
        assert not marker.exists()
    _refused(marker, file, lambda: C.read(path, IO, verify=False))  # .metadata: never trusted
    _refused(marker, file, lambda: C.read(path, IO, weights_only=False, verify=False))
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))  # the whole file a payload
    _refused(marker, file, lambda: C.read(path, IO, verify=False))


def test_a_damaged_dcp_metadata_is_named_damaged(tmp_path):
    """Bytes of ``.metadata`` flipped: the error says damaged, naming the file, not a parser's error."""
    path = _save_sharded(tmp_path / "a.ckpt", *_trained())
    data = bytearray((path / ".metadata").read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 16):
        data[i] ^= 0xFF
    (path / ".metadata").write_bytes(bytes(data))
    with pytest.raises(C.CheckpointError, match=r"\.metadata is damaged: it does not match its checksum"):
        C.read(path, IO)


def _optimizer_with_object(value) -> tuple[torch.nn.Module, torch.optim.Optimizer, str]:
    """A trained model whose first parameter's optimizer state holds ``value`` (saved as pickled bytes)."""
    model, optimizer = _trained()
    name, param = next(iter(model.named_parameters()))
    optimizer.state[param]["note"] = value
    return model, optimizer, name


def test_an_object_in_a_shard_loads_only_from_the_allow_list(tmp_path):
    marker = tmp_path / "ran"
    model, optimizer, name = _optimizer_with_object({"scale": 1.5, "counts": [1, 2]})
    plain = _save_sharded(tmp_path / "plain.ckpt", model, optimizer)
    fresh, fresh_opt = _trained(seed=11)
    state = C.read(plain, IO)["optimizer_states"][0]
    C.load_sharded_optimizer(fresh, None, Communicator(), fresh_opt, state)
    first = next(iter(fresh.parameters()))
    assert fresh_opt.state[first]["note"] == {"scale": 1.5, "counts": [1, 2]}  # plain objects load as saved

    model, optimizer, name = _optimizer_with_object(Payload(marker))
    path = _save_sharded(tmp_path / "a.ckpt", model, optimizer)  # our own writing: every checksum matches
    shard, fqn = path / "__0_0.distcp", f"optim.0.{name}.note"
    _live(marker, lambda: _unpickle_chunk(path, fqn))  # as DCP's default planner does
    state = C.read(path, IO)["optimizer_states"][0]  # meta.pt and .metadata are clean
    load = lambda: C.load_sharded_optimizer(fresh, None, Communicator(), fresh_opt, state)  # noqa: E731
    assert fqn in str(_refused(marker, shard, load))
    _refused(marker, shard, lambda: C.consolidate(path, tmp_path / "out.ckpt"))


def _unpickle_chunk(path: Path, fqn: str) -> object:
    _, metadata = C.inspect_sharded(path)
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return torch.load(io.BytesIO(f.read(info.length)), weights_only=False)


def test_naming_a_damaged_record_reads_the_pickle_without_running_it(tmp_path):
    """The integrity check reads a full file's pickle for the name of a damaged tensor: structure only."""
    marker, path = tmp_path / "ran", tmp_path / "f.ckpt"
    weight = torch.arange(6.0)
    torch.save({"state_dict": {"net.weight": weight}, "x": Payload(marker)}, path)
    _live(marker, lambda: torch.load(path, weights_only=False))
    with zipfile.ZipFile(path) as archive:
        record = next(
            i.filename
            for i in archive.infolist()
            if "/data/" in i.filename and not i.filename.endswith(".pkl")
        )
        assert verify._tensor_of(archive, record) == "state_dict/net.weight"
    assert not marker.exists()


# --------------------------------------------------------------------------- durability


@pytest.fixture
def synced(monkeypatch) -> list[tuple[str, object]]:
    """Renames (their destination) and fsyncs (a directory's inode, or None for a file), in order."""
    events: list[tuple[str, object]] = []
    fsync, rename, replace = os.fsync, os.rename, os.replace

    def record_fsync(fd: int) -> None:
        st = os.fstat(fd)
        events.append(("fsync", st.st_ino if stat.S_ISDIR(st.st_mode) else None))
        fsync(fd)

    def record(real):
        def move(src, dst, *args, **kwargs):
            real(src, dst, *args, **kwargs)
            events.append(("rename", Path(dst)))

        return move

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "rename", record(rename))
    monkeypatch.setattr(os, "replace", record(replace))
    return events


def _synced_after_publishing(events: list, path: Path) -> bool:
    """The folder of ``path`` was fsynced after the last rename that put something at ``path``."""
    last = max(i for i, (kind, what) in enumerate(events) if kind == "rename" and what == path)
    return ("fsync", path.parent.stat().st_ino) in events[last + 1 :]


def test_a_full_save_fsyncs_its_folder_after_the_rename(tmp_path, synced):
    path = tmp_path / "last.ckpt"
    model, _ = _trained()
    for step in (1, 2):  # a new name, then over the previous file
        synced.clear()
        C.save_full({"global_step": step, "state_dict": model.state_dict()}, str(path), Communicator(), IO)
        assert _synced_after_publishing(synced, path), synced
        assert ("fsync", None) in synced[: synced.index(("rename", path))]  # the file itself, before


def test_a_sharded_save_and_consolidate_fsync_their_folder_after_the_rename(tmp_path, synced):
    path = tmp_path / "last.ckpt"
    for _ in range(2):  # a new name, then replacing the previous directory
        synced.clear()
        _save_sharded(path, *_trained())
        assert _synced_after_publishing(synced, path), synced
        partial_synced = ("fsync", path.stat().st_ino)  # the directory's inode survives its rename
        assert partial_synced in synced[: synced.index(("rename", path))]  # its entries, before
    synced.clear()
    C.consolidate(path, tmp_path / "full.ckpt")
    assert _synced_after_publishing(synced, tmp_path / "full.ckpt"), synced


def test_fabric_load_raw_reads_weights_only_unless_trusted():
    """``fabric.load_raw(path, obj)`` hands the checkpoint IO ``weights_only=True`` unless the caller
    said ``False``: Lightning reads ``None`` as ``False`` for remote paths, where code would run."""
    from types import SimpleNamespace

    import torch

    from lightning_zero.fabric import checkpoint as fcheckpoint

    asked: list = []

    class RecordingIO:
        def load_checkpoint(self, path, weights_only=None):
            asked.append(weights_only)
            return torch.nn.Linear(2, 2).state_dict()

    strategy = SimpleNamespace(
        _run=SimpleNamespace(shared_path=lambda path, device: str(path)),
        root_device=torch.device("cpu"),
        checkpoint_io=RecordingIO(),
        _owns=lambda obj: False,
    )
    for given in (None, True, False):
        fcheckpoint.load_raw(strategy, "https://example.invalid/w.pt", torch.nn.Linear(2, 2), True, given)
    assert asked == [True, True, False]


def test_an_object_planted_in_a_tensor_record_with_its_checksum_rewritten_is_refused_by_name(
    tmp_path, capsys
):
    """A tensor record of a shard replaced by a pickled object, and its checksum in meta.pt rewritten
    to match (who can write the one can write the other): DCP reads tensor records itself,
    weights_only, and refused it, but the error was DCP's CheckpointException with torch's advice to
    set weights_only=False. Now it is an UnsafeCheckpointError naming the checkpoint, on load and
    on consolidate."""
    marker = tmp_path / "ran"
    model, optimizer = _trained()
    path = _save_sharded(tmp_path / "a.ckpt", model, optimizer)
    _, metadata = C.inspect_sharded(path)
    info = next(v for i, v in metadata.storage_data.items() if i.fqn.endswith("exp_avg"))
    planted = io.BytesIO()
    torch.save(Payload(marker), planted, _use_new_zipfile_serialization=False)
    record = planted.getvalue().ljust(info.length, b"\0")
    assert len(record) == info.length
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(record)
    meta = torch.load(path / "meta.pt", weights_only=False)  # our own file, written above
    chunks = meta["lightning_zero"]["checksums"]["chunks"]
    chunks[checksum.chunk_key(info.relative_path, info.offset, info.length)] = zlib.crc32(record)
    torch.save(meta, path / "meta.pt")
    fresh, fresh_opt = _trained(seed=11)
    state = C.read(path, IO)["optimizer_states"][0]
    for load in (
        lambda: C.load_sharded_optimizer(fresh, None, Communicator(), fresh_opt, state),
        lambda: C.consolidate(path, tmp_path / "out.ckpt"),
    ):
        with pytest.raises(C.UnsafeCheckpointError) as caught:
            load()
        assert str(path) in str(caught.value) and REFUSED in str(caught.value), caught.value
        assert not marker.exists()
    assert main(["consolidate", str(path), str(tmp_path / "cli.ckpt")]) != 0  # one line, no traceback
    assert "holds an object" in capsys.readouterr().err
