"""``benchmarks.aws_model.team_key_loads``: one run's metered writes spread over a team's live runs
(issue 41): a run's own keys stay its own, an index shard sums the runs the store's hash puts there,
any other key is shared by all."""

from __future__ import annotations

from collections import Counter
from typing import Any

from benchmarks.aws_model import PROJECT, IngestSample, Invocation, Job, team_key_loads, team_run
from benchmarks.metering import Bill
from shared.store.dynamodb import listing_shard, watch_shard


def _sample(partition_wcu: dict[tuple[str, Any], int], seconds: float) -> IngestSample:
    bill = Bill()
    bill.partition_wcu.update(partition_wcu)
    job = Job(ranks=512, keys=4, rate=5.0, linger=10.0, batch=500)
    call = Invocation()
    return IngestSample(job, seconds, 10, 500, 3, bill, [call], call, call, Counter())


def test_a_team_s_load_keeps_each_run_s_keys_its_own_and_sums_the_runs_of_each_index_shard() -> None:
    run = team_run(0)
    sample = _sample(
        {
            ("runs", f"{PROJECT}#{run}"): 500,  # its items: 50/s
            ("metrics", f"{PROJECT}#{run}#03"): 2000,  # an event shard: 200/s
            ("runs/by_project", listing_shard(PROJECT, run)): 10,  # 1/s from each run
            ("runs/by_received", watch_shard(PROJECT, run)): 10,
            ("runs", PROJECT): 30,  # the earlier layout's project key: 3/s from each run
        },
        seconds=10.0,
    )
    loads = team_key_loads(sample, 100)
    assert loads[("runs", f"{PROJECT}#{run} (a run's own)")] == 50.0
    assert loads[("metrics", f"{PROJECT}#{run}#03 (a run's own)")] == 200.0
    shards = Counter(listing_shard(PROJECT, team_run(n)) for n in range(100))
    for shard, runs in shards.items():
        assert loads[("runs/by_project", shard)] == runs * 1.0
    watched = Counter(watch_shard(PROJECT, team_run(n)) for n in range(100))
    assert sum(loads[("runs/by_received", s)] for s in watched) == 100.0
    assert max(loads[("runs/by_received", s)] for s in watched) == max(watched.values())
    assert loads[("runs", f"{PROJECT} (shared by all)")] == 300.0
