"""Stage 3's parameters at rest: DTensors whose reads give what plain training gives.

[Note: parameters at rest]
Between its gathers a stage-3 parameter is a :class:`ZeroDTensor`: a ``torch.distributed.tensor``
``DTensor`` (``Shard(0)`` on the mesh of [Note: the DTensor mesh]; a 0-dim parameter is
``Replicate()``, held whole by every rank) whose local tensor is a view of its unit's flat shard.
Its gradient and the optimizer's state of it are ZeroDTensors too. What describes it (shape,
dtype, ``numel()``, ``requires_grad``) is the whole parameter's. Computing with it runs DTensor's
own ops, with three rules that make a read give the value plain training gives:

- Elementwise ops and in-place writes run on the local shard (``p.mul_(0.5)``, an EMA's
  ``lerp_``, the optimizer's step): they change this rank's shard and nothing else, so nothing is
  ever copied back. A plain tensor of the parameter's shape written into it (``p.copy_(w)``,
  ``p.data = w``) gives each rank its own rows of it.
- A result DTensor leaves pending (``Partial``: ``p.norm()``, ``p.pow(2).sum()``) is reduced at
  once into a plain tensor holding the global value, by a collective of the package's
  (``<label>/at_rest/<op>/<parameter>``: checked like every other, named in any desync report).
- A parameter mixed with a plain tensor that is not a scalar (``x @ p.T`` outside its unit's
  forward, ``ema_plain.lerp_(p, 0.1)``) is gathered first (an AllGather of its rows) and the op
  runs on plain tensors.

Gradients through a read follow data parallelism: each rank's loss is its own and the gradients
are averaged over the ranks, so the backward of a reduction averages the incoming gradient over
every rank (an AllReduce) and the backward of a gather reduce-scatters it (divided by the world
size), exactly as the unit's own reduce-scatter averages what its forward produced. A penalty
``loss = model(x) + c * sum(p.pow(2).sum() for p in model.parameters())`` therefore trains as under
``ddp``. Every read that communicates is a collective: every rank runs it, as for FSDP2.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten


class MeshComms(NamedTuple):
    """The package's communicators behind one DTensor mesh."""

    shard: Any  # the shard group's Communicator (the mesh's last dimension)
    replicate: Any | None  # hybrid sharding: the replicate group's (the mesh's first dimension)
    world: Any  # every rank: gradients of reads are averaged over it
    mean_over: int  # the ranks whose gradients make one mean
    label: str  # prefix of the collectives' names


_COMMS: dict[int, MeshComms] = {}  # id(mesh) -> its communicators (a mesh lives as long as the process)


def register_mesh(mesh: DeviceMesh, comm: Any, label: str) -> None:
    """The communicators that reads of DTensors on ``mesh`` issue their collectives through."""
    _COMMS[id(mesh)] = MeshComms(comm, comm.replicate, comm.world, comm.mean_over, label)


def _comms_of(t: DTensor) -> MeshComms:
    comms = _COMMS.get(id(t.device_mesh))
    if comms is None:
        raise RuntimeError("a stage-3 tensor whose mesh belongs to no engine (was its engine torn down?)")
    return comms


def _mesh_comm(comms: MeshComms, dim: int, ndim: int) -> Any:
    """The communicator of mesh dimension ``dim`` (the last is the shard group's)."""
    return comms.shard if dim == ndim - 1 else comms.replicate


# -- what describes a tensor: answered without touching values ----------------------------------

_PROPERTIES = (
    "shape", "dtype", "device", "requires_grad", "is_leaf", "layout", "ndim", "grad_fn", "is_meta",
    "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_nested", "itemsize", "nbytes", "_version",
    "output_nr", "_base", "names", "retains_grad",
)  # fmt: skip
_METHODS = (
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
    "is_contiguous", "requires_grad_", "get_device", "__hash__", "storage_offset", "retain_grad", "_is_view", "__len__",
)  # fmt: skip
_DESCRIBE = {
    getattr(getattr(Tensor, name), accessor)
    for name in _PROPERTIES
    if hasattr(Tensor, name)
    for accessor in ("__get__", "__set__")
    if hasattr(getattr(Tensor, name), accessor)
} | {getattr(Tensor, name) for name in _METHODS if hasattr(Tensor, name)}
_DESCRIBE.add(Tensor.grad.__set__)
_HOOKS = {Tensor.register_hook, Tensor.register_post_accumulate_grad_hook}
_RECLASS = {Tensor.grad.__get__, Tensor.data.__get__}  # give a DTensor: keep it a ZeroDTensor
_DATA_SET = Tensor.data.__set__  # compared with ==: each access makes another method-wrapper
_NEEDS_VALUES = {  # give Python values: a sharded tensor is gathered first
    getattr(Tensor, name)
    for name in ("tolist", "numpy", "__array__", "item", "__float__", "__int__", "__bool__", "__index__")
    if hasattr(Tensor, name)
}


# [Note: elementwise ops at rest]
# An optimizer's step (and an EMA, a weight decay) is elementwise ops on tensors laid out alike: a
# parameter at rest, its gradient, its state, all this rank's rows of the same shape. Without grad
# mode such an op is exactly the op on the local rows, so it runs there directly, without DTensor's
# dispatch (sharding propagation in Python, ~50 us an op: a single-tensor Adam step over a small
# GPT made stage 3 1.27x zero0's step). An in-place op returns its target; any other result takes
# the inputs' layout. Anything else (a plain tensor that is not a scalar, another layout, grad
# mode on) goes the general way below.
_ELEMENTWISE = {
    getattr(Tensor, name)
    for name in (
        "add",
        "add_",
        "sub",
        "sub_",
        "mul",
        "mul_",
        "div",
        "div_",
        "addcmul",
        "addcmul_",
        "addcdiv",
        "addcdiv_",
        "lerp",
        "lerp_",
        "sqrt",
        "sqrt_",
        "rsqrt",
        "neg",
        "neg_",
        "abs",
        "pow",
        "pow_",
        "maximum",
        "minimum",
        "clamp",
        "clamp_",
        "copy_",
        "zero_",
        "fill_",
        "sign",
        "clone",
        "exp",
        "exp_",
        "square",
        "reciprocal",
        "__add__",
        "__radd__",
        "__sub__",
        "__rsub__",
        "__mul__",
        "__rmul__",
        "__truediv__",
        "__neg__",
    )
    if hasattr(Tensor, name)
} | {torch.add, torch.sub, torch.mul, torch.div, torch.sqrt, torch.maximum, torch.minimum, torch.clone}
_ELEMENTWISE |= {
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
}  # the optimizer's state at its first step


def _elementwise(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on the local rows when every tensor argument is a ZeroDTensor of the first one's
    layout or a scalar tensor (see [Note: elementwise ops at rest]); NotImplemented otherwise."""
    like = None
    for t in (*args, *kwargs.values()):
        if isinstance(t, ZeroDTensor):
            if like is None:
                like = t
            elif t._spec is not like._spec and (
                t._spec.mesh is not like._spec.mesh
                or t._spec.placements != like._spec.placements
                or t._spec.shape != like._spec.shape
            ):
                return NotImplemented
        elif isinstance(t, Tensor) and t.dim() > 0:
            return NotImplemented
    if like is None:
        return NotImplemented
    args = tuple(t._local_tensor if isinstance(t, ZeroDTensor) else t for t in args)
    kwargs = {k: v._local_tensor if isinstance(v, ZeroDTensor) else v for k, v in kwargs.items()}
    out = func(*args, **kwargs)
    if out is args[0]:  # in place: the target itself
        return like
    spec = like._spec
    if out.dtype != spec.tensor_meta.dtype or out.shape != like._local_tensor.shape:
        meta = TensorMeta(spec.shape, spec.tensor_meta.stride, out.dtype)
        spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
    return _as_zero(DTensor(out, spec, requires_grad=False))


class Writes:
    """How many in-place ops ran on the parameters at rest of one flat space (counted here: DTensor
    runs the local op below autograd, where the shard's version counter does not move)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


def _count_writes(func: Any, args: tuple) -> None:
    if not getattr(func, "__name__", "").endswith("_") or not args:
        return
    targets = args[0] if isinstance(args[0], (list, tuple)) else (args[0],)
    for t in targets:
        writes = getattr(t, "_zero_writes", None)
        if writes is not None:
            writes.count += 1


class ZeroDTensor(DTensor):
    """A DTensor whose reads give what plain training gives (see [Note: parameters at rest])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _ELEMENTWISE and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            out = _elementwise(func, args, kwargs)
            if out is not NotImplemented:
                _count_writes(func, args)
                return out
        hook = func in _HOOKS and hasattr(args[0], "_zero_unsharded")
        if func in _DESCRIBE or (func in _HOOKS and not hook) or torch.compiler.is_compiling():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _RECLASS:
            with torch._C.DisableTorchFunctionSubclass():
                return _as_zero(func(*args, **kwargs), args[0])
        if func == _DATA_SET:
            return _assign(args[0], args[1])
        if hook:
            return _register_on_both(func, *args, **kwargs)
        if func is Tensor.__deepcopy__:
            return _deepcopy(args[0], args[1] if len(args) > 1 else kwargs.get("memo", {}))
        _count_writes(func, args)
        leaves, spec = tree_flatten((args, kwargs))
        if any(_is_plain(t) for t in leaves):
            return _mixed(func, leaves, spec)
        if func in _NEEDS_VALUES:
            leaves = [_full(t) if _sharded(t) else t for t in leaves]
            args, kwargs = tree_unflatten(leaves, spec)
            return func(*args, **kwargs)
        sharded_in = any(_sharded(t) or _partial(t) for t in leaves)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        name = _name_of(leaves)
        return tree_map_only(DTensor, lambda t: _settle(t, func, name, sharded_in), out)

    def full_tensor(self, *, grad_placements: Any = None) -> Tensor:
        """The whole value on every rank (a collective); its gradient is averaged over the ranks."""
        return _full(self)


def _is_plain(t: Any) -> bool:
    return isinstance(t, Tensor) and not isinstance(t, DTensor) and t.dim() > 0


def _sharded(t: Any) -> bool:
    return isinstance(t, ZeroDTensor) and any(p.is_shard() for p in t.placements)


def _partial(t: Any) -> bool:
    return isinstance(t, DTensor) and any(p.is_partial() for p in t.placements)


def _name_of(leaves: list) -> str:
    for t in leaves:
        name = getattr(t, "_zero_name", None)
        if name is not None:
            return name
    return "tensor"


def _as_zero(t: Any, like: Any = None) -> Any:
    if isinstance(t, DTensor) and not isinstance(t, ZeroDTensor):
        t.__class__ = ZeroDTensor
        if like is not None and hasattr(like, "_zero_name"):
            t._zero_name = like._zero_name
    return t


def _settle(t: DTensor, func: Any, name: str, sharded_in: bool) -> Any:
    """An op's DTensor output: pending reductions become the global value (a plain tensor); a
    replicated value made from sharded inputs becomes plain too; a sharded one stays a ZeroDTensor."""
    if isinstance(t, DTensor) and (
        _partial(t) or (sharded_in and all(p.is_replicate() for p in t.placements))
    ):
        if t.device_mesh is None or id(t.device_mesh) not in _COMMS:
            return t
        op = getattr(func, "__name__", str(func)).strip("_")
        return _Resolve.apply(t, _comms_of(t), f"{op}/{name}")
    return _as_zero(t)


# -- reductions: the global value ---------------------------------------------------------------


class _Resolve(torch.autograd.Function):
    """A DTensor's global value as a plain tensor (reducing pending placements); backward: the
    incoming gradient averaged over every rank, handed back as a replicated DTensor."""

    @staticmethod
    def forward(ctx: Any, t: DTensor, comms: MeshComms, what: str) -> Tensor:
        ctx.comms, ctx.what, ctx.spec = comms, what, t._spec
        ndim = t.device_mesh.ndim
        value = t._local_tensor.detach()
        for dim, placement in enumerate(t.placements):
            if placement.is_partial():
                value = _reduce(value, placement, _mesh_comm(comms, dim, ndim), comms.label, what)
        return value if value is not t._local_tensor else value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        comms = ctx.comms
        grad = grad.contiguous().clone()
        comms.world.all_reduce(grad, name=f"{comms.label}/at_rest/backward/{ctx.what}", async_op=False)
        grad.div_(comms.mean_over)
        spec = ctx.spec
        replicated = DTensorSpec(
            spec.mesh,
            tuple(Replicate() for _ in spec.placements),
            tensor_meta=TensorMeta(grad.shape, grad.stride(), grad.dtype),
        )
        return DTensor(grad, replicated, requires_grad=False), None, None


def _reduce(value: Tensor, placement: Any, comm: Any, label: str, what: str) -> Tensor:
    """One pending placement reduced over its group: sums, means, extremes and p-norms."""
    name = f"{label}/at_rest/{what}"
    norm = getattr(placement, "norm_type", None)
    if norm is not None and norm not in (0, math.inf, -math.inf):
        out = value.pow(norm)
        comm.all_reduce(out, name=name, async_op=False)
        return out.pow(1.0 / norm)
    op = getattr(placement, "reduce_op", "sum")
    out = value.clone()
    comm.all_reduce(out, name=name, async_op=False, op={"avg": "sum"}.get(op, op))
    return out.div_(comm.world_size) if op == "avg" else out


# -- whole values -------------------------------------------------------------------------------


def _full(t: ZeroDTensor) -> Tensor:
    """The whole value of a (sharded or replicated) ZeroDTensor on every rank."""
    if _partial(t):
        return _Resolve.apply(t, _comms_of(t), f"full/{_name_of([t])}")
    return _Gather.apply(t, _comms_of(t), _name_of([t]))


class _Gather(torch.autograd.Function):
    """A sharded DTensor's whole value (an AllGather of its padded rows); backward: the incoming
    gradient reduce-scattered over the shard group (and summed over the replicas), divided by the
    world size: what the ranks' losses give it on average."""

    @staticmethod
    def forward(ctx: Any, t: DTensor, comms: MeshComms, name: str) -> Tensor:
        ctx.comms, ctx.name, ctx.spec = comms, name, t._spec
        dim = _shard_dim(t)
        local = t._local_tensor.detach()
        if dim is None:
            return local.clone()
        ctx.dim = dim
        k = comms.shard.world_size
        rows = -(-t.shape[dim] // k)  # rows per rank, padded
        padded = _padded(local.movedim(dim, 0), rows)
        out = torch.empty((k * rows, *padded.shape[1:]), dtype=local.dtype, device=local.device)
        comms.shard.all_gather(
            out.view(-1), padded.view(-1), name=f"{comms.label}/at_rest/gather/{name}", async_op=False
        )
        return out[: t.shape[dim]].movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        comms, spec = ctx.comms, ctx.spec
        name = f"{comms.label}/at_rest/backward/{ctx.name}"
        if not hasattr(ctx, "dim"):  # replicated: the mean of the ranks' gradients
            local = grad.contiguous().clone()
            comms.world.all_reduce(local, name=name, async_op=False)
        else:
            k = comms.shard.world_size
            size = spec.shape[ctx.dim]
            rows = -(-size // k)
            moved = _padded(grad.movedim(ctx.dim, 0), k * rows)
            mine = torch.empty((rows, *moved.shape[1:]), dtype=grad.dtype, device=grad.device)
            comms.shard.reduce_scatter(
                mine.view(-1), moved.reshape(-1), name=name, async_op=False, scratch_input=True
            )
            if comms.replicate is not None:
                comms.replicate.all_reduce(mine, name=f"{name}/replicas", async_op=False)
            held = max(0, min(rows, size - comms.shard.rank * rows))
            local = mine[:held].movedim(0, ctx.dim).contiguous()
        local.div_(comms.mean_over)
        meta = TensorMeta(spec.shape, spec.tensor_meta.stride, local.dtype)
        return (
            DTensor(local, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta), requires_grad=False),
            None,
            None,
        )


def _shard_dim(t: DTensor) -> int | None:
    dims = [p.dim for p in t.placements if p.is_shard()]
    return dims[0] if dims else None


def _padded(t: Tensor, rows: int) -> Tensor:
    """``t`` with zero rows appended up to ``rows`` (contiguous)."""
    if t.shape[0] == rows:
        return t.contiguous()
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]].copy_(t)
    return out


# -- mixing with plain tensors --------------------------------------------------------------------


def _mixed(func: Any, leaves: list, spec: Any) -> Any:
    """An op on ZeroDTensors and plain (non-scalar) tensors: written into a ZeroDTensor in place,
    the plain ones take its layout; otherwise the ZeroDTensors are gathered and the op is plain."""
    target = leaves[0] if leaves else None
    in_place = isinstance(target, ZeroDTensor) and getattr(func, "__name__", "").endswith("_")
    if in_place:
        leaves = [_laid_like(t, target) if _is_plain(t) else t for t in leaves]
        args, kwargs = tree_unflatten(leaves, spec)
        with torch._C.DisableTorchFunctionSubclass():
            func(*args, **kwargs)
        return target
    leaves = [_full(t) if isinstance(t, ZeroDTensor) else t for t in leaves]
    args, kwargs = tree_unflatten(leaves, spec)
    return func(*args, **kwargs)


def _laid_like(plain: Tensor, like: DTensor) -> DTensor:
    """A plain tensor as a DTensor beside ``like``: this rank's rows of it when it has ``like``'s
    whole shape (every rank holds the same value), else replicated (it broadcasts)."""
    plain = plain.to(device=like.device)
    if plain.shape == like.shape:
        dim = _shard_dim(like)
        if dim is not None:
            k, rank = _comms_of(like).shard.world_size, _comms_of(like).shard.rank
            rows = -(-like.shape[dim] // k)
            plain = plain.narrow(dim, min(rank * rows, like.shape[dim]), like._local_tensor.shape[dim])
        return DTensor.from_local(
            plain, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )
    replicated = [Replicate() for _ in like.placements]
    return DTensor.from_local(plain, like.device_mesh, replicated, run_check=False)


class _Handles:
    """The handle of a hook registered on a parameter at rest and on its gathered form."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _register_on_both(func: Any, p: ZeroDTensor, hook: Any) -> _Handles:
    """A gradient hook on a parameter at rest also goes on its gathered form, whose gradient (this
    rank's, before the reduction, as under DDP) is what backward computes for it; on the parameter
    at rest it sees what autograd adds there directly (a read at rest in the loss)."""
    with torch._C.DisableTorchFunctionSubclass():
        return _Handles(func(p, hook), func(p._zero_unsharded, hook))


def _assign(p: ZeroDTensor, value: Tensor) -> None:
    """``p.data = value``: a plain tensor of ``p``'s shape gives this rank its rows of it (every
    rank assigns the same value); a DTensor laid out as ``p`` replaces its local values."""
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(
            f"stage 3: cannot assign a tensor of shape {tuple(value.shape)} to "
            f"{getattr(p, '_zero_name', 'a parameter')!r} of shape {tuple(p.shape)} while it is sharded: its "
            "shape is fixed by the shards. Assign a value of the same shape (it is sharded into place)"
        )
    source = value if isinstance(value, DTensor) else _laid_like(value, p)
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        p._local_tensor.copy_(source._local_tensor)
    _count_writes(Tensor.copy_, (p,))


def _deepcopy(t: ZeroDTensor, memo: dict) -> Any:
    if id(t) in memo:
        return memo[id(t)]
    with torch._C.DisableTorchFunctionSubclass():
        local = t._local_tensor.detach().clone()
    copy = DTensor(local, t._spec, requires_grad=t.requires_grad)
    copy.__class__ = ZeroDTensor
    if getattr(t, "_is_param", False):
        copy = _as_zero(nn.Parameter(copy, requires_grad=t.requires_grad))
    if hasattr(t, "_zero_name"):
        copy._zero_name = t._zero_name
    memo[id(t)] = copy
    return copy


# -- building them --------------------------------------------------------------------------------


def sharded_param(
    local: Tensor, mesh: DeviceMesh, shape: torch.Size, *, replicated: bool, requires_grad: bool, name: str
) -> nn.Parameter:
    """A parameter at rest: ``local`` (this rank's rows, a view of its unit's shard) as a
    ZeroDTensor of the whole ``shape`` (see [Note: parameters at rest])."""
    last = Replicate() if replicated else Shard(0)
    placements = (Replicate(),) * (mesh.ndim - 1) + (last,)
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
    param = nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=requires_grad)
    param.__class__ = ZeroDTensor
    param._zero_name = name
    return param


def like_param(param: DTensor, local: Tensor) -> ZeroDTensor:
    """``local`` (this rank's rows of a tensor shaped like ``param``) laid out as ``param``: its
    gradient, or an optimizer state of it."""
    return laid_out(local, layout_like(param, local.dtype))


def layout_like(param: DTensor, dtype: torch.dtype) -> DTensorSpec:
    """The layout of a tensor of ``dtype`` shaped and placed like ``param``. Building it costs
    several times what wrapping a tensor with it does: a caller that lays out a tensor like the
    same parameter every step (its gradient) keeps it."""
    meta = TensorMeta(param.shape, param.stride(), dtype)
    return DTensorSpec(param.device_mesh, param.placements, tensor_meta=meta)


def laid_out(local: Tensor, layout: DTensorSpec) -> ZeroDTensor:
    """``local`` (this rank's rows) as a tensor of ``layout`` (see :func:`layout_like`)."""
    out = DTensor(local, layout, requires_grad=False)
    out.__class__ = ZeroDTensor
    return out


def local_of(t: Tensor) -> Tensor:
    """What this rank holds of a tensor: a DTensor's local rows, a stages 1-2 gradient's range
    (``RangeGrad``), a plain tensor as it is."""
    return getattr(t, "_local_tensor", t)
