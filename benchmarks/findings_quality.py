"""How good the findings are on synthetic jobs (tests/jobs.py): false alarms on healthy jobs, faults
found, the smallest fault found reliably, and what the findings cost beside the reducers.

    .venv/bin/python -m benchmarks.findings_quality [--quick] [--jobs N] [--fault-model realistic]

Each job is summarized in-process, as the summarize function does: ``shared.summary.decoding.decode`` then
``summarize(run, "p", "r", SummaryQuery())`` (default query: every key, 200 columns).

- false alarms: for each healthy noise model (``tests.jobs.MODELS``) at 2, 8, 64 ranks x 200 steps
  (12 seeds each) and 512 ranks x 200 steps (8 seeds): ``warning`` and ``critical`` rows per 100 jobs
  (a healthy job should have none), then what they were (kind and key, rows per 100 jobs). 528 jobs.
  The ``info`` rows they raise are listed too, for review (not counted as alarms).
- faults: each fault of ``tests.jobs.FAULT_SIZES`` at each size, added to the ``--fault-model`` job
  (default ``realistic``) at 8 and 64 ranks (and 2 where two ranks can tell it: ``AT_TWO_RANKS``;
  ``slow_node`` at 64 only), 200 steps, 40 seeds: the share of jobs where every expected finding is
  there with its kind, rank and key (at any severity; ``Job.aliases`` count), and the unexpected
  ``warning``/``critical`` rows per job, all of them and those about the faulty rank(s) alone (the
  fault described another way, not the model's noise).
- the smallest size of each fault found in at least 95% of its jobs, per rank count.
- cost at 512 ranks x 200 columns x 4 keys (a ``realistic`` job): ``stats.reducers`` over the 4
  matrices, against the findings' time, which is ``summarize`` minus ``summarize`` with every function
  of ``shared.findings`` that ``shared.summary.document`` reaches replaced by one that finds nothing. Both go
  through ``summarize``, so the figure holds whatever the findings' own signatures become. Interleaved
  rounds, medians.

``--quick`` (under a minute): 2 seeds per healthy cell and 512 x 100 steps, 4 seeds per fault cell,
fewer timing rounds. ``--jobs N``: worker processes (default 1; 2 uses both cores here).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared import findings as explain  # noqa: E402
from shared import stats  # noqa: E402
from shared.summary.decoding import decode  # noqa: E402
from shared.summary.document import summarize  # noqa: E402
from shared.summary.query import SummaryQuery  # noqa: E402
from tests.jobs import (  # noqa: E402
    AT_TWO_RANKS,
    DATA_TIME,
    FAULT_SIZES,
    GRAD,
    LOSS,
    MODELS,
    RANKS_PER_NODE,
    STEP_TIME,
    Job,
    describe,
    faulty_job,
    healthy_job,
)

HEALTHY_RANKS = (2, 8, 64, 512)
FAULT_RANKS = (2, 8, 64)
RELIABLE = 0.95
#: Spikes are also tried one step and five steps long at this size.
SPIKE_WIDTHS = ((8.0, 1), (8.0, 5))


@dataclass(frozen=True)
class Case:
    """One job to generate and judge."""

    model: str
    ranks: int
    steps: int
    seed: int
    fault: str | None = None
    size: float = 0.0
    width: int = 2

    def job(self) -> Job:
        if self.fault is None:
            return healthy_job(self.model, self.ranks, self.steps, self.seed)
        return faulty_job(self.fault, self.size, self.ranks, self.steps, self.seed, self.model, self.width)


@dataclass(frozen=True)
class Outcome:
    case: Case
    expected: str  # the expected kinds, joined by "+"
    found: bool
    unexpected: list[tuple[str, str]]  # (kind, key) of each unexpected warning/critical row
    on_faulty: list[tuple[str, str]]  # those about a faulty rank (or a rank of the slow node)
    info: list[tuple[str, str]]  # (kind, key) of each unexpected info row


def judge(case: Case) -> Outcome:
    job = case.job()
    findings = summarize(decode(job.events), "p", "r", SummaryQuery())["findings"]
    faulty = {e.rank for e in job.expected if e.rank is not None}
    if case.fault == "slow_node":
        faulty = {r + i for r in faulty for i in range(RANKS_PER_NODE)}
    rows = job.unexpected(findings)
    accepted = job.accepted()
    info = [
        f for f in findings if f["severity"] == "info" and (f["kind"], f["rank"], f["key"]) not in accepted
    ]
    return Outcome(
        case,
        "+".join(sorted({e.kind for e in job.expected})),
        not job.missed(findings),
        [(f["kind"], f["key"] or "-") for f in rows],
        [(f["kind"], f["key"] or "-") for f in rows if f["rank"] in faulty],
        [(f["kind"], f["key"] or "-") for f in info],
    )


def healthy_cases(quick: bool) -> list[Case]:
    cases = []
    for model in MODELS:
        for ranks in HEALTHY_RANKS:
            big = ranks >= 512
            seeds = (1 if big else 2) if quick else (8 if big else 12)
            steps = 100 if big and quick else 200
            cases += [Case(model, ranks, steps, seed) for seed in range(seeds)]
    return cases


def fault_variants() -> list[tuple[str, float, int]]:
    """(fault, size, spike width) in table order."""
    variants = []
    for fault, sizes in FAULT_SIZES.items():
        variants += [(fault, size, 2) for size in sizes]
        if fault == "spikes":
            variants += [(fault, size, width) for size, width in SPIKE_WIDTHS]
    return variants


def fault_ranks(fault: str) -> tuple[int, ...]:
    if fault == "slow_node":
        return (64,)
    return tuple(r for r in FAULT_RANKS if r > 2 or fault in AT_TWO_RANKS)


def fault_cases(quick: bool, model: str) -> list[Case]:
    seeds = 4 if quick else 40
    return [
        Case(model, ranks, 200, seed, fault, size, width)
        for fault, size, width in fault_variants()
        for ranks in fault_ranks(fault)
        for seed in range(seeds)
    ]


def run_all(cases: list[Case], workers: int) -> list[Outcome]:
    if workers <= 1:
        return [judge(c) for c in cases]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(judge, cases, chunksize=4)


def report_healthy(outcomes: list[Outcome]) -> None:
    by_cell: dict[tuple[str, int], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_cell[(o.case.model, o.case.ranks)].append(o)
    steps = {r: max(o.case.steps for o in outcomes if o.case.ranks == r) for r in HEALTHY_RANKS}
    print(
        f"\nfalse alarms on healthy jobs: warning/critical rows per 100 jobs (jobs run); {len(outcomes)} jobs"
    )
    print(f"  {'model':<18}" + "".join(f"{f'{r} x {steps[r]}':>16}" for r in HEALTHY_RANKS))
    for model in MODELS:
        cells = []
        for ranks in HEALTHY_RANKS:
            got = by_cell[(model, ranks)]
            rate = 100 * sum(len(o.unexpected) for o in got) / len(got)
            cells.append(f"{rate:>10.0f} ({len(got):>2})")
        print(f"  {model:<18}" + "".join(f"{c:>16}" for c in cells))
    clean = sum(not o.unexpected for o in outcomes)
    print(f"  jobs without any false alarm: {clean} of {len(outcomes)}")
    print("\nwhat the false rows were: kind key, rows per 100 jobs (most frequent first)")
    for model in MODELS:
        for ranks in HEALTHY_RANKS:
            got = by_cell[(model, ranks)]
            kinds = Counter(row for o in got for row in o.unexpected)
            if kinds:
                listed = ", ".join(
                    f"{k} {key} {100 * n / len(got):.0f}" for (k, key), n in kinds.most_common(5)
                )
                more = f" (+{len(kinds) - 5} more)" if len(kinds) > 5 else ""
                print(f"  {model:<18} {ranks:>3}: {listed}{more}")
    print("\ninfo rows on healthy jobs (not alarms; listed for review): kind key, rows per 100 jobs")
    for model in MODELS:
        got = [o for o in outcomes if o.case.model == model]
        rows = Counter(row for o in got for row in o.info)
        if rows:
            listed = ", ".join(f"{k} {key} {100 * n / len(got):.0f}" for (k, key), n in rows.most_common(4))
            print(f"  {model:<18} {listed}")


def report_faults(outcomes: list[Outcome], model: str) -> None:
    by_cell: dict[tuple[str, float, int, int], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        c = o.case
        assert c.fault is not None
        by_cell[(c.fault, c.size, c.width, c.ranks)].append(o)
    seeds = max(len(v) for v in by_cell.values())
    print(
        f"\nfaults added to the {model!r} model, 200 steps, {seeds} seeds: found = jobs with every expected "
        "finding (kind, rank, key);\nextra = unexpected warning/critical rows per job, all / about the "
        "faulty rank(s)"
    )
    print(
        f"  {'fault':<15}{'size':>8}  {'expected kind':<19}"
        + "".join(f"{f'{r} ranks':>22}" for r in FAULT_RANKS)
    )
    for fault, size, width in fault_variants():
        cells, kinds = [], ""
        for ranks in FAULT_RANKS:
            got = by_cell.get((fault, size, width, ranks))
            if not got:
                cells.append("")
                continue
            kinds = got[0].expected
            found = sum(o.found for o in got) / len(got)
            extra = sum(len(o.unexpected) for o in got) / len(got)
            mine = sum(len(o.on_faulty) for o in got) / len(got)
            cells.append(f"{found:>4.0%} ({extra:5.1f} / {mine:3.1f})")
        print(
            f"  {fault:<15}{describe(fault, size, width):>8}  {kinds:<19}"
            + "".join(f"{c:>22}" for c in cells)
        )
    print("\nunexpected rows about the faulty rank(s), per job (all sizes and rank counts together)")
    per_fault: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        assert o.case.fault is not None
        per_fault[o.case.fault].append(o)
    for fault, got in per_fault.items():
        rows = Counter(row for o in got for row in o.on_faulty)
        listed = ", ".join(f"{k} {key} {n / len(got):.2f}" for (k, key), n in rows.most_common(6)) or "none"
        print(f"  {fault:<15} {listed}")

    print(f"\nsmallest size found in >= {RELIABLE:.0%} of jobs ('none': not at any size tried)")
    print(f"  {'fault':<15}" + "".join(f"{f'{r} ranks':>10}" for r in FAULT_RANKS))
    for fault, sizes in FAULT_SIZES.items():
        cells = []
        for ranks in FAULT_RANKS:
            if (fault, sizes[0], 2, ranks) not in by_cell:
                cells.append("")
                continue
            reliable = [
                s for s in sizes if sum(o.found for o in by_cell[(fault, s, 2, ranks)]) >= RELIABLE * seeds
            ]
            cells.append(describe(fault, reliable[0]) if reliable else "none")
        print(f"  {fault:<15}" + "".join(f"{c:>10}" for c in cells))


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def report_cost(rounds: int) -> None:
    """The findings' calls on the summary's own matrices (``shared.findings.key_findings`` per key and
    ``cross_key_findings``, as ``shared.summary.document`` makes them) beside ``stats.reducers`` on the same
    matrices, interleaved; the whole summary for scale."""
    ranks, steps = 512, 200
    keys = (LOSS, GRAD, DATA_TIME, STEP_TIME)
    job = healthy_job("realistic", ranks, steps, seed=0)
    run = decode(job.events)
    query = SummaryQuery(keys=list(keys))
    document = summarize(run, "p", "r", query)
    matrices = {k: np.array(document["heatmap"][k]["values"], dtype=float) for k in keys}
    weights = np.ones_like(matrices[LOSS])
    reduced = {k: stats.reducers(m, weights) for k, m in matrices.items()}
    none = np.zeros(weights.shape, bool)
    columns = np.array(document["steps"], np.int64)

    def reducers() -> None:
        for m in matrices.values():
            stats.reducers(m, weights)

    def findings() -> None:
        results = {
            k: explain.key_findings(k, m, weights, reduced[k], none, ~none, columns, 1)
            for k, m in matrices.items()
        }
        explain.cross_key_findings([f for r in results.values() for f in r.findings], results)

    t_reducers, t_findings, t_summary = [], [], []
    for _ in range(rounds):
        t_reducers.append(timed(reducers))
        t_findings.append(timed(findings))
        t_summary.append(timed(lambda: summarize(run, "p", "r", query)))
    red, found = statistics.median(t_reducers), statistics.median(t_findings)
    print(
        f"\ncost at {ranks} ranks x {len(document['steps'])} columns x {len(keys)} keys "
        f"({len(job.events)} events, {len(document['findings'])} findings), median of {rounds} rounds"
    )
    print(f"  reducers (stats.reducers, 4 keys)   {red * 1e3:8.2f} ms")
    print(f"  findings (4 keys and cross-key)     {found * 1e3:8.2f} ms = {found / red:.1f}x the reducers")
    print(f"  the whole summary, for scale        {statistics.median(t_summary) * 1e3:8.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds and rounds: under a minute")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--fault-model", default="realistic", choices=sorted(MODELS))
    args = parser.parse_args()
    start = time.perf_counter()
    healthy = healthy_cases(args.quick)
    faults = fault_cases(args.quick, args.fault_model)
    print(
        f"findings quality: {len(healthy)} healthy and {len(faults)} faulty jobs, "
        f"{'quick' if args.quick else 'full'} run, {args.jobs} worker(s)"
    )
    outcomes = run_all(healthy + faults, args.jobs)
    report_healthy(outcomes[: len(healthy)])
    report_faults(outcomes[len(healthy) :], args.fault_model)
    report_cost(5 if args.quick else 15)
    print(f"\nelapsed {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
