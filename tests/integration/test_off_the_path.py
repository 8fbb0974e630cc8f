"""Off the happy path, through the Trainer: each case once gave a wrong result or a misleading error.

Parameters outside a unit's forward at stage 3, two optimizers over one model, optimizers that are
not elementwise, checkpoints saved after ``fit`` returned (loaded by a plain optimizer, resumed),
frozen weights under bf16, unused parameters at stage 3, wrap policies that cannot work. All fits
of a test share one pair of processes (tests/matrix/runner.py).
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.zero.optimizer import ShardingError, check_shardable, mark_elementwise
from tests.bigmodel.lit import quiet_trainer
from tests.matrix.lit import BATCH, WORLD, Case, MatrixModule
from tests.matrix.runner import BLOCK, run_jobs

STAGES = (0, 1, 2, 3)


def _trainer(stage: int | None, root: str, *, precision: str = "32-true", max_epochs: int = 1, **options):
    if stage == 3:
        options.setdefault("wrap_policy", BLOCK)
    strategy = ZeroStrategy(stage=stage, **options) if stage is not None else "auto"
    devices = WORLD if stage is not None else 1
    return quiet_trainer(strategy, root, devices=devices, max_epochs=max_epochs, precision=precision)


def _per_rank(stage: int | None) -> int:
    return BATCH if stage is not None else BATCH * WORLD


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def _fit(module, stage, root, **kwargs) -> dict:
    """Fit; the parameters after it, the losses, and the error the fit raised (None if none)."""
    try:
        _trainer(stage, root, **kwargs).fit(module)
    except Exception as err:  # noqa: BLE001  (the test asserts on it)
        return {"error": f"{type(err).__name__}: {err}", "losses": module.losses}
    return {"error": None, "params": _params(module), "losses": module.losses}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


# -- parameters outside a unit's forward --------------------------------------------------------


class Penalty(MatrixModule):
    """An L2 penalty over every parameter in training_step, and a weight norm read under no_grad;
    ``gathered`` runs both inside the strategy's gathered() (the documented way at stage 3)."""

    def __init__(self, per_rank: int, gathered: bool) -> None:
        super().__init__(Case(), per_rank=per_rank)
        self.gathered = gathered
        self.norms: list[float] = []

    def _whole(self):
        strategy = self.trainer.strategy
        return (
            strategy.gathered()
            if self.gathered and hasattr(strategy, "gathered")
            else contextlib.nullcontext()
        )

    def training_step(self, batch, batch_idx):
        loss = self.net(*batch)
        self.losses.append(loss.item())
        with self._whole():
            penalty = sum((p.float() ** 2).sum() for p in self.parameters())
            with torch.no_grad():
                self.norms.append(self.net.blocks[0].fc1.weight.norm().item())
        return loss + 1e-3 * penalty


def _penalty(stage: int | None, gathered: bool, root: str) -> dict:
    module = Penalty(_per_rank(stage), gathered)
    return {**_fit(module, stage, root), "norms": module.norms}


def test_parameters_outside_forward(tmp_path):
    """A penalty over every parameter and a weight norm, written as for plain Lightning (stage 3:
    the parameters at rest gather their units, see [Note: parameters at rest]) and inside the
    strategy's gathered(): the reference's penalty, gradients and weight norms, at every stage."""
    ref = run_jobs([functools.partial(_penalty, None, False)], str(tmp_path / "ref"), world=1, timeout=300)[
        0
    ][0]
    jobs = [functools.partial(_penalty, 3, False)] + [functools.partial(_penalty, s, True) for s in STAGES]
    ranks = run_jobs(jobs, str(tmp_path / "ranks"), world=2, timeout=600)
    for rank in ranks:
        for stage, result in zip((3, *STAGES), rank):
            assert result["error"] is None, (stage, result["error"])
            assert _max_diff(result["params"], ref["params"]) <= 1e-5, stage
            assert max(abs(a - b) for a, b in zip(result["norms"], ref["norms"])) <= 1e-5, stage


# -- two optimizers over the same parameters ----------------------------------------------------


class TwoOptimizers(MatrixModule):
    """Manual optimization alternating an SGD and an Adam step over the same parameters."""

    def __init__(self, per_rank: int) -> None:
        super().__init__(Case(manual=True), per_rank=per_rank)

    def training_step(self, batch, batch_idx):
        sgd, adam = self.optimizers()
        opt = sgd if batch_idx % 2 == 0 else adam
        loss = self.net(*batch)
        self.losses.append(loss.item())
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(self.parameters(), lr=1e-2),
        )


def _two_optimizers(stage: int | None, root: str) -> dict:
    return _fit(TwoOptimizers(_per_rank(stage)), stage, root)


def test_two_optimizers_over_the_same_parameters(tmp_path):
    ref = run_jobs([functools.partial(_two_optimizers, None)], str(tmp_path / "ref"), world=1, timeout=300)
    ranks = run_jobs(
        [functools.partial(_two_optimizers, s) for s in STAGES], str(tmp_path / "r"), world=2, timeout=600
    )
    for stage, result in zip(STAGES, ranks[0]):
        assert result["error"] is None, (stage, result["error"])
        assert _max_diff(result["params"], ref[0][0]["params"]) <= 1e-5, stage


# -- optimizers that are not elementwise ----------------------------------------------------------


class RowScaled(torch.optim.Optimizer):
    """Scales each row's step by the row's gradient norm: not elementwise."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm(dim=-1, keepdim=True) + 1), alpha=-group["lr"])


class WithOptimizer(MatrixModule):
    def __init__(self, make) -> None:
        super().__init__(Case())
        self.make = make

    def configure_optimizers(self):
        return self.make(self.parameters())


def _optimizer_job(stage: int, make, options: dict, root: str) -> dict:
    return _fit(WithOptimizer(make), stage, root, **options)


def test_optimizers_that_are_not_elementwise_are_refused_at_setup(tmp_path):
    adafactor = functools.partial(torch.optim.Adafactor, lr=1e-2)
    jobs = [
        functools.partial(_optimizer_job, 1, adafactor, {}),
        functools.partial(_optimizer_job, 3, RowScaled, {}),
        functools.partial(
            _optimizer_job, 2, RowScaled, {"elementwise_optimizers": [f"{__name__}.RowScaled"]}
        ),
        functools.partial(_optimizer_job, 0, adafactor, {}),  # stage 0 shards nothing: any optimizer
    ]
    ranks = run_jobs(jobs, str(tmp_path), world=2, timeout=600)
    for rank in ranks:
        refused_adafactor, refused_custom, declared, stage0 = rank
        for result, name in (
            (refused_adafactor, "torch.optim.Adafactor"),
            (refused_custom, "RowScaled"),
        ):
            assert result["losses"] == [], "refused at setup, before the first step"
            assert name in result["error"] and "not known to be elementwise" in result["error"], result[
                "error"
            ]
            assert "zero0" in result["error"] and "mark_elementwise" in result["error"]
        assert declared["error"] is None and stage0["error"] is None


def test_elementwise_rules_without_processes():
    params = [torch.nn.Parameter(torch.zeros(3))]
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.NAdam):
        check_shardable(cls(params, lr=0.1))
    check_shardable(torch.optim.AdamW(params, lr=0.1, foreach=True))

    class Tuned(torch.optim.AdamW):  # a subclass that keeps AdamW's update
        pass

    class Lamb(torch.optim.Adam):  # a subclass with its own update (trust ratio)
        def step(self, closure=None):
            return super().step(closure)

    check_shardable(Tuned(params))
    with pytest.raises(ShardingError, match="Lamb is not known to be elementwise"):
        check_shardable(Lamb(params))
    with pytest.raises(ShardingError, match="LBFGS is not known to be elementwise"):
        check_shardable(torch.optim.LBFGS(params))
    mark_elementwise(Lamb)
    check_shardable(Lamb(params))
    with pytest.raises(TypeError, match="takes a torch.optim.Optimizer subclass"):
        mark_elementwise(int)


# -- checkpoints saved after fit ------------------------------------------------------------------


class Adam(MatrixModule):
    def __init__(self, per_rank: int = BATCH, frozen: bool = False) -> None:
        super().__init__(Case(optimizer="adamw", frozen=frozen), per_rank=per_rank)


def _save_after_fit(stage: int, form: str, shared: str, root: str) -> dict:
    """Fit one epoch, save after fit returned, then resume a fresh run from it for a second epoch."""
    path = os.path.join(shared, f"zero{stage}-{form}.ckpt")
    module = Adam()
    trainer = _trainer(stage, root, state_dict_type=form)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    resumed = Adam()
    _trainer(stage, root, max_epochs=2, state_dict_type=form).fit(resumed, ckpt_path=path)
    return {"path": path, "resumed": _params(resumed)}


def _two_epochs(root: str) -> dict:
    module = Adam(per_rank=BATCH * WORLD)
    trainer = _trainer(None, root, max_epochs=1)
    trainer.fit(module)
    path = os.path.join(root, "reference.ckpt")
    trainer.save_checkpoint(path)
    _trainer(None, root, max_epochs=2).fit(module, ckpt_path=path)
    return {"path": path, "params": _params(module)}


def test_checkpoint_saved_after_fit_loads_and_resumes(tmp_path):
    shared = str(tmp_path / "shared")
    os.makedirs(shared)
    ref = run_jobs([_two_epochs], str(tmp_path / "ref"), world=1, timeout=300)[0][0]
    jobs = [
        functools.partial(_save_after_fit, s, form, shared) for s in (1, 2, 3) for form in ("full", "sharded")
    ]
    ranks = run_jobs(jobs, str(tmp_path / "ranks"), world=2, timeout=900)
    reference = torch.load(ref["path"], weights_only=False)["optimizer_states"][0]
    for result in ranks[0]:
        assert _max_diff(result["resumed"], ref["params"]) <= 1e-5, result["path"]
        if result["path"].endswith("full.ckpt"):
            saved = torch.load(result["path"], weights_only=False)["optimizer_states"][0]
            plain = torch.optim.AdamW(Adam().parameters(), lr=1e-2, weight_decay=0.1)
            plain.load_state_dict(saved)  # a plain torch optimizer takes it as it is
            assert saved["state"].keys() == reference["state"].keys()
            assert (
                max(
                    (v - reference["state"][i][k]).abs().max().item()
                    for i, e in saved["state"].items()
                    for k, v in e.items()
                )
                <= 1e-5
            )


def _frozen_bf16(stage: int, shared: str, root: str) -> dict:
    module = Adam(frozen=True)
    before = module.net.blocks[1].fc1.weight.detach().clone()
    trainer = _trainer(stage, root, precision="bf16-mixed")
    trainer.fit(module)
    path = os.path.join(shared, f"frozen-zero{stage}.ckpt")
    trainer.save_checkpoint(path)
    weight = module.net.blocks[1].fc1.weight
    return {
        "path": path,
        "dtype": weight.dtype,
        "same": torch.equal(weight.detach(), before),
        "before": before,
    }


def test_frozen_parameters_keep_dtype_and_values_under_bf16(tmp_path):
    shared = str(tmp_path / "shared")
    os.makedirs(shared)
    ranks = run_jobs(
        [functools.partial(_frozen_bf16, s, shared) for s in STAGES],
        str(tmp_path / "r"),
        world=2,
        timeout=600,
    )
    for result in ranks[0]:
        assert result["dtype"] == torch.float32 and result["same"], result["path"]
        state = torch.load(result["path"], weights_only=False)["state_dict"]
        assert state["net.blocks.1.fc1.weight"].dtype == torch.float32
        assert torch.equal(state["net.blocks.1.fc1.weight"], result["before"])


# -- unused parameters and wrap policies at stage 3 ------------------------------------------------


def _stage3_errors(kind: str, root: str) -> dict:
    if kind == "unused":
        return _fit(MatrixModule(Case(unused=True)), 3, root)
    return _fit(MatrixModule(Case()), 3, root, wrap_policy="torch.nn.Conv2d")


def test_stage3_errors_name_the_cause(tmp_path):
    jobs = [functools.partial(_stage3_errors, kind) for kind in ("unused", "no_match")]
    for unused, no_match in run_jobs(jobs, str(tmp_path), world=2, timeout=600):
        assert "UnusedParametersError" in unused["error"] and "net.spare.weight" in unused["error"]
        assert "find_unused_parameters=True" in unused["error"]
        assert no_match["error"].startswith("ValueError"), no_match["error"]
        assert "torch.nn.modules.conv.Conv2d match no module" in no_match["error"]
        assert (
            "tests.matrix.lit.Block" in no_match["error"]
            and "torch.nn.modules.linear.Linear" in no_match["error"]
        )


def test_wrap_policy_strings_are_checked_when_the_strategy_is_built():
    with pytest.raises(ValueError, match="wrap_policy class 'no.such.Block' cannot be imported"):
        ZeroStrategy(stage=3, wrap_policy="no.such.Block")
    with pytest.raises(ValueError, match="elementwise_optimizers: 'no.such.Opt' cannot be imported"):
        ZeroStrategy(stage=1, elementwise_optimizers=["no.such.Opt"])


# -- a parameter's data assigned by hand --------------------------------------------------------


class Reassigned(MatrixModule):
    """``p.data = value`` on every rank, as a user re-initialising or loading a weight by hand:
    before the second batch's forward (``on_train_batch_start``) and after the fourth batch's
    backward, before its step (``on_before_optimizer_step``)."""

    def __init__(self, per_rank: int) -> None:
        super().__init__(Case(), per_rank=per_rank)

    def _assign(self, scale: float) -> None:
        weight = self.net.blocks[0].fc1.weight
        with torch.no_grad():
            weight.data = torch.full(tuple(weight.shape), scale) + 0.01 * torch.arange(
                weight.numel(), dtype=torch.float32
            ).reshape(tuple(weight.shape)).remainder(7)

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 1:
            self._assign(0.05)

    def on_before_optimizer_step(self, optimizer):
        if self.trainer.global_step == 3:
            self._assign(-0.02)


def _reassigned(stage: int | None, root: str) -> dict:
    return _fit(Reassigned(_per_rank(stage)), stage, root)


def test_a_parameter_assigned_by_hand_trains_on_as_in_plain_training(tmp_path):
    """``p.data = value`` between steps and between backward and step: the value is taken and the
    parameter trains on from it at every stage, as in one process (stages 1-2 once left it frozen
    at the assigned value: it no longer viewed its bucket)."""
    ref = run_jobs([functools.partial(_reassigned, None)], str(tmp_path / "ref"), world=1, timeout=300)[0][0]
    jobs = [functools.partial(_reassigned, s) for s in STAGES]
    ranks = run_jobs(jobs, str(tmp_path / "ranks"), world=2, timeout=600)
    for rank in ranks:
        for stage, result in zip(STAGES, rank):
            assert result["error"] is None, (stage, result["error"])
            assert _max_diff(result["params"], ref["params"]) <= 1e-5, stage


# -- no thread of the package outlives fit ------------------------------------------------------


class _DoneWork:
    def wait(self, timeout=None) -> bool:
        return True


def _threads_after_fit(stage: int, root: str) -> list[str]:
    import threading

    from lightning_zero.comm.waiting import _WAITER

    _WAITER.submit(_DoneWork()).done.wait(5)  # the waiter thread runs, as after an untimed wait
    _fit(MatrixModule(Case(), per_rank=_per_rank(stage)), stage, root)
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning_zero"))


def test_no_thread_of_the_package_outlives_fit(tmp_path):
    """The watchdog and the waiter thread end with the run, at every stage (a harness that checks
    for leftover threads finds none)."""
    jobs = [functools.partial(_threads_after_fit, s) for s in STAGES]
    for rank in run_jobs(jobs, str(tmp_path / "ranks"), world=2, timeout=600):
        assert rank == [[] for _ in STAGES], rank


# -- a step or a backward on some ranks only ----------------------------------------------------


class SkipsOnOneRank(MatrixModule):
    """Rank 1 alone skips something at batch 2: its optimizer step (manual optimization, the step's
    condition true on one rank), or the whole batch (``training_step`` returns None)."""

    def __init__(self, per_rank: int, what: str) -> None:
        super().__init__(Case(manual=what == "step"), per_rank=per_rank)
        self.what = what

    def training_step(self, batch, batch_idx):
        skip = batch_idx == 2 and self.global_rank == 1
        if self.what == "batch":
            return None if skip else super().training_step(batch, batch_idx)
        opt = self.optimizers()
        loss = self.net(*batch)
        self.manual_backward(loss)
        if not skip:
            opt.step()
        opt.zero_grad()
        return None


def _skips(stage: int, what: str, root: str) -> dict:
    import time

    start = time.monotonic()
    result = _fit(SkipsOnOneRank(_per_rank(stage), what), stage, root)
    return {**result, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("what", ["step", "batch"])
def test_a_step_or_batch_skipped_on_one_rank_stops_every_rank_named(tmp_path, what):
    """Stage 3 issues no collective at the optimizer step, so a rank that skipped one once trained
    on with the others and every rank exited 0 with another model; stage 0 likewise. Now the
    per-batch agreement carries each rank's optimizer steps and backward passes: every rank stops
    at the next batch with a desync naming the counts. A whole batch skipped (``training_step``
    returns None on one rank) is Lightning's own error there, which every rank names."""
    for stage in (0, 3):  # a pair of processes each: a failed fit leaves its processes failed
        jobs = [functools.partial(_skips, stage, what)]
        for [result] in run_jobs(jobs, str(tmp_path / f"ranks{stage}"), world=2, timeout=600):
            error = result["error"] or ""
            if what == "batch":
                assert "Skipping the `training_step` by returning None" in error, (stage, error)
                continue
            assert error.startswith(
                "CollectivesStopped: the ranks are out of step (a desync) at the end of batch 2"
            ), (
                stage,
                error,
            )
            assert "rank 0: 3 optimizer steps" in error and "rank 1: 2 optimizer steps" in error, error
            assert result["seconds"] < 60, result["seconds"]


def test_a_step_skipped_on_one_rank_at_stages_1_and_2_stops_every_rank_within_seconds(tmp_path):
    """Stages 1-2 all-gather the updated shards after the step: the rank that skipped it goes on to
    the next batch's agreement while the others wait in the all-gather, which the learned schedule
    issued unchecked. The agreement posts its deviation, so every rank stops named within a wait
    slice or two, not at the watchdog (60 s)."""
    for stage in (1, 2):
        jobs = [functools.partial(_skips, stage, "step")]
        for [result] in run_jobs(jobs, str(tmp_path / f"ranks{stage}"), world=2, timeout=600):
            error = result["error"] or ""
            assert error.startswith("CollectivesStopped: ") and "out of step (a desync)" in error, (
                stage,
                error,
            )
            assert "waited 6" not in error, error  # not the watchdog's report
            assert result["seconds"] < 30, (stage, result["seconds"])


class GathersOtherShapes(MatrixModule):
    """At batch 1 each rank all-gathers a tensor of its own shape with Lightning's ``all_gather``."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            self.all_gather(torch.ones(2 + self.global_rank, 3))
        return super().training_step(batch, batch_idx)


def test_lightning_all_gather_of_different_shapes_is_a_named_desync_on_every_rank(tmp_path):
    """Lightning's own ``self.all_gather`` with another shape on each rank aborted gloo on rank 0
    (SIGABRT) while rank 1 blamed a dead rank: its check compared no sizes. Now the shapes and
    bytes are in what every rank compares before it starts."""
    jobs = [functools.partial(_fit, GathersOtherShapes(Case(), per_rank=_per_rank(2)), 2)]
    for [result] in run_jobs(jobs, str(tmp_path / "ranks"), world=2, timeout=600):
        error = result["error"] or ""
        assert error.startswith("CollectivesStopped: ") and "out of step (a desync)" in error, error
        assert "lightning/all_gather float32[2, 3] (24 B)" in error, error
        assert "lightning/all_gather float32[3, 3] (36 B)" in error, error
