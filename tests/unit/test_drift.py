"""The template is the source of truth: code, local stack and tests must not drift from it."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from infra import template
from instantml import routes
from shared.store import STORE_URL_ENV
from shared.store import dynamodb as store

ROOT = Path(__file__).resolve().parents[2]


def resolver_routes() -> dict[tuple[str, str, str], list[str]]:
    """(function, method, contract path) -> middleware names, for every route a resolver serves."""
    served = {}
    for name in {route.function for route in template.routes()}:
        module = importlib.import_module(template.functions()[name]["Handler"].rpartition(".")[0])
        for route in module.app._static_routes + module.app._dynamic_routes:
            key = (name, route.method, re.sub(r"<(\w+)>", r"{\1}", route.path))
            served[key] = [m.__name__ for m in route.middlewares]
    return served


def test_every_template_route_is_served_by_its_function_and_vice_versa(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("METRICS_TABLE", "drift")
    wired = {(r.function, r.method, r.path) for r in template.routes()}
    assert wired == set(resolver_routes())
    contract = {v for k, v in vars(routes).items() if k.isupper()}
    assert {path for _, _, path in wired} == contract


def test_every_route_but_the_page_shell_has_the_authorizer_and_the_project_check(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("METRICS_TABLE", "drift")
    middlewares = resolver_routes()
    for route in template.routes():
        protected = route.path not in (
            routes.DISTRIBUTED_VIEW,
            routes.RUNS_VIEW,
            routes.RUN_VIEW,
            routes.COMPARE_VIEW,
        )
        assert (route.authorizer == "AuthorizerFunction") is protected, route
        assert ("require_project" in middlewares[(route.function, route.method, route.path)]) is protected, (
            route
        )


def test_the_store_keys_are_the_template_key_schema() -> None:
    definition = template.table_definition("MetricsTable")
    schema = {k["KeyType"]: k["AttributeName"] for k in definition["KeySchema"]}
    assert schema == {"HASH": store.PARTITION_KEY, "RANGE": store.SORT_KEY}
    types = {a["AttributeName"]: a["AttributeType"] for a in definition["AttributeDefinitions"]}
    assert types == {store.PARTITION_KEY: "S", store.SORT_KEY: "S"}


def test_the_runs_store_keys_are_the_template_runs_table_and_its_index() -> None:
    definition = template.table_definition("RunsTable")
    assert {k["KeyType"]: k["AttributeName"] for k in definition["KeySchema"]} == {
        "HASH": "project",
        "RANGE": "run_id",
    }
    indexes = {index["IndexName"]: index for index in definition["GlobalSecondaryIndexes"]}
    index = indexes[store.RUNS_INDEX]
    keys = {k["KeyType"]: k["AttributeName"] for k in index["KeySchema"]}
    assert keys == {"HASH": "listing_shard", "RANGE": "last_event"}
    legacy = indexes[store.LEGACY_RUNS_INDEX]  # the runs recorded before run_partition
    assert {k["KeyType"]: k["AttributeName"] for k in legacy["KeySchema"]} == {
        "HASH": "project",
        "RANGE": "last_event",
    }
    assert legacy["Projection"] == index["Projection"]
    assert "config" not in index["Projection"]["NonKeyAttributes"]  # 64 KiB rewritten on every write
    assert "headline" in index["Projection"]["NonKeyAttributes"]  # the runs page's "rank 5 stopped"
    watch = indexes[store.WATCH_INDEX]  # the watch's list of every project's recent runs
    assert {k["KeyType"]: k["AttributeName"] for k in watch["KeySchema"]} == {
        "HASH": "watch_shard",
        "RANGE": "received",
    }
    assert store.RECEIVED_SET == "#rcv = :now, #wsh = :wsh, #lsh = :lsh"
    assert (store.RUN_ATTRIBUTES["#wsh"], store.RUN_ATTRIBUTES["#rcv"]) == ("watch_shard", "received")
    assert store.RUN_ATTRIBUTES["#lsh"] == "listing_shard"
    types = {a["AttributeName"]: a["AttributeType"] for a in definition["AttributeDefinitions"]}
    assert (types["watch_shard"], types["received"], types["listing_shard"]) == ("S", "N", "S")
    assert store.watch_shard("p", "r") in store.watch_shards()
    # What ``watched_runs`` reads of a run is in the index, but for its rank groups (one query a run).
    assert "config" not in watch["Projection"]["NonKeyAttributes"]
    assert {"last_event", "finished", "watch", "headline"} <= set(watch["Projection"]["NonKeyAttributes"])
    # The rank groups change with every rank's batch: no index copies them (nor the config).
    for projected in (index, legacy, watch):
        projection = set(projected["Projection"]["NonKeyAttributes"])
        assert not {"last_step", "ranks", "world_size", "config"} & projection


def test_the_template_runtime_is_the_interpreter_running_the_server_tests() -> None:
    assert template.runtime() == f"python{sys.version_info.major}.{sys.version_info.minor}"
    layer = template.load()["Resources"]["DependenciesLayer"]
    assert layer["Properties"]["CompatibleRuntimes"] == [template.runtime()]
    assert layer["Metadata"]["BuildMethod"] == template.runtime()


def _project_modules(module: str, seen: set[str] | None = None) -> set[str]:
    """``module`` and every project module it imports, transitively."""
    seen = set() if seen is None else seen
    path = ROOT / (module.replace(".", "/") + ".py")
    if module in seen or not path.is_file():
        return seen
    seen.add(module)
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.split(".")[0] in ("functions", "shared", "instantml"):
                _project_modules(name, seen)
    return seen


def _environment_reads(module: str) -> set[str]:
    """Variables read with ``os.environ[...]``, ``os.environ.get`` or ``os.getenv``: literal names, or
    constants of the module (its own or imported)."""
    read = set()

    def name(node: ast.expr) -> str:
        if isinstance(node, ast.Name):
            value = getattr(importlib.import_module(module), node.id)
            assert isinstance(value, str), f"{module} reads the environment through {node.id}"
            return value
        return str(ast.literal_eval(node))

    for node in ast.walk(ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            read.add(name(node.slice))
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
            read.add(name(node.args[0]))
    return read


#: Read with a fallback to the deployed behaviour, set only by ``instantml local`` or its tests.
LOCAL_OVERRIDES = {STORE_URL_ENV}
#: Functions given all they need in their events (none today: the deliver function notes how each
#: POST went on the alerts table, and reads the outgoing-request policy).
READS_NOTHING: set[str] = set()


@pytest.mark.slow
def test_every_environment_variable_a_function_reads_is_set_for_it_by_the_template() -> None:
    for name, props in template.functions().items():
        modules = _project_modules(props["Handler"].rpartition(".")[0])
        read = set().union(*(_environment_reads(m) for m in modules))
        if name in READS_NOTHING:
            assert not read, f"{name} reads {read}"
            continue
        assert read, f"the scan found no environment reads for {name}"
        missing = read - set(props["Environment"]["Variables"]) - LOCAL_OVERRIDES
        assert not missing, f"{name} reads {missing} but the template does not set them"


def test_handlers_exist_where_the_template_points() -> None:
    for props in template.functions().values():
        module, _, attr = props["Handler"].rpartition(".")
        assert (ROOT / props["CodeUri"] / (module.replace(".", "/") + ".py")).is_file()
        assert callable(getattr(importlib.import_module(module), attr))


def test_the_layer_installs_the_server_extra() -> None:
    pins = (ROOT / "infra/layer/requirements.txt").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'optional-dependencies.server = { file = ["infra/layer/requirements.txt"] }' in pyproject
    assert "numpy==" in pins
    assert "aws-lambda-powertools==" in pins


def test_the_wiring_the_local_stack_runs_is_the_template_s() -> None:
    from infra import template, wiring

    assert template.render_wiring() == wiring.WIRING.read_text(), "run: python -m infra.template"
    assert wiring.routes() == template.routes()
    assert wiring.stream_sources() == template.stream_sources()
    assert sorted(wiring.tables()) == sorted(template.tables())
    assert wiring.schedule_sources() == template.schedule_sources()
    assert wiring.queues() == template.queues()
    for function, props in template.functions().items():
        assert wiring.functions()[function]["Handler"] == props["Handler"]
        refs = {name: name for name in [*template.tables(), *template.queues()]}
        assert wiring.environment(function, refs) == template.environment(function, refs)


def test_every_error_code_the_handlers_answer_is_documented_with_its_status() -> None:
    from functions.api import STATUS
    from infra.openapi import WHY

    assert set(WHY) == set(STATUS)
