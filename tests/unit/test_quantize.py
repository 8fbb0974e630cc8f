"""The int8 wire format and the accuracy guard's figure (lightning_zero/comm/quantize.py), on one
process: the round trip's error bound, and which chunks the figure flags ([Note: the accuracy
guard])."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.comm.quantize import LEVELS, BlockLayout

BLOCK = 64
THRESHOLD = 0.5  # quantize_guard's default


def _round_trip(layout: BlockLayout, chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks through the wire, and the senders' figures."""
    packed, figures = layout.quantize(chunks)
    values, _ = layout.dequantize(packed)
    return values.to(chunks.dtype), figures


def _gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_each_value_is_within_half_a_step_of_its_block():
    lengths = [100, 37, 256]  # segments of 1.6, 0.6 and 4 blocks: padded apart, so no block mixes two
    layout = BlockLayout(lengths, BLOCK)
    scales = torch.tensor([0.02] * 100 + [1.0] * 37 + [1e-3] * 256)
    chunks = _gaussian(3, sum(lengths)) * scales
    out, _ = _round_trip(layout, chunks)
    for start, length, _ in layout.pieces:
        for row in range(3):
            values, back = chunks[row, start : start + length], out[row, start : start + length]
            for block, block_back in zip(values.split(BLOCK), back.split(BLOCK)):
                step = float(block.abs().max()) / LEVELS
                assert float((block_back - block).abs().max()) <= step / 2 * (1 + 1e-5)


def test_healthy_values_pass_the_guard():
    layout = BlockLayout([4096, 512], BLOCK)
    chunks = torch.cat([_gaussian(2, 4096) * 0.02, 1 + 0.1 * _gaussian(2, 512, seed=1)], dim=1)
    _, figures = _round_trip(layout, chunks)
    assert float(figures.max()) < 0.1


def test_a_segment_of_tiny_values_next_to_normal_ones_passes():
    """A packed attention bias whose key part stays near 1e-9 while the rest moves by 1e-5: the
    key part rounds to zero, harmlessly; the guard must not take it for garbage."""
    bias = _gaussian(1, 768) * 1e-5
    bias[0, 256:512] = _gaussian(1, 256, seed=2) * 1e-9
    layout = BlockLayout([768], BLOCK)
    out, figures = _round_trip(layout, bias)
    assert float(figures.max()) < THRESHOLD


def test_one_block_with_outliers_is_flagged():
    chunks = _gaussian(1, 4096) * 0.02
    chunks[0, 5:8] = 1e4 * chunks.abs().mean()
    _, figures = _round_trip(BlockLayout([4096], BLOCK), chunks)
    assert float(figures.max()) > THRESHOLD


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_outliers_in_most_blocks_are_flagged(share):
    """An outlier column: every row, and so every block (or half of them), holds one value 1e3
    times the rest, which rounds every other value of its block to zero. The typical block is then
    an outlier's block: the guard must still see that values were lost."""
    rows = _gaussian(64, BLOCK) * 0.02
    every = round(1 / share)
    rows[::every, 0] = 20.0  # 1e3 times the rest
    _, figures = _round_trip(BlockLayout([rows.numel()], BLOCK), rows.reshape(1, -1))
    assert float(figures.max()) > THRESHOLD


def test_only_the_values_travel():
    """A segment's short last block is not padded on the wire: a LayerNorm's row of 32 values at
    4 ranks sends 32 bytes and one scale, not a block of 256. The values' section is rounded up to
    4 bytes with zeros, so that the scales stay aligned, and the round trip still holds."""
    lengths = [512, 32, 3, 256]  # 2 + 1 + 1 + 1 blocks of 256; 803 values
    layout = BlockLayout(lengths, 256)
    assert (layout.numel, layout.blocks) == (803, 5)
    assert layout.nbytes == 804 + 4 * 5 + 4  # values (803 + 1 zero), 5 scales, the figure
    chunks = _gaussian(2, 803) * torch.tensor([0.02] * 512 + [1.0] * 32 + [5.0] * 3 + [1e-3] * 256)
    packed, _ = layout.quantize(chunks)
    assert packed.shape == (2, layout.nbytes) and not packed[:, 803:804].any()
    out, _ = _round_trip(layout, chunks)
    for start, length, _ in layout.pieces:
        block = chunks[:, start : start + min(length, 256)]
        step = block.abs().amax(dim=1, keepdim=True) / LEVELS
        assert bool(((out[:, start : start + block.shape[1]] - block).abs() <= step / 2 * (1 + 1e-5)).all())


def test_short_last_blocks_round_as_whole_blocks_padded_with_zeros():
    """Sending only the values changes no value: each segment, cut into blocks of 256 padded with
    zeros and rounded block by block by hand, comes back bit for bit."""
    lengths = [300, 32, 5, 512]
    layout = BlockLayout(lengths, 256)
    chunks = _gaussian(3, sum(lengths)) * 0.05
    out, _ = _round_trip(layout, chunks)
    for start, length, _ in layout.pieces:
        segment = chunks[:, start : start + length]
        padded = torch.zeros(3, -(-length // 256) * 256)
        padded[:, :length] = segment
        blocks = padded.view(3, -1, 256)
        scale = blocks.abs().amax(dim=2, keepdim=True) / LEVELS
        expected = (blocks * scale.reciprocal()).round() * scale  # as the sender rounds
        assert torch.equal(out[:, start : start + length], expected.view(3, -1)[:, :length])
