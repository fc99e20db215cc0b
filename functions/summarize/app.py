"""Summarize function: ``GET .../distributed`` and the Distributed tab ``GET .../distributed/view``."""

from __future__ import annotations

import base64
import gzip
import time
from pathlib import Path
from typing import Any

import orjson
from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.api import json_response, lazy_store, logger, make_app, page, require_project, resolver_path
from instantml import routes
from shared.errors import SECURITY_HEADERS, DomainError, FieldError, InvalidInput, NotFound
from shared.reading import raw
from shared.runs import note_findings, summary_processes, with_run_facts
from shared.summary.query import parse_query
from shared.summary.reads import distributed_summary
from shared.summary.wire import answer

app = make_app()
store = lazy_store()
VIEW_HTML = Path(__file__).with_name("view.html")


#: A Lambda response carries at most 6 MB (6,291,456 bytes) with its headers; a base64 body is 4/3 its bytes.
MAX_BODY_BYTES = 6_000_000


#: gzip's level for a summary, when the client accepts it (browsers do: a 512-rank heatmap is several MB
#: of JSON). Level 1 is about 10% larger than Powertools' level 9 and 15 times faster: 10 against 170 ms
#: for a 64 x 1,000 run's 1.3 MB.
GZIP_LEVEL = 1


@app.get(resolver_path(routes.RANK_METRICS), middlewares=[require_project], compress=True)
def get_rank_metrics(project: str, run_id: str) -> Any:
    """The run's stored rank events, a page at a time (contract 9, ``shared.reading.raw``)."""
    query = raw.parse_query(app.current_event.query_string_parameters or {})
    return json_response(200, raw.read_page(store().read_event_rows, project, run_id, query))


@app.get(resolver_path(routes.DISTRIBUTED), middlewares=[require_project])
def get_distributed(project: str, run_id: str) -> Any:
    query = parse_query(app.current_event.query_string_parameters or {})
    summary = distributed_summary(store(), project, run_id, query, arrays=True)
    if summary is None:
        raise NotFound(f"run {run_id!r} of project {project!r} has no rank events yet")
    # The record says each rank's host, and what the watch learnt from the processes (contract 8).
    record = store().get_run(project, run_id)
    summary["findings"] = with_run_facts(summary["findings"], record)
    summary["processes"] = summary_processes(store(), project, run_id, record, time.time())
    if query.keys is None and query.step_min is None and query.step_max is None:
        try:  # the runs index shows the counts of the run's latest full summary
            note_findings(store(), project, run_id, summary["findings"], time.time(), summary["processes"])
        except DomainError as exc:  # the summary is still the answer
            logger.warning("findings not recorded", extra={"reason": str(exc)})
    # orjson writes the same JSON as json.dumps (floats as their shortest repr) 20 times faster: 4
    # against 80 ms for a 64 x 1,000 run, most of it the heatmap's floats.
    encoded = orjson.dumps(answer(summary, query), option=orjson.OPT_SERIALIZE_NUMPY)
    accepts_gzip = "gzip" in (app.current_event.headers.get("accept-encoding") or "").lower()
    # A gzipped body goes as base64, 4/3 its bytes: that is what counts against Lambda's limit.
    body = base64.b64encode(gzip.compress(encoded, GZIP_LEVEL)).decode() if accepts_gzip else encoded.decode()
    size = len(body) if accepts_gzip else len(encoded)
    # A body over Lambda's limit would reach the user as a bare 502: say what to ask for instead.
    if size > MAX_BODY_BYTES:
        how = "" if accepts_gzip else "send Accept-Encoding: gzip, or "
        message = (
            f"this summary is {size / 1e6:.1f} MB{' gzipped' if accepts_gzip else ''}, over the "
            f"{MAX_BODY_BYTES / 1e6:.0f} MB a response can carry: {how}ask for fewer columns "
            f"(max_steps is {query.max_steps}), fewer keys (keys=a,b), or heatmap=base64"
        )
        raise InvalidInput(message, [FieldError("max_steps", message)])
    headers = (
        SECURITY_HEADERS
        | {"Vary": "Accept-Encoding"}
        | ({"Content-Encoding": "gzip"} if accepts_gzip else {})
    )
    response = Response(200, content_type="application/json", body=body, headers=headers)
    # The gzip is given as base64 text: bytes with a JSON type would be serialized again by the resolver.
    response.base64_encoded = accepts_gzip
    return response


@app.get(resolver_path(routes.DISTRIBUTED_VIEW))
def get_distributed_view(project: str, run_id: str) -> Any:
    return page(VIEW_HTML)


@logger.inject_lambda_context(correlation_id_path=correlation_paths.API_GATEWAY_HTTP)
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return app.resolve(event, context)
