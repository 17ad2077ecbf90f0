"""The Router actor: the sole owner of providers, credentials, the model catalog, cancellation lineage and
canonical receipts (seed 000: ``kcode_intelligence_router``; RULES.md RT-*, A.2).

No provider turn has a thread of its own (stepping.py): a turn is a generator that an actor steps, one
step per mailbox message. The scripted model's and codex's turns run on this actor's own thread (codex's
waits are requests to its adapter actor, whose replies come back as messages); the local model's on
the one actor that owns the model (its mailbox is their queue); blocking HTTP providers' on a pool of at
most ``turn_workers`` worker actors. A hosted turn reports back through this actor's mailbox, so the Router
keeps answering while tokens stream. Per turn it keeps a queue of events; a ``NextTurnEvent``
with nothing queued is answered later (the request is deferred, never waited on). Every turn gets exactly
one ``UsageReceipt`` on every path (completed, failed, unavailable, cancelled/interrupted, timed out),
written to the SQLite ledger before anyone hears of it; asking again returns the same receipt.

Durability (DESIGN.md 4a; the ledger's docstring has the details):

- **Intent before effect.** With a data dir, a turn's ``open`` row (ids, user, model, provider, round,
  start time, this Router's incarnation) is committed before its provider runs; settling turns that
  row into the receipt. A Router starting on a data dir first turns every open row of a dead incarnation
  into one ``interrupted`` receipt, before it serves anything. Usage streamed so far is staged and written
  with the next ledger write, on each housekeeping tick and before a tool call is reported.
- **Group commit.** The first ledger write after a commit (an intent, a receipt, streamed usage) opens a
  group; it is committed when, after a message, nothing more waits in this actor's mailbox (a hosted
  Router's: its host's; ``BusActor.when_drained``), or after ``GROUP_MESSAGES`` of its messages. What
  waited meanwhile (a burst of turns' starts, steps and ends, or what arrived during the last commit)
  writes into the same transaction: one commit, one fsync. Until that commit has returned every answer
  of this actor is held, in order, and a turn's provider starts only after it: nobody hears of an intent
  or a receipt, and no provider runs, before it is on disk. A lone request is committed as it is
  handled, as without groups. A commit that fails leaves nothing of its group on disk: the turns it
  would have started are refused with ``TurnNotStarted`` (nothing ran), the receipts it settled are
  written again one by one, and only if one of those fails as well are the held answers failed with
  ``LedgerUnavailable``.
- **No turn waits forever.** Every ``tick_s`` the Router looks at each turn that is *idle on its owner*
  (the StartTurn's sender): a tool call it surfaced is unanswered, the stream closed and waits for
  ``FinishUnavailable``, or no read of the owner is outstanding. Such a turn's owner is sent a heartbeat
  every ``owner_ping_interval_s`` it has been silent (a ``Ping`` to an owner actor, which its own mailbox
  answers; a ``Resolve`` to the node of a plain client thread on another node; none for a client thread of
  this node, whose death the bus cannot see). When a heartbeat failed with ``NotDelivered``,
  ``Unavailable`` or ``Expired`` and the owner has been silent for ``owner_lost_after_s``, the turn is
  cancelled and accounted ``interrupted`` (``TurnInterrupted``), and leaves memory. That happens within
  ``max(owner_lost_after_s, 2 * owner_ping_interval_s + tick_s) + tick_s`` (31 s by default) of the later
  of the owner's death and the moment the turn starts waiting on it. A turn idle on a live owner for
  ``owner_idle_bound_s`` (an hour by default: a tool may run that long) is interrupted too, and the
  worker's own wait for a tool result is bounded as well (in real time, so it ends even if this actor is
  gone). A turn whose owner died while its read was outstanding waits for that read's deadline first.
- **Flat memory.** A turn leaves memory (``_turns`` and the lineage links) once its receipt is durable
  and its terminal event or error was handed to a reader, or ``finished_grace_s`` after it ended if
  nobody reads it. Later requests on it are answered from the ledger (``TurnTerminated``, or
  ``TurnInterrupted`` for an interrupted receipt, with the receipt); without a data dir from an LRU of the
  last ``recent_receipts`` receipts (4096 by default), beyond which an old operation is ``TurnNotFound``.
- **Retry classes.** ``TurnNotStarted`` (a ``NotDelivered``) means no provider was called and no
  operation exists: safe to retry. An error that ends a turn carries the turn's receipt: the turn is over
  and accounted.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import sqlite3
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from actors.base import DEFER, LOOP_HOSTS, BusActor, Context
from actors.router.catalog import DEFAULT_CATALOG, ModelCatalog
from actors.router.messages import (
    DECISION_EVENTS,
    TERMINAL_EVENTS,
    CancelOperation,
    CountTokens,
    FinishUnavailable,
    GetReceipt,
    GetReceiptsFor,
    GetRouterStats,
    InvalidCallId,
    LedgerUnavailable,
    NextTurnEvent,
    OperationsCancelled,
    ProviderFailed,
    ProviderUnavailable,
    ReceiptList,
    ResolveModel,
    RespondCall,
    RouterError,
    RouterStats,
    StartTurn,
    StreamTurnEvents,
    SubmitInput,
    TokenCount,
    TurnBusy,
    TurnCancelled,
    TurnClosed,
    TurnCompleted,
    TurnEventBatch,
    TurnInput,
    TurnInterrupted,
    TurnNotFound,
    TurnNotStarted,
    TurnStarted,
    TurnTerminated,
    TurnTextDelta,
    TurnTimedOut,
    TurnUsage,
)
from actors.router.providers.base import (
    CLOSED,
    ChatMessage,
    NativeToolCall,
    Provider,
    ProviderError,
    ProviderEvent,
    ProviderOutcome,
    Submitted,
    TextDelta,
    ToolCallRequested,
    ToolSpec,
    TurnRequest,
    TurnSteps,
    UsageUpdate,
    estimate_tokens,
)
from actors.router.receipts import Commit, Intent, ReceiptLedger
from actors.router.stepping import (
    STEP,
    CancelTurn,
    HostTurn,
    Resolved,
    ResumeTurn,
    RunCall,
    Step,
    TurnHost,
    TurnPool,
)
from actors.router.turns import (
    FINISHED_GRACE_S,
    OWNER_GONE,
    OWNER_IDLE_BOUND_S,
    OWNER_LOST_AFTER_S,
    OWNER_PING_INTERVAL_S,
    RECENT_RECEIPTS,
    STEP_ENDED,
    STEP_STARTED,
    TICK,
    TICK_S,
    Counted,
    Emitted,
    Finished,
    StepMark,
    Tick,
    Ticker,
    TimedOut,
    Turn,
    WorkerIO,
    decode_local,
    encode_local,
    parse_tool_call,
    thread_ticker,
)
from actors.types import (
    CALL_KTOOL,
    AgentContinuation,
    ReceiptStatus,
    TokenUsage,
    ToolResult,
    UsageReceipt,
)
from transport.errors import Expired, ProtocolError
from transport.messages import Ok, Ping, Resolve
from transport.pending import Reply
from transport.records import frozen
from transport.replay import (
    MONOTONIC,
    ReplayedMailbox,
    record_mailbox,
    recorded_clock,
    recorded_uuid,
    replaying,
)

log = logging.getLogger(__name__)

# The one native tool (RT-04): the application tool's name and its JSON-object arguments.
CALL_KTOOL_PARAMETERS: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "the application tool to run"},
        "arguments": {"type": "object", "description": "that tool's arguments"},
    },
    "required": ["name", "arguments"],
}


_BATCH = 256  # events per stream part at most (bounded frame size; text deltas are small)
TURN_WORKERS = 4  # worker actors for blocking providers (the pool), started as turns need them
# The most mailbox messages one ledger group spans: what a busy Router holds its answers for is bounded.
GROUP_MESSAGES = 256
MAX_TURN_TIMEOUT_S = 7 * 24 * 3600.0  # the longest StartTurn.timeout_s: a week (a typed error past it)


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not value > 0 or math.isnan(value):
        raise ValueError(f"RouterActor: {name} must be a positive number of seconds, not {value!r}")
    return value


class RouterActor(BusActor):
    """See the module docstring. One per node that serves models; reach it with ``RouterClient``.

    Options (all in seconds unless said otherwise; a node config sets them under ``[actors.<name>]``):
    ``tick_s`` housekeeping period; ``owner_ping_interval_s`` heartbeat period for an owner that is silent;
    ``owner_lost_after_s`` silence after which an owner whose heartbeat failed is gone;
    ``owner_idle_bound_s`` the longest a turn waits on a live owner; ``finished_grace_s`` how long an ended
    turn nobody reads stays in memory; ``recent_receipts`` (a count) receipts kept in memory without a
    data dir; ``turn_workers`` (a count) the most worker actors that host blocking providers' turns.
    ``monotonic``, ``clock_ms``, ``ticker`` and ``new_operation_id`` are injectable for tests;
    by default they are the determinism seams of transport/replay.py (recorded in a capture, served on a
    replay), and the provider events, timeouts, token counts and ticks that reach the mailbox are recorded
    as mailbox effects, so a replay runs no provider (replaying: no turn is hosted, no timer or ticker).
    """

    DIRECT = True  # on a node with endpoints: remote handles reach it with no I/O-thread hand-off
    # Else on the node's loop pool, beside the runs and conversations it serves (their rounds then cost no
    # thread hand-off): it never blocks, blocking providers' turns run on its TurnPool's workers.
    PLACED_ON = LOOP_HOSTS

    def __init__(
        self,
        node: Any,
        address: str,
        *,
        catalog: ModelCatalog | None = None,
        data_dir: str | Path | None = None,
        providers: Mapping[str, Provider] | None = None,
        env: Mapping[str, str] | None = None,
        new_operation_id: Callable[[], uuid.UUID] | None = None,
        clock_ms: Callable[[], int] | None = None,
        monotonic: Callable[[], float] | None = None,
        ticker: Ticker = thread_ticker,
        tick_s: float = TICK_S,
        owner_ping_interval_s: float = OWNER_PING_INTERVAL_S,
        owner_lost_after_s: float = OWNER_LOST_AFTER_S,
        owner_idle_bound_s: float = OWNER_IDLE_BOUND_S,
        finished_grace_s: float = FINISHED_GRACE_S,
        recent_receipts: int = RECENT_RECEIPTS,
        turn_workers: int = TURN_WORKERS,
        ledger_commit: Commit | None = None,
    ) -> None:
        super().__init__(node, address)
        self.catalog = catalog or DEFAULT_CATALOG
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._ledger: ReceiptLedger | None = None
        self._ledger_commit = ledger_commit  # how the ledger commits (a test's fake disk; see receipts.py)
        # Group commit (see the module docstring): the ledger group open since this actor's first write
        # after the last commit, the turns it settled, and the StartTurn requests refused at its commit.
        self._group: contextlib.AbstractContextManager[None] | None = None
        self._committing = False
        self._group_messages = 0  # handled since the open group opened
        self._group_settled: list[Turn] = []
        self._refused: dict[int, BaseException] = {}
        self._unstarted: set[uuid.UUID] = set()  # turns refused at a failed commit: no receipt is owed
        self._provider_overrides = dict(providers or {})
        self._providers: dict[str, Provider] = {}
        self._env = env
        self._new_op = new_operation_id or (lambda: recorded_uuid(self.node, self.address))
        self._clock_ms = clock_ms or (lambda: int(recorded_clock(self.node, self.address) * 1000))
        self._monotonic = monotonic or (
            lambda: recorded_clock(self.node, self.address, MONOTONIC, time.monotonic)
        )
        self._ticker = ticker
        self._tick_s = _positive("tick_s", tick_s)
        self._ping_interval = _positive("owner_ping_interval_s", owner_ping_interval_s)
        self._lost_after = _positive("owner_lost_after_s", owner_lost_after_s)
        self._idle_bound = _positive("owner_idle_bound_s", owner_idle_bound_s)
        self._grace = _positive("finished_grace_s", finished_grace_s)
        if int(recent_receipts) < 1:
            raise ValueError(f"RouterActor: recent_receipts must be at least 1, not {recent_receipts!r}")
        self._recent_bound = int(recent_receipts)
        self._turns: dict[uuid.UUID, Turn] = {}
        # While inline turns step: the turns whose queued events are handed on when the step ends, so what
        # one step of a provider produces goes to its reader together (a tool round's input and its next
        # call in one reply), not as one message per event.
        self._held: dict[uuid.UUID, Turn] | None = None
        # Inline turns whose reader (``Turn.stream``, a reading-on RespondCall) is owed the partial Ok that
        # says the result was taken: the first event the turn's next step hands it says so instead (one
        # message fewer a tool round); a step that hands none sends the Ok when it ends (``_ack_owed``).
        self._owed: dict[uuid.UUID, Turn] = {}
        # Cancellation lineage: parent operation -> child turn operations, and back. A turn that left
        # memory stays here only while some of its own children are still in memory.
        self._children: dict[uuid.UUID, set[uuid.UUID]] = {}
        self._parent: dict[uuid.UUID, uuid.UUID] = {}
        self._recent: collections.OrderedDict[uuid.UUID, UsageReceipt] = collections.OrderedDict()
        self._recovered = 0
        self._stop_ticker: Callable[[], None] | None = None
        self._pool = TurnPool(turn_workers, f"{self.name}-worker")
        ref = self.actor_ref
        # The turns this actor steps itself ("inline" providers); their events are handled as they happen.
        self._inline = TurnHost(
            wake=lambda: _tell_quietly(ref, STEP),
            finish=lambda op, outcome, error: self._own(Finished(op, outcome, error)),
            later=self._later,
            post=lambda fn: _tell_quietly(ref, Resolved(fn)),
        )

    # ------------------------------------------------------------------------------------- lifecycle
    def on_start(self) -> None:
        super().on_start()
        started_ms = self._clock_ms()  # read with or without a ledger: a replay reads the clock alike
        if self._data_dir is not None:
            # Opened on this thread: sqlite connections are thread-bound, and only the Router writes.
            path = self._data_dir / "receipts.sqlite3"
            commit = self._ledger_commit
            ledger = ReceiptLedger(path) if commit is None else ReceiptLedger(path, commit=commit)
            try:
                ledger.begin_incarnation()
                # Before anything is served: a dead incarnation's open turns become interrupted receipts.
                recovered = ledger.recover(now_ms=started_ms, price=self._price_of)
            except BaseException:
                ledger.close()
                raise
            self._ledger = ledger
            self._recovered = len(recovered)
            if recovered:
                log.info(
                    "%s: accounted %d turns left open by a Router that died", self.address, len(recovered)
                )
        ref = self.actor_ref
        if not replaying(self.node):  # a replay's ticks come from the log
            self._stop_ticker = self._ticker(self._tick_s, lambda: _tell_quietly(ref, TICK))

    def on_stop(self) -> None:
        if self._stop_ticker is not None:
            self._stop_ticker()
        self._ack_owed()  # a respond taken is answered as taken, whatever its read's end
        self._commit_group()  # what the open group wrote, and the answers it holds
        self._committing = True  # from here each write commits on its own: no commit message will come
        for turn in list(self._turns.values()):
            if not turn.done:
                turn.io.cancel()
                try:
                    self._settle(turn, "interrupted", "the Router stopped")
                except Exception:  # its open row stays: the next Router accounts it
                    log.exception("%s: settling %s at stop failed", self.address, turn.operation_id)
        self._inline.cancel_all()  # their ends are ignored: every turn is settled
        self._pool.stop(timeout=5.0)
        for provider in self._providers.values():
            try:
                provider.close()
            except Exception:
                log.exception("closing provider %s failed", provider.name)
        if self._ledger is not None:
            self._ledger.close()
        super().on_stop()

    # --------------------------------------------------------------------------------------- dispatch
    def handle(self, message: Any, ctx: Context) -> Any:
        match message:
            case ResolveModel(requested=requested):
                return self.catalog.resolve(requested)[0]
            case StartTurn():
                return self._start(message, ctx)
            case NextTurnEvent(operation_id=op):
                return self._next(self._turn(op, ctx), ctx)
            case StreamTurnEvents(operation_id=op):
                return self._stream(self._turn(op, ctx), ctx)
            case RespondCall(operation_id=op, call_id=call_id, result=result, read_on=read_on):
                turn = self._turn(op, ctx)
                self._respond(turn, call_id, result)
                if not read_on or ctx.header.flow != "stream":
                    return None
                return self._read_on(turn, ctx)
            case FinishUnavailable(operation_id=op):
                return self._finish_unavailable(op)
            case CancelOperation(operation_id=op):
                return OperationsCancelled(operation_ids=tuple(self._cancel(op)))
            case SubmitInput(operation_id=op, input=text):
                turn = self._turn(op, ctx)
                if turn.done:
                    raise TurnTerminated(f"operation {op} has ended", receipt=turn.receipt)
                if not turn.takes_input:  # stored, never read: the caller's edits would not reach the model
                    raise ProtocolError(
                        f"model {turn.spec.model!r} runs on a provider that cannot take a re-rendered input: "
                        f"SubmitInput is not supported (operation {op})"
                    )
                turn.io.submit_input(text)
                return None
            case CountTokens(model=model, texts=texts):
                return self._count(model, texts, ctx)
            case GetReceipt(operation_id=op):
                receipt = self._receipt_of(op)
                if receipt is None:
                    raise TurnNotFound(f"no receipt for operation {op}")
                return receipt
            case GetReceiptsFor(parent_operation_id=parent):
                return ReceiptList(receipts=self._receipts_for(parent))
            case GetRouterStats():
                return RouterStats(
                    turns=len(self._turns),
                    links=len(self._children),
                    recent=len(self._recent),
                    incarnation=self._ledger.incarnation if self._ledger is not None else None,
                    recovered=self._recovered,
                    commits=self._ledger.commits if self._ledger is not None else None,
                )
        raise ProtocolError(f"the Router does not handle {type(message).__name__}")

    def on_local(self, message: Any) -> Any:
        try:
            if isinstance(message, ReplayedMailbox):
                message = decode_local(self.node.registry, message.payload, self._open)
            elif self.node.capture is not None:
                payload = encode_local(self.node.registry, message)
                if payload is not None:
                    record_mailbox(self.node, self.address, payload)
            return self._on_local(message)
        except Exception:
            # A bug in turn bookkeeping must not stop the Router (pykka stops an actor whose tell raises):
            # the other turns and the receipts they owe are worth more than this message.
            log.exception("%s: handling %s failed", self.address, type(message).__name__)
            return None

    def _own(self, message: Any) -> None:
        """A message of a turn this actor hosts, handled at once (recorded as ``on_local`` records it)."""
        self.on_local(message)

    def _later(self, seconds: float, fn: Callable[[], None]) -> None:
        ref = self.actor_ref
        self.node.call_at(self.node.monotonic() + seconds, lambda: _tell_quietly(ref, _Later(fn)))

    def _on_local(self, message: Any) -> Any:
        match message:
            case Step():
                self._own(STEP_STARTED)
                try:
                    self._inline.step()
                finally:
                    self._own(STEP_ENDED)
            case StepMark(end=False):
                self._held = {}
            case StepMark(end=True):
                held, self._held = self._held or {}, None
                for stepped in held.values():
                    self._flush(stepped)
                self._ack_owed()
            case _Later(fn=fn) | Resolved(fn=fn):
                fn()
            case _CancelInline(operation_id=op):
                self._inline.cancel(op)
            case Emitted(operation_id=op, event=event):
                turn = self._turns.get(op)
                if turn is not None and not turn.done:
                    self._on_event(turn, event)
            case Finished(operation_id=op, outcome=outcome, error=error):
                turn = self._turns.get(op)
                if turn is not None and not turn.done:
                    self._on_finished(turn, outcome, error)
            case Counted(ctx=ctx, counts=counts, error=error):
                if error is not None:
                    ctx.fail(error)
                else:
                    ctx.reply(TokenCount(counts=counts or (), exact=True))
            case TimedOut(operation_id=op):
                turn = self._turns.get(op)
                if turn is not None and not turn.done:
                    turn.timer = None  # it has fired
                    turn.io.cancel()
                    self._fail(
                        turn, "timed_out", TurnTimedOut, f"no completion within {turn.spec.timeout_s}s"
                    )
            case Tick():
                self._on_tick()
            case _:
                return super().on_local(message)
        return None

    # ---------------------------------------------------------------------------------------- starting
    def _start(self, spec: StartTurn, ctx: Context) -> TurnStarted:
        if spec.timeout_s is not None and not 0 < spec.timeout_s <= MAX_TURN_TIMEOUT_S:  # also NaN
            # A turn timer past time_t kills its timer thread, and the turn would then never time out.
            raise ProtocolError(
                f"StartTurn.timeout_s must be in (0, {MAX_TURN_TIMEOUT_S:g}] seconds, not {spec.timeout_s!r}"
            )
        resolved, entry, provider_entry = self.catalog.resolve(spec.model)
        try:
            provider = self._provider(provider_entry)
        except Exception as exc:
            raise TurnNotStarted(
                f"provider {provider_entry.name} could not be set up: {exc}"[:500], kind="provider_setup"
            ) from exc
        op = self._new_op()
        tape = getattr(self.node, "provider_tape", None)
        if tape is not None:  # a live replay (app/replay_plugin.py): the recorded provider events instead
            provider = tape.provider(self.address)
        started_ms = self._clock_ms()
        receipt_id = f"rcpt-{recorded_uuid(self.node, self.address)}"
        ledger = self._ledger
        if ledger is not None:
            self._join_group()
            try:  # the intent is durable before the provider can run: a crash from here on is accounted
                ledger.open(
                    Intent(
                        operation_id=op,
                        receipt_id=receipt_id,
                        parent_operation_id=spec.parent_operation_id,
                        user_id=spec.user_id,
                        provider=resolved.provider,
                        provider_model=resolved.provider_model,
                        model=resolved.model,
                        round=spec.round,
                        started_at_ms=started_ms,
                    )
                )
            except (sqlite3.Error, OSError) as exc:
                raise TurnNotStarted(
                    f"the turn's intent could not be recorded: {exc}"[:500], kind="ledger"
                ) from exc
        io, host = self._hosting(provider, op)
        owner = ctx.header.src
        turn = Turn(
            op,
            spec.parent_operation_id,
            spec,
            resolved,
            io,
            started_ms,
            receipt_id,
            owner,
            self._heartbeat_of(owner),
            self._monotonic(),
            prices=getattr(entry, "prices", None),
            takes_input=getattr(provider, "takes_input", True) is not False,
        )
        self._turns[op] = turn
        self._link(op, spec.parent_operation_id)
        request = TurnRequest(
            model=resolved,
            messages=self._messages(spec),
            tool=ToolSpec(CALL_KTOOL, spec.tool_description, CALL_KTOOL_PARAMETERS),
            reasoning_effort=spec.reasoning_effort,
            max_output_tokens=spec.max_output_tokens,
            response_schema=spec.response_schema,
            tools=spec.tools,
            # The provider entry's options configured its client already; per-turn overrides go here.
        )
        if ledger is not None and ledger.in_group:
            # Its provider starts when the group's commit has put the intent on disk, not before.
            ledger.when_durable(lambda error: self._begin_durable(turn, host, provider, request, ctx, error))
        else:
            self._begin(turn, host, provider, request)
        ref = self.actor_ref
        if spec.timeout_s is not None and not replaying(self.node):
            turn.timer = self.node.call_at(
                self.node.monotonic() + spec.timeout_s, lambda: _tell_quietly(ref, TimedOut(op))
            )
        return TurnStarted(operation_id=op, model=resolved)

    def _begin(
        self, turn: Turn, host: Callable[[Any], None], provider: Provider, request: TurnRequest
    ) -> None:
        """Start the turn's provider (its intent is durable); raises the turn's failure if it cannot."""
        try:
            if not replaying(self.node):  # a replay's provider events come from the log
                host(lambda: self._steps(provider, request, turn.io))
        except RuntimeError as exc:  # no worker to be had: the intent is settled, nothing ran
            self._fail(turn, "failed", ProviderFailed, f"the turn's worker could not start: {exc}", cause=exc)
            self._release(turn)
            assert turn.failure is not None
            raise turn.failure from exc

    def _begin_durable(
        self,
        turn: Turn,
        host: Callable[[Any], None],
        provider: Provider,
        request: TurnRequest,
        ctx: Context,
        error: BaseException | None,
    ) -> None:
        """The group holding ``turn``'s intent has committed (``error`` None) or failed: start it, or refuse
        its StartTurn as if the intent's own write had failed (nothing ran, no operation exists)."""
        if error is not None:
            refused = TurnNotStarted(f"the turn's intent could not be recorded: {error}"[:500], kind="ledger")
            refused.__cause__ = error
            turn.failure = refused
            self._release(turn)
            self._unlink(turn.operation_id)
            self._refused[id(ctx)] = refused
            self._unstarted.add(turn.operation_id)
            return
        if turn.done:
            return  # cancelled (or timed out) before its intent was on disk: it never runs
        try:
            self._begin(turn, host, provider, request)
        except RouterError as exc:
            self._refused[id(ctx)] = exc  # its StartTurn is answered with why, as without a group

    # ----------------------------------------------------------------------------------- group commit
    def _handle_receive(self, message: Any) -> Any:
        try:
            return super()._handle_receive(message)  # commits the group when the mailbox drains
        finally:
            if self._group is not None:
                self._group_messages += 1
                if self._group_messages >= GROUP_MESSAGES:
                    self._commit_group()

    def on_drained(self) -> None:
        self._commit_group()

    def _join_group(self) -> None:
        """Before a ledger write: join the open group, or open one and hold this actor's answers until its
        commit. The group commits once this actor's mailbox has nothing more waiting (``on_drained``), or
        after ``GROUP_MESSAGES`` of its messages: what waited meanwhile shares it (one fsync for a burst)."""
        if self._group is not None or self._committing or self._ledger is None:
            return
        group = self._ledger.group()
        group.__enter__()
        self._group = group
        self._group_messages = 0
        self.hold_answers()
        self.when_drained()

    def _commit_group(self) -> None:
        """Commit the open group (one fsync), start the turns whose intents it held, then send the answers
        held since it opened. If the commit fails, nothing of the group is on disk: its turns that had not
        started are refused (``TurnNotStarted``), the receipts it settled are written again one by one, and
        only if one of those fails too is every held answer failed with ``LedgerUnavailable``."""
        group = self._group
        if group is None:
            return
        settled, self._group_settled = self._group_settled, []
        self._committing = True
        failure: BaseException | None = None
        try:
            group.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001 - a disk's error, told to whoever the group held
            failure = exc
        finally:
            self._group = None
            self._committing = False
        broken: BaseException | None = None
        if failure is not None:
            log.error("%s: a ledger group commit failed: %s", self.address, failure)
            assert self._ledger is not None
            unstarted, self._unstarted = self._unstarted, set()
            for turn in settled:
                if turn.operation_id in unstarted or turn.receipt is None:
                    continue  # never started: no operation exists, so no receipt is written
                try:
                    self._ledger.record(turn.receipt)
                except (sqlite3.Error, OSError) as exc:
                    broken = LedgerUnavailable(
                        f"the receipt ledger could not commit: {exc}"[:500], receipt=turn.receipt
                    )
                    log.error("%s: writing receipt %s again failed: %s", self.address, turn.receipt, exc)
        refused, self._refused = self._refused, {}
        if not refused and broken is None:
            self.release_answers()
        else:
            self.release_answers(lambda ctx: refused.get(id(ctx), broken))

    def _hosting(self, provider: Provider, op: uuid.UUID) -> tuple[WorkerIO, Callable[[Any], None]]:
        """The turn's IO and how to host it (called with a function making its steps): on this actor
        (``"inline"``), on the provider's own actor (``"owner"``), or on a pool worker (``"pool"``, and any
        provider with only a blocking ``run_turn``)."""
        bound = self._idle_bound + self._lost_after + self._tick_s
        ref = self.actor_ref
        placement = getattr(provider, "placement", "pool") if _stepped(provider) else "pool"
        if placement == "inline":
            inline = self._inline
            io = WorkerIO(
                ref,
                op,
                bound,
                emit_to=self._own,
                resume=lambda call_id, result: inline.resume(op, call_id, result),
                # After the handler that cancels has settled the turn: its end is then ignored.
                on_cancel=lambda: _tell_quietly(ref, _CancelInline(op)),
            )
            return io, lambda start: inline.add(op, start())
        worker = provider.turn_host() if placement == "owner" else self._pool.pick()  # type: ignore[attr-defined]
        stepped = _stepped(provider)
        io = WorkerIO(
            ref,
            op,
            bound,
            resume=(lambda c, r: _tell_quietly(worker, ResumeTurn(op, c, r))) if stepped else None,
            on_cancel=lambda: _tell_quietly(worker, CancelTurn(op)),
        )

        def finish(done: uuid.UUID, outcome: ProviderOutcome | None, error: BaseException | None) -> None:
            _tell_quietly(ref, Finished(done, outcome, error))  # the Router may have stopped meanwhile

        return io, lambda start: worker.tell(HostTurn(op, start, finish))

    @staticmethod
    def _steps(provider: Provider, request: TurnRequest, io: WorkerIO) -> TurnSteps:
        if _stepped(provider):
            stepped: TurnSteps = provider.steps(request, io)  # type: ignore[attr-defined]
            return stepped
        return _blocking(provider, request, io)

    def _heartbeat_of(self, owner: str) -> tuple[str, Any] | None:
        """How to hear from a turn's owner: an actor answers ``Ping`` from its own mailbox; a plain client
        thread has no mailbox, so for one on another node its node's I/O thread answers a ``Resolve``
        (the process lives); for a client thread of this node there is nothing to ask."""
        node, _, actor = owner.partition("/")
        if not node or not actor:
            return None
        if actor.startswith("client."):
            return None if node == self.node.name else (f"{node}/node", Resolve(actor=self.name))
        return (owner, Ping())

    def _price_of(self, model: str, usage: TokenUsage) -> float | None:
        try:
            entry = self.catalog.resolve(model)[1]
        except Exception:  # noqa: BLE001 - a model that left the catalog: its receipt has no cost
            return None
        prices = getattr(entry, "prices", None)
        return prices.cost_usd(usage) if prices is not None else None

    def _count(self, model: str, texts: tuple[str, ...], ctx: Context) -> Any:
        """The provider's tokenizer counts on a thread of their own (it may load a model file first), and
        the answer comes back through this mailbox; without a tokenizer, the conservative estimate."""
        _, _, provider_entry = self.catalog.resolve(model)
        tape = getattr(self.node, "provider_tape", None)
        if tape is not None:  # a live replay: the recorded count, if the recording had one
            counts = tape.counts(self.address)
            if counts is not None:
                return TokenCount(counts=counts, exact=True)
        provider = self._provider(provider_entry)
        counter = getattr(provider, "count_tokens", None)
        if counter is None:
            return TokenCount(counts=tuple(estimate_tokens(t) for t in texts), exact=False)
        ref = self.actor_ref

        def count() -> tuple[int, ...]:
            return tuple(int(n) for n in counter(texts))

        def done(counts: Any, exc: BaseException | None) -> None:
            if exc is not None:
                error = ProviderFailed(f"counting tokens failed: {exc}"[:500], kind="failed")
                error.__cause__ = exc
                _tell_quietly(ref, Counted(ctx, None, error))
            else:
                _tell_quietly(ref, Counted(ctx, counts, None))

        if not replaying(self.node):
            # On the actor that owns the tokenizer (it may load a model file first), else a pool worker.
            owner = getattr(provider, "turn_host", None)
            worker = owner() if owner is not None else self._pool.pick()
            worker.tell(RunCall(count, done))
        return DEFER

    def _messages(self, spec: StartTurn) -> tuple[ChatMessage, ...]:
        messages: list[ChatMessage] = []
        if spec.instructions:
            messages.append(ChatMessage("system", spec.instructions))
        if spec.continuation is not None:
            messages.extend(self._continued(spec.continuation))
        messages.append(ChatMessage("user", spec.input))
        return tuple(messages)

    def _continued(self, continuation: AgentContinuation) -> list[ChatMessage]:
        """The conversation a continuation token stands for (kept by the Router, opaque to everyone else)."""
        try:
            rows = json.loads(continuation.token.decode("utf-8"))
            return [
                ChatMessage(
                    r["role"],
                    r["content"],
                    tuple(NativeToolCall(*c) for c in r.get("calls", ())),
                    r.get("call_id"),
                )
                for r in rows
            ]
        except (ValueError, KeyError, TypeError) as exc:
            raise RouterError(f"unreadable continuation: {exc}", kind="bad_continuation") from None

    def _provider(self, entry: Any) -> Provider:
        name = entry.name
        if name in self._provider_overrides:
            return self._provider_overrides[name]
        provider = self._providers.get(name)
        if provider is None:
            from actors.router.providers import build_provider

            provider = build_provider(entry, env=self._env)
            self._providers[name] = provider
        return provider

    # ------------------------------------------------------------------------------------------ events
    def _on_event(self, turn: Turn, event: ProviderEvent) -> None:
        match event:
            case Submitted(context=context):
                self._queue(turn, TurnInput(context=context))
            case TextDelta(text=text):
                turn.produced = True
                self._queue(turn, TurnTextDelta(text=text))
            case UsageUpdate(usage=usage):
                turn.usage = usage
                if self._ledger is not None:
                    self._ledger.stage_usage(turn.operation_id, usage)  # written with the next write
                self._queue(turn, TurnUsage(usage=usage))
            case ToolCallRequested(call=call):
                turn.produced = True
                turn.surfaced.add(call.call_id)
                self._flush_usage()  # a step boundary: what the turn used so far is durable before the call
                self._queue(turn, parse_tool_call(call))

    def _flush_usage(self) -> None:
        if self._ledger is not None and self._ledger.staged:
            self._join_group()
            try:
                self._ledger.flush()
            except sqlite3.Error:
                log.exception("%s: writing streamed usage failed (kept for the next write)", self.address)

    def _on_finished(self, turn: Turn, outcome: ProviderOutcome | None, error: BaseException | None) -> None:
        if turn.timer is not None:
            self.node.cancel_call(turn.timer)
            turn.timer = None
        if outcome is not None:
            usage = outcome.usage or turn.usage
            turn.usage = usage
            receipt = self._settle(turn, "completed", None)
            self._queue(
                turn,
                TurnCompleted(
                    answer=outcome.answer,
                    usage=usage,
                    receipt=receipt,
                    continuation=self._continuation(turn, outcome),
                    finish_reason=outcome.finish_reason,
                ),
            )
            return
        if isinstance(error, ProviderError) and error.kind == CLOSED:
            turn.closed = True
            self._queue(turn, TurnClosed())  # no receipt yet: finish_unavailable accounts for it (SI-09)
            return
        if isinstance(error, ProviderError):
            status: ReceiptStatus = {
                "unavailable": "unavailable",
                "cancelled": "interrupted",
                "timed_out": "timed_out",
            }.get(error.kind, "failed")  # type: ignore[assignment]
            cls = {
                "unavailable": ProviderUnavailable,
                "cancelled": TurnCancelled,
                "timed_out": TurnTimedOut,
            }.get(error.kind, ProviderFailed)
            self._fail(turn, status, cls, error.message, cause=error.__cause__ or error)
        else:
            log.error("provider for %s raised %r", turn.operation_id, error, exc_info=error)
            self._fail(turn, "failed", ProviderFailed, f"{type(error).__name__}: {error}", cause=error)

    def _continuation(self, turn: Turn, outcome: ProviderOutcome) -> AgentContinuation | None:
        if turn.spec.ephemeral:
            return None
        rows = [
            {"role": m.role, "content": m.content} for m in self._messages(turn.spec) if m.role != "system"
        ]
        rows.append({"role": "assistant", "content": outcome.answer})
        return AgentContinuation(
            provider=turn.model.provider, model=turn.model.model, token=json.dumps(rows).encode("utf-8")
        )

    def _fail(
        self,
        turn: Turn,
        status: ReceiptStatus,
        cls: type[RouterError],
        message: str,
        cause: BaseException | None = None,
    ) -> None:
        receipt = self._settle(turn, status, message)
        error = cls(message, receipt=receipt, kind=status)
        if cause is not None:
            error.__cause__ = cause
        turn.failure = error
        self._flush(turn)

    def _queue(self, turn: Turn, event: Any) -> None:
        turn.events.append(event)
        if self._held is not None:
            self._held[turn.operation_id] = turn  # flushed when the step ends
        else:
            self._flush(turn)

    def _live(self, ctx: Context) -> bool:
        """A reader still waiting: not answered, and its deadline (if any) not passed."""
        deadline = ctx.header.deadline
        return not ctx.done and (deadline is None or deadline > self.node.clock())

    def _flush(self, turn: Turn) -> None:
        """Hand queued events to whoever waits: the stream first, else deferred next_event requests."""
        if turn.waiting and not all(self._live(c) for c in turn.waiting):
            for ctx in turn.waiting:  # an event given to a reader that gave up would be lost
                if not ctx.done and not self._live(ctx):
                    ctx.fail(Expired(f"read of operation {turn.operation_id} expired"))
            turn.waiting = [c for c in turn.waiting if not c.done]
        while turn.events and turn.stream is not None:
            batch: list[Any] = []
            until = turn.stream_until
            while turn.events and not isinstance(turn.events[0], until) and len(batch) < _BATCH:
                batch.append(turn.events.popleft())
            if self._owed:  # the first event a reading-on respond's reader gets says it was taken
                self._owed.pop(turn.operation_id, None)
            if batch and until is DECISION_EVENTS and turn.events and isinstance(turn.events[0], until):
                # The decision is here too: it ends the read, and what precedes it comes along in the final
                # reply (one message where a partial and the final reply would be two).
                event = turn.events.popleft()
                turn.stream.reply(TurnEventBatch(events=(*batch, event)))
                turn.stream = None
                self._handed(turn, event)
                continue
            if len(batch) == 1:
                turn.stream.partial(batch[0])
            elif batch:
                turn.stream.partial(TurnEventBatch(events=tuple(batch)))
            if turn.events and isinstance(turn.events[0], until):
                event = turn.events.popleft()
                turn.stream.reply(event)
                turn.stream = None
                self._handed(turn, event)
        while turn.events and turn.waiting:
            event = turn.events.popleft()
            turn.waiting.pop(0).reply(event)
            self._handed(turn, event)
        if turn.failure is not None and not turn.events:
            self._ack(turn)
            readers = ([turn.stream] if turn.stream is not None else []) + turn.waiting
            for ctx in readers:
                ctx.fail(turn.failure)
            if readers:
                turn.delivered = True
            turn.stream, turn.waiting = None, []
        if turn.done and turn.delivered:
            self._release(turn)

    @staticmethod
    def _handed(turn: Turn, event: Any) -> None:
        if isinstance(event, TurnCompleted):
            turn.delivered = True

    def _next(self, turn: Turn, ctx: Context) -> Any:
        if turn.stream is not None:  # the stream takes every event: this read would wait for none
            raise TurnBusy(f"operation {turn.operation_id} already has a reader")
        if turn.events:
            event = turn.events.popleft()
            self._handed(turn, event)
            if turn.done and turn.delivered and not turn.events:
                self._release(turn)
            return event
        if turn.failure is not None:
            turn.delivered = True
            self._release(turn)
            raise turn.failure
        if turn.done:
            raise TurnTerminated(f"operation {turn.operation_id} has ended", receipt=turn.receipt)
        turn.waiting.append(ctx)
        return DEFER

    def _stream(self, turn: Turn, ctx: Context) -> Any:
        if turn.stream is not None or turn.waiting:
            raise TurnBusy(f"operation {turn.operation_id} already has a reader")
        if turn.done and not turn.events and turn.failure is None:
            raise TurnTerminated(f"operation {turn.operation_id} has ended", receipt=turn.receipt)
        turn.stream, turn.stream_until = ctx, TERMINAL_EVENTS
        self._flush(turn)
        return DEFER

    def _read_on(self, turn: Turn, ctx: Context) -> Any:
        """A ``RespondCall(read_on=True)``'s read: the events up to the turn's next decision (a tool call,
        its completion or close) as partials, and that decision as the final reply, so a tool round reads
        its provider input and its next call in the exchange that answered the last one. Beside other
        readers it is one read of one event, as ``NextTurnEvent``."""
        ended = not turn.events and (turn.done or turn.failure is not None)
        if turn.waiting or turn.stream is not None or ended:
            ctx.partial(Ok())  # the result is taken: what follows is the read's
            return self._next(turn, ctx)  # beside another reader, or ended: answered as a read is
        turn.stream, turn.stream_until = ctx, DECISION_EVENTS
        steps = not turn.events and self._inline.steps_next(turn.operation_id)
        # Recorded (a replay hosts no turn, so it could not tell): whether the ack waits for the step.
        if self.node.effect(self.address, b"ack", lambda: b"\x01" if steps else b""):
            # Its next events come from a step already in the mailbox: the first of them, or the step's
            # end, says the result was taken (a failure is preceded by the Ok: see _ack).
            self._owed[turn.operation_id] = turn
        else:
            ctx.partial(Ok())
        self._flush(turn)
        return DEFER

    def _ack(self, turn: Turn) -> None:
        """Send the partial Ok ``turn``'s reader may still be owed, before anything but an event goes to it
        (its error, or the end of the read)."""
        ctx = turn.stream
        if self._owed.pop(turn.operation_id, None) is not None and ctx is not None and not ctx.done:
            ctx.partial(Ok())

    def _ack_owed(self) -> None:
        """A step ended: the acks it did not make by an event go now (a step never blocks, so the respond's
        answer waits at most one step)."""
        while self._owed:
            self._ack(next(iter(self._owed.values())))

    def _respond(self, turn: Turn, call_id: str, result: ToolResult) -> None:
        if call_id not in turn.surfaced:
            why = "was answered already" if call_id in turn.answered else "was never surfaced"
            raise InvalidCallId(f"call {call_id!r} of operation {turn.operation_id} {why}")
        if turn.done:
            raise TurnTerminated(f"operation {turn.operation_id} has ended", receipt=turn.receipt)
        turn.surfaced.discard(call_id)
        turn.answered.add(call_id)
        turn.io.deliver(call_id, result)

    # -------------------------------------------------------------------------------------- accounting
    def _settle(self, turn: Turn, status: ReceiptStatus, error: str | None) -> UsageReceipt:
        """Issue the turn's one receipt: written to the ledger before it is reported."""
        if turn.receipt is not None:
            return turn.receipt
        if turn.timer is not None:
            self.node.cancel_call(turn.timer)
            turn.timer = None
        now = self._clock_ms()
        usage = turn.usage
        prices = turn.prices
        receipt = UsageReceipt(
            receipt_id=turn.receipt_id,
            operation_id=turn.operation_id,
            parent_operation_id=turn.parent_operation_id,
            user_id=turn.spec.user_id,
            provider=turn.model.provider,
            provider_model=turn.model.provider_model,
            model=turn.model.model,
            round=turn.spec.round,
            status=status,
            usage=usage,
            issued_at_ms=now,
            started_at_ms=turn.started_ms,
            duration_ms=max(0, now - turn.started_ms),
            cost_usd=prices.cost_usd(usage) if prices is not None and usage is not None else None,
            error=error,
        )
        if self._ledger is not None:
            self._join_group()
            receipt = self._ledger.record(receipt)  # settles the open row; the stored one wins (exactly once)
            if self._group is not None:
                self._group_settled.append(turn)
        turn.receipt = receipt
        turn.settled_at = self._monotonic()
        return receipt

    def _finish_unavailable(self, op: uuid.UUID) -> UsageReceipt:
        turn = self._turns.get(op)
        if turn is None:
            stored = self._receipt_of(op)
            if stored is None:
                raise TurnNotFound(f"no operation {op}")
            return stored
        if turn.done:
            assert turn.receipt is not None
            return turn.receipt
        turn.io.cancel()
        receipt = self._settle(turn, "interrupted", "accounted as unavailable by the caller")
        turn.failure = TurnTerminated(f"operation {op} was accounted as unavailable", receipt=receipt)
        turn.delivered = True  # the caller holds the receipt; later reads are answered from the ledger
        self._flush(turn)
        return receipt

    def _cancel(self, op: uuid.UUID) -> list[uuid.UUID]:
        """Cancel ``op``'s turn (if it is one) and every descendant operation's turn."""
        cancelled: list[uuid.UUID] = []
        stack = [op]
        seen: set[uuid.UUID] = set()
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            stack.extend(self._children.get(current, ()))
            turn = self._turns.get(current)
            if turn is not None and not turn.done:
                turn.io.cancel()
                status: ReceiptStatus = "interrupted" if turn.produced else "cancelled"
                self._fail(turn, status, TurnCancelled, f"operation {current} was cancelled")
                cancelled.append(current)
        return cancelled

    # -------------------------------------------------------------------------------- liveness, memory
    def _on_tick(self) -> None:
        self._flush_usage()
        now = self._monotonic()
        for turn in list(self._turns.values()):
            if turn.done:
                if turn.delivered or now - turn.settled_at >= self._grace:
                    self._release(turn)  # nobody read its end within the grace: the ledger answers later
            else:
                self._watch(turn, now)

    def _idle_on_owner(self, turn: Turn) -> bool:
        """The turn waits for its owner: a surfaced call is unanswered, the closed stream waits to be
        accounted, or no read of the owner's is outstanding."""
        if turn.surfaced or turn.closed:
            return True
        return not (
            (turn.stream is not None and self._live(turn.stream)) or any(map(self._live, turn.waiting))
        )

    def _watch(self, turn: Turn, now: float) -> None:
        if not self._idle_on_owner(turn):
            turn.idle_since = None
            return
        if turn.idle_since is None:
            turn.idle_since = now
        if now - turn.idle_since >= self._idle_bound:
            self._interrupt(turn, f"it waited on its owner {turn.owner} for more than {self._idle_bound}s")
        elif turn.ping_failed and now - turn.owner_seen >= self._lost_after:
            self._owner_lost(turn, now)
        elif (
            turn.heartbeat is not None
            and not turn.pinging
            and now - max(turn.owner_seen, turn.pinged_at) >= self._ping_interval
        ):
            self._ping(turn, now)

    def _ping(self, turn: Turn, now: float) -> None:
        assert turn.heartbeat is not None
        address, message = turn.heartbeat
        op = turn.operation_id
        turn.pinging, turn.pinged_at = True, now
        self.ask(address, message, lambda reply: self._on_heartbeat(op, reply), timeout=self._ping_interval)

    def _on_heartbeat(self, op: uuid.UUID, reply: Reply) -> None:
        turn = self._turns.get(op)
        if turn is None or turn.done:
            return
        turn.pinging = False
        now = self._monotonic()
        if not isinstance(reply.error, OWNER_GONE):  # a Pong, or any answer at all: the owner's side lives
            turn.owner_seen, turn.ping_failed = now, False
            return
        log.info("%s: owner %s of %s did not answer: %r", self.address, turn.owner, op, reply.error)
        turn.ping_failed = True
        if self._idle_on_owner(turn) and now - turn.owner_seen >= self._lost_after:
            self._owner_lost(turn, now)

    def _owner_lost(self, turn: Turn, now: float) -> None:
        self._interrupt(
            turn, f"its owner {turn.owner} stopped answering (silent for {now - turn.owner_seen:.1f}s)"
        )

    def _interrupt(self, turn: Turn, why: str) -> None:
        """End a turn nobody can finish: cancel the provider, account it, and let it leave memory (its
        receipt is durable; later requests are answered from the ledger or the recent receipts)."""
        log.info("%s: interrupting %s: %s", self.address, turn.operation_id, why)
        turn.io.cancel()
        self._fail(turn, "interrupted", TurnInterrupted, f"the Router interrupted the turn: {why}")
        self._release(turn)

    def _release(self, turn: Turn) -> None:
        """Forget an ended turn (its receipt is durable, or remembered in ``_recent`` without a ledger)."""
        op = turn.operation_id
        if self._turns.pop(op, None) is None:
            return
        if turn.timer is not None:
            self.node.cancel_call(turn.timer)
            turn.timer = None
        late = TurnTerminated(f"operation {op} has ended", receipt=turn.receipt)
        self._ack(turn)
        for ctx in ([turn.stream] if turn.stream is not None else []) + turn.waiting:
            if not ctx.done:
                ctx.fail(turn.failure or late)
        turn.stream, turn.waiting = None, []
        if self._ledger is None and turn.receipt is not None:
            self._recent[op] = turn.receipt
            while len(self._recent) > self._recent_bound:
                self._recent.popitem(last=False)
        self._unlink(op)

    def _link(self, op: uuid.UUID, parent: uuid.UUID) -> None:
        """Record ``op`` as a child of ``parent`` for cancellation (RT-12). A parent that was itself a turn
        and has left memory is linked again to its own parent (from its receipt), and so on up, so that
        cancelling any ancestor still reaches ``op``."""
        while True:
            self._children.setdefault(parent, set()).add(op)
            self._parent[op] = parent
            if parent in self._parent:
                return  # a turn in memory, or one already linked again
            receipt = self._receipt_of(parent)
            if receipt is None:
                return  # not a turn (a session's or a run's operation): the top of the lineage here
            op, parent = parent, receipt.parent_operation_id

    def _unlink(self, op: uuid.UUID) -> None:
        """Drop ``op`` from the lineage once it is neither in memory nor a parent of a turn in memory, and
        so on up (a released turn may have stayed only as the link to its own children)."""
        while op not in self._turns and not self._children.get(op):
            self._children.pop(op, None)
            parent = self._parent.pop(op, None)
            if parent is None:
                return
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(op)
                if not siblings:
                    del self._children[parent]
            op = parent

    def _receipt_of(self, op: uuid.UUID) -> UsageReceipt | None:
        turn = self._turns.get(op)
        if turn is not None and turn.receipt is not None:
            return turn.receipt
        if self._ledger is not None:
            return self._ledger.get(op)
        return self._recent.get(op)

    def _receipts_for(self, parent: uuid.UUID) -> tuple[UsageReceipt, ...]:
        """The ledger's receipts under ``parent`` and those of its live turns (no ledger: the recent ones)."""
        if self._ledger is not None:
            found = {r.operation_id: r for r in self._ledger.for_parent(parent)}
        else:
            found = {op: r for op, r in self._recent.items() if r.parent_operation_id == parent}
        for op in self._children.get(parent, ()):
            receipt = self._receipt_of(op)
            if receipt is not None:
                found.setdefault(op, receipt)
        return tuple(sorted(found.values(), key=lambda r: r.issued_at_ms))

    def _turn(self, op: uuid.UUID, ctx: Context | None = None) -> Turn:
        turn = self._turns.get(op)
        if turn is None:
            receipt = self._receipt_of(op)
            if receipt is not None:
                cls = TurnInterrupted if receipt.status == "interrupted" else TurnTerminated
                raise cls(f"operation {op} has ended", receipt=receipt)
            raise TurnNotFound(f"no operation {op}")
        if ctx is not None and ctx.header.src == turn.owner:
            turn.owner_seen, turn.ping_failed = self._monotonic(), False  # the owner's own request
        return turn


@frozen
class _Later:
    """A timer of a turn this actor hosts (a scripted delay) is due: run ``fn`` here."""

    fn: Callable[[], None]


@frozen
class _CancelInline:
    """Throw the cancel into a turn this actor hosts, after the handler that settled it."""

    operation_id: uuid.UUID


def _stepped(provider: Provider) -> bool:
    """Whether the Router steps the provider's turns (``steps``): not when a subclass overrides the
    blocking ``run_turn`` below the class that defines ``steps`` (that override is then what runs, on the
    pool)."""
    for klass in type(provider).__mro__:
        if "steps" in vars(klass):
            return True
        if "run_turn" in vars(klass):
            return False
    return False


def _blocking(provider: Provider, request: TurnRequest, io: WorkerIO) -> TurnSteps:
    """A provider with only a blocking ``run_turn``, as one step (it waits in ``io.wait_result``)."""
    yield from ()  # a generator with no yield: it runs run_turn at its first step
    return provider.run_turn(request, io)


def _tell_quietly(ref: Any, message: Any) -> None:
    try:
        ref.tell(message)
    except Exception:  # noqa: BLE001 - the Router stopped: nothing left to time out
        log.debug("router gone before %r", message)
