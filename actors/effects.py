"""The one effect store: every host that runs tools runs each effect at most once per idempotency key.

``EffectStore`` keeps one row per key in SQLite (WAL, ``synchronous=FULL``): the *intent* (the call's
summary, when it started, the host incarnation that started it) is committed before the effect runs, the
*outcome* (a wire message, or the error the host raised) after it, before anyone hears it. ``EffectRunner``
is the host side, shared by the conversation's ``ToolHostActor``, ``run_session``'s ``HostActor`` and the
subagent's ``RunHostActor``; for each call it does one of:

- a key with an outcome: the stored outcome is the answer (an error outcome is raised again); the effect
  does not run again;
- a key that is running in this host: the call waits for that one run and gets its outcome;
- a key with an intent and no outcome (the host died while it ran, or its outcome could not be stored):
  "outcome unknown", in the host's own outcome type, and the effect does not run again, unless the host says
  the call is safe to rerun (then its intent is renewed and it runs);
- a new key: intent committed, then the effect runs;
- a store that cannot be written (disk full, read-only, no such folder): ``EffectStoreError``, and the
  effect does not run.

An empty key runs the effect unprotected. Without a file the rows live in a dict, by the same rules
(``_decide``), bounded to the newest ``memory_keys`` finished keys (a claim and a settle cost about 4 us
here, against 12 in an in-memory SQLite database). With a file, one connection, opened on the host actor's
thread on first use (sqlite connections are thread-bound).
"""

from __future__ import annotations

import concurrent.futures
import logging
import sqlite3
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Final, TypeAlias

from actors.base import DEFER, BusActor, Context
from actors.errors import Broken
from actors.types import ToolCall, ToolCallError
from transport.errors import BusError
from transport.messages import ErrorReply, Ok
from transport.records import frozen

log = logging.getLogger(__name__)

__all__ = [
    "EFFECT_ERRORS",
    "MEMORY_KEYS",
    "Done",
    "EffectRecord",
    "EffectRunner",
    "EffectStore",
    "EffectStoreError",
    "RerunSafe",
    "Run",
    "Unknown",
    "idempotency_key",
    "rerun_rule",
    "unknown_text",
]

MEMORY_KEYS: Final = 10_000  # finished keys an in-memory store remembers
BUSY_TIMEOUT: Final = 10.0  # how long a write waits for another connection's lock before it fails

_SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    key TEXT PRIMARY KEY,
    summary TEXT NOT NULL,
    started_at REAL NOT NULL,
    incarnation TEXT NOT NULL,
    runs INTEGER NOT NULL,
    finished_at REAL,
    tag TEXT,
    outcome BLOB
)
"""
_COLUMNS = "key, summary, started_at, incarnation, runs, finished_at, tag, outcome"


def idempotency_key(*parts: object) -> str:
    """The one key format: the parts that name an effect (e.g. operation id, round, call id; never an
    attempt number), ``:``-joined; a ``:`` or ``\\`` inside a part is escaped, so distinct parts never
    give one key."""
    return ":".join(str(p).replace("\\", "\\\\").replace(":", "\\:") for p in parts)


class EffectStoreError(Broken):
    """The effect store cannot be written (disk full, read-only, unopenable): the effect was not run,
    so the same call may be sent again once the store is writable."""

    WIRE = "effects.store"


EFFECT_ERRORS: tuple[type[BusError], ...] = (EffectStoreError,)


@frozen
class EffectRecord:
    """One key's row: its intent, and its outcome once settled (``tag`` is the outcome's message tag)."""

    key: str
    summary: str
    started_at: float
    incarnation: str
    runs: int
    finished_at: float | None = None
    tag: str | None = None
    outcome: bytes | None = None

    @property
    def settled(self) -> bool:
        return self.tag is not None


@frozen
class Run:
    """The intent is durable: run the effect now. ``rerun``: an earlier run's outcome is unknown."""

    rerun: bool = False


@frozen
class Done:
    """The key has an outcome: answer it, do not run the effect."""

    record: EffectRecord


@frozen
class Unknown:
    """The key has an intent and no outcome, and may not run again: its outcome is unknown."""

    record: EffectRecord


Claim: TypeAlias = Run | Done | Unknown


class EffectStore:
    """Intent and outcome rows by idempotency key; see the module docstring."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        incarnation: str | None = None,
        clock: Callable[[], float] = time.time,
        memory_keys: int = MEMORY_KEYS,
        busy_timeout: float = BUSY_TIMEOUT,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.incarnation = incarnation or uuid.uuid4().hex
        self._clock = clock
        self._memory_keys = memory_keys
        self._busy_timeout = busy_timeout
        self._db: sqlite3.Connection | None = None
        # Without a file: the rows, and the finished keys oldest first (what the bound forgets first).
        self._rows: dict[str, EffectRecord] = {}
        self._finished: dict[str, None] = {}

    def __repr__(self) -> str:
        return f"EffectStore({str(self.path) if self.path else ':memory:'!r})"

    # ------------------------------------------------------------------------------------ api
    def claim(self, key: str, summary: str, *, rerun_safe: bool = False) -> Claim:
        """Decide what a call with ``key`` does, committing its intent first when it is to run."""
        now = self._clock()
        if self.path is None:
            record = self._rows.get(key)
            claim = _decide(record, rerun_safe)
            if isinstance(claim, Run):
                runs = 1 if record is None else record.runs + 1
                self._rows[key] = EffectRecord(key, summary, now, self.incarnation, runs)
            return claim
        with self._writing("record the intent of", summary) as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute(f"SELECT {_COLUMNS} FROM effects WHERE key = ?", (key,)).fetchone()
            claim = _decide(None if row is None else _record(row), rerun_safe)
            if row is None:
                db.execute(
                    "INSERT INTO effects (key, summary, started_at, incarnation, runs) "
                    "VALUES (?, ?, ?, ?, 1)",
                    (key, summary, now, self.incarnation),
                )
            elif isinstance(claim, Run):
                db.execute(
                    "UPDATE effects SET summary = ?, started_at = ?, incarnation = ?, runs = runs + 1 "
                    "WHERE key = ?",
                    (summary, now, self.incarnation, key),
                )
            db.execute("COMMIT")
        return claim

    def settle(self, key: str, tag: str, outcome: bytes) -> None:
        """Store the outcome of a claimed key (the first outcome of a key stays)."""
        if self.path is None:
            record = self._rows.get(key)
            if record is not None and record.tag is None:
                r = record  # positional: dataclasses.replace walks the fields, on every tool call
                self._rows[key] = EffectRecord(
                    key, r.summary, r.started_at, r.incarnation, r.runs, self._clock(), tag, outcome
                )
                self._finished[key] = None
                self._forget_old()
            return
        with self._writing("store the outcome of", key) as db:
            db.execute(
                "UPDATE effects SET tag = ?, outcome = ?, finished_at = ? WHERE key = ? AND tag IS NULL",
                (tag, outcome, self._clock(), key),
            )

    def lookup(self, key: str) -> EffectRecord | None:
        if self.path is None:
            return self._rows.get(key)
        with self._writing("read", key) as db:
            row = db.execute(f"SELECT {_COLUMNS} FROM effects WHERE key = ?", (key,)).fetchone()
        return None if row is None else _record(row)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # ------------------------------------------------------------------------------- plumbing
    def _writing(self, doing: str, what: str) -> _Writing:
        return _Writing(self, doing, what)

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            assert self.path is not None  # without a file the rows are a dict: no connection
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=self._busy_timeout, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")
                db.execute(_SCHEMA)
            except BaseException:
                db.close()
                raise
            self._db = db
        return self._db

    def _forget_old(self) -> None:
        """In memory only: keep the newest ``memory_keys`` finished keys (the caches stay bounded)."""
        finished = self._finished
        if len(finished) <= self._memory_keys + max(1, self._memory_keys // 10):
            return
        while len(finished) > self._memory_keys:
            key = next(iter(finished))
            del finished[key]
            del self._rows[key]


class _Writing:
    """One store operation: sqlite and OS failures become ``EffectStoreError`` (an open transaction is
    rolled back, a broken connection dropped so the next call opens a fresh one)."""

    __slots__ = ("_doing", "_store", "_what")

    def __init__(self, store: EffectStore, doing: str, what: str) -> None:
        self._store, self._doing, self._what = store, doing, what

    def __enter__(self) -> sqlite3.Connection:
        try:
            return self._store._conn()
        except (sqlite3.Error, OSError) as exc:
            raise self._error(exc) from exc

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            return
        db = self._store._db
        if db is not None and db.in_transaction:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                self._store.close()
        if isinstance(exc, sqlite3.Error | OSError):
            raise self._error(exc) from exc

    def _error(self, exc: BaseException) -> EffectStoreError:
        where = self._store.path or ":memory:"
        return EffectStoreError(f"the effect store {where} cannot {self._doing} {self._what[:80]}: {exc}")


def _decide(record: EffectRecord | None, rerun_safe: bool) -> Claim:
    """What a call does given its key's row (None: a new key); the store writes what a ``Run`` needs."""
    if record is None:
        return Run()
    if record.settled:
        return Done(record)
    if rerun_safe:
        return Run(rerun=True)
    return Unknown(record)


def _record(row: tuple[Any, ...]) -> EffectRecord:
    key, summary, started, incarnation, runs, finished, tag, outcome = row
    return EffectRecord(
        key=key,
        summary=summary,
        started_at=float(started),
        incarnation=incarnation,
        runs=int(runs),
        finished_at=None if finished is None else float(finished),
        tag=tag,
        outcome=None if outcome is None else bytes(outcome),
    )


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))


def unknown_text(record: EffectRecord) -> str:
    """What a caller (and the model) is told about a call whose outcome is unknown."""
    return (
        f"outcome unknown: {record.summary} started at {_when(record.started_at)} and its host stopped "
        "before it finished; it may or may not have taken effect, and it was not run again"
    )


def lost_text(summary: str, exc: BaseException) -> str:
    """The answer for a call that ran but whose outcome could not be stored: unknown from now on."""
    return (
        f"outcome unknown: {summary} ran, but its outcome could not be stored ({exc}); "
        "it will not be run again"
    )


# ------------------------------------------------------------------------------------------------ hosts

# A host's ``rerun_safe`` option: a predicate on the call, or the names of the rerun-safe tools.
RerunSafe: TypeAlias = Callable[[ToolCall], bool] | Collection[str]


def rerun_rule(spec: RerunSafe) -> Callable[[ToolCall | ToolCallError], bool]:
    """A host's ``rerun_safe`` option as one predicate; an invalid call (``ToolCallError``) is never
    rerun-safe (the host decides what it does)."""
    if isinstance(spec, str):
        raise TypeError("rerun_safe takes a predicate or a collection of tool names, not one string")
    if callable(spec):
        predicate = spec
        return lambda call: isinstance(call, ToolCall) and bool(predicate(call))
    names = frozenset(spec)
    return lambda call: isinstance(call, ToolCall) and call.name in names


class EffectRunner:
    """One host actor's effects, run at most once per idempotency key; used on that actor's thread only.

    ``unknown(text)`` builds the host's own "outcome unknown" answer (``ToolExecution``,
    ``SessionToolOutcome`` or ``ToolOutcome`` with ``unknown=True``). Duplicates of a running key wait for
    it in memory; everything else is read from the store, the only truth, so memory stays bounded by the
    calls running at once.
    """

    def __init__(self, actor: BusActor, store: EffectStore, unknown: Callable[[str], Any]) -> None:
        self._actor = actor
        self.store = store
        self._unknown = unknown
        self._running: dict[str, list[Context]] = {}  # key -> the contexts waiting for its one run

    def execute(
        self, ctx: Context, key: str, summary: str, start: Callable[[], Any], *, rerun_safe: bool = False
    ) -> Any:
        """Answer ``ctx`` for the effect ``start()`` (which may return a value or a future of it): the
        handler's return value (a reply, or ``DEFER``); raises ``EffectStoreError`` before running it
        when its intent cannot be stored, or the stored error of an earlier run."""
        if not key:
            return self._actor.answer_when_done(start(), ctx)
        waiting = self._running.get(key)
        if waiting is not None:
            waiting.append(ctx)
            return DEFER
        match self.store.claim(key, summary, rerun_safe=rerun_safe):
            case Done(record=record):
                return self._replay(record)
            case Unknown(record=record):
                return self._unknown(unknown_text(record))
        self._running[key] = [ctx]
        try:
            result = start()
        except Exception as exc:  # noqa: BLE001 - the host's own failure is the effect's outcome
            self._finish(key, summary, None, exc)
            return DEFER
        except BaseException:
            self._running.pop(key, None)
            raise
        if isinstance(result, concurrent.futures.Future):
            return self._actor.answer_when_done(
                result, ctx, lambda value, error: self._finish(key, summary, value, error)
            )
        self._finish(key, summary, result, None)
        return DEFER

    def close(self) -> None:
        self.store.close()

    def _replay(self, record: EffectRecord) -> Any:
        registry = self._actor.node.registry
        assert record.tag is not None and record.outcome is not None
        value = registry.decode(record.tag, record.outcome)
        if isinstance(value, ErrorReply):
            raise registry.rebuild_error(value)
        return value

    def _finish(self, key: str, summary: str, value: Any, error: BaseException | None) -> None:
        """The outcome is stored before anyone hears it; if it cannot be, everyone waiting hears "outcome
        unknown" (what the store says about the key from now on)."""
        registry = self._actor.node.registry
        waiting = self._running.pop(key, [])
        if error is None and value is None:
            value = Ok()
        body = b""
        if error is None:
            try:
                body = registry.encode(value)
            except (TypeError, BusError) as exc:
                kind = type(value).__name__
                error = TypeError(f"{summary}: the host answered {kind}, not a wire message: {exc}")
        if error is not None:
            if not isinstance(error, BusError):
                log.error("%s: %s failed", self._actor.address, summary, exc_info=error)
            tag, body = ErrorReply.TAG, registry.encode(registry.error_reply(error))
        else:
            tag = registry.tag_of(value)
        try:
            self.store.settle(key, tag, body)
        except EffectStoreError as exc:
            log.error("%s: %s ran but its outcome is lost: %s", self._actor.address, summary, exc)
            value, error = self._unknown(lost_text(summary, exc)), None
        for ctx in waiting:
            if ctx.done:
                continue
            if error is not None:
                ctx.fail(error)
            else:
                ctx.reply(value)
