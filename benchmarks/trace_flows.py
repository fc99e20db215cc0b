"""Calls and returns of the two flows of architecture.md section 1 on a running local stack (issue 17).

    .venv/bin/python -m benchmarks.trace_flows [--cold]

The same method as the baseline: ``sys.setprofile`` over the project's files while a real ``LocalStack``
(SQLite in a temporary data directory, 127.0.0.1, a free port) serves the requests over HTTP.

(a) ``POST .../rank-metrics/batch`` with 4 events, HTTP to stored rows;
(b) ``GET .../distributed`` as the Distributed tab asks for it, through the rollup reads (level-1 blocks
    up to the rollups' progress mark, events after it).

How the handler side is traced. The stack answers in two processes per request: the HTTP front (request
handler, router, authorizer) in the stack's own process, the function in a worker process of its pool
(``infra.local.workers.FunctionWorkers``). Both are traced, and the two traces are spliced into one flow:

- front: ``threading.setprofile`` is on only while the traced request is in flight, so the server's
  thread for that connection (``ThreadingHTTPServer`` starts one per connection) profiles itself; only
  the thread that calls ``RequestHandler._serve`` is kept, from that call to its return (the handler's
  ``setup`` and ``handle_one_request`` around it are left out).
- worker: the pool submits ``infra.local.workers._worker_invoke`` by name, looked up in the stack's process at
  each invoke. This script rebinds that name (from outside: no runtime code changes) to
  ``traced_worker_invoke`` below, which runs the real ``_worker_invoke`` unchanged and, only for a
  request carrying the header ``x-trace-flows-out``, with ``sys.setprofile`` on around it, writing its
  events to the file that header names. The worker's events are put where the front waits for them:
  between the call of ``FunctionWorkers.invoke`` and its return. Running the handler in-process instead
  would trace a path the stack never takes (the pickled event, the worker's ``_worker_invoke``).
- every function gets one worker (``infra.local.stack.WORKERS`` set to 1 for the run): the pool size changes
  which process answers, not what it runs, and it makes the traced request land on the worker that the
  requests before it warmed.
- no setting picks the summary's path: ``distributed_summary`` reads the levels of rollups wherever the
  rollup worker has rolled steps up (``rollup_progress``), and events after that mark. With the
  default ``max_steps`` (200) and 251 steps, its units are single steps (``unit: step``): it reads the
  level-1 blocks of the steps up to the mark and the events of the steps after it. The script checks
  the answer's ``resolution`` says so, with the counts below.

Before tracing: 4 ranks x 250 steps (0 to 249) are logged through the batch route; the script waits
(bounded) until the stack's rollup feed has rolled steps 0 to 239 up (``rollup_progress(...).step >=
239`` in the database: it rolls up to ``shared.summary.rolling.SETTLE_STEPS`` (10) behind the newest step).
The traced batch posts 4 new events at step 250; the rollup feed then rolls step 240 up, and the script
waits for that too (``step >= 240``) before the traced summary, so that (b) reads 241 level-1 blocks
(steps 0 to 240) and 40 events (steps 241 to 250) whatever the feed's timing. By default both flows are
warm, as on a reload: the ingest worker and the authorizer's token cache have served the logging, and
one untraced summary goes before the traced one. ``--cold`` traces with a token made just before (the
authorizer's cache misses and reads the token store) and traces the summary worker's first request
(its store is opened in it).

What is counted. Only ``call`` and ``return`` events of frames whose file lies in instantml/, shared/,
functions/ or infra/ (the stdlib, site-packages such as Powertools and numpy, generated code such as
dataclass ``__init__`` and this file are not); a ``call`` event is also what the profiler reports when
a generator (a ``@contextmanager``) resumes. The *position* after an event is the file of the innermost
project frame on the stack: the callee's for a call; for a return, the nearest project frame below
(for the worker's outermost frame, the front's ``FunctionWorkers.invoke``). Two views:

- the first-call path (the baseline's list, one line per function): a call is kept only when its
  function (code object) is called for the first time in the flow, with its own return; repeats, per
  event of the batch or per key, are dropped (a function first called inside a repeat is kept).
  * call hops: the kept calls, in order (so the distinct functions called), comprehensions and lambdas
    (``<genexpr>``, ``<lambda>``) included; the summary line also gives the count without them.
    files: the distinct files of the hops.
  * calls back: kept calls into a file that was a position earlier in the flow and is not the position
    just before the call (the position after the previous kept event): visited, and since left. They
    are marked ``↩`` in the path.
  * re-entries counting returns: kept calls or returns whose position after differs from the position
    before and was a position earlier (the calls back, and the returns into a visited file).
- all events: every call and return; file transitions are the events whose position after differs
  from the position before (the baseline's "a 4-event batch makes 54 file transitions"); calls back
  and re-entries as above over every event.

One more count, over all events: *upward calls*, calls from a file into one of a layer above it, in the
order a request goes down (``LAYERS``): the edge (infra/), the handlers (functions/*/), the handlers'
HTTP helpers (functions/api.py), the use cases (shared/ingest/writes, shared/summary/ reads, document,
rolling, query and scalars, shared/runs), the store's adapters (shared/store/), the domain (the rest of
shared/: the request parsing, decoding, rollups, findings, stats, tokens), the contract's facts (instantml/).
A call back into a layer below (a use case calling the domain again) is the shape of any orchestration; an
upward call is a flow that turns back.

The path prints one line per hop: its number, ``↩`` for a call back, its depth (project frames below
it), ``file:function``, and ``×n`` when the function had n call events in the flow. The summary line
gives the file transitions of all events. The baseline figures (architecture.md, main 92957e6) are
printed beside: its tracer is not in the repository, so its counting is inferred from its list (one
entry per function, repeats folded, transitions over the whole batch).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import infra.local as local  # noqa: E402
import infra.local.stack as local_stack  # noqa: E402
import infra.local.workers as local_workers  # noqa: E402
from instantml import routes  # noqa: E402

PROJECT_DIRS = ("instantml", "shared", "functions", "infra")
TRACE_HEADER = "x-trace-flows-out"
PROJECT = "trace"
RUN = "flows"
RANKS = 4
LOGGED_STEPS = 250  # steps 0 to 249: rolled up to 239, SETTLE_STEPS behind the newest
TRACED_STEP = 250
WAIT_S = 30.0
#: Where the front's flow starts and ends: the request handler's ``_serve``.
SERVE = ("infra/local/server.py", "RequestHandler._serve")

#: The layers a request goes down through, top first (file prefixes): see "upward calls" above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("infra/",),
    (
        "functions/authorizer/",
        "functions/ingest/",
        "functions/summarize/",
        "functions/runs/",
        "functions/rollup/",
    ),
    ("functions/api.py",),
    (
        "shared/ingest/writes.py",
        "shared/ingest/activity.py",
        "shared/summary/reads.py",
        "shared/summary/document.py",
        "shared/runs.py",
        "shared/summary/rolling.py",
        "shared/summary/query.py",
    ),
    ("shared/summary/scalars.py",),
    ("shared/store/",),
    ("shared/",),
    ("instantml/",),
)


def layer(file: str) -> int:
    return next(i for i, prefixes in enumerate(LAYERS) if file.startswith(prefixes))


#: architecture.md section 1 (main 92957e6); None where it gives no figure.
BASELINE: dict[str, dict[str, int | None]] = {
    "a": {"hops": 32, "files": 9, "calls_back": 9, "reentries": 26, "transitions": 54},
    "b": {"hops": 46, "files": 13, "calls_back": 17, "reentries": 46, "transitions": None},
}

#: The real worker entry point, bound before this script rebinds the module's name.
_worker_invoke = local_workers._worker_invoke

# One traced event: kind ("call" or "return"), file (relative to the checkout), function (qualified
# name), first line, and the position after it (the innermost project frame's file, None below all).
Event = tuple[str, str, str, int, str | None]


class Tracer:
    """A profile function that records the project's call and return events, per thread."""

    def __init__(self) -> None:
        self.threads: dict[int, list[Event]] = {}
        # The request's _serve returned (not just any outermost project frame: the handler's ``setup``,
        # before _serve, is one too, and waiting on it raced the end of the flow).
        self.finished = threading.Event()
        self._files: dict[str, str | None] = {}
        self._prefixes = tuple(str(ROOT / d) + os.sep for d in PROJECT_DIRS)

    def _project_file(self, filename: str) -> str | None:
        try:
            return self._files[filename]
        except KeyError:
            path = os.path.realpath(filename) if not filename.startswith("<") else ""
            inside = path.startswith(self._prefixes)
            rel = os.path.relpath(path, ROOT) if inside else None
            self._files[filename] = rel
            return rel

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" and event != "return":
            return
        code = frame.f_code
        file = self._project_file(code.co_filename)
        if file is None:
            return
        position: str | None = file
        if event == "return":
            position = None
            back = frame.f_back
            while back is not None:
                position = self._project_file(back.f_code.co_filename)
                if position is not None:
                    break
                back = back.f_back
        events = self.threads.setdefault(threading.get_ident(), [])
        events.append((event, file, code.co_qualname, code.co_firstlineno, position))
        if event == "return" and code.co_qualname == SERVE[1] and file == SERVE[0]:
            self.finished.set()


def traced_worker_invoke(
    function: str, event: dict[str, Any], timeout_s: float, memory: int
) -> dict[str, Any]:
    """``infra.local.workers._worker_invoke`` (runs in the worker), profiled when the request asks for it."""
    out = (event.get("headers") or {}).get(TRACE_HEADER)
    if not out:
        return _worker_invoke(function, event, timeout_s, memory)
    tracer = Tracer()
    sys.setprofile(tracer)
    try:
        return _worker_invoke(function, event, timeout_s, memory)
    finally:
        sys.setprofile(None)
        Path(out).write_text(json.dumps(tracer.threads.get(threading.get_ident(), [])))


@dataclass
class Hop:
    depth: int
    file: str
    function: str
    back: bool
    calls: int = 1


@dataclass
class Counts:
    hops: int = 0
    files: int = 0
    calls_back: int = 0
    reentries: int = 0
    transitions: int = 0
    upward: list[str] = field(default_factory=list)  # "caller -> callee" of the calls up the layers
    functions: int = 0  # distinct functions (code objects) called
    anonymous: int = 0  # of which comprehensions and lambdas (``<genexpr>``, ``<lambda>``)
    path: list[Hop] = field(default_factory=list)


def count(events: list[Event]) -> tuple[Counts, Counts]:
    """The first-call path and the all-events view of one flow (definitions in the module docstring)."""
    first, every = Counts(), Counts()
    keys: dict[tuple[str, str, int], Hop] = {}
    kept_stack: list[bool] = []
    visited_first: set[str] = set()
    visited_all: set[str] = set()
    before_first: str | None = None
    before_all: str | None = None
    files_first: set[str] = set()
    files_all: set[str] = set()

    def step(view: Counts, visited: set[str], before: str | None, kind: str, after: str | None) -> None:
        if after is not None and before is not None and after != before:
            view.transitions += 1
            if after in visited:
                view.reentries += 1
                if kind == "call":
                    view.calls_back += 1

    for kind, file, function, line, after in events:
        if kind == "call" and before_all is not None and layer(file) < layer(before_all):
            every.upward.append(f"{before_all} -> {file}:{function}")
        if kind == "call":
            key = (file, function, line)
            new = key not in keys
            kept = new  # also when inside a repeat (a branch only a later event or key takes)
            kept_stack.append(kept)
            every.hops += 1
            files_all.add(file)
            if not new:
                keys[key].calls += 1
            else:
                back = before_first is not None and file != before_first and file in visited_first
                hop = Hop(len(kept_stack) - 1, file, function, back)
                keys[key] = hop
                first.path.append(hop)
                first.hops += 1
                files_first.add(file)
        else:
            kept = kept_stack.pop() if kept_stack else False
        step(every, visited_all, before_all, kind, after)
        before_all = after if after is not None else before_all
        if after is not None:
            visited_all.add(after)
        if kept:
            step(first, visited_first, before_first, kind, after)
            before_first = after if after is not None else before_first
            if after is not None:
                visited_first.add(after)
    first.files, every.files = len(files_first), len(files_all)
    first.functions, every.functions = len(first.path), len(keys)
    first.anonymous = sum(hop.function.endswith(">") for hop in first.path)
    every.anonymous = sum(function.endswith(">") for _, function, _ in keys)
    return first, every


def splice(front: list[Event], worker: list[Event]) -> list[Event]:
    """The worker's events inside the front's ``FunctionWorkers.invoke``, where it waited for them."""
    invokes = [
        i
        for i, (kind, file, function, _, _) in enumerate(front)
        if kind == "call" and file == "infra/local/workers.py" and function == "FunctionWorkers.invoke"
    ]
    invoke_return = ("return", "infra/local/workers.py", "FunctionWorkers.invoke")
    if len(invokes) != 1 or front[invokes[0] + 1][:3] != invoke_return:
        raise RuntimeError(f"expected one FunctionWorkers.invoke call and its return, found {invokes}")
    at = invokes[0] + 1
    inner = [
        (k, f, fn, line, pos if pos is not None else "infra/local/workers.py")
        for k, f, fn, line, pos in worker
    ]
    return front[:at] + inner + front[at:]


def request(
    stack: local.LocalStack, method: str, path: str, token: str, body: Any = None, trace_to: str | None = None
) -> Any:
    """One request on a connection of its own (closed after, so the server's thread for it ends)."""
    headers = {"Authorization": f"Bearer {token}", "Connection": "close"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if trace_to is not None:
        headers[TRACE_HEADER] = trace_to
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=60)
    try:
        conn.request(method, path, data, headers)
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    if response.status >= 300:
        raise RuntimeError(f"{method} {path} answered {response.status}: {payload[:300]!r}")
    return json.loads(payload)


def traced(
    stack: local.LocalStack, workdir: Path, name: str, method: str, path: str, token: str, body: Any = None
) -> tuple[list[Event], Any]:
    """One request traced on both sides; its spliced events and its answer."""
    out = workdir / f"{name}.worker.json"
    tracer = Tracer()
    threading.setprofile(tracer)  # threads started from now on: the server's thread for this connection
    try:
        answer = request(stack, method, path, token, body, trace_to=str(out))
        # The front writes the answer before its _serve returns: wait for that return.
        if not tracer.finished.wait(WAIT_S):
            raise RuntimeError(f"the front's trace of {name} did not finish within {WAIT_S} s")
    finally:
        threading.setprofile(None)
    # The connection's thread also runs the handler's setup and handle_one_request around _serve: the
    # flow is from _serve's call to its return.
    fronts = []
    for events in tracer.threads.values():
        serve = [i for i, e in enumerate(events) if e[1:3] == SERVE]
        if len(serve) == 2 and events[serve[0]][0] == "call" and events[serve[1]][0] == "return":
            fronts.append(events[serve[0] : serve[1] + 1])
    if len(fronts) != 1:
        raise RuntimeError(f"expected one traced request thread, from _serve's call to its return: {fronts}")
    worker: list[Event] = [tuple(e) for e in json.loads(out.read_text())]
    return splice(fronts[0], worker), answer


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll ``condition`` (another process makes it true, with nothing to wait on) until ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(delay)
        delay = min(0.2, delay * 2)


def wait_rolled(stack: local.LocalStack, step: int, what: str) -> None:
    """Wait until the stack's rollup feed has rolled the run up through ``step`` (its progress mark)."""
    store = stack.store()
    try:
        wait_until(lambda: store.rollup_progress(PROJECT, RUN).step >= step, what)
    finally:
        store.db.close()


def rank_events(steps: range, prefix: str) -> list[dict[str, Any]]:
    return [
        {
            "event_id": f"{prefix}-{step}-{rank}",
            "step": step,
            "rank": rank,
            "world_size": RANKS,
            "metrics": {"train/loss": 2.0 - step / 1000 + rank / 100, "optimizer/grad_norm": 1.0 + rank},
        }
        for step in steps
        for rank in range(RANKS)
    ]


def fmt(value: int | None) -> str:
    return "-" if value is None else str(value)


def report(label: str, title: str, events: list[Event], baseline: dict[str, int | None]) -> None:
    first, every = count(events)
    print(f"\n({label}) {title}")
    for n, hop in enumerate(first.path, 1):
        mark = "↩" if hop.back else " "
        times = f"  ×{hop.calls}" if hop.calls > 1 else ""
        print(f"  {n:3d} {mark} {hop.depth:2d} {hop.file}:{hop.function}{times}")
    print(
        f"  now:      {first.hops} call hops over {first.files} files; {first.calls_back} calls back "
        f"({first.reentries} re-entries counting returns); {every.transitions} file transitions"
        f" [{first.hops - first.anonymous} hops without the {first.anonymous} <genexpr>/<lambda>]"
    )
    print(
        f"  baseline: {fmt(baseline['hops'])} call hops over {fmt(baseline['files'])} files; "
        f"{fmt(baseline['calls_back'])} calls back ({fmt(baseline['reentries'])} re-entries counting "
        f"returns); {fmt(baseline['transitions'])} file transitions"
    )
    print(
        f"  all events: {every.hops} calls of {every.functions} functions over {every.files} files, "
        f"{every.calls_back} calls back, {every.reentries} re-entries counting returns, "
        f"{every.transitions} file transitions; {len(every.upward)} upward calls"
    )
    for upward in sorted(set(every.upward)):
        print(f"    upward: {upward}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cold",
        action="store_true",
        help="trace with a fresh token and on the summary worker's first request",
    )
    args = parser.parse_args(argv)
    from shared.store import open_token_store
    from shared.summary.rolling import SETTLE_STEPS

    started = time.monotonic()
    saved_workers, saved_invoke = local_stack.WORKERS, local_workers._worker_invoke
    with tempfile.TemporaryDirectory(prefix="trace-flows-") as tmp:
        workdir = Path(tmp)
        local_stack.WORKERS = {}  # one worker per function (DEFAULT_WORKERS)
        local_workers._worker_invoke = traced_worker_invoke
        try:
            stack = local.LocalStack("127.0.0.1", 0, data_dir=workdir / "data")
            with stack:
                stack.wait_ready()
                batch = routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id=RUN)
                distributed = routes.DISTRIBUTED.format(project=PROJECT, run_id=RUN)
                logged = rank_events(range(LOGGED_STEPS), "log")
                for i in range(0, len(logged), 500):
                    answer = request(stack, "POST", batch, stack.token, {"events": logged[i : i + 500]})
                    assert answer["stored"] == len(logged[i : i + 500]), answer
                rolled = LOGGED_STEPS - 1 - SETTLE_STEPS
                wait_rolled(stack, rolled, f"the rollup feed to roll steps 0 to {rolled} up")
                token = stack.token
                if args.cold:
                    token, _ = open_token_store(stack.store_url).create(PROJECT, "trace_flows --cold")
                else:
                    request(stack, "GET", distributed, token)  # the summary worker's first request

                four = rank_events(range(TRACED_STEP, TRACED_STEP + 1), "traced")
                flow_a, answer = traced(stack, workdir, "a", "POST", batch, token, {"events": four})
                assert answer["stored"] == 4, answer
                mark = TRACED_STEP - SETTLE_STEPS
                wait_rolled(stack, mark, f"the rollup feed to roll step {mark} up after the traced batch")
                flow_b, summary = traced(stack, workdir, "b", "GET", distributed, token)
                resolution = summary["resolution"]
                expected = {
                    "unit": "step",
                    "level_steps": 1,
                    "rollup_blocks_read": mark + 1,
                    "events_read": (TRACED_STEP - mark) * RANKS,
                    "complete_through_step": None,
                }
                assert {name: resolution.get(name) for name in expected} == expected, resolution
        finally:
            local_stack.WORKERS, local_workers._worker_invoke = saved_workers, saved_invoke
    state = "cold (fresh token; the summary worker's first request)" if args.cold else "warm"
    print(f"Traced on a local stack (SQLite), {state}; {len(logged)} events logged first.")
    report("a", f"POST {routes.RANK_METRICS_BATCH}, 4 events, HTTP to stored rows", flow_a, BASELINE["a"])
    report(
        "b",
        f"GET {routes.DISTRIBUTED}, max_steps 200: {resolution['rollup_blocks_read']} level-1 blocks "
        f"(steps 0 to {resolution['rollup_blocks_read'] - 1}) and {resolution['events_read']} events read",
        flow_b,
        BASELINE["b"],
    )
    print(f"\n{time.monotonic() - started:.1f} s, stack stopped and its directory removed.")
    return 0


if __name__ == "__main__":
    from benchmarks.trace_flows import main as _main  # pickled by this name, not __main__'s

    sys.exit(_main())
