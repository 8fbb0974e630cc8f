"""A stack of MLP blocks built in ``configure_model`` (deferred at stage 3), optionally a frozen base
with small trainable adapters; memory measured per phase of a run; the quiet Trainer every such run
uses. Shared by the tests and by benchmarks/bench_big_model.py.
"""

from __future__ import annotations

import ctypes
import os
import resource
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_zero import ZeroStrategy
from tests.matrix.lit import Shuffled

BLOCK = "tests.bigmodel.lit.Block"  # stage 3's unit: one per block


class Shape(NamedTuple):
    width: int = 64  # d
    blocks: int = 4  # units
    tokens: int = 8  # rows per micro-batch and rank
    adapters: int = 0  # rank of the trainable adapter in each block; 0: every weight trains
    micro_batches: int = 3  # per epoch and rank


class Adapter(nn.Module):
    """A low-rank trainable update beside a frozen linear layer (LoRA-like)."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:  # children own their tensors; the up projection starts at zero
        nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class Block(nn.Module):
    """LayerNorm -> Linear(d, 4d) -> GELU -> Linear(4d, d), residual: 8d^2 parameters (+ adapter)."""

    def __init__(self, width: int, adapter: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.adapter = Adapter(width, adapter) if adapter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out = x + self.down(F.gelu(self.up(h)))
        return out + self.adapter(h) if self.adapter is not None else out


class Net(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(shape.width, shape.adapters) for _ in range(shape.blocks))
        self.head = nn.Linear(shape.width, 1)
        if shape.adapters:  # fine-tuning: the base is frozen, adapters and head train
            for block in self.blocks:
                for module in (block.norm, block.up, block.down):
                    module.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x).squeeze(-1), y)


class Rows(Dataset):
    def __init__(self, n: int, width: int) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class BigModule(LightningModule):
    """Builds ``Net(shape)`` in ``configure_model`` (so stage 3 builds it on the meta device)."""

    def __init__(self, shape: Shape, *, world: int = 2, lr: float = 1e-3, eager: bool = False) -> None:
        """``world`` 1: the one-process reference, taking the two ranks' rows per batch in the order
        Lightning's DistributedSampler shuffles them (see tests/matrix/lit.py)."""
        super().__init__()
        self.shape = shape
        self.world = world
        self.lr = lr
        self.net: Net | None = Net(shape) if eager else None  # eager: built normally, before the trainer

    def configure_model(self) -> None:
        if self.net is None:
            self.net = Net(self.shape)

    def training_step(self, batch, batch_idx):
        return self.net(*batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        rows = Rows(self.shape.micro_batches * self.shape.tokens * 2, self.shape.width)
        if self.world == 2:
            return DataLoader(rows, batch_size=self.shape.tokens)
        return DataLoader(rows, batch_size=2 * self.shape.tokens, sampler=Shuffled(len(rows)))


def psi(shape: Shape) -> tuple[int, int]:
    """(trainable, frozen) parameter counts of ``Net(shape)``."""
    with torch.device("meta"):
        net = Net(shape)
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in net.parameters()) - trainable


def peak_rss_mb() -> float:
    """The high-water mark of this process's resident memory since the last :func:`reset_peak`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def release_free_heap() -> None:
    """Hand the pages that glibc's heap holds free back to the system (``malloc_trim(0)``), so that a
    fit that follows another in one process starts without the first one's freed memory resident
    (only with glibc; elsewhere nothing is done)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak() -> None:
    """Start a new high-water mark at the current resident size (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Phases(Callback):
    """Peak resident memory of each phase of a fit: setup (model built and sharded), steps, and
    whatever the caller measures around it (saves, resume, teardown) with :meth:`measure`."""

    def __init__(self, baseline: float) -> None:
        self.baseline = baseline  # resident MB before the model existed
        self.peaks: dict[str, float] = {}  # phase -> peak resident MB above the baseline

    def measure(self, phase: str) -> None:
        self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak_rss_mb() - self.baseline)
        reset_peak()

    def on_fit_start(self, trainer, pl_module) -> None:
        self.measure("setup")  # configure_model and the strategy's setup ran before this hook

    def on_train_end(self, trainer, pl_module) -> None:
        self.measure("steps")


def supports_peak_reset() -> bool:
    try:
        reset_peak()
        return os.path.exists("/proc/self/status")
    except OSError:
        return False


def zero_strategy(stage: int, **options: Any) -> ZeroStrategy:
    """Stage ``stage`` with the package's defaults and ``options``; at stage 3 one unit per
    :class:`Block` unless ``wrap_policy`` says otherwise."""
    if stage == 3:
        options.setdefault("wrap_policy", BLOCK)
    return ZeroStrategy(stage=stage, **options)


def quiet_trainer(
    strategy: Any,
    root: str,
    *,
    devices: int = 2,
    max_epochs: int | None = 1,
    callbacks: Sequence[Callback] = (),
    accelerator: str = "cpu",
    **options: Any,
) -> Trainer:
    """A Trainer on ``devices`` processes that does nothing but fit: no logger, no checkpoints, no
    progress bar, no model summary (what the memory and timing runs measure is the strategy's);
    ``options``: any other Trainer argument (``precision``, ``max_steps``, ...), these included."""
    quiet = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=devices,
        max_epochs=max_epochs,
        default_root_dir=str(root),
        callbacks=list(callbacks),
        **{**quiet, **options},
    )
