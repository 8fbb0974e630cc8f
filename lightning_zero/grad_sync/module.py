"""ZeroModule: the root wrapper the strategy puts around the LightningModule."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from lightning_zero.comm import Communicator
from lightning_zero.comm.quantize import WireQuantization
from lightning_zero.config import ZeroConfig
from lightning_zero.grad_sync.reducer import GradReducer


class GradSync(Protocol):
    """What the root wrapper needs of a stage's gradient synchronisation."""

    label: str  # prefix of collective names
    sync_enabled: bool  # False inside no_sync()

    def prepare_forward(self) -> None: ...

    def finish_forward(self, output: Any) -> None: ...

    def abort_forward(self) -> None: ...


class ZeroModule(nn.Module):
    """Runs the wrapped module's forward between the stage's per-call preparation and wrap-up.

    Lightning calls ``training_step`` (and the evaluation steps) through this module's
    ``forward`` (its forward redirection), so this is where every step begins.

    Args:
        module: the LightningModule.
        sync: the stage's gradient synchronisation (a GradReducer, or stage 3's ZeroThree).
        comm: used to broadcast buffers.
        broadcast_buffers: broadcast buffers from rank 0 before each synchronised training forward.
    """

    def __init__(
        self, module: nn.Module, sync: GradSync, comm: Communicator, *, broadcast_buffers: bool
    ) -> None:
        super().__init__()
        self.module = module  # the wrapped LightningModule
        self.sync = sync  # gradient buckets and hooks (stages 0-2) or units (stage 3)
        self._comm = comm  # collectives for the buffer broadcast
        self._broadcast_buffers = broadcast_buffers  # whether buffers follow rank 0 each step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        training = torch.is_grad_enabled() and self.module.training
        if training and self._broadcast_buffers and self.sync.sync_enabled:
            self.sync_buffers()
        self.sync.prepare_forward()
        try:
            output = self.module(*args, **kwargs)
        except BaseException:
            self.sync.abort_forward()  # nothing collective: the peers may not be in this step
            raise
        self.sync.finish_forward(output)
        return output

    def sync_buffers(self) -> None:
        buffers = [b for b in self.module.buffers() if b.numel() > 0]
        if buffers:
            self._comm.broadcast_tensors(buffers, src=0, name=f"{self.sync.label}/broadcast/buffers")


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) for each parameter that requires grad, shared ones once, in registration order."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{type(module).__name__} has no parameter that requires grad: nothing to train")
    return named


def wrap_module(
    module: nn.Module,
    comm: Communicator,
    config: ZeroConfig,
    *,
    keys: list | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> ZeroModule:
    """Hooks and buckets for every trainable parameter of ``module``, and the root wrapper around it.

    Args:
        keys: per trainable parameter, the bucket split key (stages 1-2: its optimizer group).
        reduce_dtype: the buckets' dtype; None: the parameters' own.
    """
    named = trainable_parameters(module)
    reducer = GradReducer(
        named,
        comm,
        cap_bytes=config.bucket_cap_bytes,
        first_cap_bytes=config.first_bucket_cap_bytes,
        find_unused_parameters=config.find_unused_parameters,
        label=f"zero{config.stage}",
        stage=config.stage,
        keys=keys,
        accumulate_unsharded=config.accumulate_unsharded,
        reduce_dtype=reduce_dtype,
        max_reduce_buffers=config.max_reduce_buffers,
        quantize=WireQuantization.of(config) if config.stage >= 1 else None,
    )
    return ZeroModule(module, reducer, comm, broadcast_buffers=config.broadcast_buffers)


def broadcast_module_states(module: nn.Module, comm: Communicator, *, label: str) -> None:
    """Rank 0's parameters and buffers everywhere, so ranks seeded differently start equal."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.numel() > 0]
    with torch.no_grad():
        comm.broadcast_tensors(tensors, src=0, name=f"{label}/broadcast/module_states")
