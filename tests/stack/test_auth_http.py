"""Tenant isolation over HTTP through the local stack: tokens, projects, the operator CLI, logs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from instantml import routes


@pytest.fixture(scope="module")
def tenants(local_stack: Any) -> Iterator[dict[str, str]]:
    from shared.store import open_token_store

    store = open_token_store(local_stack.store_url)
    tokens = {project: store.create(project, "isolation test")[0] for project in ("team-a", "team-b")}
    revoked, record = store.create("team-a", "to revoke")
    store.revoke(record.token_id)
    tokens["revoked"] = revoked
    yield tokens


def request(
    stack: Any, method: str, path: str, headers: dict[str, str], body: Any = None
) -> tuple[int, Any, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **headers}
    req = urllib.request.Request(stack.url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, response.headers, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.load(exc)


def test_a_project_token_cannot_touch_another_project(local_stack: Any, tenants: dict[str, str]) -> None:
    event = {"step": 0, "rank": 0, "world_size": 1, "metrics": {"secret/loss": 1.0}}
    post_a = routes.RANK_METRICS.format(project="team-a", run_id="r")
    read_a = routes.DISTRIBUTED.format(project="team-a", run_id="r")
    auth = {
        "team-a": {"Authorization": f"Bearer {tenants['team-a']}"},
        "team-b": {"Authorization": f"Bearer {tenants['team-b']}"},
    }
    assert request(local_stack, "POST", post_a, {**auth["team-a"], "Idempotency-Key": "a1"}, event)[0] == 201

    status, headers, body = request(local_stack, "GET", read_a, auth["team-b"])
    assert (status, body["error"]["code"]) == (403, "forbidden")
    assert "secret/loss" not in json.dumps(body) and "access-control-allow-origin" not in headers
    status, _, body = request(local_stack, "POST", post_a, {**auth["team-b"], "Idempotency-Key": "b1"}, event)
    assert status == 403
    batch = routes.RANK_METRICS_BATCH.format(project="team-a", run_id="r")
    assert (
        request(local_stack, "POST", batch, auth["team-b"], {"events": [{**event, "event_id": "b2"}]})[0]
        == 403
    )
    # Unknown project for B: the same answer as an existing one.
    other = routes.DISTRIBUTED.format(project="no-such-project", run_id="r")
    assert request(local_stack, "GET", other, auth["team-b"])[2] == body

    status, _, summary = request(local_stack, "GET", read_a, auth["team-a"])
    assert status == 200 and summary["reducers"]["secret/loss"]["count"] == [1]  # B changed nothing


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer not-a-token"},
        {"Authorization": "Bearer"},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "bearer  "},
        "revoked",
    ],
)
def test_missing_unknown_revoked_or_malformed_tokens_are_401(
    local_stack: Any, tenants: dict[str, str], headers: Any
) -> None:
    if headers == "revoked":
        headers = {"Authorization": f"Bearer {tenants['revoked']}"}
    status, _, body = request(
        local_stack, "GET", routes.DISTRIBUTED.format(project="team-a", run_id="r"), headers
    )
    assert (status, body["error"]["code"]) == (401, "unauthorized")


def test_a_token_in_the_query_string_is_401_over_http(local_stack: Any, tenants: dict[str, str]) -> None:
    path = routes.DISTRIBUTED.format(project="team-a", run_id="r") + f"?token={tenants['team-a']}"
    status, _, body = request(local_stack, "GET", path, {})
    assert status == 401 and tenants["team-a"] not in json.dumps(body)


def test_the_operator_cli_creates_lists_and_revokes_tokens(local_stack: Any) -> None:
    import subprocess
    import sys
    from pathlib import Path

    cli = [
        str(Path(sys.executable).parent / "instantml"),
        "tokens",
        "--data-dir",
        str(local_stack.data_dir),
    ]
    made = subprocess.run(
        [*cli, "create", "--project", "cli-team"], capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip().splitlines()[-1]
    token_id = made.stdout.split()[2]
    assert token.startswith(f"iml_{token_id}_") and len(token) > 40

    path = routes.DISTRIBUTED.format(project="cli-team", run_id="r")
    assert (
        request(local_stack, "GET", path, {"Authorization": f"Bearer {token}"})[0] == 404
    )  # granted: no run yet
    assert (
        request(
            local_stack,
            "GET",
            routes.DISTRIBUTED.format(project="team-a", run_id="r"),
            {"Authorization": f"Bearer {token}"},
        )[0]
        == 403
    )

    listed = subprocess.run(
        [*cli, "list", "--project", "cli-team"], capture_output=True, text=True, timeout=60
    )
    assert token_id in listed.stdout and "active" in listed.stdout and token not in listed.stdout
    revoked = subprocess.run([*cli, "revoke", token_id], capture_output=True, text=True, timeout=60)
    assert revoked.returncode == 0
    listed = subprocess.run(
        [*cli, "list", "--project", "cli-team"], capture_output=True, text=True, timeout=60
    )
    assert "revoked" in listed.stdout
    bad = subprocess.run([*cli, "revoke", "no-such-id"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1


def test_logs_and_error_bodies_never_hold_a_token(
    local_stack: Any, tenants: dict[str, str], capfd: pytest.CaptureFixture[str]
) -> None:
    path = routes.RANK_METRICS.format(project="team-a", run_id="logs")
    secret = tenants["team-a"]
    for headers, body in (
        (
            {"Authorization": f"Bearer {secret}", "Idempotency-Key": "l1"},
            {"step": 0, "rank": 0, "world_size": 1, "metrics": {"a": 1}},
        ),
        ({"Authorization": f"Bearer {secret}", "Idempotency-Key": "l2"}, {"bad": True}),
        ({"Authorization": f"Bearer {secret}x"}, {"step": 0}),
    ):
        status, _, answer = request(local_stack, "POST", path, headers, body)
        assert status in (201, 400, 401) and secret not in json.dumps(answer)
    out, err = capfd.readouterr()
    assert secret not in out and secret not in err
