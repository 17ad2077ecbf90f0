"""The round machine: one provider turn driven as a table of (state, message) rows, shared by ``run_session``
and the subagent ``run`` (RULES.md RS-*, SA-*, EV-09, EV-10).

A run is a pure machine: ``step(flavor, state, message)`` returns the next state and the effects to carry
out (ask the host, the inference handle or the Router; open or close the handle; end the run). It never
blocks and touches no actor, so the table is testable with plain values. ``RoundActor`` hosts one machine on
the bus: it carries out each effect and feeds each answer back as ``Answered`` or ``Failed``.

The rows here are the ones both loops share: single use (``Idle`` is the only state a ``Begin`` starts
from; a second one is refused with the flavor's typed error), the handle's start and its event stream, the
native response, interrupted-turn accounting (``finish_unavailable``, then its receipt recorded once), a
failure's attached receipt recorded once before the failure is raised, and cancellation. What differs is a
``Flavor``: the session's host callbacks (rounds, resume decisions, completion control), the subagent's
model resolution, projection and budget checks. A flavor has rows of its own for its own states, and
hooks the shared rows call (what a receipt event looks like, what a tool call or a completion leads to).

Cancellation is a state too: a ``Cancel`` while the provider stream is read interrupts the read at once
(``Interrupting``: both answers, then the turn's one receipt); at any other point the run becomes
``Cancelling(inner)``: ``inner`` goes on until it would make its next *boundary* ask (``Ask.boundary``, or
opening a handle), and the run then ends there, the open turn accounted for first.
"""

from __future__ import annotations

import enum
import logging
import uuid
from functools import partial
from typing import Any, ClassVar, Final, Generic, Protocol, TypeVar

from actors.base import DEFER, LOOP_HOSTS, BusActor, Context, HostPool
from actors.inference.handle import (
    AwaitStarted,
    FinishUnavailable,
    InferenceError,
    InferenceEvents,
    InferenceStarted,
    NextEvent,
    ProviderEndedError,
    SessionInferenceEvent,
    SessionInferenceRequest,
)
from actors.types import UsageReceipt, evolve, note_accounting_failure, retry_class
from transport.errors import ProtocolError
from transport.messages import Ok
from transport.node import Node
from transport.pending import Reply
from transport.records import frozen

log = logging.getLogger(__name__)

__all__ = [
    "READ",
    "Abort",
    "Accounting",
    "Answered",
    "Ask",
    "Begin",
    "Cancel",
    "Cancelling",
    "Close",
    "Ended",
    "Failed",
    "Finish",
    "Flavor",
    "Idle",
    "IdleCancelled",
    "Interrupting",
    "Open",
    "Raise",
    "Raising",
    "Reading",
    "RecordingCompleted",
    "RecordingReceipt",
    "RecordingReceipts",
    "Refuse",
    "RoundActor",
    "Run",
    "Starting",
    "Step",
    "Succeed",
    "Target",
    "Then",
    "abort",
    "account",
    "fail",
    "failed_with",
    "read",
    "record_and_raise",
    "starting",
    "step",
]

F = TypeVar("F")


class Target(enum.Enum):
    HOST = "host"
    HANDLE = "handle"
    ROUTER = "router"


# ------------------------------------------------------------------------------------------ messages


@frozen
class Begin:
    """The run's request (``RunSession``, ``RunSubagent``): accepted in ``Idle`` only."""

    run: Any


@frozen
class Cancel:
    pass


@frozen
class Answered:
    """The answer to ``asked`` (the message of an ``Ask``, or ``AwaitStarted`` for an ``Open``)."""

    asked: Any
    value: Any


@frozen
class Failed:
    asked: Any
    error: BaseException


Message = Begin | Cancel | Answered | Failed

# ------------------------------------------------------------------------------------------- effects


@frozen
class Ask:
    """Ask ``target`` ``message``; the answer comes back as ``Answered``/``Failed``. A cancelled run stops
    before a ``boundary`` ask instead of making it. ``moved``: the run will not read or change a mutable
    value in ``message`` again (``BusActor.ask``)."""

    target: Target
    message: Any
    boundary: bool = True
    timeout: float | None = None  # None: the hosting actor's bound for ``target``
    moved: bool = False


@frozen
class Open:
    """Start the round's inference handle, then ask it ``AwaitStarted`` (a boundary)."""

    request: SessionInferenceRequest


@frozen
class Close:
    """Release the inference handle (it has answered its last)."""


@frozen
class Finish:
    """Answer the run's caller with ``result`` and stop."""

    result: Any


@frozen
class Abort:
    """Fail the run's caller with ``error`` (``progressed``: a turn started or a tool ran) and stop."""

    error: BaseException
    progressed: bool


@frozen
class Refuse:
    """Answer this ``Begin`` (only) with ``error``; the machine stays where it was."""

    error: BaseException


Effect = Ask | Open | Close | Finish | Abort | Refuse

# -------------------------------------------------------------------------------------------- states


@frozen
class Run(Generic[F]):
    """What every live state carries: the flavor's facts, whether a handle is open (``op``: its child
    operation once started; ``None`` while starting), whether the run has progressed, and ``queued``: handle
    events in hand not taken yet (the rest of an ``InferenceEvents`` batch), which ``read`` takes before it
    asks the handle again."""

    facts: F
    handle: bool = False
    op: uuid.UUID | None = None
    progressed: bool = False
    queued: tuple[Any, ...] = ()

    # Built positionally: these run several times a round, and ``dataclasses.replace`` walks the fields.
    def closed(self) -> Run[F]:
        return Run(self.facts, False, None, self.progressed)

    def with_facts(self, facts: F) -> Run[F]:
        return self if facts is self.facts else Run(facts, self.handle, self.op, self.progressed, self.queued)

    def with_queued(self, queued: tuple[Any, ...]) -> Run[F]:
        return Run(self.facts, self.handle, self.op, self.progressed, queued)


@frozen
class Succeed:
    answer: Any


@frozen
class Raise:
    error: BaseException


@frozen
class Then:
    """Go on with the flavor (``Flavor.then``): the session selects its next round."""


After = Succeed | Raise | Then


@frozen
class Idle:
    pass


@frozen
class IdleCancelled:
    """A ``Cancel`` overtook the ``Begin``: the run will end as soon as it is asked to start."""


@frozen
class Starting:
    run: Run[Any]


@frozen
class Reading:
    run: Run[Any]


@frozen
class RecordingCompleted:
    run: Run[Any]
    completed: SessionInferenceEvent.Completed


@frozen
class Accounting:
    run: Run[Any]
    after: After


@frozen
class RecordingReceipt:
    """The accounted receipt is being recorded; ``failure``: the accounting's own error, if any."""

    run: Run[Any]
    after: After
    failure: BaseException | None


@frozen
class Raising:
    """A failure's attached receipt is being recorded; then ``error`` is raised."""

    run: Run[Any]
    error: BaseException


@frozen
class Interrupting:
    """A cancelled read: waiting for both the read's answer and the accounting's."""

    run: Run[Any]
    event: Answered | Failed | None = None
    account: Answered | Failed | None = None


@frozen
class RecordingReceipts:
    run: Run[Any]
    rest: tuple[Any, ...]
    error: BaseException


@frozen
class Cancelling:
    inner: Any


@frozen
class Ended:
    pass


@frozen
class Step:
    state: Any
    effects: tuple[Effect, ...] = ()


# -------------------------------------------------------------------------------------------- flavor


class Flavor(Protocol):
    """What one kind of run adds to the shared rows."""

    def begin(self, run: Any, *, cancelled: bool) -> Step: ...
    def refused(self) -> BaseException: ...  # a second Begin
    def cancelled(self, text: str) -> BaseException: ...
    def record(self, event: Any) -> Any: ...  # the host message that records ``event``
    def receipt(self, run: Run[Any], receipt: UsageReceipt, usage: Any, continuation: Any) -> Any: ...
    def on_event(self, run: Run[Any], event: Any) -> Step: ...  # a non-final handle event
    def completed(self, run: Run[Any], completed: SessionInferenceEvent.Completed) -> Step: ...
    def succeed(self, run: Run[Any], answer: Any) -> Step: ...
    def then(self, run: Run[Any]) -> Step: ...
    def step(self, state: Any, message: Any) -> Step: ...  # the flavor's own rows


# ---------------------------------------------------------------------------------- shared steps


READ: Final = NextEvent(batch=True)  # a run takes what the handle has in hand at once (InferenceEvents)


def read(flavor: Flavor, run: Run[Any]) -> Step:
    """The next handle event: the first one in hand (``Run.queued``), else asked of the handle."""
    if run.queued:
        return step(flavor, Reading(run.with_queued(run.queued[1:])), Answered(READ, run.queued[0]))
    return Step(Reading(run), (Ask(Target.HANDLE, READ),))


def fail(run: Run[Any], error: BaseException) -> Step:
    effects: tuple[Effect, ...] = (Close(),) if run.handle else ()
    return Step(Ended(), (*effects, Abort(error, run.progressed)))


def account(flavor: Flavor, run: Run[Any], after: After) -> Step:
    """EV-09: ``finish_unavailable`` on the open handle, then its receipt recorded once, then ``after``. A
    completion already in hand (the end of a batch read: the handle has ended with it) carries the turn's
    receipt: that one is recorded, as finish_unavailable would have returned it."""
    done = next((e for e in run.queued if isinstance(e, SessionInferenceEvent.Completed)), None)
    if done is not None:
        run = run.closed()
        event = flavor.receipt(run, done.receipt, None, None)
        ask = Ask(Target.HOST, flavor.record(event), boundary=False)
        return Step(RecordingReceipt(run, after, None), (Close(), ask))
    if not run.handle or run.op is None:
        return _settle(flavor, run, after)
    return Step(Accounting(run, after), (Ask(Target.HANDLE, FinishUnavailable(), boundary=False),))


def abort(flavor: Flavor, run: Run[Any], error: BaseException) -> Step:
    """RS-12/RS-35/SA-28: a failure with an open turn accounts for it first, then raises ``error``."""
    return account(flavor, run, Raise(error))


def record_and_raise(flavor: Flavor, run: Run[Any], error: BaseException, receipt: UsageReceipt) -> Step:
    """RS-29/30/33: an error's attached receipt is recorded once, then that error is raised, with a failing
    record attached to it (RS-34), never in its place."""
    run = run.closed()
    event = flavor.receipt(run, receipt, None, None)
    return Step(Raising(run, error), (Close(), Ask(Target.HOST, flavor.record(event), boundary=False)))


def failed_with(flavor: Flavor, run: Run[Any], error: BaseException) -> Step:
    """A handle request failed: its attached receipt (the turn ended at the Router), else accounting."""
    receipt = getattr(error, "receipt", None)
    if isinstance(receipt, UsageReceipt):
        return record_and_raise(flavor, run, error, receipt)
    return abort(flavor, run, error)


def _settle(flavor: Flavor, run: Run[Any], after: After) -> Step:
    match after:
        case Succeed(answer=answer):
            return flavor.succeed(run, answer)
        case Raise(error=error):
            return fail(run, error)
        case Then():
            return flavor.then(run)


def _settle_failed(run: Run[Any], after: After, failure: BaseException) -> Step:
    """Accounting failed: the run ends with that failure, attached to the error being raised if any."""
    if isinstance(after, Raise):
        return fail(run, note_accounting_failure(after.error, failure))
    return fail(run, failure)


def _boundary(flavor: Flavor, result: Step) -> Step:
    """A cancelled run: stop at the first boundary ask the inner step would make (after its other effects)."""
    for i, effect in enumerate(result.effects):
        if isinstance(effect, Open) or (isinstance(effect, Ask) and effect.boundary):
            stopped = abort(flavor, result.state.run, flavor.cancelled("the run was cancelled"))
            return _cancelling(Step(stopped.state, (*result.effects[:i], *stopped.effects)))
    return _cancelling(result)


def _cancelling(result: Step) -> Step:
    if isinstance(result.state, Ended | Cancelling):
        return result
    return Step(Cancelling(result.state), result.effects)


def _interrupted(flavor: Flavor, state: Interrupting) -> Step:
    """Both answers of a cancelled read are in: record the one receipt the turn has (from the final event,
    an error that carries it, or the accounting), once."""
    assert state.event is not None and state.account is not None
    run = state.run.closed()
    events: list[Any] = []
    seen: set[str] = set()
    for part in (state.event, state.account):
        usage, continuation, receipt = None, None, None
        match part:
            case Answered(value=SessionInferenceEvent.Completed() as done):
                receipt, usage, continuation = done.receipt, done.usage, done.continuation
            case Answered(value=value):
                receipt = value
            case Failed(error=error):
                receipt = getattr(error, "receipt", None)
        if isinstance(receipt, UsageReceipt) and receipt.receipt_id not in seen:
            seen.add(receipt.receipt_id)
            events.append(flavor.receipt(run, receipt, usage, continuation))
    cancelled = flavor.cancelled("the run was cancelled while the provider was streaming")
    if not events:
        failure = next((p.error for p in (state.account, state.event) if isinstance(p, Failed)), None)
        error = cancelled if failure is None else note_accounting_failure(cancelled, failure)
        return Step(Ended(), (Close(), Abort(error, run.progressed)))
    recording = RecordingReceipts(run, tuple(events[1:]), cancelled)
    return Step(recording, (Close(), Ask(Target.HOST, flavor.record(events[0]), boundary=False)))


# ------------------------------------------------------------------------------------------- the table


def starting(run: Run[Any], request: SessionInferenceRequest) -> Step:
    """Open the round's handle (RS-01: one per provider round) and wait for its start."""
    return Step(Starting(evolve(run, handle=True, op=None)), (Open(request),))


def step(flavor: Flavor, state: Any, message: Message) -> Step:
    """One transition: the shared rows first, then the flavor's own (``Flavor.step``)."""
    match state, message:
        # ---------------------------------------------------------------- single use
        case Idle(), Begin(run=request):
            return flavor.begin(request, cancelled=False)
        case IdleCancelled(), Begin(run=request):
            return flavor.begin(request, cancelled=True)
        case Idle(), Cancel():
            return Step(IdleCancelled())
        case _, Begin():
            return Step(state, (Refuse(flavor.refused()),))
        # ---------------------------------------------------------------- cancellation
        case IdleCancelled() | Ended() | Cancelling() | Interrupting() | RecordingReceipts(), Cancel():
            return Step(state)
        case Reading(run=run), Cancel() if run.op is not None:
            ask = Ask(Target.HANDLE, FinishUnavailable(), boundary=False)
            return Step(Interrupting(run), (ask,))
        case Cancelling(inner=inner), _:
            return _boundary(flavor, step(flavor, inner, message))
        case _, Cancel():
            return Step(Cancelling(state))
        # ---------------------------------------------------------------- the handle's start
        case Starting(run=run), Answered(value=InferenceStarted(operation_id=op)):
            return read(flavor, evolve(run, op=op, progressed=True))
        case Starting(run=run), Failed(error=error):
            receipt = getattr(error, "receipt", None)
            if isinstance(receipt, UsageReceipt):  # RS-29
                return record_and_raise(flavor, run, error, receipt)
            return fail(run, error)
        case Starting(run=run), Answered(value=other):
            return abort(flavor, run, InferenceError(f"the handle started with {type(other).__name__}"))
        # ---------------------------------------------------------------- the event stream
        case Reading(run=run), Failed(error=error):  # RS-30
            return failed_with(flavor, run, error)
        case Reading(run=run), Answered(asked=asked, value=InferenceEvents(events=(first, *rest))):
            # Several events in hand (RS-10: each still taken in order, recorded before a later one acts)
            return step(flavor, Reading(run.with_queued((*rest, *run.queued))), Answered(asked, first))
        case Reading(run=run), Answered(value=Ok()):  # RS-31: closed without completion
            return abort(flavor, run, ProviderEndedError("the provider stream ended without a final answer"))
        case Reading(run=run), Answered(value=SessionInferenceEvent.Completed() as done):
            run = run.closed()
            event = flavor.receipt(run, done.receipt, done.usage, done.continuation)  # RS-23, EV-04
            ask = Ask(Target.HOST, flavor.record(event), boundary=False)  # a receipt in hand is recorded
            return Step(RecordingCompleted(run, done), (Close(), ask))
        case Reading(run=run), Answered(
            value=SessionInferenceEvent.ProviderInput()
            | SessionInferenceEvent.UsageUpdated()
            | SessionInferenceEvent.ToolCall() as event
        ):
            return flavor.on_event(run, event)
        case Reading(run=run), Answered(value=other):
            return abort(flavor, run, InferenceError(f"unexpected handle event {type(other).__name__}"))
        case RecordingCompleted(run=run, completed=done), Answered():
            return flavor.completed(run, done)
        case RecordingCompleted(run=run), Failed(error=error):
            return fail(run, error)
        # ---------------------------------------------------------------- accounting
        case Accounting(run=run, after=after), Answered(value=UsageReceipt() as receipt):
            run = run.closed()
            event = flavor.receipt(run, receipt, None, None)
            ask = Ask(Target.HOST, flavor.record(event), boundary=False)
            return Step(RecordingReceipt(run, after, None), (Close(), ask))
        case Accounting(run=run, after=after), Answered(value=other):
            failure = InferenceError(f"finish_unavailable returned {type(other).__name__}")
            return Step(Ended(), (Close(), *_settle_failed(run.closed(), after, failure).effects))
        case Accounting(run=run, after=after), Failed(error=error):
            run = run.closed()
            receipt = getattr(error, "receipt", None)
            if isinstance(receipt, UsageReceipt):
                event = flavor.receipt(run, receipt, None, None)
                ask = Ask(Target.HOST, flavor.record(event), boundary=False)
                return Step(RecordingReceipt(run, after, error), (Close(), ask))
            return Step(Ended(), (Close(), *_settle_failed(run, after, error).effects))
        case RecordingReceipt(run=run, after=after, failure=None), Answered():
            return _settle(flavor, run, after)
        case RecordingReceipt(run=run, after=after, failure=failure), Answered():
            assert failure is not None
            return _settle_failed(run, after, failure)
        case RecordingReceipt(run=run, after=after, failure=failure), Failed(error=error):
            # A host that cannot take the receipt must not hide why the run is ending.
            return _settle_failed(
                run, after, error if failure is None else note_accounting_failure(failure, error)
            )
        case Raising(run=run, error=error), Answered():
            return fail(run, error)
        case Raising(run=run, error=error), Failed(error=failure):
            return fail(run, note_accounting_failure(error, failure))
        # ---------------------------------------------------------------- an interrupted read
        case Interrupting(account=None) as it, Answered(asked=FinishUnavailable()) | Failed(
            asked=FinishUnavailable()
        ):
            it = evolve(it, account=message)
            return Step(it) if it.event is None else _interrupted(flavor, it)
        case Interrupting(event=None) as it, Answered() | Failed():
            if isinstance(message, Answered) and isinstance(message.value, InferenceEvents):
                message = Answered(message.asked, message.value.events[-1])  # the read's last says its end
            it = evolve(it, event=message)
            return Step(it) if it.account is None else _interrupted(flavor, it)
        case RecordingReceipts(run=run, error=error), Failed(error=failure):
            return fail(run, note_accounting_failure(error, failure))
        case RecordingReceipts(run=run, rest=(first, *rest), error=error), Answered():
            ask = Ask(Target.HOST, flavor.record(first), boundary=False)
            return Step(RecordingReceipts(run, tuple(rest), error), (ask,))
        case RecordingReceipts(run=run, error=error), Answered():
            return fail(run, error)
        case Ended(), _:
            return Step(state)  # a late answer after the run ended
    return flavor.step(state, message)


# ------------------------------------------------------------------------------------------- the actor

# The node's host pool (``actors.base.HostPool``) runs are placed on: its loop pool (``[node] hosts``),
# which conversations and the Router share, since a run never blocks its thread. Threads then grow with the
# pool's size, not with the number of runs.
RUN_HOSTS: Final = LOOP_HOSTS


def spawn_run(node: Node, actor_class: type[RoundActor], name: str) -> None:
    """Start a run's actor at ``node/name`` on the node's run host pool (``RUN_HOSTS``)."""
    HostPool.of(node, RUN_HOSTS).spawn(actor_class, name)


class RoundActor(BusActor):
    """Hosts one round machine on the bus and carries out its effects; every wait is a continuation (MB-03).

    A subclass names its ``FLAVOR`` and says how its handle is opened (``open_handle``) and which address
    and bound each target has (``accepted``, called once the ``Begin`` is taken)."""

    FLAVOR: ClassVar[Flavor]
    RUN: ClassVar[type]  # the Begin message
    CANCEL: ClassVar[type]  # the cancel control

    def __init__(self, node: Node, address: str) -> None:
        super().__init__(node, address)
        self.state: Any = Idle()
        self._ctx: Context | None = None
        self._to: dict[Target, str] = {}
        self._timeout: dict[Target, float | None] = {}
        self._handle_ref: Any = None

    def handle(self, message: Any, ctx: Context) -> Any:
        if isinstance(message, self.CANCEL):
            self._feed(Cancel())
            return None
        if not isinstance(message, self.RUN):
            raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")
        result = step(self.FLAVOR, self.state, Begin(message))
        refused = [e for e in result.effects if isinstance(e, Refuse)]
        if refused:
            raise refused[0].error
        self._ctx = ctx
        self.accepted(message)
        self._carry_out(result)
        return DEFER

    def accepted(self, message: Any) -> None:
        raise NotImplementedError

    def open_handle(self, request: SessionInferenceRequest) -> tuple[str, Any]:
        """Start the handle for ``request``; its address and ref."""
        raise NotImplementedError

    def _feed(self, message: Message) -> None:
        try:
            result = step(self.FLAVOR, self.state, message)
        except Exception as exc:  # a (state, message) pair with no row: a bug; the run ends with it, typed
            log.exception(
                "%s: no step for %s in %s", self.address, type(message).__name__, type(self.state).__name__
            )
            result = Step(Ended(), (Close(), Abort(exc, progressed=True)))
        self._carry_out(result)

    def _answer(self, asked: Any, reply: Reply) -> None:
        self._feed(Answered(asked, reply.message) if reply.error is None else Failed(asked, reply.error))

    def _carry_out(self, result: Step) -> None:
        self.state = result.state
        for effect in result.effects:
            match effect:
                case Ask(target=target, message=message, timeout=timeout, moved=moved):
                    bound = self._timeout.get(target) if timeout is None else timeout
                    answer = partial(self._answer, message)
                    self.ask(self._to[target], message, answer, timeout=bound, moved=moved)
                case Open(request=request):
                    self._to[Target.HANDLE], self._handle_ref = self.open_handle(request)
                    asked = AwaitStarted()
                    bound = self._timeout.get(Target.HANDLE)
                    self.ask(self._to[Target.HANDLE], asked, partial(self._answer, asked), timeout=bound)
                case Close():
                    ref, self._handle_ref = self._handle_ref, None
                    self._to.pop(Target.HANDLE, None)
                    if ref is not None:
                        ref.stop(block=False)
                case Finish(result=answer):
                    ctx = self._ctx
                    if ctx is not None and not ctx.done:
                        ctx.reply(answer)
                    self.stop()
                case Abort(error=error, progressed=progressed):
                    ctx = self._ctx
                    if ctx is not None and not ctx.done:
                        ctx.fail(retry_class(error, progressed=progressed))
                    self.stop()
                case Refuse(error=error):  # only a Begin is refused, and handle() raises it
                    log.warning("%s: refused outside a Begin: %r", self.address, error)
