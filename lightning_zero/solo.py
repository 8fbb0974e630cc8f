"""One process: every stage trains as plain training, with no machinery at all.

[Note: one process]
With one process there is nobody to shard with or reduce with: every stage's state per rank is
the whole model (16Ψ at every stage: the sharded terms divide by N = 1), and no collective carries
anything. Yet the stages' machinery would still run on every step: gradient hooks and copies into
flat buckets (stages 0-2), flat spaces and shard views, each unit's gather and free around its
forward and backward (stage 3), and the optimizer stepping DTensor shards. On a GPU that host work
delays every kernel launch behind it, and one GPU is where many runs start (a debug run, a
notebook, the first try of a config).

So with a world of one process, every stage uses :class:`SoloEngine`:
the module keeps its own parameters, autograd leaves the gradients in ``p.grad``, the optimizer
is the user's, untouched; no hook is installed. What stays the same as at any other size:

- checkpoints: the full form holds the whole model and optimizer state under the original names
  (the form every stage writes); the sharded form lays whole tensors out as stage 0 does. Either
  resumes with any stage on any number of processes, as any checkpoint does;
- the ledger and the monitor report no collective and 0 bytes; the agreements and checks, which
  are collectives, are skipped as they are for any one-process run;
- ``strategy.gathered()`` and ``full_state_dict()`` give the whole parameters (they are whole).

Under a precision policy whose gradients are reduced in the parameters' dtype (Lightning's
``"bf16-mixed"`` and ``"16-mixed"`` set one: 16-bit parameters, fp32 masters; [Note: mixed
precision] in precision.py) it keeps stage 0's masters: the optimizer steps fp32 copies, and at
the end of every backward outside ``no_sync`` the 16-bit gradients autograd left in ``p.grad``
become the masters' fp32 gradients (added to those of an earlier synced backward of the step),
as stage 0's buckets hand them over when their reduction ends, so that the loss scaler's
unscaling, clipping and the step see them where they would on N processes. Inside ``no_sync``
they accumulate in 16 bits in ``p.grad``, as in the buckets.

Not taken: a model built on the meta device at stage 3 (its values come unit by unit from the
stage-3 engine), and a policy with a ``reduce_dtype`` of its own (gradients summed in fp32 across
micro-batches, in buckets or units of that dtype); both keep their stage's engine.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.engines import Engine, _check_optimizers
from lightning_zero.grad_sync import ZeroModule
from lightning_zero.precision import PrecisionPolicy
from lightning_zero.zero.deferred import is_deferred


def runs_solo(comm: Communicator, policy: PrecisionPolicy | None, module: nn.Module) -> bool:
    """Whether a run takes [Note: one process]: one process in the world, no precision policy or
    one that reduces in the parameters' dtype, and (stage 3) a model that has its values already."""
    plain = policy is None or policy.reduce_dtype in (None, policy.param_dtype)
    return comm.world.world_size == 1 and plain and not is_deferred(module)


class SoloSync:
    """The gradient synchronisation of one process: nothing to do (see [Note: one process])."""

    grad_copies = 0  # gradients copied into buffers: none, autograd accumulates in p.grad
    attach_views = True  # for Engine._use_masters: the masters' gradients are made, not bucket slots

    def __init__(self, label: str, params: Sequence[nn.Parameter]) -> None:
        self.label = label  # prefix of collective names (none is issued)
        self.params = list(params)
        self.sync_enabled = True  # False inside no_sync()
        self.on_reduced: Any = None  # set by Engine._use_masters; SoloEngine.finish_backward does it
        self.drop_on_abort = False  # set by Engine._use_masters; nothing is held here to drop

    def prepare_forward(self) -> None:
        pass

    def finish_forward(self, output: Any) -> None:
        pass

    def abort_forward(self) -> None:
        pass

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def grad_tensors(self) -> list[Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def bucket_specs(self) -> list[Any]:
        return []

    def remove_hooks(self) -> None:
        pass


class SoloEngine(Engine):
    """Any stage on one process (see [Note: one process])."""

    @property
    def needs_optimizers_first(self) -> bool:
        """Stages 1-3 refuse an optimizer they could not shard on more processes, here too; under
        a policy the optimizers step the masters."""
        return self.config.stage > 0 or self.policy is not None

    def finish_backward(self) -> None:
        """A backward ended: outside ``no_sync``, the 16-bit gradients become the masters' (see
        [Note: one process])."""
        if not self.masters or not self.wrapped.sync.sync_enabled:
            return
        dtype = self.policy.master_dtype
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    continue
                master = self.masters[id(p)]
                if master.grad is None:
                    master.grad = p.grad.to(dtype)
                else:
                    master.grad.add_(p.grad)
                p.grad = None

    def setup(self, module: nn.Module, optimizers: Sequence[Optimizer], **placement: Any) -> ZeroModule:
        """Wrap ``module`` as it is; ``placement``'s device: where stage 3 (which the strategy
        leaves on the host for its units) puts it."""
        device = placement.get("device")
        if device is not None:
            module.to(device)
        if self.config.stage > 0:
            _check_optimizers(self.config, optimizers)
        return super().setup(module, optimizers)

    def _wrap(self, module: nn.Module) -> ZeroModule:
        """The root wrapper with nothing to synchronise: no hook, no bucket."""
        return ZeroModule(module, SoloSync(self.label, self.params), self.comm, broadcast_buffers=False)
