"""``benchmarks.job_start``: the first minute of a job against a function's limits (issue 41)."""

from __future__ import annotations

from benchmarks.job_start import Pool, first_minute

ROOMY = Pool(concurrency=1000, cold_s=0.5, warm_s=0.03)


def test_a_job_within_every_limit_has_nothing_throttled_and_each_rank_uploads_every_interval() -> None:
    figures = first_minute(64, 10.0, ROOMY, ROOMY, cache_s=60.0)
    assert figures.throttled == 0 and figures.attempts == figures.uploads == figures.delivered
    assert 64 * 5 <= figures.uploads <= 64 * 6  # a first upload within 2 s, then one every 10 s
    assert figures.held == 0
    # before the first verdict is back every request asks the authorizer; after it, one a minute
    assert 1 < figures.authorizer_calls < 64


def test_a_burst_beyond_the_concurrency_is_throttled_then_retried_until_stored() -> None:
    narrow = Pool(concurrency=4, cold_s=0.5, warm_s=0.03)
    burst = first_minute(256, 10.0, narrow, ROOMY, cache_s=60.0)
    assert burst.throttled > 0 and burst.attempts == burst.uploads + burst.throttled
    assert burst.delivered == burst.uploads and burst.held == 0  # every throttled request stored later
    assert burst.ingest_instances == 4
    spread = first_minute(256, 10.0, narrow, ROOMY, cache_s=60.0, spread_s=10.0)
    assert spread.throttled < burst.throttled / 4


def test_the_authorizer_throttles_the_first_requests_when_it_has_few_instances() -> None:
    figures = first_minute(256, 10.0, ROOMY, Pool(concurrency=2, cold_s=0.5, warm_s=0.01), cache_s=60.0)
    assert figures.throttled_authorizer > 0 and figures.throttled >= figures.throttled_authorizer
