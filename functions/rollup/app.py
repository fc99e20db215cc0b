"""Rollup function: the metrics table's stream in, the levels of rollups out (``shared.summary.rolling``).

Triggered with batches of the stream's records (keys only). A failure raises, and Lambda retries the
batch: rolling up is idempotent (a rollup is recomputed from the stored events and written only if it
read at least as many). Each call logs what it rolled up, per run.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from aws_lambda_powertools.utilities.data_classes import DynamoDBStreamEvent, event_source
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.api import lazy_store, logger
from shared.store.dynamodb import PARTITION_KEY, SORT_KEY, event_of_key
from shared.summary.rolling import roll_up, touched_steps

store = lazy_store()
#: Start no block after this share of the time left; what is left waits for the next call.
TIME_SHARE = 0.9


@logger.inject_lambda_context
@event_source(data_class=DynamoDBStreamEvent)
def lambda_handler(event: DynamoDBStreamEvent, context: LambdaContext) -> dict[str, Any]:
    changes, n_records = [], 0
    for record in event.records:
        n_records += 1
        item_keys = record.dynamodb.keys if record.dynamodb else None
        change = event_of_key(str(item_keys[PARTITION_KEY]), str(item_keys[SORT_KEY])) if item_keys else None
        if change is not None:  # an event's item, not a rollup's
            changes.append(change)
    deadline = time.monotonic() + TIME_SHARE * context.get_remaining_time_in_millis() / 1000
    runs = []
    for (project, run_id), steps in sorted(touched_steps(changes).items()):
        rolled = roll_up(store(), project, run_id, steps, deadline)
        runs.append({"project": project, "run_id": run_id, **asdict(rolled)})
        logger.info("rolled up", extra=runs[-1])
        if rolled.left:  # the batch is retried (rolling up is idempotent) and goes on from the mark
            raise TimeoutError(f"rolling up {project}/{run_id} ran out of time with {rolled.left} steps left")
    return {"records": n_records, "runs": runs}
