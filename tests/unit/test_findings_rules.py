"""The peer-relative rules of ``shared.findings`` one at a time, on small hand-made jobs: what sets a
rank apart is flagged, what every rank shows is not, and the messages say how sure and how big."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from shared import findings, stats
from shared.store.port import StoredEvent
from shared.summary.decoding import decode
from shared.summary.document import summarize
from shared.summary.query import SummaryQuery

STEPS = 200


def _key(key: str, values: np.ndarray) -> findings.KeyResult:
    weights = np.ones_like(values)
    red = stats.reducers(values, weights)
    none = np.zeros(values.shape, bool)
    return findings.key_findings(key, values, weights, red, none, ~none, np.arange(values.shape[1]), 1)


def _alarms(rows: list[findings.Finding]) -> list[tuple[str, int | None, str | None]]:
    return sorted((f["kind"], f["rank"], f["key"]) for f in rows if f["severity"] != "info")


def _data_time(rng: np.random.Generator, ranks: int, blips: float = 0.01) -> np.ndarray:
    """A healthy data-loading time: about 5 ms, with a brief blip (GC, a page fault) now and then."""
    x = 0.005 * np.exp(rng.normal(0, 0.1, (ranks, STEPS)))
    blip = rng.random((ranks, STEPS)) < blips
    x[blip] += rng.uniform(0.002, 0.05, int(blip.sum()))
    return x


@pytest.mark.parametrize("ranks", [8, 64])
@pytest.mark.parametrize("seed", range(5))
def test_blips_that_every_rank_has_are_never_a_warning(ranks: int, seed: int) -> None:
    """Real jobs: every rank's data time jumps 2x-10x now and then; that is the key's noise."""
    result = _key("system/data_time", _data_time(np.random.default_rng(seed), ranks))
    assert _alarms(result.findings) == []


def test_an_8x_loss_on_two_steps_is_a_spike_not_a_noisy_rank() -> None:
    rng = np.random.default_rng(3)
    loss = (2 * np.exp(-np.arange(STEPS) / 80) + 0.3) * np.exp(rng.normal(0, 0.02, (16, STEPS)))
    loss[7, 60:62] *= 8
    result = _key("train/loss", loss)
    assert _alarms(result.findings) == [("spike", 7, "train/loss")]
    (spike,) = result.findings
    assert spike["message"].startswith("rank 7: train/loss was 8")
    assert "at steps 60-61" in spike["message"]
    assert spike["step"] == 60


def test_a_slow_rank_is_named_with_how_much_and_on_how_many_steps() -> None:
    rng = np.random.default_rng(4)
    step_time = 0.25 * np.exp(rng.normal(0, 0.02, (12, STEPS)))
    step_time[11] *= 1.3
    (row,) = _key("system/step_time", step_time).findings
    assert (row["kind"], row["rank"], row["severity"]) == ("persistent_outlier", 11, "warning")
    # "at all 200 of its steps", not "on 200 of its 200 steps"
    assert (
        row["message"]
        == f"rank 11 is 30% slower than the median rank on system/step_time at all {STEPS} of its steps"
    )


def test_two_ranks_one_1000x_slower_is_named_and_the_message_says_what_two_ranks_can_tell() -> None:
    rng = np.random.default_rng(5)
    data_time = 0.002 * np.exp(rng.normal(0, 0.1, (2, STEPS)))
    data_time[1] *= 1000
    rows = _key("system/data_time", data_time).findings
    assert _alarms(rows) == [("persistent_outlier", 1, "system/data_time")]
    assert "not which one is wrong" in rows[0]["message"]


def test_two_healthy_ranks_raise_nothing() -> None:
    rng = np.random.default_rng(6)
    for key, x in {
        "train/loss": 1 + rng.normal(0, 0.02, (2, STEPS)),
        "system/data_time": _data_time(rng, 2, blips=0.03),
    }.items():
        assert _alarms(_key(key, x).findings) == []


def test_the_rank_the_others_wait_for_is_one_straggler_finding() -> None:
    """DDP: the rank with the slow data loader computes 'faster', because the others wait for it at
    the gradient all-reduce; both facts are one finding."""
    rng = np.random.default_rng(7)
    data = _data_time(rng, 8)
    data[3] += 0.1  # 100 ms more to load each batch
    compute = 0.2 + 0.1 + rng.normal(0, 0.002, (8, STEPS))  # its own 0.2 s + waiting for rank 3
    compute[3] -= 0.1  # rank 3 does not wait: it is the one waited for
    results = {
        "system/data_time": _key("system/data_time", data),
        "system/compute_time": _key("system/compute_time", compute),
    }
    rows = findings.cross_key_findings([f for r in results.values() for f in r.findings], results)
    assert _alarms(rows) == [("straggler", 3, "system/data_time")]
    (message,) = [f["message"] for f in rows if f["kind"] == "straggler"]
    assert message.startswith("rank 3 is the straggler the other ranks wait for")
    assert "system/compute_time, which includes waiting" in message
    assert "33% below" in message
    assert "the job loses about 0.1 of system/data_time a step" in message


def _events(values: dict[str, np.ndarray], local_size: int) -> list[StoredEvent]:
    keys = list(values)
    ranks, steps = next(iter(values.values())).shape
    events = []
    for r in range(ranks):
        for s in range(steps):
            packed = np.array([1.0, float(s), *(values[k][r, s] for k in keys)], "<f8").tobytes()
            events.append(StoredEvent(f"e-{r}-{s}", s, r, ranks, keys, packed, r % local_size))
    return events


def test_a_slow_node_is_one_finding_that_names_the_node_and_its_ranks() -> None:
    rng = np.random.default_rng(8)
    step_time = 0.25 * np.exp(rng.normal(0, 0.02, (32, 100)))
    step_time[16:24] *= 1.2  # the third node of 8
    summary = summarize(decode(_events({"system/step_time": step_time}, 8)), "p", "r", SummaryQuery())
    assert _alarms(summary["findings"]) == [("node_outlier", 16, "system/step_time")]
    message = summary["findings"][0]["message"]
    assert message.startswith("the node of ranks 16-23: 8 of its 8 ranks share one finding")


def test_without_local_rank_the_ranks_of_a_slow_node_are_listed_one_by_one() -> None:
    rng = np.random.default_rng(8)
    step_time = 0.25 * np.exp(rng.normal(0, 0.02, (32, 100)))
    step_time[16:24] *= 1.2
    events = [e._replace(local_rank=None) for e in _events({"system/step_time": step_time}, 8)]
    summary = summarize(decode(events), "p", "r", SummaryQuery())
    assert _alarms(summary["findings"]) == [
        ("persistent_outlier", r, "system/step_time") for r in range(16, 24)
    ]


def test_an_outlier_row_is_an_alarm_only_where_a_finding_names_its_rank_and_key() -> None:
    rng = np.random.default_rng(9)
    loss = 1 + rng.normal(0, 0.02, (8, 100))
    loss[5, 40] = 9.0
    step_time = 0.25 * np.exp(rng.normal(0, 0.02, (8, 100)))
    summary = summarize(
        decode(_events({"train/loss": loss, "system/step_time": step_time}, 8)), "p", "r", SummaryQuery()
    )
    alarms = [(o["rank"], o["key"], o["step"]) for o in summary["outliers"] if o["alarm"]]
    assert alarms == [(5, "train/loss", 40)]
    assert all(not o["alarm"] for o in summary["outliers"] if o["key"] == "system/step_time")


def test_a_rank_descheduled_a_few_times_is_info_and_one_that_stalls_often_is_a_warning() -> None:
    rng = np.random.default_rng(10)
    data = 0.005 * np.exp(rng.normal(0, 0.05, (8, 60)))
    data[4, [10, 25, 40, 55]] *= 20  # four stalls of one rank in 60 steps, none elsewhere
    assert _alarms(_key("system/data_time", data).findings) == []
    data = 0.005 * np.exp(rng.normal(0, 0.05, (8, STEPS)))
    data[4, ::4] *= 20  # a stall every fourth step: that rank is the noisy one
    assert _alarms(_key("system/data_time", data).findings) == [("noisy_rank", 4, "system/data_time")]


def _descheduled_steps(rng: np.random.Generator, ranks: int, steps: int, extra: float = 1.0) -> np.ndarray:
    """A real CPU job's step time in ms (seen on 2 cores, 8 torch ranks): 100.1 ms, and now and then a
    rank descheduled for 1-7 ms; every rank has it, one a little more often (``extra``) by chance."""
    x = 100.1 + np.abs(rng.normal(0, 0.05, (ranks, steps)))
    rate = np.full((ranks, 1), 0.08)
    rate[1] *= extra
    blip = rng.random((ranks, steps)) < rate
    x[blip] += rng.uniform(1.0, 7.0, int(blip.sum()))
    x[:, steps // 2] += 120_000.0  # and a 2-minute evaluation every rank shares
    return x


@pytest.mark.parametrize("seed", range(20))
def test_a_rank_descheduled_a_little_more_than_its_peers_is_not_noisy(seed: int) -> None:
    """The false alarm of a real DDP job: a 2 ms descheduling pattern, 2x as often on one rank, on a
    100 ms step: neither beyond chance nor a share of the step anyone would act on."""
    rng = np.random.default_rng(seed)
    result = _key("system/step_time_ms", _descheduled_steps(rng, 8, 40, extra=2.0))
    assert _alarms(result.findings) == []


def test_a_rank_whose_step_time_swings_by_a_fifth_is_noisy_whatever_its_peers_blips() -> None:
    rng = np.random.default_rng(3)
    x = _descheduled_steps(rng, 8, 200)
    x[5] *= np.exp(rng.normal(0, 0.2, 200))  # its data loader: 20% swings, every step
    assert _alarms(_key("system/step_time_ms", x).findings) == [("noisy_rank", 5, "system/step_time_ms")]


def test_a_rank_apart_in_columns_of_steps_says_how_many_steps_a_column_is() -> None:
    rng = np.random.default_rng(4)
    step_time = 0.25 * np.exp(rng.normal(0, 0.002, (12, STEPS)))
    step_time[11] *= 1.3
    weights = np.ones_like(step_time)
    none = np.zeros(step_time.shape, bool)
    red = stats.reducers(step_time, weights)
    binned = findings.key_findings(
        "system/step_time", step_time, weights, red, none, ~none, np.arange(STEPS) * 3, 3
    )
    (row,) = binned.findings
    assert row["message"].endswith(f"in all {STEPS} of its columns (3 steps each)"), row["message"]


# The constant-key rule: a key equal on every rank at each step (a learning rate, an epoch, a step
# counter) never gives a finding, whatever its values do over the steps (Gaussian, heavy-tailed,
# lognormal) and whatever the weights: its std and weighted mean differ from 0 and the mean only by
# floating-point rounding (``weighted_differs`` "by 2.656e-18 ... carrying 0% of the weight").
SHAPES_OVER_STEPS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "gaussian": lambda rng, n: 3e-4 * (1 + 0.1 * rng.standard_normal(n)),
    "student_t1": lambda rng, n: 0.1 * rng.standard_t(1, n),  # Cauchy: huge jumps, both signs
    "student_t3": lambda rng, n: 1e-3 * (5 + rng.standard_t(3, n)),
    "lognormal": lambda rng, n: np.exp(rng.normal(-8, 3, n)),
    "flat": lambda rng, n: np.full(n, 3e-4),
}


@pytest.mark.parametrize("ranks", [8, 64, 512])
@pytest.mark.parametrize("shape", sorted(SHAPES_OVER_STEPS))
@pytest.mark.parametrize("weighting", ["equal", "uneven", "random"])
def test_a_key_equal_on_every_rank_never_gives_a_finding(ranks: int, shape: str, weighting: str) -> None:
    rng = np.random.default_rng(ranks)
    values = np.broadcast_to(SHAPES_OVER_STEPS[shape](rng, STEPS), (ranks, STEPS)).copy()
    weights = {
        "equal": np.ones_like(values),
        "uneven": np.broadcast_to((1024.0 - 96 * (np.arange(ranks) % 8))[:, None], values.shape).copy(),
        "random": 1024.0 * rng.choice([14, 15, 16, 17, 18], values.shape),
    }[weighting]
    red = stats.reducers(values, weights)
    none = np.zeros(values.shape, bool)
    result = findings.key_findings("train/lr", values, weights, red, none, ~none, np.arange(STEPS), 1)
    assert result.findings == []


def test_the_rounding_that_made_weighted_differs_is_there_without_the_rule() -> None:
    """The case of the issue is real: with a flat 3e-4 on 512 ranks the weighted mean carries rounding,
    on the same side at every step (else the test above would prove nothing); the std of equal values
    is exactly 0 (``stats.reducers``)."""
    values = np.full((512, STEPS), 3e-4)
    weights = np.broadcast_to((1024.0 - 96 * (np.arange(512) % 8))[:, None], values.shape).copy()
    red = stats.reducers(values, weights)
    assert np.all(red.std == 0)
    assert np.all(red.weighted_mean != red.mean)


@pytest.mark.parametrize("shape", ["student_t1", "lognormal"])
def test_one_rank_off_a_heavy_tailed_all_reduced_key_is_still_a_disagreement(shape: str) -> None:
    """The rule is about rounding, not about small differences: a rank 1e-6 off is out of sync."""
    rng = np.random.default_rng(11)
    values = np.broadcast_to(SHAPES_OVER_STEPS[shape](rng, STEPS), (64, STEPS)).copy()
    values[9, 120:] *= 1 + 1e-6
    rows = _key("train/lr", values).findings
    assert _alarms(rows) == [("rank_disagreement", 9, "train/lr")], rows


@pytest.mark.parametrize("family", ["student_t3", "lognormal"])
def test_a_heavy_tailed_key_that_differs_across_ranks_is_not_constant(family: str) -> None:
    """Heavy tails across ranks (a few ranks far out at each step) are spread, not rounding: a slow rank
    on such a key is still found."""
    rng = np.random.default_rng(12)
    noise = rng.standard_t(3, (64, STEPS)) if family == "student_t3" else rng.normal(0, 1, (64, STEPS))
    step_time = 0.25 * np.exp(0.03 * noise)
    step_time[17] *= 1.5
    assert _alarms(_key("system/step_time", step_time).findings) == [
        ("persistent_outlier", 17, "system/step_time")
    ]


def test_a_summary_of_a_job_with_an_equal_key_says_nothing_about_it() -> None:
    rng = np.random.default_rng(13)
    lr = np.broadcast_to(np.full(100, 3e-4), (64, 100)).copy()
    loss = 1 + 0.02 * rng.standard_t(3, (64, 100))
    events = [  # uneven weights, as batch sizes are: the weighted mean and the mean round differently
        e._replace(
            packed=np.concatenate(
                [[1024.0 - 96 * (e.rank % 8)], np.frombuffer(e.packed, "<f8")[1:]]
            ).tobytes()
        )
        for e in _events({"train/lr": lr, "train/loss": loss}, 8)
    ]
    summary = summarize(decode(events), "p", "r", SummaryQuery())
    assert [f for f in summary["findings"] if f["key"] == "train/lr"] == []
