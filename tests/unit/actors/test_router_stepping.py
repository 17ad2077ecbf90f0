"""``AwaitFuture``: a stepped turn waits for a ``concurrent.futures.Future`` without a thread (issue 15,
item 5: the Router reaches the codex adapter by message). ``TurnHost`` parks the turn; the future's
done-callback only posts the wake-up to the host's actor; the next step, on the host's thread, is sent the
result or has the exception thrown in. A cancel while parked throws ``TurnCancelled`` in, and the future's
late outcome is dropped. ``drive`` (a direct caller's bridge) blocks on the future and honours
``io.cancelled``."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from peers.turn_io import RecordingTurnIO

from actors.app.wiring import registry
from actors.router.actor import RouterActor
from actors.router.client import RouterClient
from actors.router.messages import StartTurn, TurnCompleted, TurnInput
from actors.router.messages import TurnCancelled as RouterTurnCancelled
from actors.router.providers.base import (
    AwaitFuture,
    ProviderError,
    ProviderOutcome,
    Submitted,
    TurnCancelled,
    TurnIO,
    TurnRequest,
    TurnSteps,
    drive,
    model_context,
)
from actors.router.stepping import GetWorkerStats, HostTurn, TurnHost, TurnWorker, WorkerStats
from transport.node import Node

T = 10.0  # every blocking wait in this file is bounded by this
Seen = list[tuple[str, Any, int]]  # (what happened, the value or exception, the thread it happened on)


def awaiting(future: concurrent.futures.Future[Any], seen: Seen) -> TurnSteps:
    """A turn that waits for ``future`` once and records how it was resumed, and on which thread."""
    try:
        value = yield AwaitFuture(future)
    except ValueError as exc:
        seen.append(("thrown", exc, threading.get_ident()))
        return ProviderOutcome(f"failed: {exc}", None)
    except TurnCancelled as exc:
        seen.append(("cancelled", exc, threading.get_ident()))
        raise ProviderError("cancelled", "turn cancelled") from None
    seen.append(("sent", value, threading.get_ident()))
    return ProviderOutcome(str(value), None)


Ended = list[tuple[uuid.UUID, ProviderOutcome | None, BaseException | None]]


class Mailbox:
    """A ``TurnHost`` run by the test's thread as its actor would run it: ``wake`` and ``post`` only queue a
    message (from any thread), ``run`` handles what is queued, here."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.ended: Ended = []
        self.posted_from: list[int] = []
        self.host = TurnHost(
            wake=lambda: self.queue.put(self.host.step),
            finish=lambda op, outcome, error: self.ended.append((op, outcome, error)),
            post=self._post,
        )

    def _post(self, fn: Callable[[], None]) -> None:
        self.posted_from.append(threading.get_ident())
        self.queue.put(fn)

    def run(self) -> None:
        while True:
            try:
                message = self.queue.get_nowait()
            except queue.Empty:
                return
            message()


def settle_on_a_thread(settle: Callable[[], Any]) -> int:
    """Run ``settle`` (a future's set_result or set_exception) on a thread of its own; its ident."""
    thread = threading.Thread(target=settle)
    thread.start()
    thread.join(T)
    assert not thread.is_alive() and thread.ident is not None
    return thread.ident


def test_a_resolved_future_is_sent_into_the_turn_on_the_hosts_thread() -> None:
    mailbox, future, seen, op = Mailbox(), concurrent.futures.Future[Any](), [], uuid.uuid4()
    mailbox.host.add(op, awaiting(future, seen))
    mailbox.run()
    assert (seen, mailbox.ended, len(mailbox.host), mailbox.host.steps_run) == ([], [], 1, 1)  # parked
    resolver = settle_on_a_thread(lambda: future.set_result("sunny"))
    # The resolving thread only posted the wake-up: the turn did not step there.
    assert (seen, mailbox.ended, mailbox.posted_from) == ([], [], [resolver])
    mailbox.run()
    assert seen == [("sent", "sunny", threading.get_ident())]
    assert mailbox.ended == [(op, ProviderOutcome("sunny", None), None)]
    assert len(mailbox.host) == 0


def test_a_failed_future_throws_its_exception_into_the_turn() -> None:
    mailbox, future, seen, op = Mailbox(), concurrent.futures.Future[Any](), [], uuid.uuid4()
    mailbox.host.add(op, awaiting(future, seen))
    mailbox.run()
    error = ValueError("the adapter said no")
    settle_on_a_thread(lambda: future.set_exception(error))
    assert seen == []
    mailbox.run()
    assert seen == [("thrown", error, threading.get_ident())]
    assert mailbox.ended == [(op, ProviderOutcome("failed: the adapter said no", None), None)]


def test_a_cancel_while_parked_on_a_future_throws_turn_cancelled_and_the_late_outcome_is_dropped() -> None:
    mailbox, future, seen, op = Mailbox(), concurrent.futures.Future[Any](), [], uuid.uuid4()
    mailbox.host.add(op, awaiting(future, seen))
    mailbox.run()
    mailbox.host.cancel(op)
    assert [(what, type(value)) for what, value, _ in seen] == [("cancelled", TurnCancelled)]
    ((ended_op, outcome, error),) = mailbox.ended
    assert ended_op == op and outcome is None
    assert isinstance(error, ProviderError) and error.kind == "cancelled"
    settle_on_a_thread(lambda: future.set_result("too late"))
    mailbox.run()  # the posted wake-up finds no turn waiting on that future
    assert len(seen) == 1 and len(mailbox.ended) == 1 and mailbox.host.steps_run == 1


def test_a_future_settled_before_it_is_awaited_is_taken_at_the_next_step() -> None:
    mailbox, future, seen, op = Mailbox(), concurrent.futures.Future[Any](), [], uuid.uuid4()
    future.set_result(7)
    mailbox.host.add(op, awaiting(future, seen))
    mailbox.run()
    assert seen == [("sent", 7, threading.get_ident())] and mailbox.posted_from == []
    assert mailbox.ended == [(op, ProviderOutcome("7", None), None)]


def test_a_host_that_cannot_post_throws_into_a_turn_that_awaits_a_future() -> None:
    ended: Ended = []
    steps: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
    host = TurnHost(wake=lambda: steps.put(host.step), finish=lambda *end: ended.append(end))
    seen: Seen = []
    host.add(uuid.uuid4(), awaiting(concurrent.futures.Future(), seen))
    while not steps.empty():
        steps.get_nowait()()
    ((_, outcome, error),) = ended
    assert outcome is None and isinstance(error, RuntimeError) and seen == []


def test_a_turn_worker_resumes_a_turn_on_its_own_thread_when_its_future_resolves() -> None:
    """The worker actor's ``post`` is a tell (``Resolved``): the resolving thread never steps the turn."""
    worker = TurnWorker.start("stepping-test")
    try:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        seen: Seen = []
        ended: queue.SimpleQueue[tuple[ProviderOutcome | None, BaseException | None]] = queue.SimpleQueue()
        names: list[str] = []

        def start() -> TurnSteps:
            names.append(threading.current_thread().name)
            return awaiting(future, seen)

        worker.tell(HostTurn(uuid.uuid4(), start, lambda _, outcome, error: ended.put((outcome, error))))
        worker.ask(GetWorkerStats(), timeout=T)  # the turn is added: its first step is queued before the next
        assert worker.ask(GetWorkerStats(), timeout=T) == WorkerStats(
            hosted=1, queued=0, steps_run=1
        )  # parked
        resolver = settle_on_a_thread(lambda: future.set_result("from the worker"))
        outcome, error = ended.get(timeout=T)
        assert error is None and outcome == ProviderOutcome("from the worker", None)
        ((what, value, ident),) = seen
        assert (what, value) == ("sent", "from the worker") and ident != resolver
        assert names == ["kbus-turn-stepping-test"]
    finally:
        worker.stop(timeout=T)


# ---------------------------------------------------------------------------------------------- drive
def test_drive_sends_a_futures_result_and_throws_its_exception() -> None:
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    done.set_result("r")
    assert drive(awaiting(done, []), RecordingTurnIO()) == ProviderOutcome("r", None)
    failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
    failed.set_exception(ValueError("x"))
    assert drive(awaiting(failed, []), RecordingTurnIO()) == ProviderOutcome("failed: x", None)


def test_drive_throws_turn_cancelled_into_a_turn_waiting_on_a_future_once_cancelled() -> None:
    io = RecordingTurnIO()
    io.cancelled.set()
    seen: Seen = []
    with pytest.raises(ProviderError) as err:
        drive(awaiting(concurrent.futures.Future(), seen), io)  # a future that never settles
    assert err.value.kind == "cancelled"
    assert [what for what, _, _ in seen] == ["cancelled"]


# --------------------------------------------------------------------------------------- on the Router
class FutureProvider:
    """An inline provider (a test double) whose turn waits for a future the test settles."""

    name = "scripted"
    placement = "inline"

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.seen: Seen = []

    def steps(self, request: TurnRequest, io: TurnIO) -> TurnSteps:
        io.emit(Submitted(model_context(request)))
        return (yield from awaiting(self.future, self.seen))

    def run_turn(self, request: TurnRequest, io: TurnIO) -> ProviderOutcome:
        raise AssertionError("the Router steps this provider's turns")

    def close(self) -> None:
        pass


def router_with(make_node: Callable[..., Node], tmp_path: Path, provider: FutureProvider) -> RouterClient:
    node = make_node("n1", registry=registry())
    node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider})
    return RouterClient(node, "n1/router", timeout=T)


def start(router: RouterClient, parent: uuid.UUID) -> uuid.UUID:
    spec = StartTurn(
        user_id="u1", parent_operation_id=parent, model="scripted", input="go", tool_description="run a tool"
    )
    return router.start_turn(spec).operation_id


def test_the_router_steps_an_inline_turn_on_its_own_thread_when_its_future_resolves(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    provider = FutureProvider()
    router = router_with(make_node, tmp_path, provider)
    op = start(router, uuid.uuid4())
    assert isinstance(router.next_event(op), TurnInput)  # the turn has started and waits on its future
    resolver = settle_on_a_thread(lambda: provider.future.set_result("answer"))
    done = router.next_event(op)
    assert isinstance(done, TurnCompleted) and done.answer == "answer"
    ((what, _, ident),) = provider.seen
    assert what == "sent" and ident not in (resolver, threading.get_ident())


def test_a_router_cancel_of_a_turn_parked_on_a_future_gives_one_receipt_and_drops_the_late_outcome(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    provider = FutureProvider()
    router = router_with(make_node, tmp_path, provider)
    parent = uuid.uuid4()
    op = start(router, parent)
    assert isinstance(router.next_event(op), TurnInput)
    assert router.cancel(op) == (op,)
    receipt = router.receipt(op)
    assert receipt.status == "cancelled"
    with pytest.raises(RouterTurnCancelled):
        router.next_event(op)
    provider.future.set_result("too late")
    router.stats()  # a round trip through the Router's mailbox after the late outcome's wake-up
    assert [what for what, _, _ in provider.seen] == ["cancelled"]
    assert router.receipts_for(parent) == (receipt,) and router.receipt(op) == receipt
