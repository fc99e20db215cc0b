"""The lock files under infra/lock/ agree with their inputs, so a lock cannot silently drift from the
pins people edit (the Lambda layer's infra/layer/requirements.txt, infra/requirements-dev.txt,
infra/lock/<venv>.in). Which lock comes from which inputs is read from the Makefile's ``lock`` recipe,
the one place that says it. Pure file parsing: no network, no uv."""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK = "infra/lock"
#: The trainer frameworks: every venv that pins one pins the version the torch venv's tests run.
TRAINERS = ("torch", "transformers", "accelerate", "lightning")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: ``==2.13.0`` matches a local version (PEP 440)."""
    return version.split("+", 1)[0]


REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*(.*)$")


def requirements(path: str) -> dict[str, str | None]:
    """An input file's requirements: each name with its ``==`` version, else None."""
    found: dict[str, str | None] = {}
    for raw in (ROOT / path).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = REQUIREMENT.match(line)
        assert match, f"{path}: cannot read {raw!r}"
        spec = match.group(3).split(";", 1)[0].strip()
        pinned = re.fullmatch(r"==\s*([^\s,]+)", spec)
        found[canonical(match.group(1))] = pinned.group(1) if pinned else None
    return found


@dataclass
class Locked:
    version: str
    hashes: int


def locked(path: str) -> dict[str, Locked]:
    """A lock's packages: name, version and how many hashes it carries."""
    found: dict[str, Locked] = {}
    name = ""
    for line in (ROOT / path).read_text().splitlines():
        if line.startswith("    --hash="):
            found[name].hashes += 1
        elif line and not line.startswith((" ", "#")):
            requirement = line.rstrip("\\ ").split(";", 1)[0].strip()
            assert "==" in requirement, f"{path}: not a pin: {line!r}"
            package, version = requirement.split("==", 1)
            name = canonical(package.split("[", 1)[0])
            found[name] = Locked(version.strip(), 0)
    return found


@dataclass
class Recipe:
    output: str
    inputs: list[str]
    constraints: list[str]


def recipes() -> list[Recipe]:
    """The Makefile's ``lock`` recipe: each ``$(COMPILE)`` line's inputs, constraints and output."""
    makefile = (ROOT / "Makefile").read_text()
    body = makefile.split("\nlock:", 1)[1].split("\n\n", 1)[0]
    found = []
    for line in body.splitlines():
        if not line.startswith("\t$(COMPILE)"):
            continue
        words = shlex.split(line.replace("$(LOCK)", LOCK))
        inputs, constraints, output = [], [], ""
        for before, word in itertools.pairwise(words):
            if before == "-o":
                output = word
            elif before == "-c":
                constraints.append(word)
            elif word.endswith((".txt", ".in")):
                inputs.append(word)
        assert output, f"Makefile's lock recipe: cannot read {line!r}"
        assert inputs, f"Makefile's lock recipe: cannot read {line!r}"
        found.append(Recipe(output, inputs, constraints))
    return found


RECIPES = recipes()


def test_the_lock_recipe_covers_every_lock_and_input() -> None:
    outputs = {recipe.output for recipe in RECIPES}
    assert outputs == {str(p.relative_to(ROOT)) for p in (ROOT / LOCK).glob("*.txt")}
    assert {f"{LOCK}/dev.txt", f"{LOCK}/server.txt", f"{LOCK}/torch.txt"} <= outputs
    for stem in (p.stem for p in (ROOT / LOCK).glob("*.in")):
        assert f"{LOCK}/{stem}.txt" in outputs, f"{LOCK}/{stem}.in is locked by no recipe"


@pytest.mark.parametrize("recipe", RECIPES, ids=[Path(r.output).stem for r in RECIPES])
def test_a_lock_holds_every_input_at_its_pinned_version(recipe: Recipe) -> None:
    lock = locked(recipe.output)
    for path in recipe.inputs:
        for name, version in requirements(path).items():
            assert name in lock, f"{path} needs {name}, which {recipe.output} lacks: run `make lock`"
            if version is not None:
                assert public(lock[name].version) == version, (
                    f"{path} pins {name}=={version}, {recipe.output} has {lock[name].version}: "
                    "run `make lock`"
                )


@pytest.mark.parametrize("recipe", RECIPES, ids=[Path(r.output).stem for r in RECIPES])
def test_a_lock_keeps_within_its_constraints_and_carries_hashes(recipe: Recipe) -> None:
    lock = locked(recipe.output)
    for path in recipe.constraints:
        for name, entry in locked(path).items():
            if name in lock:
                assert lock[name].version == entry.version, f"{recipe.output}: {name} differs from {path}"
    # The Makefile installs with --require-hashes.
    assert all(entry.hashes for entry in lock.values()), f"{recipe.output} has packages without hashes"


def test_the_server_lock_is_within_the_dev_lock() -> None:
    """`make demo` adds the server lock to .venv and `make test` syncs the dev lock into it: the same
    versions either way, and a sync never removes what the demo needs."""
    dev = locked(f"{LOCK}/dev.txt")
    for name, entry in locked(f"{LOCK}/server.txt").items():
        assert name in dev, f"{name} is in the server lock only: add it to infra/requirements-dev.txt"
        assert dev[name].version == entry.version, f"{name}: server {entry.version}, dev {dev[name].version}"


def test_every_venv_pins_the_trainers_the_torch_venv_is_tested_with() -> None:
    tested = {name: requirements(f"{LOCK}/torch.in").get(name) for name in TRAINERS}
    assert all(tested.values()), f"{LOCK}/torch.in pins each of {TRAINERS}"
    for recipe in RECIPES:
        lock = locked(recipe.output)
        for name in TRAINERS:
            if name in lock:
                assert public(lock[name].version) == tested[name], (
                    f"{recipe.output} has {name} {lock[name].version}, the torch venv tests {tested[name]}"
                )


def test_the_readers_see_pins_and_hashes() -> None:
    """The parsers themselves, on the shapes the real files have."""
    assert requirements(f"{LOCK}/torch.in")["torch"] == "2.13.0"
    dev_inputs = requirements("infra/requirements-dev.txt")
    assert dev_inputs["moto"] == "5.2.5"  # moto[server,dynamodb]==5.2.5
    assert dev_inputs["aws-sam-cli"] is None
    assert public(locked(f"{LOCK}/torch.txt")["torch"].version) == "2.13.0"
