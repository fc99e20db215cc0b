"""The template as CloudFormation (through the SAM transform): least privilege and deploy settings."""

from __future__ import annotations

from typing import Any

import pytest

from infra import template

#: What each function may do, and on which resource: the whole of it.
EXPECTED_ACTIONS = {
    "AuthorizerFunction": {
        ("dynamodb:GetItem", "TokensTable"),
        ("logs:CreateLogStream", "AuthorizerLogGroup"),
        ("logs:PutLogEvents", "AuthorizerLogGroup"),
    },
    "IngestFunction": {
        ("dynamodb:PutItem", "MetricsTable"),
        ("dynamodb:UpdateItem", "RunsTable"),
        ("dynamodb:Query", "RunsTable"),  # a run update answers the record: its items, one query
        ("dynamodb:GetItem", "RunsTable"),  # a process record reads its rank's document first
        ("events:PutEvents", "WatchNudgeBus"),  # a process's failed end nudges the watch
        ("logs:CreateLogStream", "IngestLogGroup"),
        ("logs:PutLogEvents", "IngestLogGroup"),
    },
    "SummarizeFunction": {
        ("dynamodb:Query", "MetricsTable"),
        ("dynamodb:Query", "RunsTable"),  # the run's record and its processes: one query each
        ("dynamodb:UpdateItem", "RunsTable"),  # only the findings attributes: see below
        ("logs:CreateLogStream", "SummarizeLogGroup"),
        ("logs:PutLogEvents", "SummarizeLogGroup"),
    },
    "RunsFunction": {
        ("dynamodb:GetItem", "RunsTable"),
        ("dynamodb:BatchGetItem", "RunsTable"),
        ("dynamodb:Query", "RunsTable"),
        ("dynamodb:GetItem", "RunsTable/index/*"),
        ("dynamodb:BatchGetItem", "RunsTable/index/*"),
        ("dynamodb:Query", "RunsTable/index/*"),
        ("dynamodb:Query", "MetricsTable"),  # only "@scalars#..." partitions: see below
        ("logs:CreateLogStream", "RunsLogGroup"),
        ("logs:PutLogEvents", "RunsLogGroup"),
    },
    "RollupFunction": {
        ("dynamodb:Query", "MetricsTable"),
        ("dynamodb:GetItem", "MetricsTable"),  # only "@rollup#..." partitions: see below
        ("dynamodb:PutItem", "MetricsTable"),  # only "@rollup#..." partitions
        ("dynamodb:DescribeStream", "MetricsTable.StreamArn"),
        ("dynamodb:GetRecords", "MetricsTable.StreamArn"),
        ("dynamodb:GetShardIterator", "MetricsTable.StreamArn"),
        ("dynamodb:ListStreams", "MetricsTable.StreamArn"),
        ("sqs:SendMessage", "RollupFailuresQueue"),  # the stream batches it gives up on
        ("logs:CreateLogStream", "RollupLogGroup"),
        ("logs:PutLogEvents", "RollupLogGroup"),
    },
    "AlertsFunction": {
        ("dynamodb:GetItem", "AlertsTable"),
        ("dynamodb:UpdateItem", "AlertsTable"),  # the webhooks replaced, their deliveries' notes kept
        ("dynamodb:DeleteItem", "AlertsTable"),
        ("logs:CreateLogStream", "AlertsLogGroup"),
        ("logs:PutLogEvents", "AlertsLogGroup"),
    },
    "WatchFunction": {
        ("dynamodb:Query", "MetricsTable"),
        ("dynamodb:Query", "RunsTable"),  # each watched run's rank groups
        ("dynamodb:Query", "RunsTable/index/by_received"),
        ("dynamodb:UpdateItem", "RunsTable"),  # only the watch's attributes: see below
        ("dynamodb:GetItem", "AlertsTable"),
        ("sqs:SendMessage", "AlertsQueue"),
        ("logs:CreateLogStream", "WatchLogGroup"),
        ("logs:PutLogEvents", "WatchLogGroup"),
    },
    "DeliverFunction": {
        ("sqs:ReceiveMessage", "AlertsQueue"),
        ("sqs:DeleteMessage", "AlertsQueue"),
        ("sqs:GetQueueAttributes", "AlertsQueue"),
        ("sqs:ChangeMessageVisibility", "AlertsQueue"),
        ("dynamodb:UpdateItem", "AlertsTable"),  # how each webhook's last POST went
        ("logs:CreateLogStream", "DeliverLogGroup"),
        ("logs:PutLogEvents", "DeliverLogGroup"),
    },
}


@pytest.fixture(scope="module")
def cfn() -> dict[str, Any]:
    return template.transformed()


def _listify(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def permissions(cfn: dict[str, Any], function: str) -> set[tuple[str, str]]:
    """(action, resource logical id) for every statement of a function's role."""
    role = cfn["Resources"][function]["Properties"]["Role"]["Fn::GetAtt"][0]
    props = cfn["Resources"][role]["Properties"]
    assert not props.get("ManagedPolicyArns"), (
        f"{role} has managed policies (their statements are not readable here)"
    )
    found = set()
    for policy in props["Policies"]:
        for statement in policy["PolicyDocument"]["Statement"]:
            assert statement["Effect"] == "Allow"
            for action in _listify(statement["Action"]):
                for resource in _listify(statement["Resource"]):
                    assert action != "*", (function, action)
                    assert not action.endswith(":*"), (function, action)
                    assert resource != "*", (function, resource)
                    if "Fn::Sub" in resource:  # "${Table.Arn}/index/NAME" (or *): the table's indexes
                        sub = resource["Fn::Sub"]
                        table, _, index = sub.partition(".Arn}/index/")
                        assert table.startswith("${"), (function, sub)
                        assert index, (function, sub)
                        assert "$" not in index, (function, sub)
                        found.add((action, f"{table[2:]}/index/{index}"))
                        continue
                    logical_id, attribute = resource["Fn::GetAtt"]
                    found.add((action, logical_id if attribute == "Arn" else f"{logical_id}.{attribute}"))
    return found


@pytest.mark.slow
def test_every_function_may_do_exactly_what_it_needs(cfn: dict[str, Any]) -> None:
    functions = {n for n, r in cfn["Resources"].items() if r["Type"] == "AWS::Lambda::Function"}
    assert functions == set(EXPECTED_ACTIONS)
    for function, expected in EXPECTED_ACTIONS.items():
        assert permissions(cfn, function) == expected, function


def test_no_iam_statement_anywhere_has_a_wildcard(cfn: dict[str, Any]) -> None:
    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "Action" in node and "Effect" in node:
                actions = _listify(node["Action"])
                assert "*" not in actions, node
                assert all(not str(a).endswith(":*") for a in actions), node
                if "Resource" in node:
                    assert "*" not in _listify(node["Resource"]), node
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(cfn["Resources"])


def test_the_stage_throttles_logs_without_tokens_and_allows_no_other_origin(cfn: dict[str, Any]) -> None:
    stage = next(r for r in cfn["Resources"].values() if r["Type"] == "AWS::ApiGatewayV2::Stage")[
        "Properties"
    ]
    assert {"ThrottlingRateLimit", "ThrottlingBurstLimit"} <= set(stage["DefaultRouteSettings"])
    log_format = stage["AccessLogSettings"]["Format"]
    assert "authorization" not in log_format.lower()
    assert "querystring" not in log_format.lower()
    api = cfn["Resources"]["HttpApi"]["Properties"]
    assert "CorsConfiguration" not in api
    assert "x-amazon-apigateway-cors" not in api["Body"]


def test_the_authorizer_is_invoked_by_api_gateway_only_and_guards_every_data_route(
    cfn: dict[str, Any],
) -> None:
    permission = cfn["Resources"]["AuthorizerInvokePermission"]["Properties"]
    assert permission["Principal"] == "apigateway.amazonaws.com"
    assert "/authorizers/" in permission["SourceArn"]["Fn::Sub"]
    paths = cfn["Resources"]["HttpApi"]["Properties"]["Body"]["paths"]
    for path, methods in paths.items():
        for operation in methods.values():
            secured = operation.get("security") == [{"TokenAuthorizer": []}]
            assert secured is (not path.endswith("/view")), path


def test_log_groups_have_retention_and_alarms_watch_5xx_and_throttles(cfn: dict[str, Any]) -> None:
    resources = cfn["Resources"]
    groups = [r for r in resources.values() if r["Type"] == "AWS::Logs::LogGroup"]
    assert len(groups) == 9
    assert all("RetentionInDays" in g["Properties"] for g in groups)
    for name in template.functions():
        assert resources[name]["Properties"]["LoggingConfig"]["LogGroup"]["Ref"] == name.replace(
            "Function", "LogGroup"
        )
    metrics = {
        r["Properties"]["MetricName"] for r in resources.values() if r["Type"] == "AWS::CloudWatch::Alarm"
    }
    assert metrics == {"5xx", "ThrottledRequests", "IteratorAge", "ApproximateNumberOfMessagesVisible"}


def test_the_rollup_function_writes_only_rollup_partitions_and_reads_the_stream(cfn: dict[str, Any]) -> None:
    role = cfn["Resources"]["RollupFunction"]["Properties"]["Role"]["Fn::GetAtt"][0]
    statements = [
        s for p in cfn["Resources"][role]["Properties"]["Policies"] for s in p["PolicyDocument"]["Statement"]
    ]
    rollup_only = [s for s in statements if "dynamodb:PutItem" in _listify(s["Action"])]
    assert len(rollup_only) == 1
    assert set(rollup_only[0]["Action"]) == {"dynamodb:GetItem", "dynamodb:PutItem"}
    assert rollup_only[0]["Condition"] == {"ForAllValues:StringLike": {"dynamodb:LeadingKeys": ["@rollup#*"]}}
    mappings = [
        r["Properties"] for r in cfn["Resources"].values() if r["Type"] == "AWS::Lambda::EventSourceMapping"
    ]
    streams = [m for m in mappings if m["FunctionName"] == {"Ref": "RollupFunction"}]
    assert len(streams) == 1
    assert streams[0]["EventSourceArn"] == {"Fn::GetAtt": ["MetricsTable", "StreamArn"]}
    table = cfn["Resources"]["MetricsTable"]["Properties"]
    assert table["StreamSpecification"] == {"StreamViewType": "KEYS_ONLY"}
    from instantml import limits

    assert not limits.is_valid_name("@rollup")  # no project can own a partition key starting with "@"


def _statements(cfn: dict[str, Any], function: str) -> list[dict[str, Any]]:
    role = cfn["Resources"][function]["Properties"]["Role"]["Fn::GetAtt"][0]
    return [
        s for p in cfn["Resources"][role]["Properties"]["Policies"] for s in p["PolicyDocument"]["Statement"]
    ]


def test_the_summary_writes_only_findings_on_runs_and_the_runs_function_reads_only_scalars(
    cfn: dict[str, Any],
) -> None:
    from shared.store import dynamodb

    (update,) = [
        s for s in _statements(cfn, "SummarizeFunction") if "dynamodb:UpdateItem" in _listify(s["Action"])
    ]
    assert update["Condition"] == {
        "ForAllValues:StringEquals": {"dynamodb:Attributes": ["project", "run_id", "findings", "findings_at"]}
    }
    metrics_reads = [
        s
        for s in _statements(cfn, "RunsFunction")
        if {"Fn::GetAtt": ["MetricsTable", "Arn"]} in _listify(s["Resource"])
    ]
    assert len(metrics_reads) == 1
    assert metrics_reads[0]["Action"] == "dynamodb:Query"
    prefix = dynamodb.SCALARS_PREFIX
    assert metrics_reads[0]["Condition"] == {
        "ForAllValues:StringLike": {"dynamodb:LeadingKeys": [f"{prefix}*"]}
    }


def test_the_watch_runs_every_minute_alone_writes_only_its_attributes_and_queues_alerts(
    cfn: dict[str, Any],
) -> None:
    resources = cfn["Resources"]
    watch = resources["WatchFunction"]["Properties"]
    assert watch["ReservedConcurrentExecutions"] == 1  # one round at a time
    rules = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::Events::Rule"]
    (scheduled,) = [r for r in rules if "ScheduleExpression" in r]
    assert scheduled["ScheduleExpression"] == "rate(1 minute)"
    # ... and ingest's nudges, on a bus of their own (contract 8: a failed end judged at once).
    (nudged,) = [r for r in rules if "EventPattern" in r]
    assert nudged["EventBusName"] == {"Ref": "WatchNudgeBus"}
    assert all(r["Targets"][0]["Arn"] == {"Fn::GetAtt": ["WatchFunction", "Arn"]} for r in rules)
    assert len(rules) == 2
    (update,) = [
        s for s in _statements(cfn, "WatchFunction") if "dynamodb:UpdateItem" in _listify(s["Action"])
    ]
    assert update["Condition"] == {
        "ForAllValues:StringEquals": {
            "dynamodb:Attributes": ["project", "run_id", "watch", "findings", "findings_at", "headline"]
        }
    }
    # A failed delivery comes back for at least 10 minutes (contract 7), then rests in a dead-letter queue.
    queue = resources["AlertsQueue"]["Properties"]
    assert queue["VisibilityTimeout"] * queue["RedrivePolicy"]["maxReceiveCount"] >= 600
    assert queue["RedrivePolicy"]["deadLetterTargetArn"] == {"Fn::GetAtt": ["AlertsDeadLetterQueue", "Arn"]}
    (deliver,) = [
        r["Properties"]
        for r in resources.values()
        if r["Type"] == "AWS::Lambda::EventSourceMapping"
        and r["Properties"]["FunctionName"] == {"Ref": "DeliverFunction"}
    ]
    assert deliver["FunctionResponseTypes"] == ["ReportBatchItemFailures"]


def test_the_watch_knows_its_schedule_s_interval() -> None:
    watch = template.functions()["WatchFunction"]
    (event,) = [e for e in watch["Events"].values() if e["Type"] == "Schedule"]
    assert event["Properties"]["Schedule"] == "rate(1 minute)"
    assert watch["Environment"]["Variables"]["WATCH_INTERVAL_S"] == "60"


def test_api_gateway_caches_each_token_s_verdict_and_the_throttle_leaves_half_for_a_512_rank_job(
    cfn: dict[str, Any],
) -> None:
    """The authorizer is called about once a minute per token, not per request; the stage's steady rate
    takes two 512-rank jobs at 5 steps/s each at half of it (the uploaders' batching bounds)."""
    import inspect

    import instantml
    from instantml import limits

    body = cfn["Resources"]["HttpApi"]["Properties"]["Body"]
    authorizer = body["components"]["securitySchemes"]["TokenAuthorizer"]["x-amazon-apigateway-authorizer"]
    assert authorizer["identitySource"] == ["$request.header.Authorization"]  # the cache's key: the token
    assert authorizer["authorizerResultTtlInSeconds"] == {"Ref": "AuthorizerCacheSeconds"}
    parameters = template.load()["Parameters"]
    assert 1 <= parameters["AuthorizerCacheSeconds"]["Default"] <= 300  # a revoked token stops soon

    batch = inspect.signature(instantml.init).parameters["batch_size"].default
    per_rank = max(1 / limits.UPLOAD_LINGER_S, 5 / batch)  # requests/s of one rank at 5 steps/s
    job = 512 * per_rank
    assert parameters["ThrottleRateLimit"]["Default"] >= 2 * 2 * job
    assert parameters["ThrottleBurstLimit"]["Default"] >= 512  # every rank's first batch at once


#: Each function's reserved concurrency (template.yaml: ReserveConcurrency): ingest's is the stage's
#: throttle times a batch's 0.2 s, so a flood of requests can never take what the others need.
RESERVED = {
    "AuthorizerFunction": 10,
    "IngestFunction": 50,
    "SummarizeFunction": 20,
    "RunsFunction": 10,
    "RollupFunction": 10,
    "AlertsFunction": 2,
    "WatchFunction": 1,
    "DeliverFunction": 5,
}


def test_every_function_has_its_reserved_concurrency_and_a_default_account_keeps_most_unreserved(
    cfn: dict[str, Any],
) -> None:
    resources = cfn["Resources"]
    for name, reserved in RESERVED.items():
        value = resources[name]["Properties"]["ReservedConcurrentExecutions"]
        if name == "WatchFunction":  # one round at a time, whatever the deployment reserves
            assert value == 1
            continue
        assert value == {"Fn::If": ["Reserve", reserved, {"Ref": "AWS::NoValue"}]}, name
    assert set(RESERVED) == {n for n, r in resources.items() if r["Type"] == "AWS::Lambda::Function"}
    # An account's default limit is 1,000 of which 100 must stay unreserved; the template's
    # ReserveConcurrency parameter says so for smaller limits.
    assert sum(RESERVED.values()) <= 150
    parameters = template.load()["Parameters"]
    throttle = parameters["ThrottleRateLimit"]["Default"]
    assert RESERVED["IngestFunction"] >= throttle * 0.2  # the stage's steady rate, at 0.2 s a batch


def test_the_rollup_stream_sends_what_it_gives_up_on_to_a_queue_with_an_alarm_and_runs_two_batches_a_shard(
    cfn: dict[str, Any],
) -> None:
    resources = cfn["Resources"]
    (mapping,) = [
        r["Properties"]
        for r in resources.values()
        if r["Type"] == "AWS::Lambda::EventSourceMapping"
        and r["Properties"]["FunctionName"] == {"Ref": "RollupFunction"}
    ]
    assert mapping["DestinationConfig"] == {
        "OnFailure": {"Destination": {"Fn::GetAtt": ["RollupFailuresQueue", "Arn"]}}
    }
    assert mapping["ParallelizationFactor"] == 2
    assert mapping["BisectBatchOnFunctionError"] is True
    alarms = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::CloudWatch::Alarm"]
    assert any(
        a["Dimensions"]
        == [{"Name": "QueueName", "Value": {"Fn::GetAtt": ["RollupFailuresQueue", "QueueName"]}}]
        for a in alarms
    )


def test_tables_expire_what_the_retention_says_and_cap_their_on_demand_throughput(
    cfn: dict[str, Any],
) -> None:
    from shared.store import dynamodb

    resources = cfn["Resources"]
    for name in ("MetricsTable", "RunsTable"):
        props = resources[name]["Properties"]
        assert props["TimeToLiveSpecification"] == {"AttributeName": dynamodb.EXPIRES, "Enabled": True}
    for name in template.tables():
        caps = resources[name]["Properties"]["OnDemandThroughput"]
        assert {"MaxWriteRequestUnits", "MaxReadRequestUnits"} <= set(caps), name
    metrics = resources["MetricsTable"]["Properties"]["OnDemandThroughput"]
    assert metrics == {
        "MaxWriteRequestUnits": {"Ref": "MaxWriteUnitsPerSecond"},
        "MaxReadRequestUnits": {"Ref": "MaxReadUnitsPerSecond"},
    }
    parameters = template.load()["Parameters"]
    assert parameters["RetentionDays"]["Default"] == 365  # a year; 0 keeps everything
    assert parameters["RetentionDays"]["MinValue"] == 0
    # Two 512-rank jobs at 5 steps/s: 2 x 2,560 events/s, a write unit each, fit the metrics table's cap.
    assert parameters["MaxWriteUnitsPerSecond"]["Default"] >= 2 * 512 * 5
    for name, function in template.functions().items():
        assert function["Environment"]["Variables"][dynamodb.RETENTION_ENV] == {"Ref": "RetentionDays"}, name


def test_the_deployed_code_root_is_the_server_s_code_only() -> None:
    """Every function deploys deploy/: links to functions/, shared/ and instantml/ (what the handlers
    import), never tests, benchmarks or examples."""
    from infra.wiring import ROOT

    uris = {str(function["CodeUri"]) for function in template.functions().values()}
    assert uris == {"deploy/"}
    root = ROOT / "deploy"
    assert sorted(p.name for p in root.iterdir()) == ["functions", "instantml", "shared"]
    for link in root.iterdir():
        assert link.is_symlink()
        assert link.resolve() == (ROOT / link.name).resolve()


def test_the_cpu_bound_functions_get_a_whole_vcpu_and_the_others_the_global_size(cfn: dict[str, Any]) -> None:
    """Lambda's CPU follows memory (one vCPU at 1,769 MB): the summary, the rollups and the watch are
    numpy work whose cold start (imports) and requests take a share of a vCPU's time below it."""
    resources = cfn["Resources"]
    functions = {n: r["Properties"] for n, r in resources.items() if r["Type"] == "AWS::Lambda::Function"}
    memory = {name: props["MemorySize"] for name, props in functions.items()}
    whole_vcpu = {"SummarizeFunction", "RollupFunction", "WatchFunction"}
    assert {n for n, m in memory.items() if m >= 1769} == whole_vcpu
    assert all(memory[n] == 1769 for n in whole_vcpu)
    assert memory["AuthorizerFunction"] == 512  # a token lookup
    assert all(m == 1024 for n, m in memory.items() if n not in whole_vcpu | {"AuthorizerFunction"})


def test_the_watch_runs_on_the_nudges_ingest_sends() -> None:
    """The template's rule matches the events ``functions/ingest/nudge.py`` puts on the bus it names."""
    from infra import template
    from shared.watch.nudges import DETAIL_TYPE, NUDGE_ENV, SOURCE

    resources = template.load()["Resources"]
    rule = resources["WatchFunction"]["Properties"]["Events"]["Nudged"]
    assert rule["Type"] == "EventBridgeRule"
    assert rule["Properties"]["Pattern"] == {"source": [SOURCE], "detail-type": [DETAIL_TYPE]}
    bus = rule["Properties"]["EventBusName"]
    assert resources["IngestFunction"]["Properties"]["Environment"]["Variables"][NUDGE_ENV] == bus


def test_point_in_time_recovery_and_the_log_level_are_the_deployment_s_to_lower() -> None:
    """The all-in bill's two levers besides retention (README: what a team changes to pay less)."""
    cfn = template.load()
    parameters = cfn["Parameters"]
    assert (parameters["PointInTimeRecovery"]["Default"], parameters["LogLevel"]["Default"]) == (
        "true",
        "INFO",
    )
    tables = [r for r in cfn["Resources"].values() if r["Type"] == "AWS::DynamoDB::Table"]
    assert len(tables) == 4
    for table in tables:
        assert table["Properties"]["PointInTimeRecoverySpecification"] == {
            "PointInTimeRecoveryEnabled": {"Fn::If": ["Backups", True, False]}
        }
    assert cfn["Conditions"]["Backups"] == {"Fn::Equals": [{"Ref": "PointInTimeRecovery"}, "true"]}
    variables = cfn["Globals"]["Function"]["Environment"]["Variables"]
    assert variables["POWERTOOLS_LOG_LEVEL"] == {"Ref": "LogLevel"}
