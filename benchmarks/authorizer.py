"""The authorizer's added latency per request, with and without its in-process token cache.

    .venv/bin/python -m benchmarks.authorizer [--requests 2000]

Measured on the real handler against moto in this process (a DynamoDB GetItem through botocore and
moto, so the uncached figure is botocore + moto overhead, not a network round trip; on AWS a GetItem
adds a few milliseconds more). Also prints each function's IAM actions as the template test reads them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import boto3
from moto import mock_aws

from infra import template
from infra.local import ARN_PREFIX, LambdaContext


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    os.environ.update(AWS_DEFAULT_REGION="us-east-1", AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x")
    os.environ["TOKENS_TABLE"] = "bench-tokens"
    with mock_aws():
        boto3.client("dynamodb").create_table(
            TableName="bench-tokens", **template.table_definition("TokensTable")
        )
        from functions.authorizer import app
        from shared.store.dynamodb import DynamoTokenStore as TokenStore
        from shared.tokens import TokenCache

        token, _ = TokenStore("bench-tokens").create("bench", "benchmark")
        event = {"headers": {"authorization": f"Bearer {token}"}}
        context = LambdaContext("AuthorizerFunction", ARN_PREFIX + "AuthorizerFunction")
        app.lambda_handler(event, context)  # warm the imports and the client

        def timed(ttl: float) -> list[float]:
            app._cache[:] = [TokenCache(TokenStore("bench-tokens"), ttl=ttl)]
            samples = []
            for _ in range(args.requests):
                start = time.perf_counter_ns()
                verdict = app.lambda_handler(event, context)
                samples.append((time.perf_counter_ns() - start) / 1000)
                assert verdict["context"]["project"] == "bench"
            return samples

        for _ in range(3):
            uncached, cached = timed(ttl=0.0), timed(ttl=60.0)
        for label, samples in (
            ("no cache (GetItem each request)", uncached),
            ("cache hit (60 s TTL)", cached),
        ):
            q = statistics.quantiles(samples, n=100)
            print(f"authorizer {label:<34} median {statistics.median(samples):8.1f} us   p99 {q[98]:8.1f} us")
        print(f"ratio uncached/cached median: {statistics.median(uncached) / statistics.median(cached):.0f}x")

    from tests.unit.test_template import permissions

    cfn = template.transformed()
    for function in sorted(template.functions()):
        actions = sorted(permissions(cfn, function))
        print(f"{function}: " + ", ".join(f"{a} on {r}" for a, r in actions))


if __name__ == "__main__":
    main()
