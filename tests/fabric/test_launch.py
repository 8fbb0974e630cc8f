"""``fabric.launch()`` with Fabric's launchers and under torchrun (slow: fresh processes each).

The default suite launches with Fabric's subprocess launcher (``zeroK``, re-running the script)
through docs/fabric.md's program and the example's command (tests/docs); here the other ways.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "fabric_train.py"

SPAWNED = textwrap.dedent(
    """
    import lightning as L
    import torch

    import lightning_zero  # noqa: F401


    def train(fabric):
        torch.manual_seed(0)  # the same model on both ranks, whatever the strategy broadcasts
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = fabric.setup(model, optimizer)
        data = torch.Generator().manual_seed(fabric.global_rank)
        for _ in range(4):
            x = torch.randn(4, 8, generator=data)
            fabric.backward((model(x) - x.sum(1, keepdim=True)).pow(2).mean())
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
        state = fabric.strategy.full_state_dict(rank0_only=False) if hasattr(fabric.strategy, "engine") else model.state_dict()
        return {k: v.tolist() for k, v in state.items()}  # plain lists: tensors would be shared memory of an ended worker


    if __name__ == "__main__":
        results = {}
        for name in ("ddp_spawn", "zero3_spawn", "zero1_fork"):
            fabric = L.Fabric(strategy=name, accelerator="cpu", devices=2)
            results[name] = fabric.launch(train)
        for name in ("zero3_spawn", "zero1_fork"):
            ours, ddp = results[name], results["ddp_spawn"]
            diff = max((torch.tensor(ours[k]) - torch.tensor(ddp[k])).abs().max().item() for k in ddp)
            print(f"{name} differs from ddp_spawn by {diff:.3e}")
    """
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def _run(cmd: list[str], cwd: Path) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (
        f"{cmd} exited with {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


@pytest.mark.slow
def test_spawn_and_fork_launchers(tmp_path):
    """``zero3_spawn`` and ``zero1_fork`` run a function in workers Fabric starts and return rank 0's
    result, which equals ``ddp_spawn``'s to 1e-6."""
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    out = _run([sys.executable, str(script)], tmp_path)
    diffs = {
        m.group(1): float(m.group(2)) for m in re.finditer(r"(\w+) differs from ddp_spawn by (\S+)", out)
    }
    assert set(diffs) == {"zero3_spawn", "zero1_fork"} and max(diffs.values()) <= 1e-6, out


@pytest.mark.slow
def test_example_under_torchrun_equals_its_own_launcher(tmp_path):
    """The example under ``torchrun --standalone --nproc-per-node=2`` prints the same loss lines as
    under Fabric's own launcher (the same ranks, data and steps), and its checkpoint loads."""
    args = ["--strategy", "zero2", "--steps", "6", "--log-every", "2", "--val-batches", "2"]
    own = _run([sys.executable, str(EXAMPLE), *args, "--save", str(tmp_path / "own.ckpt")], tmp_path)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    under = _run([*torchrun, str(EXAMPLE), *args, "--save", str(tmp_path / "torchrun.ckpt")], tmp_path)
    lines = [
        re.sub(r"\s+\(.*s\)$", "", line) for line in own.splitlines() if line.startswith(("step", "final"))
    ]
    assert len(lines) == 4, own
    assert lines == [
        re.sub(r"\s+\(.*s\)$", "", line) for line in under.splitlines() if line.startswith(("step", "final"))
    ], (own, under)
    assert (tmp_path / "torchrun.ckpt").is_file()
