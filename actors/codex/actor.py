"""The Codex-adapter actor: one ``codex app-server`` child (``child.py``), the per-key turn registry, and the
mapping of the app-server's JSON-RPC frames (``rpc.py``) onto turns and events.

One pykka thread, no locks (MB-01): single-active-turn per key (AD-09) is a dict check in the mailbox, and a
second ``start_turn`` on a busy key is answered ``BUSY`` here and never reaches the child (the real server
would merge it into the active turn, CODEX.md). The child's life is a union of frozen states moved by
``lifecycle.step``; ``handle`` is one ``match`` on (state, message), guard rows first: closed, then broken,
then not open, then busy. Nothing here blocks on the child: its reader threads turn stdout lines and stderr
chunks into ``ChildOutput`` tells to this actor (a capture records them as deliveries, so a replay feeds
them back), and every JSON-RPC request is a continuation keyed by its id. What the actor writes to the
child goes through ``Node.effect`` keyed by the written line, so a replay checks every write without a
child; the line itself is queued for the writer thread, whose write is bounded
(``LaunchOptions.write_timeout``: a child that stops reading its stdin is killed, its turns end UNAVAILABLE).
The child is closed and reaped when the last handle is released and no turn is left unfinished, or when
the actor stops (node stop).
"""

from __future__ import annotations

import collections
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import actors.codex.lifecycle as life
from actors.base import DEFER, BusActor, Context
from actors.codex.child import Child, LaunchOptions
from actors.codex.lifecycle import Broken, Closed, Closing, Exited, Ready, Spawning
from actors.codex.messages import (
    Abandon,
    AwaitOpen,
    ChildOutput,
    Diagnostics,
    DiagnosticsReply,
    NextEvent,
    Release,
    Respond,
    Retain,
    Retained,
    StartTurn,
    TurnStarted,
    TurnUsage,
    TurnUsageReply,
)
from actors.codex.rpc import (
    Calls,
    Malformed,
    Notification,
    Response,
    ServerRequest,
    Then,
    encode,
    error_text,
    parse,
)
from actors.codex.types import (
    AdapterConfig,
    AdapterError,
    CodexToolCall,
    Done,
    ErrorEvent,
    ErrorKind,
    Event,
    TextDelta,
    ToolCallEvent,
    validate_config,
)
from actors.types import TokenUsage
from transport.errors import LimitExceeded, ProtocolError
from transport.messages import Ok
from transport.node import Node
from transport.records import frozen

log = logging.getLogger(__name__)

MAX_DIAGNOSTICS = 1 << 20  # AD-15: the most recent 1 MiB of stderr
# A next_event whose caller gives up within this many seconds gets no event: its reply could arrive after
# the caller stopped waiting and be dropped; the event waits for the next call instead.
REPLY_MARGIN = 0.05
MAX_HANDLES = 1024  # handles (Retain) held at once; past it LimitExceeded
MAX_GONE = 4096  # finished turns remembered (next_event answers None, usage stays readable)
CLIENT_INFO = {"name": "kbus", "title": "kbus codex adapter", "version": "0.1.0"}

# starting: turn/start not yet answered; active: accepted; finished: its terminal event is queued;
# delivered: that event was taken; abandoned: given up by its holder (or its start failed).
TurnState = Literal["starting", "active", "finished", "delivered", "abandoned"]


@dataclass(eq=False)
class _Turn:
    id: str
    key: str
    input: str
    ctx: Context | None  # the StartTurn request, until the app-server accepted the turn
    state: TurnState = "starting"
    thread: str | None = None
    native: str | None = None  # the app-server's turn id
    events: collections.deque[Event] = field(default_factory=collections.deque)
    waiters: collections.deque[Context] = field(default_factory=collections.deque)
    calls: dict[str, Any] = field(default_factory=dict)  # pending call id -> server request id
    error_message: str | None = None
    usage: TokenUsage | None = None  # the sum of the turn's model requests (thread/tokenUsage/updated)

    @property
    def live(self) -> bool:
        """Holds the child: not abandoned and its terminal event not yet taken (AD-17)."""
        return self.state not in ("abandoned", "delivered")

    @property
    def running(self) -> bool:
        return self.state in ("starting", "active")


@frozen
class _ReapDue:
    """Local only: REAP_TIMEOUT passed since the close; a child still running is killed."""


class CodexAdapterActor(BusActor):
    """One child, one registry. Started by ``Adapter.open`` (or a node) with the config."""

    def __init__(
        self,
        node: Node,
        address: str,
        *,
        config: AdapterConfig,
        launch: LaunchOptions | None = None,
        handle: str = "",
    ) -> None:
        """``handle``: the opener's token (``Adapter.open`` makes a random one; a replay gives none)."""
        super().__init__(node, address)
        validate_config(config)
        self.config = config
        self.launch = launch or LaunchOptions()
        # The reader and writer threads' sender addresses (one per thread: each numbers its own tells).
        self.child_srcs = (f"{address}.stdout", f"{address}.stderr", f"{address}.stdin")
        self._child = Child(config, self.launch, self._post)
        self._state: life.State = Spawning()
        # The handles given out, by token: the opener's (``handle``) and one per Retain. Only a token's holder
        # can release it, so a hostile Release cannot close the child under its users.
        self._handles: set[str] = {handle}
        self._stderr = bytearray()
        self._calls = Calls()
        self._turn_seq = 0
        self._turns: dict[str, _Turn] = {}
        # Turns whose terminal event was taken, or abandoned -> their token usage (the newest MAX_GONE).
        self._gone: dict[str, TokenUsage | None] = {}
        self._active: dict[str, str] = {}  # conversation key -> turn id (AD-09)
        self._threads: dict[str, str] = {}  # conversation key -> app-server thread id (AD-12)
        self._current: dict[str, str] = {}  # app-server thread id -> turn id receiving its frames
        self._dead_natives: set[str] = set()  # abandoned app-server turn ids: their late frames drop
        self._draining: dict[str, str] = {}  # thread -> abandoned native turn not yet completed
        self._queued: dict[str, _Turn] = {}  # thread -> turn waiting for the drain to end

    # ------------------------------------------------------------------------------------- lifecycle
    def on_start(self) -> None:
        super().on_start()
        outcome = self.node.effect(self.address, b"spawn", self._child.spawn)
        if outcome != b"ok":
            self._state = Exited(AdapterError(ErrorKind.UNAVAILABLE, outcome.decode("utf-8", "replace")))
            return
        params = {"clientInfo": CLIENT_INFO, "capabilities": {"experimentalApi": True}}
        self._rpc("initialize", params, self._on_initialized)

    def _advance(self, event: life.LifeEvent) -> None:
        """One lifecycle step: the new state first, then its actions (which may step again)."""
        self._state, actions = life.step(self._state, event)
        for action in actions:
            match action:
                case life.SendInitialized():
                    self._write({"method": "initialized"})
                case life.AnswerOpen(waiters=waiters, error=error):
                    for ctx in waiters:
                        if ctx.done:
                            continue
                        if error is None:
                            ctx.reply(Ok())
                        else:
                            ctx.fail(error)
                case life.Kill():
                    self._child.kill()
                case life.Abort(error=error):
                    self._calls.clear()
                    for turn in list(self._turns.values()):
                        if turn.running:
                            self._finish(turn, ErrorEvent(error))
                case life.CloseStdin():
                    self._child.close_stdin(self._reap_due)
                case life.Reap():
                    self._child.reap()
                case life.Answer(answers=answers):
                    for ctx, reply in answers:
                        if not ctx.done:
                            ctx.reply(reply)
                case life.StopActor():
                    self.actor_ref.stop(block=False)

    def _unheld(self, answer: tuple[Context, Any] | None = None) -> bool:
        """AD-17: with no handle and no unfinished turn left, the child closes. ``answer`` is then sent once
        it is reaped; returns whether it was taken (else the caller answers now)."""
        if self._handles or any(turn.live for turn in self._turns.values()):
            return False
        self._advance(life.Unheld(answer))
        return answer is not None

    def _post(self, message: ChildOutput) -> None:
        """The child's threads: into the mailbox. With a capture running it travels as a bus tell, so the log
        records it as a delivery and a replay feeds it back; otherwise straight into the mailbox (no encode,
        no header): the same handler either way."""
        try:
            if self.node.capture is None:
                self.actor_ref.tell(message)
            else:
                src = self.child_srcs[{"stderr": 1, "stuck": 2}.get(message.stream, 0)]
                self.node.tell(self.address, message, src=src)
        except Exception:  # noqa: BLE001 - the actor or node is stopping: nobody is left to tell
            log.debug("%s: child output after stop dropped", self.address)

    def _reap_due(self) -> None:
        """The reap timer's thread: into the mailbox (not captured: only the exit it causes is)."""
        try:
            self.actor_ref.tell(_ReapDue())
        except Exception:  # noqa: BLE001 - the actor stopped meanwhile: it reaped the child
            log.debug("%s: reap timer after stop", self.address)

    def on_local(self, message: Any) -> Any:
        match message:
            case ChildOutput():
                self._child_output(message)
                return None
            case _ReapDue():
                if isinstance(self._state, Closing):
                    log.warning("%s: codex app-server ignored the close; killed", self.address)
                self._advance(life.ReapDue())
                return None
        return super().on_local(message)

    def on_stop(self) -> None:
        # Also when a close is under way (the child may not have exited yet): the child and its home go now.
        self._advance(life.Stopped())
        for turn in self._turns.values():
            for ctx in turn.waiters:
                if not ctx.done:
                    ctx.fail(AdapterError(ErrorKind.UNAVAILABLE, "the adapter stopped"))
            turn.waiters.clear()
        super().on_stop()

    def on_failure(self, exception_type: Any, exception_value: Any, traceback: Any) -> None:
        self._advance(life.Stopped())
        super().on_failure(exception_type, exception_value, traceback)

    # ------------------------------------------------------------------------------------- handlers
    def handle(self, message: Any, ctx: Context) -> Any:
        match self._state, message:
            # In every state: the child's output, diagnostics, and what concerns a turn already made.
            case _, ChildOutput() if ctx.header.src not in self.child_srcs:
                raise ProtocolError(f"child output from {ctx.header.src}")
            case _, ChildOutput():
                self._child_output(message)
                return None
            case _, Diagnostics():
                return DiagnosticsReply(stderr=bytes(self._stderr))
            case _, TurnUsage(turn_id=turn_id):
                return self._turn_usage(turn_id)
            case _, NextEvent():
                return self._next_event(message, ctx)
            case _, Abandon(turn_id=turn_id):
                self._abandon(turn_id)
                return None
            case _, Release(handle=token) if token not in self._handles:
                raise AdapterError(ErrorKind.PROTOCOL, "release of a handle this adapter did not give out")
            case _, Release(handle=token):
                self._handles.discard(token)
                return DEFER if self._unheld((ctx, Ok())) else None  # DEFER: answered once reaped (AD-17)
            # Guard rows: closed, then broken, then not open, then busy.
            case Closing() | Closed(), Retain() | AwaitOpen():
                raise AdapterError(ErrorKind.UNAVAILABLE, "the adapter is closed")
            case Broken(failure=failure) | Exited(failure=failure), AwaitOpen():
                raise failure
            case (
                Broken(failure=failure)
                | Exited(failure=failure)
                | Closing(failure=AdapterError() as failure),
                StartTurn() | Respond(),
            ):
                raise AdapterError(failure.kind, failure.message, bytes(self._stderr))
            case Spawning() | Closing() | Closed(), StartTurn():
                raise AdapterError(ErrorKind.UNAVAILABLE, "the adapter is not open")
            case _, Retain() if len(self._handles) >= MAX_HANDLES:
                raise LimitExceeded(f"{self.address} holds {MAX_HANDLES} handles already", limit=MAX_HANDLES)
            case Ready(), StartTurn(conversation_key=key) if key in self._active:
                raise AdapterError(ErrorKind.BUSY, f"conversation {key[:80]!r} has an active turn")
            # The live rows.
            case _, Retain():
                token = uuid.uuid4().hex
                self._handles.add(token)
                return Retained(handle=token)
            case Spawning(waiters=waiters), AwaitOpen():
                self._state = Spawning((*waiters, ctx))
                return DEFER
            case Ready(), AwaitOpen():
                return None
            case Ready(), StartTurn():
                return self._start_turn(message, ctx)
            case _, Respond():
                return self._respond(message)
        raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")

    def _error(self, kind: ErrorKind, message: str) -> AdapterError:
        """An error caused by the child's state: with a snapshot of its stderr (AD-16)."""
        return AdapterError(kind, message, bytes(self._stderr))

    def _turn_usage(self, turn_id: str) -> TurnUsageReply:
        turn = self._turns.get(turn_id)
        if turn is not None:
            return TurnUsageReply(usage=turn.usage)
        if turn_id in self._gone:
            return TurnUsageReply(usage=self._gone[turn_id])
        raise AdapterError(ErrorKind.UNAVAILABLE, f"no turn {turn_id[:40]!r}")

    # -------------------------------------------------------------------------------- turn registry
    def _start_turn(self, message: StartTurn, ctx: Context) -> Any:
        key = message.conversation_key
        self._turn_seq += 1
        turn = _Turn(id=f"t{self._turn_seq}", key=key, input=message.input, ctx=ctx)
        self._turns[turn.id] = turn
        self._active[key] = turn.id
        thread = self._threads.get(key)
        if thread is None:
            self._rpc("thread/start", self._thread_params(), lambda r, e: self._on_thread(turn, r, e))
        else:
            self._begin(turn, thread)
        return DEFER

    def _thread_params(self) -> dict[str, Any]:
        config = self.config
        return {
            "cwd": config.working_directory,
            "model": config.model,
            "baseInstructions": config.base_instructions,
            "approvalPolicy": "never",
            "sandbox": "read-only",
            "dynamicTools": [
                {
                    "type": "function",
                    "name": t.name,
                    "description": t.description,
                    "inputSchema": t.input_schema,
                }
                for t in config.tools
            ],
        }

    def _on_thread(self, turn: _Turn, result: Any, error: dict[str, Any] | None) -> None:
        if turn.state != "starting":
            return
        if error is not None:
            self._reject_start(
                turn, self._error(ErrorKind.SERVER, f"thread/start failed: {error_text(error)}")
            )
            return
        thread = result.get("thread", {}).get("id") if isinstance(result, dict) else None
        if not isinstance(thread, str):
            self._protocol(f"thread/start result without thread.id: {_short(result)}")
            return
        self._threads[turn.key] = thread
        self._begin(turn, thread)

    def _begin(self, turn: _Turn, thread: str) -> None:
        if thread in self._draining:  # the abandoned turn is still winding down: a turn/start would merge
            self._queued[thread] = turn
            return
        turn.thread = thread
        self._current[thread] = turn.id
        params: dict[str, Any] = {
            "threadId": thread,
            "input": [{"type": "text", "text": turn.input}],
            "model": self.config.model,
        }
        if self.config.reasoning_effort is not None:
            params["effort"] = self.config.reasoning_effort
        self._rpc("turn/start", params, lambda r, e: self._on_turn_started(turn, r, e))

    def _on_turn_started(self, turn: _Turn, result: Any, error: dict[str, Any] | None) -> None:
        native = result.get("turn", {}).get("id") if isinstance(result, dict) else None
        if turn.state != "starting":
            if isinstance(native, str):  # ended meanwhile (protocol error, child death): stop it there too
                self._interrupt(turn.thread or "", native)
            return
        if error is not None:
            self._reject_start(turn, self._error(ErrorKind.SERVER, f"turn/start failed: {error_text(error)}"))
            return
        if not isinstance(native, str):
            self._protocol(f"turn/start result without turn.id: {_short(result)}")
            return
        turn.native = native
        turn.state = "active"
        ctx, turn.ctx = turn.ctx, None
        if ctx is not None and not ctx.done:
            ctx.reply(TurnStarted(turn_id=turn.id))
        self._pump(turn)

    def _reject_start(self, turn: _Turn, error: AdapterError) -> None:
        """AD-14: the start failed: the key stays free and no Turn exists."""
        turn.state = "abandoned"
        self._release_key(turn)
        self._turns.pop(turn.id, None)
        ctx, turn.ctx = turn.ctx, None
        if ctx is not None and not ctx.done:
            ctx.fail(error)
        self._unheld()

    def _next_event(self, message: NextEvent, ctx: Context) -> Any:
        turn = self._turns.get(message.turn_id)
        if turn is None:
            if message.turn_id in self._gone:
                return None  # TU-02: the terminal event was delivered (or the turn abandoned)
            raise AdapterError(ErrorKind.UNAVAILABLE, f"no turn {message.turn_id[:40]!r}")
        turn.waiters.append(ctx)
        self._pump(turn)
        return DEFER

    def _pump(self, turn: _Turn) -> None:
        """Answer waiting ``next_event`` requests in order. A request whose caller gave up (its deadline
        passed) is dropped without taking an event, so no event is lost to a timeout."""
        while turn.waiters:
            if not turn.live:
                turn.waiters.popleft().reply(Ok())
                continue
            if not turn.events:
                return
            ctx = turn.waiters.popleft()
            deadline = ctx.header.deadline
            if deadline is not None and deadline - REPLY_MARGIN <= self.node.clock():
                self._open.pop(ctx.header.id, None)
                ctx.done = True
                continue
            event = turn.events.popleft()
            if isinstance(event, Done | ErrorEvent):
                turn.state = "delivered"
                # The last holder's terminal event: if that closes the child, the caller hears it once the
                # child is reaped (or at once, had it exited already).
                if not turn.waiters and self._forget(turn, (ctx, event)):
                    continue
            ctx.reply(event)
        if not turn.live:
            self._forget(turn)

    def _forget(self, turn: _Turn, answer: tuple[Context, Any] | None = None) -> bool:
        """Drop a turn that no longer holds the child; returns whether the close took ``answer``."""
        if self._turns.pop(turn.id, None) is None:
            return False
        self._gone[turn.id] = turn.usage
        if len(self._gone) > MAX_GONE:
            del self._gone[next(iter(self._gone))]
        return self._unheld(answer)

    def _respond(self, message: Respond) -> Any:
        turn = self._turns.get(message.turn_id)
        call_id = message.call_id
        if turn is None or turn.state != "active" or call_id not in turn.calls:
            # TU-07: nothing is sent; the turn stays as it was.
            raise AdapterError(
                ErrorKind.INVALID_TOOL_RESULT,
                f"no pending call {call_id[:80]!r} in turn {message.turn_id[:40]}",
            )
        request_id = turn.calls.pop(call_id)
        result = message.result
        self._write(
            {
                "id": request_id,
                "result": {
                    "contentItems": [{"type": "inputText", "text": result.output}],
                    "success": result.success,
                },
            }
        )
        return None

    def _abandon(self, turn_id: str) -> None:
        turn = self._turns.get(turn_id)
        if turn is None or not turn.running:
            return  # TU-06: nothing to do, nothing sent
        turn.state = "abandoned"
        turn.events.clear()
        turn.calls.clear()
        self._release_key(turn)
        if turn.native is not None and turn.thread is not None:
            self._interrupt(turn.thread, turn.native)
        self._pump(turn)

    def _interrupt(self, thread: str, native: str) -> None:
        if life.failure_of(self._state) is not None or not thread:
            return
        self._dead_natives.add(native)
        self._draining[thread] = native

        def done(result: Any, error: dict[str, Any] | None) -> None:
            if error is not None:  # nothing to interrupt: the turn had ended already
                self._drained(thread, native)

        self._rpc("turn/interrupt", {"threadId": thread, "turnId": native}, done)

    def _drained(self, thread: str, native: str) -> None:
        if self._draining.get(thread) != native:
            return
        del self._draining[thread]
        queued = self._queued.pop(thread, None)
        if queued is not None and queued.state == "starting":
            self._begin(queued, thread)

    def _release_key(self, turn: _Turn) -> None:
        if self._active.get(turn.key) == turn.id:
            del self._active[turn.key]
        if turn.thread is not None and self._current.get(turn.thread) == turn.id:
            del self._current[turn.thread]

    def _finish(self, turn: _Turn, event: Event) -> None:
        """The turn's one terminal event (TU-02); the key is free again (AD-11)."""
        if not turn.running:
            return
        if turn.state == "starting":
            self._reject_start(
                turn,
                event.error
                if isinstance(event, ErrorEvent)
                else self._error(ErrorKind.PROTOCOL, "turn ended before it started"),
            )
            return
        turn.state = "finished"
        turn.calls.clear()
        turn.events.append(event)
        self._release_key(turn)
        self._pump(turn)

    # ----------------------------------------------------------------------------- the child's output
    def _child_output(self, message: ChildOutput) -> None:
        match message.stream:
            case "stderr":
                buf = self._stderr
                buf += message.data
                if len(buf) > MAX_DIAGNOSTICS:
                    del buf[: len(buf) - MAX_DIAGNOSTICS]
            case "exit":
                text = f"codex app-server exited (code {message.code})"
                self._advance(life.ChildExited(self._error(ErrorKind.UNAVAILABLE, text)))
            case "stuck":
                # AD-18: the child stopped reading its stdin: it is killed, its turns end UNAVAILABLE.
                log.warning("%s: codex app-server stopped reading its stdin", self.address)
                text = (
                    f"codex app-server stopped reading its stdin (a write made no progress for "
                    f"{self.launch.write_timeout:g} s); it was killed"
                )
                self._advance(life.Unusable(self._error(ErrorKind.UNAVAILABLE, text)))
            case _:
                self._on_line(message.data)

    def _on_line(self, data: bytes) -> None:
        match parse(data):
            case None:
                return
            case Malformed(why=why):
                self._protocol(why)
            case ServerRequest(id=request_id, method=method, params=params):
                self._server_request(request_id, method, params)
            case Notification(method=method, params=params):
                self._notification(method, params)
            case Response() as response:
                if not self._calls.settle(response):
                    self._protocol(f"child answered a request never sent: {data[:200]!r}")

    def _route(self, params: dict[str, Any], native: Any = None) -> _Turn | None:
        native = native if native is not None else params.get("turnId")
        if native in self._dead_natives:
            return None
        tid = self._current.get(params.get("threadId"))  # type: ignore[arg-type]
        turn = self._turns.get(tid) if tid is not None else None
        if turn is None or not turn.running:
            return None
        if turn.native is not None and isinstance(native, str) and native != turn.native:
            return None
        return turn

    def _server_request(self, request_id: Any, method: str, params: dict[str, Any]) -> None:
        if method != "item/tool/call":
            self._write(
                {"id": request_id, "error": {"code": -32601, "message": f"kbus does not handle {method}"}}
            )
            return
        turn = self._route(params)
        call_id, tool, arguments = params.get("callId"), params.get("tool"), params.get("arguments")
        if turn is None:  # a call of an abandoned turn: refuse it so the server never waits for it
            self._write({"id": request_id, "error": {"code": -32000, "message": "turn abandoned"}})
            return
        if not isinstance(call_id, str) or not isinstance(tool, str):
            self._protocol(f"item/tool/call without callId/tool: {_short(params)}")
            return
        turn.calls[call_id] = request_id
        turn.events.append(ToolCallEvent(CodexToolCall(call_id=call_id, name=tool, arguments=arguments)))
        self._pump(turn)

    def _notification(self, method: str, params: dict[str, Any]) -> None:
        match method:
            case "item/agentMessage/delta":
                turn = self._route(params)
                delta = params.get("delta")
                if turn is not None and isinstance(delta, str):
                    turn.events.append(TextDelta(delta))
                    self._pump(turn)
            case "turn/completed":
                self._turn_completed(params)
            case "thread/tokenUsage/updated":
                turn = self._route(params)
                usage = params.get("tokenUsage")
                last = usage.get("last") if isinstance(usage, dict) else None
                if turn is not None and isinstance(last, dict):
                    turn.usage = _add_usage(turn.usage, last)
            case "error":
                turn = self._route(params)
                error = params.get("error")
                if turn is not None and isinstance(error, dict) and isinstance(error.get("message"), str):
                    turn.error_message = error["message"]

    def _turn_completed(self, params: dict[str, Any]) -> None:
        native_turn = params.get("turn")
        if not isinstance(native_turn, dict):
            self._protocol(f"turn/completed without turn: {_short(params)}")
            return
        native = native_turn.get("id")
        thread = params.get("threadId")
        if isinstance(thread, str) and isinstance(native, str) and native in self._dead_natives:
            self._drained(thread, native)
            return
        turn = self._route(params, native)
        if turn is None:
            return
        status = native_turn.get("status")
        if status == "completed":
            self._finish(turn, Done())
        elif status == "interrupted":
            self._finish(turn, ErrorEvent(self._error(ErrorKind.INTERRUPTED, "the turn was interrupted")))
        else:
            error = native_turn.get("error")
            text = error.get("message") if isinstance(error, dict) else None
            text = text or turn.error_message or f"the turn ended with status {status!r}"
            self._finish(turn, ErrorEvent(self._error(ErrorKind.SERVER, str(text))))

    def _protocol(self, why: str) -> None:
        """AD-19 / AD-05: malformed child output ends the turns in flight with ``PROTOCOL``; during the
        handshake it makes the child unusable."""
        log.warning("%s: %s", self.address, why)
        error = self._error(ErrorKind.PROTOCOL, why)
        if isinstance(self._state, Spawning):
            self._advance(life.Unusable(error))
            return
        for turn in list(self._turns.values()):
            if turn.running:
                native, thread = turn.native, turn.thread
                self._finish(turn, ErrorEvent(error))
                if native is not None and thread is not None:
                    self._interrupt(thread, native)

    # ------------------------------------------------------------------------------- JSON-RPC out
    def _on_initialized(self, result: Any, error: dict[str, Any] | None) -> None:
        if error is not None:
            self._advance(
                life.Unusable(self._error(ErrorKind.SERVER, f"initialize failed: {error_text(error)}"))
            )
        else:
            self._advance(life.Opened())

    def _rpc(self, method: str, params: dict[str, Any], then: Then) -> None:
        self._write({"id": self._calls.add(then), "method": method, "params": params})

    def _write(self, frame: dict[str, Any]) -> None:
        line = encode(frame)
        self.node.effect(self.address, b"stdin " + line, lambda: self._child.write(line))


def _add_usage(total: TokenUsage | None, last: dict[str, Any]) -> TokenUsage:
    """One model request's counts (codex's ``tokenUsage.last``) added to the turn's running sum."""

    def n(key: str) -> int:
        value = last.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

    base = total or TokenUsage()
    return TokenUsage(
        input_tokens=base.input_tokens + n("inputTokens"),
        cached_input_tokens=base.cached_input_tokens + n("cachedInputTokens"),
        output_tokens=base.output_tokens + n("outputTokens"),
        reasoning_output_tokens=base.reasoning_output_tokens + n("reasoningOutputTokens"),
        total_tokens=base.total_tokens + n("totalTokens"),
    )


def _short(value: Any) -> str:
    return repr(value)[:200]
