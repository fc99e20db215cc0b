"""Deliver function: POSTs the alerts the watch queued (an SQS queue on AWS) to their webhooks.

A failed POST is reported as that message's failure: SQS hands it back after the queue's visibility
timeout, up to its ``maxReceiveCount``, then moves it to the dead-letter queue (``template.yaml``).
Webhook URLs are secrets: the log says which project and delivery failed and why, never the URL.
"""

from __future__ import annotations

import json
from typing import Any

from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.typing import LambdaContext

from shared.store.port import Delivery
from shared.webhooks import send

logger = Logger()


@logger.inject_lambda_context
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    failures = []
    for record in event.get("Records", []):
        try:
            document = json.loads(record["body"])
            delivery = Delivery(
                document["delivery_id"], document["project"], document["url"], document["payload"]
            )
        except (KeyError, TypeError, ValueError):
            logger.error("an unreadable alert was dropped", extra={"message_id": record.get("messageId")})
            continue
        error = send(delivery)
        if error is not None:
            logger.warning(
                "alert not delivered; SQS retries it",
                extra={"project": delivery.project, "delivery_id": delivery.delivery_id, "reason": error},
            )
            failures.append({"itemIdentifier": record["messageId"]})
    return {"batchItemFailures": failures}
