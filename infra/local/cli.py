"""``instantml local``: start the stack, say where it is and how to reach it, stop it on Ctrl-C or
SIGTERM."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any

from infra.local.server import listen_backlog
from infra.local.stack import DEFAULT_DATA_DIR, LocalStack, StackError, database_path


def _signed(url: str, token: str | None) -> str:
    """A printed page link, with the token in its fragment when given: never sent to a server, and the page
    takes it out of the address bar at once into the browser's storage for this origin, so the link
    signs the browser in once and every page opened from it after needs no token."""
    return f"{url}#token={token}" if token else url


def view_url(base_url: str, project: str, run_id: str, token: str | None = None) -> str:
    """The Distributed tab of a run."""
    from instantml import routes

    return _signed(f"{base_url}{routes.DISTRIBUTED_VIEW.format(project=project, run_id=run_id)}", token)


def runs_url(base_url: str, project: str, token: str | None = None) -> str:
    """The runs page of a project."""
    from instantml import routes

    return _signed(f"{base_url}{routes.RUNS_VIEW.format(project=project)}", token)


def run_url(base_url: str, project: str, run_id: str, token: str | None = None) -> str:
    """The run page of a run: its config and ``run.log`` charts."""
    from instantml import routes

    return _signed(f"{base_url}{routes.RUN_VIEW.format(project=project, run_id=run_id)}", token)


def compare_url(base_url: str, project: str, run_ids: list[str], token: str | None = None) -> str:
    """The comparison of runs: the runs in the fragment."""
    from instantml import routes

    url = f"{base_url}{routes.COMPARE_VIEW.format(project=project)}#runs={','.join(run_ids)}"
    return f"{url}&token={token}" if token else url


def stored_projects(data_dir: str | os.PathLike[str], limit: int = 5) -> tuple[list[tuple[str, int]], int]:
    """The projects a local stack's SQLite database holds, the most recently created run's first, with
    their run counts (at most ``limit``), and how many projects there are: what ``instantml local``
    links to, rather than a placeholder. Read-only, and nothing if the database cannot be read."""
    import sqlite3

    path = database_path(data_dir)
    if not path.exists():
        return [], 0
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as conn:
            rows = conn.execute(
                "SELECT project, COUNT(*) FROM runs GROUP BY project ORDER BY MAX(id) DESC"
            ).fetchall()
    except sqlite3.Error:
        return [], 0
    return [(str(p), int(n)) for p, n in rows[:limit]], len(rows)


def main(
    host: str,
    port: int,
    token: str | None,
    data_dir: str = DEFAULT_DATA_DIR,
    dynamodb_endpoint: str | None = None,
    watch_interval: float | None = None,
) -> int:
    import faulthandler
    import signal

    def stop_on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_term)
    # A shell starts a script's background job (`instantml local &`, nohup) with SIGINT ignored, and
    # Python keeps it so: such a stack never stopped on a SIGINT to its group. SIGINT is Ctrl-C always.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: where a stack that does not stop waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        stack = LocalStack(
            host, port, token, data_dir, dynamodb_endpoint, watch_interval=watch_interval
        ).start()
    except StackError as exc:
        print(f"instantml local: {exc}", file=sys.stderr)
        return 2
    for note in stack.notes:
        print(f"instantml local: {note}", file=sys.stderr)
    requested, cap = listen_backlog()
    if cap is not None and cap < requested:
        print(
            f"instantml local: the kernel caps the listen backlog at {cap} (net.core.somaxconn), below the "
            f"{requested} asked for: a crowd of uploaders connecting at once may wait or be refused; "
            f"`sysctl -w net.core.somaxconn={requested}` raises it",
            file=sys.stderr,
        )
    try:
        where = dynamodb_endpoint or f"{database_path(stack.data_dir)}"
        print(f"InstantML local API on {stack.url}")
        print(f"  data: {where}")
        print(f"  export INSTANTML_API_URL={stack.url}")
        print(f"  export INSTANTML_API_KEY={stack.token}")
        projects, total = ([], 0) if dynamodb_endpoint else stored_projects(stack.data_dir)
        if projects:
            more = f" (and {total - len(projects)} more)" if total > len(projects) else ""
            print(f"  Runs pages of the {total} project(s) stored here{more}:")
            for i, (name, runs) in enumerate(projects):  # the first link signs the browser in
                link = runs_url(stack.url, name, stack.token if i == 0 else None)
                print(f"    {name} ({runs} run(s)): {link}")
        else:
            link = runs_url(stack.url, "PROJECT", stack.token)
            print(f"  Runs page: {link} (PROJECT: the project of your im.init(project=...))")
        print(f"  Distributed tab: {view_url(stack.url, 'PROJECT', 'RUN_ID')}")
        saved = stack.data_dir / "token"  # only a token the stack made is kept there (not --token's)
        kept = not dynamodb_endpoint and saved.exists() and saved.read_text().strip() == stack.token
        print(f"  The token, for the pages' sign-in: {stack.token}" + (f" (kept in {saved})" if kept else ""))
        option = (
            f"--endpoint-url {dynamodb_endpoint} --table TokensTable"
            if dynamodb_endpoint
            else (f"--data-dir {stack.data_dir}")
        )
        print(f"  Per-project tokens: instantml tokens {option} create --project PROJECT")
        if stack.schedules:
            print(
                f"  Watching live runs every {stack.watch_interval:g} s; alerts: instantml alerts --project "
                "PROJECT --webhook URL"
            )
        print("Ctrl-C stops it.", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        # A repeated SIGTERM must not cut the stop short (`timeout` and process managers send it to the
        # process and then to its group): the workers finish the requests they hold. A second Ctrl-C is
        # a person who will not wait: exit at once (what was acknowledged is committed already).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
        stack.stop()
    return 0
