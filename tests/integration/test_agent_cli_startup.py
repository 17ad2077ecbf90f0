"""An in-process ``kbus run`` waits for its Router to start, however long a loaded machine makes that (up to
``STARTUP_WAIT``), instead of failing after a fixed few seconds; a Router that stops instead of starting
is one line at once. The slow start is real: this test holds the receipt ledger's SQLite write lock, which
the Router's start-up (``begin_incarnation``) needs; every process is ended by its PID in a finaliser."""

from __future__ import annotations

import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from peers.cli_kit import Start, finish

from actors.app.agent import CONNECT_WAIT
from actors.router.receipts import ReceiptLedger

pytestmark = pytest.mark.integration

SCRIPTED = """
[providers.scripted]
kind = "scripted"
scripts = [[{ text = "Started." }]]
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "scripted.toml"
    path.write_text(SCRIPTED)
    return path


@pytest.fixture
def held_ledger(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """The data folder's receipt ledger with its write lock held by this test until released."""
    data = tmp_path / "data"
    data.mkdir()
    ReceiptLedger(data / "receipts.sqlite3").close()
    conn = sqlite3.connect(data / "receipts.sqlite3", isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    finally:
        conn.close()


def test_a_router_slower_to_start_than_the_old_fixed_wait_is_waited_for(
    kbus_process: Start, config: Path, tmp_path: Path, held_ledger: sqlite3.Connection
) -> None:
    proc = kbus_process(
        "run", "hi", "--config", str(config), "-m", "scripted", "--data-dir", str(tmp_path / "data")
    )
    # Still waiting past the fixed wait that used to end start-up ("does not answer: Expired", exit 3).
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=CONNECT_WAIT + 3)
    held_ledger.execute("COMMIT")  # the Router's start-up can go on now
    code, out, err = finish(proc)
    assert code == 0, err
    assert out.strip() == "Started."
    assert "does not answer" not in err


def test_a_router_that_stops_instead_of_starting_is_one_line(
    kbus_process: Start, config: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "receipts.sqlite3").write_bytes(b"not a database, " * 64)  # the Router's on_start fails on it
    proc = kbus_process("run", "hi", "--config", str(config), "-m", "scripted", "--data-dir", str(data))
    code, out, err = finish(proc)
    lines = err.strip().splitlines()
    assert code == 1, err
    assert len(lines) == 1, err
    assert lines[0].startswith("kbus run: the Router ") and "did not start" in lines[0], err
    assert "Traceback" not in err and out == ""
