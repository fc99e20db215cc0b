"""The local stack: the deployed API on this machine, wired from ``template.yaml`` (through ``wiring.json``).

HTTP requests on 127.0.0.1 become API Gateway HTTP API (payload 2.0) events for the same handlers the
template deploys, behind the same authorizer. Each function runs in worker processes of its own, one
invocation at a time per process as in a Lambda environment, so requests are served concurrently and a
long summary never holds up ingest.

The store is SQLite in the data directory (``shared.store.sqlite``; default ``.instantml/local``),
locked by the running stack, durable across restarts and crashes; a rollup worker follows its change
feed as the rollup function follows the table's stream on AWS. With ``dynamodb_endpoint`` the same
functions use DynamoDB there instead (DynamoDB Local, or AWS), the template's tables are created when
missing, and the table's stream is polled as Lambda's event source mapping does (records delivered as
soon as they are read, without ``MaximumBatchingWindowInSeconds``). Nothing here knows a route, a table
key or a trigger of its own.

The package's rooms: ``events`` (what AWS hands a function), ``server`` (the HTTP front), ``workers``
(one process per function invocation at a time), ``triggers`` (the change feed, stream, schedule and
alerts delivery), ``stack`` (all of it started and stopped as one) and ``cli`` (``instantml local``).
"""

from infra.local.cli import compare_url, main, run_url, runs_url, stored_projects, view_url
from infra.local.events import (
    ARN_PREFIX,
    LambdaContext,
    http_api_event,
    lambda_records,
    load_handler,
    scheduled_event,
)
from infra.local.server import LISTEN_BACKLOG, MAX_HEAD_BYTES, MAX_REQUEST_BYTES, listen_backlog
from infra.local.stack import (
    DATABASE_FILE,
    DEFAULT_DATA_DIR,
    WATCH_INTERVAL_S,
    DataDirInUse,
    LocalStack,
    StackError,
    database_path,
)
from infra.local.triggers import streams_client
from infra.local.workers import FunctionWorkers

__all__ = [
    "ARN_PREFIX",
    "DATABASE_FILE",
    "DEFAULT_DATA_DIR",
    "LISTEN_BACKLOG",
    "MAX_HEAD_BYTES",
    "MAX_REQUEST_BYTES",
    "WATCH_INTERVAL_S",
    "DataDirInUse",
    "FunctionWorkers",
    "LambdaContext",
    "LocalStack",
    "StackError",
    "compare_url",
    "database_path",
    "http_api_event",
    "lambda_records",
    "listen_backlog",
    "load_handler",
    "main",
    "run_url",
    "runs_url",
    "scheduled_event",
    "stored_projects",
    "streams_client",
    "view_url",
]
