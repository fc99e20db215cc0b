"""The Distributed tab in headless Chromium: time from navigation to a fully drawn page, and bytes moved.

    .venv/bin/python -m benchmarks.page [--rounds 3] [--screenshot docs/distributed-tab.png]

Two runs, 8 ranks x 1,000 steps and 512 ranks x 200 steps, 3 keys, with a stopped rank, a slow rank
and a spike (tests/synthetic.py). Their summaries are computed once with the real code
(``shared.summary``) and served, gzipped as the function sends them, next to the real page by a
loopback server: the figure is the browser's part (fetch, parse, draw), not moto's, whose queries run
at about 1.4 ms per item here and would dominate (the server side is ``benchmarks/summary.py``). The
time is the page's own ``instantml:drawn`` performance mark (findings, chart, coverage, heatmap and
tables drawn for the first summary), counted from navigation start. Transfer size is the navigation
plus every resource the page fetched, as the browser reports it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from functions.api import page_html  # noqa: E402
from shared.decoding import decode  # noqa: E402
from shared.query import SummaryQuery  # noqa: E402
from shared.summary import summarize  # noqa: E402
from tests.browser import CHROMIUM, CHROMIUM_FLAGS  # noqa: E402
from tests.synthetic import synthetic_job  # noqa: E402

VIEW = page_html(ROOT / "functions/summarize/view.html").encode()  # as the function serves it: kit inlined
SHAPES = ((8, 1_000), (512, 200))


def summaries() -> dict[str, bytes]:
    bodies = {}
    for ranks, steps in SHAPES:
        run_id = f"r{ranks}x{steps}"
        started = time.perf_counter()
        document = summarize(
            decode(synthetic_job(ranks, steps, ("stop", "slow", "spikes"), seed=1)),
            "bench",
            run_id,
            SummaryQuery(),
        )
        bodies[run_id] = gzip.compress(json.dumps(document, separators=(",", ":")).encode())
        elapsed, size = time.perf_counter() - started, len(bodies[run_id]) / 1024
        print(f"{run_id}: summary computed in {elapsed:.2f} s, {size:.0f} KiB gzipped")
    return bodies


def serve(bodies: dict[str, bytes]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            run_id = self.path.split("/runs/")[-1].split("/")[0]
            if self.path.split("?")[0].endswith("/view"):
                self._send(VIEW, "text/html; charset=utf-8", {})
            else:
                self._send(bodies[run_id], "application/json", {"Content-Encoding": "gzip"})

        def _send(self, body: bytes, kind: str, headers: dict[str, str]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def measure(browser: Any, url: str, screenshot: Path | None = None) -> tuple[float, int]:
    page = browser.new_page(viewport={"width": 1280, "height": 1400})
    page.goto(url)
    page.locator('body[data-drawn="1"]').wait_for(state="attached", timeout=120_000)
    drawn = page.evaluate("performance.getEntriesByName('instantml:drawn')[0].startTime")
    transfer = page.evaluate(
        """() => performance.getEntriesByType('navigation')[0].transferSize
                 + performance.getEntriesByType('resource').reduce((n, r) => n + r.transferSize, 0)"""
    )
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot), full_page=True)
    page.close()
    return float(drawn), int(transfer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--screenshot", type=Path, help="save the 8-rank page here")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    server = serve(summaries())
    base = f"http://127.0.0.1:{server.server_address[1]}/v1/projects/bench/runs"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        for ranks, steps in SHAPES:
            url = f"{base}/r{ranks}x{steps}/distributed/view#token=benchmark"
            samples = [measure(browser, url) for _ in range(args.rounds)]
            times = [t for t, _ in samples]
            rounds = ", ".join(f"{t:.0f}" for t in times)
            print(
                f"{ranks:>4} ranks x {steps:>5} steps: navigation to fully drawn median "
                f"{statistics.median(times):6.0f} ms (rounds: {rounds}); "
                f"transfer {samples[-1][1] / 1024:7.1f} KiB"
            )
        if args.screenshot:
            measure(browser, f"{base}/r8x1000/distributed/view#token=benchmark", args.screenshot)
            print(f"screenshot: {args.screenshot}")
        browser.close()
    server.shutdown()


if __name__ == "__main__":
    main()
