"""The tables' and the alerts queue's failures as the store's: ``StoreThrottled`` (429) or
``StoreUnavailable`` (503), which the client retries."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from shared.errors import StoreThrottled, StoreUnavailable

if TYPE_CHECKING:
    from botocore.exceptions import ClientError

THROTTLED = {
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestThrottled",  # SQS
    "AWS.SimpleQueueService.RequestThrottled",
}
_UNAVAILABLE = {"InternalServerError", "ServiceUnavailable", "TransactionInProgressException"}


@contextmanager
def store_errors(doing: str) -> Iterator[None]:
    """Calls that the table throttles, fails or does not answer become ``StoreThrottled`` (429) or
    ``StoreUnavailable`` (503): every write here is idempotent and every read repeatable, so the
    client's retry is always safe (for a put that timed out, whether or not it happened)."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    try:
        yield
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in THROTTLED:
            raise StoreThrottled(f"the metrics table is throttling {doing} ({code}); retry shortly") from None
        if code in _UNAVAILABLE:
            raise StoreUnavailable(f"the metrics table is failing ({code}); retry shortly") from None
        raise
    except (BotoConnectionError, HTTPClientError) as exc:
        raise StoreUnavailable(
            f"the metrics table did not answer ({type(exc).__name__}); retry shortly"
        ) from None


@contextmanager
def queue_errors() -> Iterator[None]:
    """The alerts queue's failures as the store's: throttling ``StoreThrottled``, anything else
    (an error answer, no answer) ``StoreUnavailable``. The watch retries the run next round."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in THROTTLED:
            raise StoreThrottled(f"the alerts queue is throttling ({code}); retry shortly") from None
        raise StoreUnavailable(f"the alerts queue failed ({code}); retry shortly") from None
    except BotoCoreError as exc:
        raise StoreUnavailable(f"the alerts queue did not answer ({type(exc).__name__})") from None


def condition_failed(exc: ClientError) -> bool:
    """Whether a conditional write was refused because its condition failed (nothing else went wrong)."""
    return exc.response.get("Error", {}).get("Code") == "ConditionalCheckFailedException"
