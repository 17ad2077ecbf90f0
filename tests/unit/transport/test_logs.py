"""Issue 18 item 6: log lines hostile input can repeat are rate-limited and summarised, and cut in size."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from actors.app.echo import EchoActor
from transport import HandlerError, Node
from transport.logs import MAX_LOG_LINE, MAX_TRACEBACK, LogLimiter
from transport.messages import Echo, Fail

WAIT = 10.0
log = logging.getLogger("test.logs")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def messages(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_one_line_per_key_and_interval_then_a_count_of_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test.logs")
    clock = Clock()
    limiter = LogLimiter(10.0, monotonic=clock)
    for i in range(100):
        limiter.log(log, logging.WARNING, "a", "dropped frame %d", i)
    limiter.log(log, logging.WARNING, "b", "another kind")
    assert messages(caplog, "test.logs") == ["dropped frame 0", "another kind"]
    clock.t += 10.0
    limiter.log(log, logging.WARNING, "a", "dropped frame %d", 100)
    assert messages(caplog, "test.logs")[-1] == "dropped frame 100 (and 99 more like it in the last 10s)"
    for i in range(5):
        limiter.log(log, logging.WARNING, "a", "dropped frame %d", 101 + i)
    clock.t += 3.0
    limiter.flush()
    assert messages(caplog, "test.logs")[-1] == "5 more like this in the last 3s: dropped frame 100"
    assert limiter.left_out == 104


def test_an_oversized_line_and_traceback_are_cut_with_their_size_noted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="test.logs")
    limiter = LogLimiter()
    try:
        raise ValueError("v" * 3_000_000)
    except ValueError as exc:
        limiter.log(
            log, logging.ERROR, "k", "handler raised %r and %r", "x" * 3_000_000, "y" * 3_000, exc=exc
        )
    (line,) = messages(caplog, "test.logs")
    first, _, trace = line.partition("\n")
    assert len(first) < MAX_LOG_LINE + 60 and "characters in all]" in first
    assert len(trace) < MAX_TRACEBACK + 60 and "characters in all]" in trace
    assert trace.startswith("Traceback")


def test_a_thousand_handler_bugs_make_one_error_line_and_a_summary(
    make_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    """It used to be an ERROR with a full traceback per frame."""
    caplog.set_level(logging.INFO, logger="actors.base")
    clock = Clock()
    node = make_node("n1", monotonic=clock)
    node.spawn(EchoActor, "echo")
    futures = [node.request_future("n1/echo", Fail(message="bug"), timeout=WAIT) for _ in range(1000)]
    assert all(isinstance(f.exception(WAIT), HandlerError) for f in futures)
    errors = [r for r in caplog.records if r.name == "actors.base" and r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "handler for echo.fail raised RuntimeError" in errors[0].getMessage()
    assert "Traceback" in errors[0].getMessage()
    clock.t += 11.0
    with pytest.raises(HandlerError):
        node.request("n1/echo", Fail(message="bug"), timeout=WAIT)
    assert "(and 999 more like it in the last 11s)" in messages(caplog, "actors.base")[-1]
    assert node.request("n1/echo", Echo(seq=1), timeout=WAIT) == Echo(seq=1)


def test_failed_tells_to_a_client_make_one_warning(
    make_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="transport.node")
    node = make_node("n1")
    for i in range(300):
        node.tell("n1/nobody", Echo(seq=i))
    node.call_in_io_thread(lambda: None, timeout=WAIT)
    assert node.stats["tell_errors"] == 300
    warnings = [m for m in messages(caplog, "transport.node") if "failed" in m]
    assert len(warnings) == 1
    node.stop()
    assert "299 more like this" in messages(caplog, "transport.node")[-1]
