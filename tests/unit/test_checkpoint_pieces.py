"""A sharded save hands torch's FileSystemWriter each piece without a copy ([Note: pieces written
without copies] in checkpoint/writer.py): the writer clones a tensor that views a larger storage
and keeps every written tensor until the file is closed, which held a copy of all of a rank's
parameters (4Ψ/N) at once."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from lightning_zero.checkpoint.format import Piece
from lightning_zero.checkpoint.writer import _SavePlanner, own_storage_view


def test_a_view_gets_storage_of_its_own_over_the_same_memory():
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        flat = torch.arange(20).to(dtype)
        piece = flat[3:11]
        alias = own_storage_view(piece)
        assert alias.untyped_storage().nbytes() == piece.nbytes  # the writer will not clone it
        assert alias.data_ptr() == piece.data_ptr() and alias.dtype == dtype and torch.equal(alias, piece)
        flat[4] = flat[5]  # the same memory, not a copy
        assert torch.equal(alias, flat[3:11])
    whole = torch.ones(4)
    assert own_storage_view(whole) is whole  # already its own storage
    strided = torch.arange(12.0).view(3, 4)[:, 1]
    assert own_storage_view(strided) is strided  # not contiguous: left to the writer


def test_a_sharded_save_clones_no_piece_and_reads_back(tmp_path, monkeypatch):
    shard = torch.randn(1000)  # a flat shard; its pieces view it, as a parameter's does
    state = {"a": Piece(shard[:600], offset=0, numel=600), "b": Piece(shard[600:], offset=100, numel=500)}
    cloned = []
    original_clone = torch.Tensor.clone

    def counting_clone(self, *args, **kwargs):
        cloned.append(self.numel())
        return original_clone(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path), planner=_SavePlanner(), no_dist=True)
    monkeypatch.undo()
    assert not [n for n in cloned if n >= 400], cloned  # neither piece was copied
    back = {"a": torch.zeros(600), "b": torch.zeros(500)}
    dcp.load(back, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(back["a"], shard[:600]) and torch.equal(back["b"][100:], shard[600:])
