"""Deferred initialisation gives buffers their values (see [Note: buffer values] in
lightning_zero/zero/deferred.py): a model with a causal mask shared by its blocks, RoPE's
``inv_freq`` and a non-persistent position buffer, built on the meta device at stage 3, has at
setup the buffers a normal build has; a buffer whose value cannot be recovered stops setup with an
error that names it.

The fits run on 2 gloo ranks on CPU; the rest in this process.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroStrategy
from lightning_zero.zero.deferred import Initializer, meta_init, post_order
from tests.bigmodel.lit import quiet_trainer
from tests.matrix.runner import run_jobs

WIDTH = 16  # d
TOKENS = 6  # T, sequence length
BLOCKS = 2  # wrap units, sharing one causal mask


class Rotary(nn.Module):
    """RoPE's inverse frequencies, computed once in ``__init__`` (no reset_parameters)."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False
        )

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = torch.outer(pos.float(), self.inv_freq)  # (T, d/2)
        cos, sin = freqs.cos(), freqs.sin()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """One causal head; ``mask`` is the model's, registered here too (one tensor for all blocks)."""

    def __init__(self, width: int, mask: torch.Tensor) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.rotary = Rotary(width)
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, d) each
        q, k = self.rotary(q, pos), self.rotary(k, pos)
        att = q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1])  # (B, T, T)
        att = att.masked_fill(self.mask[: x.shape[1], : x.shape[1]] == 0, float("-inf")).softmax(-1)
        return self.proj(att @ v)


class Block(nn.Module):
    def __init__(self, width: int, mask: torch.Tensor) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = Attention(width, mask)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x), pos)


class Net(nn.Module):
    def __init__(self, *, random_buffer: bool = False) -> None:
        super().__init__()
        mask = torch.tril(torch.ones(TOKENS, TOKENS))  # causal: 1 where a token may attend
        self.register_buffer("pos", torch.arange(TOKENS), persistent=False)
        self.blocks = nn.ModuleList(Block(WIDTH, mask) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)
        if random_buffer:  # drawn at random in __init__ and set by nothing afterwards: unrecoverable
            self.blocks[1].attn.register_buffer("noise", torch.randn(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.pos[: x.shape[1]])
        return self.head(x).mean()


def init_weights(module: nn.Module) -> None:
    """A GPT-style init pass (param_init_fn): it knows nothing of buffers."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)


class LitNet(LightningModule):
    """Builds ``Net`` in ``configure_model`` unless given one."""

    def __init__(self, net: Net | None = None, *, random_buffer: bool = False) -> None:
        super().__init__()
        self.net = net
        self.random_buffer = random_buffer
        self.losses: list[float] = []
        self.built_on_meta = net is not None and net.blocks[0].attn.mask.is_meta

    def configure_model(self) -> None:
        if self.net is None:
            self.net = Net(random_buffer=self.random_buffer)
            self.built_on_meta = self.net.blocks[0].attn.mask.is_meta

    def training_step(self, batch, batch_idx):
        loss = (self.net(batch[0]) - 1.0) ** 2
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        x = torch.randn(8, TOKENS, WIDTH, generator=torch.Generator().manual_seed(3))
        return DataLoader(TensorDataset(x), batch_size=2)


class ReadBuffers(Callback):
    """The buffers as setup left them, before the first step."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}  # name -> value (a copy)
        self.shared = False  # the blocks' masks are one tensor

    def on_train_start(self, trainer, pl_module) -> None:
        named = pl_module.net.named_buffers(remove_duplicate=False)
        self.buffers = {n: b.detach().clone() for n, b in named}
        masks = [block.attn.mask for block in pl_module.net.blocks]
        self.shared = all(m is masks[0] for m in masks)


def _fit(build: str, param_init_fn, root: str) -> dict:
    """One zero3 fit of ``LitNet``: ``build`` "normal" (outside any init context), "init_module"
    (``trainer.init_module(empty_init=True)``), "configure_model" or "random_buffer" (the latter
    two built in ``configure_model``)."""
    reader = ReadBuffers()
    block = "tests.integration.test_deferred_buffers.Block"
    strategy = ZeroStrategy(stage=3, wrap_policy=block, param_init_fn=param_init_fn)
    trainer = quiet_trainer(strategy, root, callbacks=[reader])
    torch.manual_seed(0)
    if build == "normal":
        model = LitNet(Net())
    elif build == "init_module":
        with trainer.init_module(empty_init=True):
            model = LitNet(Net())
    else:
        model = LitNet(random_buffer=build == "random_buffer")
    try:
        trainer.fit(model)
    except ValueError as err:
        return {"error": str(err), "meta": model.built_on_meta}
    return {
        "error": None,
        "meta": model.built_on_meta,  # the model was built on the meta device
        "buffers": reader.buffers,
        "shared": reader.shared,
        "losses": model.losses,
    }


def _reference_buffers() -> dict[str, torch.Tensor]:
    return dict(Net().named_buffers(remove_duplicate=False))


def test_deferred_buffers_at_zero3(tmp_path):
    jobs = [
        functools.partial(_fit, "normal", None),
        functools.partial(_fit, "init_module", None),
        functools.partial(_fit, "configure_model", "tests.integration.test_deferred_buffers.init_weights"),
        functools.partial(_fit, "random_buffer", init_weights),
    ]
    reference = _reference_buffers()
    for normal, init_module, configured, unrecoverable in run_jobs(jobs, str(tmp_path), world=2, timeout=600):
        assert normal["error"] is None and init_module["error"] is None and configured["error"] is None
        assert not normal["meta"] and init_module["meta"] and configured["meta"] and unrecoverable["meta"]
        for run in (normal, init_module, configured):
            assert run["buffers"].keys() == reference.keys()
            for name, value in reference.items():
                assert torch.equal(run["buffers"][name], value), name
            assert run["shared"]
        # reset_parameters alone: the model the normal build has, so the same training
        assert init_module["losses"] == pytest.approx(normal["losses"], abs=1e-6)
        assert all(math.isfinite(loss) for loss in configured["losses"]) and configured["losses"]
        error = unrecoverable["error"]
        assert error is not None and "'net.blocks.1.attn.noise'" in error and "randn" in error
        assert "reset_parameters()" in error and "param_init_fn" in error


# -- in this process: the Initializer on a model built under meta_init ------------------------------


def _materialize(net: nn.Module, init_fn=None) -> None:
    with Initializer(init_fn, torch.get_rng_state()) as initializer:
        for name, module in post_order(net):
            initializer.materialize(name, module)


class Written(nn.Module):
    """Buffers set by code that runs at setup: its reset_parameters, and its parent's init."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.rand(3))  # random, but reset_parameters sets it
        self.register_buffer("by_parent", torch.randn(2))  # random, but the parent's init_fn sets it
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.scale.data.copy_(torch.tensor([1.0, 2.0, 3.0]))  # through .data: no version bump


def test_buffers_recorded_under_meta_init_keep_values_aliases_and_sharing():
    def build() -> nn.Module:
        net = Net()
        view = net.blocks[0].attn.mask.view(-1)  # a view: writing it writes the mask
        view[0] = 7.0
        net.register_buffer("like", torch.zeros_like(net.head.weight).add_(0.5))  # shape of a parameter
        return net

    reference = dict(build().named_buffers(remove_duplicate=False))
    rng = torch.get_rng_state()
    with meta_init("cpu"):
        net = build()
    assert torch.equal(torch.get_rng_state(), rng)  # building on meta draws no random numbers
    _materialize(net)
    buffers = dict(net.named_buffers(remove_duplicate=False))
    assert buffers.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(buffers[name], value), name
    assert net.blocks[0].attn.mask is net.blocks[1].attn.mask and net.blocks[0].attn.mask[0, 0] == 7.0


def test_buffers_set_by_init_code_and_unrecoverable_ones():
    def init_fn(module: nn.Module) -> None:
        if isinstance(module, nn.Sequential):
            module[0].by_parent.fill_(5.0)

    with meta_init("cpu"):
        net = nn.Sequential(Written(), nn.Linear(2, 2))
    _materialize(net, init_fn)
    assert net[0].scale.tolist() == [1.0, 2.0, 3.0] and net[0].by_parent.tolist() == [5.0, 5.0]

    with meta_init("cpu"):
        net = nn.Sequential(Written(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"buffer '0\.by_parent' .*made by randn.*reset_parameters\(\)"):
        _materialize(net)

    with torch.device("meta"):  # outside the strategy's context: nothing was recorded
        net = Net()
    with pytest.raises(
        ValueError,
        match=r"buffer 'blocks\.0\.attn\.rotary\.inv_freq' .*not made by a tensor operation",
    ):
        _materialize(net, init_weights)
