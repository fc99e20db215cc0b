"""What every part of the store shares: the tables and the queue it was opened on, its clients (created on
first use, or injected), its clock and the retention of what it writes."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.store.dynamodb.layout.keys import RETENTION_ENV
from shared.store.dynamodb.sums_cache import SumsCache

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient
    from mypy_boto3_sqs import SQSClient

#: Concurrent conditional puts of one batch: 1,000 events at ~5 ms a put take ~0.3 s, not 5 s.
PUT_CONCURRENCY = 16


class DynamoBase:
    """The tables' names and clients; each port's part of ``DynamoStore`` builds on it."""

    def __init__(
        self,
        table_name: str | None = None,
        client: DynamoDBClient | None = None,
        runs_table: str | None = None,
        alerts_table: str | None = None,
        alerts_queue: str | None = None,
        clock: Callable[[], float] = time.time,
        sqs: SQSClient | None = None,
        retention_days: float | None = None,
    ) -> None:
        """``clock`` is the server's: when a run's events are received (tests set it). ``retention_days``
        (default: ``RETENTION_DAYS``, else 0): events, scalars and run records written carry ``expires``,
        that long after they were written; 0 keeps them."""
        self.table_name = table_name or os.environ["METRICS_TABLE"]
        if retention_days is None:
            retention_days = float(os.environ.get(RETENTION_ENV) or 0)
        self.retention_s = max(0.0, retention_days) * 86400
        self._alerts_table, self._alerts_queue = alerts_table, alerts_queue
        self.clock = clock
        self._client = client
        self._sqs = sqs
        # Read when first used: a function that keeps no run records (the rollup) has no RUNS_TABLE.
        self._runs_table = runs_table
        #: Each run's ``last_event`` as this store last saw it recorded: it only grows, so this spares
        #: writes that cannot apply, never needed ones.
        self._recorded_times: dict[tuple[str, str], float] = {}
        self._sums = SumsCache()

    @property
    def runs_table(self) -> str:
        name = self._runs_table or os.environ.get("RUNS_TABLE")
        if not name:
            raise RuntimeError("no runs table: pass runs_table or set RUNS_TABLE")
        return name

    @property
    def alerts_table(self) -> str:
        if not self._alerts_table:  # the store URL's ``alerts`` (only the functions that use it name it)
            raise RuntimeError("no alerts table: the store URL names none (dynamodb://T?alerts=...)")
        return self._alerts_table

    @property
    def alerts_queue(self) -> str:
        if not self._alerts_queue:
            raise RuntimeError("no alerts queue: the store URL names none (dynamodb://T?queue=...)")
        return self._alerts_queue

    @property
    def sqs(self) -> SQSClient:
        if self._sqs is None:
            import boto3
            from botocore.config import Config

            config = Config(
                connect_timeout=2, read_timeout=5, retries={"mode": "standard", "max_attempts": 3}
            )
            self._sqs = boto3.client("sqs", config=config)
        return self._sqs

    @property
    def client(self) -> DynamoDBClient:
        if self._client is None:
            import boto3
            from botocore.config import Config

            # Short timeouts and few attempts: a slow store becomes a 503 the client retries, never a
            # function timeout. One connection per concurrent put.
            config = Config(
                connect_timeout=2,
                read_timeout=5,
                retries={"mode": "standard", "max_attempts": 3},
                max_pool_connections=PUT_CONCURRENCY,
            )
            self._client = boto3.client("dynamodb", config=config)
        return self._client

    def _expires(self) -> int | None:
        """``expires`` of what is written now (None: kept)."""
        return int(self.clock() + self.retention_s) if self.retention_s else None
