"""Who stopped the job (contract 8), on real DDP jobs: the seconds from one rank's fault to an alert naming
it, the alerts naming any other rank, the events the survivors logged that are missing, and a healthy job
with a pause on every rank that must stay silent. Beside it, what the anchors need for the same fault.

    .venv/bin/python -m benchmarks.lifecycle [--ranks 8] [--pause-s 120] [--fast-beats] [--quick]

Each job is ``tests/ddp_fault_job.py`` under torchrun (gloo, CPU, the torch venv of ``make test``), its
ranks logging to ``instantml local`` (``infra.local.LocalStack`` at its default watch interval) with a
webhook at ``warning`` (``tests.faults.Receiver``); ``tests.ddp_faults.run_fault`` drives it as a person on
call lives it: the fault's time is when the faulty rank wrote its last logged step, a hung job is ended
with SIGTERM once the alert came, and what the watch says is collected until every spool has drained and
5 s more. Default settings (30 s beats); ``--fast-beats`` adds the same jobs with ``INSTANTML_BEAT_S=1``.
``--quick``: 4 ranks and a 20 s pause.

The anchors are documented behaviour, not run here: the NCCL watchdog aborts a hung collective after
10 minutes by default and every waiting rank prints its own timeout; W&B marks a run "crashed" 5 minutes
after its SDK's heartbeat stops and names no rank; NVRx finds a hang in about 61-96 s in-process (45-60 min
by default in-job) and names ranks only in its logs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ddp_faults import Outcome, hook, run_fault
from tests.faults import Receiver
from tests.torchrun_jobs import TORCHRUN

#: (fault, what the issue asks of it, what the anchors need for it)
FAULTS = [
    (
        "hang",
        "<= 60 s, naming it and where",
        "NCCL watchdog 600 s (names the waiters); NVRx 61-96 s; W&B 300 s",
    ),
    ("kill", "<= 45 s", "torchrun names the first exit; W&B 300 s 'crashed', no rank"),
    ("raise", "<= 30 s, with the exception", "torchrun's root cause line (after the job ends); W&B 300 s"),
]
MODES = ("thread", "spool")


def _alerting(outcome: Outcome) -> list[str]:
    return [a["finding"]["kind"] for _, a in outcome.alerts if a["finding"]["severity"] != "info"]


def _row(label: str, outcome: Outcome, fault_rank: int | None) -> str:
    named = outcome.first_naming(fault_rank) if fault_rank is not None else None
    after = f"{named[0]:6.1f} s" if named else "   none" if fault_rank is not None else "      -"
    kind = named[1]["finding"]["kind"] if named else "-"
    survivors = sum(len(steps) for rank, steps in outcome.missing.items() if rank != fault_rank)
    faulty = len(outcome.missing.get(fault_rank, [])) if fault_rank is not None else 0
    others = len(outcome.blaming_others(fault_rank))
    return (
        f"{label:<36} {after:>9}  {kind:<14} {others:>6}  {len(_alerting(outcome)):>8}  {survivors:>9}"
        f"  {faulty:>6}  {outcome.exit_code!s:>4}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--pause-s", type=float, default=120.0)
    parser.add_argument("--fast-beats", action="store_true", help="also with INSTANTML_BEAT_S=1")
    parser.add_argument("--quick", action="store_true", help="4 ranks, a 20 s pause")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.pause_s = 4, 20.0
    if not TORCHRUN.exists():
        print(f"no {TORCHRUN}: `make test` builds the torch venv", file=sys.stderr)
        return 2
    from infra.local import LocalStack

    beats: list[tuple[str, dict[str, str]]] = [("30 s (default)", {})] + (
        [("1 s", {"INSTANTML_BEAT_S": "1"})] if args.fast_beats else []
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="instantml-lifecycle-") as scratch:
        root = Path(scratch)
        stack = LocalStack(port=0, data_dir=root / "data").start()
        receiver = Receiver()
        try:
            hook(stack, receiver)
            print(
                f"real DDP jobs (torchrun, gloo, {args.ranks} CPU ranks) -> instantml local, watch every "
                f"{stack.watch_interval:g} s, a webhook at warning; the fault on rank 1 at step 20\n"
            )
            header = (
                f"{'job':<36} {'to alert':>9}  {'kind':<14} {'others':>6}  {'alerting':>8}  {'survivors':>9}"
                f"  {'faulty':>6}  exit"
            )
            print(header)
            print("-" * len(header))
            worst: dict[str, float] = {}
            failures = 0
            for beat, env in beats:
                for fault, _, _ in FAULTS:
                    for mode in MODES:
                        run_id = f"{fault}-{mode}-{len(env)}"
                        outcome = run_fault(
                            stack,
                            receiver,
                            root / run_id,
                            run_id,
                            fault,
                            ranks=args.ranks,
                            mode=mode,
                            env=env,
                        )
                        print(_row(f"{fault} / {mode} / beat {beat}", outcome, 1), flush=True)
                        named = outcome.first_naming(1)
                        if beat.endswith("(default)"):
                            worst[fault] = max(worst.get(fault, 0.0), named[0] if named else float("inf"))
                        bad = outcome.blaming_others(1) or len(_alerting(outcome)) != 1
                        lost = any(steps for rank, steps in outcome.missing.items() if rank != 1)
                        failures += bool(bad or named is None or lost)
            pause = {"STEPS": "40", "PAUSE_S": f"{args.pause_s:g}"}
            for mode in MODES:
                run_id = f"pause-{mode}"
                outcome = run_fault(
                    stack,
                    receiver,
                    root / run_id,
                    run_id,
                    "pause",
                    ranks=args.ranks,
                    mode=mode,
                    env=pause,
                    wait_s=args.pause_s + 120,
                )
                print(_row(f"healthy, {args.pause_s:g} s pause / {mode}", outcome, None), flush=True)
                for _, alert in outcome.alerts:  # what a false alarm said, to be read
                    if alert["finding"]["severity"] != "info":
                        print(f"    {alert['finding']['kind']}: {alert['finding']['message']}", flush=True)
                failures += bool(_alerting(outcome) or any(outcome.missing.values()) or outcome.exit_code)
        finally:
            receiver.down()
            stack.stop()
    print(
        "\nto alert: seconds from the faulty rank's last logged step to the first alert naming it; others:"
        "\nalerts at warning or above naming another rank; alerting: all alerts at warning or above (one"
        "\nfailure is one alert); survivors: events the other ranks logged that are not stored; faulty:"
        "\nthe faulty rank's (a SIGKILL ends a process before its thread can send the last ones: the spool"
        "\nmode keeps them on disk); exit: torchrun's.\n"
    )
    print(f"{'fault':<6} {'worst, default settings':>24}  {'goal':<30} anchors")
    for fault, goal, anchors in FAULTS:
        print(f"{fault:<6} {worst.get(fault, float('nan')):>22.1f} s  {goal:<30} {anchors}")
    print(f"\n{failures} job(s) off their mark; {time.monotonic() - started:.0f} s in all")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
