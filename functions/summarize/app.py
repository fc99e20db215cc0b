"""Summarize function: ``GET .../distributed`` and the Distributed tab ``GET .../distributed/view``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.api import json_response, lazy_store, logger, make_app, require_project, resolver_path
from instantml import routes
from shared.models import NotFound
from shared.summary import distributed_summary, parse_query

app = make_app()
store = lazy_store()
VIEW_HTML = Path(__file__).with_name("view.html")


# gzip when the client accepts it (browsers do): a 512-rank heatmap is several MB of JSON, and a
# Lambda response must stay under 6 MB.
@app.get(resolver_path(routes.DISTRIBUTED), middlewares=[require_project], compress=True)
def get_distributed(project: str, run_id: str) -> Any:
    query = parse_query(app.current_event.query_string_parameters or {})
    summary = distributed_summary(store(), project, run_id, query)
    if summary is None:
        raise NotFound(f"run {run_id!r} of project {project!r} has no rank events yet")
    return json_response(200, summary)


@app.get(resolver_path(routes.DISTRIBUTED_VIEW))
def get_distributed_view(project: str, run_id: str) -> Any:
    # The page shell carries no data: it reads the token from the URL fragment and fetches the summary.
    return Response(
        status_code=200,
        content_type="text/html; charset=utf-8",
        body=VIEW_HTML.read_text(),
        headers={
            "Cache-Control": "no-cache",
            "Content-Security-Policy": "default-src 'self'; "
            "script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:; connect-src 'self'",
        },
    )


@logger.inject_lambda_context(correlation_id_path=correlation_paths.API_GATEWAY_HTTP)
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return app.resolve(event, context)
