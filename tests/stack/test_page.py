"""The Distributed tab in a real headless Chromium, against the local stack with two runs.

The seeded run has 8 ranks x 60 steps: rank 5 stops after step 40, rank 3 is 30% slower on
``system/step_time`` at every step, and rank 6 reports a ``train/loss`` spike at step 25.
The clean run is a healthy 8-rank job like the demo's: every rank draws from the same distributions.
"""

from __future__ import annotations

import base64
import json
import math
import random
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from infra.local import view_url
from instantml import routes
from shared.findings import worst_first
from tests.faults import wait_for

pytestmark = pytest.mark.browser  # headless Chromium (tests/browser.py)

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


def patch_run(stack: Any, run_id: str, body: dict[str, Any]) -> None:
    """``PATCH .../runs/{run_id}``: the run's config, or that it finished (as ``run.finish()`` sends it)."""
    request = urllib.request.Request(
        stack.url + routes.RUN.format(project=PROJECT, run_id=run_id),
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {stack.token}", "Content-Type": "application/json"},
        method="PATCH",
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def healthy_events(steps: range, ranks: int = 8, seed: int = 11) -> list[dict[str, Any]]:
    """A healthy job's events: ``a/lr`` is equal on every rank (it sorts first), the rest is noise."""
    rng = random.Random(seed)
    return [
        {
            "event_id": f"{step}-{rank}",
            "step": step,
            "rank": rank,
            "world_size": ranks,
            "weight": 1024 - 96 * (rank % 8),
            "metrics": {
                "a/lr": 3e-4,
                "train/loss": 2.0 - step / 100 + rng.gauss(0, 0.01),
                "system/step_time": 0.25 + abs(rng.gauss(0, 0.002)),
            },
        }
        for step in steps
        for rank in range(ranks)
    ]


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
        self,
        browser: Any,
        url: str,
        patch: SummaryPatch | None = None,
        width: int = 1280,
        height: int = 1400,
        clock: bool = False,
    ) -> None:
        # ``browser`` may be a context: pages of one context share what a user's browser shares.
        viewport = {"width": width, "height": height}
        is_context = hasattr(browser, "browser")  # a context's pages take its viewport
        self.page = browser.new_page() if is_context else browser.new_page(viewport=viewport)
        self.errors: list[str] = []
        self.hosts: set[str] = set()
        self.summaries: list[str] = []  # the query string of each summary request, in order
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", self._request)
        if clock:  # the page's timers (the 5 s refresh) run when the test says, not on the wall clock
            self.page.clock.install()
        if patch is not None:

            def fulfil(route: Any) -> None:
                summary = route.fetch().json()
                patch(summary)
                route.fulfill(status=200, json=summary)

            self.page.route(lambda url: urlsplit(url).path.endswith("/distributed"), fulfil)
        self.page.goto(url)

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def _request(self, request: Any) -> None:
        url = urlsplit(request.url)
        self.hosts.add(url.netloc)
        if url.path.endswith("/distributed"):
            self.summaries.append(url.query)

    def live_line(self) -> str:
        return str(self.page.locator("#live").inner_text())

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
    named = [f for f in worst_first(findings) if f["key"] and f["severity"] != "info"]
    assert named and tab.page.locator("#key-select").input_value() == named[0]["key"]


def test_findings_answer_the_questions_first(tab: Page) -> None:
    findings = tab.page.locator("#findings li")
    rows = findings.evaluate_all("(lis) => lis.map((li) => [li.dataset.kind || '', li.innerText])")
    assert any(kind == "stopped_reporting" and f"rank {STOPPED}" in t for kind, t in rows), rows
    assert any(
        kind == "persistent_outlier" and f"rank {SLOW}" in t and "system/step_time" in t for kind, t in rows
    ), rows
    assert any(kind == "spike" and f"rank {SPIKE_RANK}" in t and "train/loss" in t for kind, t in rows), rows
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
    const x = 66 + (col + 0.5) * (c.clientWidth - 66 - 14) / n, y = 4 + (rank + 0.5) * 16;
    return Array.from(c.getContext('2d').getImageData(Math.round(x * d), Math.round(y * d), 1, 1).data);
}"""


def test_heatmap_is_a_canvas_with_a_distinct_spike_cell(tab: Page) -> None:
    tab.show_key("train/loss")
    height = tab.page.evaluate("document.getElementById('heatmap').clientHeight")
    assert height == 4 + 8 * 16 + 34  # 8 rank rows of 16 px between the margins (steps and their title below)
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


def test_an_unknown_run_says_so_and_stops_asking(browser: Any, seeded: Any) -> None:
    page = Page(browser, view_url(seeded.url, PROJECT, "nothing-yet", seeded.token), clock=True)
    page.page.locator("#status", has_text=f"Project {PROJECT} has no run “nothing-yet”").wait_for()
    assert "no such run" in page.live_line()
    page.page.clock.run_for(60_000)  # twelve refreshes' worth of time
    assert len(page.summaries) == 1 and page.page.locator("#content").is_hidden()
    page.page.close()


def test_a_run_without_rank_events_yet_says_so_and_keeps_checking(browser: Any, seeded: Any) -> None:
    patch_run(seeded, "configured-only", {"config": {"lr": 3e-4}})  # the run exists, no rank event yet
    page = Page(browser, view_url(seeded.url, PROJECT, "configured-only", seeded.token), clock=True)
    page.page.locator("#status", has_text="No rank events for this run yet").wait_for()
    assert "live" in page.live_line()
    with page.page.expect_request(lambda r: urlsplit(r.url).path.endswith("/distributed")):
        page.page.clock.run_for(5_100)
    page.page.close()


def test_a_live_run_refreshes_and_a_finished_one_stops_and_says_so(browser: Any, seeded: Any) -> None:
    post_events(seeded, "ending", healthy_events(range(20)))
    page = Page(browser, view_url(seeded.url, PROJECT, "ending", seeded.token), clock=True)
    page.wait_drawn()
    assert page.page.locator("#badge").inner_text() == "live" and "every 5 s" in page.live_line()
    with page.page.expect_request(lambda r: urlsplit(r.url).path.endswith("/distributed")):
        page.page.clock.run_for(5_100)  # a live run is asked again
    patch_run(seeded, "ending", {"status": "finished"})
    page.page.clock.run_for(5_100)
    page.page.locator("#badge", has_text="finished").wait_for()
    page.page.locator("#live", has_text="finished · not refreshing").wait_for()
    asked = len(page.summaries)
    page.page.clock.run_for(120_000)
    assert len(page.summaries) == asked  # not one request more
    close_tab(page, seeded)


def test_a_window_with_step_min_above_step_max_is_an_error_in_place_of_the_data(tab: Page) -> None:
    tab.page.clock.install()
    tab.page.fill("#step-min", "50")
    tab.page.dispatch_event("#step-min", "change")
    tab.page.fill("#step-max", "10")
    tab.page.dispatch_event("#step-max", "change")
    error = tab.page.locator("#input-error")
    error.wait_for(state="visible")
    assert error.inner_text().startswith("step_min (50) is above step_max (10)")
    assert tab.page.locator("#data").is_hidden() and tab.page.locator("#findings").is_hidden()
    assert "until the input is corrected" in tab.live_line()
    asked = len(tab.summaries)
    tab.page.clock.run_for(60_000)
    assert len(tab.summaries) == asked  # not asked again
    assert not [q for q in tab.summaries if "step_max=10" in q]  # nor ever: the page knew it was empty
    assert "step_min=50" in tab.page.url and "step_max=10" in tab.page.url
    assert tab.page.locator("#meta").inner_text() == ""  # no figures of a summary that is not the one asked
    tab.page.fill("#step-max", "")
    tab.page.dispatch_event("#step-max", "change")
    tab.page.locator("#meta", has_text="steps 50–59").wait_for()
    assert error.is_hidden() and tab.page.locator("#data").is_visible()


def test_a_typo_in_only_keys_names_it_and_the_keys_there_are(browser: Any, seeded: Any) -> None:
    url = view_url(seeded.url, PROJECT, RUN, seeded.token) + "&keys=nope"
    page = Page(browser, url, clock=True)
    error = page.page.locator("#input-error")
    error.wait_for(state="visible")
    assert "no key “nope”" in error.inner_text()
    assert page.page.locator("#data").is_hidden() and "No rank stands out" not in page.page.inner_text("body")
    page.page.clock.run_for(60_000)
    assert len(page.summaries) == 1
    page.page.fill("#keys-filter", "train/loss")
    page.page.dispatch_event("#keys-filter", "change")
    page.wait_drawn()
    assert page.page.locator("#key-select option").all_inner_texts() == ["train/loss"]
    close_tab(page, seeded)


def drag(page: Page, selector: str, start: float, end: float) -> None:
    """Drag across an element from ``start`` to ``end`` of its plot's width (0-1), at mid height."""
    box = page.page.locator(selector).bounding_box()
    left, width, y = box["x"] + 66, box["width"] - 66 - 14, box["y"] + box["height"] / 3
    page.page.mouse.move(left + start * width, y)
    page.page.mouse.down()
    page.page.mouse.move(left + end * width, y, steps=6)
    page.page.mouse.up()


def test_dragging_across_the_chart_zooms_on_those_steps_and_reset_shows_all(tab: Page) -> None:
    drawn = tab.wait_drawn()
    drag(tab, "#reducers svg", 0.505, 0.745)  # columns 30-44 of 60
    drawn = tab.wait_drawn(drawn)
    assert "step_min=30" in tab.page.url and "step_max=44" in tab.page.url, tab.page.url
    tab.page.locator("#meta", has_text="steps 30–44").wait_for()
    labels = tab.page.locator("#reducers svg text").all_text_contents()
    assert "30" in labels and "40" in labels and "step" in labels  # round ticks and the axis title
    drag(tab, "#heatmap", 0.005, 0.395)  # the heatmap zooms too: columns 30-35 of the 15
    drawn = tab.wait_drawn(drawn)
    tab.page.locator("#meta", has_text="steps 30–35").wait_for()
    tab.page.click("#zoom-reset")
    tab.wait_drawn(drawn)
    tab.page.locator("#meta", has_text="steps 0–59").wait_for()
    assert "step_min" not in tab.page.url and tab.page.locator("#zoom-reset").is_hidden()


RANK_LINE = r"""(key) => {
    const line = `#rank-series .series[data-key="${key}"] path.rank-line`;
    const d = document.querySelector(line).getAttribute('d');
    return d.match(/[ML]([\d.]+),([\d.]+)/g).length;
}"""


def test_clicking_a_heatmap_row_plots_that_ranks_series_on_every_key(tab: Page, seeded: Any) -> None:
    tab.show_key("system/step_time")
    box = tab.page.locator("#heatmap").bounding_box()
    tab.page.mouse.click(box["x"] + box["width"] / 2, box["y"] + 4 + (SLOW + 0.5) * 16)
    tab.page.locator(f'body[data-rank-drawn="{SLOW}"]').wait_for(state="attached")
    assert f"rank={SLOW}" in tab.page.url
    title = tab.page.locator("#rank-title").text_content() or ""
    assert title.startswith(f"Rank {SLOW} against the other ranks"), title
    keys = summary_of(seeded, RUN)["keys"]
    assert (
        tab.page.locator("#rank-series .series").evaluate_all("(ds) => ds.map((d) => d.dataset.key)") == keys
    )
    assert tab.page.evaluate(RANK_LINE, "system/step_time") == 60  # one point a step
    # Its hover says its own value against the others'
    series = tab.page.locator('#rank-series .series[data-key="system/step_time"] svg').bounding_box()
    tab.page.mouse.move(series["x"] + series["width"] / 2, series["y"] + 60)
    tip = tab.page.locator("#tip")
    tip.wait_for(state="visible")
    assert f"rank {SLOW} · step" in tip.inner_text() and "this rank 0.3" in tip.inner_text(), tip.inner_text()
    tab.page.click("#rank-close")
    assert tab.page.locator("#rank-section").is_hidden() and "rank=" not in tab.page.url


def test_a_rank_in_a_finding_and_a_rank_stats_row_open_its_series(tab: Page) -> None:
    tab.page.locator("#findings li[data-kind='stopped_reporting'] a.rank-link").click()
    tab.page.locator(f'body[data-rank-drawn="{STOPPED}"]').wait_for(state="attached")
    # rank 5 stopped after step 40: its line ends there, 41 points
    assert tab.page.evaluate(RANK_LINE, "train/loss") == 41
    tab.page.locator("#rank-stats tbody tr[data-rank='2']").click()
    tab.page.locator('body[data-rank-drawn="2"]').wait_for(state="attached")
    assert tab.page.locator("#rank-stats tr.selected").get_attribute("data-rank") == "2"


def test_a_link_opened_in_a_fresh_page_of_the_same_context_restores_the_view(
    browser: Any, seeded: Any
) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 1400})
    first = Page(context, view_url(seeded.url, PROJECT, RUN, seeded.token))
    first.wait_drawn()
    first.page.select_option("#key-select", "train/loss")
    first.page.check("#log-scale")
    first.page.select_option("#smooth", "0.8")
    first.page.fill("#rank-input", str(SLOW))
    first.page.dispatch_event("#rank-input", "change")
    for arrow in ("▲", "▼"):  # ascending, then descending
        first.page.locator("#rank-stats th", has_text="mean_z").dispatch_event("click")
        first.page.locator("#rank-stats th", has_text=f"mean_z\u00a0{arrow}").wait_for()
    first.page.check("#pause")
    first.page.fill("#step-min", "10")
    first.page.dispatch_event("#step-min", "change")
    first.page.locator("#meta", has_text="steps 10–59").wait_for()
    link = first.page.url
    assert "token" not in link and seeded.token not in link
    for part in (
        "key=train%2Floss",
        "log=1",
        "smooth=0.8",
        f"rank={SLOW}",
        "sort=mean_z%3Adesc",
        "live=0",
        "step_min=10",
    ):
        assert part in link, (part, link)
    second = Page(context, link)
    if second.page.locator("#token-form").is_visible():  # a sign-in that does not carry to a new tab
        second.page.fill("#token-input", seeded.token)
        second.page.click("#token-form button")
    second.wait_drawn()
    assert second.page.url == link
    assert second.page.locator("#key-select").input_value() == "train/loss"
    assert second.page.locator("#log-scale").is_checked() and second.page.locator("#pause").is_checked()
    assert second.page.locator("#smooth").input_value() == "0.8"
    assert second.page.locator("#rank-section").is_visible()
    assert "mean_z\u00a0▼" in second.page.locator("#rank-stats th", has_text="mean_z").inner_text()
    assert "paused" in second.live_line()
    second.page.locator("#meta", has_text="steps 10–59").wait_for()
    first.page.close()
    second.page.close()
    context.close()


def test_the_view_follows_the_fragment_when_it_changes(tab: Page) -> None:
    drawn = tab.wait_drawn()
    url = tab.page.url.split("#")[0]
    tab.page.goto(url + f"#key=system%2Fstep_time&rank={SPIKE_RANK}")
    tab.wait_drawn(drawn)
    assert tab.page.locator("#key-select").input_value() == "system/step_time"
    tab.page.locator(f'#rank-title:has-text("Rank {SPIKE_RANK} ")').wait_for()


def test_evidence_sort_and_scroll_survive_a_refresh(browser: Any, seeded: Any) -> None:
    post_events(seeded, "growing", [dict(e, event_id="g" + e["event_id"]) for e in _slow_rank(range(30))])
    page = Page(browser, view_url(seeded.url, PROJECT, "growing", seeded.token), clock=True, height=700)
    drawn = page.wait_drawn()
    slow = page.page.locator("#findings li[data-kind='persistent_outlier']")
    slow.locator(".evidence").click()
    outline = page.page.locator("#hl")
    assert outline.is_visible()
    page.page.locator("#rank-stats th", has_text="last_step").click()
    page.page.locator("#rank-stats th", has_text="last_step").click()
    page.page.evaluate("document.querySelector('#rank-stats').parentElement.scrollTop = 60")
    where = outline.bounding_box()
    post_events(seeded, "growing", [dict(e, event_id="g" + e["event_id"]) for e in _slow_rank(range(30, 40))])
    page.page.clock.run_for(5_100)
    page.wait_drawn(drawn)
    page.page.locator("#meta", has_text="steps 0–39").wait_for()
    # the outline stays, and where the window shows it: what is above it may have grown or shrunk
    assert outline.is_visible() and outline.bounding_box()["y"] == where["y"]
    assert "last_step\u00a0▼" in page.page.locator("#rank-stats th", has_text="last_step").inner_text()
    assert page.page.evaluate("document.querySelector('#rank-stats').parentElement.scrollTop") == 60
    close_tab(page, seeded)


def _slow_rank(steps: range) -> list[dict[str, Any]]:
    """32 ranks; rank 3 is 30% slower at every step (a persistent outlier)."""
    rng = random.Random(5)
    return [
        {
            "event_id": f"{step}-{rank}",
            "step": step,
            "rank": rank,
            "world_size": 32,
            "metrics": {"system/step_time": 0.25 * (1.3 if rank == SLOW else 1.0) + rng.gauss(0, 0.002)},
        }
        for step in steps
        for rank in range(32)
    ]


def test_the_tab_opens_on_a_key_that_says_something_not_on_one_equal_on_every_rank(
    browser: Any, seeded: Any
) -> None:
    post_events(seeded, "equal-lr", healthy_events(range(40)))
    summary = summary_of(seeded, "equal-lr")
    assert summary["keys"][0] == "a/lr" and [f for f in summary["findings"] if f["key"] == "a/lr"] == []
    page = open_tab(browser, seeded, "equal-lr")
    chosen = page.page.locator("#key-select").input_value()
    named = [f["key"] for f in summary["findings"] if f["key"]]
    assert chosen != "a/lr" and (chosen == named[0] if named else chosen == summary["keys"][1])
    page.show_key("a/lr")  # equal on every rank: a white heatmap (z 0), not rounding noise
    assert page.page.evaluate(CELL_COLOUR, [3, 10, 40])[:3] == [247, 247, 247]
    close_tab(page, seeded)


def test_finding_tags_read_as_words_and_say_what_to_look_at_next(tab: Page) -> None:
    slow = tab.page.locator("#findings li[data-kind='persistent_outlier']")
    where = slow.locator(".where").inner_text()
    assert where.startswith(
        f"Apart from the other ranks · rank {SLOW} · on system/step_time · throughout, from step 0"
    )
    assert slow.locator(".next").inner_text().startswith(f"Look next: the host of rank {SLOW}")
    stopped = tab.page.locator("#findings li[data-kind='stopped_reporting'] .where").inner_text()
    assert f"rank {STOPPED}" in stopped and "last reported step 40" in stopped
    assert "at step 25" in tab.page.locator("#findings li[data-kind='spike'] .where").inner_text()
    columns = tab.page.locator("#outliers-columns").inner_text()
    assert "z:" in columns and "score:" in columns and "MAD" in columns
    assert "robust score" in (tab.page.locator("#outliers th", has_text="score").get_attribute("title") or "")


def test_a_finding_about_a_rank_names_the_host_its_process_said(
    browser: Any, seeded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each process of an 8-rank job started by a launcher (RANK, WORLD_SIZE, LOCAL_RANK) says its host
    once, at im.init, through the real client and the real PATCH route; the finding about the slow rank
    names that host, in the summary and on the tab (its place and what to look at next)."""
    import instantml as im
    from instantml.run import LAUNCHER_VARIABLES

    run_id, host = "hosts", socket.gethostname()
    for name in (n for names in LAUNCHER_VARIABLES.values() for n in names):
        monkeypatch.delenv(name, raising=False)
    rng = random.Random(5)
    for rank in (*range(1, 8), 0):  # rank 0 last: its finish() marks the run finished
        for name, value in (("RANK", rank), ("WORLD_SIZE", 8), ("LOCAL_RANK", rank)):
            monkeypatch.setenv(name, str(value))
        run = im.init(project=PROJECT, run_id=run_id, api_url=seeded.url, api_key=seeded.token)
        for step in range(60):
            step_time = 0.25 * (1.3 if rank == SLOW else 1.0) + rng.gauss(0, 0.002)
            run.log_rank_metrics(
                {"train/loss": 2.0 - step / 100 + rng.gauss(0, 0.01), "system/step_time": step_time},
                step=step,
            )
        run.finish()

    def slow_finding() -> dict[str, Any] | None:
        rows = [f for f in summary_of(seeded, run_id)["findings"] if f["kind"] == "persistent_outlier"]
        return rows[0] if rows and rows[0]["rank"] == SLOW else None

    wait_for(slow_finding, timeout=60, what="the finding on the slow rank, every rank counted")
    finding = slow_finding()
    assert finding is not None and finding["host"] == host, finding
    assert finding["message"].endswith(f"; rank {SLOW} runs on host {host}"), finding["message"]
    page = Page(browser, view_url(seeded.url, PROJECT, run_id, seeded.token))
    page.wait_drawn()
    slow = page.page.locator("#findings li[data-kind='persistent_outlier']")
    assert f"rank {SLOW} · host {host} · on system/step_time" in slow.locator(".where").inner_text()
    assert slow.locator(".next").inner_text().startswith(f"Look next: host {host} (rank {SLOW}'s)")
    assert f"runs on host {host}" in slow.inner_text()
    assert page.errors == []
    page.page.close()


def strip_tip(page: Any, rank: int, ranks: int = 4) -> str:
    """Hover rank ``rank``'s cell of the tab's processes strip (of ``ranks`` cells); the tip it shows."""
    page.page.locator("#procs-section").wait_for(state="visible")
    box = page.page.locator("#procs-canvas").bounding_box()
    assert box is not None
    left, cell = box["x"] + 66, (box["width"] - 66 - 14) / ranks  # view.html's L and R margins
    page.page.mouse.move(left + cell * (rank + 0.5), box["y"] + box["height"] / 2)
    tip = page.page.locator("#tip")
    tip.wait_for(state="visible")
    return str(tip.inner_text())


def test_the_processes_strip_says_each_ranks_state_and_what_it_said_and_marks_the_restart(
    browser: Any, seeded: Any
) -> None:
    """Contract 8 on the tab: one cell per rank (an exception, the launcher's SIGTERMs), a silent rank's
    stack on hover, and a restart marked on the coverage row, from real process records through the
    real PATCH route and the watch."""
    ended, silent = "procs-ended", "procs-silent"
    post_events(seeded, ended, healthy_events(range(30), ranks=4))
    post_events(seeded, silent, healthy_events(range(30), ranks=4))
    now = time.time()

    def record(run_id: str, rank: int, state: str, at: float, pid: int = 0, **fields: Any) -> None:
        who = {"rank": rank, "world_size": 4, "pid": pid or 100 + rank}
        patch_run(seeded, run_id, {"process": {**who, "state": state, **fields}, "time": at})

    for rank in range(4):
        record(ended, rank, "started", now - 60, first_step=0)
    oom = {"type": "RuntimeError", "message": "CUDA out of memory", "where": "train.py:40 forward"}
    record(ended, 1, "ended", now - 20, how="exception", exception=oom, step=29)
    for rank in (0, 2, 3):
        record(ended, rank, "ended", now - 19, how="signal", signal="SIGTERM", step=29)
    record(silent, 0, "started", now - 120, attempt=0, first_step=0)
    for rank in range(4):  # every rank started again, at step 10: a restart
        record(silent, rank, "started", now - 60, pid=200 + rank, attempt=1, first_step=10)
    stack = ["train.py:80 main", "train.py:41 load_batch", "queue.py:180 get"]
    record(silent, 3, "beat", now, pid=203, attempt=1, step=29, silent_s=40.0, every=30.0, stack=stack)
    wait_for(
        lambda: any(f["kind"] == "restarted" for f in summary_of(seeded, silent)["findings"]),
        60,
        "the watch's restarted row",
    )
    page = open_tab(browser, seeded, ended)
    page.page.locator("#procs-section").wait_for(state="visible")
    legend = page.page.locator("#procs-legend").inner_text()
    assert "ended: failed: 1" in legend and "ended by a signal: 3" in legend, legend
    text = strip_tip(page, 1)
    assert text.startswith("rank 1 · ended: failed · pid 101")
    assert "RuntimeError: CUDA out of memory at train.py:40 forward" in text
    close_tab(page, seeded)
    page = open_tab(browser, seeded, silent)
    text = strip_tip(page, 3)
    assert text.startswith("rank 3 · s") and "its main thread:" in text, text  # silent, or stuck
    assert text.index("queue.py:180 get") < text.index("train.py:80 main")  # innermost first
    assert "restarted at step 10" in page.page.locator("#coverage-note").inner_text()
    close_tab(page, seeded)


def test_the_processes_strip_shows_the_ranks_an_elastic_restart_left_behind_as_vanished(
    browser: Any, seeded: Any
) -> None:
    """A world of 4 restarted as a world of 2 (a lost node): ranks 2 and 3 never ended and never came
    back. Their cells say ``vanished`` (not running), and why, on hover."""
    run_id = "procs-shrunk"
    post_events(seeded, run_id, healthy_events(range(30), ranks=2))
    now = time.time()
    for rank in range(4):
        process = {"rank": rank, "world_size": 4, "pid": 100 + rank, "state": "started", "first_step": 0}
        patch_run(seeded, run_id, {"process": process, "time": now - 60})
    for rank in range(2):
        process = {"rank": rank, "world_size": 2, "pid": 200 + rank, "attempt": 1, "state": "started"}
        patch_run(seeded, run_id, {"process": {**process, "first_step": 10}, "time": now - 30})
    page = open_tab(browser, seeded, run_id)
    page.page.locator("#procs-section").wait_for(state="visible")
    legend = page.page.locator("#procs-legend").inner_text()
    assert "running: 2" in legend and "vanished: 2" in legend, legend
    text = strip_tip(page, 2)
    assert text.startswith("rank 2 · vanished · pid 102"), text
    assert "never ended; attempt 0, the job started again without it" in text
    close_tab(page, seeded)


# Decodes a PNG (base64) with the browser's own decoder and counts the distinct colours in a rectangle.
DECODED_PNG = """async ([data, box]) => {
    const image = await createImageBitmap(await (await fetch('data:image/png;base64,' + data)).blob());
    const canvas = new OffscreenCanvas(image.width, image.height), context = canvas.getContext('2d');
    context.drawImage(image, 0, 0);
    const pixels = context.getImageData(box.x, box.y, box.width, box.height).data, colours = new Set();
    for (let i = 0; i < pixels.length; i += 4) {
        colours.add((pixels[i] << 16) | (pixels[i + 1] << 8) | pixels[i + 2]);
    }
    return {width: image.width, height: image.height, colours: colours.size};
}"""


def test_a_full_page_screenshot_is_the_whole_page_with_the_heatmap_drawn(browser: Any, tab: Page) -> None:
    """What a user who saves or shares the page sees: the whole page, the heatmap's cells in it."""
    tab.show_key("train/loss")
    png = tab.page.screenshot(full_page=True)
    width, height, scale = tab.page.evaluate(
        "[document.documentElement.clientWidth, document.documentElement.scrollHeight, devicePixelRatio]"
    )
    # The cells only (CELL_COLOUR's geometry: 66 px of rank labels left, 14 right, rows of 16 px from 4).
    heatmap = tab.page.evaluate(
        """() => { const r = document.getElementById('heatmap').getBoundingClientRect();
        return {x: r.x + scrollX + 66, y: r.y + scrollY + 4, width: r.width - 66 - 14, height: 8 * 16}; }"""
    )
    box = {k: round(v * scale) for k, v in heatmap.items()}
    decoder = browser.new_page()  # a blank page: no content policy between it and a data: URL
    try:
        shot = decoder.evaluate(DECODED_PNG, [base64.b64encode(png).decode(), box])
    finally:
        decoder.close()
    assert shot["height"] == round(height * scale), (shot, height)  # the whole length of the page
    # Its width, less the vertical scrollbar's that headless Chromium leaves out of full-page shots.
    assert round((width - 20) * scale) <= shot["width"] <= round(width * scale), (shot, width)
    assert box["width"] > 0, heatmap
    assert box["height"] > 0, heatmap
    # 8 ranks by 60 steps on a diverging colour scale, a spike among them: a blank canvas has one colour.
    assert shot["colours"] >= 20, shot


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


def is_summary(response: Any) -> bool:
    return urlsplit(str(response.url)).path.endswith("/distributed")


DRAWING = """() => [
    document.getElementById('heatmap').toDataURL(), document.getElementById('coverage-canvas').toDataURL(),
    ...['reducers', 'rank-stats', 'outliers', 'findings'].map((id) => document.getElementById(id).innerHTML),
]"""


def test_the_heatmap_travels_as_base64_and_draws_as_the_lists_do(browser: Any, seeded: Any) -> None:
    base64 = open_tab(browser, seeded, RUN)
    assert base64.summaries and all("heatmap=base64" in q for q in base64.summaries), base64.summaries
    base64.show_key("train/loss")

    def as_lists(route: Any) -> None:  # the same request, answered in the contract's lists form
        url = route.request.url.replace("heatmap=base64", "heatmap=lists")
        route.fulfill(response=route.fetch(url=url))

    lists = Page(browser, view_url(seeded.url, PROJECT, RUN, seeded.token))
    lists.page.route(lambda url: urlsplit(url).path.endswith("/distributed"), as_lists)
    lists.page.reload()
    lists.wait_drawn()
    lists.show_key("train/loss")
    assert base64.page.evaluate(DRAWING) == lists.page.evaluate(DRAWING)
    close_tab(base64, seeded)
    close_tab(lists, seeded)


def test_a_refresh_moves_only_what_changed_and_draws_what_a_full_load_draws(
    browser: Any, seeded: Any
) -> None:
    post_events(seeded, "delta", [dict(e, event_id="d" + e["event_id"]) for e in _slow_rank(range(30))])
    page = Page(browser, view_url(seeded.url, PROJECT, "delta", seeded.token), clock=True)
    drawn = page.wait_drawn()
    with page.page.expect_response(is_summary) as unchanged:
        page.page.clock.run_for(5_100)
    assert "since=" in urlsplit(unchanged.value.url).query
    assert set(unchanged.value.json()) == {"version", "unchanged"}
    post_events(seeded, "delta", [dict(e, event_id="d" + e["event_id"]) for e in _slow_rank(range(30, 36))])
    with page.page.expect_response(is_summary) as delta:
        page.page.clock.run_for(5_100)
    body = delta.value.json()
    assert body["since"] and body["from_column"] <= 30 and len(body["steps"]) < 36, body["steps"]
    page.wait_drawn(drawn)
    page.page.locator("#meta", has_text="steps 0–35").wait_for()
    fresh = open_tab(browser, seeded, "delta")
    assert page.page.evaluate(DRAWING) == fresh.page.evaluate(DRAWING)
    close_tab(page, seeded)
    close_tab(fresh, seeded)


def test_a_long_rank_table_draws_the_rows_in_view_and_every_rank_is_reachable(
    browser: Any, seeded: Any
) -> None:
    post_events(seeded, "wide", healthy_events(range(6), ranks=200))
    page = open_tab(browser, seeded, "wide")
    rows = page.page.locator("#rank-stats tbody tr[data-rank]")
    assert 0 < rows.count() < 200  # the rows near the view, not all 200
    box = page.page.locator("#rank-stats").evaluate("(t) => t.parentElement.scrollHeight")
    assert box > 200 * 20  # spacers keep the height of every row, so the scrollbar is true
    page.page.locator("#rank-stats").evaluate(
        "(t) => { t.parentElement.scrollTop = t.parentElement.scrollHeight; }"
    )
    last = page.page.locator("#rank-stats tbody tr[data-rank='199']")
    last.wait_for()
    last.click()
    page.page.locator('body[data-rank-drawn="199"]').wait_for(state="attached")
    assert "rank=199" in page.page.url
    close_tab(page, seeded)


def test_a_leaking_rank_reads_as_memory_growth_with_its_forecast_and_the_keys_units(
    browser: Any, seeded: Any
) -> None:
    """System metrics (contract 2) in the tab: the samples as the client logs them (an event of their own
    every 10 steps, at a step the rank logged), rank 2 keeping 5 MB a step; the finding in words with the
    forecast, what to look at next, and the keys with their units."""
    run_id, leaking = "system-leak", 2
    events = healthy_events(range(240))
    for step in range(0, 240, 10):
        for rank in range(8):
            rss = 2_000.0 + rank + (5.0 * step if rank == leaking else 0.0)
            sample = {"system/rss_mb": rss, "system/cpu_percent": 97.0, "system/memory_limit_mb": 16_384.0}
            event = {"event_id": f"s{step}-{rank}", "step": step, "rank": rank, "world_size": 8}
            events.append({**event, "metrics": sample})
    post_events(seeded, run_id, events)
    page = open_tab(browser, seeded, run_id)
    growth = page.page.locator("#findings li[data-kind='memory_growth']")
    where = growth.locator(".where").inner_text()
    assert where.startswith(f"Memory keeps growing · rank {leaking} · on system/rss_mb · to step 230"), where
    assert "reaches its limit of 16,384 MB at about step" in growth.inner_text()
    assert growth.locator(".next").inner_text().startswith(f"Look next: what rank {leaking}'s process keeps")
    options = page.page.locator("#key-select option").all_inner_texts()
    assert {"system/rss_mb (MB)", "system/cpu_percent (%)", "system/step_time (s)"} <= set(options), options
    assert page.page.locator("#findings li.warning, #findings li.critical").count() == 1
    close_tab(page, seeded)
