"""Model-state memory per rank, counted from the tensors themselves.

Each category counts the bytes of the distinct storages behind its tensors, so a view (a
parameter pointing into a flat bucket, a shard parameter aliasing its chunk) is counted once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from torch import Tensor, nn
from torch.optim import Optimizer


class GatherMeter:
    """Bytes of some kind of buffer held right now, and the most held at once since a reset (stage 3's
    gathered parameters; stages 2-3's full-size gradient buffers in backward)."""

    def __init__(self) -> None:
        self.now = 0  # bytes held at this moment
        self.peak = 0  # the most at once since reset()

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def reset(self) -> None:
        self.peak = self.now


class MemoryReport(NamedTuple):
    parameters: int  # bytes of parameter storage (flat buckets in stages 1-2)
    gradients: int  # bytes of gradient storage (buckets, shard gradients)
    optimizer_states: int  # bytes of optimizer state tensors (moments, master copies)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states


def storage_bytes(tensors: Iterable[Tensor], *, exclude: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (storages in ``exclude`` skipped)."""
    seen = set(exclude or ())
    total = 0
    for t in tensors:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measure(
    module: nn.Module,
    grad_tensors: Iterable[Tensor],
    optimizers: Iterable[Optimizer],
    *,
    extra_params: Iterable[Tensor] = (),
) -> MemoryReport:
    """Parameters of ``module`` (plus ``extra_params``: stage-3 shards and gathered units), the
    given gradient tensors plus the gradients the optimizers' parameters still hold (fp32 master
    gradients, shard gradients: they live until ``zero_grad``), and the optimizers' state tensors."""
    params = [p for p in module.parameters()] + list(extra_params)
    param_ptrs = {_local(p).untyped_storage().data_ptr() for p in params}
    optimizers = list(optimizers)
    states = [
        v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)
    ]
    # what the optimizer steps, when it is not the module's own storage: fp32 master copies
    masters = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    states += [m for m in masters if _local(m).untyped_storage().data_ptr() not in param_ptrs]
    return MemoryReport(
        parameters=storage_bytes(params),
        gradients=storage_bytes([g for g in [*grad_tensors, *(m.grad for m in masters)] if g is not None]),
        optimizer_states=storage_bytes(states, exclude=param_ptrs),
    )


def _local(t: Tensor) -> Tensor:
    """The tensor whose storage holds ``t``'s bytes on this rank (a DTensor's local shard)."""
    return getattr(t, "_local_tensor", t)
