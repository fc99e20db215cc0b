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
        "local", help="run the whole API and the Distributed tab on this machine (embedded DynamoDB)"
    )
    local.add_argument("--host", default="127.0.0.1")
    local.add_argument("--port", type=int, default=8787)
    local.add_argument("--token", help="the API token to accept (default: a new one, printed)")
    tokens = commands.add_parser("tokens", help="operators: create, list and revoke API tokens")
    if _has_checkout():
        _checkout()
        from infra.tokens import add_arguments

        add_arguments(tokens)
    args = parser.parse_args(argv)
    if args.command == "local":
        _checkout()
        from infra.local import main as serve

        return serve(args.host, args.port, args.token)
    if args.command == "tokens":
        _checkout()
        from infra.tokens import run

        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
