"""One process: every stage trains as Lightning alone does, with none of the machinery
([Note: one process] in lightning_zero/solo.py).

Each fit runs in the test process (``devices=1``: Lightning launches nothing) against
``strategy="auto"`` on the same model, data and optimizer (AdamW with two groups, a step LR
schedule, gradient accumulation and clipping): the parameters after training are equal. Both keep
the data loader's own sampler (``use_distributed_sampler=False``): a parallel strategy otherwise
gets Lightning's DistributedSampler, which orders one process's batches differently.
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lightning_zero import ZeroStrategy
from lightning_zero.solo import SoloEngine
from tests.bigmodel.lit import quiet_trainer
from tests.compare import max_diff
from tests.integration.lit import LitTiny

TOL = 1e-6


@pytest.fixture(autouse=True)
def _leave_no_process_group():
    """These fits run in the test process: no process group or rendezvous variable outlives them."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        os.environ.pop(name, None)


def _fit(
    strategy,
    root,
    *,
    manual: bool = False,
    max_steps: int = 6,
    checkpoint: bool = False,
    ckpt_path: str | None = None,
    **options,
) -> tuple[Trainer, LitTiny]:
    torch.manual_seed(0)
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=1 if manual else 2,
        gradient_clip_val=None if manual else 0.05,
        logger=False,
        enable_checkpointing=checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,
        default_root_dir=str(root),
        **options,
    )
    model = LitTiny(groups=not manual, manual=manual)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def _params(model: LitTiny) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_on_one_process_trains_as_lightning_alone_with_no_machinery(tmp_path, stage):
    _, reference = _fit("auto", tmp_path / "auto")
    extra = {"wrap_policy": "torch.nn.Linear"} if stage == 3 else {}
    strategy = ZeroStrategy(stage=stage, **extra)
    seen = {}

    def probe(trainer: Trainer) -> None:
        engine = trainer.strategy.engine
        seen["engine"] = type(engine)
        seen["hooks"] = sum(
            len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) + len(p._backward_hooks or {})
            for p in trainer.lightning_module.parameters()
        )
        seen["plain"] = all(type(p) is torch.nn.Parameter for p in trainer.lightning_module.parameters())

    class Probe(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            probe(trainer)

    trainer, model = _fit(strategy, tmp_path / f"zero{stage}", callbacks=[Probe()])
    assert seen == {"engine": SoloEngine, "hooks": 0, "plain": True}, seen
    assert max_diff(_params(model), _params(reference)) <= TOL
    totals = trainer.strategy.ledger.totals()
    assert sum(t.payload_bytes for t in totals.values()) == 0, totals  # nothing sent, nothing counted
    full = trainer.strategy.full_state_dict()
    assert max_diff({n: full[n] for n in _params(model)}, _params(reference)) <= TOL


def test_manual_optimization_on_one_process_matches_lightning_alone(tmp_path):
    _, reference = _fit("auto", tmp_path / "auto", manual=True)
    _, model = _fit(ZeroStrategy(stage=3, wrap_policy="torch.nn.Linear"), tmp_path / "zero3", manual=True)
    assert max_diff(_params(model), _params(reference)) <= TOL


def _first_then_resumed(first, second, root) -> LitTiny:
    """``first`` trains one epoch (7 steps) and saves ``last.ckpt``; ``second`` resumes it to 14."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True, save_top_k=0)
    _fit(first, root / "first", max_steps=7, callbacks=[ckpt], checkpoint=True)
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
    last = str(root / "ckpt" / "last.ckpt")
    return _fit(second, root / "second", max_steps=14, ckpt_path=last)[1]


def test_a_full_checkpoint_of_one_process_resumes_at_another_stage(tmp_path):
    """Saved by stage 3 on one process at the end of an epoch (whole tensors under the original
    names, as every stage writes them), resumed by stage 2 on one process: the run goes on as
    Lightning alone goes on from its own checkpoint."""
    reference = _first_then_resumed("auto", "auto", tmp_path / "auto")
    zero3 = ZeroStrategy(stage=3, wrap_policy="torch.nn.Linear")
    resumed = _first_then_resumed(zero3, ZeroStrategy(stage=2), tmp_path / "zero")
    assert max_diff(_params(resumed), _params(reference)) <= TOL


def test_an_optimizer_no_stage_could_shard_is_refused_on_one_process_too(tmp_path):
    class WithLBFGS(LitTiny):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    trainer = quiet_trainer(ZeroStrategy(stage=1), str(tmp_path), devices=1, max_steps=1)
    with pytest.raises(Exception, match="LBFGS"):
        trainer.fit(WithLBFGS())


def _fabric_run(
    strategy, order: str, precision: str = "32-true", accumulate: int = 1
) -> dict[str, torch.Tensor]:
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
    fabric.launch()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if order == "together":
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:  # litgpt's order: the model first, then an optimizer over model.parameters()
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = torch.Generator().manual_seed(1)
    for step in range(6 * accumulate):
        last = (step + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            fabric.backward(model(torch.randn(4, 8, generator=data)).pow(2).mean())
        if last:
            fabric.clip_gradients(model, opt, max_norm=0.5)
            opt.step()
            opt.zero_grad()
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return state


@pytest.mark.parametrize("order", ["together", "apart"])
def test_fabric_on_one_process_trains_as_fabric_alone_at_every_stage(order):
    from lightning_zero.fabric import ZeroFabricStrategy

    reference = _fabric_run("auto", order)
    for stage in (0, 1, 2, 3):
        extra = {"wrap_policy": "torch.nn.Linear"} if stage == 3 else {}
        strategy = ZeroFabricStrategy(stage=stage, **extra)
        assert max_diff(_fabric_run(strategy, order), reference) <= TOL, stage
        assert isinstance(strategy._run.engine, SoloEngine)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("manual", [False, True])
def test_under_a_precision_policy_one_process_keeps_the_masters_as_stage_0_does(
    tmp_path, monkeypatch, precision, manual
):
    """16-bit parameters, fp32 masters (the policy these precisions set): the one-process path
    makes the masters' gradients at the end of each synced backward, so the loss scaler, clipping
    and accumulation see what stage 0's buckets hand over. Against stage 0's own engine on one
    process (buckets, hooks), the same program: equal, at every stage."""
    import lightning_zero.runtime as runtime

    with monkeypatch.context() as patched:
        patched.setattr(runtime, "runs_solo", lambda *args: False)
        _, reference = _fit(ZeroStrategy(stage=0), tmp_path / "buckets", precision=precision, manual=manual)
    torch.distributed.destroy_process_group()
    for stage in (0, 2, 3):
        extra = {"wrap_policy": "torch.nn.Linear"} if stage == 3 else {}
        root = tmp_path / f"zero{stage}"
        trainer, model = _fit(ZeroStrategy(stage=stage, **extra), root, precision=precision, manual=manual)
        torch.distributed.destroy_process_group()
        assert isinstance(trainer.strategy._run.fitted, SoloEngine)
        assert max_diff(_params(model), _params(reference)) == 0.0, stage


@pytest.mark.parametrize("order", ["together", "apart"])
def test_fabric_on_one_process_under_bf16_mixed_keeps_the_masters_as_stage_0_does(monkeypatch, order):
    """bf16-mixed with accumulation (``no_backward_sync``) and clipping: equal to stage 0's own
    engine on one process."""
    import lightning_zero.runtime as runtime
    from lightning_zero.fabric import ZeroFabricStrategy

    with monkeypatch.context() as patched:
        patched.setattr(runtime, "runs_solo", lambda *args: False)
        reference = _fabric_run(ZeroFabricStrategy(stage=0), order, "bf16-mixed", accumulate=2)
    for stage in (0, 2):
        strategy = ZeroFabricStrategy(stage=stage)
        assert max_diff(_fabric_run(strategy, order, "bf16-mixed", accumulate=2), reference) == 0.0, stage
        assert isinstance(strategy._run.engine, SoloEngine)
