"""Ingest function: ``POST .../rank-metrics`` and ``POST .../rank-metrics/batch`` (contract 3.3)."""

from __future__ import annotations

import time
from typing import Any

from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.api import json_response, lazy_store, logger, make_app, require_project, resolver_path
from instantml import routes
from shared.ingest import store_rank_event, store_rank_event_batch

app = make_app()
store = lazy_store()


def _body() -> bytes:
    return (app.current_event.decoded_body or "").encode()


@app.post(resolver_path(routes.RANK_METRICS), middlewares=[require_project])
def post_rank_metrics(project: str, run_id: str) -> Any:
    key = app.current_event.headers.get("idempotency-key")
    event_id, status = store_rank_event(store(), project, run_id, _body(), key, time.time())
    if status == "duplicate":
        return json_response(200, {"event_id": event_id, "status": status}, {"Idempotent-Replayed": "true"})
    return json_response(201, {"event_id": event_id, "status": status})


@app.post(resolver_path(routes.RANK_METRICS_BATCH), middlewares=[require_project])
def post_rank_metrics_batch(project: str, run_id: str) -> Any:
    result = store_rank_event_batch(store(), project, run_id, _body(), time.time())
    return json_response(200, {"results": result.results, **result.counts()})


@logger.inject_lambda_context(correlation_id_path=correlation_paths.API_GATEWAY_HTTP)
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return app.resolve(event, context)
