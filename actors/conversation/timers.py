"""The loops' clock and timer source (loops.py, wakeups.py): injected, so tests run on a manual clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["RealTimers", "TimerFired", "Timers"]


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


@dataclass(frozen=True)
class TimerFired:
    """Told to the conversation actor (a local pykka message) when one of its timers fires."""

    seq: int
