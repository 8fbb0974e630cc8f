"""Deferred (meta-device) initialisation at stage 3: a model built without memory, given values one
module at a time as its units are sharded.

[Note: deferred initialisation]
Under ``trainer.init_module(empty_init=True)`` and in ``configure_model`` the strategy creates
modules on the meta device (shapes and dtypes, no storage; :func:`meta_init`) and records rank 0's
CPU random state. At setup the modules are visited children first (the order constructors run in:
a module's children exist before its own ``reset_parameters`` runs at the end of its ``__init__``);
each module's own parameters get host memory, its own buffers the values recorded when they were
made (see [Note: buffer values]
A buffer is mostly made in ``__init__`` from constants (a causal mask ``tril(ones(T, T))``, RoPE's
``1 / base ** (arange(0, d, 2) / d)``, a ``zeros_like(weight)``) and no ``reset_parameters`` makes
it again. While :func:`meta_init` is active a torch-function mode follows every tensor made on the
meta device: a factory call with constant arguments is kept as a recipe (nothing computed: the
``torch.empty`` of a parameter costs nothing), and an operation on tensors whose values are known
is also run on the training device, its results kept beside the meta ones (so views and in-place
updates of a mask alias and update as they would in a normal build). At setup a meta buffer gets
that value, on the training device, before the module's init runs; buffers shared by two modules
stay one tensor. What is held is what a normal build holds in its buffers, plus the temporaries
of the statements making them (and the values of meta tensors kept in plain attributes, while
those live). A parameter is computed only as the temporary of an operation on constants
(``nn.Parameter(torch.ones(d) * s)``), never once its init draws. A tensor drawn at random (its
numbers would differ from a normal build's and between ranks), made from a parameter's values or
changed by such an operation has no value: such a buffer gets host memory filled with NaN (or the
dtype's largest value) and must be set by a ``reset_parameters`` or ``param_init_fn`` (of its
module or an ancestor); if none does, setup stops with an error naming the buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

InitFn = Callable[[nn.Module], None]

# Operations whose results are random: never replayed (see [Note: buffer values]).
_RANDOM = frozenset(
    "rand rand_like randn randn_like randint randint_like randperm normal bernoulli multinomial poisson "
    "binomial normal_ uniform_ random_ exponential_ geometric_ log_normal_ cauchy_ bernoulli_ "
    "trunc_normal_ xavier_uniform_ xavier_normal_ kaiming_uniform_ kaiming_normal_ orthogonal_ sparse_ "
    "dropout dropout_ alpha_dropout feature_alpha_dropout rrelu rrelu_".split()
)
# Operations that read only the shape and dtype of their first argument.
_LIKE = frozenset(
    "zeros_like ones_like full_like empty_like new_zeros new_ones new_full new_empty new_tensor".split()
)
_PLAIN = (
    int,
    float,
    bool,
    complex,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)

_values: WeakIdKeyDictionary = WeakIdKeyDictionary()  # meta tensor -> _Recipe or its value (a real Tensor)
_lost: WeakIdKeyDictionary = WeakIdKeyDictionary()  # meta tensor -> why it has no value
_recording: list[_Recorder] = []  # the active recorder (at most one)


@contextmanager
def meta_init(device: torch.device | str) -> Generator[None, None, None]:
    """Tensors created inside are on the meta device; the values of those made from constants are
    recorded, to be computed on ``device`` (the training device) at setup (see [Note: buffer
    values]). Nested uses record once."""
    with torch.device("meta"):
        if _recording:
            yield
            return
        recorder = _Recorder(torch.device(device))
        _recording.append(recorder)
        try:
            with recorder:
                yield
        finally:
            _recording.pop()


def is_deferred(module: nn.Module) -> bool:
    """The module (or part of it) was built on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def post_order(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module, children before their parent (the order constructors end in)."""
    out: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, module))

    visit("", root)
    return out


class _Unset(NamedTuple):
    """A buffer that got host memory but no recorded value: a module's init must write it."""

    path: str  # module path and buffer name, as in the model's state dict
    module: nn.Module  # its owner (the first, for a shared buffer)
    name: str  # its name in the owner's _buffers
    tensor: Tensor  # the host memory it got, filled with the sentinel
    version: int  # tensor._version after the fill
    reason: str  # why no value was recorded


class Initializer:
    """Gives meta modules host memory and values (see [Note: deferred initialisation]); buffers get
    the values recorded under :func:`meta_init` (see [Note: buffer values]), and leaving the
    context checks that every buffer without one was written by some module's init.

    Args:
        init_fn: called on every module that owns meta tensors, children first, after the
            module's own ``reset_parameters()`` (if it has one); None: that alone.
        rng_state: the CPU random state to initialise with (rank 0's, so all ranks agree).
    """

    def __init__(self, init_fn: InitFn | None, rng_state: torch.Tensor) -> None:
        self.init_fn = init_fn
        self.rng_state = rng_state
        self._saved: torch.Tensor | None = None  # the caller's random state, restored afterwards
        self._touched: set[int] = set()  # modules whose tensors (or their children's) were given values
        self._placed: dict[int, tuple[Tensor, Tensor]] = {}  # id(meta buffer) -> (it, what replaced it)
        self._unset: list[_Unset] = []  # buffers a reset_parameters or init_fn must write
        self._hosted: set[int] = set()  # id(parameter) given host memory here and not yet released

    def __enter__(self) -> Initializer:
        self._saved = torch.get_rng_state()
        torch.set_rng_state(self.rng_state)
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        torch.set_rng_state(self._saved)
        unset, self._unset, self._placed, self._hosted = self._unset, [], {}, set()
        if exc_type is None:
            _check_written(unset)

    def materialize(self, name: str, module: nn.Module) -> None:
        """Host memory and values for the module's own meta parameters and buffers; its init also
        runs when only its children had meta tensors (its ``reset_parameters`` may set theirs, as it
        does at the end of its ``__init__``)."""
        own = _own_meta(module)
        if not own and not any(id(c) in self._touched for c in module.children()):
            return
        self._touched.add(id(module))
        reset = getattr(module, "reset_parameters", None)
        params = [n for n, p in module.named_parameters(recurse=False) if p.is_meta]
        if params and reset is None and self.init_fn is None:
            raise ValueError(
                f"module {name or '(root)'!r} ({type(module).__module__}.{type(module).__qualname__}) was built on the "
                f"meta device and holds {', '.join(params)}, but has no reset_parameters() to give them values. "
                "Pass param_init_fn (a callable taking a module, or its import path) to the strategy, "
                "or build the model outside init_module(empty_init=True) / configure_model."
            )
        self._hosted.update(id(p) for p in _params_to_host(module))
        self._give_buffers(name, module)
        with torch.no_grad():
            if reset is not None:
                reset()
            if self.init_fn is not None:
                self.init_fn(module)
        if left := _own_meta(module):
            raise ValueError(
                f"module {name or '(root)'!r}: {', '.join(left)} still on the meta device after its init"
            )

    def release(self, params: list[Tensor]) -> None:
        """Free the host memory of those of ``params`` this initializer gave it, once their values
        are sharded: the module holds the sharded parameters now, but an optimizer made before the
        model was sharded (the strategy sets its optimizers up first) still holds these objects
        (they keep their identity, so that it can be pointed at the sharded ones) and would keep
        the whole model alive until then."""
        for p in params:
            if id(p) in self._hosted:
                self._hosted.discard(id(p))
                p.untyped_storage().resize_(0)

    def _give_buffers(self, name: str, module: nn.Module) -> None:
        """The module's own meta buffers get their recorded values (on the training device) or,
        without one, host memory its init must write; a buffer met before keeps its replacement."""
        for key, buf in module.named_buffers(recurse=False):
            if buf is None or not buf.is_meta:
                continue
            if id(buf) not in self._placed:
                value, reason = recorded_value(buf)
                if value is None:
                    value = _sentinel(buf)
                    path = f"{name}.{key}" if name else key
                    self._unset.append(_Unset(path, module, key, value, value._version, reason))
                self._placed[id(buf)] = (buf, value)
            module._buffers[key] = self._placed[id(buf)][1]


def recorded_value(t: Tensor) -> tuple[Tensor | None, str]:
    """The value recorded for meta tensor ``t`` (computed now if it was kept as a recipe), or None
    and why there is none."""
    try:
        return _value_of(t), ""
    except _NoValue as err:
        return None, err.reason


def _params_to_host(module: nn.Module) -> list[nn.Parameter]:
    """Uninitialised host memory for the module's own meta parameters; returns them. They keep
    their identity (``swap_tensors``): optimizers and hooks made while the model was on the meta
    device still refer to them."""
    hosted = []
    for p in module.parameters(recurse=False):
        if p.is_meta:
            torch.utils.swap_tensors(
                p, nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
            )
            hosted.append(p)
    return hosted


def _sentinel(buf: Tensor) -> Tensor:
    """Host memory for a buffer without a recorded value: NaN (floating), the largest value
    (integer) or False, never whatever memory held."""
    out = torch.empty_like(buf, device="cpu")
    if out.is_floating_point() or out.is_complex():
        return out.fill_(float("nan"))
    return out.fill_(False if out.dtype == torch.bool else torch.iinfo(out.dtype).max)


def _still_sentinel(u: _Unset) -> bool:
    """Nothing wrote the buffer (in place, through ``.data``, or by replacing it)."""
    t = u.tensor
    if u.module._buffers.get(u.name) is not t or t._version != u.version or t.numel() == 0:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(t.isnan().all())
    if t.dtype == torch.bool:
        return not bool(t.any())
    return bool((t == torch.iinfo(t.dtype).max).all())


def _check_written(unset: list[_Unset]) -> None:
    for u in unset:
        if _still_sentinel(u):
            cls = f"{type(u.module).__module__}.{type(u.module).__qualname__}"
            raise ValueError(
                f"buffer {u.path!r} ({cls}) was created on the meta device and its value cannot be "
                f"recovered: {u.reason}; no reset_parameters() or param_init_fn set it at setup. Give "
                f"{type(u.module).__qualname__} a reset_parameters() that sets it, set it in param_init_fn, "
                "or build the model outside init_module(empty_init=True) / configure_model."
            )


def _own_meta(module: nn.Module) -> list[str]:
    """Names of the module's own (not its children's) parameters and buffers on the meta device."""
    own = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
    return [n for n, t in own if t is not None and t.is_meta]


# -- recording buffer values (see [Note: buffer values]) ------------------------------------------


class _NoValue(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # why the tensor has no value, for the error naming a buffer


@dataclass(frozen=True)
class _Template:
    """Stands for a tensor of which a ``*_like`` operation reads only shape, strides and dtype (a
    pytree leaf, unlike a NamedTuple)."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class _Recipe(NamedTuple):
    """A factory call with constant arguments, run on ``device`` when its value is first needed."""

    func: Callable
    args: tuple
    kwargs: dict
    default_dtype: torch.dtype  # torch.get_default_dtype() when it was called
    device: torch.device  # the training device
    shape: torch.Size  # of the meta result, checked against the value
    dtype: torch.dtype

    def compute(self) -> Tensor:
        args, kwargs = tree_map(lambda x: _real(x, self.device), (self.args, self.kwargs))
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.default_dtype)
        try:
            value = _run(self.func, args, kwargs, self.device)
        finally:
            torch.set_default_dtype(previous)
        if not isinstance(value, Tensor) or value.shape != self.shape or value.dtype != self.dtype:
            raise _NoValue(f"{_name(self.func)} gave a different shape or dtype on {self.device}")
        return value


class _Recorder(TorchFunctionMode):
    """Follows the tensors made on the meta device (see [Note: buffer values])."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device  # where values are computed: the training device

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _name(func) == "__deepcopy__":
            return _deepcopy(func, args, kwargs)
        leaves = tree_leaves((args, kwargs))
        inputs = [t for t in leaves if isinstance(t, Tensor) and t.is_meta]
        versions = [t._version for t in inputs]
        out = func(*args, **kwargs)
        made = [o for o in tree_leaves(out) if isinstance(o, Tensor) and o.is_meta]
        changed = [t for t, v in zip(inputs, versions) if t._version != v]
        if getattr(func, "__name__", "") == "__set__":
            changed = inputs[:1]  # t.data = ...: a change the version counter does not see
        if made or changed:
            _follow(func, args, kwargs, out, leaves, made, changed, self.device)
        return out


def _follow(
    func: Callable,
    args: tuple,
    kwargs: dict,
    out: Any,
    leaves: list,
    made: list,
    changed: list,
    device: torch.device,
) -> None:
    """Record the values of ``made`` (and of ``changed`` in place): a recipe, values computed on
    ``device``, or why there are none."""
    name = _name(func)
    try:
        if name in _RANDOM or kwargs.get("generator") is not None:
            raise _NoValue(f"made by {name}, which draws random numbers")
        if name in _LIKE and isinstance(args[0], Tensor) and args[0].is_meta:
            t = args[0]
            args = (_Template(t.shape, t.stride(), t.dtype), *args[1:])
            leaves = tree_leaves((args, kwargs))
        if len(made) == 1 and out is made[0] and all(isinstance(x, (*_PLAIN, _Template)) for x in leaves):
            args, kwargs = tree_map(lambda x: x, (args, kwargs))  # a copy of any list argument
            _values[out] = _Recipe(
                func, args, kwargs, torch.get_default_dtype(), device, out.shape, out.dtype
            )
            return
        real_args, real_kwargs = tree_map(lambda x: _real(x, device), (args, kwargs))
        value = _run(func, real_args, real_kwargs, device)
    except _NoValue as err:
        for t in (*made, *changed):
            _forget(t, err.reason)
        return
    _keep(out, value, name)


def _keep(out: Any, value: Any, name: str) -> None:
    """Pair the meta results with the values computed beside them."""
    metas, spec = tree_flatten(out)
    values, value_spec = tree_flatten(value)
    for i, o in enumerate(metas):
        if not (isinstance(o, Tensor) and o.is_meta):
            continue
        if isinstance(o, nn.Parameter):
            continue  # never a buffer; a weak reference would stop swap_tensors at setup
        v = values[i] if value_spec == spec else None
        if isinstance(v, Tensor) and v.shape == o.shape and v.dtype == o.dtype:
            _values[o] = v
        else:
            _forget(o, f"{name} gave a different result off the meta device")


def _run(func: Callable, args: tuple, kwargs: dict, device: torch.device) -> Any:
    """``func`` on real tensors, factories defaulting to ``device``; a call that fails or draws
    random numbers has no value (the random state is put back)."""
    states = _rng_states(device)
    try:
        with torch.no_grad(), torch.device(device):
            value = func(*args, **kwargs)
    except Exception as err:  # noqa: BLE001  (the meta call succeeded: the buffer is what is lost)
        raise _NoValue(f"{_name(func)} failed on {device}: {type(err).__name__}: {err}") from None
    after = _rng_states(device)
    if any(not torch.equal(a, b) for a, b in zip(states, after)):
        _set_rng_states(device, states)
        raise _NoValue(f"made by {_name(func)}, which draws random numbers")
    return value


def _real(x: Any, device: torch.device) -> Any:
    """The value standing for argument ``x`` off the meta device."""
    if isinstance(x, Tensor):
        return _value_of(x) if x.is_meta else x.to(device)
    if isinstance(x, _Template):
        return torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device=device)
    if isinstance(x, torch.device) and x.type == "meta":
        return device
    return device if isinstance(x, str) and x == "meta" else x


def _value_of(t: Tensor) -> Tensor:
    value = _values.get(t)
    if isinstance(value, _Recipe):
        try:
            value = value.compute()
        except _NoValue as err:
            _forget(t, err.reason)
            raise
        _values[t] = value
    if value is None:
        raise _NoValue(
            _lost.get(t, "it was not made by a tensor operation inside the strategy's meta context")
        )
    return value


def _forget(t: Tensor, reason: str) -> None:
    """``t`` has no value (any more); nor has any tensor whose value shares its storage."""
    value = _values.pop(t, None)
    if not isinstance(t, nn.Parameter):  # a weak reference would stop swap_tensors at setup
        _lost[t] = reason
    if not isinstance(value, Tensor) or value.untyped_storage().nbytes() == 0:
        return
    storage = value.untyped_storage().data_ptr()
    for other, v in list(_values.items()):
        if (
            isinstance(v, Tensor)
            and v.untyped_storage().nbytes() > 0
            and v.untyped_storage().data_ptr() == storage
        ):
            _values.pop(other, None)
            _lost[other] = reason


def _deepcopy(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``copy.deepcopy`` of a meta tensor (``nn.TransformerEncoder`` clones its layers): the copy
    gets a copy of the value."""
    out = func(*args, **kwargs)
    source = args[0]
    if not (isinstance(out, Tensor) and out.is_meta and not isinstance(out, nn.Parameter)):
        return out
    recipe = _values.get(source)
    if isinstance(recipe, _Recipe):
        _values[out] = recipe  # computed once for each when needed
        return out
    value, reason = recorded_value(source)
    if value is not None:
        _values[out] = value.clone()
    else:
        _lost[out] = reason
    return out


def _rng_states(device: torch.device) -> list[Tensor]:
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(torch.get_device_module(device).get_rng_state(device))
    return states


def _set_rng_states(device: torch.device, states: list[Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type != "cpu":
        torch.get_device_module(device).set_rng_state(states[1], device)


def _name(func: Callable) -> str:
    if getattr(func, "__name__", "") in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return f"{getattr(owner, '__name__', '')}.{func.__name__}" if owner is not None else func.__name__
    return getattr(func, "__name__", repr(func))


@contextmanager
def kept_on_meta(module: nn.Module | None) -> Generator[None, None, None]:
    """Lightning's teardown moves the module to the CPU; a setup that failed while giving a
    meta-device model its values leaves tensors there that cannot move, and the move would hide
    the real error: skip it then."""
    if module is None or not is_deferred(module):
        yield
        return
    module.cpu = lambda *args, **kwargs: module  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.cpu
