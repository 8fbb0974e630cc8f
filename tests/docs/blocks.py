"""The fenced code blocks of README.md and docs/*.md, and how tests/docs runs them.

The convention, for everyone who writes a page:

- Every fenced block names its kind in its info string (```` ```bash ````). A block without one
  is an error.
- ``bash`` (``sh``, ``shell``): commands. They run in order, with ``bash -e -o pipefail``, in a
  scratch copy of the repository root (links to its files and folders; what the commands write at
  the top level, such as ``outputs/``, lands in the copy), with the package's environment first on
  PATH (``python``, ``lightning-zero``).
- ``console``: a transcript. A line starting with ``$ `` is a command (a trailing backslash
  continues it on the next line); the lines up to the next command are its output. Each command
  runs as a ``bash`` block does, and every output line shown must appear in the real output, in
  the same order; a line holding ``...`` stands for what the page leaves out and is not compared.
- ``python``: a program, run with the package's interpreter in an empty folder outside the
  repository, as a user who installed the package runs it (so ``examples.gpt`` is not importable).
- Any other kind (``text`` for output and trees, ``yaml``, ``ini``, ...) is not run.

A runnable block runs in the default suite (``make test``) unless an HTML comment, which the
rendered page does not show, on the line before it (blank lines between are allowed) says:

- ``<!-- docs-test: slow (REASON) -->``: runs in ``make test-slow`` only, together with all
  the page's other runnable blocks, in order; for runs of a minute and more. A block that needs
  the output of a slow one is slow too.
- ``<!-- docs-test: skip (REASON) -->``: not runnable here, and REASON says why: a GPU, a real
  SLURM cluster, several hosts, root, the test suite itself, benchmarks of many minutes.

Commands in the default suite are run exactly as written, so keep them short on the page itself
(``trainer.max_steps=20``) where a short run shows what the page is about.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

SHELL = ("bash", "sh", "shell")
RUNNABLE = (*SHELL, "console", "python")
TIERS = ("fast", "slow", "skip")

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<tier>\w+)\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")


class Block(NamedTuple):
    doc: Path  # the page
    line: int  # 1-based line of the opening fence
    kind: str  # first word of the info string: bash, console, python, text, ...
    code: str  # the block's lines, without the fence's indentation
    tier: str  # "fast" (default suite), "slow" (make test-slow) or "skip"
    reason: str  # the marker's reason ("" when there is no marker)

    @property
    def where(self) -> str:
        return f"{page_name(self.doc)}:{self.line} ({self.kind})"

    @property
    def runnable(self) -> bool:
        return self.kind in RUNNABLE


def page_name(doc: Path) -> str:
    """``doc`` relative to the repository root (as it is, for a page elsewhere)."""
    return str(doc.relative_to(REPO_ROOT)) if doc.is_relative_to(REPO_ROOT) else str(doc)


def parse(doc: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of ``doc`` and the convention's violations, each as 'page:line: what'."""
    blocks, problems = [], []
    lines = doc.read_text().splitlines()
    name = page_name(doc)
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            if (
                lines[i].lstrip().startswith("<!--")
                and "docs-test" in lines[i]
                and not _is_marker_before_fence(lines, i)
            ):
                problems.append(f"{name}:{i + 1}: a docs-test marker must be followed by a fenced block")
            i += 1
            continue
        end = _closing_line(lines, i, opening["fence"])
        indent = len(opening["indent"])
        code = "\n".join(line[indent:] if line[:indent].isspace() else line for line in lines[i + 1 : end])
        kind = opening["info"].split()[0].lower() if opening["info"].strip() else ""
        tier, reason, problem = _marker(lines, i)
        if not kind:
            problem = (
                problem or "a fenced block must name its kind: bash, console, python, or text, yaml, ..."
            )
        if tier != "fast" and kind not in RUNNABLE:
            problem = problem or f"a docs-test marker on a '{kind}' block, which never runs"
        if problem:
            problems.append(f"{name}:{i + 1}: {problem}")
        blocks.append(Block(doc, i + 1, kind, code, tier, reason))
        i = end + 1
    return blocks, problems


def _closing_line(lines: list[str], start: int, fence: str) -> int:
    """Index of the line that closes the block opened at ``start`` (the end of the page if none)."""
    for j in range(start + 1, len(lines)):
        stripped = lines[j].strip()
        if stripped.startswith(fence) and set(stripped) == {fence[0]}:
            return j
    return len(lines)


def _previous_text(lines: list[str], index: int) -> str:
    """The nearest non-blank line before ``index``, or ""."""
    for j in range(index - 1, -1, -1):
        if lines[j].strip():
            return lines[j]
    return ""


def _is_marker_before_fence(lines: list[str], index: int) -> bool:
    for j in range(index + 1, len(lines)):
        if lines[j].strip():
            return bool(_FENCE.match(lines[j]))
    return False


def _marker(lines: list[str], fence_index: int) -> tuple[str, str, str]:
    """(tier, reason, problem) from the marker before the fence at ``fence_index``."""
    text = _previous_text(lines, fence_index)
    if not (text.lstrip().startswith("<!--") and "docs-test" in text):
        return "fast", "", ""
    marker = _MARKER.match(text)
    if not marker or marker["tier"] not in ("slow", "skip"):
        return "fast", "", f"cannot read the marker {text.strip()!r}; expected <!-- docs-test: skip (why) -->"
    reason = (marker["reason"] or "").strip()
    if marker["tier"] == "skip" and not reason:
        return "skip", "", "a skipped block needs its reason: <!-- docs-test: skip (needs a GPU) -->"
    return marker["tier"], reason, ""


class Command(NamedTuple):
    line: int  # 1-based line of the command in the page
    command: str  # the command, continuation lines included
    expected: list[str]  # the output lines shown after it


def console_commands(block: Block) -> list[Command]:
    """The ``$ `` commands of a console block, each with the output the page shows for it."""
    commands: list[Command] = []
    continued = False
    for offset, line in enumerate(block.code.splitlines(), start=block.line + 1):
        if continued:
            commands[-1] = commands[-1]._replace(command=f"{commands[-1].command}\n{line}")
        elif line.startswith("$ "):
            commands.append(Command(offset, line[2:], []))
        elif commands:
            commands[-1].expected.append(line)
        continued = line.endswith("\\") and (continued or line.startswith("$ "))
    return commands


def missing_output(expected: list[str], actual: str) -> list[str]:
    """The lines of ``expected`` that ``actual`` lacks, taken in order; lines with '...' are skipped."""
    real = [line.rstrip() for line in actual.splitlines()]
    missing, position = [], 0
    for want in (line.rstrip() for line in expected):
        if not want.strip() or "..." in want:
            continue
        try:
            position = real.index(want, position) + 1
        except ValueError:
            missing.append(want)
    return missing
