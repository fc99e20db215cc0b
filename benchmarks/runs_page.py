"""The runs page in headless Chromium with 1,000 runs stored, and the comparison of 4 runs of 64 ranks x
2,000 steps, each beside its floor, in one run.

    .venv/bin/python -m benchmarks.runs_page [--runs 1000] [--rounds 5] [--compare 4x64x2000 | --compare 0]
        [--screenshots docs]   # also redraws docs/runs-page.png and docs/compare.png from the real pages

Ours: the real local stack (SQLite in a temporary directory) with ``--runs`` runs of 8 ranks, each made
through the batch route, a third finished and every 20th with a config; the page is opened with the token
in its fragment and timed from navigation start to the frame after its first table is drawn (the
page's ``data-painted-at`` mark: fetch of the first page of 50 runs, parse, draw, layout and paint).
The floor: the same 50 rows as a static HTML table served by a bare stdlib server, timed to its
``load`` event plus one frame: what any page showing them must cost. Then "Load more" up to all runs.

The comparison: ``--compare RUNSxRANKSxSTEPS`` finished runs (``tests/compare_seed.py``: 3 keys per rank
and step, two ``run.log`` keys, configs that differ) stored through the batch route, their compare page
(``.../compare/view#runs=...``) timed from navigation start to the frame after it is fully drawn
(``data-painted-at``: every run's record, scalars and summary fetched, the server summarizing each run's
``ranks x steps`` events, and every chart, finding and config cell drawn). Its floor: the page as drawn,
saved as one static document (the same SVG, tables and styles, no script), served by the bare server and
timed to ``load`` plus one frame.
"""

from __future__ import annotations

import argparse
import html
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.drivers import QuietHandler, serve  # noqa: E402
from instantml import routes  # noqa: E402
from tests.browser import CHROMIUM, CHROMIUM_FLAGS  # noqa: E402
from tests.faults import call  # noqa: E402

PROJECT = "bench-runs-page"
GOAL_S = 1.0
COMPARE_PROJECT, COMPARE_GOAL_S = "bench-compare", 1.5


def seed(stack: Any, runs: int) -> None:
    now = time.time()

    def one(i: int) -> None:
        run_id = f"run-{i:05d}"
        events = [
            {
                "event_id": f"{s}-{r}",
                "step": s,
                "rank": r,
                "world_size": 8,
                "metrics": {"x": 1.0},
                "time": now - i,
            }
            for s in range(2)
            for r in range(8 if i % 7 else 7)
        ]
        status, _ = call(
            stack,
            "POST",
            routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id=run_id),
            {"events": events},
        )
        assert status == 200, status
        update: dict[str, Any] = {"time": now - i}
        if i % 3 == 0:
            update["status"] = "finished"
        if i % 20 == 0:
            update["config"] = {"lr": 3e-4, "batch_size": 32 * (1 + i % 4), "model": "gpt2"}
        if len(update) > 1:
            assert call(stack, "PATCH", routes.RUN.format(project=PROJECT, run_id=run_id), update)[0] == 200

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(runs)))


def all_runs(stack: Any) -> list[dict[str, Any]]:
    """Every run of the project, through the API's own pages."""
    runs, cursor = [], None
    while True:
        query = "?limit=200" + (f"&cursor={cursor}" if cursor else "")
        page = call(stack, "GET", routes.RUNS.format(project=PROJECT) + query)[1]
        runs += page["runs"]
        cursor = page["next_cursor"]
        if cursor is None:
            return runs


def static_server(body: bytes) -> ThreadingHTTPServer:
    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self.send(200, body, "text/html; charset=utf-8")

    return serve(Handler)


def time_compare(browser: Any, url: str) -> tuple[float, str]:
    """Navigation to the frame after the compare page is fully drawn (ms), and the page as drawn."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    page.locator('body[data-painted="1"]').wait_for(state="attached", timeout=120_000)
    painted = float(page.evaluate("document.body.dataset.paintedAt"))
    charts = page.locator(".chart svg path.line").count()
    assert charts > 0, "the compare page drew no chart"
    drawn = page.evaluate(
        "'<!doctype html><html><head><style>' + [...document.querySelectorAll('style')].map((s) => "
        "s.textContent).join('') + '</style></head><body>' + document.body.innerHTML.replace("
        "/<script[\\s\\S]*?<\\/script>/g, '') + '</body></html>'"
    )
    page.close()
    return painted, str(drawn)


def compare_figures(browser: Any, stack: Any, ids: list[str], rounds: int) -> tuple[list[float], list[float]]:
    from infra.local import compare_url

    url = compare_url(stack.url, COMPARE_PROJECT, ids, stack.token)
    time_compare(browser, url)  # warm: the function pools' first requests
    ours = [time_compare(browser, url) for _ in range(rounds)]
    floor = static_server(ours[0][1].encode())
    floors = [time_floor(browser, f"http://127.0.0.1:{floor.server_address[1]}/") for _ in range(rounds)]
    floor.shutdown()
    return [t for t, _ in ours], floors


def screenshots(browser: Any, stack: Any, ids: list[str], where: Path) -> None:
    """The README's pictures, from the real pages on the comparison's runs: the runs page with two runs
    ticked, and the compare page of them all."""
    from infra.local import compare_url, runs_url
    from tests.faults import wait_for

    def judged(run_id: str) -> bool:  # the watch's look at the whole run, whose counts the runs page shows
        record = call(stack, "GET", routes.RUN.format(project=COMPARE_PROJECT, run_id=run_id))[1]
        return bool(record.get("watch") and record["watch"]["up_to_date"])

    wait_for(lambda: all(judged(run) for run in ids), timeout=300, what="the watch's last look at every run")
    where.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 520})
    page.goto(runs_url(stack.url, COMPARE_PROJECT, stack.token))
    page.locator('body[data-painted="1"]').wait_for(state="attached", timeout=60_000)
    for run in ids[:2]:
        page.locator(f'#rows tr[data-run="{run}"] input.pick').check()
    page.screenshot(path=str(where / "runs-page.png"))
    page.close()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(compare_url(stack.url, COMPARE_PROJECT, ids, stack.token))
    page.locator('body[data-painted="1"]').wait_for(state="attached", timeout=120_000)
    page.screenshot(path=str(where / "compare.png"), full_page=True)
    page.close()
    print(f"screenshots: {where / 'runs-page.png'}, {where / 'compare.png'}")


def floor_server(rows: list[dict[str, Any]]) -> ThreadingHTTPServer:
    cells = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(r.get(k)))}</td>"
            for k in (
                "run_id",
                "status",
                "world_size",
                "last_step",
                "ranks_reporting",
                "last_event",
                "created",
            )
        )
        + "</tr>"
        for r in rows
    )
    body = f"<!doctype html><html><body><table>{cells}</table></body></html>".encode()
    return static_server(body)


def time_ours(browser: Any, url: str) -> tuple[float, int]:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(url)
    page.locator('body[data-painted="1"]').wait_for(state="attached", timeout=60_000)
    painted = float(page.evaluate("document.body.dataset.paintedAt"))
    rows = int(page.evaluate("document.body.dataset.rows"))
    page.close()
    return painted, rows


def time_floor(browser: Any, url: str) -> float:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(url, wait_until="load")
    painted = float(
        page.evaluate(
            "new Promise(r => requestAnimationFrame(() => setTimeout(() => r(performance.now()), 0)))"
        )
    )
    page.close()
    return painted


def time_load_more(browser: Any, url: str, runs: int) -> tuple[float, int]:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(url)
    page.locator('body[data-painted="1"]').wait_for(state="attached", timeout=60_000)
    started = time.perf_counter()
    rows = int(page.evaluate("document.body.dataset.rows"))
    while rows < runs:
        page.get_by_role("button", name="Load more").click()
        rows = min(rows + 50, runs)  # each click's page is drawn, or the wait fails after 60 s
        page.locator(f'body[data-rows="{rows}"]').wait_for(state="attached", timeout=60_000)
    elapsed = time.perf_counter() - started
    page.close()
    return elapsed, rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", default="4x64x2000", help="RUNSxRANKSxSTEPS to compare; 0: none")
    parser.add_argument("--screenshots", type=Path, help="save the runs and compare pages' pictures here")
    args = parser.parse_args()
    shape = [int(n) for n in args.compare.split("x")] if args.compare != "0" else []
    import tempfile

    from playwright.sync_api import sync_playwright

    from infra.local import LocalStack, runs_url

    compared: tuple[list[float], list[float]] | None = None
    with tempfile.TemporaryDirectory() as data_dir:
        stack = LocalStack(port=0, data_dir=data_dir).start().wait_ready()
        try:
            if shape:
                from tests.compare_seed import seed_comparison

                started = time.perf_counter()
                ids = seed_comparison(stack, COMPARE_PROJECT, *shape)
                events = shape[0] * shape[1] * shape[2]
                print(
                    f"{shape[0]} runs of {shape[1]} ranks x {shape[2]:,} steps ({events:,} rank events, "
                    f"3 keys each) stored through the batch route in {time.perf_counter() - started:.1f} s"
                )
            if args.runs:
                started = time.perf_counter()
                seed(stack, args.runs)
                print(
                    f"{args.runs:,} runs of 8 ranks stored through the batch route in "
                    f"{time.perf_counter() - started:.1f} s"
                )
                first = call(stack, "GET", routes.RUNS.format(project=PROJECT) + "?limit=50")[1]["runs"]
                every = all_runs(stack)
                floor, floor_every = floor_server(first), floor_server(every)
                url = runs_url(stack.url, PROJECT, stack.token)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
                if args.runs:
                    time_ours(browser, url)  # warm: the function pools' first requests
                    ours = [time_ours(browser, url) for _ in range(args.rounds)]
                    floors = [
                        time_floor(browser, f"http://127.0.0.1:{floor.server_address[1]}/")
                        for _ in range(args.rounds)
                    ]
                    more, rows = time_load_more(browser, url, args.runs)
                    every_url = f"http://127.0.0.1:{floor_every.server_address[1]}/"
                    floor_more = statistics.median(time_floor(browser, every_url) for _ in range(args.rounds))
                    floor.shutdown()
                    floor_every.shutdown()
                if shape:
                    compared = compare_figures(browser, stack, ids, args.rounds)
                    if args.screenshots:
                        screenshots(browser, stack, ids, args.screenshots)
                browser.close()
        finally:
            stack.stop()
    if args.runs:
        ours_ms = statistics.median(t for t, _ in ours)
        floor_ms = statistics.median(floors)
        shown = ours[0][1]
        print(json.dumps({"ours_ms": [round(t) for t, _ in ours], "floor_ms": [round(t) for t in floors]}))
        print(
            f"runs page, first {shown} of {args.runs:,} runs on screen: median {ours_ms:.0f} ms from "
            f"navigation (goal <= {GOAL_S * 1000:.0f} ms: {'met' if ours_ms <= GOAL_S * 1000 else 'MISSED'})"
        )
        print(
            f"floor, the same {len(first)} rows as a static table: median {floor_ms:.0f} ms; "
            f"ours / floor {ours_ms / floor_ms:.1f}x"
        )
        print(
            f"Load more up to {rows:,} rows: {more:.1f} s ({(rows - shown) / 50:.0f} clicks); floor, all "
            f"{len(every):,} rows as one static table: {floor_more:.0f} ms; "
            f"ours / floor {more * 1000 / floor_more:.0f}x"
        )
    if compared:
        times, floors = compared
        ours_ms, floor_ms = statistics.median(times), statistics.median(floors)
        goal = COMPARE_GOAL_S * 1000
        print(
            json.dumps(
                {"compare_ms": [round(t) for t in times], "compare_floor_ms": [round(t) for t in floors]}
            )
        )
        print(
            f"compare page, {shape[0]} runs of {shape[1]} ranks x {shape[2]:,} steps fully drawn: median "
            f"{ours_ms:.0f} ms from navigation (goal <= {goal:.0f} ms: "
            f"{'met' if ours_ms <= goal else 'MISSED'})"
        )
        print(
            f"floor, the same page as drawn, static: median {floor_ms:.0f} ms; ours / floor "
            f"{ours_ms / floor_ms:.1f}x"
        )


if __name__ == "__main__":
    main()
