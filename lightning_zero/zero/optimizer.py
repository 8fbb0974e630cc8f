"""Stages 1-2: parameters in flat buckets, the user's optimizer stepping on this rank's shard.

[Note: shard layout]
The parameter buckets have the layout of the gradient buckets (``BucketSpec``): one flat tensor
per bucket, padded to a multiple of N, split into N equal contiguous chunks; rank r owns chunk r
of every bucket, so shards are balanced to the element. The module's own parameters become views
into the flat tensors (``p.data`` points into them), and the shard parameter of bucket b is a
leaf tensor aliasing chunk r of that bucket. The optimizer steps the shard parameters in place,
which updates chunk r of the model's parameters directly; an in-place AllGather per bucket then
brings every rank the other chunks. The flat tensors are owned by :class:`ShardedParams`.

[Note: optimizer in place]
The user's optimizer object is kept: its ``param_groups[i]["params"]`` lists are replaced by the
shard parameters of the buckets belonging to group i, everything else in the group (lr, betas,
weight decay, what a scheduler changes) is untouched. Lightning's ``trainer.optimizers`` and the
LR schedulers therefore keep working on the same object. Its state is per shard; the checkpoint
form is consolidated back to the original parameters (``full_state_dict``) so that a plain single
process can load it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.grad_sync import GradReducer

UNSHARDABLE = (torch.optim.LBFGS,)  # step re-evaluates closures over whole parameters


class ShardingError(ValueError):
    """The optimizer or model cannot be sharded; the message says why and what to use instead."""


def param_group_keys(
    optimizers: Sequence[Optimizer], params: Sequence[Parameter], names: Sequence[str]
) -> list:
    """Per parameter, ``(optimizer index, group index)``; ``None`` for one no optimizer updates."""
    where: dict[int, tuple[int, int]] = {}
    for oi, optimizer in enumerate(optimizers):
        _refuse_unshardable(optimizer)
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in where:
                    raise ShardingError(
                        f"a parameter appears in two optimizer param groups: {where[id(p)]} and {(oi, gi)}"
                    )
                where[id(p)] = (oi, gi)
    return [where.get(id(p)) for p in params]


def _refuse_unshardable(optimizer: Optimizer) -> None:
    if isinstance(optimizer, UNSHARDABLE):
        raise ShardingError(
            f"{type(optimizer).__name__} cannot be sharded: its step evaluates the closure over whole "
            "parameters. Use stage 0 (strategy='zero0') for it."
        )


class ShardedParams:
    """Flat parameter buckets, this rank's shard parameters, and the in-place optimizer wrapping.

    Args:
        reducer: the gradient reducer; its buckets define the layout (see [Note: shard layout]).
        comm: collectives for the AllGather of updated parameters and the norm AllReduce.
    """

    def __init__(self, reducer: GradReducer, comm: Communicator) -> None:
        self.reducer = reducer
        self.comm = comm
        self.flats: list[Tensor] = []  # per bucket: 1D, padded to a multiple of N; owns the params
        self.shard_params: list[Parameter] = []  # per bucket: alias of chunk `rank` of self.flats[b]
        self.original_groups: dict[int, list[list[Parameter]]] = {}  # optimizer -> groups' params
        self._checked: set[int] = set()  # optimizers whose state shapes were checked
        self.keys = [reducer.keys[b.spec.params[0]] for b in reducer.buckets]  # bucket -> (optimizer, group)
        self._layout()

    def _layout(self) -> None:
        rank, world = self.comm.rank, self.comm.world_size
        for bucket in self.reducer.buckets:
            spec = bucket.spec
            flat = torch.zeros(spec.padded_numel, dtype=spec.dtype, device=spec.device)
            with torch.no_grad():
                for p, offset in zip(bucket.params, spec.offsets):
                    flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = flat[offset : offset + p.numel()].view_as(p)
            size = spec.padded_numel // world
            self.flats.append(flat)
            self.shard_params.append(Parameter(flat[rank * size : (rank + 1) * size]))
        self.reducer.shard_params = self.shard_params

    def buckets_of(self, optimizer_index: int) -> list[int]:
        return [b for b, key in enumerate(self.keys) if key is not None and key[0] == optimizer_index]

    def shard_optimizer(self, optimizer: Optimizer, optimizer_index: int) -> None:
        """Replace the groups' parameters by their shard parameters (see [Note: optimizer in place])."""
        if optimizer.state:
            raise ShardingError(
                f"{type(optimizer).__name__} already holds state; shard it before its first step"
            )
        self.original_groups[optimizer_index] = [list(g["params"]) for g in optimizer.param_groups]
        for gi, group in enumerate(optimizer.param_groups):
            group["params"] = [
                self.shard_params[b] for b, key in enumerate(self.keys) if key == (optimizer_index, gi)
            ]

    def all_gather_params(self, optimizer_index: int) -> None:
        """Every rank's updated chunk everywhere: one in-place AllGather per bucket, then wait."""
        handles = []
        for b in self.buckets_of(optimizer_index):
            name = f"{self.reducer.label}/all_gather/params/bucket={b}"
            handles.append(self.comm.all_gather(self.flats[b], self.shard_params[b].detach(), name=name))
        for handle in handles:
            handle.wait()

    def after_step(self, optimizer: Optimizer, optimizer_index: int) -> None:
        if optimizer_index not in self._checked:
            self._check_state_shapes(optimizer)
            self._checked.add(optimizer_index)
        self.all_gather_params(optimizer_index)

    def _check_state_shapes(self, optimizer: Optimizer) -> None:
        for shard, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape != shard.shape:
                    raise ShardingError(
                        f"{type(optimizer).__name__} keeps state {key!r} of shape {tuple(value.shape)} for a "
                        f"parameter shard of shape {tuple(shard.shape)}; sharded stages need per-element state "
                        "shaped like the parameter, or scalars. Use stage 0 (strategy='zero0') for this optimizer."
                    )

    # -- global-norm clipping ------------------------------------------------------------------

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Clip the shard gradients by the norm of the whole, unsharded gradient."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        device = self.flats[0].device if self.flats else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            squares += g.detach().float().pow(2).sum()
        self.comm.all_reduce(squares, name=f"{self.reducer.label}/all_reduce/grad_norm", async_op=False)
        total = squares.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(coef.to(g.dtype))
        return total

    # -- checkpoint form -----------------------------------------------------------------------

    def full_state_dict(self, optimizer: Optimizer, optimizer_index: int) -> dict[str, Any]:
        """The optimizer's state for the original parameters, as a single process would have it."""
        groups = self.original_groups[optimizer_index]
        ids = _original_indices(groups)
        state: dict[int, dict[str, Any]] = {}
        for b in self.buckets_of(optimizer_index):
            shard_state = optimizer.state.get(self.shard_params[b], {})
            for key in sorted(shard_state):
                self._unshard_state_value(b, key, shard_state[key], ids, state)
        param_groups = []
        for group, params in zip(optimizer.param_groups, groups):
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = [ids[id(p)] for p in params]
            param_groups.append(saved)
        return {"state": dict(sorted(state.items())), "param_groups": param_groups}

    def _unshard_state_value(self, b: int, key: str, value: Any, ids: dict, state: dict) -> None:
        bucket = self.reducer.buckets[b]
        if isinstance(value, Tensor) and value.dim() > 0:
            full = torch.empty(bucket.spec.padded_numel, dtype=value.dtype, device=value.device)
            self.comm.all_gather(
                full,
                value.contiguous(),
                name=f"{self.reducer.label}/all_gather/optimizer_state",
                async_op=False,
            )
        for p, offset in zip(bucket.params, bucket.spec.offsets):
            entry = state.setdefault(ids[id(p)], {})
            if isinstance(value, Tensor) and value.dim() > 0:
                entry[key] = full[offset : offset + p.numel()].view_as(p).clone()
            else:
                entry[key] = value.clone() if isinstance(value, Tensor) else value

    def load_full_state_dict(self, optimizer: Optimizer, optimizer_index: int, saved: dict[str, Any]) -> None:
        """Load a single-process optimizer state (original parameters) into this rank's shards."""
        groups = self.original_groups[optimizer_index]
        if len(saved["param_groups"]) != len(groups):
            raise ShardingError(
                f"checkpoint has {len(saved['param_groups'])} param groups for {type(optimizer).__name__}, "
                f"the optimizer has {len(groups)}"
            )
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        ids = _original_indices(groups)
        saved_state = {int(k): v for k, v in saved["state"].items()}
        for b in self.buckets_of(optimizer_index):
            shard_state = self._shard_state_from_full(b, ids, saved_state)
            if shard_state:
                optimizer.state[self.shard_params[b]] = shard_state

    def _shard_state_from_full(self, b: int, ids: dict, saved_state: dict) -> dict[str, Any]:
        bucket = self.reducer.buckets[b]
        shard = self.shard_params[b]
        size, rank = shard.numel(), self.comm.rank
        flats: dict[str, Tensor] = {}  # per-element state, laid out like the bucket
        scalars: dict[str, Any] = {}  # step counts and other per-parameter scalars
        for p, offset in zip(bucket.params, bucket.spec.offsets):
            for key, value in saved_state.get(ids[id(p)], {}).items():
                if isinstance(value, Tensor) and value.shape == p.shape and key != "step":
                    numel = bucket.spec.padded_numel
                    flat = flats.setdefault(key, torch.zeros(numel, dtype=value.dtype, device=shard.device))
                    flat[offset : offset + p.numel()].copy_(value.reshape(-1))
                else:
                    scalars.setdefault(key, value.clone() if isinstance(value, Tensor) else value)
        sharded = {key: flat[rank * size : (rank + 1) * size].clone() for key, flat in flats.items()}
        return {**scalars, **sharded}


def _original_indices(groups: list[list[Parameter]]) -> dict[int, int]:
    """id(param) -> its index in a single-process ``optimizer.state_dict()`` (torch numbers them in group order)."""
    ids: dict[int, int] = {}
    for params in groups:
        for p in params:
            ids.setdefault(id(p), len(ids))
    return ids
