"""A request's body as JSON, strictly: ``NaN``/``Infinity`` literals, bad UTF-8, text UTF-8 cannot encode
and nesting too deep for any recursive code are errors naming the field (``InvalidInput``), never a
crash. Standard library only: every function's edge parses with it, before any validation library."""

from __future__ import annotations

import json
import re
from typing import Any

from instantml import limits
from shared.errors import FieldError, InvalidInput

#: How deeply a request body may nest arrays and objects. A batch needs 3 levels (body, events, an
#: event's metrics); the bound is far above that and far below what any recursive code can take.
MAX_JSON_DEPTH = 64


def parse_json(raw: bytes | str) -> Any:
    """A request body as JSON, strictly: ``NaN``/``Infinity`` literals, bad UTF-8 and nesting deeper
    than :data:`MAX_JSON_DEPTH` are errors (``InvalidInput`` naming ``body``), never a crash; so is a
    string (or object key) that UTF-8 cannot encode, naming its field (:func:`check_text_of`)."""
    document, text_suspect = parse_json_deferred(raw)
    check_depth_of(document, raw)
    if text_suspect:
        check_text_of(document)
    return document


def parse_json_deferred(raw: bytes | str) -> tuple[Any, bool]:
    """``parse_json`` with its two walks of the document left to the caller: its depth
    (:func:`check_depth_of`), before any recursive code sees it, and, where the second value says its
    text may hold a lone surrogate (:func:`may_hold_surrogates`), its text (:func:`check_text_of`). A batch
    walks its depth only when something in it is wrong, and checks each event's text on its own."""
    try:
        document = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidInput(f"body is not valid JSON: {exc}", [FieldError("body", "must be JSON")]) from None
    except RecursionError:  # thousands of '[' or '{': the decoder gives up before the end
        raise _too_deep() from None
    return document, may_hold_surrogates(raw)


#: A JSON escape of a UTF-16 surrogate (``\ud800``-``\udfff``), or a surrogate encoded as UTF-8 would
#: encode one (``ED A0``-``ED BF``, which strict UTF-8 refuses but ``json.loads`` decodes bytes with
#: "surrogatepass"): both become lone surrogates in the document.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE_ESCAPE_TEXT = re.compile(r"\\u[dD][89a-fA-F]")


def may_hold_surrogates(raw: bytes | str) -> bool:
    """Whether a JSON text may parse to a string with a lone surrogate: it escapes a surrogate (most
    often half of a pair, as ``json.dumps`` writes an emoji) or, as text, is not ASCII."""
    if isinstance(raw, bytes):
        # Most bodies hold neither a ``\u`` nor the byte ED: two substring scans, ten times faster
        # than the pattern's over a batch, rule both out first.
        return (b"\\u" in raw or b"\xed" in raw) and _SURROGATE_ESCAPE.search(raw) is not None
    return not raw.isascii() or _SURROGATE_ESCAPE_TEXT.search(raw) is not None


#: How many fields at fault an error names.
MAX_DETAILS = 5


def check_text_of(document: Any) -> None:
    """Refuse a document holding a string or key that UTF-8 cannot encode (a lone surrogate): every
    store and byte stream would fail on it later. ``InvalidInput`` names the first few such fields."""
    try:
        json.dumps(document, ensure_ascii=False, check_circular=False).encode()
        return
    except UnicodeEncodeError:
        pass
    message = "must be valid Unicode text: it holds a lone surrogate, which UTF-8 cannot encode"
    details = [FieldError(path, message) for path in _surrogate_paths(document)]
    raise InvalidInput(f"{details[0].field} {message}", details)


def _surrogate_paths(document: Any) -> list[str]:
    """The dotted paths (as pydantic names fields) of the first few strings or keys that UTF-8 cannot
    encode; a bad key is shown with its surrogates as ``\\u`` escapes, so the answer itself encodes."""
    found: list[str] = []
    stack: list[tuple[str, Any]] = [("", document)]
    while stack and len(found) < MAX_DETAILS:
        path, node = stack.pop()
        if isinstance(node, str):
            if not limits.is_utf8_text(node):
                found.append(path or "body")
        elif isinstance(node, dict):
            children = []
            for key, value in node.items():
                shown = key if limits.is_utf8_text(key) else key.encode("utf-8", "backslashreplace").decode()
                child = f"{path}.{shown}" if path else shown
                if shown is not key:
                    found.append(child)
                children.append((child, value))
            stack.extend(reversed(children))
        elif isinstance(node, list):
            stack.extend(reversed([(f"{path}.{i}" if path else str(i), v) for i, v in enumerate(node)]))
    return found[:MAX_DETAILS]


def check_depth_of(document: Any, raw: bytes | str) -> None:
    """Refuse a parsed document nesting deeper than :data:`MAX_JSON_DEPTH` (``InvalidInput``)."""
    if _nests_deeper_than(document, raw, MAX_JSON_DEPTH):
        raise _too_deep()


def _too_deep() -> InvalidInput:
    message = f"must nest at most {MAX_JSON_DEPTH} levels of arrays and objects"
    return InvalidInput(f"body {message}", [FieldError("body", message)])


def _nests_deeper_than(document: Any, raw: bytes | str, limit: int) -> bool:
    """Whether a parsed document has more than ``limit`` levels of containers, without recursion.

    Every container starts with a bracket, so a body with few brackets is shallow: only those with
    more (a batch, an attack) are walked, one level at a time.
    """
    brackets = (
        raw.count(b"[") + raw.count(b"{") if isinstance(raw, bytes) else raw.count("[") + raw.count("{")
    )
    if brackets <= limit:
        return False
    # json.loads makes exact dicts and lists: `type(x) is` is several times faster than isinstance.
    level = [document] if type(document) is dict or type(document) is list else []
    for _ in range(limit):
        inner: list[Any] = []
        for node in level:
            for child in node.values() if type(node) is dict else node:
                if type(child) is dict or type(child) is list:
                    inner.append(child)
        if not inner:
            return False
        level = inner
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f'{name} is not JSON; send non-finite metric values as the string "{name}"')
