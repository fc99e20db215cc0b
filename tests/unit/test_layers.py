"""Data flows one way, handler -> logic -> store: the logic receives a store through the port
(shared/store/port.py) and never imports an adapter, boto3 or sqlite3."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOGIC = [
    "shared.ingest",
    "shared.summary",
    "shared.query",
    "shared.decoding",
    "shared.runs",
    "shared.scalars",
    "shared.rolling",
    "shared.rollups",
    "shared.stats",
    "shared.findings",
]
ADAPTERS = {"shared.store.dynamodb", "shared.store.sqlite", "boto3", "botocore", "sqlite3"}


def imports(module: str) -> set[str]:
    """The modules ``module`` imports (anywhere in it, lazily too)."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def reachable(module: str, seen: set[str] | None = None) -> set[str]:
    """``module`` and everything it imports, transitively (project modules followed, others listed)."""
    seen = set() if seen is None else seen
    if module in seen:
        return seen
    seen.add(module)
    path = ROOT / (module.replace(".", "/") + ".py")
    if path.is_file():
        for name in imports(module):
            if (ROOT / (name.replace(".", "/") + ".py")).is_file() or not name.startswith(
                ("shared", "instantml")
            ):
                reachable(name, seen)
    return seen


@pytest.mark.parametrize("module", LOGIC)
def test_the_logic_reaches_no_adapter_and_no_database_library(module: str) -> None:
    assert reachable(module) & ADAPTERS == set()


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
    for module in ("shared.rolling", "shared.scalars", "functions.rollup.app"):
        assert reachable(module) & {"shared.summary", "shared.findings"} == set(), module


def test_the_pure_parts_do_no_io() -> None:
    # Statistics, findings and decoding see arrays, never a store, a file or the network.
    for module in ("shared.stats", "shared.findings", "shared.decoding", "shared.query"):
        assert (
            reachable(module) & {"shared.store", "shared.store.port.MetricsStore", "os", "socket", "urllib"}
            == set()
        )
