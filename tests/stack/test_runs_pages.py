"""The runs page and the run page (issue 15) in a real headless Chromium, against the real local stack.

Three parts:

- the data: seeded through the real HTTP API of ``infra.local.LocalStack`` (the ``local_stack`` fixture
  of tests/conftest.py: SQLite in a temporary directory, the real handlers and authorizer) with the
  routes a client uses: rank-metrics and scalars batches, ``PATCH .../runs/{run_id}`` for a config and
  for ``{"status": "finished"}``. Idle and older runs are events with a ``time`` in the past. Each test
  (or group of tests) has its own project, so no test depends on another's data.
- ``RunsPage`` / ``RunPage``: drive a page and read what it shows.
- the tests, which compare what the pages show with what the API answers (fetched with the same token).
"""

from __future__ import annotations

import io
import math
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import pytest

from instantml import routes
from instantml.api import Api
from instantml.commands.export import list_runs
from shared.findings.clock import SILENT_MIN_S
from tests.compare_seed import rank_events, seed_run
from tests.faults import call, wait_for

pytestmark = pytest.mark.browser  # headless Chromium (tests/browser.py)

if TYPE_CHECKING:
    from infra.local import LocalStack

# The projects of this file (no other test uses these names).
PROJECT, EMPTY_PROJECT, BIG_PROJECT = "runs-pages-main", "runs-pages-empty", "runs-pages-big"
LIVE_PROJECT, TOKEN_PROJECT = "runs-pages-live", "runs-pages-token"
SIGN_IN_PROJECT, NEW_RUN_PROJECT, COMPARE_PROJECT = (
    "runs-pages-sign-in",
    "runs-pages-new",
    "runs-pages-compare",
)
COMPARE_LIVE_PROJECT, PROCESSES_PROJECT = "runs-pages-compare-live", "runs-pages-processes"
LIVE_RUN, IDLE_RUN, DONE_RUN, CONFIG_ONLY_RUN = "alpha", "beta", "gamma", "no-events-yet"
CONFIG = {"lr": 0.0003, "model": {"name": "gpt2", "layers": 12, "head": {"dropout": 0.1}}, "tags": ["a", "b"]}
SWEEP = 60  # finished runs after the four above: the project has more runs than the page's first 50
BIG = 1000

# ---------------------------------------------------------------------------------------------------
# Seeding through the API.
# ---------------------------------------------------------------------------------------------------


def send(stack: LocalStack, method: str, route: str, project: str, run_id: str, body: Any = None) -> Any:
    """A request for a run that must succeed; the decoded answer."""
    path = route.format(project=quote(project, safe=""), run_id=quote(run_id, safe=""))
    status, answer = call(stack, method, path, body)
    assert 200 <= status < 300, (method, path, status, answer)
    if isinstance(answer, dict) and "rejected" in answer:
        assert answer["rejected"] == 0, answer
    return answer


def log_ranks(
    stack: LocalStack,
    project: str,
    run_id: str,
    step: int,
    ranks: range,
    world_size: int,
    at: float | None = None,
    nan_rank: int | None = None,
) -> None:
    """One rank-metrics batch: an event of each of ``ranks`` at ``step`` (at ``at``, else now), with a
    NaN loss from ``nan_rank``."""
    events = [
        {
            "event_id": f"{run_id}-{step}-{rank}",
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "metrics": {"train/loss": "NaN" if rank == nan_rank else 1.0 + rank / 100},
            **({} if at is None else {"time": at}),
        }
        for rank in ranks
    ]
    send(stack, "POST", routes.RANK_METRICS_BATCH, project, run_id, {"events": events})


def update(stack: LocalStack, project: str, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = send(stack, "PATCH", routes.RUN, project, run_id, body)
    return record


def summarize(stack: LocalStack, project: str, run_id: str) -> None:
    """A full summary of the run: the server records its findings counts on the run's record."""
    send(stack, "GET", routes.DISTRIBUTED, project, run_id)


Point = tuple[int, float | str]  # (step, value); NaN/Infinity as the contract's strings


def scalar_data() -> dict[tuple[str, int], list[Point]]:
    loss0: list[Point] = [(s, 2.0 * math.exp(-s / 80) + 0.1) for s in range(0, 1200, 10)]  # 120 points
    loss1: list[Point] = [(s, 2.1 * math.exp(-s / 80) + 0.12) for s in range(0, 1200, 10)]
    lr: list[Point] = [(s, 3e-4 * min(1.0, (s + 1) / 100)) for s in range(1000)]  # bins of 4 at max 300
    acc: list[Point] = [(s, 0.5 + s / 4000) for s in range(0, 1200, 120)]  # 10 points, 2 not finite
    acc[3] = (acc[3][0], "NaN")
    acc[6] = (acc[6][0], "Infinity")
    return {("lr", 0): lr, ("train/loss", 0): loss0, ("train/loss", 1): loss1, ("val/acc", 0): acc}


def log_scalars(stack: LocalStack, project: str, run_id: str) -> None:
    events = [
        {"event_id": f"{key}-{rank}-{step}", "step": step, "rank": rank, "metrics": {key: value}}
        for (key, rank), points in scalar_data().items()
        for step, value in points
    ]
    for start in range(0, len(events), 500):
        send(stack, "POST", routes.SCALARS_BATCH, project, run_id, {"events": events[start : start + 500]})


@pytest.fixture(scope="module")
def stack(local_stack: LocalStack) -> LocalStack:
    return local_stack


@pytest.fixture(scope="module")
def project(stack: LocalStack) -> str:
    """PROJECT: a live run short of a rank (config, scalars, findings), an idle one, a finished one,
    one with only a config, and SWEEP older finished runs."""
    now = time.time()
    log_ranks(stack, PROJECT, LIVE_RUN, 1180, range(8), 8, nan_rank=3)  # a critical finding
    log_ranks(stack, PROJECT, LIVE_RUN, 1190, range(7), 8)  # rank 7 has not reported the last step
    update(stack, PROJECT, LIVE_RUN, {"config": CONFIG})
    log_scalars(stack, PROJECT, LIVE_RUN)
    summarize(stack, PROJECT, LIVE_RUN)
    log_ranks(stack, PROJECT, IDLE_RUN, 55, range(4), 4, now - 900)
    log_ranks(stack, PROJECT, DONE_RUN, 100, range(2), 2, now - 1200)
    update(stack, PROJECT, DONE_RUN, {"status": "finished", "time": now - 1200})
    summarize(stack, PROJECT, DONE_RUN)
    update(stack, PROJECT, CONFIG_ONLY_RUN, {"config": {"seed": 1}, "time": now - 1300})
    for i in range(SWEEP):
        at, world = now - 2000 - i * 60, 1 + i % 8
        log_ranks(stack, PROJECT, f"sweep-{i:03d}", i, range(world), world, at)
        update(stack, PROJECT, f"sweep-{i:03d}", {"status": "finished", "time": at})
    record = api_get(stack, f"/v1/projects/{PROJECT}/runs/{LIVE_RUN}")
    assert record["status"] == "live" and record["findings"]["critical"] > 0, record
    watched(stack, PROJECT)
    return PROJECT


def watched(stack: LocalStack, project: str) -> None:
    """Wait until the watch has looked at every run of ``project`` (nobody opens their tabs) once its
    events have settled: while a run's uploads may still be arriving, the watch judges only what every
    rank has reached (``shared.findings.clock.settled_step``)."""
    settled = time.time() + SILENT_MIN_S

    def final(r: dict[str, Any]) -> bool:  # a finished run's first look is its last
        return r["findings"] is not None and (r["status"] == "finished" or (r["findings_at"] or 0) > settled)

    wait_for(
        lambda: all(final(r) for r in all_runs(stack, project)),
        timeout=300,
        what=f"the watch's findings on every run of {project}",
    )


@pytest.fixture(scope="module")
def big_project(stack: LocalStack) -> str:
    """BIG_PROJECT: 1,000 runs, each from one tiny batch (a third finished, every 20th summarized)."""
    now = time.time()

    def seed(i: int) -> None:
        run_id, at, world = f"big-{i:04d}", now - 1000 - i, 1 + i % 8
        log_ranks(stack, BIG_PROJECT, run_id, i, range(1), world, at)
        if i % 3 == 0:
            update(stack, BIG_PROJECT, run_id, {"status": "finished", "time": at})
        if i % 20 == 0:
            summarize(stack, BIG_PROJECT, run_id)  # findings: info, one per rank that never reported

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(seed, range(BIG)))
    watched(stack, BIG_PROJECT)
    return BIG_PROJECT


def api_get(stack: LocalStack, path: str) -> Any:
    status, answer = call(stack, "GET", path)
    assert status == 200, (path, status, answer)
    return answer


def all_runs(stack: LocalStack, project: str, status: str | None = None) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = (
            "limit=200" + (f"&status={status}" if status else "") + (f"&cursor={cursor}" if cursor else "")
        )
        page = api_get(stack, f"/v1/projects/{quote(project, safe='')}/runs?{query}")
        runs += page["runs"]
        cursor = page["next_cursor"]
        if not cursor:
            return runs


def runs_view(stack: LocalStack, project: str, token: str | None = None) -> str:
    token = stack.token if token is None else token
    return f"{stack.url}/v1/projects/{quote(project, safe='')}/view" + (f"#token={token}" if token else "")


def run_view(stack: LocalStack, project: str, run_id: str, token: str | None = None) -> str:
    token = stack.token if token is None else token
    path = f"/v1/projects/{quote(project, safe='')}/runs/{quote(run_id, safe='')}/view"
    return f"{stack.url}{path}" + (f"#token={token}" if token else "")


# ---------------------------------------------------------------------------------------------------
# Page drivers: what a page shows, read the way a user would see it.
# ---------------------------------------------------------------------------------------------------


class Tab:
    """A browser tab that records console errors, each request's host and each API request's path?query."""

    def __init__(self, browser: Any, width: int = 1400, height: int = 1000) -> None:
        # ``browser`` may be a context (its pages share what a user's browser shares, and its viewport)
        is_context = hasattr(browser, "browser")
        self.page = (
            browser.new_page()
            if is_context
            else browser.new_page(viewport={"width": width, "height": height})
        )
        self.errors: list[str] = []
        self.hosts: set[str] = set()
        self.api: list[str] = []
        self.page.on("console", self.on_console)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", self.on_request)

    def on_console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def on_request(self, request: Any) -> None:
        url = urlsplit(request.url)
        self.hosts.add(url.netloc)
        if not url.path.endswith("/view"):
            self.api.append(url.path + ("?" + url.query if url.query else ""))

    def goto(self, url: str) -> None:
        self.page.goto(url)

    def drawn(self) -> int:
        return int(self.page.locator("body").get_attribute("data-drawn") or 0)

    def wait_drawn(self, after: int = 0) -> int:
        """Wait until the page has drawn more often than ``after`` times; the count it has reached."""
        # A locator, not wait_for_function: the CSP forbids the eval that the latter needs. Polling may
        # draw again meanwhile, so any count above ``after`` will do.
        later = "".join(f':not([data-drawn="{i}"])' for i in range(after + 1))
        self.page.locator(f"body[data-drawn]{later}").wait_for(state="attached", timeout=30_000)
        return self.drawn()

    def close(self, stack: LocalStack) -> None:
        assert self.errors == [], self.errors
        assert self.hosts == {urlsplit(stack.url).netloc}, self.hosts
        self.page.close()


class RunsPage(Tab):
    """The runs page's table and controls."""

    def open(self, url: str) -> RunsPage:
        self.goto(url)
        self.wait_drawn()
        return self

    def rows(self) -> list[dict[str, Any]]:
        cells: list[dict[str, Any]] = self.page.evaluate(
            """() => [...document.querySelectorAll('#rows tr')].map((tr) => ({
                 run: tr.dataset.run, cells: [...tr.children].map((td) => td.textContent),
                 run_href: tr.querySelector('a.run').href, dist_href: tr.querySelector('a.dist').href,
                 short: tr.querySelector('td.ranks').classList.contains('short') ? 'yes' : '',
                 findings_title: tr.children[5].title }))"""
        )
        return cells

    def run_ids(self) -> list[str]:
        ids: list[str] = self.page.evaluate(
            "[...document.querySelectorAll('#rows tr')].map((tr) => tr.dataset.run)"
        )
        return ids

    def row_count(self) -> int:
        return int(self.page.locator("body").get_attribute("data-rows") or 0)

    def wait_painted(self, after: int = 0) -> int:
        """Wait until a draw after the ``after``-th is on screen (the frame after it has run)."""
        later = "".join(f':not([data-painted="{i}"])' for i in range(after + 1))
        self.page.locator(f"body[data-painted]{later}").wait_for(state="attached", timeout=30_000)
        return int(self.page.locator("body").get_attribute("data-painted") or 0)

    def filter(self, status: str) -> None:
        drawn = self.drawn()
        self.page.select_option("#status-filter", status)
        self.wait_drawn(drawn)

    def load_more(self) -> None:
        drawn = self.drawn()
        self.page.click("#more")
        self.wait_drawn(drawn)

    def sort_by(self, label: str) -> None:
        drawn = self.drawn()
        self.page.locator("#head th", has_text=label).first.click()
        self.wait_drawn(drawn)


class RunPage(Tab):
    """The run page's header, config table and charts."""

    def open(self, url: str) -> RunPage:
        self.goto(url)
        self.wait_drawn()
        return self

    @classmethod
    def after_navigation(cls, tab: Tab) -> RunPage:
        """The run page that a click in ``tab`` opened (same browser tab, same recorders)."""
        page = cls.__new__(cls)
        page.__dict__.update(tab.__dict__)
        page.wait_drawn()
        return page

    def config(self) -> dict[str, str]:
        rows: list[list[str]] = self.page.evaluate(
            "[...document.querySelectorAll('#config tr')]"
            ".map((tr) => [...tr.children].map((c) => c.textContent))"
        )
        return dict(rows)

    def chart_keys(self) -> list[str]:
        keys: list[str] = self.page.evaluate(
            "[...document.querySelectorAll('.chart')].map((c) => c.dataset.key)"
        )
        return keys

    def mean_points(self) -> dict[tuple[str, int], int]:
        """(key, rank) -> the number of vertices of the chart's mean line, counted from its path."""
        paths: list[list[Any]] = self.page.evaluate(
            """() => [...document.querySelectorAll('.chart')].flatMap((c) =>
                 [...c.querySelectorAll('path.mean')]
                   .map((p) => [c.dataset.key, +p.dataset.rank, p.getAttribute('d')]))"""
        )
        return {(key, rank): len(re.findall(r"[ML]", d)) for key, rank, d in paths}

    def chart_text(self, key: str) -> str:
        return str(self.page.locator(f'.chart[data-key="{key}"]').inner_text())


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def runs_page(browser: Any, stack: LocalStack, project: str) -> Iterator[RunsPage]:
    page = RunsPage(browser).open(runs_view(stack, project))
    yield page
    page.close(stack)


def findings_cells(record: dict[str, Any]) -> list[str]:
    """The findings cell's parts as the runs page shows a record's counts."""
    f = record["findings"]
    return [str(f[severity]) for severity in ("critical", "warning", "info")]


def counts_shown(cell: str) -> list[str]:
    """The counts a findings cell shows ("1 / 0 / 2", then the worst finding's words if any)."""
    found = re.match(r"(\d+) / (\d+) / (\d+)", cell)
    return list(found.groups()) if found else [cell]


def test_the_runs_page_lists_the_projects_runs_with_links_to_each_run(
    runs_page: RunsPage, stack: LocalStack
) -> None:
    want = all_runs(stack, PROJECT)
    assert len(want) == 4 + SWEEP
    rows = runs_page.rows()
    assert [r["run"] for r in rows] == [r["run_id"] for r in want[:50]]  # newest activity first, one page
    base = f"{stack.url}/v1/projects/{PROJECT}/runs/"
    for row in rows:
        assert row["run_href"] == base + quote(row["run"], safe="") + "/view"
        assert row["dist_href"] == base + quote(row["run"], safe="") + "/distributed/view"
    assert "token" not in runs_page.page.url  # the fragment's token moved to session storage
    by_id = {r["run"]: r for r in rows}
    records = {r["run_id"]: r for r in want}
    live, record = by_id[LIVE_RUN], records[LIVE_RUN]
    assert (record["status"], record["ranks_reporting"], record["world_size"]) == ("live", 7, 8)
    assert live["cells"][1] == "live" and live["cells"][4] == "7 / 8" and live["short"] == "yes"
    assert live["cells"][3] == str(record["last_step"]) == "1190"
    assert counts_shown(live["cells"][5]) == findings_cells(record)
    # the worst finding in a word, from the watch: nobody opened this run's tab for it
    assert record["headline"] == "rank 3 NaN/Inf on train/loss" and live["cells"][5].endswith(
        record["headline"]
    )
    assert live["findings_title"].startswith("as of the last look")
    assert re.fullmatch(r"\d+ (s|min) ago", live["cells"][7]), live["cells"][7]
    done = by_id[DONE_RUN]
    assert done["cells"][1] == "finished" and counts_shown(done["cells"][5]) == findings_cells(
        records[DONE_RUN]
    )
    assert by_id[IDLE_RUN]["cells"][1] == records[IDLE_RUN]["status"] == "idle"
    assert counts_shown(by_id[IDLE_RUN]["cells"][5]) == findings_cells(records[IDLE_RUN]) == ["0", "0", "0"]
    assert by_id[IDLE_RUN]["short"] == ""
    assert by_id[IDLE_RUN]["cells"][4] == "4 / 4"
    assert by_id[CONFIG_ONLY_RUN]["cells"][2:5] == ["—", "—", "—"]


def test_clicking_a_run_opens_its_run_page_with_config_and_one_chart_per_key(
    browser: Any, stack: LocalStack, project: str
) -> None:
    page = RunsPage(browser).open(runs_view(stack, project))
    page.page.click(f'#rows tr[data-run="{LIVE_RUN}"] a.run')
    page.page.wait_for_url(re.compile(rf"/runs/{LIVE_RUN}/view$"))
    run = RunPage.after_navigation(page)
    assert run.config() == {
        "lr": "0.0003",
        "model.name": "gpt2",
        "model.layers": "12",
        "model.head.dropout": "0.1",
        "tags": '["a","b"]',
    }
    scalars = api_get(stack, f"/v1/projects/{project}/runs/{LIVE_RUN}/scalars?max_steps=300")
    assert scalars["keys"] == ["lr", "train/loss", "val/acc"]
    assert run.chart_keys() == scalars["keys"]
    want = {
        (s["key"], s["rank"]): sum(isinstance(v, int | float) for v in s["mean"]) for s in scalars["series"]
    }
    assert run.mean_points() == want
    # The seeded data, binned by the server: 1,000 lr steps in bins of 4; 2 of 10 accuracies not finite.
    assert want[("lr", 0)] == 250 and want[("train/loss", 1)] == 120 and want[("val/acc", 0)] == 8
    assert "rank 1" in run.chart_text("train/loss")  # a second rank gets its own line and a legend
    assert "2 points skipped: NaN or Infinity" in run.chart_text("val/acc")
    record = api_get(stack, f"/v1/projects/{project}/runs/{LIVE_RUN}")
    header = run.page.locator("header").inner_text()
    assert "7 / 8" in header and f"{record['findings']['critical']} critical" in header and "live" in header
    assert run.page.locator("#runs-link").get_attribute("href") == f"/v1/projects/{project}/view"
    assert (
        run.page.locator("#dist-link").get_attribute("href")
        == f"/v1/projects/{project}/runs/{LIVE_RUN}/distributed/view"
    )
    run.close(stack)


def test_hovering_a_chart_shows_the_step_and_value(browser: Any, stack: LocalStack, project: str) -> None:
    page = RunPage(browser).open(run_view(stack, project, LIVE_RUN))
    page.page.locator("#pause").check()
    svg = page.page.locator('.chart[data-key="train/loss"] svg')
    box = svg.bounding_box()
    assert box is not None
    page.page.mouse.move(box["x"] + 58 + 1, box["y"] + box["height"] / 2)  # the plot's left edge: step 0
    tip = page.page.locator("#tip")
    tip.wait_for(state="visible")
    text = tip.inner_text()
    assert "step 0" in text and "rank 0: 2.1" in text and "rank 1: 2.22" in text, text
    page.close(stack)


def test_a_run_without_scalars_or_config_explains_how_to_log_them(
    browser: Any, stack: LocalStack, project: str
) -> None:
    page = RunPage(browser).open(run_view(stack, project, IDLE_RUN))
    assert "run.log(" in page.page.locator("#no-scalars").inner_text()
    assert "config=" in page.page.locator("#config-box").inner_text()
    assert "idle" in page.page.locator("#run-status").inner_text()
    page.close(stack)


def test_an_unknown_run_says_so(browser: Any, stack: LocalStack, project: str) -> None:
    page = RunPage(browser)
    page.goto(run_view(stack, project, "nope"))
    page.page.locator("#status", has_text="No run nope").wait_for()
    assert page.page.locator("#content").is_hidden()
    page.page.close()


@pytest.mark.parametrize("which", ["runs", "run"])
def test_a_bad_token_shows_the_auth_message_and_no_data(
    browser: Any, stack: LocalStack, project: str, which: str
) -> None:
    url = (
        runs_view(stack, project, "wrong") if which == "runs" else run_view(stack, project, LIVE_RUN, "wrong")
    )
    page = Tab(browser)
    page.goto(url)
    page.page.locator("#token-form").wait_for(state="visible")
    assert "not accepted" in page.page.locator("#status").inner_text()
    assert page.page.locator("#content").is_hidden()
    assert page.page.locator("#rows tr, .chart, #config tr").count() == 0
    assert page.page.evaluate("localStorage.getItem('instantml_token')") is None
    page.page.fill("#token-input", stack.token)  # the form recovers without a reload
    page.page.click("#token-form button")
    page.wait_drawn()
    assert page.page.locator("#content").is_visible()
    page.page.close()


def test_the_status_filter_asks_the_server(runs_page: RunsPage, stack: LocalStack) -> None:
    runs_page.filter("live")
    assert any(re.search(r"/runs\?.*status=live", r) for r in runs_page.api), runs_page.api
    live = [r["run_id"] for r in all_runs(stack, PROJECT, "live")]
    assert live == [LIVE_RUN] and runs_page.run_ids() == live
    assert "status=live" in runs_page.page.url
    runs_page.filter("finished")
    finished = [r["run_id"] for r in all_runs(stack, PROJECT, "finished")]
    assert len(finished) == 1 + SWEEP and runs_page.run_ids() == finished[:50]
    runs_page.filter("")  # all again: the first page of every status
    assert runs_page.run_ids() == [r["run_id"] for r in all_runs(stack, PROJECT)][:50]
    assert "status=" not in runs_page.page.url and "status=" not in runs_page.api[-1]


def test_load_more_appends_the_next_page(runs_page: RunsPage, stack: LocalStack) -> None:
    everything = [r["run_id"] for r in all_runs(stack, PROJECT)]
    assert len(everything) > 50
    first = runs_page.run_ids()
    assert first == everything[:50] and runs_page.page.locator("#more").is_visible()
    runs_page.load_more()
    assert runs_page.run_ids() == everything
    assert any("cursor=" in r for r in runs_page.api)
    assert runs_page.page.locator("#more").is_hidden()
    drawn = runs_page.drawn()
    runs_page.page.click("#reload")  # a refresh asks again for as many rows as are shown
    runs_page.wait_drawn(drawn)
    assert runs_page.run_ids() == everything
    assert re.search(rf"/runs\?limit={len(everything)}$", runs_page.api[-1]), runs_page.api[-1]


def test_the_pages_refresh_while_a_run_is_live(browser: Any, stack: LocalStack) -> None:
    log_ranks(stack, LIVE_PROJECT, "ticking", 10, range(8), 8)
    runs = RunsPage(browser).open(runs_view(stack, LIVE_PROJECT))
    run = RunPage(browser).open(run_view(stack, LIVE_PROJECT, "ticking"))
    assert runs.rows()[0]["cells"][3:5] == ["10", "8 / 8"]
    assert "live · every 5 s" in runs.page.locator("#live").inner_text()
    log_ranks(stack, LIVE_PROJECT, "ticking", 11, range(6), 8)  # the next step, 6 of 8 ranks so far
    record = api_get(stack, f"/v1/projects/{LIVE_PROJECT}/runs/ticking")
    assert (record["last_step"], record["ranks_reporting"]) == (11, 6)
    runs.page.locator('#rows tr[data-run="ticking"] td.ranks.short', has_text="6 / 8").wait_for(
        timeout=15_000
    )
    assert runs.rows()[0]["cells"][3] == "11"
    run.page.locator("#meta", has_text="last step 11").wait_for(timeout=15_000)
    runs.close(stack)
    run.close(stack)


def test_a_token_of_another_project_is_refused(browser: Any, stack: LocalStack, project: str) -> None:
    from shared.store import open_token_store

    token, _ = open_token_store(stack.store_url).create(TOKEN_PROJECT, "test")
    page = Tab(browser)
    page.goto(runs_view(stack, project, token))
    page.page.locator("#token-form").wait_for(state="visible")
    assert "does not grant access" in page.page.locator("#status").inner_text()
    assert page.page.locator("#rows tr").count() == 0
    page.page.close()
    own = RunsPage(browser).open(runs_view(stack, TOKEN_PROJECT, token))  # its own project: allowed
    assert own.page.locator("#empty").is_visible() and own.row_count() == 0
    own.close(stack)


def test_headers_sort_the_loaded_rows(runs_page: RunsPage) -> None:
    runs_page.sort_by("last step")
    steps = [r["cells"][3] for r in runs_page.rows()]
    numbers = [int(s) for s in steps if s != "—"]
    assert numbers == sorted(numbers, reverse=True) and steps[-1] == "—"  # unknown last
    runs_page.sort_by("last step")
    numbers = [int(r["cells"][3]) for r in runs_page.rows() if r["cells"][3] != "—"]
    assert numbers == sorted(numbers)
    runs_page.sort_by("run id")
    ids = runs_page.run_ids()
    assert ids == sorted(ids)


def test_an_empty_project_says_how_to_log_a_run(browser: Any, stack: LocalStack) -> None:
    assert all_runs(stack, EMPTY_PROJECT) == []
    page = RunsPage(browser).open(runs_view(stack, EMPTY_PROJECT))
    text = page.page.locator("#empty").inner_text()
    assert "im.init(" in text and "log_rank_metrics(" in text and EMPTY_PROJECT in text
    assert page.page.locator("#table-box").is_hidden() and page.page.locator("#more").is_hidden()
    page.close(stack)


def test_the_distributed_tab_links_to_the_run_page_and_the_runs_page(
    browser: Any, stack: LocalStack, project: str
) -> None:
    page = Tab(browser)
    page.goto(f"{stack.url}/v1/projects/{project}/runs/{LIVE_RUN}/distributed/view#token={stack.token}")
    page.wait_drawn()
    run_link = page.page.locator("#run-link")
    assert run_link.evaluate("a => a.href") == f"{stack.url}/v1/projects/{project}/runs/{LIVE_RUN}/view"
    assert (
        page.page.locator("#runs-link").evaluate("a => a.href") == f"{stack.url}/v1/projects/{project}/view"
    )
    run_link.click()  # the token travels in this tab's session storage, not in the link
    page.page.wait_for_url(re.compile(rf"/runs/{LIVE_RUN}/view$"))
    page.page.locator(".chart").first.wait_for()
    page.page.click("#runs-link")
    page.page.wait_for_url(re.compile(rf"/projects/{project}/view$"))
    page.page.locator(f'#rows tr[data-run="{LIVE_RUN}"]').wait_for()
    page.close(stack)


def test_with_1000_runs_stored_the_page_shows_the_first_50_newest_first(
    browser: Any, stack: LocalStack, big_project: str
) -> None:
    """How fast this is drawn is ``benchmarks/runs_page.py``'s figure, beside its floor; here, what."""
    want = all_runs(stack, big_project)
    assert len(want) == BIG
    page = RunsPage(browser).open(runs_view(stack, big_project))
    assert page.row_count() == 50 and page.run_ids() == [r["run_id"] for r in want[:50]]
    assert page.page.locator("#more").is_visible()
    page.close(stack)


def test_load_more_reaches_1000_runs_and_a_header_sorts_them_all(
    browser: Any, stack: LocalStack, big_project: str
) -> None:
    page = RunsPage(browser).open(runs_view(stack, big_project))
    for _ in range(
        BIG // 50 - 1
    ):  # 19 clicks, each waiting for its draw (bounded: no loop on a page that stalls)
        page.load_more()
    want = all_runs(stack, big_project)
    assert page.row_count() == BIG and page.run_ids() == [r["run_id"] for r in want]
    assert page.page.locator("#more").is_hidden()
    painted = page.wait_painted(page.drawn() - 1)
    page.sort_by("findings")  # a redraw of all 1,000 rows, by the costliest key (three counts each)
    page.wait_painted(painted)
    watched_counts = [findings_cells(r) for r in want]  # the watch looked at every run, nobody opened one
    shown = [counts_shown(r["cells"][5]) for r in page.rows()]
    assert shown == sorted(watched_counts, key=lambda f: [int(n) for n in f], reverse=True)
    page.close(stack)


# ---------------------------------------------------------------------------------------------------
# Issue 24: a sign-in that carries, URL state, new runs while open, comparison.
# ---------------------------------------------------------------------------------------------------


def signed_in(page: Any) -> bool:
    return bool(page.locator("#content").is_visible() and page.locator("#token-form").is_hidden())


def test_a_link_opened_in_a_fresh_page_keeps_the_sign_in_until_sign_out(
    browser: Any, stack: LocalStack
) -> None:
    """The token given once, by the printed link's fragment: gone from the address bar, kept for the origin,
    so a link opened in a new page of the same browser (Ctrl-click, a pasted URL) shows the data; Sign out
    on one page signs every open page out, and a new page then asks, saying where the token is kept."""
    log_ranks(stack, SIGN_IN_PROJECT, "r1", 5, range(2), 2)
    update(stack, SIGN_IN_PROJECT, "r1", {"status": "finished"})
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        first = context.new_page()
        first.goto(runs_view(stack, SIGN_IN_PROJECT))
        first.locator('#rows tr[data-run="r1"]').wait_for()
        assert "token" not in first.url and stack.token not in first.url
        assert first.evaluate("localStorage.getItem('instantml_token')") == stack.token
        href = first.locator('#rows tr[data-run="r1"] a.dist').evaluate("a => a.href")
        assert "token" not in href
        opened = []
        for url in (href, f"{stack.url}/v1/projects/{SIGN_IN_PROJECT}/runs/r1/view", first.url):
            other = context.new_page()  # a new tab, no token in its URL
            other.goto(url)
            other.locator("body[data-drawn]").wait_for(state="attached")
            other.locator("#content").wait_for(state="visible")
            assert signed_in(other) and other.locator("#sign-out").is_visible(), url
            assert "token" not in other.url
            opened.append(other)
        tab = opened[0]  # the Distributed tab, still open
        first.click("#sign-out")
        first.locator("#token-form").wait_for(state="visible")
        assert "Signed out" in first.locator("#status").inner_text()
        assert first.locator("#rows tr").count() == 0 and first.locator("#content").is_hidden()
        assert first.evaluate("localStorage.getItem('instantml_token')") is None
        tab.locator("#token-form").wait_for(state="visible")  # the other tab follows
        assert tab.locator("#content").is_hidden()
        fresh = context.new_page()
        fresh.goto(f"{stack.url}/v1/projects/{SIGN_IN_PROJECT}/runs/r1/view")
        fresh.locator("#token-form").wait_for(state="visible")
        where = fresh.locator("#token-where").inner_text()
        assert ".instantml/demo/token" in where and "instantml local" in where
        fresh.fill("#token-input", stack.token)  # signing in again, in one tab...
        fresh.click("#token-form button")
        fresh.locator("#content").wait_for(state="visible")
        first.locator('#rows tr[data-run="r1"]').wait_for()  # ...signs the others in
    finally:
        context.close()


def test_a_new_run_appears_while_the_runs_page_is_open_with_no_live_run(
    browser: Any, stack: LocalStack
) -> None:
    at = time.time() - 3600
    log_ranks(stack, NEW_RUN_PROJECT, "old", 3, range(2), 2, at)
    update(stack, NEW_RUN_PROJECT, "old", {"status": "finished", "time": at})
    page = RunsPage(browser)
    page.page.clock.install()  # the page's 5 s look is fast-forwarded, not waited for
    page.open(runs_view(stack, NEW_RUN_PROJECT))
    assert page.run_ids() == ["old"]
    assert "no live runs · looking for new ones every 5 s" in page.page.locator("#live").inner_text()
    drawn = page.drawn()
    log_ranks(stack, NEW_RUN_PROJECT, "new", 1, range(2), 2)
    page.page.clock.fast_forward(3_000)
    assert page.drawn() == drawn and page.run_ids() == ["old"]  # not before its time
    page.page.clock.fast_forward(2_500)
    page.page.locator('#rows tr[data-run="new"]').wait_for()
    assert page.run_ids() == ["new", "old"]
    assert "live · every 5 s" in page.page.locator("#live").inner_text()  # a live run: every 5 s now
    page.close(stack)


def test_each_run_shows_its_processes_by_state_as_the_watch_last_saw_them(
    browser: Any, stack: LocalStack
) -> None:
    """Contract 8 on the runs page: a run whose rank 1 raised while the launcher ended the other three
    shows one bar of its 4 processes (1 failed, 3 ended by a signal), from the watch's look, with
    nobody opening its tab; its title says the counts. The API's ``process_states`` says the same."""
    run_id = "ended-by-rank-1"
    for step in range(3):
        log_ranks(stack, PROCESSES_PROJECT, run_id, step, range(4), 4)
    now = time.time()
    for rank in range(4):
        process = {"rank": rank, "world_size": 4, "pid": 100 + rank, "state": "started", "first_step": 0}
        update(stack, PROCESSES_PROJECT, run_id, {"process": process, "time": now - 5})
    oom = {"type": "RuntimeError", "message": "CUDA out of memory", "where": "train.py:40 forward"}
    ended = {"world_size": 4, "state": "ended", "step": 2}
    update(
        stack,
        PROCESSES_PROJECT,
        run_id,
        {"process": {"rank": 1, "pid": 101, **ended, "how": "exception", "exception": oom}, "time": now - 3},
    )
    for rank in (0, 2, 3):
        process = {"rank": rank, "pid": 100 + rank, **ended, "how": "signal", "signal": "SIGTERM"}
        update(stack, PROCESSES_PROJECT, run_id, {"process": process, "time": now - 2})

    def judged() -> dict[str, Any] | None:
        (record,) = all_runs(stack, PROCESSES_PROJECT)
        return record if record.get("process_states") == {"failed": 1, "signal": 3} else None

    record = wait_for(judged, 60, "the watch's look at the run's processes")
    assert set(record["findings"]) == {"critical", "warning", "info"}  # the counts apart from them
    out = io.StringIO()
    assert list_runs(Api(stack.url, stack.token), PROCESSES_PROJECT, None, out) == 0
    header, row = out.getvalue().splitlines()
    assert row[header.index("PROCESSES") :].startswith("1 failed, 3 signal "), out.getvalue()
    page = RunsPage(browser).open(runs_view(stack, PROCESSES_PROJECT))
    cell = page.page.locator(f'#rows tr[data-run="{run_id}"] td.procs')
    assert cell.get_attribute("title") == "1 ended: failed, 3 ended by a signal"
    segments = cell.locator(".seg")
    assert [segments.nth(i).get_attribute("data-state") for i in range(segments.count())] == [
        "failed",
        "signal",
    ]
    widths = [segments.nth(i).bounding_box()["width"] for i in range(2)]
    assert 2.5 < widths[1] / widths[0] < 3.5, widths  # each state's share of the bar
    assert page.errors == []
    page.close(stack)


def test_filter_sort_ticked_runs_and_scroll_survive_a_reload(
    browser: Any, stack: LocalStack, project: str
) -> None:
    page = RunsPage(browser, height=600).open(runs_view(stack, project))
    page.filter("finished")
    page.sort_by("world size")
    ticked = ["sweep-003", "sweep-001"]
    for run in ticked:
        page.page.locator(f'#rows tr[data-run="{run}"] input.pick').check()
    page.page.mouse.wheel(0, 700)
    wait_for(lambda: page.page.evaluate("scrollY") >= 650, what="the scroll")
    url = page.page.url
    assert "status=finished" in url and "sort=-world_size" in url and "compare=sweep-003,sweep-001" in url
    order = page.run_ids()
    wait_for(lambda: (page.page.evaluate("history.state") or {}).get("scroll", 0) >= 650, what="saved scroll")
    drawn = page.drawn()
    page.page.reload()
    page.wait_drawn()
    assert page.page.url == url and page.run_ids() == order
    assert page.page.locator("#status-filter").input_value() == "finished"
    assert "world size\u00a0▼" in page.page.locator("#head").inner_text()
    checked = page.page.evaluate(
        "[...document.querySelectorAll('input.pick:checked')].map((b) => b.closest('tr').dataset.run)"
    )
    assert sorted(checked) == sorted(ticked)
    assert page.page.evaluate("scrollY") >= 650
    href = page.page.locator("#compare-link").get_attribute("href")
    assert href == f"/v1/projects/{project}/compare/view#runs=sweep-003,sweep-001", href
    assert drawn >= 1
    page.close(stack)


@pytest.fixture(scope="module")
def compared(stack: LocalStack) -> tuple[str, str]:
    """Two finished runs of 4 ranks x 60 steps: "before", clean, and "after", with a slow rank and two
    settings changed."""
    base = {"model": "gpt2-small", "lr": 3e-4, "batch_size": 32, "nodes": 1}
    seed_run(stack, COMPARE_PROJECT, "before", 4, 60, (), seed=1, config=base)
    seed_run(
        stack, COMPARE_PROJECT, "after", 4, 60, ("slow",), seed=2, config={**base, "lr": 6e-4, "nodes": 2}
    )
    return "before", "after"


def test_ticked_runs_open_side_by_side_with_differences_highlighted(
    browser: Any, stack: LocalStack, compared: tuple[str, str]
) -> None:
    runs = RunsPage(browser).open(runs_view(stack, COMPARE_PROJECT))
    assert runs.page.locator("#compare-link.off").count() == 1  # nothing to compare yet
    for run in compared:
        runs.page.locator(f'#rows tr[data-run="{run}"] input.pick').check()
    runs.page.click("#compare-link")
    runs.page.wait_for_url(re.compile(r"/compare/view#runs=before,after$"))
    page = RunPage.after_navigation(runs)
    page.page.locator("body[data-painted]").wait_for(state="attached")
    docs = {
        run: api_get(stack, f"/v1/projects/{COMPARE_PROJECT}/runs/{run}/distributed?heatmap=none")
        for run in compared
    }
    scalars = {
        run: api_get(stack, f"/v1/projects/{COMPARE_PROJECT}/runs/{run}/scalars?max_steps=400")
        for run in compared
    }
    lines = page.page.evaluate(
        """() => [...document.querySelectorAll('#dist-box .chart, #scalars-box .chart')].flatMap((c) =>
             [...c.querySelectorAll('path.line')].map((p) => [c.closest('section').querySelector('div').id,
               c.dataset.key, p.dataset.run, +p.dataset.points]))"""
    )
    want = [
        ["dist-box", key, run, sum(isinstance(v, int | float) for v in docs[run]["reducers"][key]["mean"])]
        for key in docs["before"]["keys"]
        for run in compared
    ] + [
        ["scalars-box", s["key"], run, sum(isinstance(v, int | float) for v in s["mean"])]
        for key in scalars["before"]["keys"]
        for run in compared
        for s in scalars[run]["series"]
        if s["key"] == key
    ]
    assert lines == want and all(n == 60 for *_, n in want[:6])
    # One step axis: every chart's first and last x tick are the same steps.
    ticks = page.page.evaluate(
        """[...document.querySelectorAll('.chart svg')].map((s) => [...s.querySelectorAll('text')]
             .filter((t) => t.getAttribute('text-anchor') === 'middle' && !t.classList.contains('axis'))
             .map((t) => t.textContent).join(','))"""
    )
    assert len(set(ticks)) == 1 and ticks[0].startswith("0,"), ticks
    differs = page.page.evaluate(
        "[...document.querySelectorAll('#config tr.differs')].map((r) => r.dataset.key)"
    )
    assert differs == ["lr", "nodes"]
    assert page.page.locator("#config-note").inner_text() == "2 of 4 settings differ (highlighted)"
    after = page.page.locator('.findings .col[data-run="after"]')
    assert "rank 3" in after.inner_text() and "slower" in after.inner_text()
    slow = after.locator('li[data-kind="persistent_outlier"]')
    assert "diff" in (slow.first.get_attribute("class") or "")  # not in the other run
    assert "no findings" in page.page.locator('.findings .col[data-run="before"]').inner_text()
    header = page.page.locator("#runs-box").inner_text()
    assert "before" in header and "after" in header and "finished" in header
    page.close(stack)


def test_the_comparison_view_is_a_link(browser: Any, stack: LocalStack, compared: tuple[str, str]) -> None:
    """Zoom, log scale and smoothing are in the fragment: a reload, or the link in another tab, opens the
    same view; an unknown run in the list is named, the others still drawn."""
    url = f"{stack.url}/v1/projects/{COMPARE_PROJECT}/compare/view#runs=after,before,nope&token={stack.token}"
    page = RunPage(browser).open(url)
    page.page.locator("body[data-painted]").wait_for(state="attached")
    assert "No run nope" in page.page.locator("#status").inner_text()
    assert "token" not in page.page.url
    svg = page.page.locator('#dist-box .chart[data-key="train/loss"] svg')
    box = svg.bounding_box()
    assert box is not None
    drawn = page.drawn()
    y = box["y"] + box["height"] / 2
    page.page.mouse.move(box["x"] + 58 + (box["width"] - 68) * 0.25, y)
    page.page.mouse.down()
    page.page.mouse.move(box["x"] + 58 + (box["width"] - 68) * 0.5, y, steps=4)
    page.page.mouse.up()
    page.page.locator("#zoom-reset").wait_for(state="visible")
    page.page.check("#log-y")
    page.page.select_option("#smooth", "5")
    found = re.search(r"steps=(\d+)-(\d+)", page.page.url)
    assert found and 10 <= int(found[1]) < int(found[2]) <= 35, page.page.url
    assert "log=1" in page.page.url and "smooth=5" in page.page.url
    points = page.page.evaluate(
        "[...document.querySelectorAll('#dist-box path.line')].map((p) => +p.dataset.points)"
    )
    assert all(0 < n < 60 for n in points), points  # the zoomed window only
    page.page.reload()
    page.wait_drawn()
    page.page.locator("#zoom-reset").wait_for(state="visible")
    assert page.page.locator("#log-y").is_checked() and page.page.locator("#smooth").input_value() == "5"
    again = page.page.evaluate(
        "[...document.querySelectorAll('#dist-box path.line')].map((p) => +p.dataset.points)"
    )
    assert again == points and drawn >= 1
    page.page.click("#zoom-reset")
    assert "steps=" not in page.page.url
    # The browser logs each answer about "nope" (its record, scalars, summary) as a failed load: expected.
    page.errors = [e for e in page.errors if "404 (Not Found)" not in e]
    page.close(stack)


def test_a_live_run_compared_grows_by_refreshes_that_send_its_version(
    browser: Any, stack: LocalStack
) -> None:
    """The compare page refreshes a live run's summary with since=<version>: the server's delta (or
    "unchanged") merged into what is drawn gives the same line as the whole document."""
    seed_run(stack, COMPARE_LIVE_PROJECT, "done", 2, 30, seed=1)
    seed_run(stack, COMPARE_LIVE_PROJECT, "going", 2, 30, seed=2, finished=False)
    url = f"{stack.url}/v1/projects/{COMPARE_LIVE_PROJECT}/compare/view#runs=done,going&token={stack.token}"
    page = RunPage(browser).open(url)
    line = page.page.locator('#dist-box .chart[data-key="train/loss"] path.line[data-run="going"]')
    assert line.get_attribute("data-points") == "30"
    more = [e for e in rank_events("going", 2, 40, (), 2) if e["step"] >= 30]
    send(stack, "POST", routes.RANK_METRICS_BATCH, COMPARE_LIVE_PROJECT, "going", {"events": more})
    page.page.locator(
        '#dist-box .chart[data-key="train/loss"] path.line[data-run="going"][data-points="40"]'
    ).wait_for(state="attached", timeout=30_000)
    assert any("/going/distributed?" in r and "since=" in r for r in page.api), page.api
    assert not any("/done/distributed?" in r and "since=" in r for r in page.api)  # finished: not asked again
    doc = api_get(stack, f"/v1/projects/{COMPARE_LIVE_PROJECT}/runs/going/distributed?heatmap=none")
    drawn = line.get_attribute("d") or ""
    assert len(re.findall(r"[ML]", drawn)) == len(doc["steps"]) == 40
    page.close(stack)


def test_the_run_page_says_when_it_refreshes(browser: Any, stack: LocalStack) -> None:
    """A finished run's page stops asking; a run id nobody logged yet is looked for every 30 s, said so."""
    project = "runs-pages-refresh"
    log_ranks(stack, project, DONE_RUN, 3, range(2), 2)
    update(stack, project, DONE_RUN, {"status": "finished"})
    done = RunPage(browser)
    done.page.clock.install()
    done.open(run_view(stack, project, DONE_RUN))
    assert done.page.locator("#live").inner_text().strip() == "finished · not refreshing"
    asked = len(done.api)
    done.page.clock.fast_forward(120_000)
    assert len(done.api) == asked and done.drawn() == 1
    done.close(stack)
    missing = RunPage(browser)
    missing.page.clock.install()
    missing.goto(run_view(stack, project, "not-yet"))
    missing.page.locator("#status", has_text="looking again every 30 s").wait_for()
    assert "no such run · looking again every 30 s" in missing.page.locator("#live").inner_text()
    asked = len(missing.api)
    missing.page.clock.fast_forward(29_000)
    assert len(missing.api) == asked
    log_ranks(stack, project, "not-yet", 1, range(2), 2)
    missing.page.clock.fast_forward(2_000)
    missing.page.locator("#run-status", has_text="live").wait_for()
    assert missing.page.locator("#status").inner_text() == ""
    missing.page.close()


RUN_LINK_PROJECT, PAUSE_PROJECT = "runs-pages-run-link", "runs-pages-pause"


def test_the_run_page_view_is_a_link_that_a_fresh_page_of_the_context_restores(
    browser: Any, stack: LocalStack
) -> None:
    """Keys shown, zoom, log scale, smoothing and paused are in the fragment (never the token): the link
    opened in a new page of the same browser shows the same view, asked of the server for the same window,
    and does not poll."""
    log_ranks(stack, RUN_LINK_PROJECT, "r1", 1190, range(2), 2)  # live: the page would poll
    log_scalars(stack, RUN_LINK_PROJECT, "r1")
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        first = Tab(context)
        first.page.goto(run_view(stack, RUN_LINK_PROJECT, "r1"))
        run = RunPage.after_navigation(first)
        assert run.chart_keys() == ["lr", "train/loss", "val/acc"]
        full = run.mean_points()[("train/loss", 0)]
        for key in ("lr", "val/acc"):  # only train/loss left ticked
            run.page.locator(f'#key-picks input[data-key="{key}"]').uncheck()
        assert run.chart_keys() == ["train/loss"]
        run.page.check("#log-y")
        run.page.select_option("#smooth", "5")
        run.page.check("#pause")
        svg = run.page.locator('.chart[data-key="train/loss"] svg')
        box = svg.bounding_box()
        assert box is not None
        drawn, y = run.drawn(), box["y"] + box["height"] / 2
        run.page.mouse.move(box["x"] + 58 + (box["width"] - 68) * 0.25, y)
        run.page.mouse.down()
        run.page.mouse.move(box["x"] + 58 + (box["width"] - 68) * 0.5, y, steps=4)
        run.page.mouse.up()
        run.wait_drawn(drawn)
        run.page.locator("#zoom-reset").wait_for(state="visible")
        link = run.page.url
        found = re.search(r"steps=(\d+)-(\d+)", link)
        assert found and 200 <= int(found[1]) < int(found[2]) <= 650, link
        for part in ("key=train%2Floss", "log=1", "smooth=5", "live=0"):
            assert part in link, (part, link)
        assert "token" not in link and stack.token not in link
        zoomed = run.mean_points()[("train/loss", 0)]
        assert 0 < zoomed < full  # the window's points only
        window = f"step_min={found[1]}&step_max={found[2]}"
        assert any("/scalars?" in r and window in r for r in run.api), run.api

        second = Tab(context)
        second.page.clock.install()  # the 5 s poll of a live run would run now if not paused
        second.goto(link)  # a new tab, the link pasted: no token in it
        again = RunPage.after_navigation(second)
        assert again.page.url == link
        assert again.chart_keys() == ["train/loss"]
        assert again.page.locator('#key-picks input[data-key="lr"]').is_checked() is False
        assert again.page.locator("#log-y").is_checked() and again.page.locator("#pause").is_checked()
        assert again.page.locator("#smooth").input_value() == "5"
        assert again.page.locator("#zoom-reset").is_visible()
        assert again.mean_points() == run.mean_points()
        assert "(log)" in again.chart_text("train/loss") and "smoothed" in again.chart_text("train/loss")
        assert any("/scalars?" in r and window in r for r in again.api), again.api
        assert "paused" in again.page.locator("#live").inner_text()
        asked = len(again.api)
        again.page.clock.fast_forward(60_000)
        assert len(again.api) == asked  # paused: no request at all
        again.page.uncheck("#pause")  # resumed: asked at once, then every 5 s
        wait_for(lambda: len(again.api) > asked, what="a request once resumed")
        assert "live=0" not in again.page.url
        again.page.click("#zoom-reset")
        assert "steps=" not in again.page.url
        again.page.locator(
            f'.chart[data-key="train/loss"] path.mean[data-rank="0"][data-points="{full}"]'
        ).wait_for(state="attached")
        first.close(stack)
        again.close(stack)
    finally:
        context.close()


def test_a_key_in_the_link_that_the_run_lacks_is_named(browser: Any, stack: LocalStack) -> None:
    log_scalars(stack, RUN_LINK_PROJECT, "r2")
    page = RunPage(browser).open(run_view(stack, RUN_LINK_PROJECT, "r2") + "&key=nope&key=lr")
    assert page.chart_keys() == ["nope", "lr"]
    note = page.page.locator("#key-note").inner_text()
    assert "no key “nope”" in note and "lr, train/loss, val/acc" in note, note
    assert "No such key in this run." in page.chart_text("nope")
    page.close(stack)


@pytest.mark.parametrize("which", ["runs", "compare"])
def test_paused_is_in_the_link_stops_the_polling_and_survives_a_reload(
    browser: Any, stack: LocalStack, which: str
) -> None:
    """The runs page and the compare page: ticking pause puts live=0 in the fragment and no request is
    sent while it is ticked, though a run is live; a reload opens paused; unticking asks again."""
    project = f"{PAUSE_PROJECT}-{which}"
    for run in ("a", "b"):
        log_ranks(stack, project, run, 3, range(2), 2)  # live runs: both pages poll every 5 s
    url = (
        runs_view(stack, project)
        if which == "runs"
        else (f"{stack.url}/v1/projects/{project}/compare/view#runs=a,b&token={stack.token}")
    )
    page = RunsPage(browser)
    page.page.clock.install()
    page.open(url)
    assert "live · every 5 s" in page.page.locator("#live").inner_text()
    asked, drawn = len(page.api), page.drawn()
    page.page.clock.fast_forward(5_100)
    page.wait_drawn(drawn)  # it polls while live: a round sent and drawn
    assert len(page.api) > asked
    page.page.check("#pause")
    assert "live=0" in page.page.url and "token" not in page.page.url
    assert page.page.locator("#live").inner_text().strip() == "paused"
    asked = len(page.api)
    page.page.clock.fast_forward(120_000)
    assert len(page.api) == asked
    page.page.reload()
    drawn = page.wait_drawn()
    assert page.page.locator("#pause").is_checked() and "live=0" in page.page.url
    asked = len(page.api)
    page.page.clock.fast_forward(120_000)
    assert len(page.api) == asked and page.drawn() == drawn  # the reload drew once, then nothing
    page.page.uncheck("#pause")
    wait_for(lambda: len(page.api) > asked, what="a request once unpaused")
    assert "live=0" not in page.page.url
    page.close(stack)
