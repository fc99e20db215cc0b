"""Prose names only what exists: every dotted name of the project's packages (``shared.runs.status``) and
every path of its folders (``tests/stack/test_load.py``) written in a comment, a docstring, a string, the
README, the Makefile, the template or the dev requirements resolves to a module, an attribute or a file.

Names are resolved from the source, without importing it: a module is a file or a package folder, an
attribute a name its module (or class) defines at its top level or assigns on ``self``.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("instantml", "shared", "functions", "infra", "tests", "benchmarks")
FOLDERS = (*PACKAGES, "docs", "examples", "events", "deploy")
#: Read whole: prose and build files.
TEXTS = ("README.md", "Makefile", "template.yaml", "pyproject.toml", "infra/requirements-dev.txt")

DOTTED = re.compile(rf"(?<![\w./-])(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(rf"(?<![\w./-])(?:{'|'.join(FOLDERS)})/[\w./-]*")
#: A dotted name that ends so is a file's name (``instantml.db``), not a module's attribute.
FILE_SUFFIXES = {"db", "md", "py", "json", "txt", "html", "css", "js", "yaml", "toml", "whl", "log", "png"}

#: What prose names on purpose though it is not in this tree, each with why.
ELSEWHERE = {
    # The installed wheel's layout (pyproject.toml's package-dir; tests/unit/test_packaging.py).
    "instantml._server",
    "instantml/_server",
    # The EventBridge source of the watch's nudges (shared/watch/nudges.py, the template's rule).
    "instantml.ingest",
    # A rate (events per second), not the events/ folder.
    "events/s",
    # A placeholder in a command line: one of the examples.
    "examples/EXAMPLE",
    # The workspace's engineering notes, outside this repository.
    "shared/engineering",
}


def sources() -> Iterator[Path]:
    """The Python files, but this one (its own examples name what does not exist)."""
    for folder in (*PACKAGES, "examples"):
        yield from (p for p in sorted((ROOT / folder).rglob("*.py")) if p != Path(__file__).resolve())


def prose_of(path: Path) -> str:
    """A Python file's comments and strings (its code's own names are checked by running it), or a
    text file whole."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    return "\n".join(
        t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type in kinds
    )


@functools.cache
def defined(module: Path, inside: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The names ``module`` defines at its top level, or in the class at ``inside``; None where that is
    not known from the source (a name imported from elsewhere: anything may follow it)."""
    body: list[ast.stmt] = ast.parse(module.read_text()).body
    for name in inside:
        found = [n for n in body if isinstance(n, ast.ClassDef) and n.name == name]
        if not found:
            return None
        body = found[0].body
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING imports, fallbacks
            names.update(
                n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            )
            names.update(
                (a.asname or a.name).split(".")[0]
                for n in ast.walk(node)
                if isinstance(n, ast.Import | ast.ImportFrom)
                for a in n.names
            )
    if inside:  # what methods assign on self
        for sub in ast.walk(ast.Module(body=body, type_ignores=[])):
            if (
                isinstance(sub, ast.Attribute)
                and isinstance(sub.ctx, ast.Store)
                and isinstance(sub.value, ast.Name)
                and sub.value.id == "self"
            ):
                names.add(sub.attr)
    return frozenset(names)


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return True
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module
        base = ROOT.joinpath(*parts[:i])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.exists() or base.is_dir():
            break
    else:
        return False
    rest = parts[i:]
    for j, name in enumerate(rest):
        if not module.exists():
            return False
        names = defined(module, tuple(rest[:j]))
        if names is None:
            return True
        if name not in names:
            return False
        if name[:1].islower():  # a function's or a value's attribute: not followed further
            return True
    return True


def exists(path: str) -> bool:
    path = path.rstrip(".")
    return (ROOT / path).exists() or (ROOT / f"{path}.py").exists()


def unresolved() -> list[str]:
    found = []
    for path in [*sources(), *(ROOT / t for t in TEXTS)]:
        where = path.relative_to(ROOT)
        prose = prose_of(path)
        for match in DOTTED.finditer(prose):
            name = match.group(0)
            if not any(name == e or name.startswith(f"{e}.") for e in ELSEWHERE) and not resolves(name):
                found.append(f"{where}: {name}")
        for match in PATH.finditer(prose):
            name = match.group(0).rstrip(".")
            if not any(name == e or name.startswith(f"{e}/") for e in ELSEWHERE) and not exists(name):
                found.append(f"{where}: {name}")
    return found


@pytest.mark.slow
def test_every_name_and_path_in_prose_exists() -> None:
    assert unresolved() == []


def test_the_check_finds_a_name_or_a_path_that_does_not_exist() -> None:
    assert resolves("shared.ingest.activity.ActivityNotes.note")
    assert resolves("shared.ingest.activity.NOTED_RUNS")
    assert resolves("shared.store")
    assert not resolves("shared.rollup_store")
    assert not resolves("shared.runs.no_such_name")
    assert not resolves("shared.ingest.activity.ActivityNotes.no_such_method")
    assert exists("tests/stack/test_load.py")
    assert not exists("tests/test_load.py")
