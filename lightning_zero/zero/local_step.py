"""Stage 3's optimizer step on this rank's rows, without a DTensor in the way.

[Note: the step on local rows]
At stage 3 the optimizer holds the parameters at rest (ZeroDTensors), as under FSDP2, and every
op of its step would go through ``ZeroDTensor.__torch_function__``: on CPU a single-tensor Adam
makes about 15 such calls per parameter (a GPT of 51 parameters: 10 ms a step against 2.4 ms on
plain tensors), and on a GPU torch picks its foreach kernels only for plain tensors. The
optimizers this package accepts are elementwise (see [Note: elementwise optimizers] in
optimizer.py): each element's update reads that element's value, gradient and state and
scalars, so stepping this rank's rows as plain tensors is the same update.

For the built-in ones (whose step calls the closure once, first, and then reads
``param_groups`` and ``state``), each step runs on *local twins*: a step pre-hook wraps the
closure so that, once it has run (backward done, gradients at rest), every ZeroDTensor in
``param_groups`` is replaced by a plain alias of its local rows whose ``.grad`` is the local rows
of its gradient, and ``optimizer.state`` by the same states with their ZeroDTensors' local rows.
The step writes through the aliases into the shards. Its post-hook, registered first, puts the
parameters and the state back before any other post-hook sees them; states the step created or
replaced are laid out as their parameter (a tensor of the local rows' shape becomes a ZeroDTensor,
a scalar stays plain). The strategies also call :meth:`LocalStep.leave` after every step, so a
step that raised leaves nothing swapped.

The DTensor path stays where this is not certain: an optimizer's first step (its state is made
there, as the DTensor path lays it out), optimizers declared elementwise by the user (their step
may call the closure more than once), ``differentiable=True``, a gradient whose dtype is not its
parameter's, and fp16's loss scaler when it decides not to step (no step runs at all).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.zero.dtensor import ZeroDTensor, like_param
from lightning_zero.zero.optimizer import ELEMENTWISE


def steps_locally(optimizer: Optimizer) -> bool:
    """A built-in elementwise optimizer (or a subclass keeping its step) without ``differentiable``."""
    cls = type(optimizer)
    base = next((b for b in ELEMENTWISE if issubclass(cls, b)), None)
    if base is None or inspect.unwrap(cls.step) is not inspect.unwrap(base.step):
        return False
    return not any(g.get("differentiable", False) for g in optimizer.param_groups)


class LocalStep:
    """The local-twin step of one optimizer (see [Note: the step on local rows])."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.ready = False  # one step ran on the DTensor path: the state's layout is known
        self.swapped: tuple[list[list[Any]], Any, list[tuple[ZeroDTensor, Tensor]]] | None = None
        self._pre = optimizer.register_step_pre_hook(self._before)
        self._post = optimizer.register_step_post_hook(self._after)
        hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
        if hooks is not None:  # first: later post-hooks see the parameters at rest
            hooks.move_to_end(self._post.id, last=False)

    def remove(self) -> None:
        self.leave()
        self._pre.remove()
        self._post.remove()

    def _before(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self.ready:
            return None
        closure = args[1] if len(args) > 1 else kwargs.get("closure")

        def then_local() -> Any:
            loss = closure() if closure is not None else None
            self.enter()
            return loss

        if len(args) > 1:
            return (args[0], then_local, *args[2:]), kwargs
        return args, {**kwargs, "closure": then_local}

    def _after(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        self.leave()
        self.ready = True

    def enter(self) -> None:
        """Replace the parameters at rest and their states by plain aliases of the local rows."""
        opt = self.optimizer
        pairs: list[tuple[ZeroDTensor, Tensor]] = []
        groups, local_state = [], defaultdict(dict)
        for group in opt.param_groups:
            params = []
            for p in group["params"]:
                twin = _twin(p)
                if twin is None:
                    if p in opt.state:
                        local_state[p] = opt.state[p]
                    params.append(p)
                    continue
                if p in opt.state:
                    local_state[twin] = {k: getattr(v, "_local_tensor", v) for k, v in opt.state[p].items()}
                pairs.append((p, twin))
                params.append(twin)
            groups.append(params)
        if len(pairs) == 0:
            return
        self.swapped = ([g["params"] for g in opt.param_groups], opt.state, pairs)
        for group, params in zip(opt.param_groups, groups):
            group["params"] = params
        opt.state = local_state

    def leave(self) -> None:
        """Put the parameters at rest back; lay out the states the step made or replaced."""
        if self.swapped is None:
            return
        originals, state, pairs = self.swapped
        self.swapped = None
        local_state = self.optimizer.state
        for group, params in zip(self.optimizer.param_groups, originals):
            group["params"] = params
        self.optimizer.state = state
        for p, twin in pairs:
            twin.grad = None
            p._zero_writes.count += 1  # the shard changed below DTensor (see Unit.generation)
            stepped = local_state.get(twin)
            if stepped:
                _lay_back(p, twin, stepped, state[p])


def _twin(p: Any) -> Tensor | None:
    """A plain alias of ``p``'s local rows with its gradient's local rows, or None to keep ``p``."""
    if not isinstance(p, ZeroDTensor):
        return None
    grad = p.grad
    local = p._local_tensor
    twin = local.detach()
    if grad is not None:
        grad = grad._local_tensor if isinstance(grad, ZeroDTensor) else None
        if grad is None or grad.dtype != local.dtype or grad.shape != local.shape:
            return None
        twin.grad = grad
    return twin


def _lay_back(p: ZeroDTensor, twin: Tensor, stepped: dict, state: dict) -> None:
    """The step's state of ``twin`` into ``state`` (of ``p``): what it kept is already there."""
    for key, value in stepped.items():
        old = state.get(key)
        if old is value or getattr(old, "_local_tensor", None) is value:
            continue
        if isinstance(value, Tensor) and (
            isinstance(old, ZeroDTensor) or (value.dim() > 0 and value.shape == twin.shape)
        ):
            value = like_param(p, value)
        state[key] = value
