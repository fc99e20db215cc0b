"""Where a nudge of the watch goes (``shared.watch.nudges``, contract 8): ``WATCH_NUDGE`` names the
EventBridge bus whose rule runs the watch over the run, or ``file:PATH`` (``instantml local``: its
schedule reads the file). Unset or empty: nothing is nudged and the next scheduled round judges the
run. A nudge that fails is logged, never the request's failure: the record is stored either way."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from functions.api import logger
from shared.watch.nudges import DETAIL_TYPE, NUDGE_ENV, SOURCE, Throttle, nudge_detail, nudge_event

_throttle = Throttle()
_client: Any = None


def nudge(project: str, run_id: str) -> None:
    """Ask the watch to judge ``project``/``run_id`` now (at most every ``NUDGE_EVERY_S`` per run)."""
    global _client
    target = os.environ.get(NUDGE_ENV, "")
    if not target or not _throttle.due((project, run_id), time.monotonic()):
        return
    runs = [(project, run_id)]
    try:
        if target.startswith("file:"):
            line = json.dumps(nudge_event(runs), separators=(",", ":")).encode() + b"\n"
            fd = os.open(target.removeprefix("file:"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line)  # one write: lines of two writers never mix
            finally:
                os.close(fd)
            return
        if _client is None:
            import boto3
            from botocore.config import Config

            # A nudge is a nicety beside the stored record: it never holds the request up for long.
            quick = Config(connect_timeout=1, read_timeout=2, retries={"max_attempts": 2, "mode": "standard"})
            _client = boto3.client("events", config=quick)
        entry = {
            "Source": SOURCE,
            "DetailType": DETAIL_TYPE,
            "Detail": json.dumps(nudge_detail(runs), separators=(",", ":")),
            "EventBusName": target,
        }
        answer = _client.put_events(Entries=[entry])
        if answer.get("FailedEntryCount"):
            raise RuntimeError(str(answer.get("Entries")))
    except Exception as exc:  # noqa: BLE001 - the record is stored; the next round judges the run
        logger.warning("the watch was not nudged", extra={"run": f"{project}/{run_id}", "reason": str(exc)})
