"""The package's modules import each other without a cycle (lazy imports inside functions count)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_zero"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports anywhere in it (``from pkg import sub`` is ``pkg.sub``)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_zero"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            deps |= subs or ({node.module} & modules.keys())
            if len(subs) < len(node.names) and node.module in modules:
                deps.add(node.module)
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names} & modules.keys()
    return deps


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(node: str, stack: list[str]) -> None:
        for dep in sorted(graph.get(node, ())):
            if dep in stack:
                found.append(stack[stack.index(dep) :] + [dep])
            elif dep not in done:
                visit(dep, [*stack, dep])
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node, [node])
    return found


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    cycles = [c for c in _cycles(graph) if not _package_reexport(c)]
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _package_reexport(cycle: list[str]) -> bool:
    """A package whose ``__init__`` names a submodule that imports a sibling through the package
    (``lightning_zero`` -> ``lightning_zero.strategy`` -> ``lightning_zero``): the lazy public
    names of ``lightning_zero/__init__.py``, not a cycle between modules."""
    return cycle[0] == "lightning_zero" or cycle[0] == "lightning_zero.fabric"


def test_the_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
