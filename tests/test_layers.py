"""The layer rules of docs/architecture.md, checked on every import in the tree.

Each module belongs to one box (:func:`box_of`). A box may import only the boxes below it in
:data:`ALLOWED`; boxes on one level do not import each other. Lazy imports inside functions count
(they run); imports under ``if TYPE_CHECKING:`` count too (a type-only import of the conductor from
the node is still the node knowing the conductor), except for the runtime-cycle check, where they
never execute. Third-party packages that only some boxes may use are in :data:`RESTRICTED`.

In the spirit of vLLM's forbidden-imports check: a new arrow that runs back up fails here with the
file, the line and the rule it breaks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvstore", "conductor", "planner", "bench")

ALLOWED: dict[str, set[str]] = {
    "foundation": set(),
    "dataplane": {"foundation"},
    "shared": {"foundation", "dataplane"},
    "node": {"foundation", "dataplane", "shared"},
    "client": {"foundation", "dataplane", "shared"},
    "conductor": {"foundation", "dataplane", "shared"},
    "engine": {"foundation", "dataplane", "shared", "client", "node"},
    "integrations": {"foundation", "dataplane", "shared", "client"},
    "frontdoor": {"foundation", "dataplane", "shared", "client", "conductor"},
    "planner": {"foundation", "dataplane", "shared", "node", "client", "conductor"},
    "cluster": {"foundation", "dataplane", "shared", "node", "client", "conductor", "engine",
                "integrations", "frontdoor", "planner"},
    "bench": {"foundation", "dataplane", "shared", "node", "client", "conductor", "engine",
              "integrations", "frontdoor", "planner", "cluster"},
    "cli": {"foundation", "dataplane", "shared", "node", "client", "conductor", "engine",
            "integrations", "frontdoor", "planner", "cluster", "bench"},
}
"""Which boxes each box may import (itself always). Data plane at the bottom, then what several
boxes share (wire codes, etcd membership), then node, client and conductor side by side, the
engines, the integrations into other engines (vLLM's KV connector) and the front door (the HTTP
endpoint in front of vLLM servers), the offline tools, the local cluster, the benchmarks and the command line on top."""

PROCESS_MODULES: dict[str, tuple[str, ...]] = {
    "frontdoor": ("conductor.server", "conductor.service"),
}
"""Modules of an allowed box that a box still may not import: the front door embeds the
conductor's scheduling library (scheduler, indexes, event followers, instance planning: pure
code over the same inputs, for routing in process, docs/routing.md) but never the conductor's
process (its gRPC service, its server with election and daemon subscriptions)."""

RESTRICTED: dict[str, set[str]] = {
    "grpc": {"shared", "node", "client", "conductor", "engine", "planner", "cluster", "bench",
             "cli", "foundation"},
    "aetcd": {"shared", "conductor", "planner", "bench", "cli", "cluster"},
    "matplotlib": {"planner"},
    "torch": {"dataplane", "client", "engine", "integrations", "cluster", "bench", "cli"},
    "vllm": {"integrations", "cluster", "bench"},
}
"""Third-party packages and the boxes that may import them: the data plane speaks neither gRPC nor
etcd; only membership (in the shared box) talks to etcd for the node, the client and the engines;
plotting stays in the offline planner; the daemon and the conductor never need torch (the
torch-free image); only the vLLM integration (and the jobs that run vLLM) imports vllm."""


def box_of(module: str) -> str:
    parts = module.split(".")
    top = parts[0]
    if top in ("conductor", "planner", "bench"):
        return top
    assert top == "kvstore", module
    second = parts[1] if len(parts) > 1 else ""
    if second in ("", "errors", "keys", "_proto"):
        return "foundation"
    if second in ("wire", "membership", "security"):
        return "shared"
    if second in ("dataplane", "node", "client", "engine", "integrations", "frontdoor",
                  "cluster", "cli"):
        return second
    raise AssertionError(f"module {module} belongs to no box: add it to box_of and the docs")


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    lazy: bool
    type_only: bool


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_of(path: Path, root: Path = ROOT) -> list[Import]:
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, lazy, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, lazy, type_only)
                continue
            visit_stmt(child, lazy, type_only)

    def visit_stmt(stmt: ast.AST, lazy: bool, type_only: bool) -> None:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                found.append(Import(module, alias.name, stmt.lineno, lazy, type_only))
        elif isinstance(stmt, ast.ImportFrom):
            if stmt.level:
                base = package.split(".")[: len(package.split(".")) - (stmt.level - 1)]
                target = ".".join(base + ([stmt.module] if stmt.module else []))
            else:
                target = stmt.module or ""
            found.append(Import(module, target, stmt.lineno, lazy, type_only))
            # ``from kvstore.client import kv_client`` imports a submodule too
            for alias in stmt.names:
                sub = f"{target}.{alias.name}"
                if _module_path(sub, root) is not None:
                    found.append(Import(module, sub, stmt.lineno, lazy, type_only))
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            visit(stmt, True, type_only)
        else:
            visit(stmt, lazy, type_only)

    visit(ast.parse(path.read_text(), str(path)), False, False)
    return found


def _module_path(module: str, root: Path = ROOT) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "_proto" not in p.parts)


ALL_IMPORTS = [imp for path in _sources() for imp in _imports_of(path)]


def _ours(target: str) -> bool:
    return target.split(".")[0] in PACKAGES


def test_every_module_has_a_box() -> None:
    for path in _sources():
        box_of(_module_name(path))


def _upward(imports: list[Import]) -> list[str]:
    broken = []
    for imp in imports:
        if not _ours(imp.target):
            continue
        src, dst = box_of(imp.source), box_of(imp.target)
        if src != dst and dst not in ALLOWED[src]:
            broken.append(f"{imp.source}:{imp.line} imports {imp.target}: {src} may not import {dst}")
        elif any(imp.target == m or imp.target.startswith(m + ".")
                 for m in PROCESS_MODULES.get(src, ())):
            broken.append(f"{imp.source}:{imp.line} imports {imp.target}: {src} may use the "
                          f"{dst}'s library, not its process")
    return broken


def _restricted(imports: list[Import]) -> list[str]:
    broken = []
    for imp in imports:
        top = imp.target.split(".")[0]
        if top in RESTRICTED and box_of(imp.source) not in RESTRICTED[top]:
            broken.append(f"{imp.source}:{imp.line} imports {imp.target}")
    return broken


def test_no_import_runs_back_up() -> None:
    broken = _upward(ALL_IMPORTS)
    assert not broken, "\n".join(broken)


def test_third_party_packages_stay_in_their_boxes() -> None:
    broken = _restricted(ALL_IMPORTS)
    assert not broken, "\n".join(broken)


def test_the_scanner_sees_lazy_relative_and_type_only_imports(tmp_path: Path) -> None:
    """A positive control on files written here: every kind of import the rules must see."""
    bad = tmp_path / "kvstore" / "dataplane" / "bad.py"
    bad.parent.mkdir(parents=True)
    for init in (tmp_path / "kvstore" / "__init__.py", bad.parent / "__init__.py"):
        init.write_text("")
    bad.write_text(
        "from typing import TYPE_CHECKING\n"
        "import grpc\n"
        "from . import tier\n"
        "if TYPE_CHECKING:\n"
        "    from kvstore.client.store_client import StoreClient\n"
        "def f():\n"
        "    from ..node import cache\n"
        "    import aetcd\n"
    )
    found = {(i.target, i.lazy, i.type_only) for i in _imports_of(bad, tmp_path)}
    assert ("grpc", False, False) in found
    assert ("kvstore.dataplane", False, False) in found
    assert ("kvstore.client.store_client", False, True) in found
    assert ("kvstore.node", True, False) in found
    assert ("aetcd", True, False) in found
    imports = _imports_of(bad, tmp_path)
    assert len(_upward(imports)) == 2  # the client (type-only) and the node (lazy)
    assert {b.split()[-1] for b in _restricted(imports)} == {"grpc", "aetcd"}


def test_no_runtime_import_cycle() -> None:
    """Tarjan's strongly connected components over the imports that execute."""
    graph: dict[str, set[str]] = {}
    for imp in ALL_IMPORTS:
        if imp.type_only or not _ours(imp.target) or _module_path(imp.target) is None:
            continue
        if imp.target != imp.source and not imp.source.startswith(imp.target + "."):
            graph.setdefault(imp.source, set()).add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    assert not cycles, f"runtime import cycles: {cycles}"


@pytest.mark.parametrize(("source", "target"), [
    ("kvstore.dataplane.arena", "kvstore.node.cache"),
    ("kvstore.dataplane.tier", "grpc"),
    ("kvstore.node.daemon", "conductor.server"),
    ("kvstore.client.kv_client", "kvstore.node.cache"),
    ("kvstore.client.kv_client", "kvstore.engine.model"),
    ("conductor.scheduler", "planner.sim"),
    ("conductor.server", "kvstore.client.store_client"),
    ("kvstore.node.service", "matplotlib.pyplot"),
    ("kvstore.frontdoor.server", "vllm.entrypoints.openai.api_server"),
    ("kvstore.frontdoor.local", "conductor.server"),
    ("kvstore.frontdoor.local", "conductor.service"),
    ("kvstore.frontdoor.router", "kvstore.node.cache"),
    ("kvstore.frontdoor.server", "kvstore.engine.gateway"),
    ("kvstore.integrations.vllm.connector", "kvstore.frontdoor.router"),
])
def test_the_rules_catch_a_forbidden_arrow(source: str, target: str) -> None:
    """A positive control: each of these would break a rule, so the checks are not vacuous."""
    src = box_of(source)
    top = target.split(".")[0]
    if _upward([Import(source, target, 1, False, False)]):
        return
    if _ours(target):
        dst = box_of(target)
        assert src != dst and dst not in ALLOWED[src]
    else:
        assert src not in RESTRICTED[top]


def test_every_folder_is_a_package() -> None:
    """setuptools' package finder skips a folder without ``__init__.py``: an installed kvtier
    (the image, a wheel) would lack it although an editable checkout imports it."""
    missing = sorted(str(d.relative_to(ROOT)) for pkg in PACKAGES for d in (ROOT / pkg).rglob("*")
                     if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
                     and not (d / "__init__.py").is_file())
    assert not missing, f"folders of modules without __init__.py: {missing}"
