"""The Shim (seed 003 "Shim API"; RULES.md SH-01..SH-24, Appendix C.1/C.3): one small actor per conversation.

``infer(input)`` runs exactly one native Codex turn on the shim's conversation key and returns one atomic
``ShimOutput``. Every dynamic tool call of that turn is converted to a box once (``BoxCodec``), handed to
the consumer's ``ToolCallLauncher`` (which starts or queues the tool and returns promptly), and then answered
at once with ``ASYNC_TOOL_ACKNOWLEDGEMENT``; the turn goes on without the tool's result. Calls are launched
one at a time, in provider order, with no limit, timer or batching.

The actor is a state machine and never waits on anything: every adapter call is ``self.ask`` with a
continuation, and a launcher that returns a future reports back through the mailbox when it resolves.
Its mailbox is the serialisation SH-22 asks for: ``infer`` requests arrive in order and wait in a queue for
the running one; ``record_box`` and ``pending_box_count`` are answered at once, even mid-turn.

Shim ops are local (in-process) messages, not wire messages: the codec and the launcher are the caller's
Python objects and a box may be any Python value. The adapter it drives may live on any node.

Failure rules: a start the adapter rejects re-raises that error and leaves the shim ready with its pending
boxes; any failure or cancellation after the start was accepted abandons the native turn and poisons the
shim, after which ``infer`` raises ``AdapterError(UNAVAILABLE, "shim poisoned: ...")`` without contacting
the adapter. A launch that succeeded is never rolled back or repeated.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import pykka

from actors.base import BusActor
from actors.codex.messages import Abandon, NextEvent, Respond, StartTurn, TurnStarted
from actors.codex.types import (
    ASYNC_TOOL_ACKNOWLEDGEMENT,
    AdapterError,
    CodexToolCall,
    Done,
    ErrorEvent,
    ErrorKind,
    TextDelta,
    ToolCallEvent,
)
from actors.types import ToolResult
from transport.errors import BusError, Expired
from transport.pending import Reply, forbid_blocking
from transport.records import frozen

if TYPE_CHECKING:
    from transport.node import Node

log = logging.getLogger(__name__)

B = TypeVar("B")
B_contra = TypeVar("B_contra", contravariant=True)

# One adapter request (start, one event, one acknowledgement) may take this long. It bounds a single
# reply, never the turn: a turn of many events or a slow launch is not timed (SH-06).
ADAPTER_TIMEOUT = 3600.0

ACKNOWLEDGEMENT = ToolResult(success=True, output=ASYNC_TOOL_ACKNOWLEDGEMENT)  # SH-04


class AdapterHandle(Protocol):
    """What the shim needs of an ``Adapter`` handle: where its actor is, the node the handle talks through
    (the shim's actor runs there), and releasing the handle."""

    @property
    def address(self) -> str: ...

    @property
    def node(self) -> Node: ...

    def close(self) -> None: ...


class LaunchRejected(Exception):
    """Raised by a launcher (or set on its future): the tool was certainly not launched (SH-07)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BoxCodec(Protocol[B]):
    def tool_call_box(self, call: CodexToolCall) -> B:
        """The canonical box for one dynamic call; called exactly once per call (SH-02)."""
        ...

    def box_text(self, box: B) -> str:
        """The box's complete Codex-visible text (SH-21)."""
        ...


class ToolCallLauncher(Protocol[B_contra]):
    def launch(self, box: B_contra) -> concurrent.futures.Future[None] | pykka.Future[None] | None:
        """Start or queue the tool and return promptly; raise (or fail the future with) ``LaunchRejected``
        when the tool was not launched. Any other exception means "possibly launched" (SH-24)."""
        ...


@frozen
class ShimText:
    text: str


@frozen
class ShimBox(Generic[B]):
    box: B


@frozen
class ShimOutput(Generic[B]):
    items: tuple[ShimText | ShimBox[B], ...]


# ------------------------------------------------------------------------------- the shim's local ops


@frozen
class RecordBoxes:
    boxes: tuple[Any, ...]


@frozen
class PendingCount:
    pass


@frozen
class Infer:
    job_id: int
    input: str
    future: InferFuture


@frozen
class CancelInfer:
    job_id: int


@frozen
class CloseShim:
    """Stop once no native turn is left running: a start in flight is waited for and its turn abandoned,
    an active turn is abandoned; ``done`` resolves when the actor has stopped."""

    done: concurrent.futures.Future[None]


@frozen
class _LaunchSettled:
    """A launcher's future resolved (told by its callback or waiter thread)."""

    job_id: int
    call_id: str
    error: BaseException | None


# -------------------------------------------------------------------------------------------- states


class _Job:
    """One ``infer`` request: its input, its caller's future, and the output built so far (linear)."""

    __slots__ = ("cancelled", "future", "input", "items", "job_id", "text")

    def __init__(self, job_id: int, input: str, future: InferFuture) -> None:
        self.job_id = job_id
        self.input = input
        self.future = future
        self.cancelled = False
        self.items: list[ShimText | ShimBox[Any]] = []
        self.text: list[str] = []  # adjacent deltas not yet closed into one ShimText (SH-11)

    def add_text(self, text: str) -> None:
        if text:  # empty deltas never become a Text("")
            self.text.append(text)

    def add_box(self, box: Any) -> None:
        self._close_text()
        self.items.append(ShimBox(box))

    def output(self) -> ShimOutput[Any]:
        self._close_text()
        return ShimOutput(tuple(self.items))

    def _close_text(self) -> None:
        if self.text:
            self.items.append(ShimText("".join(self.text)))
            self.text = []


@frozen
class Ready:
    pass


@frozen
class Starting:
    job: _Job
    boxes_used: int  # how many pending boxes prefix this start's input


@frozen
class Draining:
    job: _Job
    turn_id: str


@frozen
class Launching:
    job: _Job
    turn_id: str
    call_id: str


@frozen
class Acknowledging:
    job: _Job
    turn_id: str
    call_id: str


@frozen
class Poisoned:
    error: AdapterError


State = Ready | Starting | Draining | Launching | Acknowledging | Poisoned


def as_adapter_error(error: BaseException) -> BaseException:
    """An adapter reply's error as the shim raises it: ``AdapterError`` unchanged; a transport outcome
    (the adapter actor gone, a deadline passed) as ``UNAVAILABLE`` (MB-10)."""
    if isinstance(error, AdapterError) or not isinstance(error, BusError):
        return error
    mapped = AdapterError(
        ErrorKind.UNAVAILABLE, f"codex adapter unreachable: {type(error).__name__}: {error}"
    )
    mapped.__cause__ = error
    return mapped


def poisoned_by(error: BaseException) -> AdapterError:
    """SH-14's error for every later ``infer``, naming the failure that poisoned the shim."""
    if isinstance(error, AdapterError):
        why = f"{error.kind.value}: {error.message}"
    else:
        why = f"{type(error).__name__}: {error}"
    return AdapterError(ErrorKind.UNAVAILABLE, f"shim poisoned: {why}"[:2000])


def turn_input(texts: Iterable[str], input: str) -> str:
    """SH-18: each pending box's text in order, then the ordinary input, joined by a blank line; an empty
    ordinary input is left out."""
    parts = list(texts)
    if input:
        parts.append(input)
    return "\n\n".join(parts)


class ShimActor(BusActor, Generic[B]):
    """See the module docstring. Spawned by ``Shim``; one per conversation key."""

    def __init__(
        self,
        node: Node,
        address: str,
        *,
        adapter: str,
        conversation_key: str,
        codec: BoxCodec[B],
        launcher: ToolCallLauncher[B],
        adapter_timeout: float = ADAPTER_TIMEOUT,
    ) -> None:
        super().__init__(node, address)
        self._adapter = adapter
        self._key = conversation_key
        self._codec = codec
        self._launcher = launcher
        self._adapter_timeout = adapter_timeout
        self._pending: list[B] = []
        self._queue: deque[_Job] = deque()
        self._state: State = Ready()
        self._closing: concurrent.futures.Future[None] | None = None

    # ------------------------------------------------------------------------------------ dispatch
    def on_local(self, message: Any) -> Any:
        match message:
            case RecordBoxes(boxes=boxes):
                self._pending.extend(boxes)  # SH-17: in any state, even poisoned (SH-14)
                return len(self._pending)
            case PendingCount():
                return len(self._pending)
            case Infer(job_id=job_id, input=text, future=future):
                self._queue.append(_Job(job_id, text, future))
                self._next_job()
                return None
            case CancelInfer(job_id=job_id):
                self._cancel(job_id)
                return None
            case CloseShim(done=done):
                if self._closing is None:
                    self._closing = done
                    if not isinstance(self._state, Starting):
                        self._close_now()  # else once the start's reply is in (_on_started)
                else:
                    self._closing.add_done_callback(lambda _: _settle(done))
                return None
            case _LaunchSettled(job_id=job_id, call_id=call_id, error=error):
                state = self._state
                if isinstance(state, Launching) and state.job.job_id == job_id and state.call_id == call_id:
                    self._launch_settled(state, error)
                return None
        return super().on_local(message)

    def on_stop(self) -> None:
        state = self._state
        if isinstance(state, Draining | Launching | Acknowledging):
            self._abandon(state.turn_id)  # stopped without CloseShim (node stop): best effort
        self._fail_all()
        super().on_stop()
        if self._closing is not None:
            _settle(self._closing)

    def _fail_all(self) -> None:
        for job in (*self._jobs_of(self._state), *self._queue):
            _settle(job.future, error=AdapterError(ErrorKind.UNAVAILABLE, "the shim was closed"))
        self._queue.clear()

    def _close_now(self) -> None:
        """CloseShim with no start in flight: abandon an active turn (waiting for the adapter to confirm,
        so the key and the child are free before the handle is released), then stop."""
        state = self._state
        self._fail_all()
        self._state = Poisoned(AdapterError(ErrorKind.UNAVAILABLE, "the shim was closed"))
        if isinstance(state, Draining | Launching | Acknowledging):
            self._abandon(state.turn_id, then=self._stop_soon)
        else:
            self._stop_soon()

    def _stop_soon(self) -> None:
        self.actor_ref.stop(block=False)  # after the messages already in the mailbox

    @staticmethod
    def _jobs_of(state: State) -> tuple[_Job, ...]:
        job = getattr(state, "job", None)
        return (job,) if job is not None else ()

    # ------------------------------------------------------------------------------------ starting
    def _next_job(self) -> None:
        """Start the oldest queued ``infer`` if no other one runs (SH-22: one at a time, in order)."""
        while self._queue and isinstance(self._state, Ready | Poisoned):
            job = self._queue.popleft()
            if job.cancelled or job.future.done():
                continue  # cancelled while queued: nothing was started
            if isinstance(self._state, Poisoned):
                _settle(job.future, error=self._state.error)  # SH-14: the adapter is not contacted
                continue
            self._start(job)

    def _start(self, job: _Job) -> None:
        used = len(self._pending)
        try:
            text = turn_input((self._codec.box_text(box) for box in self._pending), job.input)
        except BaseException as exc:  # noqa: BLE001 - the codec's bug, reported to the caller
            _settle(job.future, error=exc)  # nothing was started: the shim stays ready
            return
        self._state = Starting(job, used)
        self.ask(
            self._adapter,
            StartTurn(conversation_key=self._key, input=text),
            lambda reply: self._on_started(job, reply),
            timeout=self._adapter_timeout,
        )

    def _on_started(self, job: _Job, reply: Reply) -> None:
        state = self._state
        assert isinstance(state, Starting) and state.job is job
        if reply.error is not None or not isinstance(reply.message, TurnStarted):
            # SH-15/SH-19: a start rejection leaves the shim ready and the pending boxes untouched.
            error = (
                as_adapter_error(reply.error)
                if reply.error is not None
                else AdapterError(
                    ErrorKind.PROTOCOL, f"unexpected start reply {type(reply.message).__name__}"
                )
            )
            self._state = Ready()
            _settle(job.future, error=error)
            if self._closing is not None:
                self._close_now()
            else:
                self._next_job()
            return
        turn_id = reply.message.turn_id
        del self._pending[: state.boxes_used]  # SH-19: removed only once the start was accepted
        if self._closing is not None:
            self._state = Draining(job, turn_id)
            self._close_now()
            return
        if job.cancelled:
            # SH-16: cancelled before acceptance. The turn is abandoned and the shim stays ready.
            self._abandon(turn_id)
            self._state = Ready()
            self._next_job()
            return
        self._state = Draining(job, turn_id)
        self._read(job, turn_id)

    # ------------------------------------------------------------------------------------- draining
    def _read(self, job: _Job, turn_id: str) -> None:
        self.ask(
            self._adapter,
            NextEvent(turn_id=turn_id),
            lambda reply: self._on_event(job, turn_id, reply),
            timeout=self._adapter_timeout,
        )

    def _on_event(self, job: _Job, turn_id: str, reply: Reply) -> None:
        state = self._state
        if not (isinstance(state, Draining) and state.job is job):
            return  # cancelled meanwhile: the turn was abandoned then
        if reply.error is not None:
            self._fail(job, turn_id, as_adapter_error(reply.error), abandon=True)  # SH-13
            return
        match reply.message:
            case TextDelta(text=text):
                job.add_text(text)
                self._read(job, turn_id)
            case ToolCallEvent(call=call):
                self._launch(job, turn_id, call)
            case Done():
                self._state = Ready()
                _settle(job.future, result=job.output())  # SH-09/SH-10: only after Done
                self._next_job()
            case ErrorEvent() as event:
                self._fail(job, turn_id, event.error, abandon=False)  # SH-12: passed through unchanged
            case other:
                error = AdapterError(ErrorKind.PROTOCOL, f"unexpected adapter event {type(other).__name__}")
                self._fail(job, turn_id, error, abandon=True)

    # ------------------------------------------------------------------------------------ launching
    def _launch(self, job: _Job, turn_id: str, call: CodexToolCall) -> None:
        self._state = Launching(job, turn_id, call.call_id)
        try:
            box = self._codec.tool_call_box(call)  # SH-02: exactly once per call
            job.add_box(box)  # SH-20: output only, never pending
            launched = self._launcher.launch(box)  # SH-03
        except BaseException as exc:  # noqa: BLE001 - LaunchRejected or SH-24's "possibly launched"
            self._launch_settled(Launching(job, turn_id, call.call_id), exc)
            return
        if launched is None:
            self._launch_settled(Launching(job, turn_id, call.call_id), None)
            return
        self._watch(job.job_id, call.call_id, launched)

    def _watch(self, job_id: int, call_id: str, launched: Any) -> None:
        """Report a launcher's future through the mailbox when it resolves; never wait for it here."""
        ref = self.actor_ref

        def tell(error: BaseException | None) -> None:
            try:
                ref.tell(_LaunchSettled(job_id, call_id, error))
            except pykka.ActorDeadError:
                log.info("shim stopped before launch of %s settled", call_id)

        if isinstance(launched, concurrent.futures.Future):

            def done(fut: concurrent.futures.Future[Any]) -> None:
                if fut.cancelled():
                    tell(RuntimeError(f"the launch future of call {call_id} was cancelled"))
                else:
                    tell(fut.exception())

            launched.add_done_callback(done)
        elif isinstance(launched, pykka.Future):
            # pykka futures have no callbacks: one short-lived thread waits so the mailbox never does.
            def wait() -> None:
                try:
                    launched.get()
                except BaseException as exc:  # noqa: BLE001 - handed to the actor
                    tell(exc)
                else:
                    tell(None)

            threading.Thread(target=wait, name=f"shim-launch-{call_id}", daemon=True).start()
        else:
            tell(TypeError(f"launcher returned {type(launched).__name__}, not None or a future"))

    def _launch_settled(self, state: Launching, error: BaseException | None) -> None:
        job, turn_id, call_id = state.job, state.turn_id, state.call_id
        if error is None:
            # SH-04: answer that exact call at once with the acknowledgement, then keep draining.
            self._state = Acknowledging(job, turn_id, call_id)
            self.ask(
                self._adapter,
                Respond(turn_id=turn_id, call_id=call_id, result=ACKNOWLEDGEMENT),
                lambda reply: self._on_acknowledged(job, turn_id, reply),
                timeout=self._adapter_timeout,
            )
        elif isinstance(error, LaunchRejected):
            # SH-07: not launched; the call is never answered, later calls never launched.
            self._fail(job, turn_id, AdapterError(ErrorKind.LAUNCH_REJECTED, error.message), abandon=True)
        else:
            self._fail(job, turn_id, error, abandon=True)  # SH-24: raised unchanged; possibly launched

    def _on_acknowledged(self, job: _Job, turn_id: str, reply: Reply) -> None:
        state = self._state
        if not (isinstance(state, Acknowledging) and state.job is job):
            return
        if reply.error is not None:
            self._fail(job, turn_id, as_adapter_error(reply.error), abandon=True)  # SH-13
            return
        self._state = Draining(job, turn_id)
        self._read(job, turn_id)

    # ------------------------------------------------------------------------------ failing, cancel
    def _fail(self, job: _Job, turn_id: str, error: BaseException, *, abandon: bool) -> None:
        """A failure after the start was accepted: abandon the turn, poison the shim (SH-13)."""
        if abandon:
            self._abandon(turn_id)
        self._state = Poisoned(poisoned_by(error))
        _settle(job.future, error=error)
        self._next_job()

    def _cancel(self, job_id: int) -> None:
        for job in self._queue:
            if job.job_id == job_id:
                job.cancelled = True  # dropped when its turn comes: nothing was started
                return
        state = self._state
        match state:
            case Starting(job=job) if job.job_id == job_id:
                job.cancelled = True  # decided when the start's reply arrives (SH-16)
            case (
                Draining(job=job, turn_id=turn_id)
                | Launching(job=job, turn_id=turn_id)
                | Acknowledging(job=job, turn_id=turn_id)
            ) if job.job_id == job_id:
                job.cancelled = True
                error = AdapterError(ErrorKind.INTERRUPTED, "infer was cancelled")
                self._fail(job, turn_id, error, abandon=True)  # SH-16: abandoned and poisoned

    def _abandon(self, turn_id: str, then: Callable[[], None] | None = None) -> None:
        def abandoned(reply: Reply) -> None:
            if reply.error is not None:
                log.info("%s: abandoning turn %s failed: %r", self.address, turn_id, reply.error)
            if then is not None:
                then()

        self.ask(self._adapter, Abandon(turn_id=turn_id), abandoned, timeout=self._adapter_timeout)


def _settle(
    future: concurrent.futures.Future[Any], *, result: Any = None, error: BaseException | None = None
) -> None:
    """Finish a caller's future unless the caller cancelled it meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


# ------------------------------------------------------------------------------------------- facade


class InferFuture(concurrent.futures.Future[Any]):
    """The future of one ``infer``. ``cancel()`` sends ``CancelInfer`` (SH-16): before the start was
    accepted the shim stays ready, after it the native turn is abandoned and the shim poisoned."""

    def __init__(self) -> None:
        super().__init__()
        self._on_cancel: Callable[[], None] | None = None

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled and self._on_cancel is not None:
            self._on_cancel()
        return cancelled


_job_ids = itertools.count(1)


class Shim(Generic[B]):
    """One conversation's shim (seed ``Shim``); its actor runs on the adapter facade's node.

    The shim takes over the adapter handle it is given, as the seed's ``Shim::new(adapter, ...)`` does:
    ``close()`` stops the actor and releases that handle. Give it ``adapter.clone()`` to keep your own.
    """

    def __init__(
        self,
        adapter: AdapterHandle,
        conversation_key: str,
        codec: BoxCodec[B],
        launcher: ToolCallLauncher[B],
        *,
        timeout: float = 30.0,
    ) -> None:
        self.adapter = adapter
        self.conversation_key = conversation_key
        self.timeout = timeout  # bounds record_box / pending_box_count, never an infer
        node = adapter.node
        self._ref = node.spawn(
            ShimActor,
            f"shim.{uuid.uuid4().hex}",
            adapter=adapter.address,
            conversation_key=conversation_key,
            codec=codec,
            launcher=launcher,
        )
        self._closed = False

    def _ask(self, message: Any) -> Any:
        forbid_blocking("Shim")
        try:
            return self._ref.ask(message, timeout=self.timeout)
        except pykka.ActorDeadError:
            raise AdapterError(ErrorKind.UNAVAILABLE, "the shim was closed") from None

    def record_box(self, box: B) -> None:
        self._ask(RecordBoxes((box,)))

    def record_boxes(self, boxes: Iterable[B]) -> None:
        self._ask(RecordBoxes(tuple(boxes)))

    def pending_box_count(self) -> int:
        return int(self._ask(PendingCount()))

    def infer_future(self, input: str) -> InferFuture:
        """Queue one ``infer``; the future resolves with its ``ShimOutput`` or raises its error."""
        job_id = next(_job_ids)
        future = InferFuture()
        ref = self._ref

        def cancel() -> None:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(CancelInfer(job_id))

        future._on_cancel = cancel
        try:
            ref.tell(Infer(job_id, input, future))
        except pykka.ActorDeadError:
            future.set_exception(AdapterError(ErrorKind.UNAVAILABLE, "the shim was closed"))
        return future

    def infer(self, input: str, *, timeout: float | None = None) -> ShimOutput[B]:
        """Run one native turn; ``timeout`` (default: none) gives up waiting by cancelling the infer
        (SH-16) and raises ``Expired``."""
        forbid_blocking("Shim.infer")
        future = self.infer_future(input)
        try:
            return future.result(timeout)  # type: ignore[no-any-return]
        except concurrent.futures.TimeoutError:
            if future.cancel():
                raise Expired(f"infer did not finish within {timeout}s; it was cancelled") from None
            return future.result(0)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop the actor and release the adapter handle. An infer in flight fails (``UNAVAILABLE``) and its
        native turn is abandoned first; a start in flight is waited for, then abandoned (bounded by
        ``timeout``), so no turn is left running on the key."""
        forbid_blocking("Shim.close")
        if self._closed:
            return
        self._closed = True
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            self._ref.tell(CloseShim(done))
        except pykka.ActorDeadError:
            pass
        else:
            try:
                done.result(self.timeout)
            except concurrent.futures.TimeoutError:
                log.warning("shim %s: the adapter did not confirm the close in time", self.conversation_key)
                self._ref.stop(block=True, timeout=self.timeout)
        self.adapter.close()

    def __enter__(self) -> Shim[B]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "ACKNOWLEDGEMENT",
    "AdapterHandle",
    "BoxCodec",
    "CancelInfer",
    "CloseShim",
    "Infer",
    "InferFuture",
    "LaunchRejected",
    "PendingCount",
    "RecordBoxes",
    "Shim",
    "ShimActor",
    "ShimBox",
    "ShimOutput",
    "ShimText",
    "ToolCallLauncher",
    "turn_input",
]
