"""The Router's durability (issue 11): the intent row before the provider runs, recovery of a dead Router's
open turns, bounded waits and owner heartbeats under a manual clock, and ended turns leaving memory.

Time is injected: ``ManualClock`` is the Router's monotonic clock and ``ManualTicker`` its housekeeping
timer, so no test sleeps or depends on how fast this machine is. A Router "abandoned without on_stop" is
the ``CrashedRouter`` fake below (a crash at a chosen point is the one thing no real peer can be made to do
in-process; the integration tests SIGKILL a real Router process).
"""

from __future__ import annotations

import concurrent.futures
import sqlite3
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.base import BusActor, Context
from actors.router.actor import RouterActor
from actors.router.client import RouterClient
from actors.router.messages import (
    NextTurnEvent,
    RouterStats,
    StartTurn,
    TurnCancelled,
    TurnCompleted,
    TurnInterrupted,
    TurnNotFound,
    TurnNotStarted,
    TurnStarted,
    TurnTerminated,
    TurnTextDelta,
    TurnToolCall,
)
from actors.router.providers.base import ProviderOutcome, TurnIO, TurnRequest
from actors.router.providers.base import TurnCancelled as ProviderTurnCancelled
from actors.router.providers.scripted import ScriptedProvider
from actors.router.turns import WorkerIO
from actors.types import ToolResult
from transport.errors import NotDelivered
from transport.node import Node
from transport.pending import Reply

PARENT = uuid.UUID("00000000-0000-4000-8000-0000000000aa")
LEDGER = "receipts.sqlite3"


class ManualClock:
    """The Router's monotonic clock, moved only by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ManualTicker:
    """The Router's housekeeping timer (``Ticker``): ``fire()`` is one tick."""

    def __init__(self) -> None:
        self.fns: list[Callable[[], None]] = []
        self.stopped = 0

    def __call__(self, interval_s: float, fn: Callable[[], None]) -> Callable[[], None]:
        self.fns.append(fn)

        def stop() -> None:
            self.stopped += 1

        return stop

    def fire(self) -> None:
        for fn in self.fns:
            fn()


class CrashedRouter(RouterActor):
    """A fake crash (named so): stopping it does what SIGKILL does to a Router process and nothing more.
    Its worker threads end and its ledger's descriptors (the connection, the incarnation lock) close, but
    no turn is settled and its incarnation is not marked ended."""

    def on_stop(self) -> None:
        for turn in list(self._turns.values()):
            turn.io.cancel()  # the process's threads die with it
        if self._ledger is not None:
            self._ledger.close()  # with open rows left: only released, as the kernel would
        BusActor.on_stop(self)


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node("n1", registry=registry())


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def ticker() -> ManualTicker:
    return ManualTicker()


def spawn(
    node: Node,
    name: str,
    provider: Any,
    data_dir: Path | None,
    cls: type[RouterActor] = RouterActor,
    **options: Any,
) -> RouterClient:
    """A Router under test; its housekeeping ticks only when the test fires them (a ``ManualTicker``)."""
    options.setdefault("ticker", ManualTicker())
    node.spawn(cls, name, data_dir=data_dir, providers={"scripted": provider}, **options)
    return RouterClient(node, f"{node.name}/{name}", timeout=10)


def start(router: RouterClient, **fields: Any) -> uuid.UUID:
    spec = StartTurn(
        user_id=fields.pop("user", "u1"),
        parent_operation_id=fields.pop("parent", PARENT),
        model="scripted",
        input=fields.pop("input", "hello"),
        tool_description="tools: slow",
        **fields,
    )
    return router.start_turn(spec).operation_id


def read_until(router: RouterClient, op: uuid.UUID, kind: type[Any]) -> Any:
    while True:
        event = router.next_event(op)
        if isinstance(event, kind):
            return event


def stats(router: RouterClient) -> RouterStats:
    return router.stats()


def settled(router: RouterClient) -> RouterStats:
    """Wait until the Router has handled everything sent to it so far, including the replies its own
    handlers caused (a heartbeat answered at once by NotDelivered is queued behind the first request, so
    the second request comes after it); returns the stats then."""
    stats(router)
    return stats(router)


def tick(router: RouterClient, ticker: ManualTicker) -> RouterStats:
    """One housekeeping tick, handled (with whatever it caused) before the test goes on."""
    ticker.fire()
    return settled(router)


def rows(data_dir: Path) -> list[tuple[Any, ...]]:
    """The ledger file's rows, read with SQL from a connection of the test's own."""
    conn = sqlite3.connect(data_dir / LEDGER)
    try:
        return conn.execute(
            "SELECT operation_id, status, receipt_id, input_tokens, total_tokens, incarnation, settled_by "
            "FROM receipts ORDER BY seq"
        ).fetchall()
    finally:
        conn.close()


# ------------------------------------------------------------------------------------- intent rows


class LedgerPeekingProvider:
    """Reads the ledger file from inside ``run_turn``: what is durable when the provider is called."""

    name = "scripted"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[list[tuple[Any, ...]]] = []

    def close(self) -> None:
        pass

    def run_turn(self, request: TurnRequest, io: TurnIO) -> ProviderOutcome:
        conn = sqlite3.connect(self.path)
        try:
            self.seen.append(
                conn.execute(
                    "SELECT parent_operation_id, user_id, model, provider_model, round, started_at_ms, "
                    "receipt_id, incarnation, issued_at_ms FROM receipts WHERE status = 'open'"
                ).fetchall()
            )
        finally:
            conn.close()
        return ProviderOutcome("done", None)


def test_the_intent_row_is_open_before_the_provider_runs_and_settles_into_one_receipt(
    node: Node, tmp_path: Path
) -> None:
    provider = LedgerPeekingProvider(tmp_path / LEDGER)
    router = spawn(node, "router", provider, tmp_path, clock_ms=lambda: 1_700_000_000_000)
    op = start(router, round=4, user="alice")
    done = read_until(router, op, TurnCompleted)
    (seen,) = provider.seen
    incarnation = stats(router).incarnation
    assert seen == [
        (
            str(PARENT),
            "alice",
            "scripted",
            "scripted",
            4,
            1_700_000_000_000,
            done.receipt.receipt_id,
            incarnation,
            None,
        )
    ]
    # Settling turned that same row into the receipt: one row, the intent's receipt id, never open again.
    assert rows(tmp_path) == [
        (str(op), "completed", done.receipt.receipt_id, None, None, incarnation, incarnation)
    ]
    assert router.receipt(op) == done.receipt


def test_a_turn_whose_intent_cannot_be_written_is_not_started_and_nothing_runs(
    node: Node, tmp_path: Path
) -> None:
    provider = ScriptedProvider()
    router = spawn(node, "router", provider, tmp_path)
    stats(router)  # the Router has started: its ledger file exists
    conn = sqlite3.connect(tmp_path / LEDGER)
    try:  # the file refuses the write, as a full disk would
        conn.execute("CREATE TRIGGER refuse BEFORE INSERT ON receipts BEGIN SELECT RAISE(ABORT, 'full'); END")
        conn.commit()
        with pytest.raises(TurnNotStarted) as caught:
            start(router)
    finally:
        conn.close()
    assert isinstance(caught.value, NotDelivered)  # the retry class: nothing ran, safe to retry
    assert provider.turns == []
    assert rows(tmp_path) == []
    assert stats(router).turns == 0


def test_streamed_usage_reaches_the_open_row_on_the_next_tick_not_on_each_update(
    node: Node, tmp_path: Path, ticker: ManualTicker
) -> None:
    usage = {"input_tokens": 9, "output_tokens": 1, "total_tokens": 10}
    provider = ScriptedProvider([[{"usage": usage}, {"text": "a"}, {"hang": True}]])
    router = spawn(node, "router", provider, tmp_path, ticker=ticker)
    op = start(router)
    read_until(router, op, TurnTextDelta)  # the usage update came before it
    assert [r[3:5] for r in rows(tmp_path)] == [(None, None)]  # no write (no fsync) of its own
    tick(router, ticker)
    assert [r[1:2] + r[3:5] for r in rows(tmp_path)] == [("open", 9, 10)]
    router.cancel(PARENT)


# --------------------------------------------------------------------------------------- recovery


def test_a_router_abandoned_without_on_stop_has_each_open_turn_accounted_once_by_the_next(
    node: Node, tmp_path: Path
) -> None:
    provider = ScriptedProvider(
        [
            [{"text": "streaming"}, {"hang": True}],
            [{"text": "finished"}],
            [
                {"text": "thinking"},
                {"usage": {"input_tokens": 11, "output_tokens": 2, "total_tokens": 13}},
                {"call": {"name": "slow", "arguments": {}}, "id": "c1"},
                {"text": "never"},
            ],
        ]
    )
    first = spawn(node, "first", provider, tmp_path, CrashedRouter)
    hanging = start(first)
    read_until(first, hanging, TurnTextDelta)  # mid-stream
    finished = start(first)
    completed = read_until(first, finished, TurnCompleted)
    waiting = start(first)
    # The last write before the crash: its usage was written before the call was reported (no tick, no
    # other turn's write took it along).
    read_until(first, waiting, TurnToolCall)
    first_incarnation = stats(first).incarnation
    node.lookup("first").stop(block=True, timeout=10)  # type: ignore[union-attr]
    assert {r[1] for r in rows(tmp_path)} == {"open", "completed"}

    second = spawn(node, "second", ScriptedProvider(), tmp_path)
    assert stats(second).recovered == 2
    by_op = {r[0]: r for r in rows(tmp_path)}
    assert len(by_op) == 3 == len(rows(tmp_path))  # exactly one row, one receipt, per started turn
    second_incarnation = stats(second).incarnation
    assert by_op[str(waiting)][1:] == (
        "interrupted",
        by_op[str(waiting)][2],
        11,
        13,
        first_incarnation,
        second_incarnation,
    )
    assert by_op[str(hanging)][1] == "interrupted" and by_op[str(hanging)][3] is None
    assert by_op[str(finished)][1:3] == ("completed", completed.receipt.receipt_id)
    receipt = second.receipt(waiting)
    assert receipt.status == "interrupted" and receipt.usage is not None and receipt.usage.total_tokens == 13
    with pytest.raises(TurnInterrupted) as caught:
        second.next_event(waiting)
    assert caught.value.receipt == receipt
    # A third Router finds nothing left to account: each turn was closed once.
    third = spawn(node, "third", ScriptedProvider(), tmp_path)
    assert stats(third).recovered == 0
    assert len(rows(tmp_path)) == 3


def test_two_live_routers_sharing_a_ledger_never_close_each_others_rows(node: Node, tmp_path: Path) -> None:
    a_provider = ScriptedProvider([[{"call": {"name": "slow", "arguments": {}}, "id": "c1"}, {"text": "A"}]])
    a = spawn(node, "a", a_provider, tmp_path)
    op = start(a)
    call = read_until(a, op, TurnToolCall)
    b = spawn(node, "b", ScriptedProvider(), tmp_path)  # starts (and recovers) while a's row is open
    assert stats(b).recovered == 0
    assert [r[1] for r in rows(tmp_path)] == ["open"]
    b_op = start(b)
    read_until(b, b_op, TurnCompleted)
    node.lookup("b").stop(block=True, timeout=10)  # type: ignore[union-attr]
    c = spawn(node, "c", ScriptedProvider(), tmp_path)
    assert stats(c).recovered == 0  # b stopped cleanly, a is alive
    a.respond(op, call.call_id, ToolResult(success=True, output="ok"))
    assert read_until(a, op, TurnCompleted).receipt.status == "completed"
    assert sorted(r[1] for r in rows(tmp_path)) == ["completed", "completed"]


# --------------------------------------------------------------------------------------- bounded waits


def test_the_workers_wait_for_a_tool_result_is_bounded() -> None:
    io = WorkerIO(router=None, operation_id=uuid.uuid4(), wait_bound_s=0.01)
    outcome: concurrent.futures.Future[BaseException | None] = concurrent.futures.Future()

    def wait() -> None:
        try:
            io.wait_result("c1")
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            outcome.set_result(exc)
        else:
            outcome.set_result(None)

    threading.Thread(target=wait, daemon=True).start()
    error = outcome.result(timeout=30)  # a bound that is not enforced fails here instead of hanging
    assert isinstance(error, ProviderTurnCancelled)
    assert io.cancelled.is_set()


class Owner(BusActor):
    """A turn's owner as the loops have it: an actor that starts the turn and reads it with its own
    requests, until the tool call; then it goes quiet (and the test may stop it)."""

    def __init__(self, node: Node, address: str, router: str, called: concurrent.futures.Future[Any]) -> None:
        super().__init__(node, address)
        self._router = router
        self._called = called
        self.op: uuid.UUID | None = None

    def on_start(self) -> None:
        super().on_start()
        spec = StartTurn(
            user_id="u1",
            parent_operation_id=PARENT,
            model="scripted",
            input="hi",
            tool_description="tools: slow",
        )
        self.ask(self._router, spec, self._started, timeout=10)

    def _started(self, reply: Reply) -> None:
        if reply.error is not None or not isinstance(reply.message, TurnStarted):
            self._called.set_exception(reply.error or RuntimeError(repr(reply.message)))
            return
        self.op = reply.message.operation_id
        self._read()

    def _read(self) -> None:
        assert self.op is not None
        self.ask(self._router, NextTurnEvent(operation_id=self.op), self._event, timeout=10)

    def _event(self, reply: Reply) -> None:
        if reply.error is not None:
            self._called.set_exception(reply.error)
        elif isinstance(reply.message, TurnToolCall):
            self._called.set_result(self.op)
        else:
            self._read()

    def handle(self, message: Any, ctx: Context) -> Any:
        raise TypeError(type(message).__name__)


def owned_turn(node: Node, name: str = "owner") -> uuid.UUID:
    called: concurrent.futures.Future[Any] = concurrent.futures.Future()
    node.spawn(Owner, name, router="n1/router", called=called)
    op: uuid.UUID = called.result(timeout=10)
    return op


WAITS = [[{"call": {"name": "slow", "arguments": {}}, "id": "c1"}, {"text": "never"}]]


def test_an_owner_that_stops_answering_has_its_turn_interrupted_and_accounted_within_the_bound(
    node: Node, tmp_path: Path, clock: ManualClock, ticker: ManualTicker
) -> None:
    router = spawn(
        node,
        "router",
        ScriptedProvider(WAITS),
        tmp_path,
        monotonic=clock,
        ticker=ticker,
        owner_ping_interval_s=10,
        owner_lost_after_s=30,
    )
    op = owned_turn(node)
    reader = router.next_event_future(op)  # the test's own read: it is not the owner, and proves nothing
    node.lookup("owner").stop(block=True, timeout=10)  # type: ignore[union-attr]
    tick(router, ticker)  # idle on its owner from now on
    clock.advance(10)
    # Silent for one interval: a heartbeat goes out and finds no owner. One failed heartbeat is not
    # enough: the owner was heard from 10 s ago.
    assert tick(router, ticker).turns == 1
    clock.advance(20)
    tick(router, ticker)  # silent for owner_lost_after_s and the last heartbeat failed: gone
    with pytest.raises(TurnInterrupted) as caught:
        reader.result(timeout=10)
    receipt = caught.value.receipt
    assert receipt is not None and receipt.status == "interrupted" and receipt.operation_id == op
    assert "stopped answering" in (receipt.error or "")
    after = settled(router)
    assert (after.turns, after.links) == (0, 0)
    assert router.receipt(op) == receipt
    assert [r[1] for r in rows(tmp_path)] == ["interrupted"]


def test_an_owner_that_answers_keeps_its_turn_until_the_idle_bound(
    node: Node, tmp_path: Path, clock: ManualClock, ticker: ManualTicker
) -> None:
    router = spawn(
        node,
        "router",
        ScriptedProvider(WAITS),
        tmp_path,
        monotonic=clock,
        ticker=ticker,
        owner_ping_interval_s=10,
        owner_lost_after_s=30,
        owner_idle_bound_s=100,
    )
    op = owned_turn(node)
    tick(router, ticker)
    for _ in range(9):  # 90 s idle on an owner whose mailbox answers every heartbeat
        clock.advance(10)
        assert tick(router, ticker).turns == 1

    clock.advance(10)
    assert tick(router, ticker).turns == 0  # 100 s: the bound on how long a turn waits for a live owner

    with pytest.raises(TurnInterrupted) as caught:
        router.next_event(op)
    assert caught.value.receipt is not None and "waited on its owner" in (caught.value.receipt.error or "")


def test_a_client_thread_of_the_routers_own_node_is_never_pinged_but_the_idle_bound_holds(
    node: Node, tmp_path: Path, clock: ManualClock, ticker: ManualTicker
) -> None:
    router = spawn(
        node,
        "router",
        ScriptedProvider(WAITS),
        tmp_path,
        monotonic=clock,
        ticker=ticker,
        owner_ping_interval_s=10,
        owner_lost_after_s=30,
        owner_idle_bound_s=100,
    )
    op = start(router)
    read_until(router, op, TurnToolCall)
    tick(router, ticker)
    clock.advance(99)
    assert tick(router, ticker).turns == 1
    clock.advance(1)
    assert tick(router, ticker).turns == 0
    assert router.receipt(op).status == "interrupted"


# --------------------------------------------------------------------------------------- flat memory


def test_ended_turns_leave_memory_and_late_requests_are_answered_from_the_ledger(
    node: Node, tmp_path: Path
) -> None:
    provider = ScriptedProvider(default=[{"text": "ok"}, {"usage": {"input_tokens": 1, "output_tokens": 1}}])
    router = spawn(node, "router", provider, tmp_path)
    parents = [uuid.uuid4() for _ in range(4)]
    done = [read_until(router, start(router, parent=parents[n % 4]), TurnCompleted) for n in range(200)]
    now = stats(router)
    assert (now.turns, now.links) == (0, 0)
    first = done[0].receipt
    assert router.receipt(first.operation_id) == first
    with pytest.raises(TurnTerminated) as caught:
        router.next_event(first.operation_id)
    assert caught.value.receipt == first
    assert len(router.receipts_for(parents[0])) == 50
    assert router.finish_unavailable(first.operation_id) == first


def test_a_cancelled_turn_leaves_memory_once_its_reader_has_the_error(node: Node, tmp_path: Path) -> None:
    router = spawn(node, "router", ScriptedProvider([[{"text": "a"}, {"hang": True}]]), tmp_path)
    op = start(router)
    reader = router.next_event_future(op)
    reader.result(timeout=10)  # TurnInput
    reader = router.next_event_future(op)
    reader.result(timeout=10)  # the text
    reader = router.next_event_future(op)
    router.cancel(PARENT)
    with pytest.raises(TurnCancelled):
        reader.result(timeout=10)
    assert stats(router).turns == 0


def test_an_ended_turn_nobody_reads_leaves_memory_after_the_grace(
    node: Node, tmp_path: Path, clock: ManualClock, ticker: ManualTicker
) -> None:
    router = spawn(
        node,
        "router",
        ScriptedProvider([[{"text": "unread"}]]),
        tmp_path,
        monotonic=clock,
        ticker=ticker,
        finished_grace_s=60,
    )
    op = start(router)
    for worker in [t for t in threading.enumerate() if t.name == f"kbus-turn-{op}"]:
        worker.join(10)  # the provider finished; its last message to the Router was sent before it ended
    assert tick(router, ticker).turns == 1  # ended, but its end was never handed to anyone
    clock.advance(60)
    assert tick(router, ticker).turns == 0
    with pytest.raises(TurnTerminated) as caught:
        router.next_event(op)
    assert caught.value.receipt is not None and caught.value.receipt.status == "completed"


def test_without_a_data_dir_the_recent_receipts_are_bounded(node: Node) -> None:
    router = spawn(node, "router", ScriptedProvider(), None, recent_receipts=5)
    done = [read_until(router, start(router), TurnCompleted).receipt for _ in range(8)]
    now = stats(router)
    assert (now.turns, now.links, now.recent) == (0, 0, 5)
    assert router.receipt(done[-1].operation_id) == done[-1]
    assert list(router.receipts_for(PARENT)) == done[-5:]
    with pytest.raises(TurnNotFound):
        router.receipt(done[0].operation_id)


def test_a_released_turn_still_links_its_parent_to_its_live_children(node: Node, tmp_path: Path) -> None:
    """RT-12: cancelling an operation ends every descendant turn, also through a turn that already ended
    and left memory (a subagent run started under a primary turn's operation, say)."""
    provider = ScriptedProvider([[{"text": "parent done"}], [{"hang": True}]])
    router = spawn(node, "router", provider, tmp_path)
    grandparent = uuid.uuid4()
    parent_turn = start(router, parent=grandparent)
    read_until(router, parent_turn, TurnCompleted)  # ended and handed over: it leaves memory
    child = start(router, parent=parent_turn)
    assert stats(router).turns == 1
    assert router.cancel(grandparent) == (child,)
    with pytest.raises(TurnCancelled):
        read_until(router, child, TurnCompleted)
    assert (stats(router).turns, stats(router).links) == (0, 0)
