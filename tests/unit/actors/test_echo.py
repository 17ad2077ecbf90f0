"""The echo actor's limits (issue 18 item 2): every field that sizes its work has a documented limit
(``transport.messages``) and ``LimitExceeded`` past it; at the limit it works. One in-process node."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from actors.app.echo import EchoActor
from transport import LimitExceeded, Node
from transport.messages import (
    ECHO_MAX_HELD,
    ECHO_MAX_STREAM_BYTES,
    ECHO_MAX_STREAM_PARTS,
    Echo,
    EchoStream,
    Hold,
    Ping,
    Pong,
)

WAIT = 10.0


class Clock:
    def __init__(self) -> None:
        self.t = 500_000.0

    def wall(self) -> float:
        return self.t

    def mono(self) -> float:
        return self.t - 400_000.0


class HeldEcho(EchoActor):
    def on_local(self, message: Any) -> Any:
        return len(self._open)


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    n = make_node("n1")
    n.spawn(EchoActor, "echo")
    return n


@pytest.mark.parametrize(
    ("message", "field"),
    [
        pytest.param(EchoStream(count=10**12), "count", id="count-of-the-issue"),
        pytest.param(EchoStream(count=ECHO_MAX_STREAM_PARTS + 1), "count", id="count-one-past"),
        pytest.param(EchoStream(count=-1), "count", id="negative-count"),
        pytest.param(
            EchoStream(count=1000, payload=b"x" * (ECHO_MAX_STREAM_BYTES // 1000 + 1)), "payload", id="bytes"
        ),
    ],
)
def test_a_stream_past_its_limits_is_refused_and_nothing_is_sent(
    node: Node, message: Any, field: str
) -> None:
    parts = []
    with pytest.raises(LimitExceeded) as info:
        for part in node.stream("n1/echo", message, timeout=WAIT):
            parts.append(part)
    assert parts == []
    assert info.value.details["field"] == field
    assert node.request("n1/echo", Ping(nonce=1), timeout=WAIT) == Pong(nonce=1, actor="n1/echo")


def test_a_stream_at_its_limit_is_served(node: Node) -> None:
    seqs = [m.seq for m in node.stream("n1/echo", EchoStream(count=ECHO_MAX_STREAM_PARTS), timeout=60)]
    assert seqs == list(range(ECHO_MAX_STREAM_PARTS + 1))


def test_holds_past_the_limit_are_refused_until_held_ones_expire(make_node: Callable[..., Node]) -> None:
    """The count limit and item 3 together: the limit frees up as held requests reach their deadline."""
    clock = Clock()
    node = make_node("n1", clock=clock.wall, monotonic=clock.mono)
    ref = node.spawn(HeldEcho, "echo")
    held = [node.request_future("n1/echo", Hold(), timeout=1.0) for _ in range(ECHO_MAX_HELD)]
    with pytest.raises(LimitExceeded, match=f"holds {ECHO_MAX_HELD}"):
        node.request("n1/echo", Hold(), timeout=WAIT)
    assert ref.ask("held", timeout=WAIT) == ECHO_MAX_HELD
    clock.t += 2.0
    node.call_in_io_thread(lambda: (node.pending.expire_due(), node.timers.run_due()), timeout=WAIT)
    assert ref.ask("held", timeout=WAIT) == 0
    assert all(f.exception(WAIT) is not None for f in held)
    again = node.request_future("n1/echo", Hold(), timeout=1.0)
    assert ref.ask("held", timeout=WAIT) == 1
    assert not again.done()
    assert node.request("n1/echo", Echo(text="fine"), timeout=WAIT) == Echo(text="fine")
