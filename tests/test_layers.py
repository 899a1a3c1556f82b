"""Layers without loops: imports flow analysis -> ledgers <- experiments -> serving_core.

Every module's imports are read from its source (module- and function-level, relative
ones resolved), so a deferred import inside a function counts like any other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("analysis", "experiments", "ledgers", "serving_core")
# Imports a layer must not make (by top-level package, or by exact module prefix).
FORBIDDEN = {
    "serving_core": ("ledgers", "experiments", "analysis"),
    "ledgers": ("experiments", "analysis", "serving_core"),
    "analysis": ("experiments",),
}
# Known exceptions, each to be removed by the change that ends it.
PENDING: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in the file, relative ones made absolute."""
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = package[:len(package) - (node.level - 1)]
                base = ".".join([*prefix, *([node.module] if node.module else [])])
            yield base, node.lineno
            # `from pkg import sub` may name a submodule
            yield from ((f"{base}.{a.name}", node.lineno) for a in node.names)


def _edges(top: str) -> list[tuple[str, str, int]]:
    """(file relative to the repo, imported module, line) for every .py file under `top`."""
    return [(str(p.relative_to(REPO)), name, line)
            for p in sorted((REPO / top).rglob("*.py")) for name, line in _imports(p)]


def _subfolder(module: str, top: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != top or not (REPO / top / parts[1]).is_dir():
        return None
    return parts[1]


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as a path (first node repeated at the end), [] if none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_cycle_finder_finds_a_cycle_and_passes_a_chain():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("top", ["analysis", "experiments"])
def test_no_import_cycle_among_subfolders(top):
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for file, name, line in _edges(top):
        a, b = _subfolder(_module_name(REPO / file), top), _subfolder(name, top)
        if a and b and a != b:
            graph.setdefault(a, set()).add(b)
            where.setdefault((a, b), f"{file}:{line} imports {name}")
    cycle = _cycle(graph)
    assert cycle == [], " ; ".join(where[(x, y)] for x, y in zip(cycle, cycle[1:], strict=False))


def test_layers_import_only_downward():
    found = []
    for top, banned in FORBIDDEN.items():
        for file, name, line in _edges(top):
            if name.split(".")[0] in banned \
                    and not any(file == f and name.startswith(m) for f, m in PENDING):
                found.append(f"{file}:{line} imports {name}")
    assert found == []


def test_pending_exceptions_are_still_needed():
    """An exception whose import has gone must be removed from PENDING."""
    for file, module in PENDING:
        assert any(name.startswith(module) for name, _ in _imports(REPO / file)), (file, module)


def test_the_executor_does_not_import_the_engine():
    found = [f"{file}:{line} imports {name}" for file, name, line in _edges("serving_core")
             if file.startswith("serving_core/executor/")
             and (name == "serving_core.engine" or name.startswith("serving_core.engine."))]
    assert found == []


def test_engine_columns_are_the_ledger_columns():
    """serving_core names its record columns itself; they are exactly the ledger's."""
    from ledgers.schemas import ENGINE_SCHEMAS
    from serving_core import records

    assert records.TRACE_COLUMNS == tuple(ENGINE_SCHEMAS["trace"].names)
    assert records.SLAB_COLUMNS == tuple(ENGINE_SCHEMAS["slab"].names)
    assert records.STEP_COLUMNS == tuple(ENGINE_SCHEMAS["steps"].names)
    assert records.POLLER_COLUMNS == tuple(ENGINE_SCHEMAS["poller"].names)
    assert records.REQUEST_COLUMNS == tuple(ENGINE_SCHEMAS["requests"].names)
