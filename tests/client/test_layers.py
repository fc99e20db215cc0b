"""The client's modules import one another in one direction only, along the layers below.

Every ``import`` in ``instantml/`` counts, at module level or inside a function (lazy imports keep
``import instantml`` light, but they are edges all the same), under ``TYPE_CHECKING`` too. A module
imports only modules of lower layers, never one of its own layer or above, so there is no circle and a
reader can follow any flow downwards. A new module must be given a layer here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.client

PACKAGE = Path(__file__).resolve().parent.parent.parent / "instantml"

#: Lowest first. Each module's one job:
LAYERS: list[tuple[str, ...]] = [
    # facts: the contract's limits and checks; the API's paths; the environment variables and defaults;
    # the two packages of machinery, which say what they hold and import nothing
    (
        "instantml.limits",
        "instantml.routes",
        "instantml.settings",
        "instantml.upload",
        "instantml.commands",
        "instantml.monitor",
    ),
    # HTTP: one request to the batch or run route, and the retry rules (transient / refused)
    ("instantml.upload.transport",),
    # the spool's file format, and reading a spool back
    ("instantml.upload.spool",),
    # the spool's writer in the training process; a spool's lines parsed into the requests they carry
    ("instantml.upload.spool_writer", "instantml.upload.replay_requests"),
    # the Replayer: a spool's lines sent through transport, progress recorded in the spool
    ("instantml.upload.replay",),
    # the two ways a spool gets replayed: the background uploader process, the `instantml sync` command
    ("instantml.upload.background", "instantml.commands.sync"),
    # the watch's answers from the shell: `instantml check` and `instantml alerts`, through transport
    ("instantml.commands.watching",),
    # reading back (contract 9): im.Api, through transport; then export and runs, through im.Api
    ("instantml.api",),
    ("instantml.commands.export",),
    # where a Run's events go: the in-process thread uploader; the Sink protocol and the spool sink
    # (which starts the background uploader)
    ("instantml.upload.uploader", "instantml.upload.sinks"),
    # what a process says of itself (contract 8): its records and its system metrics (contract 2); the
    # monitor thread that samples them and beats while the main thread is silent; the hooks that record
    # its end and hand on to what was there before
    ("instantml.monitor.records", "instantml.monitor.system"),
    ("instantml.monitor.thread",),
    ("instantml.monitor.hooks",),
    # im.init and Run
    ("instantml.run",),
    # the package: instantml.init, Run, LimitError
    ("instantml",),
    # the trainer integrations' shared names
    ("instantml.integrations",),
    # entry points: the `instantml` command (argument parsing), the trainer integrations
    ("instantml.cli", "instantml.integrations.lightning", "instantml.integrations.transformers"),
]
LAYER = {module: n for n, layer in enumerate(LAYERS) for module in layer}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def internal(name: str) -> str:
    """The module of ``instantml`` that importing ``name`` runs: ``name`` itself, else its package."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def edges(module: str, eager_only: bool = False) -> list[tuple[str, int]]:
    """The ``instantml`` modules ``module`` imports, each with the line of its import statement:
    everywhere in the file, or with ``eager_only`` only what runs at import time (module level, not
    under ``if TYPE_CHECKING``). The package ``__init__`` that Python runs before any of its modules is
    not counted: only the module named."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    found_in = list(_eager(tree.body)) if eager_only else list(ast.walk(tree))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in found_in:
        if isinstance(node, ast.Import):
            out += [
                (internal(a.name), node.lineno) for a in node.names if a.name.split(".")[0] == "instantml"
            ]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from .y import z
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "instantml":
                continue
            for alias in node.names:
                # `from instantml.upload import spool` imports the module instantml.upload.spool
                target = f"{base}.{alias.name}"
                out.append((target if target in MODULES else internal(base), node.lineno))
    return [(target, line) for target, line in out if target != module]


def _eager(nodes: list[ast.stmt] | Iterator[ast.AST]) -> Iterator[ast.AST]:
    """The nodes that run when the module is imported: not inside a function, not under
    ``if TYPE_CHECKING``."""
    for node in nodes:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _eager(node.orelse)
            continue
        yield node
        yield from _eager(ast.iter_child_nodes(node))


def test_every_module_has_a_layer() -> None:
    assert set(MODULES) - set(LAYER) == set(), "give the new module a layer in LAYERS"
    assert set(LAYER) - set(MODULES) == set(), "a module in LAYERS is gone"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers_only(module: str) -> None:
    wrong = [
        f"{MODULES[module].name}:{line} imports {target} (layer {LAYER[target]}, not below {LAYER[module]})"
        for target, line in edges(module)
        if LAYER[target] >= LAYER[module]
    ]
    assert wrong == []


#: The server's packages (the Lambda code root's, inside ``instantml/_server`` in a wheel).
SERVER_PACKAGES = {"shared", "functions", "infra"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_client_imports_nothing_of_the_server(module: str) -> None:
    """The server imports the client's facts (limits, routes), never the other way: ``instantml local``
    and ``tokens`` run the server in a process of its own (instantml/cli.py)."""
    tree = ast.parse(MODULES[module].read_text())
    imported = [
        (name, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
    ]
    assert [f"line {line}: {name}" for name, line in imported if name.split(".")[0] in SERVER_PACKAGES] == []


def test_the_import_graph_has_no_cycle() -> None:
    graph = {module: {target for target, _ in edges(module)} for module in MODULES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_import_instantml_loads_only_what_init_and_run_need() -> None:
    """The training process's ``import instantml`` runs no spool, HTTP or uploader module: the sinks are
    imported when ``init`` picks one."""
    loaded, todo = set(), ["instantml"]
    while todo:
        module = todo.pop()
        if module not in loaded:
            loaded.add(module)
            todo += [target for target, _ in edges(module, eager_only=True)]
    assert loaded == {"instantml", "instantml.run", "instantml.limits", "instantml.settings"}
