"""Small models and data shared by the distributed tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, SEQ, BATCH = 32, 16, 48, 8, 4  # per-rank micro-batch of BATCH sequences


class TinyLM(nn.Module):
    """Embedding -> MLP block -> head; optional tied head, frozen layer, unused layers, a buffer."""

    def __init__(self, *, tied: bool = False, frozen: bool = False, unused: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("seen", torch.zeros(()))  # counts forwards; broadcast like DDP does
        if tied:
            self.head.weight = self.emb.weight
        if frozen:
            self.fc1.requires_grad_(False)
        self.extra = nn.Linear(DIM, DIM) if unused else None  # never used in forward
        self.side = nn.Linear(DIM, DIM) if unused else None  # used only when use_side=True

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, use_side: bool = False) -> torch.Tensor:
        self.seen += 1
        x = self.emb(tokens)  # (B, T, C)
        x = x + self.fc2(F.gelu(self.fc1(x)))
        if use_side and self.side is not None:
            x = x + self.side(x)
        logits = self.head(self.norm(x))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build(seed: int, **kwargs: bool) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def global_batches(num: int, world_size: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num`` global micro-batches of ``world_size * BATCH`` sequences (rank r takes slice r)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (num, world_size * BATCH, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def rank_slice(batch: tuple[torch.Tensor, torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = batch
    return tokens[rank * BATCH : (rank + 1) * BATCH], targets[rank * BATCH : (rank + 1) * BATCH]


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


def sync_points(num_micro: int, accumulate: int) -> list[bool]:
    """Lightning's rule: step every ``accumulate`` micro-batches and at the end of the epoch."""
    return [(i + 1) % accumulate == 0 or i + 1 == num_micro for i in range(num_micro)]


class Block(nn.Module):
    """LayerNorm -> MLP with a residual: a unit for the stage-3 tests."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyStack(nn.Module):
    """Embedding -> 3 Blocks -> LayerNorm -> head (optionally tied to the embedding, frozen block)."""

    def __init__(self, *, tied: bool = False, frozen: bool = False, blocks: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        if frozen:
            self.blocks[0].fc1.requires_grad_(False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build_stack(seed: int, **kwargs: bool) -> TinyStack:
    torch.manual_seed(seed)
    return TinyStack(**kwargs)
