"""No import circles anywhere in duplexserve.

Every import counts: at module level, inside functions (the lazy ones), and under
``TYPE_CHECKING``. A lazy or type-only import dodges the error at run time but not the
design problem: two modules that need each other are one idea split in two, or a third
idea both should import. ``from a import b`` counts as importing the module ``a.b`` where
that is a module, else ``a``. A package's ``__init__`` is not counted as imported by its
submodules' imports (those of duplexserve are empty or a version).
"""

from __future__ import annotations

import ast
from pathlib import Path

import duplexserve

PACKAGE = Path(duplexserve.__file__).resolve().parent


def module_name(path: Path, root: Path) -> str:
    names = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def import_graph(sources: dict[str, tuple[bool, str]]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports. ``sources``: module -> (is a
    package, its source)."""
    known = set(sources)
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for module, (is_package, source) in sources.items():
        for node in ast.walk(ast.parse(source)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = module.split(".")
                    anchor = parts[: len(parts) - node.level + is_package]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                           for alias in node.names]
            for target in targets:
                while target and target not in known:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def package_sources(root: Path) -> dict[str, tuple[bool, str]]:
    paths = sorted(root.rglob("*.py"))
    return {module_name(p, root): (p.name == "__init__.py", p.read_text()) for p in paths}


def test_no_import_cycles_in_duplexserve():
    cycle = find_cycle(import_graph(package_sources(PACKAGE)))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_a_cycle_is_found_and_named():
    sources = {
        "pkg": (True, ""),
        "pkg.a": (False, "from pkg.b import thing\n"),
        "pkg.b": (False, "def f():\n    from . import c\n"),  # lazy and relative
        "pkg.c": (False, "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"),
        "pkg.d": (False, "import pkg.a\n"),
    }
    assert find_cycle(import_graph(sources)) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    del sources["pkg.c"]
    assert find_cycle(import_graph(sources)) is None
