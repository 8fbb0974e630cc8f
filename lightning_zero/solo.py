"""One process: every stage trains as plain training, with no machinery at all.

[Note: one process]
With one process there is nobody to shard with or reduce with: every stage's state per rank is
the whole model (16Ψ at every stage: the sharded terms divide by N = 1), and no collective carries
anything. Yet the stages' machinery would still run on every step: gradient hooks and copies into
flat buckets (stages 0-2), flat spaces and shard views, each unit's gather and free around its
forward and backward (stage 3), and the optimizer stepping DTensor shards. On a GPU that host work
delays every kernel launch behind it, and one GPU is where many runs start (a debug run, a
notebook, the first try of a config).

So with a world of one process and no precision policy (the parameters are what the optimizer
steps: ``"32-true"``, ``"bf16-true"``), every stage uses :class:`SoloEngine`:
the module keeps its own parameters, autograd leaves the gradients in ``p.grad``, the optimizer
is the user's, untouched; no hook is installed. What stays the same as at any other size:

- checkpoints: the full form holds the whole model and optimizer state under the original names
  (the form every stage writes); the sharded form lays whole tensors out as stage 0 does. Either
  resumes with any stage on any number of processes, as any checkpoint does;
- the ledger and the monitor report no collective and 0 bytes; the agreements and checks, which
  are collectives, are skipped as they are for any one-process run;
- ``strategy.gathered()`` and ``full_state_dict()`` give the whole parameters (they are whole).

Not taken: a model built on the meta device at stage 3 (its values come unit by unit from the
stage-3 engine), and any precision policy: ``param_dtype``/``reduce_dtype``, and Lightning's
``"bf16-mixed"``/``"16-mixed"``, which set one (parameters in 16 bits, fp32 masters in the
stages' flat spaces or stage 0's master copies, [Note: mixed precision] in precision.py). Those
keep their stage's engine on one process. Taking them needs the master gradients made right
after each backward (Lightning clips the optimizer's tensors, the masters, between backward and
step) and the 16-bit accumulation kept as the buckets keep it.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import Engine, _check_optimizers
from lightning_zero.grad_sync import ZeroModule, trainable_parameters
from lightning_zero.precision import PrecisionPolicy
from lightning_zero.zero.deferred import is_deferred


def runs_solo(comm: Communicator, policy: PrecisionPolicy | None, module: nn.Module) -> bool:
    """Whether a run takes [Note: one process]: one process in the world, no precision policy, and
    (stage 3) a model that has its values already."""
    return comm.world.world_size == 1 and policy is None and not is_deferred(module)


class SoloSync:
    """The gradient synchronisation of one process: nothing to do (see [Note: one process])."""

    grad_copies = 0  # gradients copied into buffers: none, autograd accumulates in p.grad

    def __init__(self, label: str, params: Sequence[nn.Parameter]) -> None:
        self.label = label  # prefix of collective names (none is issued)
        self.params = list(params)
        self.sync_enabled = True  # False inside no_sync()

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

    def __init__(self, config: ZeroConfig, comm: Communicator) -> None:
        super().__init__(config, comm, policy=None)

    @property
    def needs_optimizers_first(self) -> bool:
        """Stages 1-3 refuse an optimizer they could not shard on more processes, here too."""
        return self.config.stage > 0

    def setup(self, module: nn.Module, optimizers: Sequence[Optimizer], **placement: Any) -> ZeroModule:
        """Wrap ``module`` as it is; ``placement``'s device: where stage 3 (which the strategy
        leaves on the host for its units) puts it."""
        device = placement.get("device")
        if device is not None:
            module.to(device)
        if self.config.stage > 0:
            _check_optimizers(self.config, optimizers)
        self.optimizers = list(optimizers)
        self.params = [p for _, p in trainable_parameters(module)]
        self.wrapped = ZeroModule(
            module, SoloSync(self.label, self.params), self.comm, broadcast_buffers=False
        )
        return self.wrapped
