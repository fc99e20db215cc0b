"""pyproject.toml's package list is the code's: every package of the server's code root ships in the wheel
under ``instantml._server``, with the files its modules read beside them (tests/stack/test_wheel.py
installs the wheel and runs it)."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
SERVER_ROOTS = ("shared", "functions", "infra")
# Files beside the server's code that no server module reads at run time: what builds the venvs and the
# Lambda layer.
NOT_SHIPPED = ("infra/requirements-dev.txt", "infra/layer/*", "infra/extras/*", "infra/lock/*")


def wheel_name(directory: Path) -> str:
    """The package a directory of the code becomes in the wheel."""
    relative = directory.relative_to(ROOT)
    if relative.parts[0] in SERVER_ROOTS:
        return "instantml._server." + ".".join(relative.parts)
    return ".".join(relative.parts)


def test_every_package_of_the_client_and_the_server_is_in_the_wheel() -> None:
    found = {
        wheel_name(init.parent)
        for top in ("instantml", *SERVER_ROOTS)
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert set(SETUPTOOLS["packages"]) == found
    assert SETUPTOOLS["package-dir"] == {f"instantml._server.{name}": name for name in SERVER_ROOTS}


def test_every_file_a_server_module_reads_ships_beside_it() -> None:
    data = SETUPTOOLS["package-data"]
    for top in SERVER_ROOTS:
        for path in (ROOT / top).rglob("*"):
            relative = path.relative_to(ROOT).as_posix()
            if (
                not path.is_file()
                or path.suffix in {".py", ".pyc"}
                or any(fnmatch(relative, pattern) for pattern in NOT_SHIPPED)
            ):
                continue
            owner = path.parent
            while not (owner / "__init__.py").is_file():
                owner = owner.parent
            patterns = data.get(wheel_name(owner), [])
            inside = path.relative_to(owner).as_posix()
            assert any(fnmatch(inside, pattern) for pattern in patterns), f"{relative} is not in package-data"
