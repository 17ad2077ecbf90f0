"""The Router's group commit (DESIGN.md 4a: "Durable writes are committed in groups where throughput needs
it (many records per fsync), never after the caller has been told"; issue 15, item 6).

A burst of turns' intents and receipts waiting in the Router's mailbox shares one ledger commit; until that
commit has returned nobody hears of any of them and no provider of theirs runs; a commit that fails refuses
the turns it would have started and writes the receipts it settled again.

The burst is made deterministic by holding the Router's thread at a gate (``hold``) while the requests
queue up behind it. ``GatedCommit`` is a fake, named so: it stands in for a disk that is slow or fails at a
chosen commit (no real disk can be made to stall or fail on cue) and runs the real COMMIT otherwise.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.base import LOOP_HOSTS, HostPool
from actors.router.actor import RouterActor, _Later
from actors.router.client import RouterClient
from actors.router.messages import (
    LedgerUnavailable,
    StartTurn,
    TurnCompleted,
    TurnNotStarted,
    TurnStarted,
    TurnToolCall,
)
from actors.router.providers.scripted import ScriptedProvider
from actors.router.receipts import commit as real_commit
from actors.types import ToolResult
from transport.errors import NotDelivered
from transport.node import Node
from transport.pending import BusFuture

PARENT = uuid.UUID("00000000-0000-4000-8000-0000000000bb")
LEDGER = "receipts.sqlite3"
WAIT = 10.0
HANG = [{"hang": True}]


class GatedCommit:
    """The Router ledger's commit (a fake disk, named so). Counts the commits; once ``armed``, the next
    commit says it was entered and waits for ``release`` (``stall``), or raises a disk error (``fail``
    times) before any COMMIT runs, as a failed fsync would."""

    def __init__(self) -> None:
        self.calls = 0
        self.stall = False
        self.fail = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, conn: sqlite3.Connection) -> None:
        self.calls += 1
        if self.fail:
            self.fail -= 1
            raise sqlite3.OperationalError("disk I/O error")
        if self.stall:
            self.stall = False
            self.entered.set()
            assert self.release.wait(WAIT), "the test never released the commit"
        real_commit(conn)


@pytest.fixture(params=["hosted", "own-thread", "direct"])
def node(request: pytest.FixtureRequest, make_node: Callable[..., Node], ipc_dir: Path) -> Node:
    """Where the Router runs decides how its group learns that nothing more waits: hosted on the loop pool
    (it tells itself to commit, behind its host's items), on a thread of its own (its mailbox), or direct on
    a node with endpoints (its local items and its own socket)."""
    if request.param == "direct":
        return make_node("n1", registry=registry(), bind=[f"ipc://{ipc_dir}/n1.sock"])
    node = make_node("n1", registry=registry())
    if request.param == "own-thread":
        HostPool.configure(node, LOOP_HOSTS, 0)
    return node


@pytest.fixture
def disk() -> Iterator[GatedCommit]:
    gated = GatedCommit()
    yield gated
    gated.release.set()  # a test that failed while a commit stalled: the Router's stop may go on


def spawn(node: Node, provider: ScriptedProvider, data_dir: Path, disk: GatedCommit) -> RouterClient:
    node.spawn(
        RouterActor,
        "router",
        data_dir=data_dir,
        providers={"scripted": provider},
        ticker=lambda interval, fn: lambda: None,
        ledger_commit=disk,
    )
    router = RouterClient(node, "n1/router", timeout=WAIT)
    router.stats()  # started: its ledger is open and its recovery committed
    return router


def hold(node: Node) -> threading.Event:
    """Hold the Router's thread until the returned gate is set: what is sent meanwhile waits in its
    mailbox."""
    gate, held = threading.Event(), threading.Event()

    def wait() -> None:
        held.set()
        assert gate.wait(WAIT), "the test never opened the gate"

    node.lookup("router").tell(_Later(wait))
    assert held.wait(WAIT)
    return gate


def spec(n: int) -> StartTurn:
    return StartTurn(
        user_id=f"u{n}",
        parent_operation_id=PARENT,
        model="scripted",
        input="hello",
        tool_description="tools: x",
    )


def starts(router: RouterClient, count: int) -> list[BusFuture]:
    return [router.start_turn_future(spec(n)) for n in range(count)]


def queued_starts(
    node: Node, router: RouterClient, count: int, arm: Callable[[], None] = lambda: None
) -> list[BusFuture]:
    """``count`` starts queued behind the Router's held thread, so one group takes them all; ``arm`` sets
    the fake disk up before the gate opens."""
    gate = hold(node)
    futures = starts(router, count)
    arm()
    gate.set()
    return futures


def open_rows(data_dir: Path) -> list[str]:
    conn = sqlite3.connect(data_dir / LEDGER)
    try:
        return [op for (op,) in conn.execute("SELECT operation_id FROM receipts WHERE status = 'open'")]
    finally:
        conn.close()


def status_of(data_dir: Path, op: uuid.UUID) -> str | None:
    conn = sqlite3.connect(data_dir / LEDGER)
    try:
        row = conn.execute("SELECT status FROM receipts WHERE operation_id = ?", (str(op),)).fetchone()
    finally:
        conn.close()
    return None if row is None else str(row[0])


def test_a_burst_of_starts_shares_one_commit(node: Node, tmp_path: Path, disk: GatedCommit) -> None:
    provider = ScriptedProvider([HANG] * 5)
    router = spawn(node, provider, tmp_path, disk)
    before, counted = disk.calls, router.stats().commits
    futures = queued_starts(node, router, 5)
    ops = [f.result(WAIT).operation_id for f in futures]
    assert disk.calls - before == 1  # five intents, one commit (one fsync)
    assert counted is not None and router.stats().commits == counted + 1  # as the Router counts them
    assert sorted(open_rows(tmp_path)) == sorted(str(op) for op in ops)
    assert len(provider.turns) == 5  # and each provider ran, after it
    router.cancel(PARENT)


def test_a_lone_start_is_committed_before_it_is_answered(
    node: Node, tmp_path: Path, disk: GatedCommit
) -> None:
    provider = ScriptedProvider([HANG])
    router = spawn(node, provider, tmp_path, disk)
    before = disk.calls
    op = router.start_turn(spec(0)).operation_id
    assert disk.calls - before == 1
    assert open_rows(tmp_path) == [str(op)]
    router.cancel(PARENT)


def test_nobody_hears_of_a_start_and_no_provider_runs_before_its_commit_returns(
    node: Node, tmp_path: Path, disk: GatedCommit
) -> None:
    provider = ScriptedProvider([HANG] * 3)
    router = spawn(node, provider, tmp_path, disk)
    futures = queued_starts(node, router, 3, lambda: setattr(disk, "stall", True))
    assert disk.entered.wait(WAIT)  # the group's commit is under way, on the Router's thread
    assert [f.done() for f in futures] == [False, False, False]
    assert provider.turns == []
    disk.release.set()
    started = [f.result(WAIT) for f in futures]
    assert all(isinstance(s, TurnStarted) for s in started)
    assert len(provider.turns) == 3
    router.cancel(PARENT)


def tool_turn() -> list[dict[str, Any]]:
    return [{"call": {"name": "x", "arguments": {}}, "id": "c1"}, {"text": "done"}]


def at_the_call(router: RouterClient) -> uuid.UUID:
    op = router.start_turn(spec(0)).operation_id
    while not isinstance(router.next_event(op), TurnToolCall):
        pass  # the turn's input first
    return op


def completion(router: RouterClient, op: uuid.UUID, first: BusFuture) -> TurnCompleted:
    """The turn's completion, reading on from the read ``first``."""
    event = first.result(WAIT)
    while not isinstance(event, TurnCompleted):
        event = router.next_event(op)
    return event


def test_a_receipt_is_reported_only_after_its_commit_returns(
    node: Node, tmp_path: Path, disk: GatedCommit
) -> None:
    router = spawn(node, ScriptedProvider([tool_turn()]), tmp_path, disk)
    op = at_the_call(router)
    disk.stall = True  # the next commit: the one that settles the turn into its receipt
    gate = hold(node)  # the read waits before the turn's last step, so that step answers it
    responded = router.respond_future(op, "c1", ToolResult(output="ok", success=True))
    read = router.next_event_future(op)
    gate.set()
    responded.result(WAIT)
    assert disk.entered.wait(WAIT)
    assert not read.done()  # what the turn did since the call, its completion included, is held
    assert status_of(tmp_path, op) == "open"
    disk.release.set()
    done = completion(router, op, read)
    assert status_of(tmp_path, op) == "completed"
    assert router.receipt(op) == done.receipt


def test_a_failed_group_commit_refuses_its_starts_and_nothing_runs(
    node: Node, tmp_path: Path, disk: GatedCommit
) -> None:
    provider = ScriptedProvider([HANG] * 4)
    router = spawn(node, provider, tmp_path, disk)
    futures = queued_starts(node, router, 3, lambda: setattr(disk, "fail", 1))
    for future in futures:
        with pytest.raises(TurnNotStarted) as caught:
            future.result(WAIT)
        assert isinstance(caught.value, NotDelivered)  # the retry class: nothing ran, safe to retry
        assert "intent could not be recorded" in str(caught.value)
    assert provider.turns == []
    assert open_rows(tmp_path) == []
    assert router.stats().turns == 0
    op = router.start_turn(spec(9)).operation_id  # the Router lives on, and the next group commits
    assert open_rows(tmp_path) == [str(op)]
    router.cancel(PARENT)


def test_a_failed_commit_writes_the_receipts_it_settled_again(
    node: Node, tmp_path: Path, disk: GatedCommit
) -> None:
    router = spawn(node, ScriptedProvider([tool_turn()]), tmp_path, disk)
    op = at_the_call(router)
    disk.fail = 1  # the receipt's group fails; the receipt written once more succeeds
    router.respond(op, "c1", ToolResult(output="ok", success=True))
    done = completion(router, op, router.next_event_future(op))
    assert status_of(tmp_path, op) == "completed"
    assert router.receipt(op) == done.receipt


def test_a_receipt_that_cannot_be_written_again_fails_what_was_held(
    node: Node, tmp_path: Path, disk: GatedCommit
) -> None:
    router = spawn(node, ScriptedProvider([tool_turn(), HANG]), tmp_path, disk)
    op = at_the_call(router)
    disk.fail = 2  # the group's commit and the receipt's own write both fail
    gate = hold(node)  # the read waits before the turn's last step: its answer is one the group holds
    responded = router.respond_future(op, "c1", ToolResult(output="ok", success=True))
    read = router.next_event_future(op)
    gate.set()
    responded.result(WAIT)
    with pytest.raises(LedgerUnavailable) as caught:
        read.result(WAIT)
    assert caught.value.receipt is not None and caught.value.receipt.operation_id == op
    assert status_of(tmp_path, op) == "open"  # not on disk: a later Router accounts it from this row
    later = router.start_turn(spec(1)).operation_id  # the Router lives on
    assert str(later) in open_rows(tmp_path)
    router.cancel(PARENT)
