"""The template's wiring as the local stack runs it: routes, handlers, environment, tables, triggers.

``wiring.json`` beside this module is generated from ``template.yaml`` by ``python -m infra.template``
and a test fails when it is out of date (as for ``openapi.json``). The running stack reads this file,
not the YAML: an installed ``instantml[server]`` has no checkout and no template, and needs no YAML
parser. The template stays the one source of truth; this is its compiled form.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

#: The server's code root, as the template's ``CodeUri: .`` deploys it (``functions``, ``shared``,
#: ``infra`` and ``instantml``): a checkout, or the copy an installed wheel carries.
ROOT = Path(__file__).resolve().parent.parent
WIRING = Path(__file__).with_name("wiring.json")


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    function: str  # logical id of the function
    handler: str  # "package.module.function"
    authorizer: str | None = None  # logical id of the Lambda authorizer's function, None for no auth


@dataclass(frozen=True)
class StreamSource:
    """A function triggered by a table's stream (a ``DynamoDB`` event of the template)."""

    function: str  # logical id of the function
    table: str  # logical id of the table
    batch_size: int
    starting_position: str
    filters: list[dict[str, Any]]  # the event filter patterns, parsed


@dataclass(frozen=True)
class ScheduleSource:
    """A function run on a schedule (a ``Schedule`` event of the template: EventBridge)."""

    function: str  # logical id of the function
    expression: str  # "rate(1 minute)"
    every_s: float


@cache
def load(path: Path = WIRING) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    return document


def functions() -> dict[str, dict[str, Any]]:
    """Each function's settings by logical id (``Handler``, ``Timeout``, ``MemorySize``, ``Environment``),
    with the template's ``Globals`` merged in."""
    result: dict[str, dict[str, Any]] = load()["functions"]
    return result


def routes() -> list[Route]:
    return [Route(**route) for route in load()["routes"]]


def stream_sources() -> list[StreamSource]:
    return [StreamSource(**source) for source in load()["stream_sources"]]


def schedule_sources() -> list[ScheduleSource]:
    return [ScheduleSource(**source) for source in load().get("schedule_sources", [])]


def tables() -> list[str]:
    """The logical ids of the template's DynamoDB tables."""
    return list(load()["tables"])


def queues() -> list[str]:
    """The logical ids of the template's SQS queues (the alerts' on AWS; none runs locally)."""
    return list(load().get("queues", []))


def table_definition(logical_id: str) -> dict[str, Any]:
    """``create_table`` arguments for a table, from its template properties."""
    definition: dict[str, Any] = load()["tables"][logical_id]
    return definition


def resolve(value: Any, refs: dict[str, str]) -> str:
    """A template value with ``Ref``s replaced from ``refs`` (logical id or parameter -> value)."""
    if isinstance(value, dict) and "Ref" in value:
        return refs[value["Ref"]]
    if isinstance(value, dict) and "Fn::Sub" in value and isinstance(value["Fn::Sub"], str):
        # Names the local stack has no value for stay as they are (it sets what it serves itself).
        return re.sub(r"\$\{([^}]+)\}", lambda m: refs.get(m.group(1), m.group(0)), value["Fn::Sub"])
    if isinstance(value, dict):
        raise ValueError(f"cannot resolve {value!r} locally; add it to the local stack's refs")
    return str(value)


def environment(function: str, refs: dict[str, str]) -> dict[str, str]:
    """As ``infra.template.environment``: a ``Ref`` to an event bus is empty unless ``refs`` names it."""
    variables = functions()[function]["Environment"]["Variables"]
    refs = {**dict.fromkeys(load().get("buses", []), ""), **refs}
    return {name: resolve(value, refs) for name, value in variables.items()}
