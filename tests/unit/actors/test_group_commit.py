"""Group commit (DESIGN.md 4a: "committed in groups ... never after the caller has been told"): the receipt
ledger and the conversation journal take many records per commit or fsync, and ``when_durable`` tells
nobody of a record before the commit that holds it has returned.

``BlockingCommit`` and ``BlockingFsync`` are fakes, named so: they stand in for a disk that is slow at a
chosen moment (no real disk can be made to stall on cue), and call the real COMMIT / fsync once released.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import uuid
from pathlib import Path

import pytest

from actors.conversation.journal import Journal
from actors.router.receipts import Intent, ReceiptLedger, commit
from actors.types import AgentProvider

WAIT = 10.0


def intent(n: int, receipt_id: str | None = None) -> Intent:
    return Intent(
        operation_id=uuid.UUID(int=100 + n),
        receipt_id=receipt_id or f"rcpt-{n}",
        parent_operation_id=uuid.UUID(int=1),
        user_id="alice",
        provider=AgentProvider.OPENAI,
        provider_model="m",
        model="m",
        round=None,
        started_at_ms=1_700_000_000_000,
    )


class BlockingCommit:
    """A fake commit: says it was entered, waits for ``release``, then runs the real COMMIT."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, conn: sqlite3.Connection) -> None:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(WAIT), "the test never released the commit"
        commit(conn)


class BlockingFsync:
    """A fake fsync: says it was entered, waits for ``release``, then runs the real ``os.fsync``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(WAIT), "the test never released the fsync"
        os.fsync(fd)


def open_rows(path: Path) -> int:
    """Rows another connection sees: only what is committed."""
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM receipts").fetchone()[0])
    finally:
        conn.close()


def run(target: object) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def test_ledger_group_answers_nobody_before_its_one_commit_returns(tmp_path: Path) -> None:
    path = tmp_path / "receipts.sqlite"
    fake = BlockingCommit()
    ledger = ReceiptLedger(path, commit=fake)
    told: list[tuple[int, BaseException | None]] = []

    def burst() -> None:  # the ledger's connection belongs to the thread that uses it
        ledger.begin_incarnation()  # its own transaction, not through the commit hook
        with ledger.group():
            for n in range(5):
                ledger.open(intent(n))
                ledger.when_durable(lambda e, n=n: told.append((n, e)))
        ledger.close()

    thread = run(burst)
    try:
        assert fake.entered.wait(WAIT)
        assert told == []  # the commit has not returned: nobody has heard of any of the five
        assert open_rows(path) == 0  # and indeed nothing is on disk yet
    finally:
        fake.release.set()
        thread.join(WAIT)
    assert not thread.is_alive()
    assert told == [(n, None) for n in range(5)]
    assert (fake.calls, open_rows(path)) == (1, 5)  # five records, one commit


def test_ledger_outside_a_group_each_write_is_committed_before_it_returns(tmp_path: Path) -> None:
    ledger = ReceiptLedger(tmp_path / "r.sqlite")
    ledger.begin_incarnation()
    before = ledger.commits
    told: list[BaseException | None] = []
    ledger.open(intent(0))
    ledger.when_durable(told.append)
    assert (told, ledger.commits - before, open_rows(ledger.path)) == ([None], 1, 1)
    ledger.close()


def test_ledger_a_failing_write_rolls_back_alone_and_the_group_commits_the_rest(tmp_path: Path) -> None:
    ledger = ReceiptLedger(tmp_path / "r.sqlite")
    ledger.begin_incarnation()
    with ledger.group():
        ledger.open(intent(0))
        with pytest.raises(sqlite3.IntegrityError):
            ledger.open(intent(1, receipt_id="rcpt-0"))  # a receipt id already used
        ledger.open(intent(2))
    assert ledger.count_open() == 2
    assert open_rows(ledger.path) == 2
    ledger.close()


def test_ledger_a_group_that_raises_commits_nothing_and_says_so(tmp_path: Path) -> None:
    ledger = ReceiptLedger(tmp_path / "r.sqlite")
    ledger.begin_incarnation()
    told: list[BaseException | None] = []
    with pytest.raises(RuntimeError, match="boom"), ledger.group():
        ledger.open(intent(0))
        ledger.when_durable(told.append)
        raise RuntimeError("boom")
    assert open_rows(ledger.path) == 0
    assert len(told) == 1 and isinstance(told[0], RuntimeError)
    ledger.close()


def test_journal_group_answers_nobody_before_its_one_fsync_returns(tmp_path: Path) -> None:
    fake = BlockingFsync()
    journal = Journal(tmp_path / "s.jsonl", fsync=fake)
    told: list[tuple[int, BaseException | None]] = []

    def burst() -> None:
        with journal.group():
            for n in range(5):
                journal.write({"type": "note", "n": n}, durable=True)
                journal.when_durable(lambda e, n=n: told.append((n, e)))

    thread = run(burst)
    try:
        assert fake.entered.wait(WAIT)
        assert told == []  # written and flushed, but not fsync'd: nobody told
    finally:
        fake.release.set()
        thread.join(WAIT)
    assert not thread.is_alive()
    assert told == [(n, None) for n in range(5)]
    assert fake.calls == journal.fsyncs == 1  # five durable records, one fsync
    journal.close()


def test_journal_outside_a_group_a_durable_record_is_fsynced_before_write_returns(tmp_path: Path) -> None:
    calls: list[int] = []
    journal = Journal(tmp_path / "s.jsonl", fsync=lambda fd: calls.append(fd))
    journal.write({"type": "note"}, durable=True)
    assert len(calls) == 1
    journal.close()


def test_journal_a_failed_fsync_is_told_to_every_waiter(tmp_path: Path) -> None:
    def broken(fd: int) -> None:
        raise OSError("disk gone")

    journal = Journal(tmp_path / "s.jsonl", fsync=broken)
    told: list[BaseException | None] = []
    with pytest.raises(OSError, match="disk gone"), journal.group():
        journal.write({"type": "note"}, durable=True)
        journal.when_durable(told.append)
        journal.when_durable(told.append)
    assert len(told) == 2 and all(isinstance(e, OSError) for e in told)
    journal.close()
