"""Ingest function: the write routes (contract 3.3): rank events (``POST .../rank-metrics`` and
``.../rank-metrics/batch``), ``run.log`` scalars (``POST .../scalars`` and ``.../scalars/batch``) and the
run's config and end (``PATCH .../runs/{run_id}``).

Observability: every log line carries the API Gateway request id as ``correlation_id``; one line per
request says what happened (route, counts, milliseconds), never the token or the body. Each request
also emits CloudWatch metrics in EMF (``EventsStored``, ``EventsDuplicate``, ``EventsRejected`` with
a ``route`` dimension, and ``StoreUnavailable``).
"""

from __future__ import annotations

import time
from typing import Any

from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.metrics import EphemeralMetrics, MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.api import (
    BODY,
    json_response,
    lazy_store,
    logger,
    make_app,
    require_json,
    require_project,
    resolver_path,
)
from functions.ingest.nudge import nudge
from instantml import routes
from shared.errors import DomainError, StoreUnavailable
from shared.events import EventKind, RankEvent, ScalarEvent
from shared.ingest.writes import store_event, store_event_batch
from shared.runs import update_run

SINGLE, BATCH = "rank-metrics", "rank-metrics/batch"
SCALAR, SCALAR_BATCH, RUN = "scalars", "scalars/batch", "run"


def _route() -> str:
    """The route's name for metrics: the path after the run id."""
    path = app.current_event.path
    for name in (BATCH, SINGLE, SCALAR_BATCH, SCALAR):
        if path.endswith("/" + name):
            return name
    return RUN


def emit_metrics(
    route: str, stored: int = 0, duplicate: int = 0, rejected: int = 0, unavailable: int = 0
) -> None:
    """One EMF document for this request.

    Ephemeral metrics, not the shared ``Metrics`` singleton: the local stack serves concurrent requests
    in one process, and each request's counts must stay with its own ``route`` dimension.
    """
    metrics = EphemeralMetrics()
    metrics.add_dimension(name="route", value=route)
    for name, value in (
        ("EventsStored", stored),
        ("EventsDuplicate", duplicate),
        ("EventsRejected", rejected),
        ("StoreUnavailable", unavailable),
    ):
        metrics.add_metric(name=name, unit=MetricUnit.Count, value=value)
    metrics.flush_metrics()


def _count_refused(exc: DomainError) -> None:
    """A whole request refused: its events count as rejected, or the store as unavailable."""
    route = _route()
    if isinstance(exc, StoreUnavailable):
        emit_metrics(route, unavailable=1)
    else:
        emit_metrics(route, rejected=1)


app = make_app(on_error=_count_refused)
store = lazy_store()


def _body() -> bytes:
    body: bytes = app.context[BODY]  # every write route has require_json
    return body


@app.post(resolver_path(routes.RANK_METRICS), middlewares=[require_project, require_json])
def post_rank_metrics(project: str, run_id: str) -> Any:
    return _post_one(project, run_id, RankEvent, SINGLE)


@app.post(resolver_path(routes.SCALARS), middlewares=[require_project, require_json])
def post_scalars(project: str, run_id: str) -> Any:
    return _post_one(project, run_id, ScalarEvent, SCALAR)


@app.post(resolver_path(routes.RANK_METRICS_BATCH), middlewares=[require_project, require_json])
def post_rank_metrics_batch(project: str, run_id: str) -> Any:
    return _post_batch(project, run_id, RankEvent, BATCH)


@app.post(resolver_path(routes.SCALARS_BATCH), middlewares=[require_project, require_json])
def post_scalars_batch(project: str, run_id: str) -> Any:
    return _post_batch(project, run_id, ScalarEvent, SCALAR_BATCH)


@app.patch(resolver_path(routes.RUN), middlewares=[require_project, require_json])
def patch_run(project: str, run_id: str) -> Any:
    started = time.perf_counter()
    record = update_run(store(), project, run_id, _body(), time.time(), nudge=nudge)
    logger.info("run update", extra={"route": RUN, "ms": round((time.perf_counter() - started) * 1e3, 1)})
    return record  # a 200 with the record as JSON


#: How a request's log line names it.
_WHAT = {RankEvent: "rank event", ScalarEvent: "scalar event"}


def _post_one(project: str, run_id: str, kind: EventKind, route: str) -> Any:
    started = time.perf_counter()
    key = app.current_event.headers.get("idempotency-key")
    event_id, status = store_event(store(), project, run_id, _body(), key, time.time(), kind)
    emit_metrics(route, stored=int(status == "stored"), duplicate=int(status == "duplicate"))
    logger.info(
        _WHAT[kind],
        extra={"route": route, "status": status, "ms": round((time.perf_counter() - started) * 1e3, 1)},
    )
    if status == "duplicate":
        return json_response(200, {"event_id": event_id, "status": status}, {"Idempotent-Replayed": "true"})
    return json_response(201, {"event_id": event_id, "status": status})


def _post_batch(project: str, run_id: str, kind: EventKind, route: str) -> Any:
    started = time.perf_counter()
    result = store_event_batch(store(), project, run_id, _body(), time.time(), kind)
    counts = result.counts
    emit_metrics(route, **counts)
    extra: dict[str, Any] = {"route": route, **counts, "ms": round((time.perf_counter() - started) * 1e3, 1)}
    if not result.run_noted:
        extra["run_noted"] = False  # the store refused the run's note now: its next batch carries it
    logger.info(f"{_WHAT[kind]} batch", extra=extra)
    return {"results": result.results, **counts}  # a 200 with it as JSON


@logger.inject_lambda_context(correlation_id_path=correlation_paths.API_GATEWAY_HTTP)
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return app.resolve(event, context)
