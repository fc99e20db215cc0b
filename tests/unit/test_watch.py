"""The watch (shared/watch/rounds.py, shared/findings/clock.py): which alerts open and resolve, and when.

The decision is a pure function, tested as one; the rounds run on a real SQLite store, with synthetic
jobs (tests/jobs.py) replayed as live streams on a simulated clock (tests/live.py): the evaluation
pauses trainers make, uploads that arrive late, a rank that stops, a job that hangs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.findings import Finding
from shared.findings.clock import STALL_MIN_S, Pace, clock_findings, pace_of, settled_step
from shared.severity import SEVERITIES, Severity
from shared.store.port import Webhook
from shared.summary.decoding import decode
from shared.summary.document import summarize
from shared.summary.query import SummaryQuery
from shared.watch.rounds import RESOLVE_ROUNDS, decide, deliveries, headline, reaches, watch_round, window
from tests.jobs import faulty_job, healthy_job
from tests.live import T0, replay


def finding(
    kind: str = "stopped_reporting", rank: int | None = 5, severity: Severity = "critical"
) -> Finding:
    return {
        "kind": kind,
        "rank": rank,
        "key": None,
        "step": 10,
        "severity": severity,
        "message": f"{kind} {rank}",
    }


def test_a_finding_opens_once_rises_once_and_resolves_after_it_is_gone_for_some_rounds() -> None:
    found = finding(severity="info")
    transitions, open_alerts = decide({}, [found], now=1.0)
    assert [(t.state, t.before, t.after) for t in transitions] == [("opened", None, "info")]
    again, open_alerts = decide(open_alerts, [found], now=2.0)
    assert again == []  # the same onset: nothing new
    risen, open_alerts = decide(open_alerts, [finding(severity="critical")], now=3.0)
    assert [(t.state, t.before, t.after, t.onset) for t in risen] == [("opened", "info", "critical", 1.0)]
    lower, open_alerts = decide(open_alerts, [finding(severity="info")], now=4.0)
    assert lower == []
    assert open_alerts["stopped_reporting|5|None"].severity == "critical"
    for round_ in range(RESOLVE_ROUNDS - 1):
        quiet, open_alerts = decide(open_alerts, [], now=5.0 + round_)
        assert quiet == [], "one round without the finding does not resolve it"
        assert open_alerts, "one round without the finding does not resolve it"
    gone, open_alerts = decide(open_alerts, [], now=9.0)
    assert [(t.state, t.before) for t in gone] == [("resolved", "critical")]
    assert open_alerts == {}


def test_a_finding_back_before_it_resolves_is_the_same_onset() -> None:
    _, open_alerts = decide({}, [finding()], now=1.0)
    _, open_alerts = decide(open_alerts, [], now=2.0)
    back, open_alerts = decide(open_alerts, [finding()], now=3.0)
    assert back == []
    assert open_alerts["stopped_reporting|5|None"].absent == 0


def test_each_webhook_hears_of_an_onset_once_when_it_reaches_its_severity_and_of_its_end() -> None:
    opened_info, open_alerts = decide({}, [finding(severity="info")], now=1.0)
    risen, open_alerts = decide(open_alerts, [finding(severity="critical")], now=2.0)
    _, open_alerts = decide(open_alerts, [], now=3.0)
    resolved, _ = decide(open_alerts, [], now=4.0)
    hear = {
        bar: [t.state for t in [*opened_info, *risen, *resolved] if reaches(t, bar)] for bar in SEVERITIES
    }
    assert hear == {
        "info": ["opened", "resolved"],  # the rise to critical is not a new onset for it
        "warning": ["opened", "resolved"],
        "critical": ["opened", "resolved"],
    }
    only_info, open_alerts = decide({}, [finding(severity="info")], now=1.0)
    _, open_alerts = decide(open_alerts, [], now=2.0)
    end, _ = decide(open_alerts, [], now=3.0)
    assert [t.state for t in [*only_info, *end] if reaches(t, "warning")] == []  # never announced to it


def test_deliveries_name_the_onset_so_a_repeated_round_queues_the_same_ids() -> None:
    hooks = [Webhook("http://127.0.0.1:9/a", "warning"), Webhook("http://127.0.0.1:9/b", "critical")]
    transitions, _ = decide({}, [finding(severity="warning")], now=7.0)
    first = deliveries(transitions, hooks, "p", "r", "http://127.0.0.1:8787")
    second = deliveries(decide({}, [finding(severity="warning")], now=7.0)[0], hooks, "p", "r", None)
    assert [d.url for d in first] == ["http://127.0.0.1:9/a"]  # the critical webhook hears nothing yet
    assert [d.delivery_id for d in first] == [d.delivery_id for d in second]
    payload = first[0].payload
    assert payload["state"] == "opened"
    assert payload["finding"]["rank"] == 5
    assert payload["url"] == "http://127.0.0.1:8787/v1/projects/p/runs/r/distributed/view"
    assert payload["text"].startswith("WARNING p/r: stopped_reporting 5")


def test_a_finding_in_a_word() -> None:
    assert headline(finding()) == "rank 5 stopped"
    stalled: Finding = {**finding("stalled", None, "warning"), "short": "no rank for 3 min 5 s"}
    assert headline(stalled) == "stalled: no rank for 3 min 5 s"
    growing: Finding = {**finding("memory_growth", 3, "warning"), "key": "system/rss_mb"}
    assert headline(growing) == "rank 3 memory keeps growing on system/rss_mb"


def _pace(steps: list[int], seconds: list[float], ranks: int = 4) -> Pace:
    """Every rank reports each step at the given time."""
    s = np.repeat(np.array(steps, np.int64), ranks)
    t = np.repeat(np.array(seconds, float), ranks)
    r = np.tile(np.arange(ranks, dtype=np.int64), len(steps))
    return pace_of(s, r, t, np.full(len(s), ranks, np.int64), Pace())


def test_stalled_follows_the_run_s_pace_and_its_longest_pause() -> None:
    steady = _pace(list(range(100)), [T0 + i for i in range(100)])
    last = T0 + 99
    assert steady.interval == pytest.approx(1.0)
    assert clock_findings(steady, 99, False, last, last + STALL_MIN_S - 1) == []
    (warn,) = clock_findings(steady, 99, False, last, last + STALL_MIN_S + 1)
    assert warn["kind"] == "stalled"
    assert warn["severity"] == "warning"
    (crit,) = clock_findings(steady, 99, False, last, last + 2 * STALL_MIN_S + 1)
    assert crit["severity"] == "critical"
    assert "step 99" in crit["message"]
    assert clock_findings(steady, 99, True, last, last + 3600) == []  # a finished run is not stalled
    # A run that paused 10 minutes to evaluate is stalled only past 1.5x that.
    times = [T0 + i for i in range(50)] + [T0 + 649 + i for i in range(50)]
    paused = _pace(list(range(100)), times)
    assert paused.longest_pause == pytest.approx(600.0)
    end = times[-1]
    assert clock_findings(paused, 99, False, end, end + 800) == []
    assert clock_findings(paused, 99, False, end, end + 901)[0]["severity"] == "warning"


def test_a_rank_silent_while_the_others_go_on_is_stopped_but_not_one_that_paused_with_them() -> None:
    steps, ranks = np.arange(120), 4
    s = np.repeat(steps, ranks)
    r = np.tile(np.arange(ranks), len(steps))
    # every rank pauses 300 s after step 59 (evaluation); rank 2 is 1 step late after it
    t = T0 + s.astype(float) + np.where(s >= 60, 300.0, 0.0)
    keep = ~((r == 2) & (s == 119))
    pace = pace_of(s[keep], r[keep], t[keep], np.full(keep.sum(), ranks), Pace())
    assert clock_findings(pace, 119, False, float(t.max()), float(t.max()) + 1) == []
    assert settled_step(pace, 119, float(t.max()), float(t.max()) + 1) == 118
    # rank 1 stopped at step 70 while the others went on to 119
    gone = ~((r == 1) & (s > 70))
    pace = pace_of(s[gone], r[gone], t[gone], np.full(gone.sum(), ranks), Pace())
    (row,) = clock_findings(pace, 119, False, float(t.max()), float(t.max()) + 1)
    assert (row["kind"], row["rank"], row["severity"], row["step"]) == (
        "stopped_reporting",
        1,
        "critical",
        70,
    )
    assert settled_step(pace, 119, float(t.max()), float(t.max()) + 1) is None  # rank 1 holds nothing


def alarms(outcome: Any) -> list[tuple[str, int | None, str | None]]:
    return [(x.finding["kind"], x.finding["rank"], x.finding["key"]) for _, x in outcome.alerts("warning")]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "ranks", "seed"), [("realistic", 8, 3), ("student_t3", 16, 3), ("checkpoint_stalls", 64, 1)]
)
def test_healthy_jobs_replayed_live_with_evaluation_pauses_alert_nothing_the_whole_job_does_not_show(
    model: str, ranks: int, seed: int, tmp_path: Path
) -> None:
    """Live, a job is judged over and over on partial windows, with uploads arriving late: the watch
    must add no alarm of its own to what a summary of the finished job says (which, for a healthy job,
    is nothing or a rare false alarm that the findings benchmark counts)."""
    job = healthy_job(model, ranks, 200, seed=seed)
    whole = summarize(decode(job.events), "p", "r", SummaryQuery())["findings"]
    offline = {(f["kind"], f["rank"], f["key"]) for f in whole if f["severity"] != "info"}
    outcome = replay(job, tmp_path / "db", pause_every=60, pause_s=90.0, lag_s=2.0)
    assert outcome.rounds > 20
    assert not outcome.failed
    assert set(alarms(outcome)) <= offline
    assert len(alarms(outcome)) == len(set(alarms(outcome)))  # never twice for one onset


@pytest.mark.slow
def test_a_rank_that_stops_is_alerted_once_on_its_rank_within_a_minute(tmp_path: Path) -> None:
    job = faulty_job("stopped", 0.5, 8, 200, seed=1)
    (expected,) = job.expected
    last = max(float(np.frombuffer(e.packed, "<f8")[1]) for e in job.events if e.rank == expected.rank)
    outcome = replay(job, tmp_path / "db", slower=3.0)  # about a step a second
    assert alarms(outcome) == [("stopped_reporting", expected.rank, None)]
    at = outcome.first("stopped_reporting", expected.rank)
    assert at is not None
    assert at - (T0 + 3.0 * last) <= 60.0


def test_a_job_that_hangs_at_a_step_a_second_is_alerted_within_five_minutes_and_names_no_rank(
    tmp_path: Path,
) -> None:
    job = healthy_job("realistic", 8, 200, seed=2)
    outcome = replay(job, tmp_path / "db", hang_after=120, slower=3.0, tail_s=600.0)
    assert {kind for kind, _, _ in alarms(outcome)} == {"stalled"}
    levels = [
        x.after for _, x in outcome.transitions if x.state == "opened" and x.finding["kind"] == "stalled"
    ]
    assert levels == ["warning", "critical"]  # one onset: a webhook at warning hears of it once
    assert len(outcome.alerts("warning")) == 1
    assert len(outcome.alerts("critical")) == 1
    at = outcome.first("stalled")
    assert at is not None
    assert at - outcome.last_event <= 300.0


def test_a_round_judges_a_live_run_s_last_steps_from_a_block_and_a_finished_run_whole() -> None:
    assert window(100_037, finished=False, cut=100_030) == {"step_min": "98000", "step_max": "100030"}
    assert window(100_037, finished=True, cut=None) == {}
    assert window(1_500, finished=False, cut=None) == {}  # a young run: all of it


def test_a_round_summarizes_within_its_budget_and_never_puts_off_a_first_look(tmp_path: Path) -> None:
    from shared.events import RankEvent
    from shared.ingest import activity as notes
    from shared.store.sqlite import SqliteStore
    from tests.live import Clock

    clock = Clock()
    store = SqliteStore(tmp_path / "db", clock=clock)

    def log(step: int) -> None:
        events = [
            RankEvent("p", "r", f"{step}-{r}", step, r, 2, None, 1.0, clock.now, ("loss",), (1.0,), b"d")
            for r in range(2)
        ]
        store.put_events(events)
        store.note_activity("p", "r", notes.activity(events, clock.now))

    log(0)
    assert watch_round(store, now=clock.now, summary_budget_s=0.0).summarized == 1  # a first look
    for step in (1, 2):
        clock.now += 31.0
        log(step)
        assert watch_round(store, now=clock.now, summary_budget_s=0.0).summarized == 0  # over budget
    assert watch_round(store, now=clock.now).summarized == 1
