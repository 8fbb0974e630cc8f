"""The convention of tests/docs/blocks.py on small made-up pages, and that a wrong page fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import console_commands, missing_output, parse
from tests.docs.test_docs import run_page

PAGE = """# A page

<!-- docs-test: skip (needs a GPU) -->
```bash
python train.py trainer=gpu
```

```console
$ echo one \\
    two
one two
...
$ printf 'a\\nb\\nc\\n'
a
c
```

<!-- docs-test: slow (a long run) -->
```python
print("slow")
```

  ```text
  $ not run
  ```
"""


def write(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_blocks_kinds_tiers_and_lines(tmp_path: Path):
    blocks, problems = parse(write(tmp_path, PAGE))
    assert problems == []
    assert [(b.line, b.kind, b.tier, b.reason) for b in blocks] == [
        (4, "bash", "skip", "needs a GPU"),
        (8, "console", "fast", ""),
        (19, "python", "slow", "a long run"),
        (23, "text", "fast", ""),
    ]
    assert blocks[3].code == "$ not run"  # the fence's indentation removed


def test_console_commands_with_continuations_and_their_output(tmp_path: Path):
    console = parse(write(tmp_path, PAGE))[0][1]
    commands = console_commands(console)
    assert [(c.line, c.command, c.expected) for c in commands] == [
        (9, "echo one \\\n    two", ["one two", "..."]),
        (13, "printf 'a\\nb\\nc\\n'", ["a", "c"]),
    ]


def test_shown_output_must_appear_in_order():
    assert missing_output(["a", "...", "c"], "a\nb\nc\n") == []
    assert missing_output(["c", "a"], "a\nb\nc\n") == ["a"]  # out of order
    assert missing_output(["a  "], "a\n") == []  # trailing blanks do not count
    assert missing_output(["{...}", "x"], "y\n") == ["x"]


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        ("```\nls\n```\n", 1, "must name its kind"),
        ("<!-- docs-test: skip -->\n```bash\nls\n```\n", 2, "needs its reason"),
        ("<!-- docs-test: later (why) -->\n```bash\nls\n```\n", 2, "cannot read the marker"),
        ("<!-- docs-test: slow (why) -->\n```text\nls\n```\n", 2, "on a 'text' block, which never runs"),
        ("<!-- docs-test: slow (why) -->\n\nsome prose\n", 1, "must be followed by a fenced block"),
    ],
)
def test_convention_violations_are_named(tmp_path: Path, text: str, line: int, problem: str):
    (found,) = parse(write(tmp_path, text))[1]
    assert found.startswith(f"{tmp_path / 'page.md'}:{line}: ") and problem in found


def test_a_page_whose_command_fails_fails(tmp_path: Path):
    page = write(tmp_path, "```bash\ntrue\nfalse\necho never\n```\n")
    with pytest.raises(AssertionError, match=r"page.md:1 \(bash\) exited with 1"):
        run_page(page, {"fast"}, tmp_path / "run")


def test_a_page_whose_output_differs_fails(tmp_path: Path):
    page = write(tmp_path, "```console\n$ echo 41\n42\n```\n")
    with pytest.raises(AssertionError, match=r"shown on the page but not printed:\n\s*42"):
        run_page(page, {"fast"}, tmp_path / "run")


def test_python_blocks_run_outside_the_repository(tmp_path: Path):
    page = write(tmp_path, "```python\nimport lightning_zero_cli\nimport examples.gpt\n```\n")
    with pytest.raises(AssertionError, match="No module named 'examples'"):
        run_page(page, {"fast"}, tmp_path / "run")
