"""Train the character-level GPT with a ZeRO strategy, configured by Hydra.

    python examples/train.py                                        # gpt_tiny, 2 CPU procs, zero0
    python examples/train.py strategy.bucket_cap_mb=1 trainer.max_steps=50
    python examples/train.py -m strategy.bucket_cap_mb=1,25 trainer.max_steps=20
    python examples/train.py model=gpt_small trainer=gpu

Config groups live in configs/: model/ (the GPT shape and AdamW), data/ (the bundled corpus),
trainer/ (lightning.Trainer arguments and how processes are launched), strategy/ (ZeroConfig
fields, checked against the registered ``schema/strategy``). Each run writes its config and
logs under outputs/ (multirun: multirun/). The validation loss is printed at step 0 (the sanity
check), at every validation and at the end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: make `examples` and `lightning_zero` importable
    sys.path.insert(0, str(REPO_ROOT))

import hydra  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from tqdm import tqdm  # noqa: E402

import lightning_zero  # noqa: E402
from examples.data import CharDataModule  # noqa: E402
from examples.gpt import GPTLightning  # noqa: E402
from lightning_zero.callbacks import ProfileSteps, ZeroMonitor  # noqa: E402
from lightning_zero.config import register_hydra_schema  # noqa: E402
from lightning_zero.planning import register_resolvers  # noqa: E402

# Before @hydra.main composes anything: configs/strategy/*.yaml extend `schema/strategy`.
register_hydra_schema()
register_resolvers()  # ${zero_grad_acc:global_batch,micro_batch,devices[,num_nodes]} in configs


class ValLossReport(L.Callback):
    """Prints the synchronised validation loss on rank 0 after every validation, one line each.

    The lines are for logs, where a progress bar is only carriage returns; ``tqdm.write`` puts them
    above Lightning's progress bar on a terminal instead of inside it (and is a plain print without one).
    """

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val_loss")
        if loss is not None and trainer.is_global_zero:
            label = "sanity check" if trainer.sanity_checking else "validation"
            tqdm.write(f"step {trainer.global_step:>6}  val_loss {float(loss):.4f}  ({label})")
            sys.stdout.flush()


class ValidateAtLastStep(L.Callback):
    """Makes Lightning validate after the last optimizer step, whatever ``val_check_interval`` is.

    Setting ``trainer.should_stop`` at ``max_steps`` is Lightning's early-stopping path, which
    runs one validation before leaving fit; so the final loss is measured inside ``fit`` and no
    second launch (``trainer.validate``) is needed.
    """

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


class ThreadsAfterFork(L.Callback):
    """Each forked rank computes with the threads Lightning gives it (see [Note: OpenMP and fork]).

    [Note: OpenMP and fork]
    GNU OpenMP does not survive a fork: a process forked from one whose OpenMP threads exist finds
    their bookkeeping but not the threads, and its first parallel region waits for them forever.
    Under a multirun the sweep's process forks a job's ranks and then, between jobs, computes
    (the returned weights loaded, the sample drawn): with more than one thread that starts its
    OpenMP threads, and the next job's ranks hang. So when ranks are forked, the launching process
    computes with one thread, and each rank takes, once forked, the count Lightning chose for it
    (``OMP_NUM_THREADS``: the cores per rank unless the user set it).
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def launch_kwargs(trainer_cfg: dict) -> dict:
    """Pop the strategy's launch arguments (``trainer.strategy``) out of the Trainer arguments.

    [Note: launching under a Hydra multirun]
    Lightning's default "popen" launcher starts ranks 1..N-1 by re-running this script with the
    same command line. Under ``-m`` that command line is the whole sweep: each child runs every
    job of the sweep in a multirun folder of its own, and the parent's later jobs find
    LOCAL_RANK already set and start no children, so they work only while the first job's child
    happens to walk the sweep in step with the parent. So in a multirun a "popen" setting is
    replaced by ``multirun_start_method``, which starts fresh workers from inside each job:
    "fork" on CPU (fast: no re-import; forked workers leave through os._exit), "spawn" on GPU
    (CUDA does not survive a fork).
    """
    launch = dict(trainer_cfg.pop("strategy", None) or {})
    multirun_start_method = launch.pop("multirun_start_method", "spawn")
    external = SLURMEnvironment.detect() or TorchElasticEnvironment.detect()  # srun/torchrun start every rank
    if (
        HydraConfig.get().mode == RunMode.MULTIRUN
        and not external
        and launch.get("start_method", "popen") == "popen"
    ):
        launch["start_method"] = multirun_start_method
    return launch


def sample_text(model: GPTLightning, data: CharDataModule, num_chars: int, seed: int) -> str:
    """``num_chars`` characters generated from a newline, with a seeded generator."""
    device = next(model.parameters()).device
    start = torch.tensor([data.encode("\n")], device=device)  # (1, 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    model.eval()
    ids = model.generate(start, num_chars, temperature=0.8, top_k=20, generator=generator)  # (1, 1 + n)
    return data.decode(ids[0, 1:])


@hydra.main(config_path="../configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    launch = launch_kwargs(trainer_cfg)
    forked = launch.get("start_method") == "fork"
    if forked:
        torch.set_num_threads(1)  # before any computation here: see [Note: OpenMP and fork]
    L.seed_everything(cfg.seed, workers=True)
    data = CharDataModule(**OmegaConf.to_container(cfg.data, resolve=True))
    model = GPTLightning(vocab_size=data.vocab_size, **OmegaConf.to_container(cfg.model, resolve=True))
    zero_cfg = OmegaConf.to_container(cfg.strategy)  # ZeroConfig fields, checked by the schema
    strategy = lightning_zero.ZeroStrategy(**zero_cfg, **launch)
    callbacks = [ValLossReport(), ValidateAtLastStep()] + ([ThreadsAfterFork()] if forked else [])
    if cfg.monitor:  # traffic, exposed communication, memory and step times per step (docs/monitoring.md)
        callbacks.append(ZeroMonitor())
    if (
        cfg.profile_steps > 0
    ):  # torch.profiler trace of a few steps, one JSON per rank (README: Seeing what a step costs)
        callbacks.append(ProfileSteps(HydraConfig.get().runtime.output_dir, steps=cfg.profile_steps))
    callbacks.extend(instantiate(spec) for spec in cfg.callbacks.values())  # +callbacks.NAME._target_=...
    if trainer_cfg.get("enable_checkpointing"):  # docs/checkpoints.md
        callbacks.append(ModelCheckpoint(**OmegaConf.to_container(cfg.checkpoint, resolve=True)))
    trainer = L.Trainer(strategy=strategy, callbacks=callbacks, **trainer_cfg)
    trainer.fit(model, datamodule=data)
    val_loss = float(trainer.callback_metrics["val_loss"])
    if trainer.is_global_zero:
        print(f"final val_loss {val_loss:.4f}", flush=True)
        if cfg.sample_chars > 0:
            print(f"sample:\n{sample_text(model, data, cfg.sample_chars, cfg.seed)}", flush=True)
    return val_loss


if __name__ == "__main__":
    main()
