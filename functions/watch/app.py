"""Watch function: on a schedule (EventBridge ``rate(1 minute)``; ``instantml local`` runs it in the
background), one round of ``shared.watch.rounds`` over every live run: findings kept on each run's record,
alerts queued for delivery. Invoked by ingest with a nudge (``shared.watch.nudges``: a process's failed
end), a round over that run alone, at once."""

from __future__ import annotations

import os
from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.api import lazy_store, logger
from shared.store import PUBLIC_URL_ENV
from shared.watch.nudges import nudged_runs
from shared.watch.rounds import round_json, watch_round

ALERTS_TABLE_ENV = "ALERTS_TABLE"
ALERTS_QUEUE_ENV = "ALERTS_QUEUE_URL"
#: The schedule's interval in seconds (the template's rate; ``instantml local --watch-interval``).
WATCH_INTERVAL_ENV = "WATCH_INTERVAL_S"
store = lazy_store(lambda: {"alerts": os.environ[ALERTS_TABLE_ENV], "queue": os.environ[ALERTS_QUEUE_ENV]})


@logger.inject_lambda_context
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    # Half of the schedule's interval for summaries: a round ends well before the next begins.
    budget = float(os.environ[WATCH_INTERVAL_ENV]) / 2
    # A nudge (a process's failed end, from ingest) names its runs: a round over them alone, now.
    only = nudged_runs(event)
    report = watch_round(
        store(), base_url=os.environ.get(PUBLIC_URL_ENV) or None, summary_budget_s=budget, only=only
    )
    for failure in report.failed:
        logger.warning("a run was not watched this round", extra={"reason": failure})
    figures = round_json(report)
    logger.info("watch round", extra=figures)
    return figures
