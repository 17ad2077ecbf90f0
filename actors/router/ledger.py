"""The durable receipt ledger: one UsageReceipt per operation in SQLite, stored before it is reported."""

from __future__ import annotations

import sqlite3
import time
import uuid
from os import PathLike
from pathlib import Path
from types import TracebackType
from typing import Any, Final, cast, get_args

from actors.types import AgentProvider, ReceiptStatus, TokenUsage, UsageReceipt

SCHEMA_VERSION: Final = 1
BUSY_TIMEOUT_S: Final = 30.0  # another connection holding the write lock (a second process, a test)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS receipts (
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
    -- usage is all five token columns or none of them (a receipt without usage)
    CHECK ((input_tokens IS NULL) = (total_tokens IS NULL))
);
CREATE INDEX IF NOT EXISTS receipts_by_parent ON receipts (parent_operation_id, issued_at_ms, seq);
"""

_USAGE = ("input_tokens", "cached_input_tokens", "output_tokens", "reasoning_output_tokens", "total_tokens")
_COLUMNS = (
    "operation_id",
    "receipt_id",
    "parent_operation_id",
    "user_id",
    "provider",
    "provider_model",
    "model",
    "round",
    "status",
    *_USAGE,
    "issued_at_ms",
    "started_at_ms",
    "duration_ms",
    "cost_usd",
    "error",
)
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM receipts"
_INSERT = (
    f"INSERT INTO receipts ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
    "ON CONFLICT (operation_id) DO NOTHING"
)
_STATUSES: Final[frozenset[str]] = frozenset(get_args(ReceiptStatus))

_Row = tuple[Any, ...]  # a row as sqlite3 gives it back


def _row(r: UsageReceipt) -> _Row:
    u = r.usage
    usage = (
        (None,) * len(_USAGE)
        if u is None
        else (
            u.input_tokens,
            u.cached_input_tokens,
            u.output_tokens,
            u.reasoning_output_tokens,
            u.total_tokens,
        )
    )
    return (
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
    )


def _receipt(row: _Row) -> UsageReceipt:
    v = dict(zip(_COLUMNS, row, strict=True))
    status = v["status"]
    if status not in _STATUSES:
        raise ValueError(f"receipt ledger holds an unknown status {status!r}")
    usage = None if v["input_tokens"] is None else TokenUsage(**{n: int(v[n]) for n in _USAGE})
    return UsageReceipt(
        receipt_id=str(v["receipt_id"]),
        operation_id=uuid.UUID(str(v["operation_id"])),
        parent_operation_id=uuid.UUID(str(v["parent_operation_id"])),
        user_id=str(v["user_id"]),
        provider=AgentProvider(v["provider"]),
        provider_model=str(v["provider_model"]),
        model=str(v["model"]),
        round=None if v["round"] is None else int(v["round"]),
        status=cast(ReceiptStatus, status),  # checked above
        usage=usage,
        issued_at_ms=int(v["issued_at_ms"]),
        started_at_ms=int(v["started_at_ms"]),
        duration_ms=int(v["duration_ms"]),
        cost_usd=None if v["cost_usd"] is None else float(v["cost_usd"]),
        error=None if v["error"] is None else str(v["error"]),
    )


def _enable_wal(conn: sqlite3.Connection) -> str:
    """Switch the file to WAL (a no-op once it is); the journal mode SQLite reports back."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            (mode,) = conn.execute("PRAGMA journal_mode=WAL").fetchone()
            return str(mode)
        except sqlite3.OperationalError as exc:
            # Two connections switching a new file at once deadlock on the lock upgrade, and SQLite then
            # returns SQLITE_BUSY at once instead of calling the busy handler: wait here instead.
            if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


class ReceiptLedger:
    """Receipts keyed by operation: at most one per operation, never overwritten, durable once returned.

    Threading: the SQLite connection is opened lazily, on first use, in the thread that uses it, and stays
    bound to that thread (sqlite3's default check); the Router uses its ledger from its own actor thread only.
    Several ledgers (threads or processes) may share one file: the write lock plus the UNIQUE operation_id
    keep it to one receipt per operation. After ``close()`` the ledger is finished; open a new one to go on.
    """

    __slots__ = ("_closed", "_conn", "path")

    def __init__(self, path: str | PathLike[str]) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._closed = False

    def _connection(self) -> sqlite3.Connection:
        if self._closed:
            raise RuntimeError(f"receipt ledger {self.path} is closed")
        if self._conn is not None:
            return self._conn
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # isolation_level=None: no implicit transactions; each write is an explicit BEGIN IMMEDIATE..COMMIT.
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            mode = _enable_wal(conn)
            if mode != "wal":
                raise RuntimeError(f"receipt ledger {self.path}: no WAL journal here (got {mode!r})")
            # FULL: in WAL mode a commit is on disk when it returns; a reported receipt survives power loss.
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("BEGIN IMMEDIATE")
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            if version not in (0, SCHEMA_VERSION):
                raise RuntimeError(
                    f"receipt ledger {self.path} has schema version {version}, not {SCHEMA_VERSION}"
                )
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def record(self, receipt: UsageReceipt) -> UsageReceipt:
        """Store ``receipt`` unless its operation has one already; either way, return the stored receipt.

        Committed (fsync'd) before it returns. A receipt_id already used by another operation raises
        sqlite3.IntegrityError.
        """
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(_INSERT, _row(receipt))
            row = conn.execute(f"{_SELECT} WHERE operation_id = ?", (str(receipt.operation_id),)).fetchone()
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return _receipt(row)

    def get(self, operation_id: uuid.UUID) -> UsageReceipt | None:
        row = self._connection().execute(f"{_SELECT} WHERE operation_id = ?", (str(operation_id),)).fetchone()
        return None if row is None else _receipt(row)

    def for_parent(self, parent_operation_id: uuid.UUID) -> tuple[UsageReceipt, ...]:
        """The receipts of a parent operation's children, oldest issued first (ties in recording order)."""
        rows = self._connection().execute(
            f"{_SELECT} WHERE parent_operation_id = ? ORDER BY issued_at_ms, seq", (str(parent_operation_id),)
        )
        return tuple(_receipt(r) for r in rows)

    def count(self) -> int:
        (n,) = self._connection().execute("SELECT COUNT(*) FROM receipts").fetchone()
        return int(n)

    def close(self) -> None:
        """Close the connection (from the thread that used it); idempotent."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> ReceiptLedger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._conn is not None else "not yet opened"
        return f"ReceiptLedger({str(self.path)!r}, {state})"
