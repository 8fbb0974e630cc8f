"""Train the character-level GPT with a hand-written Lightning Fabric loop and a ZeRO strategy.

    python examples/fabric_train.py                                   # zero3, gpt_tiny, 2 CPU processes
    python examples/fabric_train.py --strategy zero1 --steps 40       # any of zero0..zero3, or ddp
    python examples/fabric_train.py --resume outputs/fabric/last.ckpt --steps 80
    torchrun --nproc-per-node=2 examples/fabric_train.py --steps 40   # processes started by torchrun

The loop is the one a Fabric user writes: ``fabric.setup``, gradient accumulation with
``fabric.no_backward_sync``, ``fabric.backward``, clipping by the global norm, the optimizer and
LR-scheduler steps, a loss line every ``--log-every`` steps, the validation loss at the end and a
checkpoint (``fabric.save``) that ``--resume`` continues. The model is the Hydra app's
``GPTLightning`` (examples/gpt.py), so the checkpoint has the Trainer's parameter names: the app's
checkpoints resume here and this script's resume in a Trainer (docs/fabric.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: make `examples` and `lightning_zero` importable
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lightning_zero.fabric  # noqa: E402  (registers zero0..zero3 for Fabric too)
from examples.data import CharDataModule  # noqa: E402
from examples.gpt import Block, GPTLightning  # noqa: E402

MODELS = {  # the shapes of configs/model/gpt_tiny.yaml and gpt_small.yaml
    "gpt_tiny": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "lr": 3e-3, "warmup_steps": 20},
    "gpt_small": {
        "n_layer": 4,
        "n_head": 4,
        "n_embd": 128,
        "block_size": 128,
        "lr": 2e-3,
        "warmup_steps": 50,
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="zero3", help="zero0 | zero1 | zero2 | zero3 | ddp (Fabric's own)")
    p.add_argument("--state-dict-type", default="full", choices=("full", "sharded"), help="checkpoint form")
    p.add_argument("--model", default="gpt_tiny", choices=sorted(MODELS))
    p.add_argument("--accelerator", default="cpu", help="cpu | gpu | auto")
    p.add_argument("--devices", type=int, default=2, help="processes per node")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--precision", default="32-true", help="32-true | bf16-mixed | bf16-true | 16-mixed (GPU)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in all (a resumed run counts on)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank and micro-batch")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    p.add_argument("--log-every", type=int, default=10, help="optimizer steps between loss lines")
    p.add_argument("--val-batches", type=int, default=8, help="validation batches per rank at the end")
    p.add_argument(
        "--save", default="outputs/fabric/last.ckpt", help="checkpoint written at the end ('' = none)"
    )
    p.add_argument(
        "--resume", default=None, help="checkpoint to continue from (this script's, or the Trainer's)"
    )
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def make_strategy(args: argparse.Namespace) -> object:
    """``zeroK`` as this package's Fabric strategy (stage 3: one unit per transformer block), else
    the name as Fabric knows it (``ddp``)."""
    names = {f"zero{k}": k for k in range(4)}
    if args.strategy not in names:
        return args.strategy
    stage = names[args.strategy]
    options = {"wrap_policy": Block} if stage == 3 else {}
    return lightning_zero.fabric.ZeroFabricStrategy(
        stage=stage, state_dict_type=args.state_dict_type, **options
    )


def set_up(fabric: L.Fabric, data: CharDataModule, args: argparse.Namespace) -> dict:
    """Model, optimizer and LR schedule (the Hydra app's), set up by Fabric; the state to save."""
    shape = MODELS[args.model]
    with fabric.init_module():
        model = GPTLightning(vocab_size=data.vocab_size, decay_steps=args.steps, **shape)
    optim = model.configure_optimizers()  # AdamW with two param groups, warmup then cosine decay
    optimizer, scheduler = optim["optimizer"], optim["lr_scheduler"]["scheduler"]
    model, optimizer = fabric.setup(model, optimizer)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}


def batches(loader):
    """Micro-batches for ever, epoch after epoch (Fabric reshuffles each epoch)."""
    while True:
        yield from loader


def loss_of(model, batch) -> torch.Tensor:
    x, y = batch  # (B, T), (B, T)
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def train(fabric: L.Fabric, state: dict, loader, args: argparse.Namespace) -> None:
    model, optimizer, scheduler = state["model"], state["optimizer"], state["scheduler"]
    stream, start = batches(loader), time.perf_counter()
    model.train()
    while state["step"] < args.steps:
        for micro in range(args.accumulate):  # no collective until the last micro-batch (stages 0-1)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = loss_of(model, next(stream))
                fabric.backward(loss / args.accumulate)
        if args.clip > 0:
            fabric.clip_gradients(model, optimizer, max_norm=args.clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        if state["step"] % args.log_every == 0 or state["step"] == args.steps:
            mean = fabric.all_reduce(loss.detach(), reduce_op="mean")  # the last micro-batch's, all ranks
            lr = scheduler.get_last_lr()[0]
            elapsed = time.perf_counter() - start
            fabric.print(
                f"step {state['step']:>5}  loss {mean.item():.4f}  lr {lr:.2e}  ({elapsed:.1f} s)", flush=True
            )


@torch.no_grad()
def validate(fabric: L.Fabric, model, loader, num_batches: int) -> float:
    model.eval()
    losses = [loss_of(model, batch) for _, batch in zip(range(num_batches), loader)]
    model.train()
    return fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean").item()


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    fabric = L.Fabric(
        strategy=make_strategy(args),
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision,
    )
    fabric.launch()
    fabric.seed_everything(args.seed)
    data = CharDataModule(block_size=MODELS[args.model]["block_size"], batch_size=args.batch_size)
    data.setup()
    state = set_up(fabric, data, args)
    train_loader, val_loader = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())
    if args.resume:  # model, optimizer, scheduler; the step comes back among the rest
        remainder = fabric.load(args.resume, {k: v for k, v in state.items() if k != "step"})
        state["step"] = remainder.get("step", remainder.get("global_step", 0))  # ours, or the Trainer's
        fabric.print(f"resumed from {args.resume} at step {state['step']}")
    train(fabric, state, train_loader, args)
    val_loss = validate(fabric, state["model"], val_loader, args.val_batches)
    fabric.print(f"final val_loss {val_loss:.4f}")
    if args.save:
        fabric.save(args.save, state)
        fabric.print(f"saved {args.save} ({args.strategy}, {args.state_dict_type})")
    return val_loss


if __name__ == "__main__":
    main()
