"""README.md and docs/*.md run as written: their shell, console and Python blocks, in page order.

The convention (which blocks run, and the ``<!-- docs-test: slow|skip (why) -->`` markers) is in
tests/docs/blocks.py. The default suite runs every page's unmarked blocks; ``make test-slow``
runs each page that has slow blocks once more, all its runnable blocks, in order.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import (
    DOCUMENTS,
    REPO_ROOT,
    SHELL,
    Block,
    console_commands,
    missing_output,
    page_name,
    parse,
)

TIMEOUT = {"fast": 300, "slow": 1800}  # seconds per block
NOT_LINKED = {
    ".git",
    "outputs",
    "multirun",
    "lightning_logs",
    "checkpoints",
    "plots",
}  # written by the blocks


def blocks_of(doc: Path, tiers: set[str]) -> list[Block]:
    return [b for b in parse(doc)[0] if b.runnable and b.tier in tiers]


def pages_with(tier: str) -> list[Path]:
    return [doc for doc in DOCUMENTS if any(b.tier == tier for b in blocks_of(doc, {tier}))]


def scratch_repository(root: Path) -> Path:
    """A folder that looks like the repository root: a link to each of its entries."""
    root.mkdir(parents=True)
    for entry in REPO_ROOT.iterdir():
        if entry.name not in NOT_LINKED and not entry.name.endswith("_cache"):
            (root / entry.name).symlink_to(entry)
    return root


def block_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1")
    return env


def run_command(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=block_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def explain(where: str, result: subprocess.CompletedProcess) -> str:
    return (
        f"{where} exited with {result.returncode}\n--- stdout (end)\n{result.stdout[-4000:]}"
        f"\n--- stderr (end)\n{result.stderr[-4000:]}"
    )


def run_block(block: Block, repo: Path, python_dir: Path) -> None:
    """Run one block as tests/docs/blocks.py says; fails the test with its output if it fails."""
    timeout = TIMEOUT[block.tier]
    if block.kind in SHELL:
        result = run_command(["bash", "-e", "-o", "pipefail", "-x", "-c", block.code], repo, timeout)
        assert result.returncode == 0, explain(block.where, result)
    elif block.kind == "python":
        script = python_dir / f"block_{block.line}.py"
        script.write_text(block.code + "\n")
        result = run_command([sys.executable, str(script)], python_dir, timeout)
        assert result.returncode == 0, explain(block.where, result)
    else:  # console
        for command in console_commands(block):
            where = f"{page_name(block.doc)}:{command.line} ($ {command.command.splitlines()[0]})"
            result = run_command(["bash", "-e", "-o", "pipefail", "-c", command.command], repo, timeout)
            assert result.returncode == 0, explain(where, result)
            missing = missing_output(command.expected, result.stdout)
            assert not missing, (
                f"{where}: output lines shown on the page but not printed:\n"
                + "\n".join(missing)
                + f"\n--- printed\n{result.stdout[-6000:]}"
            )


def run_page(doc: Path, tiers: set[str], tmp_path: Path) -> None:
    repo = scratch_repository(tmp_path / "repo")
    python_dir = tmp_path / "python"  # outside the repository: a user's own folder
    python_dir.mkdir()
    for block in blocks_of(doc, tiers):
        run_block(block, repo, python_dir)


def test_every_block_follows_the_convention():
    problems = [problem for doc in DOCUMENTS for problem in parse(doc)[1]]
    assert problems == [], "see tests/docs/blocks.py for the convention:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", pages_with("fast"), ids=page_name)
def test_page_runs_as_written(doc: Path, tmp_path: Path):
    run_page(doc, {"fast"}, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("doc", pages_with("slow"), ids=page_name)
def test_page_runs_as_written_with_its_slow_blocks(doc: Path, tmp_path: Path):
    run_page(doc, {"fast", "slow"}, tmp_path)
