"""What the stack tests share beside tests/conftest.py: one headless Chromium per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser import CHROMIUM, CHROMIUM_FLAGS


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every stack test is ``slow``: each starts the local stack's process tree, a moto server, a wheel
    build or a client process, and waits on it."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    playwright = pytest.importorskip("playwright.sync_api")
    assert Path(CHROMIUM).exists(), "make test installs Debian's chromium; it is missing"
    with playwright.sync_playwright() as p:
        # Playwright hides scrollbars in headless Chromium; a desktop browser shows them, and they take
        # width from the tables.
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_FLAGS, ignore_default_args=["--hide-scrollbars"]
        )
        yield browser
        browser.close()
