"""A token revoked with `instantml tokens revoke` on a local stack is refused from the next request (issue
28, item 7): the SQLite token store sets the authorizer's cache TTL to 0. On AWS the authorizer keeps
verdicts 60 s (``shared.tokens.DEFAULT_TTL_S``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


def tokens(stack: Any, *args: str) -> str:
    done = subprocess.run(
        [str(BIN / "instantml"), "tokens", "--data-dir", str(stack.data_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def post(stack: Any, token: str, step: int) -> tuple[int, Any]:
    request = urllib.request.Request(
        stack.url + "/v1/projects/revoked-project/runs/r/rank-metrics",
        data=json.dumps({"step": step, "rank": 0, "world_size": 1, "metrics": {"a": 1.0}}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_a_revoked_token_is_refused_at_the_next_request(local_stack: Any) -> None:
    from shared.tokens import TokenCache

    made = tokens(local_stack, "create", "--project", "revoked-project")
    token_id = re.search(r"token id (\S+)", made)
    assert token_id
    token = made.strip().splitlines()[-1]
    for step in range(3):  # used, so a cache (were there one) holds its verdict
        assert post(local_stack, token, step)[0] == 201
    printed = tokens(local_stack, "revoke", token_id.group(1))
    assert "refuses it from its next request" in printed
    status, body = post(local_stack, token, 3)
    assert (status, body["error"]["code"]) == (401, "unauthorized")
    assert TokenCache(local_stack.store()).ttl == 60.0  # a store that does not say keeps AWS's default
