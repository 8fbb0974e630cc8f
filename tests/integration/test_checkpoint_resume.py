"""Resume anywhere: a checkpoint written by any stage on N ranks continues with any stage on M ranks.

The reference: one uninterrupted run in a single process. Every run keeps the *global* batch
fixed (``GLOBAL_BATCH`` sequences per micro-batch, each of the N ranks taking GLOBAL_BATCH / N)
and Lightning's DistributedSampler does not shuffle, so rank r takes samples r, r + N, r + 2N, ...
and the N per-rank batches of micro-batch j together are exactly samples [j*G, (j+1)*G): every
world size consumes the same samples per optimizer step, and the averaged gradient is the same
mean loss's. A run that changes world size at an epoch end therefore continues as the
single-process run does, up to float summation order (compared within 1e-6, fp32). Checkpoints
are taken at epoch ends: Lightning resumes mid-epoch checkpoints only approximately.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroStrategy
from lightning_zero.cli import main
from tests.integration.lit import LitTiny, TokenData

TOL = 1e-6
GLOBAL_BATCH = 8  # sequences per micro-batch over all ranks; divisible by 1, 2 and 4
SAMPLES = 48  # per epoch: 6 micro-batches, 3 optimizer steps with accumulation 2
EPOCHS = 3
BLOCK = "tests.distributed.models.Block"


class LitResume(LitTiny):
    """LitTiny (two param groups, AdamW, a per-step StepLR) with the global batch held fixed."""

    def __init__(self) -> None:
        super().__init__(groups=True, stack=True)

    def setup(self, stage: str) -> None:
        # in the forked rank, before any computation: the pytest process may have run OpenMP
        # regions before forking, and GNU OpenMP's thread team does not survive a fork (a
        # parallel kernel in the child waits forever); one thread never enters the team
        torch.set_num_threads(1)

    def train_dataloader(self):
        return DataLoader(TokenData(SAMPLES, seed=1), batch_size=GLOBAL_BATCH // self.trainer.world_size)


class FinalState(Callback):
    """At the end of fitting: full parameters, full optimizer state, scheduler and progress (rank 0 writes)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine  # every rank takes part in the gathers
        params = engine.module_state_dict(pl_module)
        optimizer = engine.optimizer_state(trainer.optimizers[0], 0)
        if trainer.global_rank == 0:
            torch.save(
                {
                    "params": {n: params[n].detach().clone() for n, _ in pl_module.named_parameters()},
                    "optimizer": optimizer,
                    "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                    "global_step": trainer.global_step,
                    "epoch": trainer.current_epoch,
                },
                self.out / "final.pt",
            )


def strategy(stage: int, kind: str, **options) -> ZeroStrategy:
    if stage == 3:
        options.setdefault("wrap_policy", BLOCK)
    return ZeroStrategy(stage=stage, state_dict_type=kind, start_method="fork", **options)


def fit(
    out: Path,
    stage: int,
    world: int,
    kind: str,
    *,
    epochs: int,
    ckpt_path=None,
    checkpoint: ModelCheckpoint | None = None,
    callbacks=(),
    precision: str = "32-true",
) -> dict:
    """Fit LitResume with ``zero<stage>`` on ``world`` processes; checkpoints go to ``out/ckpt``."""
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = checkpoint or ModelCheckpoint(dirpath=out / "ckpt", save_last=True, save_top_k=0)
    trainer = Trainer(
        strategy=strategy(stage, kind),
        accelerator="cpu",
        devices=world,
        max_epochs=epochs,
        precision=precision,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[FinalState(out), checkpoint, *callbacks],
        default_root_dir=out,
    )
    trainer.fit(LitResume(), ckpt_path=ckpt_path)
    return torch.load(out / "final.pt", weights_only=False)


def run_chain(root: Path, kind: str, chain: list[tuple[int, int]]) -> dict:
    """One epoch per hop, each hop resuming the previous hop's ``last.ckpt``; the last runs to EPOCHS."""
    ckpt = None
    for hop, (stage, world) in enumerate(chain):
        out = root / f"{hop}-zero{stage}@{world}"
        epochs = hop + 1 if hop < len(chain) - 1 else EPOCHS
        final = fit(out, stage, world, kind, epochs=epochs, ckpt_path=ckpt)
        ckpt = out / "ckpt" / "last.ckpt"
        assert ckpt.is_dir() == (kind == "sharded")
    return final


def assert_continues_exactly(got: dict, ref: dict) -> None:
    assert got["global_step"] == ref["global_step"] == EPOCHS * SAMPLES // GLOBAL_BATCH // 2
    assert got["epoch"] == ref["epoch"]
    assert got["scheduler"] == ref["scheduler"]  # LR schedule, last_epoch
    assert got["params"].keys() == ref["params"].keys()
    assert max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"]) <= TOL
    a, b = got["optimizer"], ref["optimizer"]
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, entry in b["state"].items():
        assert entry.keys() == a["state"][i].keys()
        assert a["state"][i]["step"].item() == entry["step"].item()  # step counts
        for name in ("exp_avg", "exp_avg_sq"):
            assert (a["state"][i][name] - entry[name]).abs().max().item() <= TOL


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted single-process run."""
    return fit(tmp_path_factory.mktemp("reference"), 0, 1, "full", epochs=EPOCHS)


CHAINS = [  # (format, [(stage, world size), ...]): every stage saves and loads, N and M in {1, 2, 4}
    ("sharded", [(3, 4), (1, 2), (0, 1)]),
    ("sharded", [(2, 2), (3, 4)]),
    ("full", [(0, 2), (2, 2), (3, 1)]),
    ("full", [(1, 4), (3, 2)]),
]


@pytest.mark.parametrize(
    ("kind", "chain"), CHAINS, ids=["-".join(f"zero{s}@{n}" for s, n in c) + f"-{k}" for k, c in CHAINS]
)
def test_resume_with_another_stage_and_world_size(tmp_path, reference, kind, chain):
    assert_continues_exactly(run_chain(tmp_path, kind, chain), reference)


@pytest.mark.parametrize(("stage", "kind"), [(3, "sharded"), (1, "full")])
def test_mixed_precision_resume_is_exact(tmp_path, stage, kind):
    """bf16 parameters, fp32 masters: the checkpoint carries the masters; a resume on the same
    stage and ranks repeats the uninterrupted run bit for bit."""
    ref = fit(tmp_path / "ref", stage, 2, kind, epochs=EPOCHS, precision="bf16-mixed")
    fit(tmp_path / "first", stage, 2, kind, epochs=1, precision="bf16-mixed")
    ckpt = tmp_path / "first" / "ckpt" / "last.ckpt"
    got = fit(tmp_path / "again", stage, 2, kind, epochs=EPOCHS, ckpt_path=ckpt, precision="bf16-mixed")
    assert got["global_step"] == ref["global_step"] and got["scheduler"] == ref["scheduler"]
    assert all(
        v.dtype == torch.float32 and torch.equal(v, ref["params"][k]) for k, v in got["params"].items()
    )
    for i, entry in ref["optimizer"]["state"].items():
        assert all(torch.equal(got["optimizer"]["state"][i][k], v) for k, v in entry.items())


@pytest.fixture(scope="module")
def first_epochs(tmp_path_factory):
    """(format, stage, N) -> the last.ckpt of a one-epoch run, made once."""
    made: dict[tuple, Path] = {}

    def get(kind: str, stage: int, world: int) -> Path:
        if (kind, stage, world) not in made:
            out = tmp_path_factory.mktemp(f"first-{kind}-zero{stage}-{world}")
            fit(out, stage, world, kind, epochs=1)
            made[(kind, stage, world)] = out / "ckpt" / "last.ckpt"
        return made[(kind, stage, world)]

    return get


GRID = list(itertools.product(("full", "sharded"), (0, 1, 2, 3), (2, 4), (0, 1, 2, 3), (1, 2, 4)))


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "save_stage", "n", "load_stage", "m"), GRID)
def test_resume_grid(tmp_path, reference, first_epochs, kind, save_stage, n, load_stage, m):
    ckpt = first_epochs(kind, save_stage, n)
    final = fit(tmp_path, load_stage, m, kind, epochs=EPOCHS, ckpt_path=ckpt)
    assert_continues_exactly(final, reference)


def test_top_k_last_and_removal_keep_working(tmp_path):
    """Sharded directories under ModelCheckpoint: the best k kept, older ones removed, last replaced;
    trainer.validate(ckpt_path=directory) loads one."""
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="train_loss", save_top_k=1, save_last=True
    )
    fit(tmp_path, 2, 2, "sharded", epochs=EPOCHS, checkpoint=checkpoint)
    names = sorted(
        n for n in os.listdir(tmp_path / "ckpt") if n != ".last.ckpt.previous"
    )  # kept: the fallback
    assert len(names) == 2 and "last.ckpt" in names, names  # one best epoch + last; no leftovers
    best = Path(checkpoint.best_model_path)
    assert best.name in names and best.is_dir()
    for name in names:
        meta = torch.load(tmp_path / "ckpt" / name / "meta.pt", weights_only=False)
        assert meta["lightning_zero"]["world_size"] == 2
    assert torch.load(tmp_path / "ckpt" / "last.ckpt" / "meta.pt", weights_only=False)["epoch"] == EPOCHS - 1
    # evaluation reads a sharded directory into the plain model, as it reads the consolidated file
    assert main(["consolidate", str(best), str(tmp_path / "best.ckpt")]) == 0
    losses = [
        Trainer(
            strategy=strategy(3, "sharded"),
            accelerator="cpu",
            devices=2,
            logger=False,
            enable_progress_bar=False,
        ).validate(LitResume(), ckpt_path=path)[0]["val_loss"]
        for path in (best, tmp_path / "best.ckpt", None)
    ]
    assert losses[0] == losses[1] != losses[2]  # and not the untrained model's
