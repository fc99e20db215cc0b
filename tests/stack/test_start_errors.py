"""`instantml local` as a real process on a damaged, empty or read-only data directory and on a port in use
(issue 28, item 6): one clear paragraph naming the file, directory or port and what to do, exit code 2,
no traceback; an empty database file is taken as new, and said so.

Every process here is started by this test and stopped by its pid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.local import DATABASE_FILE

BIN = Path(sys.executable).parent
PAGE = 4096


@pytest.fixture(scope="module")
def good_database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database of some 150 pages (tokens: nothing for the rollup feed to do), its log checkpointed."""
    from shared.store.sqlite import SqliteStore, SqliteTokenStore

    path = tmp_path_factory.mktemp("good") / DATABASE_FILE
    SqliteStore(path).db.close()
    tokens = SqliteTokenStore(path)
    for i in range(3000):
        tokens.create(f"project-{i}", "x" * 100)
    tokens.db.connection().execute("PRAGMA wal_checkpoint(TRUNCATE)")
    tokens.db.close()
    assert path.stat().st_size > 100 * PAGE
    return path


def copy_of(good: Path, where: Path) -> Path:
    where.mkdir()
    shutil.copyfile(good, where / DATABASE_FILE)
    return where / DATABASE_FILE


def local(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "instantml"), "local", "--port", "0", "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_refused(done: subprocess.CompletedProcess[str], *words: str) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "retry shortly" not in done.stderr, done.stderr
    assert done.stdout == ""  # no URL or token printed for a stack that is not serving
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("instantml local: "), done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)
    return done.stderr


def cut_mid_page(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2 + 100)


def cut_at_page(path: Path) -> None:
    os.truncate(path, (path.stat().st_size // PAGE // 2) * PAGE)


def garbage_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"not a database, just garbage")


def garbage_middle_page(path: Path) -> None:
    middle = path.stat().st_size // PAGE // 2
    with open(path, "r+b") as f:
        f.seek(middle * PAGE)
        f.write(os.urandom(PAGE))


@pytest.mark.parametrize("damage", [cut_mid_page, cut_at_page, garbage_header, garbage_middle_page])
def test_a_damaged_database_is_refused_with_what_to_do(
    good_database: Path, tmp_path: Path, damage: object
) -> None:
    path = copy_of(good_database, tmp_path / "data")
    assert callable(damage)
    damage(path)
    before = path.read_bytes()
    message = assert_refused(
        local(path.parent), f"the database {path} is damaged", "move the damaged files aside"
    )
    assert "restore the file from a backup" in message and "another --data-dir" in message
    assert path.read_bytes() == before  # refused, not "repaired"


def test_an_empty_database_file_starts_as_a_new_database_and_says_so(tmp_path: Path) -> None:
    (tmp_path / DATABASE_FILE).touch()
    proc = subprocess.Popen(
        [str(BIN / "instantml"), "local", "--port", "0", "--token", "t-empty", "--data-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        url = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline())
        assert url
        request = urllib.request.Request(
            url.group(0) + "/v1/projects/p/runs/r/rank-metrics",
            data=json.dumps({"step": 0, "rank": 0, "world_size": 1, "metrics": {"a": 1.0}}).encode(),
            headers={
                "Authorization": "Bearer t-empty",
                "Idempotency-Key": "e1",
                "Content-Type": "application/json",
            },
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 201
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    note = proc.stderr.read()
    assert f"the database {tmp_path / DATABASE_FILE} was an empty file (0 bytes" in note, note
    assert "Traceback" not in note


def test_a_data_dir_that_cannot_be_made_names_it(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    data_dir = tmp_path / "a-file" / "data"
    assert_refused(local(data_dir), f"cannot make the data directory {data_dir}", "--data-dir")


@pytest.fixture
def read_only_data_dir(good_database: Path, tmp_path: Path) -> Iterator[Path]:
    """A data directory holding a good database, bind-mounted read-only (as root, permissions would not
    stop a write; a read-only mount does). Skipped where mounting is not permitted."""
    source = tmp_path / "source"
    copy_of(good_database, source)
    target = tmp_path / "read-only"
    target.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        remounted = subprocess.run(["mount", "-o", "remount,ro,bind", str(target)], capture_output=True)
        if remounted.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {remounted.stderr.decode().strip()}")
        with pytest.raises(OSError):
            (target / "probe").write_text("")
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_a_read_only_data_dir_names_it(read_only_data_dir: Path) -> None:
    assert_refused(
        local(read_only_data_dir),
        f"cannot write in the data directory {read_only_data_dir}",
        "Read-only file system",
        "--data-dir",
    )


def test_a_port_in_use_names_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with tempfile.TemporaryDirectory() as data_dir:
            done = subprocess.run(
                [str(BIN / "instantml"), "local", "--port", str(port), "--data-dir", data_dir],
                capture_output=True,
                text=True,
                timeout=120,
            )
    assert_refused(done, f"port {port} on 127.0.0.1 is in use", "--port")


def test_damage_found_while_serving_says_what_to_do_not_retry(good_database: Path, tmp_path: Path) -> None:
    """A page damaged after the start check: the store's 503 names the file and the way out."""
    from shared.errors import StoreUnavailable
    from shared.store.sqlite import SqliteTokenStore

    path = copy_of(good_database, tmp_path / "data")
    with sqlite3.connect(path) as conn:
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'tokens'").fetchone()
    conn.close()
    with open(path, "r+b") as f:  # the tokens table's root page: every read of the table passes it
        f.seek((root - 1) * PAGE)
        f.write(os.urandom(PAGE))
    with pytest.raises(StoreUnavailable) as raised:
        SqliteTokenStore(path).list()
    message = str(raised.value)
    assert f"the local database {path} is damaged" in message and "retry shortly" not in message
    assert "restore it from a backup" in message
