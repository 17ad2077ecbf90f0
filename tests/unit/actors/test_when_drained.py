"""``BusActor.when_drained`` (actors/base.py), the hook the Router's group commit closes on: one call of
``on_drained`` once nothing more waits in the actor's mailbox, on its own thread or on a host's (where the
host's other actors' items count as waiting), and at the latest after ``DRAIN_BOUND`` of a busy host's
items. Real actors on real threads; the busy neighbour keeps its host's mailbox full by telling itself."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.base import DRAIN_BOUND, BusActor, HostPool
from transport.messages import Ping
from transport.node import Node

WAIT = 10.0


class Waiter(BusActor):
    """On ``"ask"``: asks for a drain call; records, at each ``on_drained``, what ``Spinner`` has done."""

    spinner: Spinner | None = None

    def __init__(self, node: Node, address: str, calls: queue.SimpleQueue[int]) -> None:
        super().__init__(node, address)
        self.calls = calls

    def on_local(self, message: Any) -> Any:
        if message == "ask":
            self.when_drained()
        return None

    def on_drained(self) -> None:
        self.calls.put(Waiter.spinner.done if Waiter.spinner is not None else -1)


class Spinner(BusActor):
    """Tells itself ``n - 1`` after handling ``n``: while it spins, its mailbox is never empty."""

    def __init__(self, node: Node, address: str) -> None:
        super().__init__(node, address)
        self.done = 0
        self.finished = threading.Event()
        Waiter.spinner = self

    def on_local(self, message: Any) -> Any:
        self.done += 1
        if message > 0:
            self.actor_ref.tell(message - 1)
        else:
            self.finished.set()
        return None


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    Waiter.spinner = None
    return make_node("n1", registry=registry())


def test_an_actor_on_its_own_thread_is_told_once_its_mailbox_is_empty(node: Node) -> None:
    calls: queue.SimpleQueue[int] = queue.SimpleQueue()
    waiter = node.spawn(Waiter, "w", calls)
    waiter.tell("ask")
    assert calls.get(timeout=WAIT) == -1
    waiter.tell("other")  # an item with no ask before it: no second call
    node.request("n1/w", Ping(nonce=1), timeout=WAIT)  # handled after it
    assert calls.empty()


def test_a_hosted_actor_is_told_after_the_bound_while_its_hosts_mailbox_stays_full(node: Node) -> None:
    HostPool.configure(node, "t", 1)
    pool = HostPool.of(node, "t")
    calls: queue.SimpleQueue[int] = queue.SimpleQueue()
    spinner_ref = pool.spawn(Spinner, "s")
    waiter = pool.spawn(Waiter, "w", calls)
    total = 20 * DRAIN_BOUND
    spinner_ref.tell(total)
    waiter.tell("ask")
    seen = calls.get(timeout=WAIT)
    assert seen < total  # told while its neighbour still spun: the bound, not an empty mailbox
    spinner = Waiter.spinner
    assert spinner is not None and spinner.finished.wait(WAIT)
    assert calls.empty()  # once


def test_a_hosted_actor_on_a_quiet_host_is_told_after_its_own_item(node: Node) -> None:
    HostPool.configure(node, "q", 1)
    calls: queue.SimpleQueue[int] = queue.SimpleQueue()
    waiter = HostPool.of(node, "q").spawn(Waiter, "w", calls)
    waiter.tell("ask")
    assert calls.get(timeout=WAIT) == -1
