"""Test doubles of the conversation loops (RULES.md conventions): ``ManualClock`` and ``FakeEvaluator``."""

from __future__ import annotations

import concurrent.futures
import os
import select
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from actors.conversation.types import GoalVerdict, Message

WAIT = 10.0


class ManualClock:
    """A ``loops.Timers`` whose time moves only by ``advance``: due timers fire in the advancing thread (a
    timer already due when set fires at once). ``wait_timer`` blocks (bounded) until a timer is pending."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._cond = threading.Condition()
        self.set_delays: list[float] = []

    def now(self) -> float:
        with self._cond:
            return self._now

    def call_later(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]:
        with self._cond:
            self._seq += 1
            seq = self._seq
            self.set_delays.append(delay)
            if delay <= 0:
                fire_now = True
            else:
                fire_now = False
                self._timers.append((self._now + delay, seq, fn))
                self._cond.notify_all()
        if fire_now:
            fn()

        def cancel() -> None:
            with self._cond:
                self._timers = [t for t in self._timers if t[1] != seq]

        return cancel

    def pending(self) -> int:
        with self._cond:
            return len(self._timers)

    def wait_timer(self, count: int = 1, timeout: float = WAIT) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._timers) >= count, timeout):
                raise AssertionError("no timer was set")

    def advance(self, seconds: float) -> None:
        with self._cond:
            self._now += seconds
            due = sorted(t for t in self._timers if t[0] <= self._now)
            self._timers = [t for t in self._timers if t[0] > self._now]
        for _, _, fn in due:
            fn()


class FakeEvaluator:
    """Returns the scripted verdicts in order (an exception in the list is raised); records each call.
    ``hold`` (an Event) makes each call wait until it is set; ``entered`` is set when a call started."""

    def __init__(self, *verdicts: GoalVerdict | BaseException, hold: threading.Event | None = None) -> None:
        self.verdicts = list(verdicts)
        self.calls: list[tuple[str, tuple[Message, ...]]] = []
        self.hold = hold
        self.entered = threading.Event()

    def evaluate(
        self, condition: str, transcript_tail: Sequence[Message]
    ) -> GoalVerdict | concurrent.futures.Future[GoalVerdict]:
        self.calls.append((condition, tuple(transcript_tail)))
        self.entered.set()
        if self.hold is not None and not self.hold.wait(WAIT):
            raise TimeoutError("the evaluator was never released")
        verdict = self.verdicts.pop(0) if self.verdicts else GoalVerdict(achieved=False, reason="no")
        if isinstance(verdict, BaseException):
            raise verdict
        return verdict


def no(reason: str = "not yet") -> GoalVerdict:
    return GoalVerdict(achieved=False, reason=reason)


def yes(reason: str = "done") -> GoalVerdict:
    return GoalVerdict(achieved=True, reason=reason)


def kinds(events: Sequence[Any]) -> list[str]:
    return [type(e).__name__ for e in events]


WAIT_PID = 10.0


def read_pid(fd: int) -> int:
    """The pid the job writes into the fifo open at ``fd`` (a bounded wait on the pipe, no polling)."""
    try:
        data = b""
        while not data.endswith(b"\n"):
            ready, _, _ = select.select([fd], [], [], WAIT_PID)
            assert ready, "the job never wrote its child's pid"
            chunk = os.read(fd, 64)
            assert chunk or data, "the fifo closed empty"
            data += chunk
        return int(data)
    finally:
        os.close(fd)


def gone(pid: int) -> bool:
    """No such process, or a zombie (killed, not yet reaped by its new parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")
