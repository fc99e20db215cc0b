"""The examples in the docstrings of the pure modules (``>>>``) hold: they are documentation a reader
trusts, so they are run. (The client's own pages, ``instantml/run.py`` and ``api.py``, show sessions
against a server: examples to read, not to run here.)"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for package in ("shared", "instantml/upload", "instantml/monitor")
    for path in (ROOT / package).rglob("*.py")
    if ">>> " in path.read_text()
)


def test_the_examples_are_found() -> None:
    assert "shared.stats" in MODULES and "instantml.upload.spool" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_a_modules_examples_hold(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed"
