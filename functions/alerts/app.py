"""Alerts function: a project's alert destinations (contract 7), ``PUT/GET/DELETE .../alerts``.

The webhook URLs are the project's secrets: they are answered only to the project's own tokens (the
authorizer and ``require_project``), and never logged (the logger sees field names only).
"""

from __future__ import annotations

import os
from typing import Any

from aws_lambda_powertools.logging import correlation_paths
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
from instantml import routes
from shared.store.port import LastDelivery, Webhook
from shared.watch.egress import Policy

app = make_app()
ALERTS_TABLE_ENV = "ALERTS_TABLE"
store = lazy_store(lambda: {"alerts": os.environ[ALERTS_TABLE_ENV]})


@app.put(resolver_path(routes.ALERTS), middlewares=[require_project, require_json])
def put_alerts(project: str) -> Any:
    # The webhooks' validation (pydantic) is imported by the first PUT, not by every cold start.
    from shared.ingest.json_body import parse_json
    from shared.watch.alerts import parse_webhooks

    webhooks = parse_webhooks(parse_json(app.context[BODY]), Policy.from_environment())  # (require_json's)
    store().put_webhooks(project, webhooks)
    return json_response(200, alerts_json(webhooks, store().last_deliveries(project)))


@app.get(resolver_path(routes.ALERTS), middlewares=[require_project])
def get_alerts(project: str) -> Any:
    return json_response(200, alerts_json(store().get_webhooks(project), store().last_deliveries(project)))


@app.delete(resolver_path(routes.ALERTS), middlewares=[require_project])
def delete_alerts(project: str) -> Any:
    store().delete_webhooks(project)
    return json_response(200, alerts_json([], {}))


def alerts_json(webhooks: list[Webhook], last: dict[str, LastDelivery]) -> dict[str, Any]:
    """A project's webhooks as the alerts routes answer them, each with its last delivery."""
    return {
        "webhooks": [
            {
                "url": hook.url,
                "min_severity": hook.min_severity,
                "last_delivery": last[hook.url]._asdict() if hook.url in last else None,
            }
            for hook in webhooks
        ]
    }


@logger.inject_lambda_context(correlation_id_path=correlation_paths.API_GATEWAY_HTTP)
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return app.resolve(event, context)
