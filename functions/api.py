"""What the functions behind the HTTP API share at its edge: routes, auth, the contract's error responses
(the stream and schedule functions take only the store and the logger from here).

Handlers stay thin: parse the request, call one function of ``shared``, and let the exception
handlers registered here turn domain errors into the contract's error shape (3.2).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from aws_lambda_powertools import Logger
from aws_lambda_powertools.event_handler import APIGatewayHttpResolver, Response
from aws_lambda_powertools.event_handler.exceptions import NotFoundError
from aws_lambda_powertools.event_handler.middlewares import NextMiddleware

from shared.errors import (
    SECURITY_HEADERS,
    DomainError,
    FieldError,
    InvalidInput,
    StoreUnavailable,
    check_path,
)
from shared.store import STORE_URL_ENV, open_store
from shared.store.port import MetricsStore
from shared.tokens import ANY_PROJECT, same_text

logger = Logger()

#: Contract 3.2: the HTTP status of each machine code.
STATUS = {
    "invalid_request": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "idempotency_key_in_use": 409,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "idempotency_key_reused": 422,
    "rate_limited": 429,
    "unavailable": 503,
}


def resolver_path(path: str) -> str:
    """A contract path (``{project}``) in Powertools' route syntax (``<project>``)."""
    return re.sub(r"\{(\w+)\}", r"<\1>", path)


def json_response(
    status: int, body: Mapping[str, Any], headers: dict[str, str] | None = None
) -> Response[Any]:
    headers = {**SECURITY_HEADERS, **(headers or {})}
    return Response(status_code=status, content_type="application/json", body=body, headers=headers)


def error_response(code: str, message: str, headers: dict[str, str] | None = None) -> Response[Any]:
    return json_response(STATUS[code], {"error": {"code": code, "message": message}}, headers)


class Unauthorized(DomainError):
    code = "unauthorized"


class Forbidden(DomainError):
    code = "forbidden"


#: Names of query parameters that look like a token: refused, never read (contract 3.1).
TOKEN_QUERY_PARAMETERS = {"token", "api_key", "apikey", "access_token", "key", "authorization"}


def require_project(app: APIGatewayHttpResolver, next_middleware: NextMiddleware) -> Response[Any]:
    """Route middleware: the authorizer's verdict must grant the project in the path.

    The authorizer (functions/authorizer) maps the bearer token to its project; this is where a
    missing, unknown or revoked token becomes 401 and another project's token 403, in the contract's
    shape. A route reached without an authorizer verdict is refused too.
    """
    event = app.current_event
    if TOKEN_QUERY_PARAMETERS & {name.lower() for name in (event.query_string_parameters or {})}:
        raise Unauthorized(
            "tokens are never accepted in the query string; send 'Authorization: Bearer <token>'"
        )
    verdict = (event.raw_event.get("requestContext", {}).get("authorizer") or {}).get("lambda") or {}
    granted = verdict.get("project") or ""
    if not granted:
        reason = verdict.get("reason", "missing")
        if reason == "missing":
            raise Unauthorized("send the project's API token as 'Authorization: Bearer <token>'")
        raise Unauthorized("the API token is not valid (unknown or revoked)")
    params = event.path_parameters or {}
    project = params.get("project", "")
    # A name outside the contract's rules (non-ASCII, a trailing newline) is a 400 naming it, whatever
    # the token: no project can have such a name, so saying so reveals nothing about any project.
    check_path(project, params.get("run_id"))
    if granted != ANY_PROJECT and not same_text(granted, project):
        # The same answer whether or not that project exists: it reveals nothing about it.
        raise Forbidden("this API token does not grant access to this project")
    return next_middleware(app)


class UnsupportedMediaType(DomainError):
    code = "unsupported_media_type"


#: Where ``require_json`` puts the request's body, as sent, for the route (``app.context[BODY]``).
BODY = "body"


def require_json(app: APIGatewayHttpResolver, next_middleware: NextMiddleware) -> Response[Any]:
    """Route middleware: a body sent as anything but JSON is a 415 (a missing type is taken as JSON);
    the body, as sent (``request_body``), is ``app.context[BODY]`` for the route."""
    content_type = app.current_event.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.partition(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise UnsupportedMediaType(
                f"send the body as Content-Type: application/json, not {media_type or 'an empty type'!r}",
                [FieldError("Content-Type", "must be application/json")],
            )
    app.context[BODY] = request_body(app.current_event)
    return next_middleware(app)


def request_body(event: Any) -> bytes:
    """The request body as sent. Powertools' ``decoded_body`` would raise (a 500) on a base64 body
    that is not UTF-8; as bytes, the JSON parser turns that into a 400."""
    if event.is_base64_encoded:
        try:
            return base64.b64decode(event.body or "")
        except binascii.Error:
            raise InvalidInput("body is not valid base64", [FieldError("body", "must be JSON")]) from None
    # "surrogatepass": a body string holding a lone surrogate (which no real HTTP body can) becomes
    # bytes that are not UTF-8, which the JSON parser refuses with a 400, rather than a 500 here.
    return (event.body or "").encode("utf-8", "surrogatepass")


def make_app(on_error: Callable[[DomainError], None] | None = None) -> APIGatewayHttpResolver:
    """A resolver that answers every domain error and unknown route in the contract's shape.

    ``on_error`` sees each domain error first (the ingest function counts rejections with it).
    """
    app = APIGatewayHttpResolver()

    @app.exception_handler(DomainError)  # type: ignore[untyped-decorator]
    def _domain_error(exc: DomainError) -> Response[Any]:
        if on_error is not None:
            on_error(exc)
        headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, StoreUnavailable) else None
        if isinstance(exc, StoreUnavailable):
            logger.warning("store unavailable", extra={"reason": str(exc)})
        else:  # the code and the fields at fault; never the body or the token
            fields = [d.field for d in exc.details]
            logger.info("request refused", extra={"error_code": exc.code, "fields": fields[:10]})
        return json_response(STATUS[exc.code], {"error": exc.error_object()}, headers)

    @app.not_found
    def _not_found(exc: NotFoundError) -> Response[Any]:
        # The path as sent may hold anything, a lone surrogate too: escaped, the answer always encodes.
        path = app.current_event.path.encode("utf-8", "backslashreplace").decode()
        return error_response("not_found", f"there is no route {app.current_event.http_method} {path}")

    return app


#: The pages' Content-Security-Policy: requests to this API only, no plugin, no <base>, no framing, and
#: only the page's own script runs (``{script}``: its hash, so markup that ever slipped through escaping
#: runs nothing, inline handlers included). Inline style stays allowed: the charts set it.
PAGE_POLICY = (
    "default-src 'self'; script-src {script}; style-src 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)


#: The page kit (functions/pages) that the pages share: where each part goes (its placeholder, which a
#: page holds once) and the closing tag the part must not hold, since it is inlined into that element.
PAGE_KIT = Path(__file__).with_name("pages")
KIT_PARTS = {
    "kit.head.html": ("<!-- instantml:kit.head.html -->", None),  # what every page's <head> opens with
    "kit.css": ("/* instantml:kit.css */", "</style"),
    "kit.html": ("<!-- instantml:kit.html -->", None),
    "kit.js": ("// instantml:kit.js", "</script"),
}


@functools.cache
def page_html(path: Path) -> str:
    """The page at ``path`` with the kit's parts put in its placeholders: one self-contained document, its
    script and style inline. Assembled once per process; a page without a placeholder (or with one twice)
    is an error, not a page without the kit."""
    html = path.read_text()
    for placeholder, _ in KIT_PARTS.values():
        if html.count(placeholder) != 1:
            raise ValueError(f"{path} must hold the page kit's placeholder {placeholder!r} exactly once")
    for name, (placeholder, closing) in KIT_PARTS.items():
        part = (PAGE_KIT / name).read_text()
        if closing is not None and closing in part.lower():
            raise ValueError(f"{PAGE_KIT / name} must not hold {closing!r}: it is inlined into that element")
        html = html.replace(placeholder, part.rstrip("\n"))
    return html


@functools.cache
def page_headers(path: Path) -> dict[str, str]:
    """The page's headers, its policy naming the SHA-256 of its one inline script (as assembled)."""
    html = page_html(path)
    start = html.index(">", html.index("<script")) + 1
    script = html[start : html.index("</script>", start)]
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    policy = PAGE_POLICY.format(script=f"'sha256-{digest}'")
    return {"Cache-Control": "no-cache", "Content-Security-Policy": policy, **SECURITY_HEADERS}


def page(path: Path) -> Response[Any]:
    """An HTML page shell. It carries no data: it reads the token from the URL fragment and sends it
    with each request for data."""
    return Response(
        200, content_type="text/html; charset=utf-8", body=page_html(path), headers=page_headers(path)
    )


def lazy_store(extra: Callable[[], dict[str, str]] | None = None) -> Callable[[], MetricsStore]:
    """One store per warm function, created on first use so imports stay cheap and mockable: the
    template's table on AWS, the local database under ``instantml local`` (``shared.store``).
    ``extra`` names more of the deployment's resources for the functions that use them (the alerts
    table, the alerts queue), read from their own environment when the store is first used."""
    return functools.cache(functools.partial(_open_store, extra))


def _open_store(extra: Callable[[], dict[str, str]] | None) -> MetricsStore:
    parts = {"runs": os.environ.get("RUNS_TABLE", ""), **(extra() if extra else {})}
    deployed = f"dynamodb://{os.environ['METRICS_TABLE']}?{urlencode(parts)}"
    return open_store(os.environ.get(STORE_URL_ENV) or deployed)
