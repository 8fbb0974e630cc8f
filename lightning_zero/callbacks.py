"""ZeroMonitor: what each optimizer step communicated, how long it waited, what memory it held.

    from lightning_zero.callbacks import ZeroMonitor
    Trainer(strategy="zero2", callbacks=[ZeroMonitor()], logger=CSVLogger("logs"))

Every optimizer step, rank 0 hands its loggers (``trainer.loggers``) the metrics below, at the
step number the strategy's ledger uses (0 for the first optimizer step):

    zero/<op>_calls, zero/<op>_bytes, zero/<op>_wire_bytes   per op in OPS (and any other op
                                                              the step ran); bytes are logical
    zero/<op>_wait_s, zero/exposed_comm_s                     seconds lost waiting for collectives
    zero/exposed_comm_cuda_events                              1: timed with CUDA events on the
                                                              stream, 0: with the host's clock
    zero/mem_params_bytes, zero/mem_optim_bytes                after the optimizer step
    zero/mem_grads_bytes                                       just before the optimizer step
    zero/mem_gathered_bytes                                    stage 3: units gathered into backward
    zero/int8_fallbacks                                        stage 3 with int8 on the wire: times
                                                              the accuracy guard fell back so far
    zero/step_time_s, zero/step_time_max_over_min              wall clock, over ranks
    zero/busy_time_max_s, zero/busy_time_min_s, zero/busy_time_max_over_min
    zero/loss_scale, zero/skipped_steps                        fp16 loss scaling: the scale after
                                                              the step, steps skipped so far
                                                              (skipped_steps also with the
                                                              nonfinite_grads="skip" guard)

At the end of fit rank 0 prints the measured traffic and memory next to what
:mod:`lightning_zero.planning` predicts for the same Ψ, N, stage, dtypes and optimizer. With a
strategy other than :class:`~lightning_zero.ZeroStrategy` only the step times are logged.
docs/monitoring.md explains how to read every figure.

[Note: a step's window]
A step's figures cover its window: from the start of the first micro-batch of the accumulation
window to the end of the batch whose optimizer step advanced ``trainer.global_step``, with any
validation inside it cut out. The window is read as a slice of the ledger's records (those
appended while it was open), not by the ledger's step number, so the broadcasts of setup and the
collectives of the sanity check, of validation and of checkpointing (which the ledger files under
the step before them) are not counted in any step.

[Note: busy time and stragglers]
Collectives make every rank wait for the slowest one, so wall-clock step times come out nearly
equal on all ranks even when one rank is slow: the fast ranks spend the difference blocked in
``wait()``. A rank's busy time, its step time minus the time it was blocked waiting for this
package's collectives, keeps the difference; its spread over ranks (max / min) is the straggler
signal. The wall-clock spread only shows work done after the last collective of a step.

[Note: exposed communication on GPUs]
A wait for a collective on CUDA tensors does not block the host: the compute stream waits. The
ledger times those waits with CUDA events on the stream and resolves them lazily ([Note: timing a
wait] in ``comm/timing.py``). The window waits for the rank's CUDA stream when it opens and when
it closes (so that its wall time is that of the step's kernels, not of their launch) and then
reads the ledger's waits, whose events have run by then. These are the monitor's own
synchronisations, two per step at its ends (its step-time all-gather synchronises there too),
never the training path's. Each step says how its waits were timed (``StepSample.timing``), and
the summary says it for the run.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.comm import CommLedger
from lightning_zero.comm.ledger import OpTotals, timing_of, wire_bytes
from lightning_zero.comm.timing import CUDA_EVENTS
from lightning_zero.memory import MemoryReport
from lightning_zero.planning import (
    MemoryEstimate,
    int8_wire_bytes,
    model_state_memory,
    optimizer_k,
    step_traffic,
)
from lightning_zero.precision import ZeroGradScaler
from lightning_zero.strategy import ZeroStrategy

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")  # logged every step, 0 when idle
PREFIX = "zero/"  # of every logged metric
LOGICAL_NOTE = (
    "bytes are logical ring-algorithm figures computed from tensor sizes (payload: the full tensor; "
    "wire: what one rank sends), the same on every backend; gloo sends other amounts "
    "(its reduce-scatter of a bucket at stages 1-2 sends as much as an all-reduce)"
)


# --------------------------------------------------------------------------- the run's shape


class FlatLayout(NamedTuple):
    psi: int  # Ψ: trainable elements in the flat spaces (gradient buckets, or stage-3 units)
    padded: int  # the same with each flat space rounded up to a multiple of N
    kept: int  # stage 3: elements of units gathered once per micro-batch (kept from forward to backward)
    kept_padded: int  # the same, padded
    spaces: int  # gradient buckets (stages 0-2) or wrap units (stage 3)


class RunShape(NamedTuple):
    stage: int  # 0 = plain DP, 1-3 = ZeRO stage
    world_size: int  # N
    param_bytes: int  # bytes per parameter element
    grad_bytes: int  # bytes per gradient element
    optimizer: str  # what k was taken from ("adam", "sgd_momentum", ...; or the class name)
    k: float | None  # optimizer-state bytes per parameter; None: not known for this optimizer
    master_copy: bool  # the optimizer steps fp32 master copies (mixed precision), counted in k
    micro_batches: int  # micro-batches per optimizer step (accumulate_grad_batches)
    accumulate_unsharded: bool  # stages 2-3: one reduce-scatter per window instead of per micro-batch
    layout: FlatLayout
    found_inf: bool = False  # fp16 loss scaling: one 4-byte AllReduce of the overflow flags per step
    wire_param_bytes: float | None = None  # bytes per gathered element on the wire; None: param_bytes
    wire_grad_bytes: float | None = None  # bytes per reduced element on the wire; None: grad_bytes


class OpBytes(NamedTuple):
    payload: float  # bytes of the full logical tensors per step
    wire: float  # bytes one rank sends per step under the ring algorithm


def flat_layout(engine: Any) -> FlatLayout:
    """Ψ, padding and unit split of a running stage's flat spaces (read only)."""
    zero3 = getattr(engine, "zero3", None)
    if zero3 is not None:
        units = zero3.units
        kept = [u for u in units if u is zero3.root_unit or not zero3.reshard_after_forward]
        return FlatLayout(
            sum(u.flat.numel for u in units),
            sum(u.flat.padded_numel for u in units),
            sum(u.flat.numel for u in kept),
            sum(u.flat.padded_numel for u in kept),
            len(units),
        )
    specs = engine.wrapped.sync.bucket_specs()
    return FlatLayout(sum(s.numel for s in specs), sum(s.padded_numel for s in specs), 0, 0, len(specs))


def optimizer_state_k(
    optimizers: Sequence[Optimizer], *, state_bytes: int, master_copy: bool
) -> tuple[str, float | None]:
    """The name and k (optimizer bytes per parameter) of the optimizer, when the planner knows it.

    Args:
        optimizers: the trainer's optimizers; k is known for one Adam, AdamW or SGD.
        state_bytes: bytes per element of the optimizer's states: the parameters' dtype, or the
            master dtype under a mixed-precision policy.
        master_copy: the optimizer steps a master copy of the parameters (mixed precision); without
            one it steps the parameter shards themselves.
    """
    if len(optimizers) != 1:
        return f"{len(optimizers)} optimizers", None
    opt = optimizers[0]
    groups = opt.param_groups
    key = None
    if isinstance(opt, torch.optim.Adam) and not any(g.get("amsgrad") for g in groups):
        key = "adamw" if isinstance(opt, torch.optim.AdamW) else "adam"
    elif isinstance(opt, torch.optim.SGD):
        momentum = [bool(g.get("momentum")) for g in groups]
        key = "sgd_momentum" if all(momentum) else "sgd" if not any(momentum) else None
    if key is None:
        return type(opt).__name__, None
    return key, optimizer_k(key, master_copy=master_copy) * state_bytes / 4  # the planner's k is fp32


# --------------------------------------------------------------------------- predictions


def _volumes(shape: RunShape, psi: float, stage: int, groups: int | None = None) -> tuple[Any, Any]:
    """(wire, payload) Traffic of the planner for ``psi`` elements; payload is the large-N limit."""
    param_bytes = shape.param_bytes if shape.wire_param_bytes is None else shape.wire_param_bytes
    grad_bytes = shape.grad_bytes if shape.wire_grad_bytes is None else shape.wire_grad_bytes
    kwargs = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, groups=groups)
    return step_traffic(psi, shape.world_size, stage, **kwargs), step_traffic(psi, None, stage, **kwargs)


def predict_traffic(shape: RunShape, *, padded: bool = False) -> dict[str, OpBytes]:
    """Bytes per optimizer step by op, from :func:`lightning_zero.planning.step_traffic`.

    Stage 0 and 1 reduce once per step (no_sync inside the accumulation window); stage 2
    reduce-scatters every micro-batch and stage 3 gathers and reduce-scatters every micro-batch,
    unless ``accumulate_unsharded``. Stage 3 gathers a unit kept from forward into backward (the
    root unit) once per micro-batch, every other unit twice. ``padded``: Ψ with each flat space
    rounded up to a multiple of N, which is what the collectives move.
    """
    if shape.world_size < 2:
        return {}  # one process sends nothing
    layout, m = shape.layout, shape.micro_batches
    psi, kept = (layout.padded, layout.kept_padded) if padded else (layout.psi, layout.kept)
    flag = _found_inf_bytes(shape)
    if shape.stage == 0:
        wire, logical = _volumes(shape, psi, 0)
        return {"all_reduce": OpBytes(logical.all_reduce / 2 + flag.payload, wire.all_reduce + flag.wire)}
    extra = {"all_reduce": flag} if shape.found_inf else {}
    reduce_times = m if shape.stage >= 2 and not shape.accumulate_unsharded else 1
    wire, logical = _volumes(shape, psi, shape.stage)
    reduce = OpBytes(logical.reduce_scatter * reduce_times, wire.reduce_scatter * reduce_times)
    if shape.stage < 3:
        return {"reduce_scatter": reduce, "all_gather": OpBytes(logical.all_gather, wire.all_gather), **extra}
    wire_rest, logical_rest = _volumes(shape, psi - kept, 3)  # gathered in forward and in backward
    wire_kept, logical_kept = _volumes(shape, kept, 3, groups=1)  # gathered once
    gather = OpBytes(
        (logical_rest.all_gather + logical_kept.all_gather) * m,
        (wire_rest.all_gather + wire_kept.all_gather) * m,
    )
    return {"reduce_scatter": reduce, "all_gather": gather, **extra}


def _found_inf_bytes(shape: RunShape) -> OpBytes:
    """The loss scaler's AllReduce of one fp32 overflow flag (zero without loss scaling)."""
    if not shape.found_inf:
        return OpBytes(0.0, 0.0)
    return OpBytes(4.0, wire_bytes("all_reduce", 4, shape.world_size))


def predict_memory(shape: RunShape, *, padded: bool = False) -> MemoryEstimate:
    """Model-state bytes per rank, from :func:`lightning_zero.planning.model_state_memory`."""
    psi = shape.layout.padded if padded else shape.layout.psi
    return model_state_memory(
        psi,
        shape.world_size,
        shape.stage,
        k=shape.k or 0.0,
        param_bytes=shape.param_bytes,
        grad_bytes=shape.grad_bytes,
    )


# --------------------------------------------------------------------------- measurements


class StepSample(NamedTuple):
    step: int  # the optimizer step (the ledger's step number)
    traffic: dict[str, OpTotals]  # op -> calls and bytes inside the step's window
    waits: dict[str, float]  # op -> seconds this rank was blocked in wait()
    memory: MemoryReport | None  # params, optimizer after the step, grads before it; None: no ledger
    gathered: int  # bytes of parameters held beyond the resting ones when backward starts
    times: Tensor  # (N, 2): per rank, wall-clock and busy seconds of the step
    timing: str | None = None  # how the waits were timed: "wall-clock", "cuda-events"; None: no wait
    int8_fallbacks: int | None = None  # stage 3 with int8 on the wire: the guard's fallbacks so far


def traffic_of(records: Sequence[Any]) -> dict[str, OpTotals]:
    """Calls and bytes per op of ``records`` (CommRecords)."""
    totals: dict[str, OpTotals] = {}
    for r in records:
        calls, payload, wire = totals.get(r.op, OpTotals(0, 0, 0.0))
        totals[r.op] = OpTotals(calls + 1, payload + r.payload_bytes, wire + r.wire_bytes)
    return totals


def ops_of(traffic: dict[str, Any]) -> list[str]:
    """OPS, then any other op the ledger recorded (a checkpoint's gather or barrier), sorted."""
    return [*OPS, *sorted(op for op in traffic if op not in OPS)]


def ratio(values: Tensor) -> float:
    """max / min of ``values`` (1 when there is one value; inf when the minimum is 0)."""
    low, high = float(values.min()), float(values.max())
    return high / low if low > 0 else (1.0 if high == 0 else float("inf"))


def step_metrics(sample: StepSample) -> dict[str, float]:
    """The logged metrics of one step (names in the module docstring)."""
    wall, busy = sample.times[:, 0], sample.times[:, 1]
    metrics = {
        "step_time_s": float(wall.max()),
        "step_time_max_over_min": ratio(wall),
        "busy_time_max_s": float(busy.max()),
        "busy_time_min_s": float(busy.min()),
        "busy_time_max_over_min": ratio(busy),
    }
    if sample.memory is not None:
        for op in ops_of(sample.traffic):
            totals = sample.traffic.get(op, OpTotals(0, 0, 0.0))
            metrics[f"{op}_calls"] = float(totals.calls)
            metrics[f"{op}_bytes"] = float(totals.payload_bytes)
            metrics[f"{op}_wire_bytes"] = float(totals.wire_bytes)
            metrics[f"{op}_wait_s"] = sample.waits.get(op, 0.0)
        metrics["exposed_comm_s"] = sum(sample.waits.values())
        metrics["exposed_comm_cuda_events"] = float(CUDA_EVENTS in (sample.timing or ""))
        metrics["mem_params_bytes"] = float(sample.memory.parameters)
        metrics["mem_grads_bytes"] = float(sample.memory.gradients)
        metrics["mem_optim_bytes"] = float(sample.memory.optimizer_states)
        metrics["mem_gathered_bytes"] = float(sample.gathered)
    if sample.int8_fallbacks is not None:
        metrics["int8_fallbacks"] = float(sample.int8_fallbacks)
    return {PREFIX + name: value for name, value in metrics.items()}


def loss_scale_metrics(trainer: pl.Trainer) -> dict[str, float]:
    """The loss scaler's scale and skipped steps, or the non-finite guard's skipped steps (none
    without either)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if not isinstance(scaler, ZeroGradScaler) or not scaler.is_enabled():
        guard = getattr(trainer.strategy, "nonfinite_guard", None)
        return {} if guard is None else {PREFIX + "skipped_steps": float(guard.skipped_steps)}
    return {PREFIX + "loss_scale": scaler.get_scale(), PREFIX + "skipped_steps": float(scaler.skipped_steps)}


class _Window:
    """The records, blocked time and wall time of one optimizer step (see [Note: a step's window]).

    On a CUDA ``device`` the window waits for the stream at its ends, so that its wall time is
    that of the step's kernels, not of their launch (see [Note: exposed communication on GPUs]).
    """

    def __init__(self, step: int, ledger: CommLedger | None, *, device: torch.device | None = None) -> None:
        self.step = step  # trainer.global_step when the window opened
        self.ledger = ledger  # None: a strategy without a ledger
        self.device = device  # the rank's device; CUDA: the window's ends wait for its stream
        self.records: list = []  # CommRecords of the closed segments
        self.waits: Counter[str] = Counter()  # op -> seconds blocked in the closed segments
        self.timed: Counter[str] = Counter()  # timing method -> waits timed with it, closed segments
        self.elapsed = 0.0  # wall seconds of the closed segments
        self.open = False  # a segment is running
        self._start = 0.0  # perf_counter at the start of the open segment
        self._index = 0  # ledger.recorded at the start of the open segment
        self._waits: Counter[str] = Counter()  # ledger wait totals at the start of the open segment
        self._timed: Counter[str] = Counter()  # ledger wait timings at the start of the open segment
        self.resume()

    def resume(self) -> None:
        if self.open:
            return
        self._sync()
        self.open, self._start = True, time.perf_counter()
        if self.ledger is not None:  # O(ops): see [Note: bounded ledger]
            self._index, self._waits = self.ledger.recorded, self.ledger.wait_totals()
            self._timed = self.ledger.wait_timings()

    def pause(self) -> None:
        if not self.open:
            return
        self.open = False
        self._sync()
        self.elapsed += time.perf_counter() - self._start
        if self.ledger is not None:  # O(collectives of the segment), whatever the run's length
            self.records.extend(self.ledger.records_since(self._index))
            self.waits.update(self.ledger.wait_totals() - self._waits)  # settles pending waits first
            self.timed.update(self.ledger.wait_timings() - self._timed)

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


# --------------------------------------------------------------------------- the callback


class ZeroMonitor(Callback):
    """Logs the communication ledger, exposed communication, memory and step-time spread per step.

    Args:
        log_every_n_steps: log every n-th optimizer step (the step-time all-gather runs on those
            steps only). Every step is still measured for the end-of-fit summary.
        print_summary: at the end of fit, print predicted vs measured traffic and memory on rank 0.
    """

    def __init__(self, *, log_every_n_steps: int = 1, print_summary: bool = True) -> None:
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int):
            raise TypeError(f"log_every_n_steps must be an int, got {log_every_n_steps!r}")
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.print_summary = print_summary
        self._reset()

    def _reset(self) -> None:
        self._window: _Window | None = None  # the optimizer step being measured
        self._grads = 0  # largest gradient bytes seen before an optimizer step of the window
        self._forward_params = 0  # largest parameter bytes seen when a backward of the window started
        self._shape: RunShape | None = None  # Ψ, N, stage, ... of the run, refreshed every step
        self._traffic_seen: Counter[tuple] = Counter()  # per-step traffic -> steps that had it
        self._last: StepSample | None = None  # the latest step's measurements
        self._gathered_max = 0  # largest mem_gathered_bytes of the run
        self._steps = 0  # optimizer steps measured
        self._wall_sum = 0.0  # seconds: sum over steps of the slowest rank's step time
        self._exposed_sum = 0.0  # seconds: sum over steps of this rank's exposed communication
        self._worst_busy_ratio = 1.0  # largest busy-time max/min over ranks of any logged step
        self._timed: Counter[str] = Counter()  # timing method -> waits timed with it, all steps

    @property
    def timing(self) -> str | None:
        """How this rank's exposed communication was timed so far: ``"wall-clock"`` (host clock
        around a blocking wait), ``"cuda-events"`` (on the CUDA stream), both joined by " + "; None
        while no step waited for a collective. See [Note: exposed communication on GPUs]."""
        return timing_of(self._timed)

    @staticmethod
    def _zero(trainer: pl.Trainer) -> ZeroStrategy | None:
        strategy = trainer.strategy
        return strategy if isinstance(strategy, ZeroStrategy) and strategy.engine is not None else None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        if self._zero(trainer) is None:
            rank_zero_warn(
                f"ZeroMonitor: strategy {type(trainer.strategy).__name__} keeps no communication ledger; "
                "only step times are logged (use a lightning_zero ZeroStrategy for traffic and memory)"
            )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._window is None:
            zero = self._zero(trainer)
            ledger = zero.ledger if zero is not None else None
            self._window = _Window(trainer.global_step, ledger, device=trainer.strategy.root_device)
            self._grads = self._forward_params = 0

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._window is not None:
            self._window.pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._window is not None:
            self._window.resume()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        zero = self._zero(trainer)
        if zero is not None and self._window is not None and zero.config.stage == 3:  # units gathered
            self._forward_params = max(self._forward_params, zero.memory_report().parameters)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        zero = self._zero(trainer)
        if zero is not None and self._window is not None:
            self._grads = max(self._grads, zero.memory_report().gradients)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        window = self._window
        if window is None or trainer.global_step == window.step:
            return  # inside an accumulation window: no optimizer step yet
        self._window = None
        window.pause()
        log_now = window.step % self.log_every_n_steps == 0
        sample = self._measure(trainer, window, gather_times=log_now)
        self._remember(sample)
        self._timed.update(window.timed)
        if log_now and trainer.is_global_zero:
            metrics = {**step_metrics(sample), **loss_scale_metrics(trainer)}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=window.step)

    def _measure(self, trainer: pl.Trainer, window: _Window, *, gather_times: bool) -> StepSample:
        busy = window.elapsed - sum(window.waits.values())
        mine = torch.tensor(
            [[window.elapsed, busy]], dtype=torch.float64, device=trainer.strategy.root_device
        )
        times = trainer.strategy.all_gather(mine) if gather_times else mine
        times = times.reshape(-1, 2).cpu()  # (N, 2): one row per rank
        zero = self._zero(trainer)
        if zero is None:
            return StepSample(window.step, {}, {}, None, 0, times)
        report = zero.memory_report()
        memory = MemoryReport(report.parameters, self._grads, report.optimizer_states)
        gathered = max(self._forward_params - report.parameters, 0)
        self._shape = run_shape(trainer, zero)
        traffic, waits, timing = traffic_of(window.records), dict(window.waits), timing_of(window.timed)
        wrapped = getattr(zero.engine, "wrapped", None)  # its sync: stage 3's units, stages 1-2's buckets
        quantized = wrapped is not None and (zero.config.quantize_weights or zero.config.quantize_grads)
        fallbacks = wrapped.sync.quantize_fallbacks() if quantized else None
        return StepSample(window.step, traffic, waits, memory, gathered, times, timing, fallbacks)

    def _remember(self, sample: StepSample) -> None:
        self._last = sample
        self._traffic_seen[tuple(sorted(sample.traffic.items()))] += 1
        self._gathered_max = max(self._gathered_max, sample.gathered)
        self._steps += 1
        self._wall_sum += float(sample.times[:, 0].max())
        self._exposed_sum += sum(sample.waits.values())
        self._worst_busy_ratio = max(self._worst_busy_ratio, ratio(sample.times[:, 1]))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (self.print_summary and trainer.is_global_zero and self._last is not None):
            return
        typical = dict(self._traffic_seen.most_common(1)[0][0])
        mean_wall, mean_exposed = self._wall_sum / self._steps, self._exposed_sum / self._steps
        timing = StepTimes(self._steps, mean_wall, mean_exposed, self._worst_busy_ratio, self.timing)
        sections = summary_sections(self._shape, typical, self._last.memory, self._gathered_max, timing)
        print_sections(sections)


def run_shape(trainer: pl.Trainer, zero: ZeroStrategy) -> RunShape:
    """What the planner needs to predict this run (read from the running strategy)."""
    config = zero.config
    layout = flat_layout(zero.engine)
    param = next(p for p in trainer.lightning_module.parameters() if p.requires_grad)
    element = param.element_size()
    policy = getattr(zero.engine, "policy", None)  # mixed precision: fp32 masters in the optimizer
    grad_bytes = element if policy is None else torch.empty((), dtype=policy.reduce_dtype).element_size()
    state_bytes = element if policy is None else torch.empty((), dtype=policy.master_dtype).element_size()
    name, k = optimizer_state_k(trainer.optimizers, state_bytes=state_bytes, master_copy=policy is not None)
    return RunShape(
        stage=config.stage,
        world_size=trainer.world_size,
        param_bytes=element,
        grad_bytes=grad_bytes,
        optimizer=name,
        k=k,
        master_copy=policy is not None,
        micro_batches=trainer.accumulate_grad_batches,
        accumulate_unsharded=config.accumulate_unsharded,
        layout=layout,
        found_inf=isinstance(getattr(trainer.precision_plugin, "scaler", None), ZeroGradScaler),
        wire_param_bytes=int8_wire_bytes(config.quantize_block) if config.quantize_weights else None,
        wire_grad_bytes=int8_wire_bytes(config.quantize_block) if config.quantize_grads else None,
    )


# --------------------------------------------------------------------------- the summary


class StepTimes(NamedTuple):
    steps: int  # optimizer steps measured
    mean_step_s: float  # mean wall-clock step time of the slowest rank
    mean_exposed_s: float  # mean exposed communication of rank 0
    worst_busy_ratio: float  # largest busy-time max/min over ranks of any logged step
    exposed_timing: str | None = None  # how exposed communication was timed; None: no wait


class Section(NamedTuple):
    title: str  # table title
    headers: tuple[str, ...]  # column headers
    rows: list[tuple[str, ...]]  # formatted cells
    notes: tuple[str, ...] = ()  # lines printed under the table


def format_bytes(nbytes: float | None) -> str:
    """``12,345 B`` below 10 KiB, else KiB / MiB / GiB with three significant digits; ``-`` for None."""
    if nbytes is None:
        return "-"
    if abs(nbytes) < 10 * 1024:
        return f"{nbytes:,.0f} B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:,.0f} B"  # unreachable; keeps the return type plain


def format_diff(measured: float | None, predicted: float | None) -> str:
    """measured - predicted, signed, in bytes; ``-`` when either is missing."""
    if measured is None or predicted is None:
        return "-"
    return f"{measured - predicted:+,.0f} B"


def traffic_section(shape: RunShape, measured: dict[str, OpTotals]) -> Section:
    """Bytes per optimizer step by op: planner vs ledger."""
    predicted = predict_traffic(shape)
    rows = []
    for op in ops_of(measured):
        got, want = measured.get(op), predicted.get(op)
        if got is None and want is None:
            continue
        payload = got.payload_bytes if got is not None else 0
        wire = got.wire_bytes if got is not None else 0.0
        rows.append(
            (
                op,
                str(got.calls if got is not None else 0),
                format_bytes(want.payload if want else None),
                format_bytes(payload),
                format_bytes(want.wire if want else None),
                format_bytes(wire),
                format_diff(wire, want.wire if want else None),
            )
        )
    headers = (
        "op",
        "calls",
        "payload predicted",
        "payload measured",
        "wire predicted",
        "wire measured",
        "wire diff",
    )
    return Section("traffic per optimizer step, one rank", headers, rows, _traffic_notes(shape))


def _traffic_notes(shape: RunShape) -> tuple[str, ...]:
    layout = shape.layout
    pad = predict_traffic(shape, padded=True)
    plain = predict_traffic(shape)
    extra = sum(pad[op].wire - plain[op].wire for op in plain)
    notes = [
        LOGICAL_NOTE,
        f"padding: {layout.spaces} flat space(s) rounded up to a multiple of N = {shape.world_size} add "
        f"{layout.padded - layout.psi} element(s): up to {format_bytes(extra)} more on the wire than predicted",
        "measured: the most common per-step figures; ops without a prediction (broadcast of buffers, "
        "the gradient-norm all-reduce of clipping) are not in the plan",
    ]
    if shape.stage == 3:
        notes.append(
            f"stage 3: {layout.kept:,} of Ψ gathered once per micro-batch (kept from forward into backward), "
            "the rest twice"
        )
    return tuple(notes)


def memory_section(shape: RunShape, measured: MemoryReport, gathered: int) -> Section:
    """Model-state bytes per rank by category: planner vs this rank's tensors."""
    want = predict_memory(shape)
    k_known = shape.k is not None
    optimizer = want.optimizer if k_known else None
    rows = [
        ("parameters", format_bytes(want.params), format_bytes(measured.parameters)),
        ("gradients", format_bytes(want.grads), format_bytes(measured.gradients)),
        ("optimizer states", format_bytes(optimizer), format_bytes(measured.optimizer_states)),
        ("gathered units", "-", format_bytes(gathered)),
    ]
    diffs = [
        format_diff(measured.parameters, want.params),
        format_diff(measured.gradients, want.grads),
        format_diff(measured.optimizer_states, optimizer),
        "-",
    ]
    rows = [(*row, diff) for row, diff in zip(rows, diffs)]
    total = want.params + want.grads + (optimizer or 0.0)
    total_diff = format_diff(measured.total, total if k_known else None)
    rows.append(("total", format_bytes(total if k_known else None), format_bytes(measured.total), total_diff))
    headers = ("category", "predicted", "measured", "diff")
    return Section("model-state memory per rank (rank 0)", headers, rows, _memory_notes(shape))


def _element_sizes(shape: RunShape) -> str:
    if shape.param_bytes == shape.grad_bytes:
        return f"{shape.param_bytes}-byte parameters and gradients"
    return f"{shape.param_bytes}-byte parameters, {shape.grad_bytes}-byte gradients"


def _memory_notes(shape: RunShape) -> tuple[str, ...]:
    sharded = {0: "nothing", 1: "optimizer states", 2: "optimizer states, gradients", 3: "everything"}
    k = "unknown: no prediction" if shape.k is None else f"{shape.k:g}"
    return (
        f"stage {shape.stage} shards {sharded[shape.stage]} over N = {shape.world_size}; "
        f"{_element_sizes(shape)}, {shape.optimizer} k = {k} "
        f"({'with' if shape.master_copy else 'no'} master copy)",
        "parameters and optimizer states after the optimizer step, gradients just before it; "
        "gathered units: parameters held beyond those when backward starts (stage 3)",
        "measured includes padding of the flat spaces and 0-dim optimizer state (a 4-byte step count "
        "per stepped tensor)",
    )


def summary_sections(
    shape: RunShape | None,
    traffic: dict[str, OpTotals],
    memory: MemoryReport | None,
    gathered: int,
    timing: StepTimes,
) -> list[Section]:
    """The end-of-fit tables: traffic and memory (a ZeroStrategy run), then step times."""
    rows = [
        ("optimizer steps measured", f"{timing.steps}"),
        ("mean step time (slowest rank)", f"{timing.mean_step_s * 1e3:.4g} ms"),
        ("mean exposed communication (rank 0)", f"{timing.mean_exposed_s * 1e3:.4g} ms"),
        ("exposed communication timed with", timing.exposed_timing or "- (no collective waited)"),
        ("worst busy-time max/min over ranks", f"{timing.worst_busy_ratio:.3g}"),
    ]
    times = Section("step times", ("quantity", "value"), rows)
    if shape is None or memory is None:
        return [times]
    psi = shape.layout.psi
    header = Section(
        f"ZeroMonitor: predicted vs measured, Ψ = {psi:,}, N = {shape.world_size}, stage {shape.stage}",
        (),
        [],
    )
    return [header, traffic_section(shape, traffic), memory_section(shape, memory, gathered), times]


def print_sections(sections: Sequence[Section]) -> None:
    """Print with rich when it is installed, as plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for section in sections:
            print(plain_text(section))
        return
    console = Console() if sys.stdout.isatty() else Console(width=140)
    for section in sections:
        if not section.headers:
            console.print(section.title, highlight=False, markup=False)
            continue
        table = Table(title=section.title, title_justify="left")
        for i, header in enumerate(section.headers):
            table.add_column(header, justify="left" if i == 0 else "right")
        for row in section.rows:
            table.add_row(*row)
        console.print(table)
        for note in section.notes:
            console.print(_wrap(note, console.width), highlight=False, markup=False)


def plain_text(section: Section) -> str:
    """One section as aligned plain-text columns."""
    lines = [section.title]
    if section.headers:
        widths = [max([len(h), *(len(r[i]) for r in section.rows)]) for i, h in enumerate(section.headers)]
        lines += [
            "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in (section.headers, *section.rows)
        ]
    lines += [_wrap(note, 100) for note in section.notes]
    return "\n".join(lines)


def _wrap(note: str, width: int) -> str:
    return textwrap.fill(note, width=width, initial_indent="  ", subsequent_indent="    ")


class ProfileSteps(Callback):
    """Records a ``torch.profiler`` trace of some optimizer steps on every rank (Chrome/Perfetto JSON).

    The collectives appear under their ledger names (``zero3/all_gather/unit=blocks.1`` on the
    launching thread, the backend's own event, e.g. ``gloo:all_gather``, on its worker thread), so
    the trace shows which unit's gather runs while which unit computes.

    Args:
        dirpath: where ``trace_rank{r}.json`` goes.
        start: the first optimizer step recorded (after warm-up).
        steps: how many optimizer steps are recorded.
    """

    def __init__(self, dirpath: str, *, start: int = 5, steps: int = 1) -> None:
        self.dirpath = dirpath
        self.start = start
        self.steps = steps
        self._profiler: torch.profiler.profile | None = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._profiler is None and trainer.global_step == self.start:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._profiler is not None and trainer.global_step >= self.start + self.steps:
            self._finish(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._profiler is not None:
            self._finish(trainer)

    def _finish(self, trainer: pl.Trainer) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        os.makedirs(self.dirpath, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(self.dirpath, f"trace_rank{trainer.global_rank}.json"))
