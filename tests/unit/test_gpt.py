"""The example GPT and its character data: shapes, causality, weight tying, optimizer groups,
determinism. No process group, CPU only, a few seconds in all."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from examples.data import CharDataModule, corpus_text
from examples.gpt import GPT, Block, GPTConfig, GPTLightning, lr_lambda

TINY = dict(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=16)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


@pytest.fixture(scope="module")
def data() -> CharDataModule:
    dm = CharDataModule(block_size=32, batch_size=4, num_train_samples=64, seed=7)
    dm.setup("fit")
    return dm


# ----------------------------------------------------------------------------- model


def test_logits_shape_and_blocks():
    model = tiny_gpt()
    idx = torch.randint(0, TINY["vocab_size"], (3, 10))  # (B, T)
    assert model(idx).shape == (3, 10, TINY["vocab_size"])  # (B, T, V)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert len(blocks) == TINY["n_layer"]
    assert Block.__module__ == "examples.gpt"  # the path a wrap policy names


def test_context_longer_than_block_size_is_refused():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_config_rejects_heads_that_do_not_divide_width():
    with pytest.raises(ValueError, match="n_embd must be a multiple of n_head"):
        GPTConfig(n_embd=10, n_head=4)


@pytest.mark.parametrize("t", [0, 5, 14])
def test_output_at_t_does_not_depend_on_later_tokens(t):
    model = tiny_gpt().eval()
    a = torch.randint(0, TINY["vocab_size"], (2, 16))
    b = a.clone()
    b[:, t + 1 :] = (a[:, t + 1 :] + 1) % TINY["vocab_size"]  # change every token after t
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, : t + 1], lb[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(la[:, t + 1 :], lb[:, t + 1 :])  # later positions do see the change


def test_tie_weights_shares_one_tensor():
    tied, untied = tiny_gpt(tie_weights=True), tiny_gpt(tie_weights=False)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight
    V, C = TINY["vocab_size"], TINY["n_embd"]
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == V * C
    # a gradient step through the head moves the embedding too
    tied(torch.randint(0, V, (1, 4))).sum().backward()
    assert tied.wte.weight.grad is not None and tied.wte.weight.grad.abs().sum() > 0


def test_same_seed_same_weights():
    a, b = tiny_gpt(seed=3), tiny_gpt(seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(tiny_gpt(seed=4).wte.weight, a.wte.weight)


def test_residual_projections_have_scaled_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=4, n_embd=128))
    std = model.blocks[0].mlp.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert model.blocks[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


# ----------------------------------------------------------------------------- optimizer


@pytest.mark.parametrize("tie", [False, True])
def test_param_groups_cover_every_trainable_param_once(tie):
    model = tiny_gpt(tie_weights=tie)
    model.blocks[1].ln_2.bias.requires_grad_(False)  # frozen: in no group
    decay, no_decay = model.optim_groups(weight_decay=0.1)
    grouped = [id(p) for p in decay["params"] + no_decay["params"]]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert len(grouped) == len(set(grouped)) == len(trainable)
    assert set(grouped) == trainable
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)

    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    embeddings = {id(model.wte.weight), id(model.wpe.weight)}
    assert {id(p) for p in decay["params"]} == linear_weights - embeddings
    assert all(p.dim() == 1 or id(p) in embeddings for p in no_decay["params"])


def test_configure_optimizers_builds_adamw_and_step_schedule():
    module = GPTLightning(**TINY, lr=1e-3, weight_decay=0.05, betas=[0.8, 0.9], warmup_steps=4)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    assert config["lr_scheduler"]["interval"] == "step"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)  # first warmup step
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # warmup done, no max_steps: flat


def test_lr_schedule_shapes():
    kw = dict(warmup_steps=10, decay_steps=110, min_lr_ratio=0.1)
    assert lr_lambda(0, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_lambda(9, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_lambda(60, schedule="cosine", **kw) == pytest.approx(0.55)  # halfway: mean of 1 and 0.1
    assert lr_lambda(60, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_lambda(35, schedule="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.75)
    assert lr_lambda(110, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_lambda(500, schedule="linear", **kw) == pytest.approx(0.1)
    assert lr_lambda(500, schedule="constant", **kw) == 1.0


def test_hparams_rebuild_the_same_module():
    module = GPTLightning(GPTConfig(**TINY, tie_weights=True), lr=2e-3)
    rebuilt = GPTLightning(**module.hparams)  # what load_from_checkpoint does
    assert rebuilt.config == module.config
    assert rebuilt.hparams.lr == 2e-3
    with pytest.raises(TypeError, match="either config or its fields"):
        GPTLightning(GPTConfig(**TINY), n_layer=3)


def test_a_few_steps_on_one_batch_lower_the_loss(data):
    torch.manual_seed(0)
    shape = dict(vocab_size=data.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32)
    module = GPTLightning(**shape, warmup_steps=0)
    optimizer = module.configure_optimizers()["optimizer"]
    batch = next(iter(data.train_dataloader()))
    losses = []
    for _ in range(20):
        loss = module._loss(batch)  # training_step without the Trainer's logging
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(data.vocab_size), abs=0.2)  # uniform at init
    assert losses[-1] < losses[0] - 1.0


# ----------------------------------------------------------------------------- generation


def test_generate_is_seeded_and_keeps_the_prompt():
    model = tiny_gpt().eval()
    prompt = torch.tensor([[1, 2, 3]])
    out_a = model.generate(prompt, 20, generator=torch.Generator().manual_seed(5))
    out_b = model.generate(prompt, 20, generator=torch.Generator().manual_seed(5))
    assert out_a.shape == (1, 23)
    assert torch.equal(out_a, out_b)
    assert torch.equal(out_a[:, :3], prompt)
    top1 = model.generate(prompt, 20, top_k=1, generator=torch.Generator().manual_seed(9))
    assert torch.equal(top1, model.generate(prompt, 20, temperature=0.0))  # top-1 sampling is greedy


def test_generate_crops_context_to_block_size():
    model = tiny_gpt().eval()
    out = model.generate(torch.zeros(2, 16, dtype=torch.long), 5, temperature=0.0)  # beyond block_size
    assert out.shape == (2, 21)


def test_predict_step_returns_greedy_continuations():
    module = GPTLightning(**TINY, predict_new_tokens=7).eval()
    x = torch.randint(0, TINY["vocab_size"], (2, 4))
    out = module.predict_step((x, x), 0)
    assert out.shape == (2, 11)
    assert torch.equal(out, module.generate(x, 7, temperature=0.0))


# ----------------------------------------------------------------------------- data


def test_vocabulary_is_the_sorted_set_of_corpus_characters(data):
    text = corpus_text()
    assert len(text) > 400_000
    assert data.chars == sorted(set(text))
    assert data.vocab_size == len(set(text))
    sample = text[1000:1200]
    assert data.decode(data.encode(sample)) == sample
    with pytest.raises(ValueError, match="not in the vocabulary"):
        data.encode("\x00")


def test_split_is_ninety_ten_in_corpus_order(data):
    n = data.data.numel()
    assert data.train_data.numel() == int(0.9 * n)
    assert data.train_data.numel() + data.val_data.numel() == n
    assert data.decode(data.val_data[:50]) == corpus_text()[int(0.9 * n) :][:50]


def test_train_windows_are_fixed_length_shifted_and_seeded(data):
    train = data.train_set
    assert len(train) == 64
    x, y = train[3]
    assert x.shape == y.shape == (32,)
    assert torch.equal(x[1:], y[:-1])
    again = CharDataModule(block_size=32, num_train_samples=64, seed=7)
    again.setup("fit")
    assert torch.equal(again.train_set.starts, train.starts)
    other = CharDataModule(block_size=32, num_train_samples=64, seed=8)
    other.setup("fit")
    assert not torch.equal(other.train_set.starts, train.starts)
    assert int(train.starts.max()) + 33 <= data.train_data.numel()  # windows stay inside the split


def test_val_windows_tile_the_validation_split(data):
    val = data.val_set
    assert len(val) == (data.val_data.numel() - 1) // 32
    x0, y0 = val[0]
    x1, _ = val[1]
    assert torch.equal(x0, data.val_data[:32])
    assert torch.equal(x1, data.val_data[32:64])
    assert torch.equal(y0, data.val_data[1:33])
    with pytest.raises(IndexError):
        val[len(val)]


def test_dataloaders_batch_and_leave_sampling_to_lightning(data):
    loader = data.train_dataloader()
    x, y = next(iter(loader))
    assert x.shape == y.shape == (4, 32)
    assert len(loader) == 64 // 4
    assert not isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    assert len(data.val_dataloader().dataset) == len(data.val_set)
