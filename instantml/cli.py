"""The ``instantml`` command."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

#: The server's commands, with their one-line help. They run in a process of their own (``infra/cli.py``).
SERVER_COMMANDS = {
    "local": "run the whole API, the runs page and the Distributed tab on this machine (instantml[server])",
    "tokens": "operators: create, list and revoke API tokens (instantml[server])",
}

# Starts the server's command line with its code root first on the path, then as ``python -m`` would.
_BOOT = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module('infra.cli', run_name='__main__')"
)


def server_root() -> Path:
    """The server's code root (``functions``, ``shared``, ``infra``): the copy a wheel carries inside this
    package, else the checkout this package is installed from."""
    package = Path(__file__).resolve().parent
    for root in (package / "_server", package.parent):
        if (root / "infra" / "wiring.json").is_file():
            return root
    sys.exit(f"instantml: this installation has no server code (looked in {package / '_server'})")


def run_server(argv: list[str]) -> NoReturn:
    """Replace this process with the server's command line (same pid, same signals). The client never
    imports the server, and the server's generic top-level names (``shared``, ``functions``, ``infra``)
    are on the path of that process alone, as on Lambda, where they cannot shadow a user's modules."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-c", _BOOT, str(server_root()), *argv])  # noqa: S606


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVER_COMMANDS:
        run_server(argv)
    parser = argparse.ArgumentParser(prog="instantml", description="InstantML distributed metrics.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, summary in SERVER_COMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)
    sync = commands.add_parser(
        "sync",
        help="upload what a spool holds, with progress; exit 0 only when every event is stored",
        description="Replay a spool directory through the batch route. Exit codes: 0 every event is "
        "stored; 1 some events were rejected (see SPOOL_DIR/rejects.jsonl); 3 some events are still in "
        "the spool (server unreachable or refusing the token, or --timeout passed); 4 some requests were "
        "set aside (the server kept failing on them while it stored others: see SPOOL_DIR/set-aside.jsonl, "
        "resend them with --resend-set-aside); 130 interrupted "
        "(Ctrl-C): what was not sent stays in the spool for the next sync.",
    )
    sync.add_argument(
        "spool_dir",
        nargs="?",
        metavar="SPOOL_DIR",
        help="default: INSTANTML_SPOOL_DIR, else .instantml/spool",
    )
    sync.add_argument("--api-url", help="default: INSTANTML_API_URL, else the URL the spool was made for")
    sync.add_argument("--api-key", help="default: INSTANTML_API_KEY")
    sync.add_argument("--timeout", type=float, default=600.0, help="give up after this long failing (s)")
    sync.add_argument(
        "--quiet", action="store_true", help="no progress bar (failed attempts and the outcome still print)"
    )
    sync.add_argument(
        "--resend-set-aside",
        action="store_true",
        help="put the requests of SPOOL_DIR/set-aside.jsonl back into the spool first, to send them again",
    )
    from instantml.commands import watching

    check = commands.add_parser(
        "check",
        help="print a run's findings; exit 1 when one reaches --fail-on (a gate for CI and job scripts)",
        description="Print a run's findings (the server's watch keeps them, wall-clock ones included). Exit "
        "codes: 0 nothing at or above --fail-on; 1 something is; 2 a usage or connection error.",
    )
    check.add_argument("--project", required=True)
    check.add_argument("run_id", metavar="RUN")
    check.add_argument("--fail-on", default="warning", choices=watching.SEVERITIES, help="default: warning")
    watching.add_connection_arguments(check)
    alerts = commands.add_parser(
        "alerts",
        help="set, list or clear a project's alert webhooks (Slack, Mattermost, any JSON receiver)",
        description="Where the server's watch sends alerts: one POST of JSON per alert to each webhook "
        "whose --min-severity the finding reaches. --webhook replaces the project's webhooks (repeat it "
        "for several).",
    )
    alerts.add_argument("--project", required=True)
    alerts.add_argument("--webhook", action="append", metavar="URL", help="an http(s) URL (repeatable)")
    alerts.add_argument(
        "--min-severity", default="warning", choices=watching.SEVERITIES, help="default: warning"
    )
    alerts.add_argument("--list", action="store_true", help="show the project's webhooks")
    alerts.add_argument("--clear", action="store_true", help="remove them")
    watching.add_connection_arguments(alerts)
    from instantml.commands import export

    export.add_parsers(commands, watching.add_connection_arguments)
    args = parser.parse_args(argv)
    if args.command in ("check", "alerts"):
        return watching.command(args)
    if args.command in ("export", "runs"):
        return export.command(args)
    if args.command == "sync":
        from instantml.commands import sync as sync_command

        return sync_command.command(
            args.spool_dir, args.api_url, args.api_key, args.timeout, args.quiet, args.resend_set_aside
        )
    return 2


if __name__ == "__main__":
    sys.exit(main())
