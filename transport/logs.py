"""Log lines that hostile input can repeat, rate-limited and summarised instead of written per frame.

``LogLimiter.log(logger, level, key, message, *args)`` writes the first line of a ``key`` in each
``interval`` and counts the rest; the next line written for that key (or ``flush()``, at node stop) says how
many were left out. Every line is cut to ``MAX_LOG_LINE`` characters (a traceback to ``MAX_TRACEBACK``),
its original size noted, so one oversized error never makes a multi-megabyte line. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from transport.errors import cut_text

MAX_LOG_LINE = 1000
MAX_TRACEBACK = 6000
DEFAULT_INTERVAL = 10.0
MAX_KEYS = 1024  # kinds of line tracked at once; past it the oldest is forgotten (its count summarised)


@dataclass(slots=True)
class _Window:
    logger: logging.Logger
    level: int
    started: float
    left_out: int = 0
    text: str = ""


class LogLimiter:
    """See the module docstring. ``monotonic`` is injectable for tests."""

    def __init__(
        self,
        interval: float = DEFAULT_INTERVAL,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self.interval = interval
        self._monotonic = monotonic
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._windows: dict[Hashable, _Window] = {}
        self.left_out = 0  # lines counted instead of written, in all

    def log(
        self,
        logger: logging.Logger,
        level: int,
        key: Hashable,
        message: str,
        *args: object,
        exc: BaseException | None = None,
    ) -> bool:
        """Write ``message % args`` (cut) unless a line of ``key`` was written less than ``interval`` ago;
        ``exc`` adds its traceback (cut). True when written."""
        if not logger.isEnabledFor(level):
            return False
        now = self._monotonic()
        evicted: _Window | None = None
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window.started < self.interval:
                window.left_out += 1
                self.left_out += 1
                return False
            left_out = window.left_out if window is not None else 0
            since = now - window.started if window is not None else 0.0
            text = _cut_line(message, args)
            self._windows.pop(key, None)
            self._windows[key] = _Window(logger, level, now, 0, text)
            if len(self._windows) > self._max_keys:
                evicted = self._windows.pop(next(iter(self._windows)))
        if evicted is not None and evicted.left_out:
            _summary(evicted, self._monotonic() - evicted.started)
        if left_out:
            text += f" (and {left_out} more like it in the last {since:.0f}s)"
        if exc is not None:
            trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            text += "\n" + cut_text(trace, MAX_TRACEBACK)
        logger.log(level, "%s", text)
        return True

    def flush(self) -> None:
        """Write one summary line for every key with lines left out, and forget them all."""
        now = self._monotonic()
        with self._lock:
            windows, self._windows = list(self._windows.values()), {}
        for window in windows:
            if window.left_out:
                _summary(window, now - window.started)


def _cut_line(message: str, args: tuple[object, ...]) -> str:
    # Arguments are cut one by one first, so a huge one never gets formatted whole.
    cut_args = tuple(a if isinstance(a, int | float) else cut_text(str(a), MAX_LOG_LINE) for a in args)
    try:
        text = message % cut_args if cut_args else message
    except (TypeError, ValueError):
        text = f"{message} {cut_args!r}"
    return cut_text(text, MAX_LOG_LINE)


def _summary(window: _Window, since: float) -> None:
    window.logger.log(
        window.level, "%s more like this in the last %.0fs: %s", window.left_out, since, window.text
    )
