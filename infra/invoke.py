"""Invoke the template's functions with ``events/*.json`` in this process, no Docker needed.

    python -m infra.invoke IngestFunction events/post_rank_metrics.json \\
                           SummarizeFunction events/get_distributed.json \\
                           RollupFunction events/rollup_stream.json

What ``sam local invoke -e`` does with a container, on an in-memory DynamoDB (moto) whose table is
created from the template. The pairs run in order against one table, so a write can be read back.
The sample events carry the authorizer's verdict for project ``distributed-job`` as API Gateway
would pass it; ``events/authorizer_request.json`` is what the authorizer itself receives, with the
token ``sample-token``, stored for that project here (``--token`` changes it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from infra import wiring
from infra.local import ARN_PREFIX, LambdaContext, load_handler

SAMPLE_PROJECT = "distributed-job"


def invoke_all(pairs: list[tuple[str, Path]], token: str) -> list[dict[str, Any]]:
    import boto3
    from moto import mock_aws

    from shared.store.dynamodb import DynamoTokenStore

    functions = wiring.functions()
    refs = {name: f"instantml-local-{name.removesuffix('Table').lower()}" for name in wiring.tables()}
    os.environ.update(AWS_DEFAULT_REGION=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    # As with `sam local invoke`, the functions' logs and EMF metrics go to stderr and only the
    # responses to stdout.
    with mock_aws(), contextlib.redirect_stdout(sys.stderr):
        for logical_id, name in refs.items():
            boto3.client("dynamodb").create_table(TableName=name, **wiring.table_definition(logical_id))
        for logical_id in wiring.queues():  # a Ref to a queue is its URL
            refs[logical_id] = boto3.client("sqs").create_queue(
                QueueName=f"instantml-local-{logical_id.lower()}"
            )["QueueUrl"]
        DynamoTokenStore(refs["TokensTable"]).create(SAMPLE_PROJECT, "sample events", token=token)
        responses = []
        for function, event_path in pairs:
            if function not in functions:
                raise SystemExit(f"{function} is not a function in template.yaml: {', '.join(functions)}")
            os.environ.update(wiring.environment(function, refs))
            handler = load_handler(functions[function]["Handler"])
            responses.append(
                handler(json.loads(event_path.read_text()), LambdaContext(function, ARN_PREFIX + function))
            )
        return responses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("pairs", nargs="+", metavar="FUNCTION EVENT", help="function logical id, event file")
    parser.add_argument("--token", default="sample-token")
    args = parser.parse_args(argv)
    if len(args.pairs) % 2:
        parser.error("give FUNCTION EVENT pairs")
    pairs = [(args.pairs[i], Path(args.pairs[i + 1])) for i in range(0, len(args.pairs), 2)]
    for response in invoke_all(pairs, args.token):
        print(json.dumps(response, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
