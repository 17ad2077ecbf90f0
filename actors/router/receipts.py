"""The durable intent and receipt ledger: one row per provider turn in SQLite, opened before the provider is
called and settled into the turn's one ``UsageReceipt`` (DESIGN.md 4a, "Intent ledger").

A row's life::

    open(intent)          status 'open': the turn was started, the provider may be running
      stage_usage / flush the usage streamed so far, kept on the open row
    record(receipt)       one UPDATE of the same row: status, usage, issue time, duration, cost, error
    recover()             a later Router finds the row 'open' and its Router dead: status 'interrupted'

Only settled rows are receipts: ``get``, ``for_parent`` and ``count`` never show an open row, and a
settled row is never changed again (at most one receipt per operation, the first one wins).

Incarnations. Every Router that opens rows first registers an *incarnation*: a row in ``incarnations``
(id, pid, start time) and an exclusive ``flock`` on its own file ``<ledger>.incarnations/<id>.lock``, held
for the Router's life. The kernel drops a flock when the last descriptor of it closes, so also when the
process is SIGKILLed: an incarnation is dead exactly when its lock can be taken. That is why a lock and
not a pid (a pid is reused, and two Routers of one process share it) nor a lease (a lease would make a
restarted Router wait for it to run out before it may close anything). SQLite in WAL mode only works for
processes on one machine (the WAL index is shared memory), so every sharer of a ledger can see the lock.
The lock descriptor is close-on-exec; a child forked *without* exec (multiprocessing's fork) would inherit
it and keep the incarnation alive until that child ends.

Usage policy. ``stage_usage`` only remembers the latest usage of an open row in memory; staged usage is
written with the ledger's next transaction (any ``open``, ``record`` or ``flush``), never on its own, so a
token stream costs no fsync per token. The Router flushes on its housekeeping tick (every ``tick_s``,
1 s by default) and before it reports a tool call, so a crash loses at most the usage reported since the
last of those; an interrupted receipt then carries the usage written before it (or none).

Group commit. ``with ledger.group():`` makes every write inside it (``open``, ``record``, ``flush``) one
transaction, committed with one fsync when the outermost group ends; each write is a savepoint in it, so
one that fails (a reused receipt id) rolls back alone and raises as it would outside a group. A write in a
group is *not* durable when its method returns: whoever would tell someone of it hands that telling to
``when_durable(callback)``, which runs the callback at once outside a group and after the group's commit
inside one (with the commit's error, if the commit failed: nothing of the group is then on disk). So many
records share an fsync and still nobody hears of one before it is durable.

Schema versions: 1 had settled receipts only; 2 adds open rows, the row's incarnation, who settled it and
the incarnations table. A version-1 file is migrated in place, in one transaction, when it is opened.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from os import PathLike
from pathlib import Path
from types import TracebackType
from typing import Any, Final, cast, get_args

from actors.types import AgentProvider, ReceiptStatus, TokenUsage, UsageReceipt
from transport.records import frozen

SCHEMA_VERSION: Final = 2
BUSY_TIMEOUT_S: Final = 30.0  # another connection holding the write lock (a second process, a test)
OPEN: Final = "open"  # the status of a row whose turn has not been settled yet (an intent, not a receipt)

_TABLE = """
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
    issued_at_ms INTEGER,
    started_at_ms INTEGER NOT NULL,
    duration_ms INTEGER,
    cost_usd REAL,
    error TEXT,
    incarnation TEXT,
    settled_by TEXT,
    -- usage is all five token columns or none of them (a receipt without usage)
    CHECK ((input_tokens IS NULL) = (total_tokens IS NULL)),
    -- an open row has no issue time and no duration yet; a receipt has both
    CHECK ((status = 'open') = (issued_at_ms IS NULL)),
    CHECK ((status = 'open') = (duration_ms IS NULL)),
    -- an open row always names the incarnation that opened it (recovery closes rows by incarnation)
    CHECK (status != 'open' OR incarnation IS NOT NULL)
)
"""
_INDEXES = (
    "CREATE INDEX IF NOT EXISTS receipts_by_parent ON receipts (parent_operation_id, issued_at_ms, seq)",
    "CREATE INDEX IF NOT EXISTS receipts_open ON receipts (incarnation) WHERE status = 'open'",
)
_INCARNATIONS = """
CREATE TABLE IF NOT EXISTS incarnations (
    id TEXT PRIMARY KEY,
    pid INTEGER NOT NULL,
    started_at_ms INTEGER NOT NULL,
    ended_at_ms INTEGER,
    ended TEXT CHECK (ended IN ('stopped', 'recovered')),
    recovered_by TEXT
)
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
_V1_COLUMNS = ", ".join(("seq", *_COLUMNS))  # version 1 had exactly these
_SETTLED = "status != 'open'"
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM receipts"
_INSERT = (
    f"INSERT INTO receipts ({', '.join(_COLUMNS)}, settled_by) "
    f"VALUES ({', '.join('?' * (len(_COLUMNS) + 1))}) ON CONFLICT (operation_id) DO NOTHING"
)
_SETTLE = (
    f"UPDATE receipts SET status = ?, {', '.join(f'{n} = ?' for n in _USAGE)}, issued_at_ms = ?, "
    "duration_ms = ?, cost_usd = ?, error = ?, settled_by = ? WHERE operation_id = ? AND status = 'open'"
)
_STAGE = (
    f"UPDATE receipts SET {', '.join(f'{n} = ?' for n in _USAGE)} WHERE operation_id = ? AND status = 'open'"
)
_OPEN = (
    "INSERT INTO receipts (operation_id, receipt_id, parent_operation_id, user_id, provider, provider_model, "
    "model, round, status, started_at_ms, incarnation) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'open', ?, ?)"
)
_STATUSES: Final[frozenset[str]] = frozenset(get_args(ReceiptStatus))

_Row = tuple[Any, ...]  # a row as sqlite3 gives it back
PriceOf = Callable[[str, TokenUsage], float | None]  # (catalog model id, usage) -> cost, for recovered rows
Durable = Callable[[BaseException | None], None]  # told None once a group's writes are on disk, else why not
Commit = Callable[[sqlite3.Connection], None]  # ends a write transaction; the default runs COMMIT


def commit(conn: sqlite3.Connection) -> None:
    """COMMIT the connection's transaction: with ``synchronous=FULL`` in WAL mode, on disk when it returns."""
    conn.execute("COMMIT")


@frozen
class Intent:
    """What the ledger knows of a turn before its provider is called (the open row)."""

    operation_id: uuid.UUID
    receipt_id: str  # allocated now: the receipt the turn settles into keeps this id
    parent_operation_id: uuid.UUID
    user_id: str
    provider: AgentProvider
    provider_model: str
    model: str
    round: int | None
    started_at_ms: int


def _usage_values(u: TokenUsage | None) -> tuple[int | None, ...]:
    if u is None:
        return (None,) * len(_USAGE)
    return (u.input_tokens, u.cached_input_tokens, u.output_tokens, u.reasoning_output_tokens, u.total_tokens)


def _usage_of(v: dict[str, Any]) -> TokenUsage | None:
    return None if v["input_tokens"] is None else TokenUsage(**{n: int(v[n]) for n in _USAGE})


def _row(r: UsageReceipt) -> _Row:
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
        *_usage_values(r.usage),
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
        usage=_usage_of(v),
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


def _migrate_v1(conn: sqlite3.Connection) -> None:
    """Version 1 -> 2 inside the caller's transaction: rebuild the table (its NOT NULL issue time and
    duration must allow open rows, which ALTER TABLE cannot change); every v1 row is a settled receipt."""
    conn.execute("ALTER TABLE receipts RENAME TO receipts_v1")
    conn.execute(_TABLE)
    conn.execute(f"INSERT INTO receipts ({_V1_COLUMNS}) SELECT {_V1_COLUMNS} FROM receipts_v1")
    conn.execute("DROP TABLE receipts_v1")  # its index goes with it


def _ms() -> int:
    return int(time.time() * 1000)


class ReceiptLedger:
    """Intents and receipts keyed by operation: at most one receipt per operation, never overwritten,
    durable once returned. See the module docstring for the row's life, incarnations and usage policy.

    Threading: the SQLite connection is opened lazily, on first use, in the thread that uses it, and stays
    bound to that thread (sqlite3's default check); the Router uses its ledger from its own actor thread only.
    Several ledgers (threads or processes) may share one file: the write lock plus the UNIQUE operation_id
    keep it to one receipt per operation. After ``close()`` the ledger is finished; open a new one to go on.
    """

    __slots__ = (
        "_closed",
        "_commit",
        "_conn",
        "_depth",
        "_lock_fd",
        "_savepoints",
        "_staged",
        "_waiting",
        "commits",
        "incarnation",
        "path",
    )

    def __init__(self, path: str | PathLike[str], *, commit: Commit = commit) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._staged: dict[uuid.UUID, TokenUsage] = {}
        self._lock_fd: int | None = None
        self._commit = commit
        self._depth = 0  # groups open (nested ones join the outermost)
        self._savepoints = 0
        self._waiting: list[Durable] = []  # told once the open group is committed
        self.commits = 0  # write transactions committed (a group counts once)
        self.incarnation: str | None = None

    @property
    def lock_dir(self) -> Path:
        """Where the incarnations' lock files live (one per live Router on this ledger)."""
        return self.path.with_name(self.path.name + ".incarnations")

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
            if version == 1:
                _migrate_v1(conn)
            elif version not in (0, SCHEMA_VERSION):
                raise RuntimeError(
                    f"receipt ledger {self.path} has schema version {version}, not {SCHEMA_VERSION}"
                )
            for statement in (_TABLE, *_INDEXES, _INCARNATIONS):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _write(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
        """One write: the staged usage first, then ``work``. Outside a group it is its own transaction,
        committed (fsync'd) on return; inside one, a savepoint of the group's transaction (see ``group``)."""
        conn = self._connection()
        if self._depth:
            if not conn.in_transaction:
                conn.execute("BEGIN IMMEDIATE")
            self._savepoints += 1
            name = f"w{self._savepoints}"
            conn.execute(f"SAVEPOINT {name}")
            try:
                result = self._apply(conn, work)
            except BaseException:
                conn.execute(f"ROLLBACK TO {name}")
                conn.execute(f"RELEASE {name}")
                raise
            conn.execute(f"RELEASE {name}")
            self._staged.clear()
            return result
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = self._apply(conn, work)
            self._commit(conn)
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self.commits += 1
        self._staged.clear()
        return result

    def _apply(self, conn: sqlite3.Connection, work: Callable[[sqlite3.Connection], Any]) -> Any:
        if self._staged:
            conn.executemany(_STAGE, [(*_usage_values(u), str(op)) for op, u in self._staged.items()])
        return work(conn)

    # ---------------------------------------------------------------------------------- group commit
    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Writes inside are one transaction, committed with one fsync as the outermost group ends; then
        every ``when_durable`` callback queued in it runs (see the module docstring). An exception out of
        the group rolls back what it wrote; the callbacks are then told that error."""
        self._depth += 1
        failure: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._end_group(failure)

    def _end_group(self, failure: BaseException | None) -> None:
        conn, waiting = self._conn, self._waiting
        self._waiting, self._savepoints = [], 0
        try:
            if conn is not None and conn.in_transaction:
                if failure is None:
                    try:
                        self._commit(conn)
                        self.commits += 1
                    except BaseException as exc:
                        failure = exc
                        raise
                    finally:
                        if conn.in_transaction:
                            conn.execute("ROLLBACK")
                else:
                    conn.execute("ROLLBACK")
        finally:
            for callback in waiting:
                callback(failure)

    def when_durable(self, callback: Durable) -> None:
        """``callback(None)`` once everything written so far is on disk: now outside a group, after its
        commit inside one (``callback(error)`` instead when that commit fails or the group raised)."""
        if self._depth:
            self._waiting.append(callback)
        else:
            callback(None)

    @property
    def in_group(self) -> bool:
        return self._depth > 0

    def _not_in_group(self, what: str) -> None:
        if self._depth:
            raise RuntimeError(f"receipt ledger {self.path}: {what}() commits on its own, not inside a group")

    # --------------------------------------------------------------------------------------- intents
    def begin_incarnation(self) -> str:
        """Register this ledger's owner as a live incarnation (see the module docstring); idempotent."""
        if self.incarnation is not None:
            return self.incarnation
        self._not_in_group("begin_incarnation")
        conn = self._connection()
        ident = uuid.uuid4().hex
        self.lock_dir.mkdir(mode=0o700, exist_ok=True)
        # Locked before the row exists: a row whose lock can be taken is always a dead incarnation's.
        fd = os.open(
            self.lock_dir / f"{ident}.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{os.getpid()}\n".encode())
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                "INSERT INTO incarnations (id, pid, started_at_ms) VALUES (?, ?, ?)",
                (ident, os.getpid(), _ms()),
            )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.lock_dir / f"{ident}.lock")
            raise
        self._lock_fd = fd
        self.incarnation = ident
        return ident

    def open(self, intent: Intent) -> None:
        """Record that ``intent``'s turn is about to call its provider (status 'open'); committed on return.
        Needs ``begin_incarnation`` first. An operation id seen before raises sqlite3.IntegrityError."""
        if self.incarnation is None:
            raise RuntimeError("ReceiptLedger.open needs begin_incarnation() first")
        incarnation = self.incarnation
        self._write(
            lambda conn: conn.execute(
                _OPEN,
                (
                    str(intent.operation_id),
                    intent.receipt_id,
                    str(intent.parent_operation_id),
                    intent.user_id,
                    intent.provider.value,
                    intent.provider_model,
                    intent.model,
                    intent.round,
                    intent.started_at_ms,
                    incarnation,
                ),
            )
        )

    def stage_usage(self, operation_id: uuid.UUID, usage: TokenUsage) -> None:
        """The usage an open turn has streamed so far; written with the next transaction (no fsync now)."""
        self._staged[operation_id] = usage

    @property
    def staged(self) -> int:
        """How many open rows have usage not yet written."""
        return len(self._staged)

    def flush(self) -> None:
        """Write the staged usage now (one transaction for all of it); nothing to do if none is staged."""
        if self._staged:
            self._write(lambda conn: None)

    # -------------------------------------------------------------------------------------- receipts
    def record(self, receipt: UsageReceipt) -> UsageReceipt:
        """Settle ``receipt``'s operation unless it has a receipt already; either way, return the stored one.

        An open row of the operation becomes the receipt in one UPDATE (its receipt id, ids, model and start
        time stay the intent's); without one the receipt is inserted. Committed (fsync'd) before it returns.
        A receipt_id already used by another operation raises sqlite3.IntegrityError.
        """
        if receipt.status not in _STATUSES:
            raise ValueError(f"not a receipt status: {receipt.status!r}")
        self._staged.pop(receipt.operation_id, None)  # the receipt's own usage supersedes it
        settled_by = self.incarnation
        op = str(receipt.operation_id)

        def settle(conn: sqlite3.Connection) -> _Row:
            cur = conn.execute(
                _SETTLE,
                (
                    receipt.status,
                    *_usage_values(receipt.usage),
                    receipt.issued_at_ms,
                    receipt.duration_ms,
                    receipt.cost_usd,
                    receipt.error,
                    settled_by,
                    op,
                ),
            )
            if cur.rowcount == 0:
                conn.execute(_INSERT, (*_row(receipt), settled_by))
            row: _Row = conn.execute(f"{_SELECT} WHERE operation_id = ?", (op,)).fetchone()
            return row

        return _receipt(self._write(settle))

    def get(self, operation_id: uuid.UUID) -> UsageReceipt | None:
        row = (
            self._connection()
            .execute(f"{_SELECT} WHERE operation_id = ? AND {_SETTLED}", (str(operation_id),))
            .fetchone()
        )
        return None if row is None else _receipt(row)

    def for_parent(self, parent_operation_id: uuid.UUID) -> tuple[UsageReceipt, ...]:
        """The receipts of a parent operation's children, oldest issued first (ties in recording order)."""
        rows = self._connection().execute(
            f"{_SELECT} WHERE parent_operation_id = ? AND {_SETTLED} ORDER BY issued_at_ms, seq",
            (str(parent_operation_id),),
        )
        return tuple(_receipt(r) for r in rows)

    def count(self) -> int:
        """How many receipts (settled rows) the ledger holds."""
        (n,) = self._connection().execute(f"SELECT COUNT(*) FROM receipts WHERE {_SETTLED}").fetchone()
        return int(n)

    def count_open(self) -> int:
        """How many rows are open (turns started and not yet settled), of any incarnation."""
        (n,) = self._connection().execute("SELECT COUNT(*) FROM receipts WHERE status = 'open'").fetchone()
        return int(n)

    # -------------------------------------------------------------------------------------- recovery
    def recover(self, *, now_ms: int | None = None, price: PriceOf | None = None) -> tuple[UsageReceipt, ...]:
        """Turn every open row of every *dead* incarnation into one 'interrupted' receipt (with the usage
        its row holds) and mark that incarnation recovered; live incarnations' rows are never touched.
        Returns the receipts written. Safe to run from several Routers at once (each row settles once)."""
        self._not_in_group("recover")  # it releases dead incarnations' locks after each commit
        conn = self._connection()
        mine = self.incarnation
        candidates = {
            str(r[0])
            for r in conn.execute(
                "SELECT id FROM incarnations WHERE ended_at_ms IS NULL "
                "UNION SELECT DISTINCT incarnation FROM receipts WHERE status = 'open'"
            )
        }
        candidates.discard(mine or "")
        written: list[UsageReceipt] = []
        for ident in sorted(candidates):
            dead, held = self._lock_if_dead(ident)
            if not dead:
                continue  # alive: its lock is held
            try:
                written.extend(
                    self._write(functools.partial(self._close_rows, ident=ident, now_ms=now_ms, price=price))
                )
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.lock_dir / f"{ident}.lock")
            finally:
                if held is not None:
                    os.close(held)
        return tuple(written)

    def _lock_if_dead(self, ident: str) -> tuple[bool, int | None]:
        """Whether incarnation ``ident`` is dead, and then the descriptor now holding its lock (None when
        its lock file is gone: it ended, or a recoverer finished with it)."""
        if not ident or "/" in ident or os.sep in ident:
            return True, None
        try:
            fd = os.open(self.lock_dir / f"{ident}.lock", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return True, None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False, None
        except BaseException:
            os.close(fd)
            raise
        return True, fd

    def _close_rows(
        self, conn: sqlite3.Connection, ident: str, now_ms: int | None, price: PriceOf | None
    ) -> list[UsageReceipt]:
        now = _ms() if now_ms is None else now_ms
        rows = conn.execute(
            f"{_SELECT} WHERE incarnation = ? AND status = 'open' ORDER BY seq", (ident,)
        ).fetchall()
        written: list[UsageReceipt] = []
        for row in rows:
            v = dict(zip(_COLUMNS, row, strict=True))
            usage = _usage_of(v)
            started = int(v["started_at_ms"])
            receipt = UsageReceipt(
                receipt_id=str(v["receipt_id"]),
                operation_id=uuid.UUID(str(v["operation_id"])),
                parent_operation_id=uuid.UUID(str(v["parent_operation_id"])),
                user_id=str(v["user_id"]),
                provider=AgentProvider(v["provider"]),
                provider_model=str(v["provider_model"]),
                model=str(v["model"]),
                round=None if v["round"] is None else int(v["round"]),
                status="interrupted",
                usage=usage,
                issued_at_ms=now,
                started_at_ms=started,
                duration_ms=max(0, now - started),
                cost_usd=price(str(v["model"]), usage) if price is not None and usage is not None else None,
                error=f"the Router running this turn ended without settling it (incarnation {ident})",
            )
            cur = conn.execute(
                _SETTLE,
                (
                    receipt.status,
                    *_usage_values(usage),
                    receipt.issued_at_ms,
                    receipt.duration_ms,
                    receipt.cost_usd,
                    receipt.error,
                    self.incarnation,
                    str(receipt.operation_id),
                ),
            )
            if cur.rowcount == 1:
                written.append(receipt)
        conn.execute(
            "UPDATE incarnations SET ended_at_ms = ?, ended = 'recovered', recovered_by = ? "
            "WHERE id = ? AND ended_at_ms IS NULL",
            (now, self.incarnation, ident),
        )
        return written

    # ------------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the connection (from the thread that used it) and release this incarnation; idempotent.

        Staged usage not yet written is dropped (``flush()`` first to keep it). An incarnation with no open
        rows left is marked stopped; one with open rows is only released, exactly as its process dying
        would release it, so the next Router on this ledger recovers those rows."""
        if self._closed:
            return
        if self._depth:
            raise RuntimeError(f"receipt ledger {self.path}: close() inside a group")
        self._closed = True
        conn, self._conn = self._conn, None
        fd, self._lock_fd = self._lock_fd, None
        try:
            if conn is not None and fd is not None and self.incarnation is not None:
                self._end(conn, self.incarnation)
        finally:
            if fd is not None:
                os.close(fd)
            if conn is not None:
                conn.close()

    def _end(self, conn: sqlite3.Connection, ident: str) -> None:
        self._staged.clear()
        conn.execute("BEGIN IMMEDIATE")
        try:
            (still_open,) = conn.execute(
                "SELECT COUNT(*) FROM receipts WHERE incarnation = ? AND status = 'open'", (ident,)
            ).fetchone()
            if not still_open:
                conn.execute(
                    "UPDATE incarnations SET ended_at_ms = ?, ended = 'stopped' "
                    "WHERE id = ? AND ended_at_ms IS NULL",
                    (_ms(), ident),
                )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        if not still_open:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lock_dir / f"{ident}.lock")

    def __enter__(self) -> ReceiptLedger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._conn is not None else "not yet opened"
        return f"ReceiptLedger({str(self.path)!r}, {state})"
