"""The first minute of a job on AWS (issue 41), simulated from measured durations: every rank's first
upload at once, onto cold instances, through the authorizer's first verdicts.

``benchmarks.aws_model`` measures what goes in (each function's cold start and warm duration, from the
real handlers on moto); this module only replays the first minute against the template's limits, so
it is pure: numbers in, counts out.

- Each rank's process starts within ``launch_s`` of the others (torchrun and SLURM start every rank
  within a second or two), and its uploader sends its first request a random part of ``spread_s``
  later (``instantml.upload.transport.first_upload_spread_s``: 0 sends it at once), then every
  ``interval`` seconds.
- API Gateway calls the authorizer for a request unless a verdict of its token is cached (one token per
  job: every rank's requests share it; ``AuthorizerCacheSeconds``); until the first verdict is back,
  every request calls it.
- A function has at most ``concurrency`` instances (its reserved concurrency): a request goes to an
  idle instance (``warm_s``), else to a new one while there are fewer (``cold_s + warm_s``), else it is
  throttled and the client retries it after ``instantml.upload.transport.backoff`` (the uploader holds
  a failed batch and sends it again: nothing is dropped).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from instantml.upload import transport


@dataclass(frozen=True)
class Pool:
    """A function's limits and timings."""

    concurrency: int
    cold_s: float  # a new instance's start before it serves (runtime and imports)
    warm_s: float  # one request on a warm instance


@dataclass
class StartFigures:
    uploads: int  # the uploads the ranks make in the simulated time
    attempts: int  # requests sent, retries included
    throttled: int  # attempts refused for want of an instance (authorizer or ingest)
    throttled_authorizer: int
    delivered: int  # uploads stored within the simulated time
    held: int  # uploads still being retried at its end (held by their uploaders, not lost)
    authorizer_calls: int
    ingest_instances: int
    last_first_upload_s: float  # when the last rank's first upload was stored

    @property
    def throttled_share(self) -> float:
        return self.throttled / self.attempts if self.attempts else 0.0


_SENT, _AUTHORIZED, _STORED = range(3)


class _Instances:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.free_at: list[float] = []  # each instance's end of its current request (a heap)
        self.made = 0

    def serve(self, t: float) -> float | None:
        """When the request arriving at ``t`` is answered, or None when it is throttled."""
        if self.free_at and self.free_at[0] <= t:
            heapq.heapreplace(self.free_at, t + self.pool.warm_s)
            return t + self.pool.warm_s
        if len(self.free_at) < self.pool.concurrency:
            self.made += 1
            heapq.heappush(self.free_at, t + self.pool.cold_s + self.pool.warm_s)
            return t + self.pool.cold_s + self.pool.warm_s
        return None


def first_minute(
    ranks: int,
    interval: float,
    ingest: Pool,
    authorizer: Pool,
    cache_s: float,
    launch_s: float = 2.0,
    spread_s: float = 0.0,
    seconds: float = 60.0,
    seed: int = 41,
) -> StartFigures:
    """The first ``seconds`` of a ``ranks``-rank job whose uploaders send every ``interval`` seconds."""
    rng = random.Random(seed)
    random.seed(seed)  # (``transport.backoff`` draws its jitter from the module's generator)
    queue: list[tuple[float, int, int, int, int]] = []  # (time, order, stage, upload, failures)
    order = 0

    def at(t: float, stage: int, upload: int, failures: int) -> None:
        nonlocal order
        heapq.heappush(queue, (t, order, stage, upload, failures))
        order += 1

    firsts: list[bool] = []  # per upload: whether it is its rank's first
    for _ in range(ranks):
        first = rng.uniform(0, launch_s) + rng.uniform(0, spread_s)
        k = 0
        while first + k * interval < seconds:
            firsts.append(k == 0)
            at(first + k * interval, _SENT, len(firsts) - 1, 0)
            k += 1
    auth, ing = _Instances(authorizer), _Instances(ingest)
    verdict_from, verdict_until = float("inf"), float("-inf")  # the token's cached verdict
    attempts = throttled = throttled_auth = auth_calls = delivered = 0
    last_first = 0.0
    while queue:
        t, _, stage, upload, failures = heapq.heappop(queue)
        answered: float | None
        if stage == _STORED:
            delivered += 1
            last_first = max(last_first, t) if firsts[upload] else last_first
            continue
        if stage == _SENT:
            attempts += 1
            if verdict_from <= t < verdict_until:
                at(t, _AUTHORIZED, upload, failures)
                continue
            auth_calls += 1  # no verdict cached: API Gateway asks the authorizer
            answered = auth.serve(t)
            if answered is not None:
                if answered >= verdict_until:
                    verdict_from, verdict_until = answered, answered + cache_s
                elif answered < verdict_from:
                    verdict_from = answered
                at(answered, _AUTHORIZED, upload, failures)
                continue
            throttled_auth += 1
        else:  # authorized: the ingest function
            answered = ing.serve(t)
            if answered is not None:
                at(answered, _STORED, upload, failures)
                continue
        throttled += 1  # refused for want of an instance: the uploader sends it again
        retry = t + transport.backoff(failures, None)
        if retry < seconds:
            at(retry, _SENT, upload, failures + 1)
    return StartFigures(
        uploads=len(firsts),
        attempts=attempts,
        throttled=throttled,
        throttled_authorizer=throttled_auth,
        delivered=delivered,
        held=len(firsts) - delivered,
        authorizer_calls=auth_calls,
        ingest_instances=ing.made,
        last_first_upload_s=last_first,
    )
