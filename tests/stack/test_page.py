"""The Distributed tab in a real headless Chromium, against the local stack with two runs.

The seeded run has 8 ranks x 60 steps: rank 5 stops after step 40, rank 3 is 30% slower on
``system/step_time`` at every step, and rank 6 reports a ``train/loss`` spike at step 25.
The clean run is a healthy 8-rank job like the demo's: every rank draws from the same distributions.
"""

from __future__ import annotations

import json
import math
import random
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from infra.local import view_url
from instantml import routes

PROJECT, RUN, CLEAN_RUN = "page-test", "seeded", "clean"
STOPPED, SLOW, SPIKE_RANK, SPIKE_STEP = 5, 3, 6, 25
ALARM = "rgb(253, 236, 234)"  # view.html's --alarm: rows that a warning or critical finding names


def seed(stack: Any) -> None:
    rng = random.Random(3)
    events = []
    for step in range(60):
        for rank in range(8):
            if rank == STOPPED and step > 40:
                continue
            loss = 2.0 - step / 100 + rng.gauss(0, 0.01)
            if (rank, step) == (SPIKE_RANK, SPIKE_STEP):
                loss *= 10
            step_time = 0.25 * (1.3 if rank == SLOW else 1.0) + rng.gauss(0, 0.002)
            events.append(
                {
                    "event_id": f"{step}-{rank}",
                    "step": step,
                    "rank": rank,
                    "world_size": 8,
                    "metrics": {"train/loss": loss, "system/step_time": step_time},
                }
            )
    post_events(stack, RUN, events)


def seed_clean(stack: Any) -> None:
    rng = random.Random(7)
    events = [
        {
            "event_id": f"{step}-{rank}",
            "step": step,
            "rank": rank,
            "world_size": 8,
            "weight": 1024 - 96 * rank,
            "metrics": {
                "train/loss": 2.4 * math.exp(-step / 60) + 0.2 + rng.gauss(0, 0.02),
                "optimizer/grad_norm": 3.0 + rng.gauss(0, 0.3),
                "system/step_time": 0.25 + abs(rng.gauss(0, 0.01)),
            },
        }
        for step in range(60)
        for rank in range(8)
    ]
    post_events(stack, CLEAN_RUN, events)


def post_events(stack: Any, run_id: str, events: list[dict[str, Any]]) -> None:
    path = routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id=run_id)
    for start in range(0, len(events), 200):
        request = urllib.request.Request(
            stack.url + path,
            data=json.dumps({"events": events[start : start + 200]}).encode(),
            headers={"Authorization": f"Bearer {stack.token}", "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.load(response)["rejected"] == 0


def summary_of(stack: Any, run_id: str) -> dict[str, Any]:
    """The run's Distributed summary as the page gets it (same route, same token)."""
    request = urllib.request.Request(
        stack.url + routes.DISTRIBUTED.format(project=PROJECT, run_id=run_id),
        headers={"Authorization": f"Bearer {stack.token}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        summary: dict[str, Any] = json.load(response)
    return summary


@pytest.fixture(scope="module")
def seeded(local_stack: Any) -> Any:
    seed(local_stack)
    return local_stack


SummaryPatch = Callable[[dict[str, Any]], None]


class Page:
    """A page on the tab that records console errors and every request's host.

    ``patch`` edits every summary the server sends before the page sees it: fields the server does
    not send yet reach the real page through the real request.
    """

    def __init__(
        self, browser: Any, url: str, patch: SummaryPatch | None = None, width: int = 1280, height: int = 1400
    ) -> None:
        self.page = browser.new_page(viewport={"width": width, "height": height})
        self.errors: list[str] = []
        self.hosts: set[str] = set()
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.hosts.add(urlsplit(r.url).netloc))
        if patch is not None:

            def fulfil(route: Any) -> None:
                summary = route.fetch().json()
                patch(summary)
                route.fulfill(status=200, json=summary)

            self.page.route(lambda url: urlsplit(url).path.endswith("/distributed"), fulfil)
        self.page.goto(url)

    def show_key(self, key: str) -> None:
        """Select a key and wait until the outlier table is drawn for it."""
        self.page.select_option("#key-select", key)
        self.page.locator(f'#outliers[data-key="{key}"]').wait_for(state="attached")

    def outlier_rows(self) -> list[tuple[int, int]]:
        """(step, rank) of each row of the outlier table, top to bottom, as the cells show them."""
        cells = self.page.evaluate(
            "[...document.querySelectorAll('#outliers tbody tr')].map((tr) =>"
            " [...tr.children].map((td) => td.textContent))"
        )
        return [(int(row[0]), int(row[1])) for row in cells if len(row) > 1]  # not the "no rows" line

    def outlier_heading(self) -> tuple[str, str]:
        """The outlier table's title and note as written (the stylesheet upper-cases titles)."""
        return (
            self.page.locator("#outliers-title").text_content() or "",
            self.page.locator("#outliers-note").text_content() or "",
        )

    def coloured_rows(self, table: str) -> list[list[str]]:
        """The cells of each row of a table that has a cell in the alarm colour."""
        rows: list[list[str]] = self.page.evaluate(
            """([table, alarm]) => [...document.querySelectorAll(`#${table} tbody tr`)]
                 .map((tr) => [...tr.children])
                 .filter((tds) => tds.some((td) => getComputedStyle(td).backgroundColor === alarm))
                 .map((tds) => tds.map((td) => td.textContent))""",
            [table, ALARM],
        )
        return rows

    def wait_drawn(self, after: int = 0) -> int:
        # Locators, not wait_for_function: the page's CSP forbids the eval that the latter needs.
        self.page.locator(f'body[data-drawn="{after + 1}"]').wait_for(state="attached", timeout=30_000)
        return after + 1


@pytest.fixture(scope="module")
def clean(seeded: Any) -> Any:
    seed_clean(seeded)
    return seeded


def open_tab(browser: Any, stack: Any, run_id: str, **options: Any) -> Page:
    page = Page(browser, view_url(stack.url, PROJECT, run_id, stack.token), **options)
    page.wait_drawn()
    return page


def close_tab(page: Page, stack: Any) -> None:
    assert page.errors == [], page.errors
    assert page.hosts == {urlsplit(stack.url).netloc}, page.hosts
    page.page.close()


@pytest.fixture
def tab(browser: Any, seeded: Any) -> Iterator[Page]:
    page = open_tab(browser, seeded, RUN)
    yield page
    close_tab(page, seeded)


def test_the_page_opens_on_the_key_of_the_most_severe_finding(tab: Page, seeded: Any) -> None:
    findings = summary_of(seeded, RUN)["findings"]
    order = {"critical": 0, "warning": 1}
    named = sorted(
        (f for f in findings if f["key"] and f["severity"] in order), key=lambda f: order[f["severity"]]
    )
    assert named and tab.page.locator("#key-select").input_value() == named[0]["key"]


def test_findings_answer_the_questions_first(tab: Page) -> None:
    findings = tab.page.locator("#findings li")
    texts = findings.all_inner_texts()
    kinds = " ".join(texts)
    assert "stopped_reporting" in kinds and f"rank {STOPPED}" in kinds
    assert any(
        "persistent_outlier" in t and f"rank {SLOW}" in t and "system/step_time" in t for t in texts
    ), texts
    assert any("spike" in t and f"rank {SPIKE_RANK}" in t and "train/loss" in t for t in texts), texts
    assert "critical" in findings.first.get_attribute("class")  # most severe first
    box = tab.page.locator("#findings").bounding_box()
    assert box["y"] < tab.page.locator("#reducers").bounding_box()["y"]  # findings come first


def test_coverage_strip_shows_the_missing_rank_on_hover(tab: Page) -> None:
    canvas = tab.page.locator("#coverage-canvas")
    box = canvas.bounding_box()
    tab.page.mouse.move(box["x"] + box["width"] - 16, box["y"] + box["height"] / 2)  # the last column
    tip = tab.page.locator("#tip")
    tip.wait_for(state="visible")
    assert "7 of 8 ranks; missing: 5" in tip.inner_text()


CELL_COLOUR = """([rank, col, n]) => {
    const c = document.getElementById('heatmap'), d = window.devicePixelRatio || 1;
    const x = 56 + (col + 0.5) * (c.clientWidth - 56 - 14) / n, y = 4 + (rank + 0.5) * 16;
    return Array.from(c.getContext('2d').getImageData(Math.round(x * d), Math.round(y * d), 1, 1).data);
}"""


def test_heatmap_is_a_canvas_with_a_distinct_spike_cell(tab: Page) -> None:
    tab.page.select_option("#key-select", "train/loss")
    height = tab.page.evaluate("document.getElementById('heatmap').clientHeight")
    assert height == 4 + 8 * 16 + 22  # 8 rank rows of 16 px between the margins
    assert tab.page.locator("#heat-wrap *").count() <= 3  # drawn on the canvas, not a node per cell
    spike = tab.page.evaluate(CELL_COLOUR, [SPIKE_RANK, SPIKE_STEP, 60])
    neighbour = tab.page.evaluate(CELL_COLOUR, [SPIKE_RANK - 1, SPIKE_STEP, 60])
    # With 8 ranks plain z cannot pass sqrt(7) = 2.65, so the spike is deep orange, not the scale's end.
    assert spike[0] > 200 and spike[2] < 60, spike
    assert sum(abs(a - b) for a, b in zip(spike[:3], neighbour[:3], strict=True)) > 150


def test_the_outlier_table_lists_the_spike_first(tab: Page) -> None:
    tab.show_key("train/loss")
    assert tab.outlier_rows()[0] == (SPIKE_STEP, SPIKE_RANK)
    tab.page.locator("#outliers th", has_text="rank").click()  # sortable
    ranks = [rank for _, rank in tab.outlier_rows()]
    assert ranks == sorted(ranks)


def test_the_outlier_table_keeps_the_servers_order_by_size_of_score(browser: Any, clean: Any) -> None:
    summary = summary_of(clean, CLEAN_RUN)
    page = open_tab(browser, clean, CLEAN_RUN)
    for key in summary["keys"]:
        page.show_key(key)
        want = [(row["step"], row["rank"]) for row in summary["outliers"] if row["key"] == key]
        assert page.outlier_rows() == want, key  # low values (negative scores) included
    close_tab(page, clean)


def test_a_spikes_evidence_is_its_row_under_its_key(tab: Page) -> None:
    tab.page.check("#pause")  # a redraw from polling would take the highlight away
    tab.show_key("system/step_time")
    spike = tab.page.locator("#findings li", has_text="spike").filter(has_text="train/loss")
    spike.locator(".evidence").click()
    tab.page.locator(f'#outliers tr.focus[data-step="{SPIKE_STEP}"][data-rank="{SPIKE_RANK}"]').wait_for()
    assert tab.page.locator("#key-select").input_value() == "train/loss"


def test_the_outlier_table_shows_only_the_selected_keys_rows(tab: Page, seeded: Any) -> None:
    summary = summary_of(seeded, RUN)
    assert len({row["key"] for row in summary["outliers"]}) > 1  # else there would be nothing to leave out
    for key in summary["keys"]:
        tab.show_key(key)
        want = [(row["step"], row["rank"]) for row in summary["outliers"] if row["key"] == key]
        assert sorted(tab.outlier_rows()) == sorted(want), key


def test_key_and_window_live_in_the_url_and_redraw_the_charts(tab: Page) -> None:
    drawn = tab.wait_drawn()
    shown = tab.page.locator("#key-select").input_value()
    other = "train/loss" if shown == "system/step_time" else "system/step_time"
    tab.page.select_option("#key-select", other)
    drawn = tab.wait_drawn(drawn)
    assert f"key={other.replace('/', '%2F')}" in tab.page.url
    tab.page.fill("#step-min", "30")
    tab.page.dispatch_event("#step-min", "change")
    tab.page.locator("#meta", has_text="steps 30–59").wait_for()
    assert "step_min=30" in tab.page.url and "token" not in tab.page.url
    labels = tab.page.locator("#reducers svg text").all_text_contents()
    assert "30" in labels and "0" not in labels


def test_a_bad_token_shows_the_auth_state(browser: Any, seeded: Any) -> None:
    page = Page(browser, view_url(seeded.url, PROJECT, RUN, "not-the-token"))
    page.page.locator("#token-form").wait_for(state="visible")
    assert "The API token was not accepted" in page.page.locator("#status").inner_text()
    assert page.page.evaluate("sessionStorage.getItem('instantml_token')") is None
    page.page.fill("#token-input", seeded.token)
    page.page.click("#token-form button")
    page.wait_drawn()
    assert page.page.locator("#content").is_visible()
    page.page.close()


def test_a_run_without_events_says_so(browser: Any, seeded: Any) -> None:
    page = Page(browser, view_url(seeded.url, PROJECT, "nothing-yet", seeded.token))
    page.page.locator("#status", has_text="No rank events").wait_for()
    page.page.close()


def test_screenshot(tab: Page, tmp_path: Path) -> None:
    path = tmp_path / "distributed-tab.png"
    tab.page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 20_000


def mark_alarm(*rows: tuple[str, int, int]) -> SummaryPatch:
    """A summary patch: ``alarm`` true on the given (key, step, rank) rows, false on every other row."""

    def patch(summary: dict[str, Any]) -> None:
        for row in summary["outliers"]:
            row["alarm"] = (row["key"], row["step"], row["rank"]) in rows

    return patch


def drop_alarm(summary: dict[str, Any]) -> None:
    """A summary patch: the outlier rows of a server from before ``alarm``."""
    for row in summary["outliers"]:
        row.pop("alarm", None)


def test_a_clean_run_shows_its_largest_deviations_and_colours_none(browser: Any, clean: Any) -> None:
    summary = summary_of(clean, CLEAN_RUN)
    problems = [f for f in summary["findings"] if f["severity"] in ("warning", "critical")]
    assert problems == [], "the clean run is meant to have no problems"
    page = open_tab(browser, clean, CLEAN_RUN)
    for key in summary["keys"]:
        page.show_key(key)
        title, note = page.outlier_heading()
        assert title == "Largest deviations", key
        assert note.startswith(f"No rank stands out on {key}"), note
        assert page.coloured_rows("outliers") == [], key
        assert page.coloured_rows("rank-stats") == [], key
    close_tab(page, clean)


def test_a_row_with_an_alarm_makes_the_table_outliers_and_only_it_is_coloured(
    browser: Any, seeded: Any
) -> None:
    page = open_tab(browser, seeded, RUN, patch=mark_alarm(("train/loss", SPIKE_STEP, SPIKE_RANK)))
    page.show_key("train/loss")
    assert len(page.outlier_rows()) > 1  # other rows are there, uncoloured
    assert page.outlier_heading() == (
        "Outliers",
        "1 row is named by a warning or critical finding on train/loss (marked red).",
    )
    coloured = page.coloured_rows("outliers")
    assert [(int(cells[0]), int(cells[1])) for cells in coloured] == [(SPIKE_STEP, SPIKE_RANK)]
    page.show_key("system/step_time")  # no alarm on this key's rows: nothing to colour
    assert page.outlier_heading()[0] == "Largest deviations"
    assert page.coloured_rows("outliers") == []
    close_tab(page, seeded)


def test_rows_without_an_alarm_field_are_not_alarms(browser: Any, seeded: Any) -> None:
    page = open_tab(browser, seeded, RUN, patch=drop_alarm)
    page.show_key("train/loss")  # a spike finding names a row here; only `alarm` colours rows
    assert page.outlier_heading()[0] == "Largest deviations"
    assert page.coloured_rows("outliers") == []
    close_tab(page, seeded)


def test_rank_stats_colour_the_ranks_a_finding_names_on_the_key(tab: Page, seeded: Any) -> None:
    summary = summary_of(seeded, RUN)
    problems = [
        f for f in summary["findings"] if f["severity"] in ("warning", "critical") and f["rank"] is not None
    ]
    for key in summary["keys"]:
        tab.show_key(key)
        want = {f["rank"] for f in problems if f["key"] in (None, key)}
        coloured = {int(cells[0]) for cells in tab.coloured_rows("rank-stats")}
        assert coloured == want, key
        assert STOPPED in coloured, key  # a rank that stopped reporting is a problem on every key


HIDDEN_COLUMNS = """() => {
    const problems = [], page = document.documentElement;
    if (page.scrollWidth > page.clientWidth) problems.push(`page ${page.scrollWidth} > ${page.clientWidth}`);
    for (const id of ['outliers', 'rank-stats']) {
        const table = document.getElementById(id), box = table.parentElement;
        const rect = box.getBoundingClientRect(), right = rect.left + box.clientLeft + box.clientWidth;
        for (const e of [box, table]) {
            if (e.scrollWidth > e.clientWidth) problems.push(`${id} ${e.tagName}: ${e.scrollWidth}`);
        }
        for (const th of table.querySelectorAll('th')) {  // a scrollbar's width is no room for a column
            const r = th.getBoundingClientRect();
            if (r.left < rect.left || r.right > right + 0.5) problems.push(`${id} ${th.textContent}`);
        }
    }
    return problems;
}"""


def test_every_column_of_the_tables_is_readable_at_1400_px(browser: Any, clean: Any) -> None:
    for run_id in (CLEAN_RUN, RUN):
        page = open_tab(browser, clean, run_id, width=1400, height=900)
        for key in summary_of(clean, run_id)["keys"]:
            page.show_key(key)
            assert page.page.evaluate(HIDDEN_COLUMNS) == [], (run_id, key)
            for table, column in (("outliers", "score"), ("rank-stats", "outlier_steps")):
                box = page.page.locator(f"#{table} th", has_text=column).bounding_box()
                assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 1400, (table, box)
        close_tab(page, clean)
