"""Where a nudge of the watch goes (``shared.watch.nudges``, contract 8): ``WATCH_NUDGE`` names the watch
function (invoked asynchronously, as a nudge event) or ``file:PATH`` (``instantml local``: its schedule
reads the file). Unset or empty: nothing is nudged and the next scheduled round judges the run. A nudge
that fails is logged, never the request's failure: the record is stored either way."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from functions.api import logger
from shared.watch.nudges import NUDGE_ENV, Throttle, nudge_event

_throttle = Throttle()
_client: Any = None


def nudge(project: str, run_id: str) -> None:
    """Ask the watch to judge ``project``/``run_id`` now (at most every ``NUDGE_EVERY_S`` per run)."""
    global _client
    target = os.environ.get(NUDGE_ENV, "")
    if not target or not _throttle.due((project, run_id), time.monotonic()):
        return
    payload = json.dumps(nudge_event([(project, run_id)]), separators=(",", ":"))
    try:
        if target.startswith("file:"):
            fd = os.open(target.removeprefix("file:"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, payload.encode() + b"\n")  # one write: lines of two writers never mix
            finally:
                os.close(fd)
            return
        if _client is None:
            import boto3

            _client = boto3.client("lambda")
        _client.invoke(FunctionName=target, InvocationType="Event", Payload=payload.encode())
    except Exception as exc:  # noqa: BLE001 - the record is stored; the next round judges the run
        logger.warning("the watch was not nudged", extra={"run": f"{project}/{run_id}", "reason": str(exc)})
