"""What the ranks run for tests/fabric: hand-written Fabric loops, checkpoints, and Trainer fits.

Every job is a picklable callable of a scratch folder (tests/matrix/runner.py's ``run_jobs`` runs
them in turn in one pair of processes sharing one process group). A Fabric job builds its own
``L.Fabric``; ``fabric.launch()`` finds the processes and the group there already (``LOCAL_RANK``
is set, as under torchrun), exactly as in a script launched by ``torchrun``.

The loop: ``MICRO_BATCHES`` micro-batches of ``WORLD x BATCH`` sequences; micro-batch j is samples
[j*G, (j+1)*G) of a fixed token set (G = WORLD x BATCH), rank r taking its r-th block of BATCH. Every
strategy sees the same samples in the same order, so Fabric's DDP and every stage compute the same
mean gradient.
"""

from __future__ import annotations

import functools
import traceback
from collections import Counter
from typing import Any, NamedTuple

import lightning as L
import torch
from lightning.pytorch import Callback, Trainer

import lightning_zero  # noqa: F401  (registers zero0..zero3 for the Trainer and for Fabric)
from lightning_zero import ZeroStrategy as TrainerZeroStrategy
from lightning_zero.fabric import ZeroFabricStrategy as ZeroStrategy
from lightning_zero.zero.dtensor import local_of
from tests.matrix.lit import BATCH, MICRO_BATCHES, WORLD, Case, MatrixModule, Tokens

BLOCK = "tests.matrix.lit.Block"
DATA = Tokens(MICRO_BATCHES * BATCH * WORLD).data  # (48, SEQ + 1) token ids, the same on every rank


class FabricNet(MatrixModule):
    """The matrix's LightningModule (same parameter names as in a Trainer checkpoint) with a forward
    that Fabric calls: (tokens, targets) -> mean cross-entropy."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.net(tokens, targets)


class Loop(NamedTuple):
    """One way of writing the Fabric training loop."""

    precision: str = "32-true"  # Fabric's flag
    accumulate: int = 1  # micro-batches per optimizer step (no_backward_sync on the others)
    checkpointing: str = "none"  # activation checkpointing of the blocks: none | nonreentrant | reentrant
    clip: tuple[str, float] | None = None  # ("norm", max_norm) | ("value", clip_val)
    halves: bool = False  # two forward/backward passes per micro-batch, both synchronised
    apart: bool = False  # fabric.setup_module, then fabric.setup_optimizers (instead of fabric.setup)
    optimizer: str = "sgd"  # sgd (momentum, weight decay) | adamw

    @property
    def name(self) -> str:
        parts = [self.precision, f"acc{self.accumulate}", f"ac-{self.checkpointing}"]
        parts += [f"clip-{self.clip[0]}{self.clip[1]}"] if self.clip else []
        parts += [k for k in ("halves", "apart") if getattr(self, k)]
        parts += [self.optimizer] if self.optimizer != "sgd" else []
        return "-".join(parts)


def batch(j: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of micro-batch ``j``: (BATCH, SEQ) tokens and targets."""
    start = j * BATCH * WORLD + rank * BATCH
    rows = DATA[start : start + BATCH]
    return rows[:, :-1], rows[:, 1:]


def strategy(stage: int | None, **options: Any) -> Any:
    """Fabric's ``ddp`` (stage None) or this package's strategy; stage 3 with one unit per block."""
    if stage is None:
        return "ddp"
    if stage == 3:
        options.setdefault("wrap_policy", BLOCK)
    return ZeroStrategy(stage=stage, **options)


def make_fabric(stage: int | None, precision: str = "32-true", **options: Any) -> L.Fabric:
    fabric = L.Fabric(
        strategy=strategy(stage, **options), accelerator="cpu", devices=WORLD, precision=precision
    )
    fabric.launch()
    return fabric


def make_optimizer(params: Any, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.01)


def set_up(fabric: L.Fabric, loop: Loop, *, perturb: bool = False) -> tuple[Any, Any]:
    """The model and optimizer, set up together or apart; ``perturb`` moves every parameter (a
    checkpoint loaded later must bring them back)."""
    model = FabricNet(Case(precision=loop.precision, checkpointing=loop.checkpointing))
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    if loop.apart:
        model = fabric.setup_module(model)
        return model, fabric.setup_optimizers(make_optimizer(model.parameters(), loop.optimizer))
    return fabric.setup(model, make_optimizer(model.parameters(), loop.optimizer))


def train(
    fabric: L.Fabric, model: Any, optimizer: Any, loop: Loop, micro: range, inside: Counter
) -> list[float]:
    """The hand-written loop over micro-batches ``micro``; ``inside`` counts the collectives issued
    inside ``no_backward_sync`` (this package's strategies). Returns this rank's loss per micro-batch."""
    ledger = getattr(fabric.strategy, "ledger", None)
    losses = []
    for j in micro:
        tokens, targets = batch(j, fabric.global_rank)
        stepping = (j + 1) % loop.accumulate == 0
        parts = (slice(0, BATCH // 2), slice(BATCH // 2, None)) if loop.halves else (slice(None),)
        before = ledger.recorded if ledger is not None else 0
        total = 0.0
        with fabric.no_backward_sync(model, enabled=not stepping):
            for part in parts:
                loss = model(tokens[part], targets[part]) / len(parts)
                fabric.backward(loss / loop.accumulate)
                total += loss.item()
        if ledger is not None and not stepping:
            inside.update(r.op for r in ledger.records_since(before))
        losses.append(total)
        if stepping:
            _clip(fabric, model, optimizer, loop.clip)
            optimizer.step()
            optimizer.zero_grad()
    return losses


def _clip(fabric: L.Fabric, model: Any, optimizer: Any, clip: tuple[str, float] | None) -> None:
    if clip is None:
        return
    kind, value = clip
    if kind == "norm":
        fabric.clip_gradients(model, optimizer, max_norm=value)
    else:
        fabric.clip_gradients(model, optimizer, clip_val=value)


def full_params(fabric: L.Fabric, model: Any) -> dict[str, torch.Tensor]:
    """The whole parameters, fp32 copies, on every rank (this package's strategies gather stage 3's
    shards)."""
    if isinstance(fabric.strategy, ZeroStrategy):
        state = fabric.strategy.full_state_dict(rank0_only=False)
    else:
        state = model.state_dict()
    return {k: v.detach().float().clone() for k, v in state.items()}


def _guard(fn):
    """A job's exception becomes its result's ``error`` (the test reports it)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return {"error": None, **fn(*args, **kwargs)}
        except Exception as err:  # noqa: BLE001
            return {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}

    return run


# -- parity against Fabric's DDP -------------------------------------------------------------------


@_guard
def fit(loop: Loop, stage: int | None, root: str, **options: Any) -> dict[str, Any]:
    """One run of ``loop`` over every micro-batch."""
    fabric = make_fabric(stage, loop.precision, **options)
    model, optimizer = set_up(fabric, loop)
    inside: Counter = Counter()
    losses = train(fabric, model, optimizer, loop, range(MICRO_BATCHES), inside)
    return {"params": full_params(fabric, model), "losses": losses, "inside": dict(inside)}


# -- saving and loading mid-run --------------------------------------------------------------------

HALF = MICRO_BATCHES // 2  # the checkpoint is taken after this many micro-batches


@_guard
def save_midway(loop: Loop, stage: int | None, form: str, path: str, root: str) -> dict[str, Any]:
    """Train to HALF, save to ``path`` (``form``: full | sharded; Fabric's DDP writes its own
    format), train on to the end."""
    options = {"state_dict_type": form} if stage is not None else {}
    fabric = make_fabric(stage, loop.precision, **options)
    model, optimizer = set_up(fabric, loop)
    train(fabric, model, optimizer, loop, range(HALF), Counter())
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": HALF})
    saved = full_params(fabric, model)
    train(fabric, model, optimizer, loop, range(HALF, MICRO_BATCHES), Counter())
    return {"saved": saved, "params": full_params(fabric, model)}


@_guard
def resume(loop: Loop, stage: int, path: str, root: str) -> dict[str, Any]:
    """A model created under ``fabric.init_module(empty_init=True)`` and moved away from the run's
    start, loaded from ``path``, trained from HALF to the end."""
    fabric = make_fabric(stage, loop.precision)
    with fabric.init_module(empty_init=True):
        model = FabricNet(Case(precision=loop.precision, checkpointing=loop.checkpointing))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.25)
    optimizer = make_optimizer(model.parameters(), loop.optimizer)
    model, optimizer = fabric.setup(model, optimizer)
    model_only = sorted(fabric.load(path, {"model": model}))  # what is not asked for comes back
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(path, state)
    loaded = full_params(fabric, model)
    train(fabric, model, optimizer, loop, range(state["step"], MICRO_BATCHES), Counter())
    return {
        "step": state["step"],
        "remainder": sorted(remainder),
        "model_only": model_only,
        "loaded": loaded,
        "params": full_params(fabric, model),
    }


# -- the Trainer and Fabric on one checkpoint ------------------------------------------------------


class _SaveAtEnd(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


def _trainer(strategy: Any, steps: int, callbacks: list, root: str) -> Trainer:
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=WORLD,
        max_steps=steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
    )


@_guard
def trainer_save(stage: int, form: str, path: str, root: str) -> dict[str, Any]:
    """The Trainer fits HALF steps with this package's strategy and saves a checkpoint (``form``)."""
    options = {"wrap_policy": BLOCK} if stage == 3 else {}
    strategy = TrainerZeroStrategy(stage=stage, state_dict_type=form, **options)
    _trainer(strategy, HALF, [_SaveAtEnd(path)], root).fit(MatrixModule(Case()))
    return {}


@_guard
def fabric_continue(stage: int | None, path: str, root: str) -> dict[str, Any]:
    """Fabric loads a Trainer checkpoint and trains HALF micro-batches more. Fabric's DDP (stage
    None), the reference, takes the full file's entries into the model and optimizer before setup."""
    loop = Loop()
    fabric = make_fabric(stage)
    model = FabricNet(Case())
    optimizer = make_optimizer(model.parameters(), loop.optimizer)
    if stage is None:
        checkpoint = torch.load(path, weights_only=False)
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        model, optimizer = fabric.setup(model, optimizer)
        remainder: list[str] = []
    else:
        model, optimizer = fabric.setup(model, optimizer)
        remainder = sorted(fabric.load(path, {"model": model, "optimizer": optimizer}))
    train(fabric, model, optimizer, loop, range(HALF, MICRO_BATCHES), Counter())
    return {"params": full_params(fabric, model), "remainder": remainder}


@_guard
def trainer_resume(strategy: Any, path: str, root: str) -> dict[str, Any]:
    """The Trainer resumes a checkpoint Fabric wrote and fits HALF steps (its own data order)."""
    if isinstance(strategy, int):
        options = {"wrap_policy": BLOCK} if strategy == 3 else {}
        strategy = TrainerZeroStrategy(stage=strategy, **options)
    module = MatrixModule(Case())
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(0.25)  # the checkpoint must bring the values
    _trainer(strategy, HALF, [], root).fit(module, ckpt_path=path)
    return {"params": {n: p.detach().float().clone() for n, p in module.named_parameters()}}


# -- the rest of the strategy's surface ------------------------------------------------------------


@_guard
def surface(root: str) -> dict[str, Any]:
    """Fabric's collectives through the strategy; after a step, the memory report; a raw state dict
    (the untrained model's, written by torch.save) back in through ``fabric.load_raw``; stage 3's
    whole parameters inside ``gathered()``."""
    fabric = make_fabric(3)
    model, optimizer = set_up(fabric, Loop())
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum")
    mean = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)))
    sent = fabric.broadcast({"from": fabric.global_rank}, src=1)
    fabric.barrier()
    expected = FabricNet(Case())
    raw = f"{root}/raw.pt"
    if fabric.global_rank == 0:
        torch.save(expected.state_dict(), raw)
    fabric.barrier()
    train(fabric, model, optimizer, Loop(), range(1), Counter())
    report = fabric.strategy.memory_report()  # after a step: shards and SGD's momentum, no gradient
    trained = full_params(fabric, model)
    fabric.load_raw(raw, model)
    with fabric.strategy.gathered():
        shapes = {n: tuple(p.shape) for n, p in model.module.named_parameters()}
        whole = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {
        "memory": tuple(report),
        "numel": sum(p.numel() for p in expected.parameters()),
        "sum": total.item(),
        "mean": mean.item(),
        "broadcast": sent,
        "shapes_ok": shapes == {n: tuple(p.shape) for n, p in expected.named_parameters()},
        "moved": max((trained[n] - p).abs().max().item() for n, p in expected.named_parameters()),
        "loaded": max((whole[n] - p).abs().max().item() for n, p in expected.named_parameters()),
    }


def _raised(fn: Any) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001  (the message is the result)
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


@_guard
def misuse(root: str) -> dict[str, Any]:
    """What each unsupported use says (every rank raises the same, before any collective)."""
    out = {}
    fabric = make_fabric(3)
    model = fabric.setup_module(FabricNet(Case()))
    optimizer = fabric.setup_optimizers(make_optimizer(model.parameters(), "sgd"))
    fabric.backward(model(*batch(0, fabric.global_rank)))  # training begins: the set of optimizers closes
    late = make_optimizer(torch.nn.Linear(2, 2).parameters(), "sgd")
    out["late optimizer"] = _raised(lambda: fabric.setup_optimizers(late))
    out["second model"] = _raised(lambda: fabric.setup(FabricNet(Case())))
    out["norm type"] = _raised(lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0, norm_type="inf"))
    out["no model saved"] = _raised(lambda: fabric.save(f"{root}/x.ckpt", {"optimizer": optimizer}))
    two = make_fabric(1, state_dict_type="sharded")
    net = FabricNet(Case())
    first = make_optimizer([*net.net.emb.parameters(), *net.net.blocks.parameters()], "sgd")
    second = make_optimizer([*net.net.norm.parameters(), *net.net.head.parameters()], "sgd")
    net, first, second = two.setup(net, first, second)
    out["another Fabric's model"] = _raised(lambda: fabric.no_backward_sync(net, enabled=True))
    out["one of two optimizers"] = _raised(
        lambda: two.save(f"{root}/y.ckpt", {"model": net, "optimizer": first})
    )
    two.save(f"{root}/z.ckpt", {"model": net, "first": first, "second": second})
    out["sharded without state"] = _raised(lambda: two.load(f"{root}/z.ckpt"))
    out["key clash"] = _raised(lambda: two.save(f"{root}/w.ckpt", {"model": net, "state_dict": 1}))
    return out


@_guard
def fp16(stage: int, path: str, root: str) -> dict[str, Any]:
    """fp16 with loss scaling (``param_dtype="fp16"`` over ``"32-true"``: Fabric turns ``16-mixed``
    into bf16 on CPU). At micro-batch 2 rank 0's loss is multiplied by 1e6, so its fp16 gradients
    overflow: every rank must skip that step. The scale is saved and loaded back."""
    fabric = make_fabric(stage, param_dtype="fp16")
    model, optimizer = set_up(fabric, Loop())
    for j in range(MICRO_BATCHES):
        loss = model(*batch(j, fabric.global_rank))
        fabric.backward(loss * (1e6 if (j, fabric.global_rank) == (2, 0) else 1.0))
        fabric.clip_gradients(model, optimizer, max_norm=0.05)
        optimizer.step()
        optimizer.zero_grad()
    scaler = fabric.strategy.precision.scaler
    fabric.save(path, {"model": model, "optimizer": optimizer})
    scale = scaler.get_scale()
    scaler.update(1.0)  # another scale; the load brings the saved one back
    fabric.load(path, {"model": model, "optimizer": optimizer})
    return {
        "scaler": type(scaler).__name__,
        "scale": scale,
        "loaded_scale": scaler.get_scale(),
        "skipped": scaler.skipped_steps,
        "params": full_params(fabric, model),
    }


# -- clipping and the model's state dict ------------------------------------------------------------


@_guard
def clip_nonfinite(stage: int, root: str) -> dict[str, Any]:
    """A NaN put into one gradient on rank 0 before the reduction: ``clip_gradients`` raises on the
    non-finite norm, and the gradients the optimizer would step are as they were before the call."""
    fabric = make_fabric(stage)
    model, optimizer = set_up(fabric, Loop())
    weight = model.net.blocks[1].fc1.weight
    weight.register_hook(
        lambda g: g.index_fill(0, torch.tensor([0]), float("nan")) if fabric.global_rank == 0 else g
    )
    tokens, targets = batch(0, fabric.global_rank)
    fabric.backward(model(tokens, targets))
    stepped = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    before = [local_of(p.grad).clone() for p in stepped]
    try:
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        raised = None
    except RuntimeError as err:
        raised = str(err)
    after = [local_of(p.grad) for p in stepped]
    kept = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(before, after))
    optimizer.zero_grad()
    return {"raised": raised, "kept": kept, "nan_held": any(b.isnan().any().item() for b in before)}


@_guard
def module_state_dict(stage: int, root: str) -> dict[str, Any]:
    """``fabric.strategy.get_module_state_dict``: rank 0 gets the whole model, one flat space gathered
    at a time (the ledger's gathers: one per space, each of that space's size); the others ``{}``."""
    fabric = make_fabric(stage)
    model, optimizer = set_up(fabric, Loop())
    train(fabric, model, optimizer, Loop(), range(2), Counter())
    ledger = fabric.strategy.ledger
    before = ledger.recorded
    state = fabric.strategy.get_module_state_dict(model)
    gathers = [(r.op, r.payload_bytes) for r in ledger.records_since(before)]
    engine = fabric.strategy.engine
    spaces = [s.padded_numel * s.shard.element_size() for s in engine.param_spaces()]
    whole = fabric.strategy.full_state_dict(rank0_only=False)
    same = bool(state) and all(torch.equal(state[k], whole[k]) for k in whole)
    return {"gathers": gathers, "spaces": spaces, "keys": len(state), "same": same}
