"""The API's OpenAPI document, ``openapi.json``, generated from the code that serves the API.

    python -m infra.openapi            # writes openapi.json
    python -m infra.openapi --check    # exits 1 if openapi.json is not what the code generates

Powertools generates the operations and path parameters from each template function's resolver (the
routes the template wires, so the document cannot list a route that is not deployed). The handlers read
their bodies and headers by hand, so this adds what the resolvers cannot see: the request bodies (the
pydantic model that validates them, with the limits of ``instantml.limits``), the ``Idempotency-Key``
header, the contract's responses and error shape (3.2), and bearer authentication.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Literal

from pydantic import BaseModel, Field

from functions.api import STATUS
from infra import template
from instantml import limits, routes
from shared import runs
from shared.ingest.bodies import RankEventBody, RunUpdateBody, ScalarEventBody
from shared.reading.raw import MAX_LIMIT as MAX_RAW_LIMIT
from shared.summary.query import HEATMAP_ENCODINGS
from shared.watch.alerts import AlertsAnswer, AlertsBody, LastDeliveryBody, WebhookAnswer, WebhookBody

OPENAPI_JSON = template.ROOT / "openapi.json"


class ErrorDetail(BaseModel):
    field: str
    message: str


class ErrorObject(BaseModel):
    code: str = Field(description="The contract's machine code, such as invalid_request.")
    message: str
    details: list[ErrorDetail] | None = None


class Error(BaseModel):
    """Every error response (contract 3.2)."""

    error: ErrorObject


class EventResult(BaseModel):
    event_id: str
    status: Literal["stored", "duplicate"]


class BatchEventResult(BaseModel):
    event_id: str
    status: Literal["stored", "duplicate", "rejected"]
    error: ErrorObject | None = None


class BatchResult(BaseModel):
    results: list[BatchEventResult] = Field(description="One result per event, in request order.")
    stored: int
    duplicate: int
    rejected: int


class Run(BaseModel):
    """A run's record (contract 3.3), kept as its events arrive."""

    run_id: str
    created: float
    last_event: float = Field(description="The latest event time (seconds since the epoch).")
    last_step: int | None
    world_size: int | None
    ranks_reporting: int | None = Field(description="Ranks with an event at last_step.")
    status: Literal["live", "idle", "finished"]
    finished: float | None
    findings: dict[str, int] | None = Field(
        description="Counts by severity of the watch's latest look (or of a full summary opened since)."
    )
    findings_at: float | None
    config: dict[str, Any] | None
    headline: str | None = Field(
        default=None, description="The worst finding in a few words ('rank 5 stopped'); null below warning."
    )
    process_states: dict[str, int] | None = Field(
        default=None,
        description="The run's processes (contract 8) by state at the watch's latest look: running, silent, "
        "stuck, finished, failed, signal, vanished (the absent ones left out); null before its first look.",
    )
    watch: dict[str, Any] | None = Field(
        default=None,
        description="GET of one run only: the watch's findings (worst first, at most 50), watched_at, "
        "up_to_date (it had seen every event received) and open_alerts.",
    )


class RunList(BaseModel):
    runs: list[Run] = Field(description="Newest activity first.")
    next_cursor: str | None = Field(description="Pass as cursor= for the next page; null on the last.")
    idle_after_s: float


class ScalarSeries(BaseModel):
    key: str
    rank: int
    points: int = Field(description="Steps of the series in the window.")
    bin: int = Field(description="Consecutive points per value.")
    steps: list[int] = Field(description="The last step of each bin.")
    mean: list[float | None]
    min: list[float | None]
    max: list[float | None]
    last: list[float | str] = Field(description="The value at each bin's step; NaN and Infinity as strings.")


class Scalars(BaseModel):
    """A run's ``run.log`` series, binned to at most max_steps points."""

    project: str
    run_id: str
    keys: list[str] = Field(description="Every scalar key of the run.")
    series: list[ScalarSeries]
    complete_through: int | None


class RawEvent(BaseModel):
    event_id: str
    step: int
    rank: int
    world_size: int | None
    local_rank: int | None
    weight: float
    time: float
    values: list[float | str | None] = Field(
        description="Aligned with the page's keys: the value as stored (NaN and Infinity as strings), "
        "null where the event has no such key."
    )


class RawColumns(BaseModel):
    """A page's events columnar (``encoding=base64``): fields as lists by position, floats as base64."""

    count: int
    event_id: list[str]
    step: list[int]
    rank: list[int]
    world_size: list[int | None]
    local_rank: list[int | None]
    weight: str = Field(description="base64 of little-endian float64, one per event")
    time: str = Field(description="base64 of little-endian float64, one per event")
    values: str = Field(description="base64 of little-endian float64, events x keys, row by row")
    present: str = Field(description="base64 of a bit per cell (numpy packbits, most significant first)")


class RawPage(BaseModel):
    """Stored events at full resolution, ordered by (step, rank), one page of them (contract 9)."""

    project: str
    run_id: str
    keys: list[str] = Field(description="The keys of this page's events (filtered by keys=), once.")
    events: list[RawEvent] | RawColumns = Field(description="a list (encoding=json) or columns (base64)")
    next_cursor: str | None = Field(description="Pass as cursor= for the next page; null on the last.")


#: What each error code means here; its status is the handlers' (``functions.api.STATUS``).
WHY = {
    "invalid_request": "a field outside the limits (details name it)",
    "unauthorized": "no or an unknown token",
    "forbidden": "the token does not grant this project",
    "not_found": "no such run, or a run with no events yet",
    "payload_too_large": "the body or the config is larger than the limits",
    "unsupported_media_type": "the body is not sent as application/json",
    "idempotency_key_in_use": "a request with this id is being stored (contract 3.2; not answered today)",
    "idempotency_key_reused": "the id is stored with another payload",
    "rate_limited": "retry after Retry-After seconds",
    "unavailable": "retry after Retry-After seconds",
}
ERRORS = {STATUS[code]: f"{code}: {why}" for code, why in WHY.items()}


#: The models a body refers to (its ``$defs``), gathered as the bodies are rendered: each becomes a
#: component of its own, so a model nested in a body needs no listing here.
_nested: dict[str, Any] = {}


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _nested.update(schema.pop("$defs", {}))
    return schema


def _batch_body(kind: str = "RankEvent") -> dict[str, Any]:
    # What refuses the whole request is only this: not a list of 1-1000 objects, each with a valid
    # event_id (once). An event outside RankEvent's limits is rejected alone, in the results, and the
    # others are stored (contract 3.3): the document says so, or it would call a 200 a violation.
    event = {
        "title": f"{kind}InBatch",
        "description": f"A {kind} with its event_id. An object that is not a valid {kind} is "
        "rejected on its own (status rejected, with its error) and does not stop the others.",
        "type": "object",
        "properties": {"event_id": {"type": "string", "pattern": limits.EVENT_ID_PATTERN}},
        "required": ["event_id"],
        "anyOf": [
            {"$ref": f"#/components/schemas/{kind}"},
            {"type": "object", "description": "any other event: rejected alone, in the results"},
        ],
    }
    return {
        "type": "object",
        "title": f"{kind}Batch",
        "description": f"At most {limits.MAX_BATCH_BYTES} bytes; each event at most "
        f"{limits.MAX_EVENT_BYTES} bytes and each event_id once.",
        "properties": {
            "events": {"type": "array", "minItems": 1, "maxItems": limits.MAX_BATCH_EVENTS, "items": event}
        },
        "required": ["events"],
    }


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


def _responses(ok: dict[str, Any], codes: list[int]) -> dict[str, Any]:
    responses = dict(ok)
    for code in codes:
        response: dict[str, Any] = {"description": ERRORS[code], "content": _json("Error")}
        if code in (429, 503):
            response["headers"] = {"Retry-After": {"schema": {"type": "integer", "minimum": 1}}}
        responses[str(code)] = response
    return responses


def _resolvers() -> list[Any]:
    os.environ.setdefault("METRICS_TABLE", "openapi")  # the modules read them lazily, but be safe
    os.environ.setdefault("RUNS_TABLE", "openapi-runs")
    apps = []
    functions = template.functions()
    for name in sorted({route.function for route in template.routes()}):  # the authorizer serves no route
        apps.append(importlib.import_module(functions[name]["Handler"].rpartition(".")[0]).app)
    return apps


def _paths() -> dict[str, Any]:
    """Every function's generated paths, merged, each operation behind the bearer token and each path
    parameter checked against the name pattern."""
    paths: dict[str, Any] = {}
    for app in _resolvers():
        generated = json.loads(app.get_openapi_json_schema(title="InstantML", version="1"))
        for path, operations in generated["paths"].items():  # a path may have methods in two functions
            paths.setdefault(path, {}).update(operations)
    name = {"type": "string", "pattern": limits.NAME_PATTERN}
    for operations in paths.values():
        for operation in operations.values():
            operation["security"] = [{"bearer": []}]
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "path":
                    parameter["schema"] = dict(name, title=parameter["schema"].get("title", ""))
    return paths


def _describe_ingest(paths: dict[str, Any]) -> None:
    """The event POSTs, single and batch, for rank metrics and scalars."""
    for path, kind in ((routes.RANK_METRICS, "RankEvent"), (routes.SCALARS, "ScalarEvent")):
        single = paths[path]["post"]
        single["parameters"].append(
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "description": "The event id, bare or quoted; without it the request is not retry-safe.",
                "schema": {"type": "string", "pattern": limits.EVENT_ID_PATTERN},
            }
        )
        single["requestBody"] = {"required": True, "content": _json(kind)}
        single["responses"] = _responses(
            {
                "201": {"description": "stored", "content": _json("EventResult")},
                "200": {
                    "description": "duplicate: this id is stored with the same payload; nothing changed",
                    "headers": {"Idempotent-Replayed": {"schema": {"const": "true"}}},
                    "content": _json("EventResult"),
                },
            },
            [400, 401, 403, 413, 415, 422, 429, 503],
        )
        batch = paths[path + "/batch"]["post"]
        batch["requestBody"] = {"required": True, "content": _json(f"{kind}Batch")}
        batch["responses"] = _responses(
            {"200": {"description": "one result per event", "content": _json("BatchResult")}},
            [400, 401, 403, 413, 415, 429, 503],
        )


def _query(operation: dict[str, Any], params: tuple[tuple[str, dict[str, Any]], ...]) -> None:
    """Optional query parameters added to ``operation``'s."""
    operation["parameters"] = operation.get("parameters", []) + [
        {"name": n, "in": "query", "required": False, "schema": s} for n, s in params
    ]


def _describe_runs(paths: dict[str, Any]) -> None:
    """A run's record (read and updated) and the listing of runs."""
    update = paths[routes.RUN]["patch"]
    update["requestBody"] = {"required": True, "content": _json("RunUpdate")}
    update["responses"] = _responses(
        {"200": {"description": "the run's record", "content": _json("Run")}},
        [400, 401, 403, 413, 415, 429, 503],
    )
    run = paths[routes.RUN]["get"]
    run["responses"] = _responses(
        {"200": {"description": "the run's record", "content": _json("Run")}}, [400, 401, 403, 404, 429, 503]
    )
    listing = paths[routes.RUNS]["get"]
    _query(
        listing,
        (
            ("limit", {"type": "integer", "minimum": 1, "maximum": runs.MAX_LIMIT}),
            ("cursor", {"type": "string", "description": "next_cursor of the previous page"}),
            ("status", {"type": "string", "description": "comma-separated: live, idle, finished"}),
        ),
    )
    listing["responses"] = _responses(
        {"200": {"description": "a page of runs", "content": _json("RunList")}}, [400, 401, 403, 429, 503]
    )


_RAW_PARAMETERS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("keys", {"type": "string", "description": "comma-separated metric keys"}),
    ("ranks", {"type": "string", "description": "ranks and ranges: 0,3,8-15"}),
    ("step_min", {"type": "integer", "minimum": 0}),
    ("step_max", {"type": "integer", "minimum": 0}),
    ("limit", {"type": "integer", "minimum": 1, "maximum": MAX_RAW_LIMIT}),
    ("cursor", {"type": "string", "description": "an earlier page's next_cursor"}),
    ("encoding", {"type": "string", "enum": ["json", "base64"]}),
)


def _describe_series(paths: dict[str, Any]) -> None:
    """The reads of a run's series: its scalars and its Distributed summary."""
    series = paths[routes.SCALARS]["get"]
    _query(
        series,
        (
            ("keys", {"type": "string", "description": "comma-separated scalar keys"}),
            ("step_min", {"type": "integer", "minimum": 0}),
            ("step_max", {"type": "integer", "minimum": 0}),
            ("max_steps", {"type": "integer", "minimum": 1}),
            *(p for p in _RAW_PARAMETERS if p[0] in ("ranks", "limit", "cursor", "encoding")),
            ("raw", {"type": "string", "description": "1: the stored values a page at a time (RawPage)"}),
        ),
    )
    either = [{"$ref": f"#/components/schemas/{name}"} for name in ("Scalars", "RawPage")]
    binned_or_raw = {"application/json": {"schema": {"anyOf": either}}}
    series["responses"] = _responses(
        {"200": {"description": "the run's scalars, binned, or raw=1: stored", "content": binned_or_raw}},
        [400, 401, 403, 404, 429, 503],
    )
    raw = paths[routes.RANK_METRICS]["get"]
    _query(raw, _RAW_PARAMETERS)
    raw["responses"] = _responses(
        {"200": {"description": "one page of the run's stored rank events", "content": _json("RawPage")}},
        [400, 401, 403, 404, 429, 503],
    )
    summary = paths["/v1/projects/{project}/runs/{run_id}/distributed"]["get"]
    _query(
        summary,
        (
            ("keys", {"type": "string", "description": "comma-separated metric keys"}),
            ("step_min", {"type": "integer", "minimum": 0}),
            ("step_max", {"type": "integer", "minimum": 0}),
            ("max_steps", {"type": "integer", "minimum": 1}),
            ("heatmap", {"type": "string", "enum": list(HEATMAP_ENCODINGS)}),
            (
                "since",
                {"type": "string", "description": "an earlier answer's version"},
            ),
        ),
    )
    summary["responses"] = _responses(
        {"200": {"description": "The Distributed summary (contract 5)", "content": {"application/json": {}}}},
        [400, 401, 403, 404, 429, 503],
    )


def _describe_alerts(paths: dict[str, Any]) -> None:
    """A project's webhooks: replaced, read, deleted."""
    alerts = paths[routes.ALERTS]
    alerts["put"]["requestBody"] = {"required": True, "content": _json("Alerts")}
    for method, what in (
        ("put", "the project's webhooks, replaced"),
        ("get", "the project's webhooks"),
        ("delete", "none: the watch sends no alert for this project"),
    ):
        codes = [400, 401, 403, 413, 415, 429, 503] if method == "put" else [400, 401, 403, 429, 503]
        alerts[method]["responses"] = _responses(
            {"200": {"description": what, "content": _json("AlertsAnswer")}}, codes
        )


def _describe_views(paths: dict[str, Any]) -> None:
    """The HTML pages: open to anyone, whatever the path's names."""
    for path, what in (
        (routes.DISTRIBUTED_VIEW, "The Distributed tab"),
        (routes.RUNS_VIEW, "The runs page"),
        (routes.RUN_VIEW, "The run page: config and run.log charts"),
        (
            routes.COMPARE_VIEW,
            "The comparison of runs (#runs=a,b): run.log and Distributed series, findings, configs",
        ),
    ):
        view = paths[path]["get"]
        view.pop("security")  # the page shell carries no data
        for parameter in view["parameters"]:  # nor checks the names: the data it fetches does
            parameter["schema"] = {"type": "string", "title": parameter["schema"]["title"]}
            parameter["description"] = "any value: the page is the same for every path"
        view["responses"] = {"200": {"description": what, "content": {"text/html": {}}}}


def _schemas() -> dict[str, Any]:
    """The components' schemas: the bodies by the names the operations use, the rest by class name."""
    schemas = {
        "RankEvent": _schema(RankEventBody),
        "RankEventBatch": _batch_body(),
        "ScalarEvent": _schema(ScalarEventBody),
        "ScalarEventBatch": _batch_body("ScalarEvent"),
        "RunUpdate": _schema(RunUpdateBody),
        "EventResult": _schema(EventResult),
        "BatchResult": _schema(BatchResult),
        "Error": _schema(Error),
        "Alerts": _schema(AlertsBody),
        "AlertsAnswer": _schema(AlertsAnswer),
    }
    for model in (
        ErrorObject,
        ErrorDetail,
        BatchEventResult,
        Run,
        RunList,
        ScalarSeries,
        Scalars,
        WebhookBody,
        WebhookAnswer,
        RawEvent,
        RawColumns,
        RawPage,
        LastDeliveryBody,
    ):
        schemas[model.__name__] = _schema(model)
    for name, nested in sorted(_nested.items()):
        schemas.setdefault(name, nested)
    return schemas


def document() -> dict[str, Any]:
    """The whole OpenAPI 3.1 document."""
    paths = _paths()
    for describe in (_describe_ingest, _describe_runs, _describe_series, _describe_alerts, _describe_views):
        describe(paths)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "InstantML distributed metrics",
            "version": "1",
            "description": "Per-rank metric events in, Distributed summaries out. All bodies are JSON.",
        },
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": dict(sorted(_schemas().items())),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if openapi.json is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OPENAPI_JSON.is_file() or OPENAPI_JSON.read_text() != text:
            print("openapi.json is out of date: run python -m infra.openapi", file=sys.stderr)
            return 1
        return 0
    OPENAPI_JSON.write_text(text)
    print(f"wrote {OPENAPI_JSON.relative_to(template.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
