"""The local stack fuzzed over HTTP by schemathesis, from the published ``openapi.json``.

Next to ``test_openapi_fuzz.py`` (our own hypothesis strategies, and what the table holds after each
answer), this is the independent OpenAPI-driven fuzzer: for every operation it sends the document's
examples, its boundary values (the coverage phase: each limit, one past it, missing and wrong-typed
fields) and random valid and invalid requests, authenticated with the stack's token, and checks each
answer: never a 5xx, a status code, content type, headers and body that the document declares, a 401
without the token, and a 4xx for whatever the document says is invalid.

Bounded so it stays fast and small: a few examples per operation, no shrinking, no stateful phase
(the document declares no links between operations). The coverage phase sends step 2**53 - 1, which
once took the stack past 3 GiB in half a minute (the rollup poller enumerated every block below it);
now the server's work follows the events that exist (issue 13 item 7), and this run stays small.
"""

from __future__ import annotations

import http.client
from typing import Any
from urllib.parse import urlsplit

import pytest
import schemathesis
from schemathesis.core.parameters import ParameterLocation
from schemathesis.generation.case import Case
from schemathesis.generation.modes import GenerationMode

from infra import openapi

#: Examples per operation and phase; with 4 operations the whole run sends a few hundred requests.
MAX_EXAMPLES = 25

#: What is checked on every answer. Not checked: positive_data_acceptance (the document cannot say
#: that rank < world_size, or that a batch's event ids differ, so valid-looking requests are rightly
#: refused), unsupported_method and allow_header_conformance (an unknown method is 404 not_found, as
#: HTTP API answers it, not 405), and the checks that need links between operations.
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "negative_data_rejection",
    "ignored_auth",
    "missing_required_header",
]


# Loaded at import, with the stack's URL and token given at each call: schemathesis 4.32's loader from
# a fixture (`schemathesis.pytest.from_fixture`) fails under pytest 9 ('Function' object has no
# attribute '_nodeid').
schema = schemathesis.openapi.from_path(str(openapi.OPENAPI_JSON))
schema.config.update(request_timeout=30)
schema.config.generation.update(
    max_examples=MAX_EXAMPLES, no_shrink=True, database="none", deterministic=True
)
schema.config.phases.update(phases=["examples", "coverage", "fuzzing"])
# Methods the operations do not declare, sent to their paths: those the local stack dispatches (and
# answers 404 not_found, as HTTP API does).
schema.config.phases.coverage.unexpected_methods = {
    "get",
    "put",
    "post",
    "delete",
    "patch",
    "options",
    "trace",
}
schema.config.checks.update(included_check_names=CHECKS)


@schema.parametrize()
def test_the_local_stack_answers_every_request_as_openapi_json_says(
    local_stack: Any, case: Case[Any]
) -> None:
    headers = {"Authorization": f"Bearer {local_stack.token}"}
    made = case.meta.components.get(ParameterLocation.HEADER) if case.meta else None
    negative = made is not None and made.mode == GenerationMode.NEGATIVE
    if negative and "Authorization" not in (case.headers or {}):
        # A case made without its Authorization header is sent without it: with the token added, a
        # valid request went out while schemathesis still expected the missing header to be refused.
        headers = {}
    case.call_and_validate(base_url=local_stack.url, headers=headers)


@pytest.mark.parametrize("method", ["HEAD", "OPTIONS", "TRACE"])
def test_undeclared_methods_are_not_5xx(local_stack: Any, method: str) -> None:
    url = urlsplit(local_stack.url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    try:
        connection.request(method, "/v1/projects/p/runs/r/rank-metrics", headers={"Authorization": "x"})
        response = connection.getresponse()
        response.read()
    finally:
        connection.close()
    assert response.status == 404, (method, response.status)
    if method != "HEAD":
        assert response.getheader("content-type") == "application/json"
