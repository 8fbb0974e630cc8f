"""Block-wise int8 on the wire: stage 3's weight all-gathers and gradient reductions, guarded.

[Note: quantized communication]
With ``quantize_weights`` a unit's all-gather sends int8 values instead of the parameters' dtype,
and with ``quantize_grads`` its gradient reduction does; everything else stays in full precision:
the shard (fp32 masters under bf16) is the only copy of the values and what the optimizer steps,
the gradients are accumulated and stepped in the shard's dtype, and checkpoints hold full values.

The wire format of one chunk (a rank's shard of a unit, or the part of a gradient bound for one
rank) is a :class:`BlockLayout`: each parameter's rows are cut into blocks of ``block`` elements,
a parameter's last block only as long as what is left of it, so that no block mixes two
parameters (a LayerNorm weight near 1 next to a linear weight near 0.02 would round the small one
to zero). A block is sent as int8 values and one fp32 scale (its largest magnitude over 127, round
to nearest), and each chunk ends with one fp32 figure, the sender's measure of what the rounding
lost (:meth:`BlockLayout.quantize`). Only the values travel, not the last blocks' padding: a
rank's row of a LayerNorm or a bias (32 elements of a 128-wide layer at 4 ranks) would otherwise
send a whole block of 256 bytes for 32 values. Bytes per element: 1 + 4 / block (+ 4 per chunk,
and up to 3 to keep the scales 4-byte aligned) instead of 4 (fp32) or 2 (bf16).

Weights: every rank sends its quantized shard, and every rank, itself included, computes with the
dequantized values of all of them, so the model every rank runs is the same. Not the root unit's:
it stays gathered from its first use in a step to the step's end, where user code reads and writes
it (an EMA taken after the forward, a weight scaled after backward), and there it must hold the
values, not their rounding, which a write would carry into the shard; a unit freed after forward is
read at rest (exact DTensors). For the same reason ``quantize_weights`` needs
``reshard_after_forward``.

Gradients: a reduce-scatter would sum partial sums that each hop quantizes again; instead each
rank quantizes the chunk bound for rank r once, an all-to-all delivers them, and rank r sums the N
dequantized chunks in fp32 (what DeepSpeed's ZeRO++ does for its gradients). Each value is rounded
exactly once, so the error of a sum is that of N independent roundings, not of N - 1 stacked ones.
No error feedback: it would keep a residual of the whole gradient on every rank (Ψ elements, the
memory stage 3 exists to save), and with each value rounded once the error is already unbiased
to first order. The ledger records it as the reduce-scatter it stands for, with the packed bytes.

[Note: the accuracy guard]
A block whose scale is set by a few outliers rounds its other values to zero. What marks the harm
is not that small values vanish (a packed attention bias whose key part stays near 1e-9 while the
rest moves by 4e-5 loses the key part to rounding, harmlessly) but that values which a typical
block of the same chunk would keep do: a value counts as lost when it rounds to zero and is above
half the chunk's median quantization step, or above a quarter of the chunk's typical nonzero
magnitude (the median of a strided sample of 4096 values), whichever is lower. The first alone
would miss outliers in most blocks (an outlier column: every row's block is an outlier's block,
so the median step is an outlier's); a healthy block rounds to zero only values below 1/254 of its
largest, far below a quarter of the median. Each sender sends the worst block's share of
lost values (against at least a quarter of a block, so that a short parameter's tail cannot alarm)
as its figure; for gradients, the worst over all the chunks it sends, so every receiver gets the
same N figures. Every rank reads the same N figures after the collective, so every rank takes the
same decision without another collective: when the largest passes ``quantize_guard``, the unit's
quantized result is dropped, the same collective runs again in full precision (named
``.../fallback`` in the ledger), and the unit's weights (or gradients) go in full precision for the
next ``quantize_fallback_steps`` steps before trying again; the world's rank 0 warns, naming the
unit and the figure. Healthy weights and gradients score near 0; a value 1000 times its block's
typical one makes its block score near 1. On a GPU, reading the figures waits for the collective
on the host (one sync per unit gather or reduction); ``quantize_guard=None`` turns the guard off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

LEVELS = 127.0  # int8 values in [-127, 127]: symmetric, so that zero stays exactly zero
_SAMPLE = 4096  # values of a chunk the guard's typical magnitude is the median of
_F32 = 4  # bytes of a scale and of the figure


@dataclass(frozen=True)
class WireQuantization:
    """What a stage-3 model quantizes on the wire, and its guard (the ``quantize_*`` options)."""

    weights: bool
    grads: bool
    block: int = 256
    guard: float | None = 0.5
    fallback_steps: int = 100

    @classmethod
    def of(cls, config: Any) -> WireQuantization | None:
        """From a ZeroConfig; None when it quantizes nothing."""
        if not (config.quantize_weights or config.quantize_grads):
            return None
        return cls(
            config.quantize_weights,
            config.quantize_grads,
            config.quantize_block,
            config.quantize_guard,
            config.quantize_fallback_steps,
        )

    def guard_for(self, what: str, comm: Any) -> WireGuard:
        """A guard for one unit's traffic over ``comm`` (its ledger's step is the clock; the world's
        rank 0 warns, since every rank decides alike)."""
        return WireGuard(
            what, self.guard, self.fallback_steps, lambda: comm.ledger.step, comm.global_rank == 0
        )


class BlockLayout:
    """How one chunk, laid out as consecutive segments (a unit's parameters, each its rows), is cut
    into int8 blocks of ``block`` elements, each segment's last block as long as what is left.

    Packed, a chunk is its int8 values in the chunk's order (``numel`` bytes, then zeros up to a
    multiple of 4), one fp32 scale per block, and the fp32 figure. Quantizing works on the blocks
    padded with zeros (a copy of the chunk); only the values are sent.

    Args:
        lengths: the segments' lengths, in the chunk's order (their sum: the chunk's elements).
        block: elements per block (one fp32 scale each).
    """

    def __init__(self, lengths: Sequence[int], block: int) -> None:
        self.block = block
        self.numel = sum(lengths)  # elements of a chunk
        self.pieces: list[tuple[int, int, int]] = []  # (start in the chunk, length, start padded)
        padded = 0
        for start, length in zip(_starts(lengths), lengths):
            if length:
                self.pieces.append((start, length, padded))
                padded += -(-length // block) * block
        self.padded = padded  # elements of a chunk in blocks, each padded to ``block``
        self.blocks = padded // block
        self.aligned = padded == self.numel  # every segment a whole number of blocks: no padding
        self.scales_at = -(-self.numel // _F32) * _F32  # byte offset of the scales in a packed chunk
        self.figure_at = self.scales_at + _F32 * self.blocks  # byte offset of the figure
        self.nbytes = self.figure_at + _F32  # bytes of one packed chunk

    def quantize(self, chunks: Tensor, *, measure: bool = True) -> tuple[Tensor, Tensor]:
        """``chunks`` (M, numel, floating point) as packed int8 chunks (M, nbytes; uint8), and each
        chunk's figure (M,, see :meth:`_figure`; zeros when not ``measure``). The figure slot of
        each packed chunk is left for :meth:`set_figures`."""
        m = chunks.shape[0]
        blocks = self._padded(chunks).view(m, self.blocks, self.block)  # fp32, a copy of its own
        magnitude = blocks.abs()
        scale = magnitude.amax(dim=2).div_(LEVELS)  # (M, blocks): 0 for a block of zeros
        inverse = torch.where(scale > 0, scale.reciprocal(), 0.0).unsqueeze(2)
        rounded = blocks.mul_(inverse).round_().view(m, self.padded)  # in [-127, 127]
        figure = torch.zeros(m, dtype=torch.float32, device=chunks.device)
        if measure:
            figure = self._figure(magnitude, rounded.view(m, self.blocks, self.block), scale)
        del magnitude
        packed = torch.empty(m, self.nbytes, dtype=torch.uint8, device=chunks.device)
        values = packed[:, : self.numel].view(torch.int8)
        if self.aligned:
            values.copy_(rounded)
        else:
            for start, length, at in self.pieces:
                values[:, start : start + length].copy_(rounded[:, at : at + length])
        packed[:, self.numel : self.scales_at].zero_()
        packed[:, self.scales_at : self.figure_at].view(torch.float32).copy_(scale)
        return packed, figure

    def _figure(self, magnitude: Tensor, rounded: Tensor, scale: Tensor) -> Tensor:
        """Per chunk (M,): the largest share, over its blocks, of values lost to their block's
        scale that a typical block of the chunk would have kept (see [Note: the accuracy guard])."""
        m = magnitude.shape[0]
        step = scale.median(dim=1, keepdim=True).values  # (M, 1): the median block's step
        flat = magnitude.view(m, -1)
        sample = flat[:, :: max(1, flat.shape[1] // _SAMPLE)]  # a strided sample, padding included
        value = torch.where(sample > 0, sample, torch.nan).nanmedian(dim=1, keepdim=True).values
        kept = torch.fmin(step / 2, value / 4).unsqueeze(2)  # (M, 1, 1); NaN (no nonzero): the step
        lost = ((rounded == 0) & (magnitude > kept)).sum(dim=2)
        nonzero = (magnitude != 0).sum(dim=2).clamp_min(self.block // 4)
        return (lost / nonzero).amax(dim=1).float()

    def set_figures(self, packed: Tensor, figures: Tensor) -> None:
        """Write each chunk's figure (M,) or one figure for all into the packed chunks."""
        packed[:, self.figure_at :].view(torch.float32).copy_(
            figures.reshape(-1, 1).expand(packed.shape[0], 1)
        )

    def dequantize(self, packed: Tensor) -> tuple[Tensor, Tensor]:
        """Packed chunks (M, nbytes) as fp32 values (M, numel) and their senders' figures (M,)."""
        m, size = packed.shape[0], self.block
        values = packed[:, : self.numel].view(torch.int8).to(torch.float32)
        scales = packed[:, self.scales_at : self.figure_at].view(torch.float32)
        if self.aligned:
            values.view(m, self.blocks, size).mul_(scales.unsqueeze(2))
        else:
            for start, length, at in self.pieces:
                first, whole = at // size, length // size
                body = start + whole * size
                if whole:
                    values[:, start:body].view(m, whole, size).mul_(scales[:, first : first + whole, None])
                if body < start + length:  # the segment's short last block
                    values[:, body : start + length].mul_(scales[:, first + whole, None])
        figures = packed[:, self.figure_at :].view(torch.float32).reshape(m)
        return values, figures

    def _padded(self, chunks: Tensor) -> Tensor:
        """``chunks`` (M, numel) in blocks (M, padded), fp32; a copy (the caller keeps its values)."""
        if self.aligned:
            return chunks.to(torch.float32, copy=True)
        out = torch.zeros(chunks.shape[0], self.padded, dtype=torch.float32, device=chunks.device)
        for start, length, at in self.pieces:
            out[:, at : at + length].copy_(chunks[:, start : start + length])
        return out


class WireGuard:
    """One unit's guard for one kind of traffic (weights or gradients): whether to quantize now, and
    the check of the figures every rank received (see [Note: the accuracy guard]).

    Args:
        what: named in the warning ("weights of unit 'blocks.0'").
        threshold: the largest figure accepted; None: every figure is (the guard is off).
        fallback_steps: after a figure above it, full precision for this many steps.
        clock: the current step (every rank's the same).
        announce: this rank logs the warning (one rank does: they all decide alike).
    """

    def __init__(
        self,
        what: str,
        threshold: float | None,
        fallback_steps: int,
        clock: Callable[[], int],
        announce: bool,
    ) -> None:
        self.announce = announce
        self.what = what
        self.threshold = threshold
        self.fallback_steps = fallback_steps
        self.clock = clock
        self.until = -1  # full precision while the step is below this
        self.fallbacks = 0  # times the figures failed the threshold
        self.last = 0.0  # the largest figure of the latest quantized collective

    def quantize_now(self) -> bool:
        return self.clock() >= self.until

    def accept(self, figures: Tensor) -> bool:
        """After a quantized collective: its result may be used (else: fall back, warned)."""
        self.last = float(figures.max())  # the same on every rank: every rank received these
        if self.threshold is None or self.last <= self.threshold:
            return True
        self.fallbacks += 1
        self.until = self.clock() + self.fallback_steps
        if not self.announce:
            return False
        log.warning(
            "quantized communication: the %s lost %.0f%% of a block's nonzero values to int8 rounding "
            "(quantize_guard=%s); sent again in full precision, and in full precision until step %d",
            self.what,
            100 * self.last,
            self.threshold,
            self.until,
        )
        return False


class Int8Reduction:
    """A ReduceScatter sent as int8 chunks through an all-to-all and summed in fp32 by each
    receiver (see [Note: quantized communication]), falling back to a ReduceScatter in full
    precision when the guard refuses the figures: a stage-3 unit's gradients, a stage 1-2 bucket.

    Args:
        wire: the layout of one rank's chunk.
        guard: the guard of this traffic.
    """

    def __init__(self, wire: BlockLayout, guard: WireGuard) -> None:
        self.wire = wire
        self.guard = guard
        self.received: Tensor | None = None  # 1D, N x packed: the chunks bound for this rank
        self.name = ""  # the reduction in flight's ledger name (its fallback's stem)

    def start(self, comm: Any, values: Tensor, name: str) -> Any:
        """Send ``values`` (1D, N x chunk, left as they are); returns the all-to-all's handle."""
        self.name = name
        packed, figures = self.wire.quantize(
            values.view(comm.world_size, -1), measure=self.guard.threshold is not None
        )
        self.wire.set_figures(packed, figures.max())  # the worst of all it sends: see the guard
        self.received = torch.empty_like(packed).view(-1)
        return comm.all_to_all(self.received, packed.view(-1), name=name + "/int8")

    @property
    def nbytes(self) -> int:
        """Bytes of the packed chunks in flight (sent and received); 0: none in flight."""
        return 0 if self.received is None else 2 * self.received.numel()

    def finish(self, comm: Any, out: Tensor, values: Tensor) -> None:
        """After the all-to-all: this rank's sum into ``out``, or, when the guard refuses the senders'
        figures (every rank alike), a ReduceScatter of ``values`` in full precision."""
        received, self.received = self.received, None
        wire = self.wire
        dequantized, figures = wire.dequantize(received.view(comm.world_size, wire.nbytes))
        if self.guard.accept(figures):
            out.view(1, -1).copy_(dequantized.sum(dim=0, keepdim=True))  # summed in fp32, then cast
            return
        comm.reduce_scatter(out, values, name=self.name + "/fallback", scratch_input=True, async_op=False)

    def drop(self) -> None:
        self.received = None


def _starts(lengths: Sequence[int]) -> list[int]:
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    return starts
