"""The errors the logic raises, each with the contract's machine code (3.2), and the check of a path's
names: what every function's HTTP edge needs, without pydantic (``shared.ingest.bodies`` builds the bodies'
validation; a function imports it only when it validates a body)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from instantml import limits


@dataclass(frozen=True, slots=True)
class FieldError:
    field: str
    message: str


class DomainError(Exception):
    """Base of the errors the logic raises; ``code`` is the contract's machine code (3.2)."""

    code = "invalid_request"

    def __init__(self, message: str, details: list[FieldError] | None = None) -> None:
        super().__init__(message)
        self.details = details or []

    def error_object(self) -> dict[str, Any]:
        """The contract's ``error`` object: code, one sentence, and the fields at fault."""
        error: dict[str, Any] = {"code": self.code, "message": str(self)}
        if self.details:
            error["details"] = [{"field": d.field, "message": d.message} for d in self.details]
        return error


class InvalidInput(DomainError):
    """The request is outside the contract (3.4); ``details`` name the fields at fault."""


class NotFound(DomainError):
    """There is nothing at this path (for example a run with no events)."""

    code = "not_found"


class PayloadTooLarge(DomainError):
    """A body is larger than the contract allows."""

    code = "payload_too_large"


class EventIdReused(DomainError):
    """The event id is stored with a different payload."""

    code = "idempotency_key_reused"


class StoreUnavailable(DomainError):
    """The store is failing or timing out; the client should retry after ``retry_after`` s.

    Every write is a conditional put, so a retry of the whole request is always safe: what was
    stored before the failure answers ``duplicate`` the second time.
    """

    code = "unavailable"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StoreThrottled(StoreUnavailable):
    """The store is throttling writes: ``429 rate_limited`` with ``Retry-After``."""

    code = "rate_limited"

    def __init__(self, message: str, retry_after: int = 2) -> None:
        super().__init__(message, retry_after)


def check_path(project: str, run_id: str | None) -> None:
    """The names in a path (``run_id`` None: a project's route, such as its runs)."""
    details = [
        FieldError(
            name, f"must be 1-{limits.MAX_NAME_LENGTH} of A-Z a-z 0-9 . _ - starting with a letter or digit"
        )
        for name, value in (("project", project), ("run_id", run_id))
        if not limits.is_valid_name(value) and not (name == "run_id" and value is None)
    ]
    if details:
        raise InvalidInput(f"{details[0].field} {details[0].message}", details)


#: On every answer of the API, page or JSON, from a function or the local stack itself: never sniffed
#: into another type, and no Referer leaves a page (its fragment holds the token, its path the run).
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
