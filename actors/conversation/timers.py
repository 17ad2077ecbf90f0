"""The loops' clock and timer source (loops.py, wakeups.py, gatekeeper.py): injected, so tests run on a
manual clock; by default ``RecordedTimers``, wired to the replay seams (transport/replay.py).

The conversation's own mailbox messages (a timer fired, a wait for a person expired, a custom evaluator's
verdict) are recorded where the actor takes them (``conversation_mailbox``), so a replay tells them to the
actor at the same place among its deliveries and starts no timer or evaluator thread of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from actors.conversation.types import GoalVerdict
from transport.capture import pack_payload, unpack_payload
from transport.node import Node
from transport.replay import ReplayedMailbox, record_mailbox, recorded_clock, replaying

__all__ = [
    "Judged",
    "RealTimers",
    "RecordedTimers",
    "TimerFired",
    "Timers",
    "WaitExpired",
    "conversation_mailbox",
]


class Timers(Protocol):
    """The clock and timer source of the loops: ``now()`` in seconds (absolute: due times are journaled),
    ``call_later(delay, fn)`` runs ``fn`` once after ``delay`` seconds and returns a cancel function."""

    def now(self) -> float: ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]: ...


class RealTimers:
    """Wall-clock time and ``threading.Timer``s (daemon threads)."""

    def now(self) -> float:
        return time.time()

    def call_later(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]:
        timer = threading.Timer(max(0.0, delay), fn)
        timer.daemon = True
        timer.start()
        return timer.cancel


def _never() -> None:
    return None


class RecordedTimers(RealTimers):
    """``RealTimers`` through the replay seams of ``actor`` (the conversation's default): each ``now()`` is a
    ``recorded_clock`` reading, and on a replay (``replaying(node)``) ``call_later`` starts no timer, since
    the firing the timer told the actor is served from the log (``conversation_mailbox``)."""

    def __init__(self, node: Node, actor: str) -> None:
        self.node = node
        self.actor = actor

    def now(self) -> float:
        return recorded_clock(self.node, self.actor)

    def call_later(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]:
        if replaying(self.node):
            return _never
        return super().call_later(delay, fn)


@dataclass(frozen=True)
class TimerFired:
    """Told to the conversation actor (a local pykka message) when one of its timers fires."""

    seq: int


@dataclass(frozen=True)
class WaitExpired:
    """A wait for a person (``kind`` "ask" or "plan", under ``key``) ran past ``ask_timeout``."""

    kind: str
    key: str


@dataclass(frozen=True)
class Judged:
    """A custom goal evaluator's verdict (or failure), from the thread it ran on."""

    seq: int
    verdict: GoalVerdict | BaseException


def _encode(message: Any) -> bytes | None:
    row: list[Any]
    match message:
        case TimerFired(seq=seq):
            row = ["conv.timer", seq]
        case WaitExpired(kind=kind, key=key):
            row = ["conv.expired", kind, key]
        case Judged(seq=seq, verdict=GoalVerdict() as v):
            row = ["conv.judged", seq, [v.achieved, v.reason, v.impossible], None]
        case Judged(seq=seq, verdict=error):
            row = ["conv.judged", seq, None, [type(error).__name__, str(error)]]
        case _:
            return None
    return pack_payload(row)


def _decode(payload: bytes) -> Any:
    row = unpack_payload(payload)
    kind = row[0]
    if kind == "conv.timer":
        return TimerFired(int(row[1]))
    if kind == "conv.expired":
        return WaitExpired(str(row[1]), str(row[2]))
    if kind == "conv.judged":
        if row[2] is not None:
            achieved, reason, impossible = row[2]
            return Judged(int(row[1]), GoalVerdict(achieved=achieved, reason=reason, impossible=impossible))
        name, text = row[3]
        return Judged(int(row[1]), type(name, (Exception,), {})(text))  # same name and text as recorded
    raise ValueError(f"not a conversation mailbox record: {kind!r}")


def conversation_mailbox(node: Node, actor: str, message: Any) -> Any:
    """The message the conversation ``actor`` takes from its own mailbox: a ``ReplayedMailbox`` decoded back
    into what was recorded; one of its own (``TimerFired``, ``WaitExpired``, ``Judged``) recorded first
    when ``node`` captures (``record_mailbox``); anything else unchanged."""
    if isinstance(message, ReplayedMailbox):
        return _decode(message.payload)
    if node.capture is not None:
        payload = _encode(message)
        if payload is not None:
            record_mailbox(node, actor, payload)
    return message
