"""Deliver function: POSTs the alerts the watch queued (an SQS queue on AWS) to their webhooks.

Every POST goes through the outgoing-request policy (``shared.watch.egress``, with the template's
``WebhookAllowedNetworks``). A failed POST is reported as that message's failure: SQS hands it back after
the queue's visibility timeout, up to its ``maxReceiveCount``, then moves it to the dead-letter queue
(``template.yaml``). A refused one is not retried: it is logged and the message is done. How each went
is noted on the project's alerts item, for ``GET .../alerts``. Webhook URLs are secrets: the log says
which project and delivery failed and why, never the URL.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.api import lazy_store
from shared.errors import StoreThrottled, StoreUnavailable
from shared.store.port import Delivery, LastDelivery
from shared.watch.egress import Policy
from shared.watch.webhooks import Outcome, send

logger = Logger()
store = lazy_store(lambda: {"alerts": os.environ["ALERTS_TABLE"]})


@logger.inject_lambda_context
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    failures = []
    policy = Policy.from_environment()
    for record in event.get("Records", []):
        try:
            document = json.loads(record["body"])
            delivery = Delivery(
                document["delivery_id"], document["project"], document["url"], document["payload"]
            )
        except (KeyError, TypeError, ValueError):
            logger.error("an unreadable alert was dropped", extra={"message_id": record.get("messageId")})
            continue
        outcome = send(delivery, policy)
        note(delivery, outcome)
        what = {"project": delivery.project, "delivery_id": delivery.delivery_id, "reason": outcome.reason}
        if outcome.state == "refused":
            logger.warning("alert refused by the outgoing-request policy; not retried", extra=what)
        elif outcome.state == "failing":
            logger.warning("alert not delivered; SQS retries it", extra=what)
            failures.append({"itemIdentifier": record["messageId"]})
    return {"batchItemFailures": failures}


def note(delivery: Delivery, outcome: Outcome) -> None:
    """Keep how the POST went for ``GET .../alerts``; a store that fails now only loses this note."""
    try:
        store().note_delivery(
            delivery.project, delivery.url, LastDelivery(outcome.state, outcome.reason, time.time())
        )
    except (StoreThrottled, StoreUnavailable) as exc:
        logger.warning("the delivery's outcome was not noted", extra={"reason": str(exc)})
