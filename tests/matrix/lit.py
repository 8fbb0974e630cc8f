"""The LightningModule the matrix trains: a small stack of blocks, every way of training it switchable."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Sampler

VOCAB, DIM, HIDDEN, SEQ, BATCH = 32, 16, 48, 8, 4  # BATCH sequences per rank and micro-batch
MICRO_BATCHES = 6  # per epoch and rank
WORLD = 2  # ranks of the distributed runs


class Case(NamedTuple):
    """One way of training; the matrix combines them."""

    precision: str = "32-true"  # Lightning's flag: 32-true | bf16-mixed | bf16-true
    accumulate: int = 1  # micro-batches per optimizer step
    checkpointing: str = "none"  # activation checkpointing of the blocks: none | nonreentrant | reentrant
    prefetch: bool = True  # stage 3
    manual: bool = False  # manual optimization with two backward passes per micro-batch
    clip: float | None = None  # gradient_clip_val (by norm)
    frozen: bool = False  # a frozen block layer (in the optimizer's params, as people write it)
    unused: bool = False  # a parameter no rank uses, with weight decay (find_unused_parameters)
    optimizer: str = "sgd"  # sgd (momentum, weight decay) | adamw
    compile: str = (
        "none"  # torch.compile (aot_eager): none | blocks (each) | net | module (the LightningModule)
    )
    quantize: bool = False  # stage 3: int8 weights and gradients on the wire (docs/quantized.md)

    @property
    def name(self) -> str:
        parts = [self.precision, f"acc{self.accumulate}", f"ac-{self.checkpointing}"]
        parts += [] if self.prefetch else ["noprefetch"]
        parts += ["manual"] if self.manual else []
        parts += [f"clip{self.clip}"] if self.clip else []
        parts += [k for k in ("frozen", "unused") if getattr(self, k)]
        parts += [self.optimizer] if self.optimizer != "sgd" else []
        parts += [f"compile-{self.compile}"] if self.compile != "none" else []
        parts += ["int8"] if self.quantize else []
        return "-".join(parts)


class Block(nn.Module):
    """LayerNorm -> MLP with a residual: the stage-3 wrap unit."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.spare = nn.Linear(DIM, DIM) if case.unused else None  # never used in forward
        if case.frozen:
            self.blocks[1].fc1.requires_grad_(False)
        if case.compile == "blocks":
            for block in self.blocks:
                block.compile(backend="aot_eager")

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)  # (B, T, C)
        for block in self.blocks:
            if self.case.checkpointing == "none":
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.case.checkpointing == "reentrant")
        logits = self.head(self.norm(x))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class Tokens(Dataset):
    def __init__(self, n: int, seed: int = 11) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]


class Shuffled(Sampler):
    """The order DistributedSampler(shuffle=True, seed=0) draws each epoch, for one process."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it at every epoch, as for DistributedSampler
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


class MatrixModule(LightningModule):
    """Trains ``Net(case)``. The ranks share each global batch; the one-process reference takes
    ``per_rank = WORLD x BATCH`` in the order Lightning's DistributedSampler shuffles (seed 0 + epoch), of
    which rank r takes every N-th sample from r: so each reference batch is the union of the ranks'
    batches, and the union of the ranks' first halves is the first half of the reference's."""

    def __init__(self, case: Case, per_rank: int = BATCH) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.case = case
        self.per_rank = per_rank
        self.net = Net(case)
        if case.compile == "net":
            self.net.compile(backend="aot_eager")
        self.automatic_optimization = not case.manual
        self.losses: list[float] = []  # the loss of every micro-batch (the sum of both halves when manual)

    def training_step(self, batch, batch_idx):
        if self.case.manual:
            return self._manual_step(batch, batch_idx)
        loss = self.net(*batch)
        self.losses.append(loss.detach().float().item())
        return loss

    def _manual_step(self, batch, batch_idx):
        """Two losses, two backward passes (first and second half of each rank's batch), one step."""
        opt = self.optimizers()
        acc = self.case.accumulate
        sync = (batch_idx + 1) % acc == 0 or batch_idx + 1 == MICRO_BATCHES
        half = len(batch[0]) // 2
        total = 0.0
        with opt.toggle_model(sync_grad=sync):
            for part in (slice(0, half), slice(half, None)):
                loss = self.net(batch[0][part], batch[1][part]) / 2
                self.manual_backward(loss / acc)
                total += loss.detach().float().item()
        self.losses.append(total)
        if sync:
            if self.case.clip:
                self.clip_gradients(opt, gradient_clip_val=self.case.clip, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        params = self.parameters()  # frozen ones included, as people write it
        if self.case.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.01)

    def train_dataloader(self):
        data = Tokens(MICRO_BATCHES * BATCH * WORLD)
        if self.per_rank == BATCH:  # distributed: Lightning shuffles with DistributedSampler(seed=0)
            return DataLoader(data, batch_size=BATCH)
        return DataLoader(data, batch_size=self.per_rank, sampler=Shuffled(len(data)))  # the same order
