"""The ``instantml`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _has_checkout() -> bool:
    return (Path(__file__).resolve().parent.parent / "template.yaml").is_file()


def _checkout() -> Path:
    """The project checkout this client is installed from (editable install): it holds the server."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "template.yaml").is_file():
        sys.exit(
            "instantml local and tokens run the server code of a checkout of the project; install the client "
            "from the checkout with: pip install -e '.[server]'"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="instantml", description="InstantML distributed metrics.")
    commands = parser.add_subparsers(dest="command", required=True)
    local = commands.add_parser(
        "local",
        help="run the whole API and the Distributed tab on this machine, data kept in --data-dir",
        description="Serve the API, its authorizer and the Distributed tab as template.yaml deploys them, "
        "on an embedded SQLite database in --data-dir that survives restarts and crashes (or on a "
        "DynamoDB endpoint). Needs the server code: a checkout of the project, or instantml[server].",
    )
    local.add_argument("--host", default="127.0.0.1")
    local.add_argument("--port", type=int, default=8787, help="0 picks a free port")
    local.add_argument(
        "--token", help="the API token to accept (default: the one saved in --data-dir, else a new one)"
    )
    local.add_argument(
        "--data-dir", default=".instantml/local", help="where the runs are kept (default: .instantml/local)"
    )
    local.add_argument(
        "--dynamodb-endpoint",
        metavar="URL",
        help="use DynamoDB at URL (DynamoDB Local, or AWS) instead of SQLite; tables made when missing",
    )
    sync = commands.add_parser(
        "sync",
        help="upload what a spool holds, with progress; exit 0 only when every event is stored",
        description="Replay a spool directory through the batch route. Exit codes: 0 every event is "
        "stored; 1 some events were rejected (see SPOOL_DIR/rejects.jsonl); 3 some events are still in "
        "the spool (server unreachable or refusing the token, or --timeout passed); 130 interrupted "
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
    tokens = commands.add_parser("tokens", help="operators: create, list and revoke API tokens")
    if _has_checkout():
        _checkout()
        from infra.tokens import add_arguments

        add_arguments(tokens)
    args = parser.parse_args(argv)
    if args.command == "sync":
        from instantml import sync as sync_command

        return sync_command.command(args.spool_dir, args.api_url, args.api_key, args.timeout, args.quiet)
    if args.command == "local":
        _checkout()
        from infra.local import main as serve

        return serve(args.host, args.port, args.token, args.data_dir, args.dynamodb_endpoint)
    if args.command == "tokens":
        _checkout()
        from infra.tokens import run

        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
