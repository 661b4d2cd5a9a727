"""The direction of imports between the node's modules, read from the source with `ast`.

Every import counts, wherever it stands: at the top, inside a function (a lazy import is still
a dependency) or under `if TYPE_CHECKING`. A package's `__init__.py` only hands its modules'
names on, so an import of a package counts as none: what ties modules is the module named.

The rules (see docs/architecture.md, "Packages and the direction of calls"):
- no two modules import each other, directly or around a loop.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import aenv

SRC = Path(aenv.__file__).parent.parent


@cache
def modules() -> dict[str, Path]:
    """Every module of the `aenv` package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((SRC / "aenv").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _named(name: str) -> str | None:
    """The module of ours that `name` (a module, or a name inside one) is, or is in."""
    known = modules()
    while name and name not in known:
        name = name.rpartition(".")[0]
    if not name or known[name].name == "__init__.py":
        return None
    return name


def _imported(module: str) -> Iterator[str]:
    """The names each import of `module` reaches for, relative ones made absolute."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parents, base] if base else parents)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


@cache
def imports() -> dict[str, frozenset[str]]:
    """What each of our modules imports of ours (packages' `__init__` not counted)."""
    graph = {}
    for module, path in modules().items():
        if path.name == "__init__.py":
            continue
        named = (_named(name) for name in _imported(module))
        graph[module] = frozenset(n for n in named if n is not None and n != module)
    return graph


def _loops(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The groups of modules that import each other around a loop (Tarjan's strongly
    connected components, iterative: the graph is hundreds of modules deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            module, rest = work[-1]
            following = next(rest, None)
            if following is not None:
                if following not in index:
                    index[following] = low[following] = len(index)
                    stack.append(following)
                    work.append((following, iter(sorted(graph[following]))))
                elif following in stack:
                    low[module] = min(low[module], index[following])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                group = stack[stack.index(module) :]
                del stack[stack.index(module) :]
                if len(group) > 1:
                    loops.append(sorted(group))
    return loops


def test_the_rules_read_the_imports() -> None:
    """The reading itself: a lazy import inside a function counts, and a relative one."""
    graph = imports()
    assert "aenv.server" in graph["aenv.cli.serve"]  # imported inside `serve`
    connect = graph["aenv.envd.proto.process.process_connect"]
    assert "aenv.envd.proto.process.process_pb" in connect  # `from . import process_pb`
    assert _loops({"a": frozenset("b"), "b": frozenset("c"), "c": frozenset("a")}) == [
        ["a", "b", "c"]
    ]


def test_no_modules_import_each_other() -> None:
    assert _loops(imports()) == []
