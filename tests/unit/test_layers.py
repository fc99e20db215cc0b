"""Data flows one way, handler -> logic -> store: the logic receives a store through the port
(shared/store/port.py) and never imports an adapter, boto3 or sqlite3; the domain's packages, each the
answer to one question, import one another in one direction; no package is a corridor of doors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Every module of the domain but the store's: the logic, which gets a store through the port.
LOGIC = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for path in (ROOT / "shared").rglob("*.py")
    if (ROOT / "shared" / "store") not in path.parents
)
ADAPTERS = {"shared.store.dynamodb", "shared.store.sqlite", "boto3", "botocore", "sqlite3"}
SERVER = {"shared", "functions", "infra"}


def module_file(name: str) -> Path | None:
    """The project file of module ``name`` (a module, or a package's ``__init__``), None when not ours."""
    base = ROOT / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def resolve(name: str) -> str:
    """The module an imported name lives in: ``shared.store.port.MetricsStore`` -> ``shared.store.port``;
    names outside the project stay as they are."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if module_file(".".join(parts[:n])):
            return ".".join(parts[:n])
    return name


def imports(module: str) -> set[str]:
    """The names ``module`` imports (anywhere in it, lazily too)."""
    path = module_file(module)
    assert path is not None, module
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def reachable(module: str, seen: set[str] | None = None) -> set[str]:
    """``module`` and every module it imports, transitively: the server's modules are followed, others
    (the standard library, third parties, the client package, whose layers tests/client checks) listed."""
    seen = set() if seen is None else seen
    if module in seen:
        return seen
    seen.add(module)
    if module.split(".")[0] in SERVER and module_file(module):
        for name in imports(module):
            reachable(resolve(name), seen)
    return seen


def among(found: set[str], banned: set[str]) -> set[str]:
    """The names of ``found`` that are one of ``banned`` or inside one (``urllib.request`` is ``urllib``)."""
    return {name for name in found for b in banned if name == b or name.startswith(b + ".")}


def test_reachable_follows_packages_names_and_submodules() -> None:
    # The checks below must see through `from shared.store import open_store` (a package's name) and
    # `import urllib.request` (a submodule of a banned library).
    assert {"shared.store", "shared.store.sqlite", "sqlite3"} <= reachable("functions.api")
    assert among({"urllib.request", "osx"}, {"urllib", "os"}) == {"urllib.request"}


@pytest.mark.parametrize("module", LOGIC)
def test_the_logic_reaches_no_adapter_and_no_database_library(module: str) -> None:
    assert among(reachable(module), ADAPTERS) == set()


def test_the_port_and_the_registry_import_no_adapter_eagerly() -> None:
    for module in ("shared.store.port", "shared.store"):
        path = "shared/store/__init__" if module == "shared.store" else module.replace(".", "/")
        tree = ast.parse((ROOT / f"{path}.py").read_text())
        top_level = {
            n.module if isinstance(n, ast.ImportFrom) else a.name
            for n in tree.body
            if isinstance(n, ast.Import | ast.ImportFrom)
            for a in n.names
        }
        assert top_level & ADAPTERS == set(), module


def test_the_rollup_writer_and_the_scalars_reach_neither_the_summary_nor_the_findings() -> None:
    # The summary's read path is its own: writing rollups needs the decoding, not the document.
    for module in ("shared.summary.rolling", "shared.summary.scalars", "functions.rollup.app"):
        assert among(reachable(module), {"shared.summary.document", "shared.findings"}) == set(), module


def test_the_pure_parts_do_no_io() -> None:
    # Statistics, findings and decoding see arrays, never a store, a file or the network (the port's
    # types are no store: decoding reads StoredEvent from it).
    for module in ("shared.stats", "shared.findings", "shared.summary.decoding", "shared.summary.query"):
        found = reachable(module)
        assert among(found, ADAPTERS | {"os", "socket", "urllib"}) == set(), module
        assert "shared.store" not in found, module  # the registry, which opens stores


#: The most modules directly in one package: past that, a package wants rooms of its own.
MAX_MODULES_PER_PACKAGE = 10


def test_no_package_holds_more_than_ten_modules() -> None:
    crowded = {
        str(package.relative_to(ROOT)): n
        for top in ("shared", "functions", "infra", "instantml")
        for package in [ROOT / top, *(p.parent for p in (ROOT / top).rglob("*/__init__.py"))]
        if (n := len([p for p in package.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES_PER_PACKAGE
    }
    assert crowded == {}


def room(module: str) -> str | None:
    """The room of the domain a module is in: ``shared.summary.reads`` -> ``shared.summary``,
    ``shared.runs`` -> itself; None outside the domain."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "shared" and len(parts) > 1 else None


def test_the_domains_rooms_import_one_another_one_way() -> None:
    # Module by module there is no circle (Python would say so); room by room there is none either,
    # so a reader follows any flow down from the room it enters.
    graph: dict[str, set[str]] = {}
    for module in [*LOGIC, "shared.store.port"]:
        if (here := room(module)) is None:  # the package shared itself, which imports nothing
            continue
        graph.setdefault(here, set()).update(
            r for r in (room(resolve(name)) for name in imports(module)) if r not in (None, here)
        )
    circles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if a < b and a in graph.get(b, set()))
    assert circles == []
