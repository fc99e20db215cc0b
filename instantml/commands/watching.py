"""``instantml check`` and ``instantml alerts`` (contract 7): the watch's answers from the shell.

``check`` is a gate for CI and for scripts that launch jobs: it prints a run's findings and exits 1 when
one reaches ``--fail-on`` (default ``warning``), 0 otherwise, 2 on a usage or connection error.
``alerts`` sets, lists or clears a project's webhooks.
"""

from __future__ import annotations

import os
import sys
from typing import Any
from urllib.parse import quote

from instantml import routes, settings
from instantml.limits import is_valid_name
from instantml.upload.transport import Refused, Transient, request

SEVERITIES = ("info", "warning", "critical")
EXIT_OK, EXIT_FOUND, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A mistake in the command line or its setting (exit 2)."""


def _connection(api_url: str | None, api_key: str | None) -> tuple[str, str]:
    url = api_url or os.environ.get(settings.API_URL_ENV)
    key = api_key or os.environ.get(settings.API_KEY_ENV)
    if not url:
        raise UsageError(f"no API URL: pass --api-url or set {settings.API_URL_ENV}")
    if not key:
        raise UsageError(f"no API token: pass --api-key or set {settings.API_KEY_ENV}")
    return url.rstrip("/"), key


def _path(route: str, **names: str) -> str:
    for name, value in names.items():
        if not is_valid_name(value):
            raise UsageError(f"{name} {value!r} is not a valid name (letters, digits, '.', '_', '-')")
    return route.format(**{k: quote(v, safe="") for k, v in names.items()})


def _call(method: str, url: str, key: str, document: Any = None) -> Any:
    try:
        return request(method, url, key, document)
    except Refused as exc:
        raise UsageError(f"the server refused {method} {url}: {exc.error.get('message', exc)}") from None
    except Transient as exc:
        raise UsageError(f"could not reach {url}: {exc}") from None


def _watched_findings(record: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The findings the watch kept for a run, when it has seen everything the server received."""
    watch = record.get("watch")
    if not isinstance(watch, dict) or not watch.get("up_to_date"):
        return None
    found = watch.get("findings")
    return found if isinstance(found, list) else None


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-2, 5``: consecutive ranks as spans.

    >>> _ranks([5]), _ranks([0, 1, 2, 5, 7, 8])
    ('rank 5', 'ranks 0-2, 5, 7-8')
    """
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _process_state(row: dict[str, Any]) -> str:
    """What one process says, in a few words: ``ended: exception RuntimeError at train.py:40 forward``
    (the message apart: peers' messages differ by address, and a group is one line)."""
    state = str(row.get("state", "?"))
    if state == "ended":
        how = str(row.get("how") or "?")
        if how == "exception" and isinstance(row.get("exception"), dict):
            exc = row["exception"]
            where = f" at {exc['where']}" if exc.get("where") else ""
            return f"ended: exception {exc.get('type')}{where}"
        if how == "signal":
            return f"ended: signal {row.get('signal')}"
        if how == "exit":
            return f"ended: exit {'code ' + str(row['code']) if row.get('code') is not None else ''}".rstrip()
        return f"ended: {how}"
    if state == "vanished":  # (of an earlier attempt: the job started again without it)
        return f"vanished (attempt {row.get('attempt', 0)}; the job went on without it)"
    if state == "silent" and row.get("stack"):
        return f"silent, in {row['stack'][-1]}"
    return state


#: Groups of processes printed by ``instantml check``; the rest are counted.
MAX_PROCESS_LINES = 8
MESSAGE_CHARS = 100


def process_lines(record: dict[str, Any]) -> list[str]:
    """A run's processes (contract 8) grouped by what they say, each group's ranks as spans, a line per
    group whatever the world: silent ones first (a hang), then the ended in the order they ended (the one
    that went first on top), then the running. A process alone in its group says its message too."""
    rows = [
        r for r in record.get("processes") or [] if isinstance(r, dict) and isinstance(r.get("rank"), int)
    ]
    if not rows:
        return []
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(_process_state(row), []).append(row)

    def order(members: list[dict[str, Any]]) -> tuple[int, float]:
        state = members[0].get("state")
        if state == "ended":
            return 1, min(float(m.get("ended") or 0.0) for m in members)
        return (0 if state == "silent" else 2), 0.0

    lines = []
    for what, members in sorted(groups.items(), key=lambda group: order(group[1])):
        exc = members[0].get("exception")
        if len(members) == 1 and isinstance(exc, dict) and exc.get("message"):
            message = str(exc["message"])
            if len(message) > MESSAGE_CHARS:
                message = message[: MESSAGE_CHARS - 3] + "..."
            what += f": {message}"
        lines.append(f"  {_ranks([m['rank'] for m in members])}: {what}")
    if len(lines) > MAX_PROCESS_LINES:
        lines[MAX_PROCESS_LINES:] = [f"  ... and {len(lines) - MAX_PROCESS_LINES} more group(s)"]
    restarted = sum(1 for row in rows if row.get("restarts"))
    return [f"processes ({len(rows)}{f', {restarted} restarted' if restarted else ''}):", *lines]


def _record(base: str, key: str, project: str, run_id: str) -> dict[str, Any]:
    record = _call("GET", base + _path(routes.RUN, project=project, run_id=run_id), key)
    return record if isinstance(record, dict) else {}


def run_findings(
    base: str, key: str, project: str, run_id: str, record: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], str]:
    """A run's findings and where they came from: the watch's (wall-clock ones included) when it has
    seen the run's latest events, else a fresh summary's plus the watch's wall-clock rows."""
    record = _record(base, key, project, run_id) if record is None else record
    watched = _watched_findings(record)
    if watched is not None:
        return watched, "the watch"
    try:
        summary = request("GET", base + _path(routes.DISTRIBUTED, project=project, run_id=run_id), key)
        found = [f for f in summary.get("findings", []) if f.get("kind") != "partial"]
    except Refused as exc:
        if exc.status != 404:
            raise UsageError(f"the server refused the summary: {exc.error.get('message', exc)}") from None
        found = []  # a run with run.log scalars only has no rank events to summarize
    except Transient as exc:
        raise UsageError(f"could not reach {base}: {exc}") from None
    watch = record.get("watch")
    kept = watch.get("findings", []) if isinstance(watch, dict) else []
    clock = [f for f in kept if f.get("kind") == "stalled"]
    return found + clock, "a fresh summary"


def check(
    project: str, run_id: str, fail_on: str, api_url: str | None, api_key: str | None, out: Any = None
) -> int:
    out = sys.stdout if out is None else out
    if fail_on not in SEVERITIES:
        raise UsageError(f"--fail-on must be one of {', '.join(SEVERITIES)}, got {fail_on!r}")
    base, key = _connection(api_url, api_key)
    record = _record(base, key, project, run_id)
    findings, source = run_findings(base, key, project, run_id, record)
    order = {name: i for i, name in enumerate(SEVERITIES)}
    findings = sorted(findings, key=lambda f: -order.get(f.get("severity", "info"), 0))
    for finding in findings:
        where = " ".join(
            part
            for part in (
                f"rank {finding['rank']}" if finding.get("rank") is not None else "",
                str(finding.get("key") or ""),
            )
            if part
        )
        tag = f"{finding.get('kind')}{' · ' + where if where else ''}"
        print(f"{finding.get('severity', '?').upper():8} {tag}: {finding.get('message')}", file=out)
    counts = {name: sum(f.get("severity") == name for f in findings) for name in reversed(SEVERITIES)}
    failing = [f for f in findings if order.get(f.get("severity", "info"), 0) >= order[fail_on]]
    described = ", ".join(f"{n} {name}" for name, n in counts.items())
    verdict = (
        f"FAIL: {len(failing)} at or above {fail_on}" if failing else f"OK: nothing at or above {fail_on}"
    )
    for line in process_lines(record):
        print(line, file=out)
    print(f"{project}/{run_id}: {described} (from {source}). {verdict}", file=out)
    return EXIT_FOUND if failing else EXIT_OK


def alerts(
    project: str,
    webhooks: list[str],
    min_severity: str,
    listing: bool,
    clear: bool,
    api_url: str | None,
    api_key: str | None,
    out: Any = None,
) -> int:
    out = sys.stdout if out is None else out
    chosen = sum([bool(webhooks), listing, clear])
    if chosen != 1:
        raise UsageError("give one of --webhook URL (repeatable), --list or --clear")
    base, key = _connection(api_url, api_key)
    url = base + _path(routes.ALERTS, project=project)
    if clear:
        _call("DELETE", url, key)
        print(f"{project}: no webhooks; the watch sends no alerts", file=out)
        return EXIT_OK
    if webhooks:
        document = {"webhooks": [{"url": hook, "min_severity": min_severity} for hook in webhooks]}
        answer = _call("PUT", url, key, document)
    else:
        answer = _call("GET", url, key)
    hooks = answer.get("webhooks", [])
    if not hooks:
        print(
            f"{project}: no webhooks; set one with: instantml alerts --project {project} --webhook URL",
            file=out,
        )
    for hook in hooks:
        last = hook.get("last_delivery")
        said = ""
        if isinstance(last, dict) and "state" in last:  # a server before last deliveries gives none
            said = f"; last delivery {last['state']}" + (f": {last['reason']}" if last.get("reason") else "")
        print(f"{project}: {hook['url']} (from {hook['min_severity']} up{said})", file=out)
    return EXIT_OK


def add_connection_arguments(parser: Any) -> None:
    parser.add_argument("--api-url", help=f"default: {settings.API_URL_ENV}")
    parser.add_argument("--api-key", help=f"default: {settings.API_KEY_ENV}")


def command(args: Any) -> int:
    try:
        if args.command == "check":
            return check(args.project, args.run_id, args.fail_on, args.api_url, args.api_key)
        return alerts(
            args.project,
            args.webhook or [],
            args.min_severity,
            args.list,
            args.clear,
            args.api_url,
            args.api_key,
        )
    except UsageError as exc:
        print(f"instantml {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
