"""A random training program, as people write them for ``ddp``: the model, the LightningModule and
its callbacks, all switched by one :class:`Program`.

The fuzzer (``test_fuzz.py``) draws programs and fits each at zero0-3 on two ranks and once in one
process with plain Lightning (the reference, taking both ranks' samples in each batch, in the order
Lightning's DistributedSampler deals them). :func:`fit` returns what the program's own code saw: the
parameters after fit (``model.state_dict()``), each micro-batch's loss, what its callbacks read from
the parameters at rest (an EMA copy, norms, a parameter count) and what its ``on_save_checkpoint``
hook found and wrote.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from tests.matrix.lit import BATCH, DIM, HIDDEN, VOCAB, WORLD, Shuffled, Tokens

MICRO_BATCHES = 4  # per rank and epoch


class Program(NamedTuple):
    """One drawn program. Model: ``blocks`` wrap units between a root embedding, gain and head."""

    blocks: int = 2  # 1-3 Block units
    tie: str = "none"  # none | root (head.weight is emb.weight) | across (two blocks share fc2.weight)
    twice: bool = False  # the first block is called twice per forward
    kwargs: bool = False  # blocks are called with keyword arguments, block(x=h)
    adapter: bool = False  # the first block: frozen fc1 plus a trainable adapter beside it
    checkpointing: str = "none"  # activation checkpointing of the blocks: none | nonreentrant | reentrant
    captured: bool = False  # the checkpointed function uses the root's gain, not passed as an input
    unused: bool = False  # a branch no rank uses (find_unused_parameters)
    manual: int = 0  # 0: automatic optimization; 1-3: manual, that many optimizer steps per batch
    accumulate: int = 1  # micro-batches per step (automatic)
    clip: float | None = None  # gradient_clip_val (automatic)
    penalty: float = 0.0  # L2 penalty over self.parameters() added in training_step
    optimizer: str = "sgd"  # sgd (momentum, weight decay) | adamw
    ema: bool = False  # a callback keeping an EMA of every parameter and logging their norms
    save_hook: bool = False  # on_save_checkpoint casts a copy of checkpoint["state_dict"] to half
    backward_error: bool = False  # manual: the first backward raises inside, is caught, training goes on
    lightning_callbacks: bool = False  # Lightning's own: ModelSummary, EMAWeightAveraging, ModelCheckpoint
    sharded_checkpoint: bool = False  # state_dict_type="sharded" (consolidated to compare)
    validate: bool = False  # a validation loop every 2 batches (EMAWeightAveraging swaps weights in)
    precision: str = "32-true"  # Lightning's flag: 32-true | bf16-mixed
    zero3: str = "default"  # stage 3's options: default | no_prefetch | keep_after_forward | unsharded_accumulation | sharded_after_fit

    @property
    def name(self) -> str:
        base = Program()
        return ",".join(f"{k}={v}" for k, v in self._asdict().items() if v != getattr(base, k)) or "default"


class Boom(RuntimeError):
    """Raised inside backward on purpose."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise Boom("raised inside backward on purpose")


class Block(nn.Module):
    """LayerNorm -> MLP with a residual: the stage-3 wrap unit."""

    def __init__(self, adapter: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.adapter = nn.Linear(DIM, HIDDEN, bias=False) if adapter else None
        if adapter:
            self.fc1.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        h = self.norm(x)
        hidden = self.fc1(h) if self.adapter is None else self.fc1(h) + self.adapter(h)
        return x + self.fc2(F.gelu(hidden))


class Net(nn.Module):
    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program
        self.emb = nn.Embedding(VOCAB, DIM)
        self.gain = nn.Parameter(torch.ones(DIM) + 0.1 * torch.randn(DIM))  # a root parameter
        self.blocks = nn.ModuleList(Block(adapter=program.adapter and i == 0) for i in range(program.blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.spare = nn.Linear(DIM, DIM) if program.unused else None  # never used in forward
        if program.tie == "root":
            self.head.weight = self.emb.weight
        elif program.tie == "across" and program.blocks > 1:
            self.blocks[-1].fc2.weight = self.blocks[0].fc2.weight

    def _block(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        out = block(x=x) if self.program.kwargs else block(x)
        return out * self.gain if self.program.captured else out

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, *, boom: bool = False) -> torch.Tensor:
        x = self.emb(tokens)  # (B, T, C)
        calls = [self.blocks[0], *self.blocks] if self.program.twice else list(self.blocks)
        for i, block in enumerate(calls):
            mode = self.program.checkpointing
            if mode == "none":
                x = self._block(block, x)
            else:
                x = checkpoint(self._block, block, x, use_reentrant=mode == "reentrant")
            if boom and i == len(calls) // 2:
                x = _RaiseInBackward.apply(x)
        x = x if self.program.captured else x * self.gain
        logits = self.head(self.norm(x))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class ProgramModule(LightningModule):
    """Trains ``Net(program)`` as the program says. ``per_rank``: samples per micro-batch (the
    reference takes every rank's)."""

    def __init__(self, program: Program, per_rank: int = BATCH) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.program = program
        self.per_rank = per_rank
        self.net = Net(program)
        self.automatic_optimization = not program.manual
        self.losses: list[float] = []  # every micro-batch's loss (manual: every step's)
        self.saved_states: list[dict] = []  # what on_save_checkpoint found, as it found it
        self.val_losses: list[float] = []  # every validation batch's loss, this rank's

    def _loss(self, batch: Any, *, boom: bool = False) -> torch.Tensor:
        loss = self.net(*batch, boom=boom)
        self.losses.append(loss.detach().float().item())
        if self.program.penalty:
            penalty = sum(p.pow(2).sum() for p in self.parameters() if p.requires_grad)
            loss = loss + self.program.penalty * penalty
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self.program.manual:
            return self._loss(batch)
        opt = self.optimizers()
        if self.program.backward_error and batch_idx == 1:
            try:
                self.manual_backward(self._loss(batch, boom=True))
            except Boom:
                opt.zero_grad()
        loss = None
        for _ in range(self.program.manual):
            loss = self._loss(batch)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss  # returned, as people often do under manual optimization

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_losses.append(self.net(*batch).float().item())

    def val_dataloader(self):
        # unshuffled: rank r takes every N-th sample from r, the reference's batch is the union
        return DataLoader(Tokens(2 * BATCH * WORLD, seed=5), batch_size=self.per_rank)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.program.save_hook:
            state = checkpoint["state_dict"]
            checkpoint["export"] = {k: v.detach().half().clone() for k, v in state.items()}
            self.saved_states.append({k: v.detach().float().clone() for k, v in state.items()})

    def configure_optimizers(self):
        params = self.parameters()  # frozen ones included, as people write it
        if self.program.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=0.01)

    def train_dataloader(self):
        data = Tokens(MICRO_BATCHES * BATCH * WORLD)
        if self.per_rank == BATCH:  # distributed: Lightning shuffles with DistributedSampler(seed=0)
            return DataLoader(data, batch_size=BATCH)
        return DataLoader(data, batch_size=self.per_rank, sampler=Shuffled(len(data)))


class ReadsParameters(Callback):
    """What people's callbacks do with parameters at rest: count them when training starts, keep an
    EMA of them after every batch (``detach``, ``clone``, in-place ``mul_``/``add_``) and their norms."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.count = 0  # parameters, as ModelSummary counts them
        self.ema: dict[str, torch.Tensor] = {}
        self.norms: list[float] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.count = sum(p.numel() for p in pl_module.parameters())

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        with torch.no_grad():
            for name, p in pl_module.named_parameters():
                if name not in self.ema:
                    self.ema[name] = p.detach().clone()
                else:
                    self.ema[name].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)
            self.norms.append(torch.stack([p.norm() for p in pl_module.parameters()]).norm().item())


ZERO3_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "no_prefetch": {"prefetch": False},
    "keep_after_forward": {"reshard_after_forward": False},
    "unsharded_accumulation": {"accumulate_unsharded": True},
    "sharded_after_fit": {
        "gather_at_teardown": False
    },  # model.state_dict() after fit reads parameters at rest
}


class Outcome(NamedTuple):
    params: dict[str, torch.Tensor]  # model.state_dict() after fit, fp32 copies
    losses: list[float]  # this rank's, per forward
    count: int  # parameters counted by a callback at the start of training
    ema: dict[str, torch.Tensor]  # the callback's EMA after fit
    norms: list[float]  # the callback's global norm after every batch
    hook_states: list[dict]  # what on_save_checkpoint found in checkpoint["state_dict"]
    val_losses: list[float]  # this rank's validation losses
    saved: dict | None  # rank 0: the file trainer.save_checkpoint wrote after fit ("state_dict", "export")
    error: str | None  # the fit raised: type, message and traceback


def strategy_for(program: Program, stage: int) -> Any:
    from lightning_zero import ZeroStrategy

    options: dict[str, Any] = {"find_unused_parameters": program.unused}
    if program.sharded_checkpoint:
        options["state_dict_type"] = "sharded"
    if stage == 3:
        options["wrap_policy"] = "tests.fuzz.program.Block"
        options.update(ZERO3_OPTIONS[program.zero3])
    return ZeroStrategy(stage=stage, **options)


def fit(program: Program, stage: int | None, root: str) -> Outcome:
    """Fit ``program`` at ``stage`` on the ranks of the process group, or (None) in this process alone."""
    if stage is None and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return Outcome({}, [], 0, {}, [], [], [], None, None)
    model = ProgramModule(program, per_rank=BATCH if stage is not None else BATCH * WORLD)
    reader = ReadsParameters()
    automatic = not program.manual
    callbacks: list[Callback] = [reader] if program.ema else []
    if program.lightning_callbacks:
        callbacks += [
            EMAWeightAveraging(decay=0.7),
            ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=2, save_last=True),
        ]
    trainer = Trainer(
        strategy=strategy_for(program, stage) if stage is not None else "auto",
        accelerator="cpu",
        devices=WORLD if stage is not None else 1,
        max_epochs=1,
        precision=program.precision,
        limit_val_batches=None if program.validate else 0,
        val_check_interval=2 if program.validate else None,
        num_sanity_val_steps=0,
        accumulate_grad_batches=program.accumulate if automatic else 1,
        gradient_clip_val=program.clip if automatic else None,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=program.lightning_callbacks,
        enable_progress_bar=False,
        enable_model_summary=program.lightning_callbacks,
        default_root_dir=root,
    )
    try:
        trainer.fit(model)
        saved = _save_after_fit(trainer, root) if program.save_hook or program.lightning_callbacks else None
        params = {k: _whole(v.detach().float()) for k, v in model.state_dict().items()}
    except Exception as err:  # noqa: BLE001  (the test reports it)
        error = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        return Outcome({}, model.losses, 0, {}, [], [], [], None, error)
    ema = {k: _whole(v.float()) for k, v in reader.ema.items()}
    outcome = (params, model.losses, reader.count, ema, reader.norms, model.saved_states, model.val_losses)
    return Outcome(*outcome, saved, None)


def _save_after_fit(trainer: Trainer, root: str) -> dict | None:
    path = os.path.join(root, "after_fit.ckpt")
    trainer.save_checkpoint(path)
    if trainer.global_rank != 0:
        return None
    if os.path.isdir(path):  # the sharded form: compare its consolidated full file
        from lightning_zero.checkpoint import consolidate

        consolidate(path, path + ".full")
        path = path + ".full"
    saved = torch.load(path, weights_only=True)
    keys = ("state_dict", "export", "current_model_state")
    return {key: {k: v.float() for k, v in saved[key].items()} for key in keys if key in saved}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """What a program keeps of a tensor, whole: stage 3 leaves parameters (and what is made from
    them, an EMA) as DTensors, whose whole value every rank gathers together (``full_tensor()``)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
