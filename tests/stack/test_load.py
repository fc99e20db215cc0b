"""Load and exactly-once: 512 ranks x 50 steps through the batch route of the local stack, concurrently.

5% of the batches are sent twice, and 5% of the requests fail in transit after the server got them
(the client sends the whole request, then drops the connection without reading the answer, and
retries). Afterwards the table holds each of the 25,600 events once and the summary counts each once.
The stack is the local stack as `instantml local` serves it (the ``local_stack`` fixture of
tests/conftest.py): SQLite in a temporary data directory, the template's wiring, its worker processes.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import pytest

from instantml import routes

PROJECT, RUN = "load", "r512"
RANKS, STEPS, BATCH = 512, 50, 100
CLIENTS = 4


def value(rank: int, step: int) -> float:
    return rank + step / 1000


class Sender:
    """One client connection per request, as an uploader that lost its connection would reconnect."""

    def __init__(self, url: str, token: str) -> None:
        split = urlsplit(url)
        self.host, self.port = split.hostname or "", split.port
        self.path = routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id=RUN)
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.lock = threading.Lock()
        self.answers: list[dict[str, Any]] = []
        self.lost = 0

    def send(self, body: bytes, lose_answer: bool = False) -> dict[str, Any] | None:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            connection.request("POST", self.path, body, self.headers)
            if lose_answer:
                # The request is on the wire; the answer never reaches the client.
                connection.sock.shutdown(2)
                with self.lock:
                    self.lost += 1
                return None
            response = connection.getresponse()
            answer = json.loads(response.read())
            assert response.status == 200, answer
            with self.lock:
                self.answers.append(answer)
            return answer  # type: ignore[no-any-return]
        finally:
            connection.close()

    def deliver(self, body: bytes, lose_first: bool, twice: bool) -> None:
        """Send until an answer arrives (a lost answer is retried at once), then maybe once more."""
        if lose_first:
            self.send(body, lose_answer=True)
        self.send(body)
        if twice:
            self.send(body)


@pytest.mark.timeout(600)  # about 2 minutes alone; more on a machine busy with other work
def test_512_ranks_x_50_steps_with_replays_and_lost_answers_count_each_event_once(local_stack: Any) -> None:
    events = [
        {
            "event_id": f"r{rank}-s{step}",
            "step": step,
            "rank": rank,
            "world_size": RANKS,
            "weight": 1 + rank % 4,
            "metrics": {"train/loss": value(rank, step)},
            "time": 1764672000.0 + step,
        }
        for step in range(STEPS)
        for rank in range(RANKS)
    ]
    batches = [json.dumps({"events": events[i : i + BATCH]}).encode() for i in range(0, len(events), BATCH)]
    chosen = random.Random(3)
    n = len(batches)  # 256
    twice = set(chosen.sample(range(n), round(n * 0.05)))
    lost = set(chosen.sample(range(n), round(n * 0.05)))
    sender = Sender(local_stack.url, local_stack.token)
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(lambda i: sender.deliver(batches[i], i in lost, i in twice), range(n)))

    # What the client saw: every batch answered, nothing rejected, nothing reported stored twice.
    assert sender.lost == len(lost) == 13
    assert len(twice) == 13
    assert len(sender.answers) == n + len(twice)
    results = [r for answer in sender.answers for r in answer["results"]]
    assert Counter(r["status"] for r in results)["rejected"] == 0
    stored_twice = [
        i for i, c in Counter(r["event_id"] for r in results if r["status"] == "stored").items() if c > 1
    ]
    assert stored_twice == []
    assert {r["event_id"] for r in results} == {e["event_id"] for e in events}

    # What the table holds: each event once.

    items = local_stack.store().read_events(PROJECT, RUN).events
    assert len(items) == RANKS * STEPS == 25_600
    assert len({(i.step, i.rank) for i in items}) == 25_600

    # What the summary counts: 512 ranks at each of the 50 steps, each once, with the logged values.
    url = urlsplit(local_stack.url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=120)
    path = routes.DISTRIBUTED.format(project=PROJECT, run_id=RUN) + f"?max_steps={STEPS}"
    connection.request("GET", path, headers={"Authorization": f"Bearer {local_stack.token}"})
    response = connection.getresponse()
    summary = json.loads(response.read())
    connection.close()
    assert response.status == 200, summary
    loss = summary["reducers"]["train/loss"]
    assert summary["steps"] == list(range(STEPS))
    assert loss["count"] == [RANKS] * STEPS
    assert sum(loss["count"]) == 25_600
    assert summary["coverage"]["reported"] == [RANKS] * STEPS
    assert summary["coverage"]["missing"] == [[]] * STEPS
    for step in range(STEPS):
        want = sum(value(rank, step) for rank in range(RANKS)) / RANKS
        assert abs(loss["mean"][step] - want) < 1e-9
