"""examples/train.py end to end: the Hydra app as a user runs it, in a subprocess, on 2 CPU ranks.

Each test takes seconds: gpt_tiny, a handful of steps, 2 validation batches.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
APP = REPO_ROOT / "examples" / "train.py"
SHORT = [
    "trainer.max_steps=10",
    "trainer.limit_val_batches=2",
    "data.num_train_samples=1024",
    "sample_chars=20",
]
VAL_LOSS = re.compile(r"step\s+(\d+)\s+val_loss (\d+\.\d+)")
FINAL = re.compile(r"final val_loss (\d+\.\d+)")


def run_app(args: list[str], cwd: Path, timeout: float = 120, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONUNBUFFERED": "1", **env_vars}
    env.pop("LOCAL_RANK", None)  # let Lightning launch the ranks itself
    return subprocess.run(
        [sys.executable, str(APP), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def explain(result: subprocess.CompletedProcess) -> str:
    return (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    )


def test_short_run_lowers_the_validation_loss(tmp_path):
    args = [*SHORT, "trainer.enable_checkpointing=true", f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_app(args, cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    # Lightning's progress bar (rich's or tqdm's)
    assert "Epoch 0" in result.stdout + result.stderr, explain(result)
    losses = [(int(step), float(loss)) for step, loss in VAL_LOSS.findall(result.stdout)]
    assert [step for step, _ in losses] == [0, 10], explain(result)  # sanity check, then the last step
    (final,) = (float(v) for v in FINAL.findall(result.stdout))
    assert final == losses[-1][1]
    assert final < losses[0][1] - 0.3, explain(result)  # ~4.6 (uniform over the vocabulary) -> ~3.9
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()
    assert list((tmp_path / "run" / "lightning_logs").glob("version_*/metrics.csv"))
    # configs/config.yaml `checkpoint`: the last step under a name known in advance (docs/checkpoints.md)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=10.ckpt", "last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 10


def test_multirun_sweeps_bucket_cap(tmp_path):
    args = [
        "-m",
        "strategy.bucket_cap_mb=1,25",
        *SHORT,
        "trainer.max_steps=4",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    # two threads per rank: the sweep's process then must not start OpenMP threads between jobs,
    # or the second job's forked ranks hang (see [Note: OpenMP and fork] in examples/train.py)
    result = run_app(args, cwd=tmp_path, OMP_NUM_THREADS="2")
    assert result.returncode == 0, explain(result)
    finals = FINAL.findall(result.stdout)
    assert len(finals) == 2, explain(result)
    # two ranks average exactly, whatever the bucketing: both jobs train the same weights
    assert finals[0] == finals[1], explain(result)
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("strategy.bucket_cap_mbb=1", "Key 'bucket_cap_mbb' not in 'ZeroConfig'"),
        ("strategy.bucket_cap_mb=big", "Value 'big' of type 'str' could not be converted to Float"),
        ("model.n_layr=3", "n_layr"),
    ],
)
def test_bad_override_is_a_hydra_error_naming_the_key(tmp_path, override, message):
    result = run_app([override, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr, explain(result)
    assert "Initializing distributed" not in result.stdout + result.stderr  # refused before any launch


def test_unknown_strategy_lists_the_stages(tmp_path):
    result = run_app(["strategy=zero9", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=60)
    assert result.returncode != 0
    assert "Could not find 'strategy/zero9'" in result.stderr, explain(result)
    listed = result.stderr.split("Available options in 'strategy':")[1].split("Config search path")[0]
    assert listed.split() == ["zero0", "zero1", "zero2", "zero3"], explain(result)  # not the schema
    assert "Initializing distributed" not in result.stdout + result.stderr
