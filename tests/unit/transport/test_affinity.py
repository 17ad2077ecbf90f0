"""Where bus threads wait (transport/affinity.py): on the process's home CPU while they wait, anywhere once
woken, so neither what a handler runs nor a child process it starts is confined; ZeroMQ's I/O threads start
on the home CPU; ``[node] colocate_waits = false`` turns it all off.

Observed on the real threads through the kernel (``os.sched_getaffinity`` of a thread id, a child's own
view of its mask). A thread that has gone back to its mailbox stays parked until its next message, so the
bounded look for the parked mask ends as soon as the thread is there."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from actors.base import BusActor, Context, HostPool
from config.settings import from_mapping
from transport import Node, Peer, affinity
from transport.messages import Echo

WAIT = 10.0
ALLOWED = os.sched_getaffinity(0)

pytestmark = pytest.mark.skipif(len(ALLOWED) < 2, reason="one CPU: there is no other CPU to wake")


class Where(BusActor):
    """Answers with the CPU mask its thread runs with, and its thread id; with ``text="child"`` also the
    mask a child process it starts sees for itself."""

    def handle(self, message: Any, ctx: Context) -> Any:
        seen: dict[str, Any] = {"mask": sorted(os.sched_getaffinity(0)), "tid": threading.get_native_id()}
        if isinstance(message, Echo) and message.text == "child":
            out = subprocess.run(
                [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                capture_output=True,
                text=True,
                timeout=WAIT,
                check=True,
            )
            seen["child"] = json.loads(out.stdout)
        return Echo(data=seen)


@pytest.fixture
def colocated() -> Iterator[int]:
    home = affinity.colocate(True)
    assert home == min(ALLOWED)
    yield home
    affinity.colocate(True)


def _parked(tid: int, mask: set[int]) -> bool:
    """True once thread ``tid`` has the mask ``mask`` (bounded: WAIT)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if os.sched_getaffinity(tid) == mask:
            return True
        os.sched_yield()
    return False


@pytest.mark.parametrize("placed", ["own thread", "hosting actor"])
def test_an_idle_actor_thread_waits_on_the_home_cpu_and_runs_its_handler_on_any(
    make_node: Callable[..., Node], colocated: int, placed: str
) -> None:
    """Both mailboxes: an actor's own (HomeQueue) and a hosting actor's (SocketInbox, a pool's thread)."""
    node = make_node("aff1")
    if placed == "own thread":
        node.spawn(Where, "where")
    else:
        HostPool.of(node, "affinity-test").spawn(Where, "where")
    seen = node.request("aff1/where", Echo(), timeout=WAIT).data
    assert set(seen["mask"]) == ALLOWED  # woken: the process's mask back before the handler ran
    assert _parked(seen["tid"], {colocated}), "the idle actor thread never waited on the home CPU"
    again = node.request("aff1/where", Echo(), timeout=WAIT).data
    assert again["tid"] == seen["tid"] and set(again["mask"]) == ALLOWED


def test_a_child_process_a_handler_starts_is_not_confined_to_the_home_cpu(
    make_node: Callable[..., Node], colocated: int
) -> None:
    node = make_node("aff2")
    node.spawn(Where, "where")
    node.request("aff2/where", Echo(), timeout=WAIT)  # the actor has waited (parked) at least once
    seen = node.request("aff2/where", Echo(text="child"), timeout=WAIT).data
    assert set(seen["child"]) == ALLOWED


def test_with_colocation_off_waits_stay_where_the_scheduler_puts_them(make_node: Callable[..., Node]) -> None:
    assert affinity.colocate(False) is None
    try:
        assert affinity.home() is None
        node = make_node("aff3")
        node.spawn(Where, "where")
        first = node.request("aff3/where", Echo(), timeout=WAIT).data
        node.request("aff3/where", Echo(), timeout=WAIT)  # it has waited between the two
        assert os.sched_getaffinity(first["tid"]) == ALLOWED  # never changed: nothing to race with
    finally:
        affinity.colocate(True)


def _comm(tid: str) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except FileNotFoundError:  # a thread that has ended meanwhile
        return ""


def test_zmq_io_threads_a_node_starts_run_on_the_home_cpu(tmp_path: Path, colocated: int) -> None:
    before = set(os.listdir("/proc/self/task"))
    context = zmq.Context()
    node = Node("aff4", bind=[f"ipc://{tmp_path}/aff4.sock"], context=context).start()
    peer = Node("aff4c").start()
    try:
        # A libzmq thread sets its mask, then its name, then serves (thread_routine). Traffic through the
        # node's socket has been carried by its I/O thread, so that thread is past both by then (a look
        # right after start could find a thread not yet there, or another thread of the process starting).
        peer.connect(Peer("aff4", node.endpoints[0]), wait=WAIT)
        io = [
            int(tid)
            for tid in set(os.listdir("/proc/self/task")) - before
            if _comm(tid).startswith("ZMQbg/IO")
        ]
        assert io, "the context started no I/O thread"
        assert all(os.sched_getaffinity(tid) == {colocated} for tid in io)
    finally:
        peer.stop()
        node.stop()
        context.term()


def test_a_mailbox_wait_that_times_out_gives_the_thread_its_mask_back(colocated: int) -> None:
    box = affinity.HomeQueue()
    with pytest.raises(queue.Empty):
        box.get(timeout=0.01)
    assert os.sched_getaffinity(0) == ALLOWED
    box.put("x")
    assert box.get() == "x"  # something waiting: taken without a park
    assert os.sched_getaffinity(0) == ALLOWED


def test_a_process_allowed_one_cpu_does_not_colocate() -> None:
    result: list[int | None] = []

    def one_cpu() -> None:
        os.sched_setaffinity(0, {min(ALLOWED)})
        result.append(affinity.colocate(True))

    thread = threading.Thread(target=one_cpu)
    thread.start()
    thread.join(WAIT)
    try:
        assert result == [None] and affinity.home() is None
    finally:
        affinity.colocate(True)


def test_the_node_settings_turn_colocation_off_and_on() -> None:
    try:
        assert from_mapping({"node": {"name": "n1"}}).node.colocate_waits is True
        Node.from_settings(from_mapping({"node": {"name": "n1", "colocate_waits": False}}))
        assert affinity.home() is None
        Node.from_settings(from_mapping({"node": {"name": "n1"}}))
        assert affinity.home() == min(ALLOWED)
    finally:
        affinity.colocate(True)


def test_a_node_built_without_settings_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setattr(affinity, "_chosen", False)
        affinity.colocate_by_default({"KBUS_NODE_COLOCATE_WAITS": "off"})
        assert affinity.home() is None
        affinity.colocate_by_default({})  # chosen already: the default changes nothing
        assert affinity.home() is None
        monkeypatch.setattr(affinity, "_chosen", False)
        affinity.colocate_by_default({})
        assert affinity.home() == min(ALLOWED)
        monkeypatch.setattr(affinity, "_chosen", False)
        with pytest.raises(ValueError, match="KBUS_NODE_COLOCATE_WAITS: expected true or false, got 'maybe'"):
            affinity.colocate_by_default({"KBUS_NODE_COLOCATE_WAITS": "maybe"})
    finally:
        affinity.colocate(True)
