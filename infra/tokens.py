"""Operators' token commands: create, list and revoke API tokens in a deployed or local tokens table.

    instantml tokens create --project distributed-job --stack-name instantml
    instantml tokens list   --stack-name instantml
    instantml tokens revoke TOKEN_ID --stack-name instantml

They write the tokens table directly with the operator's AWS credentials (the API has no route that
makes tokens). ``--stack-name`` finds the table from the stack's ``TokensTableName`` output;
``--table`` names it directly; ``--endpoint-url`` reaches a local stack's DynamoDB (printed by
``instantml local``).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from instantml import limits
from shared.tokens import TokenStore


def table_from_stack(stack_name: str, region: str | None) -> str:
    import boto3

    stacks = boto3.client("cloudformation", region_name=region).describe_stacks(StackName=stack_name)[
        "Stacks"
    ]
    for output in stacks[0].get("Outputs", []):
        if output["OutputKey"] == "TokensTableName":
            return str(output["OutputValue"])
    raise SystemExit(f"stack {stack_name!r} has no TokensTableName output; is it an InstantML stack?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--stack-name", help="the deployed stack (reads its TokensTableName output)")
    where.add_argument("--table", help="the tokens table's name")
    where.add_argument("--data-dir", help="a local stack's data directory (`instantml local --data-dir`)")
    parser.add_argument("--region")
    parser.add_argument("--endpoint-url", help="a DynamoDB endpoint, e.g. the local stack's")
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="make a token for one project; it is shown once")
    create.add_argument("--project", required=True)
    create.add_argument("--description", default="")
    listing = actions.add_parser("list", help="list tokens (ids and projects, never the tokens)")
    listing.add_argument("--project")
    revoke = actions.add_parser(
        "revoke", help="revoke a token by its id (at once on a local stack; within 60 s on AWS)"
    )
    revoke.add_argument("token_id")


def open_tokens(args: argparse.Namespace) -> TokenStore:
    if args.data_dir:
        from infra.local import database_path
        from shared.store.sqlite import SqliteTokenStore

        path = database_path(args.data_dir)
        if args.action != "create" and not path.is_file():
            raise SystemExit(
                f"instantml tokens: no local stack data in {args.data_dir} ({path} does not exist); pass the "
                "--data-dir that `instantml local` uses"
            )
        return SqliteTokenStore(path)
    import boto3

    from shared.store.dynamodb import DynamoTokenStore

    table = args.table or table_from_stack(args.stack_name, args.region)
    region, key = args.region, None
    if args.endpoint_url:  # DynamoDB Local: any region and credentials do
        region, key = args.region or "us-east-1", "local"
    client: Any = boto3.client(
        "dynamodb",
        region_name=region,
        endpoint_url=args.endpoint_url,
        aws_access_key_id=key,
        aws_secret_access_key=key,
    )
    return DynamoTokenStore(table, client)


def run(args: argparse.Namespace) -> int:
    store = open_tokens(args)
    if args.action == "create":
        try:
            limits.check_name("project", args.project)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        token, record = store.create(args.project, args.description)
        print(f"token id {record.token_id} for project {record.project}. The token (shown only now):")
        print(token)
        return 0
    if args.action == "list":
        for record in store.list(args.project):
            created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(record.created))
            state = "revoked" if record.revoked else "active"
            print(f"{record.token_id}  {record.project:<30} {state:<8} {created}  {record.description}")
        return 0
    if store.revoke(args.token_id):
        when = "from its next request" if args.data_dir else "within 60 s (the authorizer's cache)"
        print(f"revoked {args.token_id}; the API refuses it {when}")
        return 0
    print(f"no token with id {args.token_id}", file=sys.stderr)
    return 1
