"""Stage 3 for models that do not fit one rank: deferred (meta-device) initialisation, frozen
parameters sharded, gradient buffers bounded in backward, the module left sharded after fit, and
the peak memory of every phase of a run against 16Ψ/N.

The phase test runs a 38M-parameter model in the default suite; ``-m slow`` runs the 200M one of
benchmarks/bench_big_model.py (see docs/big-models.md).
"""

from __future__ import annotations

import functools
import gc
import os

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lightning_zero.zero.unit import is_at_rest
from tests.bigmodel.lit import (
    BigModule,
    Phases,
    Shape,
    psi,
    quiet_trainer,
    reset_peak,
    rss_mb,
    supports_peak_reset,
    zero_strategy,
)
from tests.matrix.runner import run_jobs

SMALL = Shape()


def _trainer(stage: int | None, root: str, *, max_epochs: int = 1, callbacks=(), **options) -> Trainer:
    strategy = zero_strategy(stage, **options) if stage is not None else "auto"
    return quiet_trainer(
        strategy, root, devices=2 if stage is not None else 1, max_epochs=max_epochs, callbacks=callbacks
    )


def _values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


class Initial(Callback):
    """The full parameter values when training starts (gathered at stage 3: every rank takes part)."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        state = trainer.strategy.full_state_dict(rank0_only=False)
        self.values = {n: state[n].float().clone() for n, _ in pl_module.named_parameters()}


class Memory(Callback):
    """The strategy's memory report after the last training batch."""

    def __init__(self) -> None:
        self.report = None

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.report = trainer.strategy.memory_report()


class BufferPeaks(Callback):
    """The most full-size gradient-buffer bytes alive in each backward."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        meter = trainer.strategy.engine.buffer_meter
        self.peaks.append(meter.peak)
        meter.reset()


# -- deferred initialisation -----------------------------------------------------------------------


def _build(mode: str, stage: int, root: str, **options) -> dict:
    """Fit SMALL built ``mode``: eager (before the trainer), configure (in configure_model), init_module
    (eagerly, inside trainer.init_module(empty_init=True)); the first and last values and how it ended."""
    torch.manual_seed(0)
    initial = Initial()
    trainer = _trainer(stage, root, callbacks=[initial], **options)
    if mode == "init_module":
        with trainer.init_module(empty_init=True):
            module = BigModule(SMALL, eager=True)
    else:
        module = BigModule(SMALL, eager=mode == "eager")
    meta_before = any(p.is_meta for p in module.parameters())
    trainer.fit(module)
    first = next(iter(module.net.blocks[0].parameters()))
    return {
        "meta_before": meta_before,
        "initial": initial.values,
        "final": trainer.strategy.full_state_dict(rank0_only=False),
        "sharded_after_fit": is_at_rest(first),
    }


@pytest.mark.slow  # about 15 s; deferred init also in tests/fabric/test_deferred.py and the fuzzer (make test-slow; default suite kept near 15 min)
def test_deferred_initialisation(tmp_path):
    """configure_model and init_module(empty_init=True) build on the meta device at stage 3 and get the
    values a normal build would have (reset_parameters, rank 0's random state), on every rank; the
    run then equals one from the normal build; stages 0-2 build configure_model's model as DDP does."""
    jobs = [
        functools.partial(_build, "configure", 0),
        functools.partial(_build, "configure", 3),
        functools.partial(_build, "init_module", 3),
        functools.partial(_build, "eager", 3),
        functools.partial(_build, "configure", 2),
    ]
    for rank in run_jobs(jobs, str(tmp_path), world=2, timeout=900):
        zero0, deferred, init_module, eager, zero2 = rank
        assert not zero0["meta_before"] and not zero2["meta_before"]
        assert init_module["meta_before"]  # built eagerly, but inside the context: on the meta device
        for other in (deferred, init_module, eager, zero2):
            assert _max_diff(other["initial"], zero0["initial"]) == 0.0
            assert _max_diff(other["final"], zero0["final"]) <= 1e-6
        # the default teardown: a model built on the meta device stays sharded after fit
        assert deferred["sharded_after_fit"] and init_module["sharded_after_fit"]
        assert not eager["sharded_after_fit"] and not zero0["sharded_after_fit"]


def gpt_init(module: torch.nn.Module) -> None:
    """A GPT-style init pass: normal(0, 0.02) weights, zero biases for Linear layers."""
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)


class NoReset(torch.nn.Module):
    """Holds a parameter of its own but no reset_parameters: a meta build cannot give it values."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(SMALL.width))

    def forward(self, x):
        return x * self.scale


class WithNoReset(BigModule):
    def configure_model(self) -> None:
        super().configure_model()
        self.extra = NoReset()


def _init_fn(kind: str, root: str) -> dict:
    torch.manual_seed(0)
    module = WithNoReset(SMALL) if kind == "missing" else BigModule(SMALL)
    options = {"param_init_fn": f"{__name__}.gpt_init"} if kind == "init_fn" else {}
    trainer = _trainer(3, root, max_epochs=0, **options)
    try:
        trainer.fit(module)
    except ValueError as err:
        return {"error": str(err)}
    state = trainer.strategy.full_state_dict(rank0_only=False)
    return {"error": None, "state": state}


@pytest.mark.slow  # about 15 s (make test-slow; default suite kept near 15 min)
def test_param_init_fn_and_a_module_without_reset_parameters(tmp_path):
    jobs = [functools.partial(_init_fn, kind) for kind in ("init_fn", "missing")]
    for init_fn, missing in run_jobs(jobs, str(tmp_path), world=2, timeout=600):
        state = init_fn["state"]
        for i in range(SMALL.blocks):
            assert torch.equal(state[f"net.blocks.{i}.up.bias"], torch.zeros(4 * SMALL.width))  # gpt_init ran
            assert torch.equal(
                state[f"net.blocks.{i}.norm.weight"], torch.ones(SMALL.width)
            )  # reset_parameters
            assert 0.015 < state[f"net.blocks.{i}.up.weight"].std().item() < 0.025
        assert "module 'extra'" in missing["error"] and "NoReset" in missing["error"]
        assert "scale" in missing["error"] and "param_init_fn" in missing["error"]
    ranks = run_jobs([functools.partial(_init_fn, "init_fn")], str(tmp_path / "again"), world=2, timeout=600)
    assert _max_diff(ranks[0][0]["state"], ranks[1][0]["state"]) == 0.0  # ranks agree


# -- frozen parameters, adapters ---------------------------------------------------------------------

ADAPTERS = Shape(adapters=4)


def _adapters(stage: int | None, root: str) -> dict:
    torch.manual_seed(0)
    module = BigModule(ADAPTERS, eager=True, lr=1e-2, world=2 if stage is not None else 1)
    memory = Memory()
    trainer = _trainer(stage, root, callbacks=[memory] if stage is not None else [])
    frozen_before = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    trainer.fit(module)
    frozen_after = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
    return {
        "values": _values(module),
        "frozen_kept": all(torch.equal(frozen_before[n], frozen_after[n]) for n in frozen_before),
        "memory": memory.report,
        "shards": _shard_elements(trainer.strategy._run.fitted) if stage == 3 else 0,
        "trainable_shards": _shard_elements(trainer.strategy._run.fitted, trainable=True)
        if stage == 3
        else 0,
    }


def _shard_elements(engine, *, trainable: bool = False) -> int:
    """Elements per rank in every unit's shards (rows padded to N: [Note: row layout])."""
    return sum(
        f.flat.shard_numel for u in engine.zero3.units for f in u.flats if f.trainable or not trainable
    )


def test_frozen_base_with_adapters(tmp_path):
    """The frozen base lives in the units' flat parameters as 1/N shards (no gradients, no optimizer
    state); adapters inside the same blocks train as a reference does."""
    ref = run_jobs([functools.partial(_adapters, None)], str(tmp_path / "ref"), world=1, timeout=300)[0][0]
    ranks = run_jobs(
        [functools.partial(_adapters, s) for s in (0, 3)], str(tmp_path / "r"), world=2, timeout=600
    )
    trainable, frozen = psi(ADAPTERS)
    for zero0, zero3 in ranks:
        assert zero3["frozen_kept"] and zero0["frozen_kept"]
        assert _max_diff(zero3["values"], ref["values"]) <= 1e-6
        assert _max_diff(zero0["values"], ref["values"]) <= 1e-6
        assert (trainable + frozen) / 2 <= zero3["shards"] <= (trainable + frozen) / 2 + 2 * ADAPTERS.width
        assert zero3["memory"].parameters == 4 * zero3["shards"]  # the shards, nothing gathered
        assert zero0["memory"].parameters == 4 * (trainable + frozen)
        # optimizer state only for the trainable part, 1/N of it (Adam: 8 bytes per element + steps)
        assert zero3["memory"].optimizer_states <= 8 * zero3["trainable_shards"] + 4 * 40


# -- gradient buffers in backward ----------------------------------------------------------------------


def _buffers(stage: int, limit: int, root: str) -> dict:
    torch.manual_seed(0)
    peaks = BufferPeaks()
    options = {"max_reduce_buffers": limit}
    if stage == 2:
        options.update(bucket_cap_mb=0.05, first_bucket_cap_mb=0.05)
    trainer = _trainer(stage, root, callbacks=[peaks], **options)
    module = BigModule(SMALL, eager=True)
    trainer.fit(module)
    engine = trainer.strategy._run.fitted
    root_unit = None
    if stage == 3:
        sizes = [u.flat.padded_numel * 4 for u in engine.zero3.units if u.flat is not None]
        root_unit = engine.zero3.root_unit
    else:
        sizes = [s.padded_numel * 4 for s in engine.wrapped.sync.bucket_specs()]
    root = root_unit.flat.padded_numel * 4 if root_unit is not None and root_unit.flat is not None else 0
    return {"peak": max(peaks.peaks), "sizes": sizes, "root": root}


@pytest.mark.slow  # about 12 s (make test-slow; default suite kept near 15 min)
def test_gradient_buffers_are_bounded_in_backward(tmp_path):
    jobs = [functools.partial(_buffers, stage, limit) for stage in (2, 3) for limit in (1, 2, 100)]
    for rank in run_jobs(jobs, str(tmp_path), world=2, timeout=600):
        (s2_1, s2_2, s2_all, s3_1, s3_2, s3_all) = rank
        biggest2, biggest3 = max(s2_1["sizes"]), max(s3_1["sizes"])
        assert len(s2_1["sizes"]) >= 5 and len(s3_1["sizes"]) == SMALL.blocks + 1
        # the bucket being filled, or the unit whose gradients accumulate, plus `limit` in flight;
        # stage 3 also the root unit's buffer (gathered for the whole step, reduced last)
        assert s2_1["peak"] <= 2 * biggest2 and s2_2["peak"] <= 3 * biggest2
        root = s3_1["root"]
        assert s3_1["peak"] <= 2 * biggest3 + root and s3_2["peak"] <= 3 * biggest3 + root
        # without a bound, the whole gradient is alive at the end of backward
        assert s2_all["peak"] == sum(s2_all["sizes"]) and s3_all["peak"] == sum(s3_all["sizes"])


# -- the module after fit ----------------------------------------------------------------------------


def _after_fit(gather: bool | None, root: str) -> dict:
    torch.manual_seed(0)
    module = BigModule(SMALL)
    trainer = _trainer(3, root, gather_at_teardown=gather)
    trainer.fit(module)
    first = module.net.blocks[1].up.weight
    out = {"sharded": is_at_rest(first), "rank0": trainer.strategy.full_state_dict()}
    out["all"] = trainer.strategy.full_state_dict(rank0_only=False)
    out["doubled"] = (first * 2).sum().item()  # at rest: gathers its unit (every rank runs it)
    x = torch.randn(4, SMALL.width)
    with torch.no_grad():  # calling the sharded module still works: each unit gathers itself
        out["loss"] = module.net(x, torch.zeros(4)).item()
    return out


@pytest.mark.slow  # about 10 s (make test-slow; default suite kept near 15 min)
def test_module_after_fit(tmp_path):
    jobs = [functools.partial(_after_fit, g) for g in (None, True, False)]
    ranks = run_jobs(jobs, str(tmp_path), world=2, timeout=600)
    for rank, results in enumerate(ranks):
        default, gathered, sharded = results
        assert default["sharded"] and sharded["sharded"] and not gathered["sharded"]
        assert sharded["doubled"] == gathered["doubled"] == default["doubled"]
        assert (sharded["rank0"] == {}) == (rank == 1)
        assert _max_diff(sharded["all"], gathered["all"]) == 0.0
        assert sharded["loss"] == gathered["loss"]


# -- resume into a deferred model ---------------------------------------------------------------------


def _resume(form: str, shared: str, root: str) -> dict:
    torch.manual_seed(0)
    path = os.path.join(shared, f"{form}.ckpt")
    trainer = _trainer(3, root, state_dict_type=form)
    trainer.fit(BigModule(SMALL))
    trainer.save_checkpoint(path)
    torch.manual_seed(1)  # another seed: every value must come from the checkpoint
    resumed = BigModule(SMALL)
    trainer = _trainer(3, root, max_epochs=2, state_dict_type=form)
    trainer.fit(resumed, ckpt_path=path)
    return trainer.strategy.full_state_dict(rank0_only=False)


def _uninterrupted(root: str) -> dict:
    torch.manual_seed(0)
    trainer = _trainer(3, root, max_epochs=2)
    trainer.fit(BigModule(SMALL))
    return trainer.strategy.full_state_dict(rank0_only=False)


def test_resume_into_a_deferred_model(tmp_path):
    shared = str(tmp_path / "shared")
    os.makedirs(shared)
    jobs = [_uninterrupted] + [functools.partial(_resume, form, shared) for form in ("full", "sharded")]
    for reference, full, sharded in run_jobs(jobs, str(tmp_path / "r"), world=2, timeout=900):
        assert _max_diff(full, reference) <= 1e-6
        assert _max_diff(sharded, reference) <= 1e-6


# -- peak memory of every phase -----------------------------------------------------------------------

PHASES = Shape(width=768, blocks=8, tokens=8, micro_batches=2)  # 37.8M parameters


def run_phases(shape: Shape, stage: int, shared: str, root: str) -> dict:
    """One fit of ``shape`` (built in configure_model), a full and a sharded save after it, a resume
    from each and the teardown: the peak resident MiB above the process's start, per phase. (A full
    file is memory-mapped on load: the pages of it a rank reads, about its 1/N, count as resident
    while the load runs; they are the file's, not copies.)"""
    torch.set_num_threads(1)
    reset_peak()
    phases = Phases(baseline=rss_mb())
    torch.manual_seed(0)
    options = {"gather_at_teardown": False} if stage == 3 else {}
    trainer = _trainer(stage, root, callbacks=[phases], **options)
    trainer.fit(BigModule(shape))
    for form in ("full", "sharded"):
        trainer.strategy.config.state_dict_type = form
        trainer.save_checkpoint(os.path.join(shared, f"zero{stage}.{form}.ckpt"))
        phases.measure(f"save {form}")
    peaks, baseline = phases.peaks, phases.baseline
    del trainer, phases  # the first run's state goes (Lightning gives callbacks the module's log method)
    gc.collect()
    reset_peak()
    for form in ("sharded", "full"):
        resumed = Phases(baseline=baseline)
        trainer = _trainer(stage, root, max_epochs=2, callbacks=[resumed], state_dict_type=form, **options)
        trainer.fit(BigModule(shape), ckpt_path=os.path.join(shared, f"zero{stage}.{form}.ckpt"))
        peaks[f"resume {form}"] = max(resumed.peaks.values())
        resumed.measure("teardown")
        peaks["teardown"] = max(peaks.get("teardown", 0.0), resumed.peaks["teardown"])
        del trainer, resumed
        gc.collect()
        reset_peak()
    return peaks


def phase_bound(shape: Shape, world: int, *, prefetch_limit: int = 1, max_reduce_buffers: int = 2) -> float:
    """The most a stage-3 rank may hold in any phase (MB above its start): its model state 16Ψ/N
    (4Ψ_f/N for frozen weights), the units in flight in backward (the one computing, those
    prefetched, the reduce-scatter buffers, the one whose gradients are being copied: all one unit
    each), and 96 MiB for the process (collective buffers, activations, Lightning: about 67
    measured here)."""
    trainable, frozen = psi(shape)
    unit = 4 * 8 * shape.width**2 / 2**20  # MB of one block's fp32 parameters
    units = 1 + prefetch_limit + max_reduce_buffers + 1
    return (16 * trainable + 4 * frozen) / world / 2**20 + units * unit + 96


def setup_bound(shape: Shape, world: int) -> float:
    """The most a stage-3 rank may hold while a deferred model is built and sharded (MB above its
    start): its shard of the weights 4Ψ/N, one unit's full values on the host and its shard being
    made, and the process's 96 MiB (see phase_bound); no optimizer state or gradients exist yet."""
    trainable, frozen = psi(shape)
    unit = 4 * 8 * shape.width**2 / 2**20
    return 4 * (trainable + frozen) / world / 2**20 + 2 * unit + 96


def check_phases(peaks: dict, shape: Shape, world: int) -> float:
    """Every phase within the bound; resuming from a full file also maps the pages it reads."""
    bound = phase_bound(shape, world)
    trainable, frozen = psi(shape)
    mapped = 12 * (trainable + frozen) / world / 2**20  # this rank's part of the file: values and moments
    assert all(v <= bound for k, v in peaks.items() if k != "resume full"), (peaks, bound)
    assert peaks["resume full"] <= bound + mapped, (peaks, bound + mapped)
    return bound


@pytest.mark.skipif(
    not supports_peak_reset(), reason="needs /proc/self/clear_refs to measure peaks per phase"
)
def test_no_phase_holds_the_whole_model(tmp_path):
    """Setup, steps, a full and a sharded save, a resume and the teardown of a 38M-parameter model
    each stay within 16Ψ/N plus the units in flight (phase_bound); the whole model (4Ψ, 144 MiB)
    on top would not fit."""
    shared = str(tmp_path / "shared")
    os.makedirs(shared)
    job = functools.partial(run_phases, PHASES, 3, shared)  # the package's defaults, no malloc variable
    ranks = run_jobs([job], str(tmp_path / "r"), world=2, timeout=900)
    trainable, _ = psi(PHASES)
    for peaks in (ranks[0][0], ranks[1][0]):
        bound = check_phases(peaks, PHASES, 2)
        # one unit on the host at a time: the materialized parameters are freed once sharded, though
        # the optimizer, made while they were on the meta device, still holds them (4Ψ/2 more here)
        assert peaks["setup"] <= setup_bound(PHASES, 2), (peaks["setup"], setup_bound(PHASES, 2))
        assert max(peaks.values()) + 4 * trainable / 2**20 > bound  # one more copy of the model would fail
        assert bound < 16 * trainable / 2**20  # below what one unsharded rank holds (16Ψ)
