"""A request or timer whose wait is not a finite number is refused (found by the 1M-frame fuzz run).

A fuzzed ``timeout`` field (NaN) reached ``Node.send`` through an actor's own request: the deadline heap
then had a NaN at its head, and the I/O thread died on ``int(nan)``; the node took no frame after that.
"""

from __future__ import annotations

import math
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
