"""The local stack: the template's routes, functions and triggers on loopback, over the SQLite store in
a data directory (or a DynamoDB endpoint), started and stopped as one."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from infra import wiring
from infra.local.events import Handler, load_module
from infra.local.server import IDLE_TIMEOUT_S, REQUEST_READ_TIMEOUT_S, RequestHandler, Router, Server
from infra.local.triggers import Schedule, StreamPoller, deliver_alerts, dynamodb_client, roll_up_feed
from infra.local.workers import BACKGROUND_STOP_S, FunctionWorkers, signals_held

DEFAULT_DATA_DIR = ".instantml/local"
DATABASE_FILE = "instantml.db"
#: Worker processes per function: ingest and summaries each have their own, so neither waits for the
#: other; two of each keep both cores busy under load.
WORKERS = {"IngestFunction": 2, "SummarizeFunction": 2}
DEFAULT_WORKERS = 1
#: The change feed that rolls up the local database's blocks, as the stream does on AWS.


#: How often ``instantml local`` runs the watch (the template's schedule says once a minute; locally a
#: shorter round costs little and finds a stopped rank sooner). ``--watch-interval`` sets it.
WATCH_INTERVAL_S = 10.0
#: How often the delivery worker looks for alerts due (a new alert waits at most this long).


#: The watch's worker runs at this lower CPU priority (``os.nice``), so that a round never holds up ingest.
WATCH_NICE = 10


#: How long the integrity check at start may take before the stack serves (the rest runs behind).
INTEGRITY_BUDGET_S = 1.0


def damaged(path: Path, problem: str) -> str:
    """What a person reads about a damaged database, and what to do."""
    near = [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm")]
    files = " ".join(str(f) for f in (path, *near) if f.exists())
    return (
        f"the database {path} is damaged: {problem}. Stop every `instantml local` on "
        f"{path.parent}, then either move the damaged files aside (e.g. `mkdir {path.parent}/damaged && mv "
        f"{files} {path.parent}/damaged/`) to start with an empty database there, restore the file from a "
        "backup, or start with another --data-dir."
    )


#: The CPU priority (``nice``) of the integrity check that goes on behind a serving stack: it reads the
#: whole file (about 10 s of a core for 3 GB), and must not slow the requests it runs beside.
CHECK_NICE = 19


def check_in_background(path: Path) -> None:
    from shared.store.sqlite import check_database

    with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's own priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CHECK_NICE)
    problem, _ = check_database(path, 24 * 3600.0)
    if problem is not None:
        print(f"instantml local: {damaged(path, problem)}", file=sys.stderr, flush=True)


class StackError(RuntimeError):
    """The stack cannot start; the message names what (a path, a port) and what to do about it."""


class DataDirInUse(StackError):
    """Another stack serves this data directory."""


def database_path(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / DATABASE_FILE


def raise_open_files_limit() -> None:
    """A connection is a file descriptor: lift the soft limit (often 1,024) to the hard one, so that
    thousands of uploaders' connections are accepted rather than refused for want of descriptors."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


class LocalStack:
    """The template's routes and functions on loopback, over the SQLite store in ``data_dir`` (or over
    a DynamoDB endpoint with ``dynamodb_endpoint``)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8787,
        token: str | None = None,
        data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR,
        dynamodb_endpoint: str | None = None,
        environment: dict[str, str] | None = None,
        watch_interval: float | None = None,
        request_timeout_s: float = REQUEST_READ_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        """``environment`` adds variables to every function's (as a deployment's parameters would);
        ``watch_interval`` is how often scheduled functions run (default ``WATCH_INTERVAL_S``);
        ``request_timeout_s`` bounds the reading of one request, ``idle_timeout_s`` a kept-alive
        connection's wait for the next."""
        self.watch_interval = WATCH_INTERVAL_S if watch_interval is None else watch_interval
        self.host, self.port = host, port
        self._timeouts = {"request_timeout_s": request_timeout_s, "idle_timeout_s": idle_timeout_s}
        self.notes: list[str] = []  # what a person should know about the data found at start
        self.data_dir = Path(data_dir).resolve()
        self.dynamodb_endpoint = dynamodb_endpoint
        self._token = token
        self._extra_environment = environment or {}
        self._lock_file: Any = None
        self._server: ThreadingHTTPServer | None = None
        self._workers: dict[str, FunctionWorkers] = {}
        self._feed: Any = None
        self._feed_stop: Any = None
        self._deliver: Any = None
        self.pollers: list[StreamPoller] = []
        self.schedules: list[Schedule] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def token(self) -> str:
        assert self._token is not None, "the stack is not started"
        return self._token

    @property
    def store_url(self) -> str:
        from shared.store import sqlite_url

        return sqlite_url(database_path(self.data_dir))

    def store(self) -> Any:
        """A store on this stack's data (for tests and tools in this process)."""
        from shared.store import open_store

        if self.dynamodb_endpoint:
            from shared.store.dynamodb import DynamoStore

            return DynamoStore("MetricsTable", dynamodb_client(self.dynamodb_endpoint), "RunsTable")
        return open_store(self.store_url)

    def start(self) -> LocalStack:
        try:
            with signals_held():
                return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> LocalStack:
        environment = self._environment()  # the functions' (this process's own is left alone)
        tokens = self._open_tokens()
        if self._token is None:
            self._token = self._saved_token()
        from shared.tokens import ANY_PROJECT, token_hash

        if tokens.lookup_hash(token_hash(self._token)) is None:
            # The one token this stack prints grants every project (contract 2: `instantml local`).
            tokens.create(ANY_PROJECT, "instantml local", token=self._token)
        functions = wiring.functions()
        routes = wiring.routes()
        # Bound before any worker starts, so that a port in use is said at once. The router reaches the
        # authorizers and workers made below through these same dicts.
        authorizers: dict[str, Handler] = {}
        router = Router(routes, authorizers, self._workers)
        handler = type("Handler", (RequestHandler,), {"router": router, **self._timeouts})
        self._server = self._bind(handler)
        self.port = self._server.server_address[1]
        for name in sorted({r.function for r in routes}):
            self._workers[name] = FunctionWorkers(
                name, functions[name], environment, WORKERS.get(name, DEFAULT_WORKERS)
            )
        # The authorizer runs here, in the request's thread (a cached lookup), on this stack's tokens.
        for name in {r.authorizer for r in routes if r.authorizer}:
            module = load_module(functions[name]["Handler"], fresh=True)
            module.use_token_store(tokens)
            authorizers[name] = module.lambda_handler
        if self.dynamodb_endpoint:
            for source in wiring.stream_sources():
                workers = FunctionWorkers(source.function, functions[source.function], environment, 1)
                self._workers[source.function] = workers
                poller = StreamPoller(source, source.table, workers, self.dynamodb_endpoint)
                poller.start()
                self.pollers.append(poller)
        else:
            import multiprocessing

            context = multiprocessing.get_context("spawn")
            self._feed_stop = context.Event()
            self._feed = context.Process(
                target=roll_up_feed,
                args=(str(database_path(self.data_dir)), environment, self._feed_stop, os.getpid()),
                name="instantml-rollups",
                daemon=True,
            )
            self._feed.start()
            self._deliver = context.Process(
                target=deliver_alerts,
                args=(
                    str(database_path(self.data_dir)),
                    environment["WEBHOOK_ALLOWED_NETWORKS"],  # (set by _environment)
                    self._feed_stop,
                    os.getpid(),
                ),
                name="instantml-alerts",
                daemon=True,
            )
            self._deliver.start()
            # The watch's alerts wait in the SQLite outbox (an SQS queue on AWS).
            from shared.store import PUBLIC_URL_ENV

            scheduled = {
                **environment,
                PUBLIC_URL_ENV: self.url,
                "WATCH_INTERVAL_S": f"{self.watch_interval:g}",
            }
            scheduled.update(self._extra_environment)  # what the caller sets wins, as for every function
            for timed in wiring.schedule_sources():
                # A round is background work: on a busy machine, ingest and summaries go first.
                workers = FunctionWorkers(timed.function, functions[timed.function], scheduled, 1, WATCH_NICE)
                self._workers[timed.function] = workers
                schedule = Schedule(timed, workers, self.watch_interval, self.nudge_file)
                schedule.start()
                self.schedules.append(schedule)
        threading.Thread(target=self._server.serve_forever, daemon=True, name="http").start()
        return self

    def _bind(self, handler: type[RequestHandler]) -> Server:
        """The listening socket on ``host:port``, or a ``StackError`` that says what to do."""
        import errno

        raise_open_files_limit()
        where = f"{self.host}:{self.port}"
        try:
            return Server((self.host, self.port), handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                why = f"port {self.port} on {self.host} is in use by another program"
                fix = "stop that program, or pass another --port (--port 0 picks a free one)"
            elif exc.errno == errno.EACCES:
                why = f"this user may not listen on {where} (ports below 1024 need privileges)"
                fix = "pass a --port of 1024 or above"
            elif exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
                why = f"{self.host} is not an address of this machine ({exc.strerror or exc})"
                fix = "pass a --host of this machine, such as 127.0.0.1"
            else:
                why = f"cannot listen on {where} ({exc.strerror or exc})"
                fix = "pass another --host or --port"
            raise StackError(f"{why}; {fix}") from None

    def wait_ready(self) -> LocalStack:
        """Block until every worker process has imported its function (requests are served before, and
        wait for their worker)."""
        for workers in self._workers.values():
            workers.wait_ready()
        return self

    def _environment(self) -> dict[str, str]:
        """What every function sees: the template's environment, and where the store is."""
        environment: dict[str, str] = {}
        # Tables by their logical ids; no queue here (the watch's outbox is the SQLite database).
        refs = {name: name for name in wiring.tables()} | dict.fromkeys(wiring.queues(), "")
        for function in sorted(wiring.functions()):
            for name, value in wiring.environment(function, refs).items():
                if environment.setdefault(name, value) != value:
                    raise RuntimeError(
                        f"functions disagree on {name}; the local stack gives them one environment"
                    )
        # A developer's own machine: alerts may go to loopback and private addresses (a local Mattermost,
        # the tests' receivers), never to link-local or metadata ones; WEBHOOK_ALLOWED_NETWORKS narrows it.
        from shared.watch.egress import ALLOWED_ENV, LOCAL_DEFAULT, Policy

        environment[ALLOWED_ENV] = os.environ.get(ALLOWED_ENV, LOCAL_DEFAULT)
        Policy.parse(environment[ALLOWED_ENV])  # a bad value is said at start, not at the first alert
        if not os.environ.get("INSTANTML_LOCAL_LOGS"):
            # No CloudWatch here: EMF documents and per-request log lines would only bury the output
            # of `instantml local` and the demo. INSTANTML_LOCAL_LOGS=1 keeps them as deployed.
            environment.update(POWERTOOLS_METRICS_DISABLED="true", POWERTOOLS_LOG_LEVEL="WARNING")
        if self.dynamodb_endpoint:
            environment.update(
                AWS_ENDPOINT_URL_DYNAMODB=self.dynamodb_endpoint,
                AWS_DEFAULT_REGION=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
                AWS_ACCESS_KEY_ID=os.environ.get("AWS_ACCESS_KEY_ID", "local"),
                AWS_SECRET_ACCESS_KEY=os.environ.get("AWS_SECRET_ACCESS_KEY", "local"),
            )
        else:
            from shared.store import STORE_URL_ENV

            environment[STORE_URL_ENV] = self.store_url
        if self.dynamodb_endpoint:
            from shared.store import STORE_URL_ENV

            environment[STORE_URL_ENV] = ""  # the template's tables, whatever this shell says
        # A process's failed end nudges the watch through a file the schedule reads (an event on the
        # watch's bus on AWS: the template's WATCH_NUDGE).
        from shared.watch.nudges import NUDGE_ENV

        environment[NUDGE_ENV] = "file:" + self.nudge_file
        environment.update(self._extra_environment)
        return environment

    @property
    def nudge_file(self) -> str:
        return str(Path(self.data_dir) / "watch.nudge")

    def _open_tokens(self) -> Any:
        from shared.store import open_token_store

        if self.dynamodb_endpoint:
            from shared.store.dynamodb import DynamoTokenStore

            self._create_tables()
            return DynamoTokenStore("TokensTable", dynamodb_client(self.dynamodb_endpoint))
        self._lock_data_dir()
        self._check_database()
        return open_token_store(self.store_url)

    def _lock_data_dir(self) -> None:
        """Hold an exclusive lock on ``DIR/lock`` while serving: a second stack exits at once. A data
        directory that cannot be made or written is a ``StackError`` naming it."""
        import fcntl

        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StackError(
                f"cannot make the data directory {self.data_dir} ({exc.strerror or exc}); "
                "pass a --data-dir this user can write to"
            ) from None
        try:
            lock = open(self.data_dir / "lock", "a+")  # noqa: SIM115 - held until stop()
        except OSError as exc:
            raise StackError(
                f"cannot write in the data directory {self.data_dir} ({exc.strerror or exc}); make it "
                "writable (a read-only disk or mount cannot hold a live stack's data), or pass another "
                "--data-dir"
            ) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise DataDirInUse(
                f"the data directory {self.data_dir} is in use by another `instantml local` ({holder}); "
                "stop it, or pass another --data-dir"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}\n")
        lock.flush()
        self._lock_file = lock

    def _check_database(self) -> None:
        """Refuse a database file that cannot be written or is damaged, with what to do; say so when an
        empty file is taken as a new database. A check that outruns ``INTEGRITY_BUDGET_S`` (a large
        database on a cold disk) goes on in the background and reports on stderr."""
        from shared.store.sqlite import check_database

        path = database_path(self.data_dir)
        if not path.exists():
            return
        try:
            os.close(os.open(path, os.O_RDWR))
            problem, complete = check_database(path, INTEGRITY_BUDGET_S)
        except OSError as exc:
            raise StackError(
                f"cannot open the database {path} for writing ({exc.strerror or exc}); make it writable, or "
                "pass another --data-dir"
            ) from None
        if problem is not None:
            raise StackError(damaged(path, problem))
        if path.stat().st_size == 0:
            self.notes.append(
                f"the database {path} was an empty file (0 bytes, no data in it): starting a new database "
                "there. If runs were expected, stop this stack and restore the file from a backup."
            )
        if not complete:
            threading.Thread(target=check_in_background, args=(path,), daemon=True, name="check").start()

    def _saved_token(self) -> str:
        """The stack's token: the one saved in the data directory, so that it stays the same across
        restarts (users export it), or a new one."""
        if self.dynamodb_endpoint:
            return secrets.token_urlsafe(24)
        path = self.data_dir / "token"
        if path.exists():
            return path.read_text().strip()
        token = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token

    def _create_tables(self) -> None:
        assert self.dynamodb_endpoint is not None
        client = dynamodb_client(self.dynamodb_endpoint)
        existing = set(client.list_tables()["TableNames"])
        for name in wiring.tables():
            if name not in existing:
                client.create_table(TableName=name, **wiring.table_definition(name))

    def stop(self) -> None:
        for schedule in self.schedules:
            schedule.stop()
        self.schedules = []
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for poller in self.pollers:
            poller.stop()
        self.pollers = []
        for workers in self._workers.values():
            workers.stop()
        self._workers = {}
        # The rollup feed and the delivery worker stop at their next look at the event; one that does
        # not within BACKGROUND_STOP_S (a rollup batch at low priority on a busy machine) is killed:
        # they ignore SIGTERM, and Python's exit would wait for a live one forever. Nothing is lost: a
        # batch rolled again changes nothing, and an alert not yet sent is sent after the next start.
        if self._feed_stop is not None:
            self._feed_stop.set()
        for process in (self._feed, self._deliver):
            if process is not None:
                process.join(timeout=BACKGROUND_STOP_S)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)
        self._feed = self._deliver = None
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
