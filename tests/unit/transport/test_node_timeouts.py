"""A request or timer whose wait is not a finite number is refused (found by the 1M-frame fuzz run).

A fuzzed ``timeout`` field (NaN) reached ``Node.send`` through an actor's own request: the deadline heap
then had a NaN at its head, and the I/O thread died on ``int(nan)``; the node took no frame after that.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import pytest

from actors.app.echo import EchoActor
from transport.errors import Expired, ProtocolError
from transport.messages import Hold, Ping, Pong
from transport.node import Node


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_timeout_is_refused_and_every_other_request_still_expires(
    make_node: Callable[..., Node], bad: float
) -> None:
    node = make_node("n1")
    node.spawn(EchoActor, "echo")
    with pytest.raises(ProtocolError, match="finite"):
        node.request_future("n1/echo", Hold(), timeout=bad)
    with pytest.raises(ProtocolError, match="finite"):
        node.call_at(bad, lambda: None)
    held = node.request_future("n1/echo", Hold(), timeout=0.05)
    with pytest.raises(Expired):
        held.result(10)  # the I/O thread runs, and its deadline heap still expires requests
    assert node.request("n1/echo", Ping(nonce=3), timeout=10) == Pong(nonce=3, actor="n1/echo")
    assert len(node.pending) == 0


def test_a_timer_added_while_the_io_thread_arms_its_poll_wakes_that_poll(
    make_node: Callable[..., Node],
) -> None:
    """A timer set between the I/O thread's look at its timers and its next poll must wake that poll. It
    did not: ``call_at`` compared the new time with the *last* poll's end, skipped the wake, and the poll
    slept its full second (found as a 2 ms scripted delay that took up to 1 s, scripts/bench --only router).
    The interleaving is forced here by setting the timer from inside the timers' own look."""
    node = make_node("n1")
    io = node._io
    assert io is not None
    wakes: list[float] = []
    real_wake = io.wake
    io.wake = lambda: (wakes.append(io.poll_until), real_wake())  # type: ignore[method-assign]
    fired = threading.Event()
    real_run_due = node.timers.run_due
    armed, set_once = threading.Event(), threading.Event()

    def run_due() -> float | None:
        due = real_run_due()
        if armed.is_set() and not set_once.is_set():
            set_once.set()
            wakes.clear()
            node.call_at(node.monotonic() + 0.001, fired.set)  # as another thread would, at this moment
        return due

    node.timers.run_due = run_due  # type: ignore[method-assign]
    armed.set()
    io.wake()  # one more turn of the loop, so the look above runs with `armed` set
    assert set_once.wait(10)
    assert wakes == [math.inf]  # the timer woke the poll being armed (before the fix: no wake, a 1 s sleep)
    assert fired.wait(10)
