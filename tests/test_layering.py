"""The direction of imports between the node's modules, read from the source with `ast`.

Every import counts, wherever it stands: at the top, inside a function (a lazy import is still
a dependency) or under `if TYPE_CHECKING`. A package's `__init__.py` hands its modules' names
on, so an import of a package counts as none (what ties modules is the module named), while
what an `__init__.py` imports counts as its package's.

The rules (see docs/architecture.md, "Packages and the direction of calls"):
- no two modules import each other, directly or around a loop;
- a package imports only packages on lower lines of `LAYERS`, never one on its own line or
  above (a top-level module, `server.py` say, is a package of its own here);
- the control plane (api, cluster, gateway) never imports runtime or storage: it reaches VMs
  and disks through the orchestrator, which alone sees the driver contract.

A new package needs a line in `LAYERS`. An import these rules refuse is a dependency to turn
around, or a package to move to another line: a decision for review, not an accident.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import aenv

SRC = Path(aenv.__file__).parent.parent

# From the top down: each line imports only the lines below it.
LAYERS = (
    ("docs",),  # the reference pages, generated from the CLI's help and the settings
    ("cli", "sdk"),  # the `aenv` command; the helpers for E2B SDK users
    ("gateway",),  # a cluster's gateway: the E2B API in front of its nodes
    # A node as a whole: cluster membership, the server's wiring, the publication of the
    # code interpreter, the host checks of `aenv doctor`.
    ("cluster", "server", "publish", "doctor"),
    ("dashboard",),  # the web dashboard, over the API app of a node or a gateway
    ("api", "claims"),  # the control plane; what a running node holds on its host
    ("orchestrator",),  # sandboxes, templates, builds, saved states, volumes
    ("runtime",),  # the VMM drivers behind `runtime/driver.py`
    ("storage", "oci", "envd_bundle", "proxy"),  # disks and images; the data plane
    ("guest", "serving"),  # what makes a guest bootable; serving HTTP
    # The ground: envd and the code interpreter (they run in the guest), slots, settings,
    # and small helpers.
    ("envd", "code_interpreter", "network", "config", "template_definition", "atomic",
     "timing", "subprocesses", "mounts"),
    ("ids",),  # the shapes of ids and the default team's, which the egress policy names too
)  # fmt: skip
# Below the control plane, yet out of its reach: the orchestrator stands between.
CONTROL_PLANE = ("api", "cluster", "gateway", "dashboard")
BEHIND_THE_ORCHESTRATOR = ("runtime", "storage")


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
    """What each of our modules imports of ours, but for `aenv/__init__.py` (the version)."""
    graph = {}
    for module in modules():
        if module == "aenv":
            continue
        named = (_named(name) for name in _imported(module))
        graph[module] = frozenset(n for n in named if n is not None and n != module)
    return graph


def _package(module: str) -> str:
    """The top-level package (or module) of ours that `module` is in: `aenv.api.app` -> `api`."""
    return module.split(".")[1]


def _crossing() -> Iterator[tuple[str, str, str, str]]:
    """(module, package, imported module, its package) for each import between packages."""
    for module, imported in sorted(imports().items()):
        for name in sorted(imported):
            if _package(name) != _package(module):
                yield module, _package(module), name, _package(name)


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
    # A package's `__init__` imports as its package, and is imported as none.
    assert "aenv.network.manager" in graph["aenv.network"]
    assert "aenv.network" not in graph["aenv.network.manager"]
    assert _loops({"a": frozenset("b"), "b": frozenset("c"), "c": frozenset("a")}) == [
        ["a", "b", "c"]
    ]


def test_no_modules_import_each_other() -> None:
    assert _loops(imports()) == []


def test_every_package_has_a_layer() -> None:
    placed = [package for layer in LAYERS for package in layer]
    assert len(placed) == len(set(placed)), "a package on two lines"
    assert sorted({_package(m) for m in imports()} - set(placed)) == []


def test_imports_only_go_down() -> None:
    line = {package: n for n, layer in enumerate(LAYERS) for package in layer}
    upward = [
        f"{module} imports {name}"
        for module, package, name, theirs in _crossing()
        if line.get(theirs, -1) <= line.get(package, -1)
    ]
    assert upward == []


def test_the_control_plane_reaches_vms_and_disks_only_through_the_orchestrator() -> None:
    past = [
        f"{module} imports {name}"
        for module, package, name, theirs in _crossing()
        if package in CONTROL_PLANE and theirs in BEHIND_THE_ORCHESTRATOR
    ]
    assert past == []
