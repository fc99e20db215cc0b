"""The server's commands, ``instantml local`` and ``instantml tokens``.

The client's ``instantml`` command never imports the server: it runs this module in a process of its
own with the server's code root first on the path (``instantml._server`` in an installed wheel, the
checkout in a clone), as the Lambda runtime runs a function from its code root. This module imports
only the standard library until a command runs, so ``--help`` works, and says what is missing, before
the server's packages are installed.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

INSTALL = "pip install 'instantml[server]'"


def missing_server_packages() -> list[str]:
    """The ``server`` extra's distributions that are not installed (none when ``instantml`` itself is not
    installed, as when it runs from a checkout on ``PYTHONPATH``: then imports will tell)."""
    try:
        requirements = metadata.requires("instantml") or []
    except metadata.PackageNotFoundError:
        return []
    missing = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        if "extra" not in marker or "server" not in marker:
            continue
        name = spec.strip()
        for stop in "<>=!~[ (":
            name = name.split(stop, 1)[0]
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def _needs(missing: list[str]) -> str:
    state = f"Missing here: {', '.join(missing)}." if missing else "Installed here."
    return f"Needs the server's packages ({INSTALL}): numpy, pydantic, Powertools, boto3. {state}"


def parser(missing: list[str]) -> argparse.ArgumentParser:
    from infra.local import DEFAULT_DATA_DIR, WATCH_INTERVAL_S
    from infra.tokens import add_arguments

    needs = _needs(missing)
    root = argparse.ArgumentParser(prog="instantml", description="InstantML's server commands.")
    commands = root.add_subparsers(dest="command", required=True)
    local = commands.add_parser(
        "local",
        help="run the whole API and the Distributed tab on this machine, data kept in --data-dir",
        description="Serve the API, its authorizer, the runs page and the Distributed tab as template.yaml "
        "deploys them, on an embedded SQLite database in --data-dir that survives restarts and crashes (or "
        f"on a DynamoDB endpoint), bound to --host. {needs}",
    )
    local.add_argument("--host", default="127.0.0.1")
    local.add_argument("--port", type=int, default=8787, help="0 picks a free port")
    local.add_argument(
        "--token", help="the API token to accept (default: the one saved in --data-dir, else a new one)"
    )
    local.add_argument(
        "--data-dir", default=DEFAULT_DATA_DIR, help=f"where the runs are kept (default: {DEFAULT_DATA_DIR})"
    )
    local.add_argument(
        "--dynamodb-endpoint",
        metavar="URL",
        help="use DynamoDB at URL (DynamoDB Local, or AWS) instead of SQLite; tables made when missing",
    )
    local.add_argument(
        "--watch-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how often the watch looks at every live run and sends alerts (default: every "
        f"{WATCH_INTERVAL_S:g} s; the deployed schedule is once a minute)",
    )
    tokens = commands.add_parser(
        "tokens",
        help="operators: create, list and revoke API tokens",
        description=f"Create, list and revoke API tokens in a local stack's data directory or a deployed "
        f"stack's tokens table. {needs}",
    )
    add_arguments(tokens)
    return root


def main(argv: list[str] | None = None) -> int:
    missing = missing_server_packages()
    args = parser(missing).parse_args(argv)
    if missing:
        print(
            f"instantml {args.command}: the server's packages are not installed ({', '.join(missing)} "
            f"missing); install them with: {INSTALL}",
            file=sys.stderr,
        )
        return 2
    if args.command == "local":
        from infra.local import main as serve

        return serve(
            args.host, args.port, args.token, args.data_dir, args.dynamodb_endpoint, args.watch_interval
        )
    from infra.tokens import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
