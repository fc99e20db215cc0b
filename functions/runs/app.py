"""Runs function: a project's runs (``GET .../runs``), one run's record (``GET .../runs/{run_id}``), its
``run.log`` scalars (``GET .../scalars``, binned, or as stored with ``raw=1``), and the pages: runs, run
and compare. It only reads."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.api import json_response, lazy_store, logger, make_app, page, require_project, resolver_path
from instantml import routes
from shared import runs

app = make_app()
store = lazy_store()
RUNS_HTML = Path(__file__).with_name("runs.html")
RUN_HTML = Path(__file__).with_name("run.html")
COMPARE_HTML = Path(__file__).with_name("compare.html")


@app.get(resolver_path(routes.RUNS), middlewares=[require_project], compress=True)
def get_runs(project: str) -> Any:
    params = app.current_event.query_string_parameters or {}
    return json_response(200, runs.list_runs(store(), project, params, time.time()))


@app.get(resolver_path(routes.RUN), middlewares=[require_project])
def get_run(project: str, run_id: str) -> Any:
    return json_response(200, runs.get_run(store(), project, run_id, time.time()))


@app.get(resolver_path(routes.SCALARS), middlewares=[require_project], compress=True)
def get_scalars(project: str, run_id: str) -> Any:
    from shared.summary import (
        scalars,  # numpy: imported by the first request of scalars, not by every cold start
    )

    params = dict(app.current_event.query_string_parameters or {})
    if params.pop("raw", None) in ("1", "true"):  # the stored values, a page at a time (contract 9)
        from shared.reading import raw

        page = raw.read_page(
            store().read_scalar_rows, project, run_id, raw.parse_query(params), "run.log scalars"
        )
        return json_response(200, page)
    binned = scalars.parse_query(params)
    return json_response(200, scalars.scalar_series(store(), project, run_id, binned))


@app.get(resolver_path(routes.RUNS_VIEW))
def get_runs_view(project: str) -> Any:
    return page(RUNS_HTML)


@app.get(resolver_path(routes.RUN_VIEW))
def get_run_view(project: str, run_id: str) -> Any:
    return page(RUN_HTML)


@app.get(resolver_path(routes.COMPARE_VIEW))
def get_compare_view(project: str) -> Any:
    return page(COMPARE_HTML)


@logger.inject_lambda_context(correlation_id_path=correlation_paths.API_GATEWAY_HTTP)
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return app.resolve(event, context)
