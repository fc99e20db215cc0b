"""The process rows (contract 8), pure: who went first and how, on documents as the store keeps them."""

from __future__ import annotations

import json
from typing import Any

from shared.findings import Finding
from shared.findings.processes import explained, process_findings
from shared.processes.records import fold, processes_json, strip_counts

NOW = 10_000.0
WAIT = [
    "train.py:88 train_step",
    "/venv/lib/python3.12/site-packages/torch/autograd/__init__.py:266 backward",
]
LOAD = ["train.py:80 train_step", "train.py:41 load_batch", "/usr/lib/python3.12/queue.py:180 get"]


def started(
    rank: int, at: float = 1_000.0, world: int = 8, attempt: int = 0, pid: int | None = None
) -> dict[str, Any]:
    return {
        "state": "started",
        "rank": rank,
        "world_size": world,
        "pid": pid or 100 + rank,
        "attempt": attempt,
        "host": f"node-{rank // 4}",
        "first_step": 0,
    }


def docs(*notes: tuple[dict[str, Any], float]) -> list[dict[str, Any]]:
    kept: dict[int, str] = {}
    for note, at in notes:
        base: dict[str, Any] = {k: note[k] for k in ("rank", "world_size", "pid", "attempt") if k in note}
        folded = fold(kept.get(note["rank"]), {**base, **note}, at)
        if folded is not None:
            kept[note["rank"]] = folded
    return [json.loads(kept[r]) for r in sorted(kept)]


def ended(rank: int, how: str, **detail: Any) -> dict[str, Any]:
    return {**started(rank), "state": "ended", "how": how, "step": 120, **detail}


def beat(rank: int, stack: list[str], silent: float = 40.0) -> dict[str, Any]:
    return {**started(rank), "state": "beat", "step": 120, "silent_s": silent, "every": 30.0, "stack": stack}


def alerting(rows: list[Finding]) -> list[Finding]:
    return [r for r in rows if r["severity"] != "info"]


def fresh(n: int = 8, at: float = NOW - 2) -> dict[int, float]:
    return dict.fromkeys(range(n), at)


def test_a_record_is_folded_once_and_a_restart_keeps_the_one_before() -> None:
    kept = fold(None, started(3), 1.0)
    assert kept is not None
    assert fold(kept, started(3), 2.0) is None  # a replay changes nothing
    kept = fold(kept, ended(3, "signal", signal="SIGTERM"), 5.0)
    assert kept is not None and fold(kept, ended(3, "finished"), 6.0) is None  # the first end counts
    again = fold(kept, {**started(3, attempt=1, pid=999), "first_step": 100}, 9.0)
    assert again is not None
    doc = json.loads(again)
    assert doc["pid"] == 999 and doc.get("ended") is None and doc["prior"][0]["how"] == "signal"
    assert fold(again, beat(3, WAIT), 10.0) is None  # a late beat of the process before is not this one's


def test_one_rank_raising_is_one_alert_naming_it_and_counting_the_rest() -> None:
    notes = [(started(r), 1_000.0) for r in range(8)]
    notes.append(
        (
            ended(
                5,
                "exception",
                exception={
                    "type": "RuntimeError",
                    "message": "CUDA out of memory",
                    "where": "train.py:42 forward",
                },
            ),
            NOW - 30,
        )
    )
    notes += [(ended(r, "signal", signal="SIGTERM"), NOW - 28 + r * 0.1) for r in range(8) if r != 5]
    rows = process_findings(docs(*notes), fresh(8, NOW - 31), 0.5, NOW)
    (row,) = alerting(rows)
    assert (row["kind"], row["rank"], row["severity"]) == ("rank_exited", 5, "critical")
    assert "raised RuntimeError: CUDA out of memory at train.py:42 forward" in row["message"]
    assert "7 other ranks ended after it" in row["message"] and "7 by SIGTERM" in row["message"]


def test_a_killed_rank_is_named_not_the_ranks_whose_collective_failed_after_it() -> None:
    notes = [(started(r), 1_000.0) for r in range(8)]
    broken = {
        "type": "RuntimeError",
        "message": "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
    }
    notes += [(ended(r, "exception", exception=broken), NOW - 39 + r * 0.01) for r in range(8) if r != 3]
    last = {**fresh(8, NOW - 39.5), 3: NOW - 40.0}  # its last events came just before the others' ends
    rows = process_findings(docs(*notes), last, 0.5, NOW)
    (row,) = alerting(rows)
    assert (row["kind"], row["rank"]) == ("rank_vanished", 3)
    assert "7 other ranks ended after it" in row["message"]
    # Judged only once the teardown's own records had time to land.
    assert process_findings(docs(*notes), last, 0.5, NOW - 39 + 5) == []


def test_a_writer_its_uploader_saw_go_is_named_at_once_before_the_launchers_sigterms() -> None:
    """Spool mode: the uploader's ``vanished`` record (dated at its last write) names the killed rank as
    soon as it lands, with no wait for silence, and the SIGTERMs that followed are its consequences."""
    notes = [(started(r), 1_000.0) for r in range(8)]
    notes.append((ended(3, "vanished"), NOW - 3.0))
    notes += [(ended(r, "signal", signal="SIGTERM"), NOW - 2.9 + r * 0.01) for r in range(8) if r != 3]
    (row,) = alerting(process_findings(docs(*notes), fresh(8, NOW - 3.0), 0.5, NOW))
    assert (row["kind"], row["rank"], row["severity"]) == ("rank_vanished", 3, "critical")
    assert "its uploader saw it go" in row["message"]
    assert "7 other ranks ended after it" in row["message"] and "7 by SIGTERM" in row["message"]
    # Alone, while the others still log: named too (the uploader's word needs no silence to confirm it).
    alone = [(started(r), 1_000.0) for r in range(8)] + [(ended(3, "vanished"), NOW - 1.0)]
    (row,) = alerting(process_findings(docs(*alone), fresh(), 0.5, NOW))
    assert (row["kind"], row["rank"]) == ("rank_vanished", 3)


def test_every_rank_ended_by_one_signal_is_a_stop_from_outside_not_a_rank_fault() -> None:
    notes = [(started(r), 1_000.0) for r in range(8)]
    notes += [(ended(r, "signal", signal="SIGTERM"), NOW - 60 + r * 0.05) for r in range(8)]
    (row,) = process_findings(docs(*notes), fresh(8, NOW - 61), 0.5, NOW)
    assert (row["kind"], row["rank"], row["severity"]) == ("rank_exited", None, "warning")
    assert "stopped from outside" in row["message"]


def test_healthy_runs_raise_nothing() -> None:
    live = docs(*[(started(r), 1_000.0) for r in range(8)])
    assert process_findings(live, fresh(), 0.5, NOW) == []
    done = docs(
        *[(started(r), 1_000.0) for r in range(8)], *[(ended(r, "finished"), NOW - 5) for r in range(8)]
    )
    assert process_findings(done, fresh(8, NOW - 6), 0.5, NOW) == []
    exits = docs(
        *[(started(r), 1_000.0) for r in range(8)], *[(ended(r, "exit", code=0), NOW - 5) for r in range(8)]
    )
    assert process_findings(exits, fresh(8, NOW - 6), 0.5, NOW) == []


def test_a_rank_that_stops_while_its_peers_log_has_vanished() -> None:
    rows = process_findings(
        docs(*[(started(r), 1_000.0) for r in range(8)]), {**fresh(), 6: NOW - 200}, 0.5, NOW
    )
    (row,) = rows
    assert (row["kind"], row["rank"]) == ("rank_vanished", 6)
    # A slow job (a step a minute) is given its own pace before that.
    assert (
        process_findings(docs(*[(started(r), 1_000.0) for r in range(8)]), {**fresh(), 6: NOW - 200}, 60, NOW)
        == []
    )


def test_a_hang_names_the_rank_that_is_somewhere_else_and_where() -> None:
    notes = [(started(r), 1_000.0) for r in range(8)]
    notes += [(beat(r, LOAD if r == 4 else WAIT), NOW - 5) for r in range(8)]
    rows = process_findings(docs(*notes), fresh(8, NOW - 45), 0.5, NOW)
    (row,) = rows
    assert (row["kind"], row["rank"], row["severity"]) == ("rank_stuck", 4, "warning")
    assert (
        "train.py:41 load_batch" in row["message"]
        and "the other 7 wait at train.py:88 train_step" in row["message"]
    )
    same = docs(*[(started(r), 1_000.0) for r in range(8)], *[(beat(r, WAIT), NOW - 5) for r in range(8)])
    (row,) = process_findings(same, fresh(8, NOW - 45), 0.5, NOW)
    assert row["rank"] is None and "every rank (8)" in row["message"]
    # A place every rank shares is an evaluation as often as a hang: said, never alerted (``stalled``
    # judges the silence of the whole job by its own earlier pauses).
    assert alerting(process_findings(same, fresh(8, NOW - 45), 0.5, NOW)) == []
    assert [f["kind"] for f in explained([row, stalled()])] == ["rank_stuck", "stalled"]
    # A beat older than its events says nothing: the process went on.
    assert process_findings(same, fresh(8, NOW - 1), 0.5, NOW) == []


def test_the_first_rank_to_beat_in_a_shared_pause_is_not_named_before_the_others_say_where() -> None:
    """Every rank pauses at once; one rank's beat arrives a watch round before the others'."""
    first = docs(*[(started(r), 1_000.0) for r in range(8)], (beat(0, WAIT, silent=31.0), NOW - 1))
    assert process_findings(first, fresh(8, NOW - 32), 0.5, NOW) == []


def test_the_last_rank_back_from_a_shared_pause_is_not_stuck() -> None:
    """Every rank paused and beat; the others' first events after it have arrived, rank 3's not yet."""
    notes = [(started(r), 1_000.0) for r in range(8)]
    notes += [(beat(r, WAIT, silent=38.0), NOW - 3) for r in range(8)]
    rows = process_findings(docs(*notes), {**fresh(8, NOW - 0.5), 3: NOW - 41}, 0.5, NOW)
    assert alerting(rows) == []


def test_a_silent_rank_is_stuck_on_its_own_while_the_others_log() -> None:
    notes = [(started(r), 1_000.0) for r in range(8)] + [(beat(3, LOAD), NOW - 5)]
    (row,) = process_findings(docs(*notes), {**fresh(8, NOW - 0.5), 3: NOW - 45}, 0.5, NOW)
    assert (row["kind"], row["rank"], row["severity"]) == ("rank_stuck", 3, "warning")
    assert "train.py:41 load_batch" in row["message"]


def stalled() -> Finding:
    return {"kind": "stalled", "rank": None, "key": None, "step": 120, "severity": "warning", "message": ""}


def test_a_restart_and_a_smaller_world_are_said() -> None:
    notes = [(started(r), 1_000.0) for r in range(8)]
    notes += [(ended(r, "signal", signal="SIGTERM"), 2_000.0) for r in range(8)]
    notes += [({**started(r, world=6, attempt=1, pid=500 + r), "first_step": 100}, 3_000.0) for r in range(6)]
    rows = process_findings(docs(*notes), fresh(6), 0.5, NOW)
    assert sorted(r["kind"] for r in rows) == ["restarted", "world_size_changed"]
    changed = next(r for r in rows if r["kind"] == "world_size_changed")
    assert "from 8 to 6 ranks at step 100" in changed["message"]
    restarted = next(r for r in rows if r["kind"] == "restarted")
    assert "steps 100-120 were logged again" in restarted["message"]


def test_a_culprit_explains_the_rows_about_silence() -> None:
    culprit = {
        "kind": "rank_vanished",
        "rank": 3,
        "key": None,
        "step": 1,
        "severity": "critical",
        "message": "",
    }
    silence = [
        {
            "kind": "stopped_reporting",
            "rank": 1,
            "key": None,
            "step": 1,
            "severity": "critical",
            "message": "",
        },
        {"kind": "stalled", "rank": None, "key": None, "step": 1, "severity": "warning", "message": ""},
        {
            "kind": "node_outlier",
            "rank": 0,
            "key": None,
            "step": 1,
            "severity": "critical",
            "message": "",
            "of": "stopped_reporting",
        },
    ]
    spike = {"kind": "spike", "rank": 2, "key": "loss", "step": 1, "severity": "warning", "message": ""}
    assert explained([culprit, *silence, spike]) == [culprit, spike]  # type: ignore[list-item]
    assert explained([*silence, spike]) == [*silence, spike]  # type: ignore[list-item]


def test_the_api_shows_each_process_state() -> None:
    texts = {
        0: fold(None, started(0), 1.0),
        1: fold(fold(None, started(1), 1.0), beat(1, WAIT), NOW - 5),
        2: fold(fold(None, started(2), 1.0), ended(2, "exit", code=3), NOW - 5),
    }
    rows = processes_json({k: v for k, v in texts.items() if v}, NOW)
    assert [r["state"] for r in rows] == ["running", "silent", "ended"]
    assert rows[1]["stack"] == WAIT and "stack" not in rows[0] and rows[2]["code"] == 3


def test_a_lost_node_s_ranks_read_vanished_once_the_job_went_on_without_them() -> None:
    """An elastic restart that lost a node (world 4 -> 2): ranks 2 and 3 never ended and never came
    back. They read ``vanished`` (not ``running`` for ever), the check says so, and no alert names them
    or the survivors once the job runs again."""
    from instantml.commands.watching import process_lines

    notes = [(started(r, world=4), 1_000.0) for r in range(4)]
    notes += [
        (
            ended(r, "exception", exception={"type": "RuntimeError", "message": "Connection closed by peer"}),
            2_000.0,
        )
        for r in (0, 1)
    ]
    notes += [({**started(r, world=2, attempt=1, pid=500 + r), "first_step": 10}, 2_010.0) for r in (0, 1)]
    folded = docs(*notes)
    rows = process_findings(folded, fresh(2), 0.1, NOW)
    assert sorted(r["kind"] for r in rows) == ["restarted", "world_size_changed"], rows
    texts = {d["rank"]: json.dumps(d) for d in folded}
    shown = processes_json(texts, NOW)
    assert [(r["rank"], r["state"]) for r in shown] == [
        (0, "running"),
        (1, "running"),
        (2, "vanished"),
        (3, "vanished"),
    ]
    assert "  ranks 2-3: vanished (attempt 0; the job went on without it)" in process_lines(
        {"processes": shown}
    )
    assert strip_counts(shown, rows) == {"running": 2, "vanished": 2}  # the runs page's bar


def test_the_runs_page_counts_each_process_as_the_tab_colours_it() -> None:
    texts = {
        0: fold(None, started(0), 1.0),
        1: fold(fold(None, started(1), 1.0), beat(1, WAIT), NOW - 5),
        2: fold(fold(None, started(2), 1.0), ended(2, "exit", code=3), NOW - 5),
        3: fold(fold(None, started(3), 1.0), ended(3, "exit"), NOW - 5),
        4: fold(fold(None, started(4), 1.0), ended(4, "signal", signal="SIGTERM"), NOW - 5),
        5: fold(fold(None, started(5), 1.0), beat(5, LOAD), NOW - 5),
        6: fold(None, started(6), 1.0),
    }
    rows = processes_json({k: v for k, v in texts.items() if v}, NOW)
    named = [
        {"kind": "rank_stuck", "rank": 5},
        {"kind": "rank_vanished", "rank": 6},
        {"kind": "spike", "rank": 0},
    ]
    assert strip_counts(rows, named) == {
        "running": 1,
        "silent": 1,
        "stuck": 1,
        "finished": 1,
        "failed": 1,
        "signal": 1,
        "vanished": 1,
    }
