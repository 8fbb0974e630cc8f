"""One engine per kind of stage: what the strategy asks of a stage, in one place.

The strategy (Lightning glue) calls the same methods whatever the stage; each engine answers
with its own mechanism: stage 0 a GradReducer that all-reduces buckets, stages 1-2 a reducer that
reduce-scatters plus ShardedParams, stage 3 ZeroThree's units.

[Note: after fitting]
``teardown`` ends training (hooks removed, the module whole again) but the engine keeps its flat
spaces and the optimizers keep their sharded state, so a checkpoint saved after ``fit`` returns
(``trainer.save_checkpoint``) still holds the whole optimizer state under the original parameters.
After a failure (``failed=True``) teardown runs no collective: peers may be gone.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.comm.quantize import WireQuantization
from lightning_zero.config import ZeroConfig
from lightning_zero.grad_sync import GradReducer, ZeroModule, trainable_parameters, wrap_module
from lightning_zero.imports import resolve_init_fn
from lightning_zero.precision import PrecisionPolicy, cast_parameters
from lightning_zero.zero.deferred import Initializer, is_deferred
from lightning_zero.zero.flat_param import (
    FlatParameter,
    clip_grad_norm_,
    full_optimizer_state,
    full_parameters,
    gather_values,
    load_full_optimizer_state,
    state_dict_with,
)
from lightning_zero.zero.local_step import LocalStep, steps_locally
from lightning_zero.zero.optimizer import (
    ShardedParams,
    ShardingError,
    check_shardable,
    check_state_shapes,
    resolve_optimizer_classes,
)
from lightning_zero.zero.sharded_module import ZeroThree
from lightning_zero.zero.wrap import make_policy


class Engine:
    """Stage 0: plain data parallelism. The base of the others."""

    sharded = False  # optimizer state lives in shards (stages 1-3)

    @property
    def streams_values(self) -> bool:
        """The optimizer's parameter values live in shards (stage 3; stages 1-2's fp32 masters): a
        full checkpoint gathers them while it is written (see [Note: streamed full checkpoints])."""
        return False

    def optimizer_of(self, index: int) -> Optimizer:
        return self.optimizers[index]

    def largest_freed_block(self) -> int:
        """Bytes of the largest block the engine allocates and frees again within a step (a stage-2
        bucket's gradients, a stage-3 unit gathered or its gradient buffer): what the CPU allocator's
        setting is chosen by (allocator.py); 0 where it frees nothing (stages 0-1)."""
        return 0

    @property
    def buffer_meter(self) -> Any:
        """Gradient buffers alive in backward, now and at most: stage 2's buckets, stage 3's units,
        and with ``quantize_grads`` the int8 reductions' packed chunks in flight (stages 1-3); None
        where nothing transient is (stage 0, stage 1 in full precision: persistent buckets)."""
        sync = self.wrapped.sync if self.wrapped is not None else None
        transient = self.config.stage >= 2 or (self.config.stage == 1 and self.config.quantize_grads)
        return getattr(sync, "buffer_meter", None) if transient else None

    def __init__(self, config: ZeroConfig, comm: Communicator, policy: PrecisionPolicy | None = None) -> None:
        self.config = config
        self.comm = comm
        self.policy = policy  # mixed precision; None: the module's own dtype, no master copy
        self.label = f"zero{config.stage}"  # prefix of collective names
        self.wrapped: ZeroModule | None = None  # the root wrapper, once set up
        self.params: list[nn.Parameter] = []  # the module's trainable parameters
        self.masters: dict[int, nn.Parameter] = {}  # stage 0 with a policy: id(param) -> fp32 master
        self.optimizers: list[Optimizer] = []  # the optimizers set up with the module
        self.finished = False  # teardown ran (see [Note: after fitting])

    def setup(self, module: nn.Module, optimizers: Sequence[Optimizer], **placement: Any) -> ZeroModule:
        """Wrap ``module``; ``optimizers`` exist already for the sharded stages and under a policy.
        (``placement``: stage 3's device and random state; the module is in place already here.)"""
        _refuse_meta(module, self.config.stage)
        self.optimizers = list(optimizers)
        self.params = [p for _, p in trainable_parameters(module)]
        initial = cast_parameters(module, self.policy)
        self.wrapped = self._wrap(module)
        if initial:
            self._use_masters(optimizers, initial)
        return self.wrapped

    def _wrap(self, module: nn.Module) -> ZeroModule:
        """The root wrapper with the stage's gradient synchronisation (stage 0: buckets and hooks)."""
        return wrap_module(module, self.comm, self.config, reduce_dtype=self._reduce_dtype)

    def _use_masters(self, optimizers: Sequence[Optimizer], initial: dict) -> None:
        """Stage 0 under a policy: the optimizers step whole fp32 masters (see [Note: mixed precision])."""
        self.masters = {id(p): nn.Parameter(initial[id(p)]) for p in self.params}
        for optimizer in optimizers:
            if optimizer.state:
                raise ValueError(
                    f"{type(optimizer).__name__} already holds state; cannot give it master weights"
                )
            for group in optimizer.param_groups:  # frozen parameters stay as they are: no gradient
                group["params"] = [self.masters.get(id(p), p) for p in group["params"]]
        sync = self.wrapped.sync
        sync.on_reduced = self._grads_to_masters
        sync.drop_on_abort = True  # see [Note: a backward that raised] in grad_sync/reducer.py
        if not sync.attach_views:  # the master gradients are the bucket slots themselves
            sync.consumed = lambda i: self.masters[id(sync.params[i])].grad is None

    def _grads_to_masters(self) -> None:
        for p, grad in self.wrapped.sync.reduced_grads(self.policy.master_dtype):
            self.masters[id(p)].grad = grad

    @property
    def _reduce_dtype(self) -> torch.dtype | None:
        return self.policy.reduce_dtype if self.policy is not None else None

    @property
    def needs_optimizers_first(self) -> bool:
        return self.sharded or self.policy is not None

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        with self.wrapped.sync.no_sync():
            yield

    def gathered(self) -> Any:
        """Whole parameters inside (stage 3 gathers them; the other stages hold them whole)."""
        return nullcontext()

    def grad_copies(self) -> int:
        """Gradients copied or added into a bucket or unit buffer so far, rather than accumulated there
        by autograd (stages 0 and 1: none once a step's gradients land in their buckets; stage 2 and
        a ``reduce_dtype`` of its own add each fresh gradient in, by design; stage 3 copies each
        gradient once per reduced backward into its unit's ReduceScatter input, laid out as the shards)."""
        sync = self.wrapped.sync if self.wrapped is not None else None
        if hasattr(sync, "units"):
            return sum(u.grad_copies for u in sync.units)
        return getattr(sync, "grad_copies", 0)

    def prepare_backward(self, loss: Tensor | None = None) -> None:
        """A backward of ``loss`` follows (the glue's ``pre_backward``): one that raised before it is
        noticed now (see [Note: a backward that raised]); when it starts, the gradients go into their
        buckets (``GradReducer.attach_grads``), also for a backward inside the step's forward (manual
        optimization), whose outputs no hook follows yet."""
        sync = self.wrapped.sync if self.wrapped is not None else None
        if isinstance(sync, GradReducer):
            sync.prepare_forward()
            if loss is not None:
                sync.attach_when_backward_starts([loss])

    def finish_backward(self) -> None:
        """A backward ended (the glue's ``post_backward``); one process makes its master gradients
        here ([Note: one process] in solo.py)."""

    def before_step(self, optimizer: Optimizer, index: int) -> None:
        """The optimizer is about to step (the gradients are final): stages 1-2 take what the user
        made of the parameters' ``.grad`` into the shards ([Note: gradients of whole parameters])."""

    def step_ended(self, index: int) -> None:
        """The optimizer's step returned or raised: stage 3 puts back what it swapped for it."""

    def after_step(self, optimizer: Optimizer, index: int) -> None:
        """After the optimizer stepped: masters into the parameters; stages 1-2 all-gather them."""
        if not self.masters:
            return
        self.values_loaded()
        for group in optimizer.param_groups:  # the fp32 master gradients: freed now, not at zero_grad
            for master in group["params"]:
                master.grad = None

    def clip_grad_norm_(
        self, optimizer: Optimizer, max_norm: float, *, error_if_nonfinite: bool = False
    ) -> Tensor:
        """The sharded stages' clipping by the global 2-norm (see ``flat_param.clip_grad_norm_``)."""
        return clip_grad_norm_(
            optimizer, max_norm, self.comm, self.label, error_if_nonfinite=error_if_nonfinite
        )

    def optimizer_state(self, optimizer: Optimizer, index: int) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: Optimizer, index: int, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full model under the original names, parameters as the optimizer holds them."""
        if self.finished and not getattr(self, "sharded_after_fit", False):  # teardown gave the values back
            return module.state_dict()
        return state_dict_with(module, self._master_values())

    def full_state_dict(self, module: nn.Module, *, rank0_only: bool = True) -> dict[str, Any]:
        """The module's state dict with full parameter values (the optimizer's), in CPU memory;
        ``rank0_only``: only rank 0 gets it (the others ``{}``). Every rank calls it."""
        state = self.module_state_dict(module)
        if rank0_only and self.comm.rank != 0:
            return {}
        return {k: v.to("cpu") if isinstance(v, Tensor) else v for k, v in state.items()}

    def _master_values(self) -> dict[int, Tensor]:
        """id(param) -> full master value (empty when the parameters are their own masters)."""
        self.take_back()
        return {i: m.detach().clone() for i, m in self.masters.items()}

    def take_back(self) -> None:
        """[Note: taking back parameter changes] Under a policy the optimizer steps fp32 masters and
        the module holds their compute-dtype copies, equal to them after every step. User code that
        writes the module's parameters between steps (an EMA callback copying its average in at the
        end of training, ``p.data.copy_(...)``) changes only the copies: before the masters are
        read (a checkpoint, the end of fit), the masters of changed parameters take the new values.
        Stage 3 has nothing to take back: its parameters at rest are the masters (``zero/dtensor.py``)."""
        if not self.masters or self.finished:
            return
        with torch.no_grad():
            for p in self.params:
                master = self.masters[id(p)]
                if not torch.equal(p, master.to(p.dtype)):
                    master.copy_(p)

    def _restore_masters(self) -> None:
        """Teardown under a policy: the module gets its full-precision values back."""
        values = self._master_values()
        for p in self.params:
            if id(p) in values:
                p.data = values[id(p)]

    def grad_tensors(self) -> list[Tensor]:
        return self.wrapped.sync.grad_tensors() if self.wrapped is not None else []

    def param_tensors(self) -> list[Tensor]:
        """Parameter storage beyond the module's own parameters (stage 3: shards, gathered units)."""
        return []

    def teardown(self, *, failed: bool = False) -> None:
        """End training (see [Note: after fitting]); safe after a setup that stopped half-way."""
        if self.wrapped is not None:
            self.wrapped.sync.remove_hooks()
            if self.policy is not None and not (failed and self.sharded):
                self._restore_masters()
        self.finished = True

    # -- what checkpoints read and write (lightning_zero/checkpoint/) -------------------------

    def flat_spaces(self) -> list[FlatParameter]:
        """The flat spaces whose ``shard`` holds the optimizer's values of their parameters."""
        return []

    def param_spaces(self) -> list[FlatParameter]:
        """The flat spaces holding parameter values: the optimizer's, plus stage 3's frozen ones."""
        return self.flat_spaces()

    def whole_values(self) -> dict[int, Tensor]:
        """id(param) -> the whole tensor the optimizer steps for it, where that is not the parameter
        itself (stage 0 under a policy: its fp32 master)."""
        return dict(self.masters)

    def group_params(self, optimizer: Optimizer, index: int) -> list[list[nn.Parameter]]:
        """The module's parameters of each param group of ``optimizer``, in the user's order."""
        param_of = {id(self.masters[id(p)]): p for p in self.params if id(p) in self.masters}
        return [[param_of.get(id(q), q) for q in group["params"]] for group in optimizer.param_groups]

    def values_loaded(self) -> None:
        """Shards and masters were overwritten (a step, a checkpoint): bring the module's parameters in line."""
        if not self.masters or self.finished:
            return
        with torch.no_grad():
            torch._foreach_copy_(self.params, [self.masters[id(p)] for p in self.params])
        for p in self.params:
            p.grad = None  # consumed through the master; the optimizer's zero_grad does not reach it


def _refuse_meta(module: nn.Module, stage: int) -> None:
    if is_deferred(module):
        meta = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta][:5]
        raise ValueError(
            f"{type(module).__name__} holds tensors on the meta device ({', '.join(meta)}, ...): stage {stage} "
            "keeps whole parameters on every rank and cannot initialise them. Build the model normally, or use "
            "stage 3, which gives a meta-device model its values unit by unit (param_init_fn)."
        )


def _check_optimizers(config: ZeroConfig, optimizers: Sequence[Optimizer]) -> None:
    """The sharded stages take only elementwise optimizers (see [Note: elementwise optimizers])."""
    declared = resolve_optimizer_classes(config.elementwise_optimizers)
    for optimizer in optimizers:
        check_shardable(optimizer, declared)


class ShardedOptimizerEngine(Engine):
    """Stages 1-2: optimizer state (and, for 2, gradients) sharded; parameters whole."""

    sharded = True

    @property
    def streams_values(self) -> bool:
        return self.sharded_params.masters

    def setup(self, module: nn.Module, optimizers: Sequence[Optimizer], **placement: Any) -> ZeroModule:
        _refuse_meta(module, self.config.stage)
        _check_optimizers(self.config, optimizers)
        self.optimizers = list(optimizers)
        self.params = [p for _, p in trainable_parameters(module)]
        initial = cast_parameters(module, self.policy)
        self.wrapped = self._wrap(module)
        self.sharded_params = ShardedParams(self.wrapped.sync, self.comm, initial)  # flat buckets, shards
        self.wrapped.sync.before_forward = self.take_assigned
        for index, optimizer in enumerate(optimizers):
            self.sharded_params.shard_optimizer(optimizer, index)
        return self.wrapped

    def largest_freed_block(self) -> int:
        if self.config.stage < 2:
            return 0
        buckets = self.wrapped.sync.buckets
        return max((b.spec.padded_numel * b.spec.dtype.itemsize for b in buckets), default=0)

    def take_assigned(self) -> None:
        """Values assigned by hand (``p.data = value``) into the buckets, and under a policy into the
        fp32 masters (see [Note: parameters assigned by hand] in zero/optimizer.py)."""
        if self.sharded_params.rebind():
            self.take_back()

    def before_step(self, optimizer: Optimizer, index: int) -> None:
        self.take_assigned()
        self.sharded_params.take_user_grads(index)

    def after_step(self, optimizer: Optimizer, index: int) -> None:
        self.sharded_params.after_step(optimizer, index)

    def optimizer_state(self, optimizer: Optimizer, index: int) -> dict[str, Any]:
        return self.sharded_params.full_state_dict(optimizer, index)

    def load_optimizer_state(self, optimizer: Optimizer, index: int, state: dict[str, Any]) -> None:
        self.sharded_params.load_full_state_dict(optimizer, index, state)

    def _master_values(self) -> dict[int, Tensor]:
        if not self.sharded_params.masters:
            return {}
        self.take_back()
        return full_parameters(self.sharded_params.spaces, self.comm, self.label)

    def full_state_dict(self, module: nn.Module, *, rank0_only: bool = True) -> dict[str, Any]:
        if not self.sharded_params.masters or self.finished:  # the parameters hold the values
            return super().full_state_dict(module, rank0_only=rank0_only)
        self.take_back()
        return _gathered_state_dict(self, module, self.sharded_params.spaces, rank0_only=rank0_only)

    def take_back(self) -> None:
        """See [Note: taking back parameter changes]: this rank's chunk of each bucket against its
        fp32 master shard."""
        sp = self.sharded_params
        if self.finished or not sp.masters:
            return
        with torch.no_grad():
            for flat, space in zip(sp.flats, sp.spaces):
                own = space.own_chunk(flat)
                if not torch.equal(own, space.shard.to(own.dtype)):
                    space.shard.copy_(own)

    def flat_spaces(self) -> list[FlatParameter]:
        return self.sharded_params.spaces

    def whole_values(self) -> dict[int, Tensor]:
        return {}

    def group_params(self, optimizer: Optimizer, index: int) -> list[list[nn.Parameter]]:
        return self.sharded_params.original_groups[index]

    def values_loaded(self) -> None:
        """Every bucket's shard into the parameters: this rank's chunk, then an in-place AllGather."""
        if self.finished:
            return
        sp = self.sharded_params
        handles = []
        with torch.no_grad():
            for b, (flat, space) in enumerate(zip(sp.flats, sp.spaces)):
                own = space.own_chunk(flat)
                if own.data_ptr() != space.shard.data_ptr():  # a separate fp32 master
                    own.copy_(space.shard)
                name = f"{self.label}/all_gather/params/bucket={b}"
                handles.append(self.comm.all_gather(flat, own, name=name))
        for handle in handles:
            handle.wait()


class FullyShardedEngine(Engine):
    """Stage 3: parameters, gradients and optimizer state sharded per wrap unit."""

    sharded = True
    streams_values = True

    def largest_freed_block(self) -> int:
        sizes = [0]
        for unit in self.zero3.units:
            sizes += [flat.nbytes for flat in unit.flats]
            if unit.trainable is not None:  # its reduce-scatter's input
                sizes.append(unit.trainable.flat.padded_numel * unit.reduce_dtype.itemsize)
        return max(sizes)

    def setup(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        *,
        device: torch.device | None = None,
        rng_state: Tensor | None = None,
    ) -> ZeroModule:
        """Shard ``module`` unit by unit onto ``device`` (see [Note: deferred initialisation] for a
        model built on the meta device; ``rng_state``: the random state it was built under)."""
        cfg = self.config
        _check_optimizers(cfg, optimizers)
        self.optimizers = list(optimizers)
        trainable_parameters(module)  # raises when there is nothing to train
        self.deferred = is_deferred(module)  # built on the meta device: values come at setup
        device = device if device is not None else _device_of(module)
        self.zero3 = ZeroThree(  # units, hooks and schedule
            module,
            self.comm,
            make_policy(cfg.wrap_policy, cfg.min_num_params),
            prefetch=cfg.prefetch,
            prefetch_limit=cfg.prefetch_limit,
            reshard_after_forward=cfg.reshard_after_forward,
            accumulate_unsharded=cfg.accumulate_unsharded,
            find_unused_parameters=cfg.find_unused_parameters,
            max_reduce_buffers=cfg.max_reduce_buffers,
            label=self.label,
            precision=self.policy,
            reduce_dtype=self._reduce_dtype,
            device=device,
            broadcast=not self.deferred,
            initializer=self._initializer(rng_state, device) if self.deferred else None,
            quantize=WireQuantization.of(cfg),
        )
        _place_buffers(module, device, self.comm, broadcast=not self.deferred, label=self.label)
        self._stepped: dict[int, tuple[FlatParameter, int]] = {}  # id(what an optimizer steps) -> its place
        self._checked: set[int] = set()  # optimizers whose state shapes were checked
        self._local: dict[int, LocalStep] = {}  # optimizer index -> its step on local rows
        for i, optimizer in enumerate(optimizers):
            self.lay_optimizer(optimizer, i)
        self.wrapped = ZeroModule(module, self.zero3, self.comm, broadcast_buffers=cfg.broadcast_buffers)
        return self.wrapped

    def _initializer(self, rng_state: Tensor | None, device: torch.device) -> Initializer:
        """Rank 0's random state for every rank: all compute the same values (see [Note: deferred
        initialisation])."""
        state = rng_state if rng_state is not None else torch.get_rng_state()
        state = self.comm.broadcast_object(state, name=f"{self.label}/broadcast/init_rng", device=device)
        return Initializer(resolve_init_fn(self.config.param_init_fn), state)

    def lay_optimizer(self, optimizer: Optimizer, index: int) -> None:
        """Point the optimizer's param groups at the parameters at rest (those it holds from before
        the model was sharded are replaced by theirs; frozen ones, which never have a gradient, are
        left out): it then steps the DTensors, as it would under FSDP2."""
        if optimizer.state:
            raise ShardingError(
                f"{type(optimizer).__name__} already holds state; set it up before its first step"
            )
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                place = self.zero3.sharded_of(p)
                if place is None or not place[0].params[place[1]].requires_grad:
                    continue
                flat, i = place
                stepped = flat.sub_shard(index, i)
                self._stepped[id(stepped)] = (flat, i)
                params.append(stepped)
            group["params"] = params
        if steps_locally(optimizer):
            self._local[index] = LocalStep(optimizer)

    def gathered(self) -> Any:
        return self.zero3.gathered()

    def before_step(self, optimizer: Optimizer, index: int) -> None:
        self.zero3.take_written()  # e.g. the root kept through a step, scaled after backward

    def step_ended(self, index: int) -> None:
        local = self._local.get(index)
        if local is not None:  # a step that raised left its parameters swapped
            local.leave()

    def after_step(self, optimizer: Optimizer, index: int) -> None:
        if index not in self._checked:
            check_state_shapes(optimizer)
            self._checked.add(index)
        self.zero3.after_step()  # the gradients stay until the optimizer's zero_grad, as under DDP

    def optimizer_state(self, optimizer: Optimizer, index: int) -> dict[str, Any]:
        groups = self.group_params(optimizer, index)
        return full_optimizer_state(optimizer, index, self.flat_spaces(), groups, self.comm, self.label)

    def load_optimizer_state(self, optimizer: Optimizer, index: int, state: dict[str, Any]) -> None:
        groups = self.group_params(optimizer, index)
        load_full_optimizer_state(optimizer, index, self.flat_spaces(), groups, state)

    def _master_values(self) -> dict[int, Tensor]:
        return full_parameters(self.param_spaces(), self.comm, self.label)

    def param_tensors(self) -> list[Tensor]:
        if self.finished:
            return []
        gathered = [t for u in self.zero3.units if u.gathered for t in u.full_tensors()]
        return self.zero3.shard_tensors() + gathered

    def teardown(self, *, failed: bool = False) -> None:
        """End of fit (see ``gather_at_teardown``): gather the full weights into the module unit by
        unit, or leave it sharded with its forward hooks, so that calling it still gathers each unit.
        After a failure nothing is gathered or waited: the module keeps its placeholders."""
        if not hasattr(self, "zero3"):  # setup stopped before the units existed
            self.finished = True
            return
        for local in self._local.values():
            local.remove()
        self._local.clear()
        gather = self.config.gather_at_teardown
        gather = (not self.deferred) if gather is None else gather
        self.zero3.remove_hooks(keep_forward=not (failed or gather))
        if not failed and gather:
            self._load_full_weights()
        if failed or gather:
            self.zero3.release(wait=not failed)
        self.sharded_after_fit = not (failed or gather)  # the module still holds placeholders
        self.finished = True

    def _load_full_weights(self) -> None:
        """Every parameter becomes a plain one holding its whole value, one flat space at a time."""
        for unit in self.zero3.units:
            whole = []
            for flat in unit.flats:
                values = full_parameters([flat.flat], self.comm, self.label)
                whole.append([values[id(p)] for p in flat.flat.params])
            unit.put_whole(whole)

    def full_state_dict(self, module: nn.Module, *, rank0_only: bool = True) -> dict[str, Tensor]:
        return _gathered_state_dict(self, module, self.param_spaces(), rank0_only=rank0_only)

    def flat_spaces(self) -> list[FlatParameter]:
        return [u.flat for u in self.zero3.units if u.flat is not None]

    def param_spaces(self) -> list[FlatParameter]:
        return self.zero3.param_spaces()

    def whole_values(self) -> dict[int, Tensor]:
        return {}

    def group_params(self, optimizer: Optimizer, index: int) -> list[list[nn.Parameter]]:
        """The module's parameters of each param group (the DTensors it steps, or after a teardown
        that gathered the weights, the whole parameters that took their place)."""
        return [[self._module_param(q) for q in group["params"]] for group in optimizer.param_groups]

    def _module_param(self, stepped: Tensor) -> nn.Parameter:
        place = self._stepped.get(id(stepped))
        return place[0].params[place[1]] if place is not None else stepped

    def values_loaded(self) -> None:
        """Shards were overwritten (a checkpoint): what is gathered now is freed, the next use
        gathers the loaded values."""
        if not self.finished:
            self.zero3.after_step()


def _gathered_state_dict(
    engine: Engine, module: nn.Module, spaces: Sequence[FlatParameter], *, rank0_only: bool
) -> dict[str, Any]:
    """The module's state dict with the values the flat spaces' shards hold (the optimizer's: fp32
    masters under a policy) in CPU memory, gathered one space at a time; ``rank0_only``: only rank 0
    gets it (the others ``{}``), never more than one space gathered beyond its shards."""
    values: dict[int, Tensor] = {}
    dst = 0 if rank0_only else None
    for space in spaces:
        for pid, value in gather_values(space, engine.comm, engine.label, dst=dst).items():
            values[id(space.params[pid])] = value
    if rank0_only and engine.comm.rank != 0:
        return {}
    state = state_dict_with(module, values)
    return {k: v.to("cpu") if isinstance(v, Tensor) else v for k, v in state.items()}


def _device_of(module: nn.Module) -> torch.device:
    real = [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
    return real[0].device if real else torch.device("cpu")


def _place_buffers(
    module: nn.Module, device: torch.device, comm: Communicator, *, broadcast: bool, label: str
) -> None:
    """Stage 3: buffers are kept whole, on ``device``, rank 0's values everywhere (a built model)."""
    for owner in module.modules():
        for name, buf in owner._buffers.items():
            if buf is not None and buf.device != device:
                owner._buffers[name] = buf.to(device)
    buffers = [b for b in module.buffers() if b.numel() > 0]
    if broadcast and buffers:
        with torch.no_grad():
            comm.broadcast_tensors(buffers, src=0, name=f"{label}/broadcast/buffers")


def make_engine(config: ZeroConfig, comm: Communicator, policy: PrecisionPolicy | None = None) -> Engine:
    if config.stage == 0:
        return Engine(config, comm, policy)
    if config.stage in (1, 2):
        return ShardedOptimizerEngine(config, comm, policy)
    return FullyShardedEngine(config, comm, policy)
