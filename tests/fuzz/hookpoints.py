"""The hook-point fuzzer: user code at every position a LightningModule, a Callback or a Fabric
loop offers, run under a ZeRO stage and under ``ddp``, compared.

A :class:`HookProgram` is a position (a hook, or a place in ``training_step`` or in a Fabric loop)
times an operation people write there (read a norm, read or scale ``.grad``, ``detach().clone()``,
an EMA copy, scale a weight in place, a penalty over the parameters added to the loss, a no-grad
forward of the model or of one block, ``model.state_dict()``), times a stage, precision and glue.
Each program trains the matrix's small GPT-like stack (an embedding, three Block units, a head)
for a few steps; :func:`fit` returns what the program's own code saw (every value the operation
read) and the parameters after fit. ``ddp`` (Lightning's and Fabric's own) is the reference:
:func:`problems` lists where a stage differs from it. In fp32 the parameters must agree to 1e-6;
in bf16-mixed, within twice ddp's own bf16 spread (how far ddp-bf16 is from ddp-fp32 on the program),
and never tighter than the bf16 policy's own rounding (``BF16_FLOOR``).
"""

from __future__ import annotations

import functools
import math
import os
import random
import traceback
from typing import Any, NamedTuple

import lightning as L
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroStrategy
from lightning_zero.fabric import ZeroFabricStrategy
from tests.matrix.lit import BATCH, DIM, SEQ, VOCAB, Case, Net, Tokens
from tests.matrix.runner import run_jobs

BLOCK = "tests.matrix.lit.Block"
STEPS = 3  # optimizer steps per fit (on_load_checkpoint: 2, then 2 more after the resume)
TOL = 1e-6  # fp32: parameters against ddp
OBS_TOL = 1e-5  # fp32: what the program read, relative
# bf16-mixed: the stages compute with bf16 parameters (the package's policy: bf16 weights, fp32
# masters) where ddp autocasts fp32 ones, which moves results by up to about 1e-2 relative; a
# program must lie within max(2 x ddp's own bf16-against-fp32 spread, this) of ddp-bf16
BF16_FLOOR = 1e-2
# int8 communication rounds every gathered weight and reduced gradient: a program must lie within
# INT8_MARGIN x the distance from ddp of the same training without its operation (the rounding's
# own effect), and never tighter than INT8_FLOOR; with SGD that distance is small next to a lost
# update (under Adam a rounded gradient's sign moves a weight by the whole learning rate)
INT8_MARGIN = 4.0
INT8_FLOOR = 1e-4
INT8_READ = 1e-2  # what the program read (a norm of rounded gradients): relative, as BF16_FLOOR

TRAINER_POSITIONS = (
    "on_train_batch_start",
    "step_before_forward",
    "step_after_forward",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_validation_batch_end",
    "on_train_epoch_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
)
# a Fabric loop, and training_step under manual optimization (manual_backward, then the step)
LOOP_POSITIONS = ("before_forward", "after_forward", "after_backward", "after_step")
LOSS_POSITIONS = {"step_before_forward", "step_after_forward", "before_forward", "after_forward"}
OPERATIONS = (
    "norm",  # the sum of every parameter's norm
    "read_grad",  # how many parameters hold a gradient, the sum of their norms, Lightning's grad_norm
    "scale_grad",  # every gradient scaled by 0.5 in place
    "clone",  # detach().clone() of every parameter; the sum of the squares of the copies
    "ema",  # an EMA of every parameter (clone, then mul_/add_), kept to the end
    "scale_weight",  # every weight scaled by 0.999 in place, under no_grad
    "penalty",  # 1e-2 * sum(p.pow(2).sum()) added to the loss (positions with a loss only)
    "nograd_model",  # the whole model called under no_grad (a teacher); its loss
    "nograd_block",  # one block called under no_grad on a fixed input; the sum of its output
    "state_dict",  # model.state_dict(): the sum of the squares of its floating tensors
)


class HookProgram(NamedTuple):
    glue: str = "trainer"  # trainer | manual (the Trainer, manual optimization) | fabric
    stage: int = 3  # 1 | 2 | 3
    position: str = "on_before_optimizer_step"
    operation: str = "norm"
    precision: str = "32-true"  # 32-true | bf16-mixed
    hybrid: bool = False  # 4 ranks, shard_size=2 (2 ranks otherwise)
    optimizer: str = "sgd"  # sgd (momentum) | adamw
    secondary: bool = False  # stage 3 on 4 ranks, full sharding, secondary_shard_size=2 (hpZ)
    int8: bool = False  # quantize_grads, and at stage 3 quantize_weights (fp32, SGD; see INT8_FLOOR)

    @property
    def world(self) -> int:
        return 4 if self.hybrid or self.secondary else 2

    def options(self) -> dict[str, Any]:
        """The ZeroStrategy options of this program (Trainer and Fabric alike)."""
        options: dict[str, Any] = {"wrap_policy": BLOCK} if self.stage == 3 else {}
        if self.hybrid:
            options["shard_size"] = 2
        if self.secondary:
            options["secondary_shard_size"] = 2
        if self.int8:
            options.update(quantize_grads=True, quantize_weights=self.stage == 3)
        return options

    @property
    def name(self) -> str:
        parts = [self.glue, f"zero{self.stage}", self.position, self.operation, self.precision]
        parts += ["hybrid"] if self.hybrid else []
        parts += ["secondary"] if self.secondary else []
        parts += ["int8"] if self.int8 else []
        parts += [self.optimizer] if self.optimizer != "sgd" else []
        return ",".join(parts)


class Outcome(NamedTuple):
    params: dict[str, torch.Tensor]  # after fit, whole, fp32
    observed: list[float]  # every value the operation read, in order
    ema: dict[str, torch.Tensor]  # the EMA the operation kept (whole), or {}
    error: str | None  # the fit raised: its type and message
    secondary: int = 0  # backward all-gathers from secondary copies (the ledger's ``/secondary``)


def draw(
    rng: random.Random, *, hybrid: bool = False, secondary: bool = False, int8: bool = False
) -> HookProgram:
    """One program, uniformly over the valid combinations (a penalty needs a loss to add to);
    ``secondary``: stage 3 with secondary shards; ``int8``: int8 communication, fp32 and SGD."""
    glue = rng.choice(("trainer", "trainer", "manual", "fabric"))
    positions = TRAINER_POSITIONS if glue == "trainer" else LOOP_POSITIONS
    position = rng.choice(positions)
    operations = [op for op in OPERATIONS if op != "penalty" or position in LOSS_POSITIONS]
    operation = rng.choice(operations)
    precision = rng.choice(("32-true", "32-true", "bf16-mixed"))
    optimizer = rng.choice(("sgd", "sgd", "adamw")) if precision == "32-true" else "sgd"
    stage = 3 if secondary or (hybrid and rng.random() < 0.5) else rng.choice((1, 2, 3, 3))
    if int8:
        precision, optimizer = "32-true", "sgd"
    return HookProgram(glue, stage, position, operation, precision, hybrid, optimizer, secondary, int8)


def sample(
    count: int, seed: int, *, hybrid: bool = False, secondary: bool = False, int8: bool = False
) -> list[HookProgram]:
    rng = random.Random(seed)
    seen: dict[HookProgram, None] = {}
    while len(seen) < count:
        seen[draw(rng, hybrid=hybrid, secondary=secondary, int8=int8)] = None
    return list(seen)


# -- what the operations do ------------------------------------------------------------------------


class Operator:
    """Runs the program's operation on a model's parameters and keeps what it read."""

    def __init__(self, program: HookProgram) -> None:
        self.program = program
        self.observed: list[float] = []
        self.ema: dict[str, torch.Tensor] = {}
        g = torch.Generator().manual_seed(5)
        self.tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)  # a teacher's batch
        self.hidden = torch.randn(2, SEQ, DIM, generator=g)  # one block's input

    def __call__(self, net: torch.nn.Module, module: torch.nn.Module) -> torch.Tensor | None:
        """``net``: the network (its ``blocks``); ``module``: what ``state_dict()`` and
        ``parameters()`` are called on. Returns a penalty to add to the loss, or None."""
        op = self.program.operation
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if op == "norm":
            self._keep(sum(p.norm() for _, p in params))
        elif op == "read_grad":
            grads = [p.grad for _, p in params if p.grad is not None]
            self.observed.append(float(len(grads)))
            if grads:
                self._keep(sum(g.norm() for g in grads))
                norms = grad_norm(module, norm_type=2)
                self._keep(norms["grad_2.0_norm_total"])
        elif op == "scale_grad":
            for _, p in params:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        elif op == "clone":
            copies = [p.detach().clone() for _, p in params]
            self._keep(sum((c.float() * c.float()).sum() for c in copies))
        elif op == "ema":
            for n, p in params:
                if n in self.ema:
                    self.ema[n].mul_(0.9).add_(p.detach(), alpha=0.1)
                else:
                    self.ema[n] = p.detach().clone()
        elif op == "scale_weight":
            with torch.no_grad():
                for _, p in params:
                    if p.dim() >= 2:
                        p.mul_(0.999)
        elif op == "penalty":
            return 1e-2 * sum(p.pow(2).sum() for _, p in params)
        elif op == "nograd_model":
            with torch.no_grad():
                self._keep(net(self.tokens[:, :-1], self.tokens[:, 1:]))
        elif op == "nograd_block":
            with torch.no_grad():
                self._keep(net.blocks[0](self.hidden.to(_dtype_of(net))).float().sum())
        elif op == "state_dict":
            state = module.state_dict()
            self._keep(sum((v.float() * v.float()).sum() for v in state.values() if v.is_floating_point()))
        return None

    def _keep(self, value: Any) -> None:
        self.observed.append(float(value))


def _dtype_of(net: torch.nn.Module) -> torch.dtype:
    return next(net.blocks[0].parameters()).dtype


def _whole(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t.clone()).float()


# -- the Trainer's programs ------------------------------------------------------------------------


class HookModule(LightningModule):
    """The stack, trained with the program's operation at its position (hooks of the module)."""

    def __init__(self, program: HookProgram, operator: Operator) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.program = program
        self.operator = operator
        self.net = Net(Case())
        self.automatic_optimization = program.glue != "manual"

    def _at(self, position: str) -> torch.Tensor | None:
        if self.program.position == position:
            return self.operator(self.net, self)
        return None

    def training_step(self, batch, batch_idx):
        if self.program.glue == "manual":
            return self._manual_step(batch)
        penalty = self._at("step_before_forward")
        loss = self.net(*batch)
        after = self._at("step_after_forward")
        for extra in (penalty, after):
            if extra is not None:
                loss = loss + extra
        return loss

    def _manual_step(self, batch):
        """Manual optimization, as people write it: forward, manual_backward, step, zero_grad."""
        optimizer = self.optimizers()
        penalty = self._at("before_forward")
        loss = self.net(*batch)
        after = self._at("after_forward")
        for extra in (penalty, after):
            if extra is not None:
                loss = loss + extra
        self.manual_backward(loss)
        self._at("after_backward")
        optimizer.step()
        self._at("after_step")
        optimizer.zero_grad()
        return loss.detach()

    def validation_step(self, batch, batch_idx):
        return self.net(*batch)

    def configure_optimizers(self):
        if self.program.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)

    def train_dataloader(self):
        return DataLoader(Tokens(8 * BATCH * self.program.world), batch_size=BATCH)

    def val_dataloader(self):
        return DataLoader(Tokens(2 * BATCH * self.program.world, seed=3), batch_size=BATCH)

    def on_train_batch_start(self, batch, batch_idx):
        self._at("on_train_batch_start")

    def on_before_backward(self, loss):
        self._at("on_before_backward")

    def on_after_backward(self):
        self._at("on_after_backward")

    def on_before_optimizer_step(self, optimizer):
        self._at("on_before_optimizer_step")

    def on_before_zero_grad(self, optimizer):
        self._at("on_before_zero_grad")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._at("on_train_batch_end")

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self._at("on_validation_batch_end")

    def on_train_epoch_end(self):
        self._at("on_train_epoch_end")

    def on_save_checkpoint(self, checkpoint):
        self._at("on_save_checkpoint")

    def on_load_checkpoint(self, checkpoint):
        self._at("on_load_checkpoint")


def _trainer(program: HookProgram, kind: str, precision: str, root: str, steps: int) -> Trainer:
    if kind == "ddp":
        strategy: Any = "ddp"
    else:
        strategy = ZeroStrategy(stage=program.stage, **program.options())
    saving = program.position in ("on_save_checkpoint", "on_load_checkpoint")
    callbacks = [ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=2)] if saving else []
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=program.world,
        precision=precision,
        max_steps=steps,
        val_check_interval=2 if program.position == "on_validation_batch_end" else 1.0,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=saving,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
    )


def fit_trainer(program: HookProgram, kind: str, precision: str, root: str) -> Outcome:
    operator = Operator(program)
    model = HookModule(program, operator)
    try:
        if program.position == "on_load_checkpoint":
            _trainer(program, kind, precision, root, 2).fit(model)
            model = HookModule(program, operator)
            trainer = _trainer(program, kind, precision, root, 4)
            trainer.fit(model, ckpt_path=os.path.join(root, "last.ckpt"))
        else:
            trainer = _trainer(program, kind, precision, root, STEPS)
            trainer.fit(model)
        params = {k: _whole(v) for k, v in model.state_dict().items()}
        ema = {k: _whole(v) for k, v in operator.ema.items()}
    except Exception as err:  # noqa: BLE001  (the comparison reports it)
        return Outcome({}, operator.observed, {}, f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    return Outcome(params, operator.observed, ema, None, _secondary_gathers(trainer.strategy))


def _secondary_gathers(strategy: Any) -> int:
    ledger = getattr(strategy, "ledger", None)  # ddp has none
    return 0 if ledger is None else sum(r.name.endswith("/secondary") for r in ledger.records)


# -- Fabric's programs -----------------------------------------------------------------------------


class FabricNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.net = Net(Case())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.net(tokens, targets)


def fit_fabric(program: HookProgram, kind: str, precision: str, root: str) -> Outcome:
    operator = Operator(program)
    try:
        fabric = _fabric(program, kind, precision)
        module = FabricNet()
        if program.optimizer == "adamw":
            optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
        else:
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        model, optimizer = fabric.setup(module, optimizer)
        data = Tokens(STEPS * BATCH * program.world).data
        for step in range(STEPS):
            start = (step * program.world + fabric.global_rank) * BATCH
            rows = data[start : start + BATCH]
            loss = _fabric_step(program, operator, module, model, rows)
            fabric.backward(loss)
            _fabric_at(program, "after_backward", operator, module, model)
            optimizer.step()
            _fabric_at(program, "after_step", operator, module, model)
            optimizer.zero_grad()
        params = {k: _whole(v) for k, v in module.state_dict().items()}
        ema = {k: _whole(v) for k, v in operator.ema.items()}
    except Exception as err:  # noqa: BLE001
        return Outcome({}, operator.observed, {}, f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    return Outcome(params, operator.observed, ema, None, _secondary_gathers(fabric.strategy))


def _fabric(program: HookProgram, kind: str, precision: str) -> L.Fabric:
    if kind == "ddp":
        strategy: Any = "ddp"
    else:
        strategy = ZeroFabricStrategy(stage=program.stage, **program.options())
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=program.world, precision=precision)
    fabric.launch()
    return fabric


def _fabric_step(program: HookProgram, operator: Operator, module: Any, model: Any, rows: torch.Tensor):
    penalty = _fabric_at(program, "before_forward", operator, module, model)
    loss = model(rows[:, :-1], rows[:, 1:])
    after = _fabric_at(program, "after_forward", operator, module, model)
    for extra in (penalty, after):
        if extra is not None:
            loss = loss + extra
    return loss


def _fabric_at(program: HookProgram, position: str, operator: Operator, module: Any, model: Any):
    if program.position == position:
        return operator(module.net, model)
    return None


# -- running and comparing -------------------------------------------------------------------------


def _jobs(program: HookProgram) -> list[tuple[tuple, Any]]:
    fit = fit_fabric if program.glue == "fabric" else fit_trainer
    jobs = [
        ((program, "zero"), functools.partial(fit, program, "zero", program.precision)),
        ((program, "ddp"), functools.partial(fit, program, "ddp", program.precision)),
    ]
    if program.precision != "32-true":  # ddp's own spread: its bf16 run against its fp32 one
        jobs.append(((program, "ddp32"), functools.partial(fit, program, "ddp", "32-true")))
    if program.int8:  # int8's own spread: the same training without the operation, against ddp's
        plain = program._replace(operation="none")
        jobs.append(((program, "zero_plain"), functools.partial(fit, plain, "zero", program.precision)))
        jobs.append(((program, "ddp_plain"), functools.partial(fit, plain, "ddp", program.precision)))
    return jobs


def run_programs(programs: list[HookProgram], out_dir: str) -> dict[HookProgram, dict[str, list[Outcome]]]:
    """Per program: {"zero": every rank's outcome, "ddp": ..., "ddp32": ... (bf16 programs)}; the
    programs of one world size run in one set of processes."""
    out: dict[HookProgram, dict[str, list[Outcome]]] = {}
    for world in sorted({p.world for p in programs}):
        keyed = [job for p in programs if p.world == world for job in _jobs(p)]
        ranks = run_jobs([job for _, job in keyed], os.path.join(out_dir, f"world{world}"), world=world,
                         timeout=120 + 20 * len(keyed))  # fmt: skip
        for i, ((program, kind), _) in enumerate(keyed):
            out.setdefault(program, {})[kind] = [r[i] for r in ranks]
    return out


def _max_diff(a: dict, b: dict, *, relative: bool = False) -> float:
    if a.keys() != b.keys():
        return math.inf
    out = 0.0
    for k in a:
        d = (a[k] - b[k]).abs()
        if relative:
            d = d / (1 + b[k].abs())
        out = max(out, d.max().item() if d.numel() else 0.0)
    return out


def _list_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return math.inf
    return max((abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b)), default=0.0)


def problems(program: HookProgram, outcomes: dict[str, list[Outcome]]) -> list[str]:
    """What differs between the stage and ddp on this program (empty: nothing)."""
    name = program.name
    zero, ddp = outcomes["zero"][0], outcomes["ddp"][0]
    if ddp.error:  # the program is wrong under ddp too: the stage must fail as well
        return [] if zero.error else [f"{name}: ddp raised {ddp.error.splitlines()[0]}, the stage did not"]
    errors = [f"{name}: rank {r} raised {o.error}" for r, o in enumerate(outcomes["zero"]) if o.error]
    if errors and _bf16_saved_weights(program, outcomes["zero"]):
        return []
    if errors:
        return errors[:1]
    out = []
    if program.int8:
        spread = _max_diff(outcomes["zero_plain"][0].params, outcomes["ddp_plain"][0].params)
        tol, obs_tol, relative = max(INT8_MARGIN * spread, INT8_FLOOR), INT8_READ, False
    elif program.precision == "32-true":
        tol, obs_tol, relative = TOL, OBS_TOL, False
    else:
        fp32 = outcomes["ddp32"][0]
        spread = _max_diff(ddp.params, fp32.params, relative=True)
        obs_spread = _list_diff(ddp.observed, fp32.observed)
        tol, obs_tol, relative = max(2 * spread, BF16_FLOOR), max(2 * obs_spread, BF16_FLOOR), True
    if any(_max_diff(o.params, zero.params) != 0.0 for o in outcomes["zero"][1:]):
        out.append(f"{name}: the ranks' parameters differ after fit")
    if (d := _max_diff(zero.params, ddp.params, relative=relative)) > tol:
        out.append(f"{name}: parameters differ from ddp's by {d:.2e} (tolerance {tol:.1e})")
    if (d := _list_diff(zero.observed, ddp.observed)) > obs_tol:
        out.append(f"{name}: the program read {zero.observed}, under ddp {ddp.observed}")
    if (d := _max_diff(zero.ema, ddp.ema, relative=relative)) > tol:
        out.append(f"{name}: the EMA differs from ddp's by {d:.2e}")
    if program.secondary and not zero.secondary:  # the program must exercise what it names
        out.append(f"{name}: no backward all-gather used a secondary copy")
    return out


def _bf16_saved_weights(program: HookProgram, ranks: list[Outcome]) -> bool:
    """bf16-mixed, weights scaled in place between forward and backward: under the package's policy
    the bf16 parameters are what autograd saved, so every rank refuses the change (autograd's
    message), where ddp's autocast saved bf16 copies of fp32 weights and went on. Loud on every
    rank, as docs/mixed-precision.md says; never a silent difference. ``after_forward``: the loops'
    (manual optimization, Fabric) place between the forward and the backward."""
    between = program.position in (
        "step_after_forward",
        "on_before_backward",
        "on_before_zero_grad",
        "after_forward",
    )
    if program.precision == "32-true" or program.operation != "scale_weight" or not between:
        return False
    return all(o.error and "modified by an inplace operation" in o.error for o in ranks)


def report(results: dict[HookProgram, dict[str, list[Outcome]]]) -> list[str]:
    return [p for program, outcomes in results.items() for p in problems(program, outcomes)]
