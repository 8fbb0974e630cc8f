"""The rooms of ``lightning_zero/checkpoint/`` import one way ([Note: one-way read] in
``checkpoint/reader.py``, [Note: one-way write] in ``checkpoint/writer.py``): each imports only rooms
below it, never the package itself or a glue, and the read's four steps none of each other."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_zero" / "checkpoint"

# bottom to top: a room may import the rooms before it in this list, and no other
ORDER = [
    "format",
    "agree",
    "locate",
    "checksum",
    "disk",
    "verify",
    "unpickle",
    "layout",
    "publish",
    "states",
    "writer",
    "load",
    "reader",
    "hooks",
    "consolidate",
]
READ_STEPS = {"locate", "verify", "unpickle", "layout"}  # of these, none imports another
OUTSIDE = ("lightning_zero.strategy", "lightning_zero.runtime", "lightning_zero.fabric")  # the glues


def _imports(room: str) -> set[str]:
    """The modules of the package that ``room`` imports (``from pkg import sub`` is ``pkg.sub``)."""
    found = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{room}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_zero"):
            found.add(node.module)
            found |= {
                f"{node.module}.{a.name}" for a in node.names if node.module == "lightning_zero.checkpoint"
            }
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lightning_zero")}
    return found


def _rooms_of(modules: set[str]) -> set[str]:
    prefix = "lightning_zero.checkpoint."
    return {m[len(prefix) :] for m in modules if m.startswith(prefix)}


def test_every_room_is_in_the_order():
    assert sorted(ORDER) == sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _climbs(order: list[str]) -> list[str]:
    """Each import of a room that is not below the importing one in ``order``, of the package itself
    or of a glue."""
    climbs = []
    for i, room in enumerate(order):
        imported = _imports(room)
        above = _rooms_of(imported) - set(order[:i])
        package = {m for m in imported if m in ("lightning_zero", "lightning_zero.checkpoint")}
        glue = {m for m in imported if m.startswith(OUTSIDE)}
        climbs += [f"{room} imports {m}" for m in sorted(above | package | glue)]
    return climbs


def test_each_room_imports_only_rooms_below_it():
    assert _climbs(ORDER) == []


def test_the_read_steps_do_not_import_each_other():
    sideways = [
        f"{room} imports {other}" for room in READ_STEPS for other in _rooms_of(_imports(room)) & READ_STEPS
    ]
    assert sideways == []


def test_the_check_sees_a_climb():
    swapped = [r for r in ORDER if r != "reader"]
    swapped.insert(swapped.index("verify"), "reader")  # the reader below the room it calls
    assert "reader imports verify" in _climbs(swapped)
