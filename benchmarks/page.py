"""The Distributed tab in headless Chromium: time from navigation to a fully drawn page, and bytes moved.

    .venv/bin/python -m benchmarks.page [--rounds 3] [--screenshot docs/distributed-tab.png]

Two runs are seeded straight into the local stack's table (the items the ingest function would write,
by BatchWriteItem, so seeding takes seconds, not minutes): 8 ranks x 1,000 steps and 512 ranks x
200 steps, 3 keys, with a stopped rank, a slow rank and a spike. For each, a fresh page navigates to
the tab; the figure is the page's own ``instantml:drawn`` performance mark (set when the findings,
chart, coverage, heatmap and tables are drawn for the first summary), which counts from navigation
start. Transfer size is the navigation plus every resource the page fetched, as the browser reports it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infra.local import LocalStack, view_url  # noqa: E402
from shared.store import SHARDS, partition_key, sort_key  # noqa: E402
from tests.synthetic import synthetic_job  # noqa: E402
from tests.test_page import CHROMIUM, CHROMIUM_FLAGS  # noqa: E402

PROJECT = "bench"
FAULTS = ("stop", "slow", "spikes")


def seed(run_id: str, ranks: int, steps: int) -> int:
    import boto3

    client = boto3.client("dynamodb")
    items = [
        {
            "PutRequest": {
                "Item": {
                    "pk": {"S": partition_key(PROJECT, run_id, e.rank % SHARDS)},
                    "sk": {"S": sort_key(e.step, e.event_id)},
                    "r": {"N": str(e.rank)},
                    "ws": {"N": str(e.world_size)},
                    "k": {"S": "\n".join(e.keys)},
                    "v": {"B": e.packed},
                    "h": {"B": b"0" * 16},
                }
            }
        }
        for e in synthetic_job(ranks, steps, FAULTS, seed=1)
    ]
    for start in range(0, len(items), 25):
        client.batch_write_item(RequestItems={"MetricsTable": items[start : start + 25]})
    return len(items)


def measure(browser: Any, url: str) -> tuple[float, int]:
    page = browser.new_page(viewport={"width": 1280, "height": 1400})
    page.goto(url)
    page.locator('body[data-drawn="1"]').wait_for(state="attached", timeout=120_000)
    drawn = page.evaluate("performance.getEntriesByName('instantml:drawn')[0].startTime")
    transfer = page.evaluate(
        """() => performance.getEntriesByType('navigation')[0].transferSize
                 + performance.getEntriesByType('resource').reduce((n, r) => n + r.transferSize, 0)"""
    )
    page.close()
    return float(drawn), int(transfer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--screenshot", type=Path, help="save the 8-rank page here")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with LocalStack(port=0) as stack, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        for ranks, steps in ((8, 1_000), (512, 200)):
            run_id = f"r{ranks}x{steps}"
            count = seed(run_id, ranks, steps)
            url = view_url(stack.url, PROJECT, run_id, stack.token)
            samples = [measure(browser, url) for _ in range(args.rounds)]
            times = [t for t, _ in samples]
            print(
                f"{ranks:>4} ranks x {steps:>5} steps ({count:>6} events): navigation to drawn "
                f"median {statistics.median(times):7.0f} ms (rounds: {', '.join(f'{t:.0f}' for t in times)}), "
                f"transfer {samples[-1][1] / 1024:7.1f} KiB"
            )
            if args.screenshot and ranks == 8:
                page = browser.new_page(viewport={"width": 1280, "height": 1400})
                page.goto(url)
                page.locator('body[data-drawn="1"]').wait_for(state="attached", timeout=120_000)
                args.screenshot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.screenshot), full_page=True)
                page.close()
                print(f"screenshot: {args.screenshot}")
        browser.close()


if __name__ == "__main__":
    main()
