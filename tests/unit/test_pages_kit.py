"""The page kit (functions/pages): each page is served as one document with the kit inlined.

The pages' behaviour in a browser is tests/stack/test_page.py and tests/stack/test_runs_pages.py; here,
the assembly:
every page holds each placeholder once, the served document has none left and one script and style
(the CSP allows inline ones only), and what the kit defines is defined there only.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

import pytest

from functions.api import KIT_PARTS, PAGE_KIT, page, page_html
from functions.runs.app import COMPARE_HTML, RUN_HTML, RUNS_HTML
from functions.summarize.app import VIEW_HTML

PAGES = [VIEW_HTML, RUNS_HTML, RUN_HTML, COMPARE_HTML]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_each_page_is_served_whole_with_the_kit_inlined(path: Path) -> None:
    html = page_html(path)
    for name, (placeholder, _) in KIT_PARTS.items():
        assert placeholder not in html
        assert (PAGE_KIT / name).read_text().strip() in html
    assert html.count("<script") == 1
    assert html.count("<style") == 1  # inline, nothing fetched
    assert "<script src" not in html
    assert '<link rel="stylesheet"' not in html
    assert html.index("const Kit = ") < html.index("Kit.start(")
    response = page(path)
    assert response.body == html


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_a_page_runs_only_its_own_script(path: Path) -> None:
    # The policy names the hash of the one inline script as served: any other script (injected markup,
    # an inline handler) is refused by the browser (tests/stack/test_hostile_pages.py shows it).
    html = page_html(path)
    script = html[html.index(">", html.index("<script")) + 1 : html.index("</script>")]
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    headers = page(path).headers
    text = headers["Content-Security-Policy"]
    assert isinstance(text, str)
    policy = {d.strip().split(" ", 1)[0]: d.strip().split(" ", 1)[1] for d in text.split(";")}
    assert policy["script-src"] == f"'sha256-{digest}'"
    assert "'unsafe-inline'" not in policy["script-src"] and "'unsafe-inline'" not in policy["default-src"]
    assert (policy["object-src"], policy["base-uri"], policy["frame-ancestors"]) == ("'none'",) * 3
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Referrer-Policy"] == "no-referrer"
    markup = html[: html.index("<script")] + html[html.index("</script>") :]
    assert re.findall(r"<[^>]*\son[a-z]+\s*=", markup, re.IGNORECASE) == []  # no inline handlers
    assert "javascript:" not in markup.lower()


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_what_the_kit_defines_is_not_defined_again_in_a_page(path: Path) -> None:
    text = path.read_text()
    facts = (
        "instantml_token",
        "sessionStorage",
        "localStorage",
        "Authorization",
        "Bearer",
        "'token'",
        'id="token-form"',
    )
    for fact in facts:
        assert fact not in text, f"{path.name} defines {fact} again: it belongs to the page kit"


def test_a_page_is_assembled_once_per_process() -> None:
    assert page_html(VIEW_HTML) is page_html(VIEW_HTML)


def test_a_page_without_a_placeholder_is_an_error(tmp_path: Path) -> None:
    good = VIEW_HTML.read_text()
    for placeholder, _ in KIT_PARTS.values():
        broken = tmp_path / f"{len(placeholder)}.html"
        broken.write_text(good.replace(placeholder, ""))
        with pytest.raises(ValueError, match="placeholder"):
            page_html(broken)
    twice = tmp_path / "twice.html"
    twice.write_text(good.replace("// instantml:kit.js", "// instantml:kit.js\n// instantml:kit.js"))
    with pytest.raises(ValueError, match="exactly once"):
        page_html(twice)
