"""Pages that run only their own script: hostile markup in every field a user controls (metric keys,
config keys and values, host names, and the findings' text that quotes them), stored through the real
local stack's API, and every page opened in headless Chromium. Nothing injected runs, the markup shows
as text, and the page still draws. The CSP (functions/api.py: the hash of each page's one script) is
the second wall behind the pages' escaping: both are checked, the escaping by what the page shows, the
policy by the headers and by tests/unit/test_pages_kit.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import pytest

from instantml import routes
from tests.faults import call

pytestmark = pytest.mark.browser

if TYPE_CHECKING:
    from infra.local import LocalStack

PROJECT, RUN, OTHER = "hostile-pages", "evil", "evil-too"
#: Each marks the page's body if it ever runs (a locator sees it; the CSP forbids the eval that
#: reading a window variable would need).
MARK = "document.body.setAttribute('data-pwned','1')"
PAYLOADS = [
    f'<img src=x onerror="{MARK}">',
    f"<script>{MARK}</script>",
    f'"><svg onload="{MARK}">',
    f"'><iframe srcdoc='<script>parent.{MARK}</script>'>",
    f"javascript:{MARK}",
]
#: Host names are printable ASCII without spaces (contract 3.4's host rule).
HOSTS = ["<img/src=x/onerror=document.body.setAttribute('data-pwned','1')>", '"><svg/onload=alert(1)>']


def send(stack: LocalStack, method: str, route: str, run_id: str, body: Any) -> Any:
    path = route.format(project=PROJECT, run_id=run_id)
    status, answer = call(stack, method, path, body)
    assert 200 <= status < 300, (path, status, answer)
    if isinstance(answer, dict) and "rejected" in answer:
        assert answer["rejected"] == 0, answer
    return answer


@pytest.fixture(scope="module")
def stack(local_stack: LocalStack) -> LocalStack:
    keys = [f"train/{p}"[:256] for p in PAYLOADS]
    for run_id in (RUN, OTHER):
        config = {p: p for p in PAYLOADS} | {"nested": {PAYLOADS[0]: [PAYLOADS[1], PAYLOADS[2]]}}
        send(local_stack, "PATCH", routes.RUN, run_id, {"config": config})
        send(local_stack, "PATCH", routes.RUN, run_id, {"hosts": {"0": HOSTS[0], "1": HOSTS[1]}})
        events = [
            {
                "event_id": f"{run_id}-{step}-{rank}",
                "step": step,
                "rank": rank,
                "world_size": 4,
                # rank 3 stands far apart on every key, so the findings quote the keys and hosts
                "metrics": dict.fromkeys(keys, 50.0 if rank == 3 else 1.0 + rank / 100 + step / 1000),
            }
            for step in range(40)
            for rank in range(4)
            if not (rank == 1 and step > 20)  # rank 1 stops: a finding naming its (hostile) host
        ]
        send(local_stack, "POST", routes.RANK_METRICS_BATCH, run_id, {"events": events})
        scalars = [
            {"event_id": f"s-{run_id}-{n}", "step": n, "rank": 0, "metrics": {PAYLOADS[n % 5]: n}}
            for n in range(20)
        ]
        send(local_stack, "POST", routes.SCALARS_BATCH, run_id, {"events": scalars})
    return local_stack


def pages(stack: LocalStack) -> dict[str, str]:
    base, token = stack.url, quote(stack.token, safe="")
    return {
        "distributed": f"{base}/v1/projects/{PROJECT}/runs/{RUN}/distributed/view#token={token}",
        "runs": f"{base}/v1/projects/{PROJECT}/view#token={token}",
        "run": f"{base}/v1/projects/{PROJECT}/runs/{RUN}/view#token={token}",
        "compare": f"{base}/v1/projects/{PROJECT}/compare/view#runs={RUN},{OTHER}&token={token}",
    }


@pytest.mark.parametrize("name", ["distributed", "runs", "run", "compare"])
def test_hostile_values_show_as_text_and_run_nothing(stack: LocalStack, browser: Any, name: str) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    requests: list[str] = []
    refused: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: requests.append(urlsplit(r.url).path))
    page.on("console", lambda m: (refused if "Content Security Policy" in m.text else errors).append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    answer = page.goto(pages(stack)[name])
    assert answer is not None
    policy = answer.headers["content-security-policy"]
    assert "'unsafe-inline'" not in policy.split("script-src", 1)[1].split(";", 1)[0]
    assert answer.headers["x-content-type-options"] == "nosniff"
    page.locator("body[data-drawn]").wait_for(state="attached", timeout=30_000)
    # The page drew, and (where it shows keys, configs or findings: not the runs list's table) with the
    # hostile text in it as text.
    if name != "runs":
        text = page.locator("body").inner_text()
        assert "onerror" in text or "<script>" in text or "svg" in text, text[:2000]
    # Nothing injected ran, nothing it would fetch was fetched, no frame was made.
    assert page.locator("body[data-pwned]").count() == 0
    assert page.locator("img[src='x'], svg[onload], iframe, script:not(:first-of-type)").count() == 0
    assert not [p for p in requests if p.endswith("/x")], requests
    assert refused == []  # escaping held: the policy never even had markup to refuse
    assert errors == [], errors
    page.close()


def test_the_api_answers_carry_the_same_headers(stack: LocalStack) -> None:
    import urllib.request

    for path in (f"/v1/projects/{PROJECT}/runs", f"/v1/projects/{PROJECT}/runs/{RUN}/distributed"):
        request = urllib.request.Request(stack.url + path, headers={"Authorization": f"Bearer {stack.token}"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.headers["X-Content-Type-Options"] == "nosniff"
            assert answer.headers["Referrer-Policy"] == "no-referrer"
    # The stack's own refusals too (no token: the authorizer's 401).
    try:
        urllib.request.urlopen(stack.url + f"/v1/projects/{PROJECT}/runs", timeout=30)
    except urllib.error.HTTPError as refusal:
        assert refusal.code == 401
        assert refusal.headers["X-Content-Type-Options"] == "nosniff"
    else:
        raise AssertionError("a request without a token was answered")
