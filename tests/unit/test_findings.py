"""Findings on synthetic jobs: each injected fault is found (kind, rank and key); clean runs stay quiet."""

from __future__ import annotations

import numpy as np
import pytest

from shared import findings, stats
from shared.summary.decoding import decode
from shared.summary.document import Summary, summarize
from shared.summary.query import SummaryQuery
from tests.synthetic import FAULTS, GRAD, LOSS, synthetic_job

STEPS = 200


def _summary(ranks: int, faults: tuple[str, ...], seed: int = 1) -> Summary:
    return summarize(decode(synthetic_job(ranks, STEPS, faults, seed)), "p", "r", SummaryQuery())


def _alarms(summary: Summary) -> set[tuple[str, int | None, str | None]]:
    return {(f["kind"], f["rank"], f["key"]) for f in summary["findings"] if f["severity"] != "info"}


def _all(summary: Summary) -> set[tuple[str, int | None, str | None]]:
    return {(f["kind"], f["rank"], f["key"]) for f in summary["findings"]}


# 512 ranks takes about a second a case: `make quick` runs the 8-rank cases.
RANKS = [8, pytest.param(512, marks=pytest.mark.slow)]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_alone_is_found_with_its_kind_rank_and_key_and_nothing_else(
    ranks: int, fault: str
) -> None:
    rank, kind, key = FAULTS[fault]
    summary = _summary(ranks, (fault,))
    assert (kind, rank, key) in _all(summary), summary["findings"]
    expected_alarms = set() if kind == "weighted_differs" else {(kind, rank, key)}
    assert _alarms(summary) == expected_alarms, summary["findings"]


@pytest.mark.parametrize("ranks", RANKS)
def test_all_faults_together_are_each_found(ranks: int) -> None:
    summary = _summary(ranks, tuple(FAULTS), seed=2)
    want = {(kind, rank, key) for rank, kind, key in FAULTS.values()}
    assert _all(summary) == want, summary["findings"]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_clean_run_raises_no_warning_or_critical_finding(ranks: int, seed: int) -> None:
    summary = _summary(ranks, (), seed=seed + 10)
    assert _alarms(summary) == set(), summary["findings"]


def test_messages_say_what_happened_in_plain_words() -> None:
    summary = _summary(8, tuple(FAULTS), seed=2)
    by_kind = {f["kind"]: f for f in summary["findings"]}
    assert by_kind["stopped_reporting"]["message"].startswith("rank 1 has not reported since step 119")
    assert by_kind["stopped_reporting"]["step"] == 119
    slow = by_kind["persistent_outlier"]["message"]
    assert slow.startswith("rank 3 is 2")
    assert "% slower than the median rank on system/step_time" in slow
    assert slow.endswith("at all 200 of its steps")
    noisy = by_kind["noisy_rank"]["message"]  # about 4x the noise: sqrt(1 + 4**2)
    assert noisy.startswith("rank 4: train/loss jumps around ")
    assert 3 <= float(noisy.split()[5][:-1]) <= 5
    assert by_kind["spike"]["message"].startswith(
        f"rank 5: {LOSS} was 3x the median of the ranks at steps 60, 140"
    )
    assert by_kind["nonfinite"]["step"] == 100
    assert by_kind["rank_disagreement"]["key"] == GRAD
    assert by_kind["rank_disagreement"]["step"] == 80
    assert "out of sync" in by_kind["rank_disagreement"]["message"]
    assert "rank 7 pulls it most" in by_kind["weighted_differs"]["message"]
    missing = by_kind["missing_steps"]["message"]
    assert missing.startswith("rank 2 is intermittently absent: it missed 20 of the 200 steps")


def test_rank_stats_give_bias_noise_and_outlier_counts() -> None:
    summary = _summary(8, ("slow", "noisy"))
    stats = {row["rank"]: row["keys"] for row in summary["rank_stats"]}
    # (None, no figure, counts as 0 and fails each bound)
    assert (stats[3]["system/step_time"]["mean_z"] or 0.0) > 2  # persistently high
    assert stats[3]["system/step_time"]["outlier_steps"] == STEPS
    assert (stats[4][LOSS]["noise"] or 0.0) > 3
    typical = [stats[r][LOSS]["noise"] or 0.0 for r in (0, 1, 2, 5, 6, 7)]
    assert all(0.5 < n < 1.6 for n in typical), typical
    assert stats[0][GRAD]["noise"] is None  # an all-reduced key has no spread to compare with


def test_a_rank_just_behind_at_the_live_edge_is_info_not_critical() -> None:
    events = [e for e in synthetic_job(8, 50) if not (e.rank == 3 and e.step == 49)]
    summary = summarize(decode(events), "p", "r", SummaryQuery())
    stopped = [f for f in summary["findings"] if f["kind"] == "stopped_reporting"]
    assert [(f["rank"], f["severity"]) for f in stopped] == [(3, "info")]
    assert _alarms(summary) == set()


def test_a_world_that_shrinks_is_not_a_stopped_rank() -> None:
    events = [e for e in synthetic_job(8, 60) if e.step < 30 or e.rank < 4]
    events = [e if e.step < 30 else type(e)(e.event_id, e.step, e.rank, 4, e.keys, e.packed) for e in events]
    summary = summarize(decode(events), "p", "r", SummaryQuery())
    assert [f for f in summary["findings"] if f["kind"] in ("stopped_reporting", "missing_steps")] == []


def test_outlier_method_and_threshold_are_settable() -> None:
    summary_decoded = decode(synthetic_job(8, 50, ("spikes",)))
    robust = summarize(summary_decoded, "p", "r", SummaryQuery())
    plain = summarize(summary_decoded, "p", "r", SummaryQuery(outlier_method="z", outlier_threshold=2.5))
    assert robust["outliers"][0]["rank"] == 5
    assert abs(robust["outliers"][0]["score"]) > 10
    assert all(abs(o["score"]) <= 7**0.5 + 5e-4 for o in plain["outliers"])  # sqrt(n - 1), to 3 decimals
    assert all(o["score"] == o["z"] for o in plain["outliers"])
    capped = summarize(summary_decoded, "p", "r", SummaryQuery(outlier_limit=1))
    per_key = [o["key"] for o in capped["outliers"]]
    assert len(per_key) == len(set(per_key)) >= 1  # the cap holds per key: the tab shows one key at a time
    # The findings do not follow the outlier settings.
    assert plain["findings"] == robust["findings"]


@pytest.mark.parametrize("seed", range(40))
def test_all_reduced_is_told_from_the_reducers_as_from_every_value(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ranks, cols = int(rng.choice([2, 3, 4, 8, 12, 40])), int(rng.choice([1, 5, 30]))
    values = np.broadcast_to(rng.normal(3, 1, cols), (ranks, cols)).copy()
    if seed % 3:
        odd = rng.random((ranks, cols)) < rng.choice([0.02, 0.1, 0.5])
        values[odd] *= 1 + rng.choice([1e-12, 1e-3], odd.sum())
    if seed % 5 == 0:
        values[rng.random((ranks, cols)) < 0.1] = np.nan
    complete = rng.random((ranks, cols)) > (0.1 if seed % 7 == 0 else 0.0)
    red = stats.reducers(values, np.ones_like(values))
    full = bool((red.count == ranks).all())
    agree, comparable = findings._agreement(values, red.p50, complete)
    got = findings._all_reduced_agreement(values, red, complete, full)
    assert (got is not None) == findings._agreeing_columns(agree, comparable)
    if got is not None:
        assert np.array_equal(got[0] & comparable, agree & comparable)


def test_a_finding_about_a_rank_names_its_host_when_the_rank_said_it() -> None:
    rows: list[findings.Finding] = [
        {
            "kind": "persistent_outlier",
            "rank": 3,
            "key": "t",
            "step": 0,
            "severity": "warning",
            "message": "rank 3 is slow",
        },
        {
            "kind": "stopped_reporting",
            "rank": 5,
            "key": None,
            "step": 9,
            "severity": "critical",
            "message": "rank 5 stopped",
        },
        {
            "kind": "partial",
            "rank": None,
            "key": None,
            "step": None,
            "severity": "info",
            "message": "partial",
        },
    ]
    named = findings.name_hosts(rows, {3: "gpu-07", 4: "gpu-08"})
    assert named[0] == {**rows[0], "host": "gpu-07", "message": "rank 3 is slow; rank 3 runs on host gpu-07"}
    assert named[1] is rows[1] and named[2] is rows[2]  # rank 5 never said; no rank: nothing to name
    assert "host" not in rows[0]  # the rows given are not changed
    assert findings.name_hosts(named, {3: "gpu-07"}) == named  # named once, however often asked
    assert findings.name_hosts(rows, None) is rows and findings.name_hosts(rows, {}) is rows
