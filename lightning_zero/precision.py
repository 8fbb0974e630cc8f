"""Mixed precision the ZeRO way, and gradient clipping by the global norm over shards.

[Note: mixed precision]
With a policy (``param_dtype`` bf16), the module's trainable parameters are bf16: forward, backward and
the gradient collectives run in bf16 (2 bytes per element on the wire). The optimizer never sees
them: it steps fp32 master copies (stage 0: whole; stages 1-3: this rank's shard), whose
gradients are the reduced bf16 gradients converted to fp32, and after each step the master
values are copied back into the bf16 parameters (stages 1-2: into this rank's chunk, then
all-gathered; stage 3: into the bf16 shard the next gather reads). Checkpoints carry the fp32
master values under the original parameter names, so a resume continues exactly and a plain fp32
LightningModule loads them. Frozen parameters are left in their own dtype (no compute copy, no
master): autocast, which every policy runs under (Lightning's mixed flag, or one the strategy
installs for an explicit ``param_dtype`` over ``"32-true"``), computes with them, and they end the
run with the values and dtype they started with.

[Note: loss scaling]
fp16 (``param_dtype="fp16"``, or Lightning's ``precision="16-mixed"``) needs dynamic loss scaling:
the loss is multiplied by a scale before backward, the gradients divided by it before the step,
and a step whose gradients hold an inf or NaN is skipped and the scale lowered. In stages 1-3 each
rank checks only its own shard of the gradients, so one rank can find an overflow that its peers
cannot see; if it skipped alone, the ranks' parameters would part for good. :class:`ZeroGradScaler`
therefore sums the ranks' found-inf flags (one small AllReduce per optimizer step) before deciding,
so every rank skips the same steps and keeps the same scale. It replaces the scaler of Lightning's
mixed-precision plugin (same settings and state); with ``param_dtype="fp16"`` and
``precision="32-true"`` the strategy installs fp16 autocast with such a scaler itself
(:func:`training_precision`).

Clipping:
Lightning clips through the precision plugin (``clip_gradients`` -> ``clip_grad_by_norm``), which
on its own would take the norm of this rank's shard only. :func:`install_sharded_clipping` gives
the strategy's plugin a subclass of its own class whose ``clip_grad_by_norm`` takes the norm of the
whole gradient: sqrt(AllReduce(sum of the shards' squares)). Keeping the plugin's class in the MRO
keeps Lightning's isinstance checks (mixed precision, scalers) working. ``"value"`` clipping is
elementwise and needs nothing: the plugin clips the local shard.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.zero.dtensor import local_of


class _GlobalNormClipping:
    _zero_clip_fn: Any  # (optimizer, max_norm) -> total norm; set by install_sharded_clipping
    _zero_before_step: Any  # (optimizer) -> None: the user's gradients into the shards; or None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._zero_clip_fn(optimizer, float(clip_val))

    def _clip_gradients(self, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        # after the closure and on_before_optimizer_step, before clipping and the step
        if self._zero_before_step is not None:
            self._zero_before_step(optimizer)
        super()._clip_gradients(model, optimizer, *args, **kwargs)


@functools.cache
def _with_global_norm(cls: type) -> type:
    # the base's qualname: Lightning files the plugin's checkpoint state under it
    namespace = {"_zero_base": cls, "__qualname__": cls.__qualname__}
    return type(f"GlobalNorm{cls.__name__}", (_GlobalNormClipping, cls), namespace)


def install_sharded_clipping(plugin: Precision, clip_fn: Any, before_step: Any = None) -> None:
    """Make ``plugin`` clip by ``clip_fn(optimizer, max_norm)`` (the global norm over shards) and
    call ``before_step(optimizer)`` once the closure and the hooks before the step ran."""
    base = getattr(type(plugin), "_zero_base", type(plugin))
    plugin.__class__ = _with_global_norm(base)
    plugin._zero_clip_fn = clip_fn
    plugin._zero_before_step = before_step


def remove_sharded_clipping(plugin: Precision) -> None:
    base = getattr(type(plugin), "_zero_base", None)
    if base is not None:
        plugin.__class__ = base
        del plugin._zero_clip_fn, plugin._zero_before_step


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # config names


class PrecisionPolicy(NamedTuple):
    param_dtype: torch.dtype  # what the module computes with (and its gradients)
    reduce_dtype: torch.dtype  # gradients on the wire
    master_dtype: torch.dtype  # the optimizer's copy of the parameters


_MIXED_FLAG = {"bf16": "bf16-mixed", "fp16": "16-mixed"}  # param_dtype -> Lightning's autocast flag


def resolve_policy(
    param_dtype: str | None, reduce_dtype: str | None, lightning_precision: str
) -> PrecisionPolicy | None:
    """The policy for this run; ``None`` trains in the module's own dtype with no master copy.

    ``param_dtype`` None follows Lightning's flag: ``"bf16-mixed"`` -> bf16 parameters and
    gradients with fp32 master weights, ``"16-mixed"`` -> the same in fp16 (with loss scaling, see
    [Note: loss scaling]); ``"32-true"`` (and the ``*-true`` flags, which convert the module
    themselves) -> no policy. An explicit ``param_dtype`` overrides ``"32-true"`` and must agree
    with a mixed flag.
    """
    if param_dtype is None:
        param_dtype = next((d for d, flag in _MIXED_FLAG.items() if flag == lightning_precision), None)
    elif param_dtype != "fp32" and lightning_precision not in ("32-true", _MIXED_FLAG[param_dtype]):
        raise ValueError(
            f"param_dtype={param_dtype!r} does not go with Lightning's precision={lightning_precision!r}: "
            f"use precision={_MIXED_FLAG[param_dtype]!r} or '32-true', or leave param_dtype unset"
        )
    if param_dtype is None or param_dtype == "fp32":
        if reduce_dtype not in (None, "fp32"):
            raise ValueError(f"reduce_dtype={reduce_dtype!r} needs param_dtype of the same dtype")
        return None
    if reduce_dtype not in (None, param_dtype, "fp32"):
        raise ValueError(
            f"reduce_dtype must be param_dtype ({param_dtype!r}) or 'fp32', got {reduce_dtype!r}: "
            "a reduction in a narrower dtype than the gradients would only lose precision"
        )
    dtype = DTYPES[param_dtype]
    return PrecisionPolicy(dtype, DTYPES[reduce_dtype or param_dtype], torch.float32)


def cast_parameters(module: nn.Module, policy: PrecisionPolicy | None) -> dict[int, torch.Tensor]:
    """Cast the trainable floating-point parameters to the policy's dtype; return id -> their values
    before the cast, in the master dtype. Frozen parameters keep their dtype and values (see
    [Note: mixed precision])."""
    if policy is None:
        return {}
    masters = {}
    for p in module.parameters():
        if p.requires_grad and p.is_floating_point() and id(p) not in masters:
            masters[id(p)] = p.detach().to(policy.master_dtype, copy=True)
            p.data = p.data.to(policy.param_dtype)
    return masters


class ZeroGradScaler(torch.amp.GradScaler):
    """A dynamic loss scaler whose found-inf check every rank agrees on (see [Note: loss scaling]).

    Args:
        comm: the strategy's communicator (the AllReduce of the flags goes into its ledger).
        device: the device type the gradients live on (``"cuda"``, ``"cpu"``).
        label: prefix of the collective's name.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as for
            ``torch.amp.GradScaler``.
    """

    def __init__(
        self,
        comm: Communicator,
        device: str = "cuda",
        *,
        label: str = "zero",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.comm = comm
        self.label = label
        self.local_found_inf = False  # this rank's own shard held an inf/NaN at the last unscale
        self.ranks_found_inf = 0  # how many ranks found one (every rank then skipped the step)
        self.skipped_steps = 0  # optimizer steps skipped over this scaler's life

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, comm: Communicator, label: str) -> ZeroGradScaler:
        """A ZeroGradScaler with ``scaler``'s settings and state."""
        new = cls(
            comm,
            scaler._device,
            label=label,
            init_scale=scaler._init_scale if scaler.is_enabled() else 2.0**16,
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
            enabled=scaler.is_enabled(),
        )
        if scaler.is_enabled() and scaler._scale is not None:
            new.load_state_dict(scaler.state_dict())
        return new

    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """As torch's, on what this rank holds of each gradient (a stage-3 gradient is a DTensor:
        its local rows), per device and dtype."""
        inv, found = {}, {}
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = local_of(param.grad)
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    groups.setdefault((grad.device, grad.dtype), []).append(grad)
            for (device, _), grads in groups.items():
                if device not in found:
                    found[device] = found_inf.to(device, copy=True)
                    inv[device] = inv_scale.to(device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv[device])
        return found

    def unscale_(self, optimizer: Optimizer) -> None:
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        assert self._scale is not None
        flag = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for value in found.values():
            flag += value.to(flag.device)
        flag.clamp_(max=1.0)
        local = flag.clone()
        self.comm.all_reduce(flag, name=f"{self.label}/all_reduce/found_inf", async_op=False)
        mine, ranks = torch.stack((local, flag)).tolist()  # one device sync for both
        self.local_found_inf = bool(mine)
        self.ranks_found_inf = round(ranks)
        self.skipped_steps += int(self.ranks_found_inf > 0)
        for value in found.values():
            value.copy_(flag.to(value.device))
        if not found:  # no gradient on this rank: it still follows the others
            found[flag.device] = flag


def training_precision(
    plugin: Any, policy: PrecisionPolicy | None, comm: Communicator, label: str, device: str
) -> Any:
    """The plugin to train with: Lightning's scaler swapped for a :class:`ZeroGradScaler`; or, for an
    explicit ``param_dtype`` over ``precision="32-true"``, autocast in that dtype (fp16 with such a
    scaler), so that parameters the policy leaves in their own dtype (frozen ones) compute with the
    rest, as under Lightning's mixed flags. ``plugin`` is the Trainer's (``lightning.pytorch``) or
    Fabric's (``lightning.fabric``); a new plugin is of the same family."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        if not isinstance(scaler, ZeroGradScaler):
            plugin.scaler = ZeroGradScaler.like(scaler, comm, label)
        return plugin
    base, mixed = _plugin_family(plugin)
    if policy is None or isinstance(plugin, mixed):
        return plugin
    if type(plugin) is not base:
        if policy.param_dtype == torch.float16:
            raise ValueError(
                f"param_dtype='fp16' needs loss scaling, which the precision plugin {type(plugin).__name__} "
                "does not do: use precision='16-mixed' or '32-true'"
            )
        return plugin
    if policy.param_dtype == torch.float16:
        return mixed("16-mixed", device, scaler=ZeroGradScaler(comm, device, label=label))
    return mixed("bf16-mixed", device)


def _plugin_family(plugin: Any) -> tuple[type, type]:
    """(plain, mixed) precision plugin classes of ``plugin``'s family: the Trainer's or Fabric's."""
    if isinstance(plugin, Precision):
        return Precision, MixedPrecision
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
    from lightning.fabric.plugins.precision import Precision as FabricPrecision

    return FabricPrecision, FabricMixed
