"""SIGKILL in the middle of group commits loses nothing that was answered (DESIGN.md 4a): a real writer
process (tests/peers/group_commit_writer.py) writes records in groups and prints ``answered N`` only from
``when_durable``; it is killed by its PID while writing, and every answered record must be on disk.

The ledger test fails when ``when_durable`` answers before the group's COMMIT (checked). The journal's
records are flushed to the OS as they are written, so a SIGKILL (not a power loss) keeps them either way:
its test shows the answered-implies-on-disk contract under SIGKILL; the fsync ordering itself is shown by
the BlockingFsync test in tests/unit/actors/test_group_commit.py."""

from __future__ import annotations

import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WRITER = ROOT / "tests" / "peers" / "group_commit_writer.py"
WAIT = 30.0
ANSWERED = 200  # kill once this many were answered: many groups committed, one surely in flight


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:  # ended by PID, whatever the test did
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(WAIT)
        if proc.stdout is not None:
            proc.stdout.close()


def answered_then_kill(proc: subprocess.Popen[str]) -> list[int]:
    """Read ``answered N`` lines until ANSWERED came (bounded), SIGKILL the writer mid-stream, then read
    whatever it had printed before it died."""
    assert proc.stdout is not None
    answered: list[int] = []
    deadline = time.monotonic() + WAIT
    while len(answered) < ANSWERED:
        left = deadline - time.monotonic()
        assert left > 0, f"the writer answered {len(answered)} records within {WAIT}s"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            line = proc.stdout.readline()
            assert line, f"the writer ended early (exit {proc.poll()})"
            answered.append(int(line.split()[1]))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(WAIT)
    answered.extend(int(line.split()[1]) for line in proc.stdout.read().splitlines())
    return answered


def start(kind: str, path: Path, group: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-P", str(WRITER), kind, str(path), str(group)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_journal_sigkill_mid_group_loses_nothing_answered(
    tmp_path: Path, writer: list[subprocess.Popen[str]]
) -> None:
    path = tmp_path / "s.jsonl"
    writer.append(proc := start("journal", path, 16))
    answered = answered_then_kill(proc)
    lines = path.read_text(encoding="utf-8").splitlines()
    on_disk = set()
    for line in lines:
        try:
            on_disk.add(json.loads(line)["n"])
        except json.JSONDecodeError:  # a torn last line: the writer was killed mid-write
            assert line is lines[-1]
    assert answered == sorted(answered)
    assert set(answered) <= on_disk


def test_ledger_sigkill_mid_group_loses_nothing_answered(
    tmp_path: Path, writer: list[subprocess.Popen[str]]
) -> None:
    path = tmp_path / "receipts.sqlite"
    writer.append(proc := start("ledger", path, 16))
    answered = answered_then_kill(proc)
    conn = sqlite3.connect(path)
    try:
        on_disk = {int(r[0].removeprefix("rcpt-")) for r in conn.execute("SELECT receipt_id FROM receipts")}
    finally:
        conn.close()
    assert set(answered) <= on_disk
