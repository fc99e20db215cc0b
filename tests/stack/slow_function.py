"""A function whose invocation says it started (a file named by its event) and then runs for minutes:
a watch round on a starved machine, for the stop tests."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def lambda_handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    Path(event["started"]).write_text("started")
    time.sleep(600)
    return {}
