"""ZeroConfig: every option of the strategy, validated where it enters.

The same dataclass is registered in Hydra's ConfigStore (``schema/strategy``), so a typo in a
command-line override (``strategy.bucket_cap_mbb=1``) is an error instead of a silently ignored key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_STAGES = (0, 1, 2, 3)  # stages this build implements
STATE_DICT_TYPES = ("full", "sharded")  # checkpoint forms (lightning_zero/checkpoint/)
NONFINITE_ACTIONS = ("off", "skip", "stop")  # what nonfinite_grads may ask for
CPU_ALLOCATOR_MODES = ("tuned", "default")  # cpu_allocator values (lightning_zero/allocator.py)


@dataclass
class ZeroConfig:
    """Options of :class:`~lightning_zero.ZeroStrategy`.

    Args:
        stage: ZeRO stage. 0 = plain data parallel (bucketed AllReduce of gradients); 1 = shard
            the optimizer state (ReduceScatter of gradients, AllGather of updated parameters);
            2 = shard the gradients too (a bucket's full gradient is freed once reduce-scattered);
            3 = shard the parameters too (one flat parameter per wrap unit, gathered before use).
        bucket_cap_mb: size of a gradient bucket in MiB. Small buckets start communicating early
            but pay the per-collective latency many times; large buckets leave the last bucket's
            communication exposed after backward.
        first_bucket_cap_mb: size of the first bucket (the last layers' gradients, ready first),
            kept small so that communication starts as early as possible in backward.
        broadcast_buffers: broadcast module buffers from rank 0 at every synchronised training
            forward (as torch DDP does), so that e.g. BatchNorm statistics agree across ranks.
        find_unused_parameters: allow parameters that receive no gradient in a synchronised
            backward. Off: such a parameter is an error that names it. On: its slot is reduced as
            zeros and an extra small AllReduce of the per-parameter used-map runs each step.
        accumulate_unsharded: stages 2-3 with gradient accumulation: keep full local gradients
            across the accumulation window and reduce-scatter once at its end (no_sync; traffic of
            one step, full gradients held), instead of reduce-scattering every micro-batch into
            the 1/N shard (memory stays 1/N, traffic grows with the window).
        wrap_policy: stage 3: which modules become units: a class import path
            (``"examples.gpt.Block"``), a list of them, classes, or a callable
            ``(module, name) -> bool``. None: the whole model is one unit.
        min_num_params: stage 3: instead of classes, make every module with at least this many
            parameters (not already in a nested unit) a unit.
        prefetch: stage 3: gather the next unit while the current one computes (forward order;
            reverse order in backward). Overlaps communication, holds one more unit gathered.
        prefetch_limit: stage 3: how many units ahead may be gathering at once (memory bound).
        reshard_after_forward: stage 3: free a unit's parameters after its forward and gather
            them again for backward (3Ψ traffic). False keeps them from forward to backward
            (2Ψ traffic, the gathered model held through the step).
        param_dtype: mixed precision: the dtype the module computes in and reduces gradients in,
            with fp32 master weights held by the optimizer (see docs/mixed-precision.md).
            None follows Lightning's ``precision`` flag ("bf16-mixed" -> "bf16", "16-mixed" ->
            "fp16"; "32-true" -> fp32, no master copy). "fp16" adds dynamic loss scaling whose
            overflow check all ranks agree on (docs/mixed-precision.md).
        reduce_dtype: dtype of gradients on the wire and of their accumulation across
            micro-batches; None: param_dtype. "fp32" under bf16/fp16 parameters sums in fp32
            (twice the bytes on the wire; stages 0-1 hold fp32 gradient buckets).
        param_init_fn: stage 3, deferred initialisation (a model built in ``configure_model`` or
            under ``trainer.init_module(empty_init=True)``, on the meta device): called with every
            module that owns meta tensors, children first, after the module's own
            ``reset_parameters()``; a callable or its import path. None: ``reset_parameters()``
            alone (a module without one is an error naming it).
        gather_at_teardown: stage 3, the end of fit: True gathers the full weights into the
            module on every rank (the whole model on each rank once more; handy for evaluating a
            small model afterwards), False leaves it sharded (``strategy.full_state_dict()`` and
            ``strategy.gathered()`` still give full weights, and calling the module still
            gathers each unit as it runs). None: True unless the model was built on the meta
            device, the sign that it does not fit one rank.
        max_reduce_buffers: stages 2-3: how many full-size gradient buffers (reduce-scatter inputs)
            may be alive at once in backward (stage 2: the buckets reducing and the one filling);
            before another is needed, the oldest reduce-scatter is waited and its buffer freed.
            Small keeps the gradient memory of backward at a few buckets or units instead of the
            whole model; larger lets more communication overlap.
        elementwise_optimizers: stages 1-3: optimizer classes (import paths) to treat as
            elementwise besides SGD, Adam, AdamW, Adamax, NAdam, RAdam, Adagrad, RMSprop and
            Adadelta; the sharded stages refuse any other optimizer at setup.
        state_dict_type: how checkpoints are written. ``"full"``: rank 0 writes one file with the
            full model and optimizer state under the original parameter names. ``"sharded"``:
            every rank writes only its own shards, in parallel, into a directory in the
            ``torch.distributed.checkpoint`` format (docs/checkpoints.md). Either form resumes
            with any stage on any number of ranks.
        ledger_records: how many of the latest collectives the communication ledger keeps in
            detail (name, sizes); per-step aggregates and run totals are kept apart, so memory
            stays bounded however long the run (docs/monitoring.md).
        handle_signals: during fit, SIGTERM, SIGUSR1 and SIGINT only set a flag; at the next
            optimizer-step boundary all ranks agree on it, save a checkpoint and stop with a
            non-zero status that names the signal (under SLURM, SIGUSR1 also requeues the job).
            Off: Lightning's own handlers, which run a collective inside the handler (docs/failures.md).
        nonfinite_grads: a NaN or inf in the loss or the gradients of any rank: ``"off"`` (train
            on, as torch DDP does), ``"skip"`` (every rank skips the optimizer step: weights and
            optimizer state untouched, counted as a skipped step) or ``"stop"`` (every rank raises,
            naming the ranks and the step). One AllReduce of 8N bytes per optimizer step when on.
        watchdog_s: a collective that waits longer than this many seconds makes every rank post
            its latest collectives (sequence number, op, name, bytes) in the process group's store;
            two ranks with different collectives under one sequence number are a desync, and every
            rank stops naming them; otherwise the report (a slow rank, a stuck link) is printed
            and training goes on. A slow rank (a long step, save or validation) is never a desync,
            so the default only bounds how long a desync that the per-collective check on gloo
            and the per-batch agreement do not catch (on NCCL, within a step) can last: lower
            ends it sooner, higher prints fewer reports during long healthy waits
            (docs/failures.md). None: off.
        fault_wait_s: when a collective fails, how long a rank waits for the failing rank's
            message in the store before naming the ranks that left without one.
        keep_previous_checkpoint: keep the previous version of a checkpoint that is overwritten
            under the same name (``.NAME.previous``), so that a damaged ``last.ckpt`` falls back to
            it; costs the disk space of one more copy per such name.
        verify_checkpoints: check every tensor (full form) or chunk (sharded form) against the
            CRC32 recorded when it was written, when loading; a mismatch is a CheckpointError
            naming the file and the tensor.
        cpu_allocator: training on CPU under Linux with glibc: ``"tuned"`` fixes glibc's mmap
            and trim thresholds through ``mallopt``. On several ranks the model is set up under a
            4 MiB mmap threshold at every stage, and stages 2-3 train under it, so that freed
            blocks of 4 MiB and more (the unsharded model, buckets, gathered units, gradient
            buffers) go back to the system and the memory a stage frees shows in the process's
            resident size; stages 0-1, one rank, and stages 2-3 whose units and buckets are all
            smaller than 4 MiB (nothing to return) train at the ceiling of glibc's own adjustment
            (32 MiB).
            The trim threshold is 64 MiB at every stage, so that no step gives small blocks' heap
            pages back only to fault them in again. ``"default"`` leaves glibc's defaults.
            Settings the user made in the environment are kept either way; nothing changes on
            GPUs or other C libraries (lightning_zero/allocator.py).
        shard_size: hybrid sharding (stages 1-3): the ranks form groups of this many consecutive
            ranks; each group shards the model state and the groups replicate each other
            (gradients reduce-scattered inside the group, then all-reduced across groups, shard
            by shard; parameters gathered inside the group only). ``"node"``: one group per node
            (ranks per node from the cluster environment). None: one group of all ranks (full
            sharding). ``"auto"``: chosen at setup by the planner from the model's size, the
            device's memory and the two links measured then (a few timed all-reduces inside a node
            and across nodes); the choice and its alternatives are printed. A group inside a node keeps the all-gathers and reduce-scatters off the
            inter-node links, at the price of memory: the sharded terms of the formulas divide
            by shard_size instead of the world size (docs/planning.md, "Hybrid sharding"). It
            must divide the world size and the ranks per node (or be a multiple of them).
        quantize_weights: stage 3: each unit's all-gather sends its weights as int8 blocks with
            one fp32 scale per block (ZeRO++'s qwZ): about 4x fewer bytes than fp32, 2x fewer than
            bf16, at the price of computing with weights rounded to 1/254 of their block's
            largest value. The shards (fp32 masters under bf16) stay the only copy and what the
            optimizer steps; checkpoints hold full values (docs/quantized.md). The root unit (the
            parameters outside every wrap unit) is gathered in full precision: it stays gathered
            through the step, where user code reads it. Needs ``reshard_after_forward``.
        quantize_grads: stages 1-3: each gradient reduction (a stage-3 unit's, a stage 1-2
            bucket's) sends int8 blocks (ZeRO++'s qgZ), as an all-to-all whose chunks every rank
            dequantizes and sums in fp32, so that each value is rounded once; accumulation and the
            step stay in full precision.
        quantize_block: elements per int8 block (one fp32 scale each); blocks never span two
            parameters. Smaller blocks follow the values' range more closely and send more scales
            (4 bytes per block). A multiple of 32 up to 65536.
        quantize_guard: the accuracy guard of quantized communication: when a block of some rank
            lost more than this share of its nonzero values to rounding (outliers set its scale),
            the collective runs again in full precision and that unit's weights or gradients stay
            in full precision for ``quantize_fallback_steps`` steps, with a warning. None: off
            (on a GPU the guard reads a figure on the host after each quantized collective).
        quantize_fallback_steps: how many steps a unit stays in full precision after the guard
            tripped, before trying int8 again.
        secondary_shard_size: stage 3 (ZeRO++'s hpZ): when a unit is freed after its forward, each
            rank keeps a secondary copy of it sharded over a group of this many consecutive ranks
            (``"node"``: the ranks of one node), so that the unit's all-gather in backward runs
            inside that group (a node's fast links) instead of across all ranks. Costs, per rank,
            the unit's gathered bytes divided by this size, for every unit between its forward and
            its backward (1/secondary_shard_size of the model in the compute dtype at the end of
            forward). Must divide the shard group's size; equal to it: nothing to save (off).
            Needs ``reshard_after_forward``. None: off (docs/quantized.md).
    """

    stage: int = 0  # ZeRO stage: 0 plain DP
    bucket_cap_mb: float = 25.0  # cap of one gradient bucket, MiB
    first_bucket_cap_mb: float = 1.0  # cap of the first bucket (first gradients ready), MiB
    broadcast_buffers: bool = True  # buffers from rank 0 at each synced training forward
    find_unused_parameters: bool = False  # tolerate params without grad (DDP semantics)
    accumulate_unsharded: bool = False  # stages 2-3: no_sync with full grads during accumulation
    wrap_policy: Any = None  # stage 3: unit classes (import paths) or a callable; None: one unit
    min_num_params: int | None = None  # stage 3: size-based units instead of classes
    prefetch: bool = True  # stage 3: gather the next unit while one computes
    prefetch_limit: int = 1  # stage 3: units gathering ahead at most
    reshard_after_forward: bool = True  # stage 3: free units after forward (3Ψ) or keep (2Ψ)
    param_dtype: str | None = None  # "bf16" | "fp16" | "fp32" | None: follow Lightning's precision flag
    reduce_dtype: str | None = None  # gradients on the wire; None: param_dtype
    state_dict_type: str = "full"  # checkpoints: "full" (one file, rank 0) or "sharded" (a directory)
    max_reduce_buffers: int = 2  # stages 2-3: full-size gradient buffers in flight at most
    param_init_fn: Any = None  # stage 3 deferred init: fn(module) (or its import path) after reset_parameters
    gather_at_teardown: bool | None = (
        None  # stage 3: full weights into the module after fit; None: unless deferred
    )
    elementwise_optimizers: list[Any] = field(default_factory=list)  # extra optimizers safe to shard
    ledger_records: int = 4_096  # collectives the ledger keeps in detail (bounded memory)
    handle_signals: bool = True  # SIGTERM/SIGUSR1/SIGINT: save and stop at the next step boundary
    nonfinite_grads: str = "off"  # NaN/inf loss or gradients on any rank: "off" | "skip" | "stop"
    watchdog_s: float | None = 60.0  # compare every rank's collectives after a wait this long; None: off
    fault_wait_s: float = 3.0  # wait this long for a failing rank's message after a collective fails
    keep_previous_checkpoint: bool = True  # keep .NAME.previous when NAME is overwritten
    verify_checkpoints: bool = True  # check CRC32s of tensors/chunks when loading
    cpu_allocator: str = "tuned"  # CPU on glibc: "tuned" (freed memory returned) | "default"
    shard_size: Any = None  # hybrid sharding: ranks per shard group (int), "node", "auto", or None: all ranks
    quantize_weights: bool = False  # stage 3: int8 all-gather of weights (qwZ)
    quantize_grads: bool = False  # stages 1-3: int8 gradient reduction (qgZ)
    quantize_block: int = 256  # elements per int8 block (one fp32 scale each)
    quantize_guard: float | None = 0.5  # a block losing more than this share to rounding: full precision
    quantize_fallback_steps: int = 100  # steps in full precision after the guard tripped
    secondary_shard_size: Any = None  # stage 3 (hpZ): ranks (int) or "node" keeping a copy for backward

    def __post_init__(self) -> None:
        _check_int("stage", self.stage)
        if self.stage not in SUPPORTED_STAGES:
            raise ValueError(f"stage must be one of {list(SUPPORTED_STAGES)}, got {self.stage!r}")
        _check_positive("bucket_cap_mb", self.bucket_cap_mb)
        _check_positive("first_bucket_cap_mb", self.first_bucket_cap_mb)
        _check_bool("broadcast_buffers", self.broadcast_buffers)
        _check_bool("find_unused_parameters", self.find_unused_parameters)
        _check_bool("accumulate_unsharded", self.accumulate_unsharded)
        if self.accumulate_unsharded and self.stage < 2:
            raise ValueError(f"accumulate_unsharded applies to stages 2 and 3, got stage={self.stage}")
        self._check_stage3()
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(
                f"state_dict_type must be one of {list(STATE_DICT_TYPES)}, got {self.state_dict_type!r}"
            )
        if self.gather_at_teardown is not None:
            _check_bool("gather_at_teardown", self.gather_at_teardown)
        if self.stage != 3 and (self.param_init_fn is not None or self.gather_at_teardown is not None):
            raise ValueError(
                f"param_init_fn and gather_at_teardown apply to stage 3 only, got stage={self.stage}"
            )
        _check_int("max_reduce_buffers", self.max_reduce_buffers)
        if self.max_reduce_buffers < 1:
            raise ValueError(f"max_reduce_buffers must be >= 1, got {self.max_reduce_buffers}")
        self._check_classes()
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in ("bf16", "fp16", "fp32"):
                raise ValueError(f"{name} must be one of 'bf16', 'fp16', 'fp32' or null, got {value!r}")
        self._check_failure_handling()
        self._check_shard_size()
        self._check_quantization()
        if self.cpu_allocator not in CPU_ALLOCATOR_MODES:
            raise ValueError(
                f"cpu_allocator must be one of {list(CPU_ALLOCATOR_MODES)}, got {self.cpu_allocator!r}"
            )

    def _check_stage3(self) -> None:
        _check_bool("prefetch", self.prefetch)
        _check_bool("reshard_after_forward", self.reshard_after_forward)
        _check_int("prefetch_limit", self.prefetch_limit)
        if self.prefetch_limit < 1:
            raise ValueError(f"prefetch_limit must be >= 1, got {self.prefetch_limit}")
        if self.min_num_params is not None:
            _check_int("min_num_params", self.min_num_params)
            if self.min_num_params < 1:
                raise ValueError(f"min_num_params must be >= 1, got {self.min_num_params}")
        if self.stage != 3 and (self.wrap_policy is not None or self.min_num_params is not None):
            raise ValueError(f"wrap_policy and min_num_params apply to stage 3 only, got stage={self.stage}")
        if self.wrap_policy is not None and self.min_num_params is not None:
            raise ValueError("give either wrap_policy or min_num_params, not both")

    def _check_shard_size(self) -> None:
        """The value's form here; against the world size and the nodes at setup (comm/mesh.py)."""
        value = self.shard_size
        if value is None:
            return
        if value not in ("node", "auto") and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(
                f"shard_size must be a positive number of ranks, 'node', 'auto' or null, got {value!r}"
            )
        if self.stage == 0:
            raise ValueError(
                f"shard_size={value!r} with stage 0: stage 0 shards nothing, so there is no group to shard "
                "in; use stage 1, 2 or 3, or leave shard_size unset"
            )

    def _check_quantization(self) -> None:
        _check_bool("quantize_weights", self.quantize_weights)
        _check_bool("quantize_grads", self.quantize_grads)
        if self.stage != 3 and self.quantize_weights:
            raise ValueError(
                f"quantize_weights applies to stage 3 (whose all-gathers feed the forward), got stage={self.stage}"
            )
        if self.quantize_weights and not self.reshard_after_forward:
            raise ValueError(
                "quantize_weights with reshard_after_forward=false: every unit would stay gathered from forward "
                "to the step, where your code reads and writes its weights, in their int8 rounding instead of "
                "their values; keep reshard_after_forward=true (units are gathered again for backward) or "
                "drop quantize_weights"
            )
        if self.stage == 0 and self.quantize_grads:
            raise ValueError(
                "quantize_grads applies to stages 1-3 (int8 reduce-scatters), got stage=0: stage 0 all-reduces, "
                "which would round each partial sum again; use stage 1, 2 or 3"
            )
        _check_int("quantize_block", self.quantize_block)
        if not 32 <= self.quantize_block <= 65536 or self.quantize_block % 32:
            raise ValueError(
                f"quantize_block must be a multiple of 32 from 32 to 65536, got {self.quantize_block}"
            )
        guard = self.quantize_guard
        if guard is not None and (
            isinstance(guard, bool) or not isinstance(guard, (int, float)) or not 0 < guard < 1
        ):
            raise ValueError(
                f"quantize_guard must be a share between 0 and 1 (exclusive) or null, got {guard!r}"
            )
        _check_int("quantize_fallback_steps", self.quantize_fallback_steps)
        if self.quantize_fallback_steps < 1:
            raise ValueError(f"quantize_fallback_steps must be >= 1, got {self.quantize_fallback_steps}")
        self._check_secondary()

    def _check_secondary(self) -> None:
        """The value's form here; against the shard group and the nodes at setup (comm/mesh.py)."""
        value = self.secondary_shard_size
        if value is None:
            return
        if value != "node" and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
            hint = (
                " (to keep whole units from forward to backward: reshard_after_forward=false)"
                if value == 1
                else ""
            )
            raise ValueError(
                f"secondary_shard_size must be a number of ranks >= 2, 'node' or null, got {value!r}{hint}"
            )
        if self.stage != 3:
            raise ValueError(
                f"secondary_shard_size applies to stage 3 (its parameters are gathered in backward), got stage={self.stage}"
            )
        if not self.reshard_after_forward:
            raise ValueError(
                "secondary_shard_size with reshard_after_forward=false: the units stay gathered from forward "
                "to backward, so there is no backward all-gather for a secondary copy to serve; drop one of them"
            )

    def _check_classes(self) -> None:
        """Import paths are resolved now, where the value enters, not when the processes start."""
        from lightning_zero.imports import resolve_classes, resolve_init_fn, resolve_optimizer_classes

        policy = self.wrap_policy
        if isinstance(policy, (str, type)) or (isinstance(policy, (list, tuple)) and policy):
            resolve_classes([policy] if isinstance(policy, (str, type)) else policy)
        elif policy is not None and not callable(policy):
            raise ValueError(
                f"wrap_policy must be a class, an import path, a list of them or a callable, got {policy!r}"
            )
        if self.elementwise_optimizers:
            resolve_optimizer_classes(self.elementwise_optimizers)
        resolve_init_fn(self.param_init_fn)

    def _check_failure_handling(self) -> None:
        _check_int("ledger_records", self.ledger_records)
        if self.ledger_records < 1:
            raise ValueError(f"ledger_records must be >= 1, got {self.ledger_records}")
        for name in ("handle_signals", "keep_previous_checkpoint", "verify_checkpoints"):
            _check_bool(name, getattr(self, name))
        if self.nonfinite_grads not in NONFINITE_ACTIONS:
            raise ValueError(
                f"nonfinite_grads must be one of {list(NONFINITE_ACTIONS)}, got {self.nonfinite_grads!r}"
            )
        if self.watchdog_s is not None:
            _check_seconds("watchdog_s", self.watchdog_s)
        _check_seconds("fault_wait_s", self.fault_wait_s)

    @classmethod
    def from_kwargs(cls, others: tuple[str, ...] = (), /, **kwargs: Any) -> ZeroConfig:
        """Build a config, refusing unknown names with the list of known ones (and of ``others``,
        the names the caller takes itself)."""
        known = set(option_names())
        unknown = sorted(set(kwargs) - known)
        if unknown:
            also = f"; and the strategy's own: {', '.join(others)}" if others else ""
            raise TypeError(
                f"unknown ZeroConfig option(s): {', '.join(unknown)}; known options: {', '.join(sorted(known))}"
                + also
            )
        return cls(**kwargs)

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 1024 * 1024)

    @property
    def first_bucket_cap_bytes(self) -> int:
        return int(self.first_bucket_cap_mb * 1024 * 1024)


def option_names() -> list[str]:
    return [f.name for f in dataclasses.fields(ZeroConfig)]


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be > 0 (MiB), got {value!r}")


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be > 0 seconds, got {value!r}")


def register_hydra_schema() -> None:
    """Register ZeroConfig as ``schema/strategy`` in Hydra's ConfigStore (idempotent).

    A strategy config extends it with ``defaults: [/schema/strategy@_here_, _self_]``. It lives
    outside the ``strategy`` group so that the group's options are the stages alone: a wrong
    ``strategy=zero9`` is refused with the list of them.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="schema", name="strategy", node=ZeroConfig)
