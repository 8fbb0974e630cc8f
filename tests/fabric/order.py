"""What the ranks run for the tests of litgpt's order: the model set up alone, its optimizer made from
``model.parameters()`` afterwards, checkpoints under the user's keys.

The order, as litgpt's ``finetune/full.py`` writes it::

    with fabric.init_module(empty_init=True):
        model = GPT(config)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), ...)
    optimizer = fabric.setup_optimizers(optimizer)
    fabric.load_raw(checkpoint_path, model)  # litgpt's load_checkpoint: the pretrained weights

Every run loads the same initial weights (written by rank 0 from a normal build, seed 0), so Fabric's
``ddp`` (whose ``empty_init`` leaves memory as it was) and every stage start from the same values.
Rank r takes block r of each step's ``WORLD x BATCH`` sequences of a fixed token set.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

import lightning_zero  # noqa: F401  (registers zero0..zero3 for Fabric)
from lightning_zero.fabric import ZeroFabricStrategy as ZeroStrategy
from tests.fabric.jobs import _guard, _raised
from tests.matrix.lit import DIM, Block

WORLD = 2  # ranks
BATCH = 2  # sequences per rank and step
SEQ = 16  # tokens per sequence
VOCAB = 96  # token ids
STEPS = 4  # optimizer steps of a run
SAVE_AT = 2  # the checkpoint is taken after this many steps
MATRIX_BLOCK = "tests.matrix.lit.Block"  # stage 3's wrap unit of the matrix model
LITGPT_BLOCK = "litgpt.model.Block"  # ... of litgpt's GPT


class Run(NamedTuple):
    """One run in litgpt's order."""

    model: str = "matrix"  # matrix (tests/matrix/lit.py's net) | litgpt (litgpt.model.GPT)
    stage: int | None = 3  # None: Fabric's ddp
    form: str = "full"  # state_dict_type of the save
    precision: str = "32-true"  # Fabric's flag
    together: bool = False  # the reference order instead: fabric.setup(model, optimizer)
    load_first: bool = False  # fabric.load_raw of the initial weights before the optimizer exists

    @property
    def name(self) -> str:
        stage = "ddp" if self.stage is None else f"zero{self.stage}"
        flags = "".join(f"-{k}" for k in ("together", "load_first") if getattr(self, k))
        return f"{self.model}-{stage}-{self.form}-{self.precision}{flags}"


def litgpt_config() -> Any:
    """A small llama-shaped litgpt config: RMSNorm, LLaMAMLP, grouped queries, rotary embeddings."""
    from litgpt.config import Config

    return Config(
        block_size=SEQ,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=32,
        intermediate_size=64,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        parallel_residual=False,
        rotary_percentage=1.0,
    )


class TinyLM(nn.Module):
    """Tokens -> logits, called as litgpt calls GPT: an embedding, the matrix's blocks (stage 3's wrap
    units), a norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.emb(tokens)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(kind: str) -> nn.Module:
    if kind == "litgpt":
        from litgpt.model import GPT

        return GPT(litgpt_config())
    return TinyLM()


def tokens(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (BATCH, SEQ) inputs and targets of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = torch.randint(0, VOCAB, (WORLD * BATCH, SEQ + 1), generator=g)[rank * BATCH : (rank + 1) * BATCH]
    return rows[:, :-1], rows[:, 1:]


def loss_of(kind: str, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if kind == "litgpt":
        from litgpt.utils import chunked_cross_entropy

        return chunked_cross_entropy(logits, targets)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_fabric(run: Run) -> L.Fabric:
    if run.stage is None:
        strategy: Any = "ddp"
    else:
        options: dict[str, Any] = {"state_dict_type": run.form}
        if run.stage == 3:
            options["wrap_policy"] = LITGPT_BLOCK if run.model == "litgpt" else MATRIX_BLOCK
        strategy = ZeroStrategy(stage=run.stage, **options)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD, precision=run.precision)
    fabric.launch()
    return fabric


def initial_weights(fabric: L.Fabric, kind: str, root: str) -> str:
    """Rank 0 writes the model's state dict from a normal build (seed 0), once per kind."""
    path = os.path.join(root, f"init-{kind}.pt")
    if fabric.global_rank == 0 and not os.path.exists(path):
        torch.manual_seed(0)
        torch.save(build(kind).state_dict(), path)
    fabric.barrier()
    return path


def set_up(fabric: L.Fabric, run: Run, root: str) -> tuple[Any, Any]:
    """litgpt's order (see the module docstring), or the model and optimizer set up together."""
    init = initial_weights(fabric, run.model, root)
    with fabric.init_module(empty_init=True):
        model = build(run.model)
    if run.together:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, optimizer = fabric.setup(model, optimizer)
        fabric.load_raw(init, model)
        return model, optimizer
    model = fabric.setup(model)
    if run.load_first:
        fabric.load_raw(init, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = fabric.setup_optimizers(optimizer)
    if not run.load_first:
        fabric.load_raw(init, model)
    return model, optimizer


def train(fabric: L.Fabric, run: Run, model: Any, optimizer: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = tokens(step, fabric.global_rank)
        loss = loss_of(run.model, model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def whole(fabric: L.Fabric, model: Any) -> dict[str, torch.Tensor]:
    """The model's state dict, fp32 copies (this package's strategies gather stage 3's shards)."""
    if isinstance(fabric.strategy, ZeroStrategy):
        state = fabric.strategy.full_state_dict(rank0_only=False)
    else:
        state = model.state_dict()
    return {k: v.detach().float().clone() for k, v in state.items()}


@_guard
def fit(run: Run, path: str, root: str) -> dict[str, Any]:
    """STEPS steps in litgpt's order; after SAVE_AT, ``fabric.save(path, {"model", "optimizer",
    "iter_num"})``."""
    fabric = make_fabric(run)
    model, optimizer = set_up(fabric, run, root)
    losses = train(fabric, run, model, optimizer, range(SAVE_AT))
    ledger = getattr(fabric.strategy, "ledger", None)
    before = ledger.recorded if ledger is not None else 0
    fabric.save(path, {"model": model, "optimizer": optimizer, "iter_num": SAVE_AT})
    save_ops = [(r.op, r.name, r.payload_bytes) for r in ledger.records_since(before)] if ledger else []
    saved = whole(fabric, model)
    losses += train(fabric, run, model, optimizer, range(SAVE_AT, STEPS))
    return {
        "saved": saved,
        "params": whole(fabric, model),
        "losses": losses,
        "save_ops": save_ops,
        "space_bytes": _space_bytes(fabric),
    }


def _space_bytes(fabric: L.Fabric) -> list[int]:
    """The padded size in bytes of each flat space that holds parameter values (stages 1-3)."""
    engine = getattr(fabric.strategy, "engine", None)
    spaces = engine.param_spaces() if engine is not None else []
    return [s.padded_numel * s.shard.element_size() for s in spaces]


@_guard
def resume(run: Run, path: str, root: str) -> dict[str, Any]:
    """A fresh run in litgpt's order loads ``path`` (``fabric.load(path, state)``, as litgpt resumes)
    and trains from ``iter_num`` to STEPS."""
    fabric = make_fabric(run)
    model, optimizer = set_up(fabric, run, root)
    state = {"model": model, "optimizer": optimizer, "iter_num": 0}
    remainder = fabric.load(path, state)
    loaded = whole(fabric, model)
    train(fabric, run, model, optimizer, range(state["iter_num"], STEPS))
    return {
        "iter_num": state["iter_num"],
        "remainder": sorted(remainder),
        "loaded": loaded,
        "params": whole(fabric, model),
    }


@_guard
def trainer_layout(source: str, path: str, root: str) -> dict[str, Any]:
    """Rank 0 rewrites the ddp file ``source`` in the layout Fabric files had before they kept the
    user's keys (the Trainer's ``state_dict`` / ``optimizer_states`` and the record of keys)."""
    if torch.distributed.get_rank() == 0:
        ddp = torch.load(source, weights_only=True)
        torch.save(
            {
                "state_dict": ddp["model"],
                "optimizer_states": [ddp["optimizer"]],
                "lr_schedulers": [],
                "iter_num": ddp["iter_num"],
                "pytorch-lightning_version": L.__version__,
                "lightning_zero_fabric": {"model": "model", "optimizers": ["optimizer"], "lr_schedulers": []},
            },
            path,
        )
    torch.distributed.barrier()
    return {}


@_guard
def as_trainer_file(source: str, path: str, root: str) -> dict[str, Any]:
    """Rank 0 writes the entries of the Fabric file ``source`` (``{"model", "optimizer", "step"}``,
    as tests/fabric/jobs.py saves) where Lightning's own Trainer reads them, for its DDP to resume."""
    if torch.distributed.get_rank() == 0:
        saved = torch.load(source, weights_only=True)
        torch.save(
            {
                "state_dict": saved["model"],
                "optimizer_states": [saved["optimizer"]],
                "lr_schedulers": [],
                "step": saved["step"],
                "pytorch-lightning_version": L.__version__,
            },
            path,
        )
    torch.distributed.barrier()
    return {}


@_guard
def misuse(root: str) -> dict[str, Any]:
    """What an optimizer set up after its model says when it cannot be laid onto the shards."""
    run = Run()
    fabric = make_fabric(run)
    with fabric.init_module(empty_init=True):
        model = build(run.model)
    model = fabric.setup(model)
    stranger = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    out = {"foreign": _raised(lambda: fabric.setup_optimizers(stranger))}
    weights = f"{root}/weights.ckpt"
    fabric.save(weights, {"model": model})  # saving and loading weights leave the optimizers open
    fabric.load(weights, {"model": model})
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    out["after a load"] = _raised(lambda: fabric.setup_optimizers(mine))
    out["twice"] = _raised(lambda: fabric.setup_optimizers(mine))
    x, y = tokens(0, fabric.global_rank)
    fabric.backward(loss_of(run.model, model(x), y))  # training begins: the optimizers are closed
    out["late"] = _raised(lambda: fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1)))
    return out
