"""Durable tool outcomes by idempotency key, for a host whose process may die mid-session.

A host records the outcome of each finished tool effect under its idempotency key (operation, round,
call id) before answering; a rerun asking for the same key gets the stored outcome and the effect does not
run again. SQLite (WAL, synchronous=FULL) in a file the host names; one connection, on the host actor's
thread (sqlite connections are thread-bound).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


class OutcomeStore:
    """key -> encoded outcome bytes; ``put`` keeps the first outcome of a key (an effect runs once)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("CREATE TABLE IF NOT EXISTS outcomes (key TEXT PRIMARY KEY, outcome BLOB NOT NULL)")
            self._db = db
        return self._db

    def get(self, key: str) -> bytes | None:
        row = self._conn().execute("SELECT outcome FROM outcomes WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def put(self, key: str, outcome: bytes) -> None:
        self._conn().execute(
            "INSERT INTO outcomes (key, outcome) VALUES (?, ?) ON CONFLICT DO NOTHING", (key, outcome)
        )

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
