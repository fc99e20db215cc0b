"""The Distributed tab in headless Chromium: drawing times, the longest main-thread task, switching key,
a rank's own series, and the bytes a refresh moves; the page of this tree beside a reference page.

    .venv/bin/python -m benchmarks.page [--rounds 3] [--reference 33ae969]
        [--screenshot docs/distributed-tab.png]

Runs (tests/synthetic.py, 3 keys with a stopped, a slow and a spiky rank, plus ``train/lr``, equal on
every rank): 8 ranks x 1,000 steps; 512 ranks x 200 steps (4 keys, 200 columns); 512 ranks x 5,000
steps (200 columns of 25 steps); a live 64 ranks x 500 steps. Their summaries are computed once with the
real code (``shared.summary.document`` then ``shared.summary.wire.answer``, as the summarize function answers)
and served, gzipped as the function sends them, next to the pages by a loopback server: the figures are the
browser's part (fetch, parse, draw), not the server's (that is ``benchmarks/summary.py``).

- navigation to fully drawn: the page's own ``instantml:drawn`` mark (findings, charts, coverage,
  heatmap and tables drawn for the first summary), from navigation start. Goal (issue 24): <= 1 s at
  512 x 200 x 4 keys.
- longest main-thread task until then (Long Tasks API, which reports tasks of 50 ms and more). Goal:
  <= 100 ms.
- switching key: from the select's change to the next frame painted, each key in turn, median. Goal:
  <= 100 ms.
- a rank's own series on the 512 x 5,000 run: from the click on its heatmap row (the event's time) to
  the frame after its charts are drawn. Goal: <= 300 ms.
- bytes of a refresh of the live 64 x 500 tab (10 more steps since the page loaded; the page asks with
  ``since``) against a full reload of the same summary. Goal: less than half.

The reference is the tab as it was at ``--reference`` (a git revision; by default the commit before
issue 24's work): the same summaries in the form it reads (the contract's lists) and the same figures,
in the same browser, rounds interleaved. ``--reference ''`` leaves it out.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.drivers import QuietHandler  # noqa: E402
from benchmarks.drivers import serve as serve_stub  # noqa: E402
from functions.api import page_html  # noqa: E402
from shared.findings import name_hosts  # noqa: E402
from shared.summary.decoding import DecodedRun  # noqa: E402
from shared.summary.document import summarize  # noqa: E402
from shared.summary.query import SummaryQuery  # noqa: E402
from shared.summary.wire import answer  # noqa: E402
from tests.browser import CHROMIUM, CHROMIUM_FLAGS  # noqa: E402
from tests.synthetic import KEYS, synthetic_matrices  # noqa: E402

VIEW = ROOT / "functions/summarize/view.html"
REFERENCE = "33ae969"  # main before issue 24's Distributed tab work
SHAPES = {"r8x1000": (8, 1_000), "r512x200": (512, 200), "r512x5000": (512, 5_000)}
LIVE, LIVE_STEPS, LIVE_MORE = "live64x500", 500, 10
GOALS = {"drawn": 1000.0, "longest": 100.0, "switch": 100.0, "series": 300.0}


def decoded(ranks: int, steps: int, seed: int = 1) -> DecodedRun:
    """A synthetic job as ``shared.summary.decoding.decode`` returns it, built from its matrices (a 512 x
    5,000 run is 2.5 million events: as stored events it would take gigabytes here)."""
    values, weights, present = synthetic_matrices(ranks, steps, ("stop", "slow", "spikes"), seed)
    lr = np.broadcast_to(3e-4 * np.minimum(1.0, (np.arange(steps) + 1) / 50), (ranks, steps))
    values = np.concatenate([values, lr[:, :, None]], axis=2)
    keys = [*KEYS, "train/lr"]
    r, s = np.nonzero(present)
    order = np.lexsort((r, s))  # by step, then rank; the keys one after the other
    r, s = r[order], s[order]
    k = len(keys)
    return DecodedRun(
        keys=keys,
        key_id=np.repeat(np.arange(k), len(r)),
        step=np.tile(s, k),
        rank=np.tile(r, k),
        value=values[r, s, :].T.reshape(-1).copy(),
        weight=np.tile(weights[r, s], k),
        event_step=s,
        event_rank=r,
        event_world_size=np.full(len(r), ranks),
        event_node=np.full(len(r), -1),
    )


def first_steps(run: DecodedRun, steps: int) -> DecodedRun:
    """The run as it was when it had reached ``steps`` steps (a live run, ``steps`` later)."""
    value, event = run.step < steps, run.event_step < steps
    return DecodedRun(
        keys=run.keys,
        key_id=run.key_id[value],
        step=run.step[value],
        rank=run.rank[value],
        value=run.value[value],
        weight=run.weight[value],
        event_step=run.event_step[event],
        event_rank=run.event_rank[event],
        event_world_size=run.event_world_size[event],
        event_node=run.event_node[event],
    )


def hosts(ranks: int) -> dict[int, str]:
    """The hosts the ranks of a launched job say at ``im.init``: 8 ranks a node, as the record keeps them
    (the summarize function names them in the findings, ``shared.findings.name_hosts``)."""
    return {rank: f"gpu-node-{rank // 8:02d}" for rank in range(ranks)}


def named(summary: dict[str, Any], ranks: int) -> dict[str, Any]:
    summary["findings"] = name_hosts(summary["findings"], hosts(ranks))
    return summary


def body(document: dict[str, Any]) -> bytes:
    return gzip.compress(json.dumps(document, separators=(",", ":")).encode())


def summaries() -> dict[tuple[str, str], bytes]:
    """(run, form) -> gzipped answer; forms: ``base64`` (this page), ``lists`` (the reference),
    ``delta`` (the live run's refresh since the version the page loaded)."""
    out: dict[tuple[str, str], bytes] = {}
    runs = {name: decoded(*shape) for name, shape in SHAPES.items()}
    for name, run in runs.items():
        started = time.perf_counter()
        summary = named(summarize(run, "bench", name, SummaryQuery(), arrays=True), SHAPES[name][0])
        for form in ("base64", "lists"):
            out[(name, form)] = body(answer(summary, SummaryQuery(heatmap=form)))
        elapsed = time.perf_counter() - started
        sizes = ", ".join(f"{form} {len(out[(name, form)]) / 1024:.0f} KiB" for form in ("base64", "lists"))
        print(
            f"{name}: {len(summary['keys'])} keys x {len(summary['steps'])} columns, "
            f"summarized in {elapsed:.2f} s; gzipped: {sizes}"
        )
    live = decoded(64, LIVE_STEPS + LIVE_MORE)
    before = named(summarize(first_steps(live, LIVE_STEPS), "bench", LIVE, SummaryQuery(), arrays=True), 64)
    after = named(summarize(live, "bench", LIVE, SummaryQuery(), arrays=True), 64)
    for form in ("base64", "lists"):
        first = answer(before, SummaryQuery(heatmap=form))
        out[(LIVE, form)] = body(first)
        out[(LIVE, form + "-after")] = body(answer(after, SummaryQuery(heatmap=form)))
        out[(LIVE, form + "-delta")] = body(answer(after, SummaryQuery(heatmap=form, since=first["version"])))
    return out


def serve(bodies: dict[tuple[str, str], bytes], pages: dict[str, bytes]) -> ThreadingHTTPServer:
    """/v1/projects/{page}/runs/{run}/...: the page named ``page`` (``now`` or ``reference``), its
    summaries and the run's record. A summary asked with ``since`` is the live run after 10 more steps:
    the delta the server would send (its full form for the reference, which never asks ``since``)."""

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            parts = url.path.split("/")
            which, run = parts[3], parts[5]
            query = parse_qs(url.query)
            if url.path.endswith("/view"):
                self.send(200, pages[which], "text/html; charset=utf-8")
            elif url.path.endswith("/distributed"):
                form = query.get("heatmap", ["lists"])[0]
                if "since" in query and run != LIVE:  # nothing new: what the server says then
                    unchanged = {"version": query["since"][0], "unchanged": True}
                    self.send(200, body(unchanged), "application/json", {"Content-Encoding": "gzip"})
                    return
                if "since" in query:
                    form += "-delta"
                elif run == LIVE and self.server.refreshed.get(which):  # type: ignore[attr-defined]
                    form += "-after"
                if run == LIVE:
                    self.server.refreshed[which] = True  # type: ignore[attr-defined]
                self.send(200, bodies[(run, form)], "application/json", {"Content-Encoding": "gzip"})
            else:  # the run's record
                record = json.dumps({"run_id": run, "status": "live"}).encode()
                self.send(200, record, "application/json")

    server = serve_stub(Handler)
    server.refreshed = {}  # type: ignore[attr-defined]
    return server


LONG_TASKS = """
window.__longest = 0;
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.__longest = Math.max(window.__longest, e.duration);
}).observe({ type: 'longtask', buffered: true });
"""

# From the change to the frame after the page says it is fully drawn again (data-drawn: the tables may
# come in a task after the charts).
SWITCH = """async (key) => {
  const sel = document.getElementById('key-select'), before = document.body.dataset.drawn;
  const t0 = performance.now();
  sel.value = key;
  sel.dispatchEvent(new Event('change'));
  await new Promise((done) => {
    const check = () => (document.body.dataset.drawn !== before
      ? requestAnimationFrame(() => setTimeout(done, 0)) : setTimeout(check, 0));
    check();
  });
  return performance.now() - t0;
}"""


def open_page(browser: Any, url: str) -> Any:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.add_init_script(LONG_TASKS)
    page.goto(url)
    page.locator('body[data-drawn="1"]').wait_for(state="attached", timeout=120_000)
    return page


def drawn(browser: Any, url: str) -> tuple[float, float, float]:
    """Navigation to fully drawn (ms), the longest task until then (ms), median key switch (ms)."""
    page = open_page(browser, url)
    at = page.evaluate("performance.getEntriesByName('instantml:drawn')[0].startTime")
    page.evaluate("new Promise((done) => requestAnimationFrame(() => setTimeout(done, 0)))")
    longest = page.evaluate("window.__longest")
    keys = page.locator("#key-select option").evaluate_all("(os) => os.map((o) => o.value)")
    shown = page.locator("#key-select").input_value()
    switches = [page.evaluate(SWITCH, key) for key in [*[k for k in keys if k != shown], shown]]
    page.close()
    return float(at), float(longest), float(statistics.median(switches))


def rank_series(browser: Any, url: str) -> float | None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    """From the click on the heatmap row of rank 100 to its series drawn (ms); None when the page has none."""
    page = open_page(browser, url)
    box = page.locator("#heatmap").bounding_box()
    height = (box["height"] - 4 - 34) / SHAPES["r512x5000"][0]  # the heatmap's rows, between its margins
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + 4 + 100.5 * height)
    try:  # rank 100, give or take the pixel rounding of 1-pixel rows
        page.locator("body[data-rank-drawn]").wait_for(state="attached", timeout=10_000)
    except PlaywrightTimeout:  # the reference page has no rank series
        page.close()
        return None
    ms = page.evaluate(
        "performance.getEntriesByName('instantml:rank-drawn')[0].startTime"
        " - performance.getEntriesByName('instantml:rank-click')[0].startTime"
    )
    page.close()
    return float(ms)


def refresh_bytes(browser: Any, url: str) -> tuple[int, int]:
    """Bytes the first load's summary moved, and those of one refresh 10 steps later."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.clock.install()  # the 5 s refresh when the benchmark says
    sizes: list[int] = []

    def finished(request: Any) -> None:
        if urlsplit(request.url).path.endswith("/distributed"):
            size = request.sizes()  # as received: gzipped body and headers
            sizes.append(size["responseBodySize"] + size["responseHeadersSize"])

    page.on("requestfinished", finished)
    page.goto(url)
    page.locator('body[data-drawn="1"]').wait_for(state="attached", timeout=120_000)
    with page.expect_request_finished(lambda r: urlsplit(r.url).path.endswith("/distributed")):
        page.clock.run_for(5_100)
    page.close()
    return sizes[0], sizes[-1]


def reference_page(revision: str) -> bytes | None:
    if not revision:
        return None
    try:
        html = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{revision}:functions/summarize/view.html"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"no reference page at {revision!r}: {exc}")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "view.html"
        path.write_text(html)
        return page_html(path).encode()  # with this tree's kit, as it would be served


def verdict(value: float | None, goal: float) -> str:
    return "" if value is None else ("  (goal met)" if value <= goal else "  (over the goal)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3, help="0: no figures (with --screenshot: only that)")
    parser.add_argument(
        "--reference", default=REFERENCE, help="git revision of the reference page ('' for none)"
    )
    parser.add_argument("--screenshot", type=Path, help="save the 8-rank page here, rank 3's series open")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    pages = {"now": page_html(VIEW).encode()}
    reference = reference_page(args.reference)
    if reference is not None:
        pages["reference"] = reference
    server = serve(summaries(), pages)
    base = f"http://127.0.0.1:{server.server_address[1]}/v1/projects"
    url = lambda which, run: f"{base}/{which}/runs/{run}/distributed/view#token=benchmark"  # noqa: E731
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        for run in ("r8x1000", "r512x200") if args.rounds else ():
            results: dict[str, list[tuple[float, float, float]]] = {which: [] for which in pages}
            for _ in range(args.rounds):
                for which in pages:  # interleaved
                    results[which].append(drawn(browser, url(which, run)))
            print(f"\n{run}: median of {args.rounds} rounds")
            for which, samples in results.items():
                nav, longest, switch = (statistics.median(s[i] for s in samples) for i in range(3))
                goals = run == "r512x200"
                print(
                    f"  {which:<9} navigation to fully drawn {nav:6.0f} ms"
                    f"{verdict(nav, GOALS['drawn']) if goals else ''}; longest task {longest:5.0f} ms"
                    f"{' (none of 50 ms or more)' if longest == 0 else ''}"
                    f"{verdict(longest, GOALS['longest']) if goals else ''}; switching key {switch:5.1f} ms"
                    f"{verdict(switch, GOALS['switch']) if goals else ''}"
                )
        if args.rounds:
            series = [rank_series(browser, url("now", "r512x5000")) for _ in range(args.rounds)]
            shown = [s for s in series if s is not None]
            median = statistics.median(shown) if shown else None
            print(
                f"\nr512x5000: rank 100's own series drawn {median:.0f} ms after the click"
                f"{verdict(median, GOALS['series'])} (rounds: {', '.join(f'{s:.0f}' for s in shown)});"
                " the reference page has no rank series"
                if median is not None
                else "\nr512x5000: no rank series drawn"
            )
            print(
                f"\n{LIVE}: a refresh {LIVE_MORE} steps later against a full reload (gzipped, as transferred)"
            )
            for which in pages:
                server.refreshed.clear()  # type: ignore[attr-defined]
                first, refresh = refresh_bytes(browser, url(which, LIVE))
                print(
                    f"  {which:<9} full load {first / 1024:7.1f} KiB; refresh {refresh / 1024:7.1f} KiB"
                    f" = {refresh / first:.1%} of a full load"
                    + ("  (goal met: less than half)" if refresh < first / 2 else "  (not less than half)")
                )
        if args.screenshot:
            page = open_page(browser, url("now", "r8x1000").replace("#token", "#rank=3&live=0&token"))
            page.locator('body[data-drawn="1"]').wait_for(state="attached")
            args.screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.screenshot), full_page=True)
            page.close()
            print(f"screenshot: {args.screenshot}")
        browser.close()
    server.shutdown()


if __name__ == "__main__":
    main()
