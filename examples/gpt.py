"""A character-level GPT and the LightningModule that trains it.

The model is the classic decoder-only transformer: token + position embedding, a stack of
``Block`` (LayerNorm -> causal self-attention -> LayerNorm -> MLP, each with a residual), a final
LayerNorm and a linear head over the vocabulary. ``GPTLightning`` adds the loss, the logged
metrics, the AdamW parameter groups and the learning-rate schedule.

Train it with the Hydra app (2 CPU processes, ZeRO stage 0, the tiny model):

    python examples/train.py
    python examples/train.py model=gpt_small strategy.bucket_cap_mb=1
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics import MeanMetric


@dataclass
class GPTConfig:
    """Shape of the transformer.

    Args:
        vocab_size: number of distinct tokens; for the character corpus, the data module's
            ``vocab_size``.
        block_size: longest context the model attends over; inputs have T <= block_size.
        n_layer: number of ``Block`` in the stack.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: width C of the residual stream.
        dropout: dropout probability on attention weights, residual branches and embeddings.
        bias: whether Linear and LayerNorm layers carry a bias.
        tie_weights: share one tensor between the token embedding and the lm head.
    """

    vocab_size: int = 128  # tokens in the vocabulary (set from the data)
    block_size: int = 64  # maximum context length T
    n_layer: int = 2  # number of transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 64  # residual stream width C
    dropout: float = 0.0  # dropout probability (0 keeps a run deterministic and simple)
    bias: bool = True  # biases in Linear and LayerNorm layers
    tie_weights: bool = False  # lm_head.weight is wte.weight

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd must be a multiple of n_head, got n_embd={self.n_embd}, n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t attends only to positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head  # number of heads H
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # heads back to C
        self.resid_dropout = nn.Dropout(config.dropout)  # on the output projection
        self.dropout = config.dropout  # probability for the attention weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, hs)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide with GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)  # C -> 4C
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)  # 4C -> C
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """One transformer block (pre-LayerNorm): x + attn(ln(x)), then x + mlp(ln(x)).

    This is the unit a wrap policy shards as one piece at ZeRO stage 3.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """Embeddings, ``config.n_layer`` blocks, final LayerNorm and the lm head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding (V, C)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding (T_max, C)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # (V, C) weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections: keep the stream's variance flat
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight  # one Parameter, two uses

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids (B, T) to next-token logits (B, T, V)."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def optim_groups(self, weight_decay: float) -> list[dict]:
        """Two AdamW groups: weight decay on the matrices of Linear layers, none elsewhere.

        Biases, LayerNorm gains and embedding tables (including a tied lm head, which is the
        token embedding) are not decayed. Every trainable parameter is in exactly one group.
        """
        embedding_ids = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        decay, no_decay = [], []
        for p in self.parameters():  # parameters() yields a shared (tied) tensor once
            if not p.requires_grad:
                continue
            if p.dim() >= 2 and id(p) not in embedding_ids:
                decay.append(p)
            else:
                no_decay.append(p)
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend ``idx`` (B, T) by ``max_new_tokens`` tokens, returning (B, T + max_new_tokens).

        ``temperature == 0`` picks the most likely token; otherwise tokens are sampled (from the
        ``top_k`` most likely ones if given) with ``generator``, so a seeded generator repeats.
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]  # (B, <=block_size)
            logits = self(context)[:, -1, :]  # (B, V)
            idx_next = _next_token(logits, temperature, top_k, generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)  # (B, T + 1)
        return idx


def _next_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """Pick one token per row of ``logits`` (B, V); returns (B, 1)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)  # (B, V)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def lr_lambda(step: int, *, warmup_steps: int, decay_steps: int, min_lr_ratio: float, schedule: str) -> float:
    """Multiplier of the peak learning rate at ``step``: linear warmup, then cosine or linear decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or decay_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (decay_steps - warmup_steps))  # 0 -> 1
    if schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0
    else:  # linear
        shape = 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class GPTLightning(L.LightningModule):
    """Next-character language modelling with :class:`GPT`.

    Args:
        config: the model shape; alternatively pass GPTConfig fields as keyword arguments.
        lr: peak learning rate of AdamW.
        weight_decay: decoupled weight decay of the decayed group (see ``GPT.optim_groups``).
        betas: AdamW betas.
        warmup_steps: optimizer steps of linear warmup from ``lr / warmup_steps`` to ``lr``.
        schedule: "cosine", "linear" or "constant" after warmup.
        decay_steps: step at which the decay reaches ``min_lr_ratio * lr``; None uses the
            trainer's ``max_steps`` (constant if that is unset).
        min_lr_ratio: floor of the schedule as a fraction of ``lr``.
        predict_new_tokens: tokens ``predict_step`` appends to each prompt (greedy decoding).
        **config_fields: GPTConfig fields, used when ``config`` is None.
    """

    def __init__(
        self,
        config: GPTConfig | None = None,
        *,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 10,
        schedule: str = "cosine",
        decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        predict_new_tokens: int = 64,
        **config_fields,
    ) -> None:
        super().__init__()
        if config is not None and config_fields:
            raise TypeError(f"pass either config or its fields, not both; got {sorted(config_fields)}")
        config = config if config is not None else GPTConfig(**config_fields)
        if schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule must be 'cosine', 'linear' or 'constant', got {schedule!r}")
        betas = tuple(float(b) for b in betas)
        optim = {
            "lr": lr,
            "weight_decay": weight_decay,
            "betas": betas,
            "warmup_steps": warmup_steps,
            "schedule": schedule,
            "decay_steps": decay_steps,
            "min_lr_ratio": min_lr_ratio,
            "predict_new_tokens": predict_new_tokens,
        }
        # flat hyperparameters, so that load_from_checkpoint rebuilds the module from them
        self.save_hyperparameters({**dataclasses.asdict(config), **optim})
        self.config = config
        self.model = GPT(config)
        self.val_loss_metric = MeanMetric()  # mean validation loss over the epoch, all ranks

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)  # (B, T, V)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        logits = self(x)  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        self.val_loss_metric.update(loss)
        self.log("val_loss_metric", self.val_loss_metric, on_step=False, on_epoch=True)

    def predict_step(self, batch: torch.Tensor | Iterable[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Greedy continuation of the prompts: (B, T) ids -> (B, T + predict_new_tokens) ids."""
        prompt = batch if isinstance(batch, torch.Tensor) else next(iter(batch))  # (B, T)
        return self.model.generate(prompt, self.hparams.predict_new_tokens, temperature=0.0)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """See :meth:`GPT.generate`."""
        return self.model.generate(idx, max_new_tokens, **kwargs)

    def configure_optimizers(self):
        hp = self.hparams
        groups = self.model.optim_groups(hp.weight_decay)
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=hp.betas)
        decay_steps = hp.decay_steps
        if decay_steps is None:
            max_steps = self.trainer.max_steps if self._trainer is not None else -1
            decay_steps = max_steps if max_steps > 0 else 0  # 0: no decay, constant after warmup
        schedule = functools.partial(
            lr_lambda,
            warmup_steps=hp.warmup_steps,
            decay_steps=decay_steps,
            min_lr_ratio=hp.min_lr_ratio,
            schedule=hp.schedule,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
