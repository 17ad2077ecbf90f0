"""Provider turns as state machines an actor hosts: no thread per turn (issue 15, item 5).

A provider turn is a generator (``providers/base.py``: ``TurnSteps``) that yields what it waits for.
``TurnHost`` keeps the turns one actor hosts and steps them on that actor's thread, one step per mailbox
message (``STEP``), so a cancel, a tool result or another request is handled between any two steps:

- a FIFO of turns ready to run, and at most one *active* turn: the one that yielded ``Pause`` keeps the
  host until it yields anything else (a model generating keeps the model), then the next ready turn runs;
- a turn waiting for a tool result (``AwaitResult``), a future (``AwaitFuture``), a delay (``Sleep``) or
  its cancel (``AwaitCancel``) is parked and holds nothing; a result that arrives before it is awaited is
  kept for it;
- a future's outcome comes back by message: its done-callback (on whichever thread settles it) only hands
  the wake-up to the host's actor (``post``), and the turn's next step, on the host's thread, is sent the
  result or has the exception thrown in; an outcome that settles after the turn ended is dropped;
- ``cancel`` throws ``TurnCancelled`` into the turn wherever it waits, and the turn ends there.

Who hosts: the Router itself for ``"inline"`` providers (the scripted model, codex); a ``TurnWorker`` actor
for the others: the one a provider owns (``"owner"``: the local model, whose mailbox is then its queue of
turns and token counts) or one of the Router's ``TurnPool`` (``"pool"``: blocking HTTP providers, and any
provider with only a blocking ``run_turn``), bounded by configuration. ``run_hosted`` is the blocking bridge
for a direct caller of a hosted provider's ``run_turn`` (tests, not actors).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import pykka

from actors.router.messages import TurnCancelled
from actors.router.providers.base import (
    AwaitCancel,
    AwaitFuture,
    AwaitResult,
    Pause,
    ProviderError,
    ProviderOutcome,
    Sleep,
    TurnIO,
    TurnSteps,
)
from actors.types import ToolResult
from transport.records import frozen

log = logging.getLogger(__name__)

Finish = Callable[[uuid.UUID, ProviderOutcome | None, BaseException | None], None]
"""``finish(op, outcome, error)``: a hosted turn ended (exactly one of outcome and error)."""

Later = Callable[[float, Callable[[], None]], object]
"""``later(seconds, fn)``: run ``fn`` on the host's thread after ``seconds`` (by a tell from a timer)."""

Awaiting = Callable[[uuid.UUID, str], None]
"""``awaiting(op, call_id)``: the turn parked for that call's result (a bridge answers it)."""

Post = Callable[[Callable[[], None]], None]
"""``post(fn)``: run ``fn`` on the host's thread soon (by a tell to its actor, ``Resolved``); callable from
any thread."""


@frozen
class Step:
    """Run the host's next step (a tell to itself; at most one is in the mailbox at a time)."""


STEP: Final = Step()


@frozen
class Resolved:
    """A future a hosted turn waits on has settled: run ``fn`` (``TurnHost``'s) on the host's thread."""

    fn: Callable[[], None]


@dataclass(eq=False, slots=True)
class _Hosted:
    steps: TurnSteps
    send: Any = None  # what the next step is sent (a tool result, a future's result)
    throw: BaseException | None = None  # what the next step throws in instead (a future's exception)
    waits_for: str | None = None  # the call id it is parked on
    future: concurrent.futures.Future[Any] | None = None  # the future it is parked on
    results: dict[str, ToolResult] = field(default_factory=dict)  # arrived before they were awaited
    parked: bool = False


class TurnHost:
    """The stepped turns of one actor; every method runs on that actor's thread (no lock). ``post`` is how a
    settled future's wake-up reaches that thread; a host without it throws ``RuntimeError`` into a turn that
    yields ``AwaitFuture``."""

    def __init__(
        self,
        wake: Callable[[], None],
        finish: Finish,
        later: Later | None = None,
        awaiting: Awaiting | None = None,
        post: Post | None = None,
    ) -> None:
        self._wake = wake
        self._finish = finish
        self._later = later
        self._awaiting = awaiting
        self._post = post
        self._turns: dict[uuid.UUID, _Hosted] = {}
        self._ready: collections.deque[uuid.UUID] = collections.deque()
        self._active: uuid.UUID | None = None
        self._woken = False
        self.steps_run = 0

    def __len__(self) -> int:
        return len(self._turns)

    @property
    def queued(self) -> int:
        """Turns ready to run and waiting for the host (the active one not counted)."""
        return len(self._ready)

    def steps_next(self, op: uuid.UUID) -> bool:
        """``op`` is active or ready and a ``STEP`` is in the mailbox: it runs at that step or, behind
        other ready turns, at one of the next."""
        return self._woken and op in self._turns and (self._active == op or op in self._ready)

    def add(self, op: uuid.UUID, steps: TurnSteps) -> None:
        self._turns[op] = _Hosted(steps)
        self._ready.append(op)
        self._poke()

    def resume(self, op: uuid.UUID, call_id: str, result: ToolResult) -> None:
        turn = self._turns.get(op)
        if turn is None:
            return  # ended meanwhile (cancelled): the result has nobody to go to
        if turn.parked and turn.waits_for == call_id:
            turn.parked, turn.waits_for, turn.send = False, None, result
            self._ready.append(op)
            self._poke()
        else:
            turn.results[call_id] = result

    def wake_up(self, op: uuid.UUID) -> None:
        """A parked turn's delay is over."""
        turn = self._turns.get(op)
        if turn is not None and turn.parked and turn.waits_for is None and turn.future is None:
            turn.parked = False
            self._ready.append(op)
            self._poke()

    def cancel(self, op: uuid.UUID, cause: BaseException | None = None) -> None:
        """End the turn where it waits: ``TurnCancelled`` (or ``cause``) is thrown into it."""
        turn = self._turns.pop(op, None)
        if turn is None:
            return
        if self._active == op:
            self._active = None
        with contextlib.suppress(ValueError):
            self._ready.remove(op)
        error: BaseException = cause if cause is not None else TurnCancelled("turn cancelled")
        outcome: ProviderOutcome | None = None
        try:
            turn.steps.throw(error)
        except StopIteration as stop:
            outcome = stop.value
        except BaseException as exc:  # noqa: BLE001 - how the cancelled turn ended, reported as such
            error = exc
        else:
            error = ProviderError("cancelled", "turn cancelled")
        finally:
            turn.steps.close()
        self._report(op, outcome, None if outcome is not None else error)
        self._poke()

    def cancel_all(self) -> None:
        for op in list(self._turns):
            self.cancel(op)

    def step(self) -> None:
        """One step of the active turn (or of the next ready one). Runs on ``STEP``."""
        self._woken = False
        op = self._active
        if op is None:
            while self._ready and op is None:
                candidate = self._ready.popleft()
                if candidate in self._turns:
                    op = candidate
            if op is None:
                return
            self._active = op
        turn = self._turns[op]
        send, turn.send = turn.send, None
        throw, turn.throw = turn.throw, None
        self.steps_run += 1
        try:
            wait = turn.steps.send(send) if throw is None else turn.steps.throw(throw)
        except StopIteration as stop:
            self._end(op, stop.value, None)
        except BaseException as exc:  # noqa: BLE001 - reported to the Router, which decides the receipt
            self._end(op, None, exc)
        else:
            match wait:
                case Pause():
                    pass  # stays active: its next step comes before any other turn's
                case AwaitResult(call_id=call_id):
                    self._active = None
                    if call_id in turn.results:
                        turn.send = turn.results.pop(call_id)
                        self._ready.append(op)
                    else:
                        turn.parked, turn.waits_for = True, call_id
                        if self._awaiting is not None:
                            self._awaiting(op, call_id)
                case Sleep(seconds=seconds):
                    self._active = None
                    turn.parked = True
                    if self._later is None:
                        time.sleep(
                            max(0.0, seconds)
                        )  # a host without timers (a worker): bounded by the script
                        self.wake_up(op)
                    else:
                        self._later(max(0.0, seconds), lambda: self.wake_up(op))
                case AwaitFuture(future=future):
                    self._active = None
                    if future.done():  # settled already: taken here, on this thread, at the next step
                        self._take(turn, future)
                        self._ready.append(op)
                    elif self._post is None:
                        turn.throw = RuntimeError("this turn host cannot wait for a future")
                        self._ready.append(op)
                    else:
                        turn.parked, turn.future = True, future
                        post = self._post

                        def settled(
                            done: concurrent.futures.Future[Any], op: uuid.UUID = op, turn: _Hosted = turn
                        ) -> None:
                            post(lambda: self._settled(op, turn, done))  # any thread: only a tell

                        future.add_done_callback(settled)
                case AwaitCancel():
                    self._active = None
                    turn.parked = True
        self._poke()

    def _settled(self, op: uuid.UUID, turn: _Hosted, future: concurrent.futures.Future[Any]) -> None:
        """On the host's thread: ``future`` settled. Ready the turn that waits on it; a turn that ended or
        was cancelled meanwhile (or waits on something else) is not woken: the outcome is dropped."""
        if self._turns.get(op) is not turn or turn.future is not future:
            return
        turn.parked, turn.future = False, None
        self._take(turn, future)
        self._ready.append(op)
        self._poke()

    @staticmethod
    def _take(turn: _Hosted, future: concurrent.futures.Future[Any]) -> None:
        """What the turn's next step gets from a settled future: its result, or its exception thrown."""
        if future.cancelled():
            turn.throw = concurrent.futures.CancelledError()
            return
        error = future.exception()
        if error is not None:
            turn.throw = error
        else:
            turn.send = future.result()

    def _end(self, op: uuid.UUID, outcome: ProviderOutcome | None, error: BaseException | None) -> None:
        self._turns.pop(op, None)
        if self._active == op:
            self._active = None
        self._report(op, outcome, error)

    def _report(self, op: uuid.UUID, outcome: ProviderOutcome | None, error: BaseException | None) -> None:
        try:
            self._finish(op, outcome, error)
        except Exception:
            log.exception("reporting the end of turn %s failed", op)

    def _poke(self) -> None:
        if self._woken:
            return
        if self._active is not None or any(op in self._turns for op in self._ready):
            self._woken = True
            self._wake()


# ----------------------------------------------------------------------------------- worker actors
@frozen
class HostTurn:
    """Host a turn: ``start()`` (called on the worker's thread) gives its steps; its end goes to
    ``finish``, and, for a bridge, each parked ``AwaitResult`` to ``awaiting``."""

    operation_id: uuid.UUID
    start: Callable[[], TurnSteps]
    finish: Finish
    awaiting: Awaiting | None = None


@frozen
class ResumeTurn:
    operation_id: uuid.UUID
    call_id: str
    result: ToolResult


@frozen
class CancelTurn:
    operation_id: uuid.UUID
    cause: BaseException | None = None


@frozen
class RunCall:
    """Run ``fn()`` on the worker's thread between steps (a token count) and hand ``done`` its result or
    its error."""

    fn: Callable[[], Any]
    done: Callable[[Any, BaseException | None], None]


@frozen
class WorkerStats:
    hosted: int
    queued: int
    steps_run: int


@frozen
class GetWorkerStats:
    pass


class TurnWorker(pykka.ThreadingActor):
    """An actor that hosts stepped provider turns (``TurnHost``) and runs calls between their steps.

    Its thread is named ``kbus-turn-<name>``. ``on_stop`` runs once its mailbox is closed: its remaining
    turns are cancelled and ``closing`` (if any) runs on its thread (a provider frees its model there)."""

    def __init__(self, name: str, closing: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._name = name
        self._closing = closing
        self._finishes: dict[uuid.UUID, Finish] = {}
        self._awaitings: dict[uuid.UUID, Awaiting] = {}
        ref = self.actor_ref
        self.host = TurnHost(
            wake=lambda: _tell_quietly(ref, STEP),
            finish=self._finished,
            awaiting=self._parked,
            post=lambda fn: _tell_quietly(ref, Resolved(fn)),
        )

    def on_start(self) -> None:
        threading.current_thread().name = f"kbus-turn-{self._name}"

    def on_stop(self) -> None:
        self.host.cancel_all()
        if self._closing is not None:
            try:
                self._closing()
            except Exception:
                log.exception("%s: closing failed", self._name)

    def on_receive(self, message: Any) -> Any:
        match message:
            case Step():
                self.host.step()
            case HostTurn(operation_id=op, start=start, finish=finish, awaiting=awaiting):
                self._finishes[op] = finish
                if awaiting is not None:
                    self._awaitings[op] = awaiting
                try:
                    steps = start()
                except BaseException as exc:  # noqa: BLE001 - the turn fails, the worker lives
                    self._finished(op, None, exc)
                else:
                    self.host.add(op, steps)
            case ResumeTurn(operation_id=op, call_id=call_id, result=result):
                self.host.resume(op, call_id, result)
            case Resolved(fn=fn):
                fn()
            case CancelTurn(operation_id=op, cause=cause):
                self.host.cancel(op, cause)
            case RunCall(fn=fn, done=done):
                try:
                    value = fn()
                except Exception as exc:  # noqa: BLE001 - handed to whoever asked
                    done(None, exc)
                else:
                    done(value, None)
            case GetWorkerStats():
                return WorkerStats(len(self.host), self.host.queued, self.host.steps_run)
            case _:
                log.warning("%s: unexpected message %r", self._name, type(message).__name__)
        return None

    def _finished(self, op: uuid.UUID, outcome: ProviderOutcome | None, error: BaseException | None) -> None:
        self._awaitings.pop(op, None)
        finish = self._finishes.pop(op, None)
        if finish is not None:
            finish(op, outcome, error)

    def _parked(self, op: uuid.UUID, call_id: str) -> None:
        awaiting = self._awaitings.get(op)
        if awaiting is not None:
            awaiting(op, call_id)


def _tell_quietly(ref: Any, message: Any) -> None:
    try:
        ref.tell(message)
    except pykka.ActorDeadError:
        log.debug("turn worker gone before %r", message)


class TurnPool:
    """At most ``size`` ``TurnWorker`` actors, started on first use; turns are given out round-robin.
    Owned by the Router (its thread only)."""

    def __init__(self, size: int, name: str) -> None:
        if int(size) < 1:
            raise ValueError(f"turn_workers must be at least 1, not {size!r}")
        self._size = int(size)
        self._name = name
        self._workers: list[Any] = []
        self._next = 0

    def __len__(self) -> int:
        return len(self._workers)

    def pick(self) -> Any:
        if len(self._workers) < self._size:
            ref = TurnWorker.start(f"{self._name}-{len(self._workers)}")
            self._workers.append(ref)
            return ref
        ref = self._workers[self._next % self._size]
        self._next += 1
        return ref

    def stop(self, timeout: float) -> None:
        for ref in self._workers:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.stop(block=False)
        for ref in self._workers:
            try:
                ref.actor_stopped.wait(timeout)
            except Exception:  # noqa: BLE001 - stopping goes on
                log.debug("turn worker did not stop")
        self._workers.clear()


def run_hosted(
    worker: Any, start: Callable[[], TurnSteps], io: TurnIO, *, bound_s: float = 3600.0
) -> ProviderOutcome:
    """A hosted provider's ``run_turn`` for a direct caller (never an actor): host the turn on ``worker``,
    answer each tool call it awaits with ``io.wait_result`` on the calling thread (its ``TurnCancelled`` is
    thrown into the turn), and return how it ended. ``bound_s`` bounds each wait for the worker."""
    inbox: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
    op = uuid.uuid4()

    def finish(_: uuid.UUID, outcome: ProviderOutcome | None, error: BaseException | None) -> None:
        inbox.put(("done", outcome, error))

    def awaiting(_: uuid.UUID, call_id: str) -> None:
        inbox.put(("await", call_id, None))

    try:
        worker.tell(HostTurn(op, start, finish, awaiting))
    except pykka.ActorDeadError as exc:
        raise ProviderError("unavailable", "the provider's actor has stopped") from exc
    while True:
        try:
            kind, a, b = inbox.get(timeout=bound_s)
        except queue.Empty:
            _tell_quietly(worker, CancelTurn(op))
            why = f"the provider's actor did not answer within {bound_s}s"
            raise ProviderError("timed_out", why) from None
        if kind == "done":
            if b is not None:
                raise b
            outcome: ProviderOutcome = a
            return outcome
        try:
            result = io.wait_result(a)
        except TurnCancelled as exc:
            _tell_quietly(worker, CancelTurn(op, exc))
        else:
            _tell_quietly(worker, ResumeTurn(op, a, result))
