"""Tests for actors.router.receipts: exactly one durable receipt per operation, read back as written."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.router.receipts import SCHEMA_VERSION, Intent, ReceiptLedger
from actors.types import AgentProvider, TokenUsage, UsageReceipt

PARENT = uuid.UUID(int=1)


def receipt(n: int = 0, **changes: Any) -> UsageReceipt:
    base = UsageReceipt(
        receipt_id=f"rcpt-{n}",
        operation_id=uuid.UUID(int=1000 + n),
        parent_operation_id=PARENT,
        user_id="alice",
        provider=AgentProvider.OPENAI,
        provider_model="gpt-4.1-2025-04-14",
        model="gpt-4.1",
        round=3,
        status="completed",
        usage=TokenUsage(
            input_tokens=1200,
            cached_input_tokens=200,
            output_tokens=300,
            reasoning_output_tokens=100,
            total_tokens=1500,
        ),
        issued_at_ms=1_700_000_000_000 + n,
        started_at_ms=1_699_999_999_000,
        duration_ms=1000 + n,
        cost_usd=0.0049,
        error=None,
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "deeper" / "receipts.sqlite3"


@pytest.fixture
def ledger(path: Path) -> Iterator[ReceiptLedger]:
    with ReceiptLedger(path) as opened:
        yield opened


def test_a_recorded_receipt_reads_back_equal(ledger: ReceiptLedger) -> None:
    r = receipt()
    assert ledger.record(r) == r
    assert ledger.get(r.operation_id) == r
    assert ledger.count() == 1


def test_none_fields_round_trip(ledger: ReceiptLedger) -> None:
    r = receipt(usage=None, cost_usd=None, round=None, error=None, status="interrupted")
    assert ledger.record(r) == r
    assert ledger.get(r.operation_id) == r
    failed = receipt(1, usage=TokenUsage(), cost_usd=0.0, error="provider said no", status="failed")
    assert ledger.record(failed) == failed
    stored = ledger.get(failed.operation_id)
    assert stored == failed and stored is not None and stored.usage == TokenUsage()


def test_every_field_round_trips_exactly(ledger: ReceiptLedger) -> None:
    r = receipt(
        provider=AgentProvider.LOCAL,
        user_id="ünïcødé \x00 user",
        cost_usd=0.1 + 0.2,  # not representable in decimal: must come back bit for bit
        round=0,
        usage=TokenUsage(input_tokens=2**62, total_tokens=2**62),
        issued_at_ms=2**53 + 1,
    )
    back = ledger.record(r)
    assert back == r
    assert type(back.operation_id) is uuid.UUID and type(back.provider) is AgentProvider
    assert back.cost_usd == 0.1 + 0.2


def test_get_of_an_unknown_operation_is_none(ledger: ReceiptLedger) -> None:
    assert ledger.get(uuid.uuid4()) is None


def test_exactly_once_the_first_receipt_stays(ledger: ReceiptLedger) -> None:
    first = receipt(status="completed")
    second = receipt(status="cancelled", receipt_id="rcpt-other", usage=None, cost_usd=None, error="late")
    assert second.operation_id == first.operation_id
    assert ledger.record(first) == first
    assert ledger.record(second) == first  # the stored one, unchanged
    assert ledger.get(first.operation_id) == first
    assert ledger.count() == 1


def test_a_receipt_id_reused_by_another_operation_is_refused(ledger: ReceiptLedger) -> None:
    ledger.record(receipt(0))
    with pytest.raises(sqlite3.IntegrityError):
        ledger.record(receipt(1, receipt_id="rcpt-0"))
    assert ledger.count() == 1
    ledger.record(receipt(2))  # the failed write left no transaction open
    assert ledger.count() == 2


def test_receipts_survive_a_restarted_router(path: Path) -> None:
    first = ReceiptLedger(path)
    recorded = [first.record(receipt(n)) for n in range(3)]
    first.close()
    assert path.exists()
    second = ReceiptLedger(path)
    try:
        assert second.count() == 3
        assert [second.get(r.operation_id) for r in recorded] == recorded
        # Exactly once across the restart too.
        assert second.record(receipt(0, status="failed", receipt_id="rcpt-again")) == recorded[0]
        assert second.count() == 3
    finally:
        second.close()


def test_the_file_is_in_wal_mode(ledger: ReceiptLedger, path: Path) -> None:
    ledger.record(receipt())
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        conn.close()


def test_a_record_is_committed_when_it_returns(ledger: ReceiptLedger, path: Path) -> None:
    r = ledger.record(receipt())
    # Another connection (another process, say) sees it at once: nothing is left in an open transaction.
    other = sqlite3.connect(path)
    try:
        assert other.execute("SELECT receipt_id FROM receipts").fetchall() == [(r.receipt_id,)]
    finally:
        other.close()


def test_same_operation_from_ten_threads_gives_one_row_and_one_answer(path: Path) -> None:
    ReceiptLedger(path).close()  # never opened: creating the file is left to the racing threads
    results: list[UsageReceipt] = []
    errors: list[Exception] = []
    lock = threading.Lock()
    start = threading.Barrier(10)

    def worker(n: int) -> None:
        ledger = ReceiptLedger(path)  # its own connection, opened in this thread
        try:
            start.wait(timeout=10)
            mine = receipt(0, receipt_id=f"rcpt-thread-{n}", status="completed" if n % 2 else "failed")
            got = ledger.record(mine)
            with lock:
                results.append(got)
        except Exception as exc:  # noqa: BLE001 - reported to the test below
            with lock:
                errors.append(exc)
        finally:
            ledger.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert len(results) == 10
    assert len(set(results)) == 1
    winner = results[0]
    assert winner.receipt_id.startswith("rcpt-thread-")
    with ReceiptLedger(path) as check:
        assert check.count() == 1
        assert check.get(winner.operation_id) == winner


def test_for_parent_orders_by_issue_time(ledger: ReceiptLedger) -> None:
    other_parent = uuid.UUID(int=2)
    issued = {0: 30, 1: 10, 2: 20, 3: 20, 4: 5}
    for n, at in issued.items():
        ledger.record(receipt(n, issued_at_ms=at))
    ledger.record(receipt(9, parent_operation_id=other_parent, issued_at_ms=1))
    children = ledger.for_parent(PARENT)
    assert [r.receipt_id for r in children] == ["rcpt-4", "rcpt-1", "rcpt-2", "rcpt-3", "rcpt-0"]
    assert [r.receipt_id for r in ledger.for_parent(other_parent)] == ["rcpt-9"]
    assert ledger.for_parent(uuid.UUID(int=3)) == ()


def test_a_closed_ledger_refuses_use(path: Path) -> None:
    ledger = ReceiptLedger(path)
    ledger.record(receipt())
    ledger.close()
    ledger.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ledger.get(receipt().operation_id)


def test_the_connection_is_opened_lazily_and_bound_to_its_thread(path: Path) -> None:
    ledger = ReceiptLedger(path)  # made here, as the Router's __init__ would
    assert not path.exists()
    got: list[int] = []

    def router_thread() -> None:
        got.append(ledger.count())
        try:
            ledger.record(receipt())
            got.append(ledger.count())
        finally:
            ledger.close()

    t = threading.Thread(target=router_thread)
    t.start()
    t.join(timeout=30)
    assert got == [0, 1]


def test_use_from_a_second_thread_is_refused(ledger: ReceiptLedger) -> None:
    ledger.count()
    caught: list[BaseException] = []

    def intruder() -> None:
        try:
            ledger.count()
        except sqlite3.ProgrammingError as exc:
            caught.append(exc)

    t = threading.Thread(target=intruder)
    t.start()
    t.join(timeout=30)
    assert len(caught) == 1


def test_a_newer_schema_is_refused(path: Path) -> None:
    path.parent.mkdir(parents=True)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    ledger = ReceiptLedger(path)
    with pytest.raises(RuntimeError, match="schema version 99"):
        ledger.count()


# ------------------------------------------------------------------------- intents (schema version 2)


def intent(n: int = 0, **changes: Any) -> Intent:
    base = Intent(
        operation_id=uuid.UUID(int=1000 + n),
        receipt_id=f"rcpt-{n}",
        parent_operation_id=PARENT,
        user_id="alice",
        provider=AgentProvider.OPENAI,
        provider_model="gpt-4.1-2025-04-14",
        model="gpt-4.1",
        round=3,
        started_at_ms=1_699_999_999_000,
    )
    return dataclasses.replace(base, **changes)


def sql(path: Path, query: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(query, args).fetchall()
    finally:
        conn.close()


def test_an_open_row_is_no_receipt_and_settles_into_exactly_one(ledger: ReceiptLedger, path: Path) -> None:
    mine = ledger.begin_incarnation()
    ledger.open(intent())
    assert (ledger.get(intent().operation_id), ledger.count(), ledger.count_open()) == (None, 0, 1)
    assert ledger.for_parent(PARENT) == ()
    settled = ledger.record(receipt())
    assert settled == receipt()
    # The same row, updated once: no second row, settled by this incarnation, and never changed again.
    assert sql(path, "SELECT status, incarnation, settled_by FROM receipts") == [("completed", mine, mine)]
    assert (
        ledger.record(receipt(status="failed", receipt_id="rcpt-late", usage=None, cost_usd=None)) == settled
    )
    assert (ledger.count(), ledger.count_open()) == (1, 0)


def test_the_intents_receipt_id_and_ids_stay_when_it_is_settled(ledger: ReceiptLedger) -> None:
    ledger.begin_incarnation()
    ledger.open(intent())
    stored = ledger.record(receipt(receipt_id="rcpt-other", user_id="mallory"))
    assert (stored.receipt_id, stored.user_id) == ("rcpt-0", "alice")


def test_opening_needs_an_incarnation(ledger: ReceiptLedger) -> None:
    with pytest.raises(RuntimeError, match="begin_incarnation"):
        ledger.open(intent())


def test_staged_usage_waits_for_the_next_write(ledger: ReceiptLedger, path: Path) -> None:
    ledger.begin_incarnation()
    ledger.open(intent(0))
    usage = TokenUsage(
        input_tokens=5, cached_input_tokens=0, output_tokens=7, reasoning_output_tokens=0, total_tokens=12
    )
    ledger.stage_usage(intent(0).operation_id, usage)
    assert sql(path, "SELECT total_tokens FROM receipts") == [(None,)]  # no write of its own: no fsync
    ledger.open(intent(1))  # the next write takes it along
    assert sql(path, "SELECT total_tokens FROM receipts ORDER BY seq") == [(12,), (None,)]
    ledger.stage_usage(intent(1).operation_id, usage)
    ledger.flush()
    assert sql(path, "SELECT total_tokens FROM receipts ORDER BY seq") == [(12,), (12,)]
    assert ledger.staged == 0


def test_recovery_closes_only_the_rows_of_dead_incarnations(path: Path) -> None:
    alive, dead = ReceiptLedger(path), ReceiptLedger(path)
    alive_id, dead_id = alive.begin_incarnation(), dead.begin_incarnation()
    alive.open(intent(0))
    dead.open(intent(1))
    dead.stage_usage(
        intent(1).operation_id,
        TokenUsage(
            input_tokens=3, cached_input_tokens=0, output_tokens=4, reasoning_output_tokens=0, total_tokens=7
        ),
    )
    dead.flush()
    with ReceiptLedger(path) as third:
        third_id = third.begin_incarnation()
        assert third.recover(now_ms=1_700_000_000_000) == ()  # both hold their locks: both alive
        dead.close()  # what the kernel does to a killed process: its lock goes, its row stays open
        (recovered,) = third.recover(now_ms=1_700_000_000_000)
        assert third.recover() == ()  # once only
        assert recovered == third.get(intent(1).operation_id)
    assert recovered.status == "interrupted" and recovered.receipt_id == "rcpt-1"
    assert recovered.usage is not None and recovered.usage.total_tokens == 7  # what was streamed so far
    assert recovered.duration_ms == 1_700_000_000_000 - intent(1).started_at_ms
    assert sql(path, "SELECT operation_id, status FROM receipts ORDER BY seq") == [
        (str(intent(0).operation_id), "open"),
        (str(intent(1).operation_id), "interrupted"),
    ]
    assert sql(path, "SELECT id, ended, recovered_by FROM incarnations ORDER BY rowid") == [
        (alive_id, None, None),
        (dead_id, "recovered", third_id),
        (third_id, "stopped", None),
    ]
    alive.record(receipt(0))
    alive.close()
    assert sql(path, "SELECT ended FROM incarnations WHERE id = ?", alive_id) == [("stopped",)]
    assert sorted(p.name for p in alive.lock_dir.iterdir()) == []  # every lock file cleaned up


def test_recovery_prices_what_it_recovers(path: Path) -> None:
    """Also: closing a ledger with an open row only releases it, like a crash (the row stays open)."""
    with ReceiptLedger(path) as dead:
        dead.begin_incarnation()
        dead.open(intent())
        dead.stage_usage(intent().operation_id, receipt().usage)  # type: ignore[arg-type]
        dead.flush()
    with ReceiptLedger(path) as later:
        later.begin_incarnation()
        (recovered,) = later.recover(price=lambda model, usage: 0.5 if model == "gpt-4.1" else None)
    assert recovered.cost_usd == 0.5


V1_SCHEMA = """
CREATE TABLE receipts (
    seq INTEGER PRIMARY KEY,
    operation_id TEXT NOT NULL UNIQUE,
    receipt_id TEXT NOT NULL UNIQUE,
    parent_operation_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    provider TEXT NOT NULL,
    provider_model TEXT NOT NULL,
    model TEXT NOT NULL,
    round INTEGER,
    status TEXT NOT NULL,
    input_tokens INTEGER,
    cached_input_tokens INTEGER,
    output_tokens INTEGER,
    reasoning_output_tokens INTEGER,
    total_tokens INTEGER,
    issued_at_ms INTEGER NOT NULL,
    started_at_ms INTEGER NOT NULL,
    duration_ms INTEGER NOT NULL,
    cost_usd REAL,
    error TEXT,
    CHECK ((input_tokens IS NULL) = (total_tokens IS NULL))
);
CREATE INDEX receipts_by_parent ON receipts (parent_operation_id, issued_at_ms, seq);
PRAGMA user_version = 1;
"""


def test_a_version_1_ledger_is_migrated_in_place(path: Path) -> None:
    path.parent.mkdir(parents=True)
    conn = sqlite3.connect(path)
    conn.executescript(V1_SCHEMA)
    old = [receipt(0), receipt(1, usage=None, cost_usd=None, error="boom", status="failed"), receipt(2)]
    columns = (
        "operation_id, receipt_id, parent_operation_id, user_id, provider, provider_model, model, "
        "round, status, input_tokens, cached_input_tokens, output_tokens, reasoning_output_tokens, "
        "total_tokens, issued_at_ms, started_at_ms, duration_ms, cost_usd, error"
    )
    for r in old:
        u = r.usage
        usage = (
            (None,) * 5
            if u is None
            else (
                u.input_tokens,
                u.cached_input_tokens,
                u.output_tokens,
                u.reasoning_output_tokens,
                u.total_tokens,
            )
        )
        conn.execute(
            f"INSERT INTO receipts ({columns}) VALUES ({', '.join('?' * 19)})",
            (
                str(r.operation_id),
                r.receipt_id,
                str(r.parent_operation_id),
                r.user_id,
                r.provider.value,
                r.provider_model,
                r.model,
                r.round,
                r.status,
                *usage,
                r.issued_at_ms,
                r.started_at_ms,
                r.duration_ms,
                r.cost_usd,
                r.error,
            ),
        )
    conn.commit()
    conn.close()
    with ReceiptLedger(path) as ledger:
        assert [ledger.get(r.operation_id) for r in old] == old
        assert ledger.for_parent(PARENT) == tuple(old)
        ledger.begin_incarnation()
        ledger.open(intent(7))  # the migrated table takes open rows
        assert ledger.record(receipt(7)) == receipt(7)
        assert ledger.record(receipt(0, status="failed", receipt_id="rcpt-again")) == old[0]  # exactly once
    assert sql(path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    assert sql(path, "SELECT seq, receipt_id FROM receipts ORDER BY seq") == [
        (1, "rcpt-0"),
        (2, "rcpt-1"),
        (3, "rcpt-2"),
        (4, "rcpt-7"),
    ]
    assert [r[0] for r in sql(path, "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")] == [
        "incarnations",
        "receipts",
    ]
