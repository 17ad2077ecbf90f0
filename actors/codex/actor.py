"""The Codex-adapter actor: owns one ``codex app-server`` child and the per-key turn registry.

One pykka thread, no locks (MB-01): single-active-turn per key (AD-09) is a dict check in the mailbox, and a
second ``start_turn`` on a busy key is answered ``BUSY`` here and never reaches the child (the real server
would merge it into the active turn, CODEX.md). Nothing here blocks on the child: two reader threads turn
its stdout lines and stderr chunks into ``ChildOutput`` tells to this actor (a capture records them as
deliveries, so a replay feeds them back), and every JSON-RPC request is a continuation keyed by its id.
What the actor writes to the child goes through ``Node.effect`` keyed by the written line, so a replay
checks every write without a child; the line itself is queued for a writer thread, whose write is bounded
(``LaunchOptions.write_timeout``: a child that stops reading its stdin is killed, its turns end UNAVAILABLE).
The child is closed and reaped when the last handle is released and no turn is left unfinished, or when
the actor stops (node stop).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import select
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, Literal

from actors.base import DEFER, BusActor, Context
from actors.codex.homes import make_home, sweep_once
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

log = logging.getLogger(__name__)

MAX_DIAGNOSTICS = 1 << 20  # AD-15: the most recent 1 MiB of stderr
MAX_LINE = 512 * 1024  # a longer stdout line is a protocol error (it could not travel as one message)
REAP_TIMEOUT = 3.0
# A next_event whose caller gives up within this many seconds gets no event: its reply could arrive after
# the caller stopped waiting and be dropped; the event waits for the next call instead.
REPLY_MARGIN = 0.05
MAX_HANDLES = 1024  # handles (Retain) held at once; past it LimitExceeded
MAX_GONE = 4096  # finished turns remembered (next_event answers None, usage stays readable)
CLIENT_INFO = {"name": "kbus", "title": "kbus codex adapter", "version": "0.1.0"}

# CODEX.md: no network besides the model server, no shell snapshot, no analytics, and a model server that
# is down fails the turn at once instead of reconnecting forever.
HERMETIC_ARGS = (
    "--disable",
    "plugins",
    "--disable",
    "shell_snapshot",
    "--disable",
    "unbounded_connection_retries",
    "-c",
    "analytics.enabled=false",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchOptions:
    """How the child is launched, beyond the seed's ``AdapterConfig``.

    ``model_base_url``: a Responses-API server (``.../v1``); codex then uses it as provider ``kbus`` with no
    credentials and no retries. ``codex_home``: ``None`` makes a fresh private directory per child, removed
    when the child is reaped (and, if its owner was killed first, by the next process that starts a child:
    ``actors.codex.homes``). ``extra_args`` are appended to the app-server command line.
    """

    model_base_url: str | None = None
    codex_home: str | None = None
    stream_idle_timeout_ms: int = 30_000
    context_window: int = 100_000
    # A write to the child's stdin that makes no progress for this long means the child stopped reading:
    # it is killed and its turns end UNAVAILABLE.
    write_timeout: float = 30.0
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def child_argv(config: AdapterConfig, launch: LaunchOptions, catalog: str | None) -> list[str]:
    args = [config.executable, "app-server", *HERMETIC_ARGS]
    if launch.model_base_url is not None:
        provider = (
            '{ name = "kbus", base_url = ' + json.dumps(launch.model_base_url) + ', wire_api = "responses", '
            "requires_openai_auth = false, supports_websockets = false, request_max_retries = 0, "
            f"stream_max_retries = 0, stream_idle_timeout_ms = {int(launch.stream_idle_timeout_ms)} }}"
        )
        args += ["-c", 'model_provider="kbus"', "-c", f"model_providers.kbus={provider}"]
    args += ["-c", f"model={json.dumps(config.model)}"]
    if catalog is not None:
        args += ["-c", f"model_catalog_json={json.dumps(catalog)}"]
    return [*args, *launch.extra_args]


def model_catalog(config: AdapterConfig, launch: LaunchOptions) -> dict[str, Any]:
    """One catalog entry for the configured model: its instructions are the config's base_instructions."""
    return {
        "models": [
            {
                "slug": config.model,
                "display_name": config.model,
                "base_instructions": config.base_instructions,
                "supported_reasoning_levels": [],
                "shell_type": "default",
                "visibility": "list",
                "supported_in_api": True,
                "priority": 0,
                "support_verbosity": False,
                "truncation_policy": {"mode": "bytes", "limit": 10000},
                "experimental_supported_tools": [],
                "context_window": launch.context_window,
            }
        ]
    }


TurnState = Literal["starting", "active", "finished", "abandoned"]


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
    terminal_delivered: bool = False
    error_message: str | None = None
    usage: TokenUsage | None = None  # the sum of the turn's model requests (thread/tokenUsage/updated)

    @property
    def live(self) -> bool:
        """Holds the child: not abandoned and its terminal event not yet taken (AD-17)."""
        return self.state != "abandoned" and not self.terminal_delivered


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
        # The handles given out, by token: the opener's (``handle``) and one per Retain. Only a token's holder
        # can release it, so a hostile Release cannot close the child under its users.
        self._handles: set[str] = {handle}
        self._proc: subprocess.Popen[bytes] | None = None
        self._home: str | None = None  # a CODEX_HOME this actor made (removed when the child is reaped)
        self._readers: list[threading.Thread] = []
        # Lines for the writer thread, in order; None closes the child's stdin (its clean shutdown).
        self._writes: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._reap_timer: threading.Timer | None = None  # kills a child that outlives its close
        self._reaped = False
        self._stderr = bytearray()
        self._ready = False
        self._closing = False
        self._stopping = False
        self._failure: AdapterError | None = None  # the child is gone (or unusable): UNAVAILABLE etc.
        self._open_waiters: list[Context] = []
        self._exited = False  # the child's exit was delivered (or it never started)
        self._close_waiters: list[tuple[Context, Any]] = []  # answered once the child is reaped
        self._next_rpc = 0
        self._calls: dict[int, Callable[[Any, dict[str, Any] | None], None]] = {}
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

    # ---------------------------------------------------------------------------------------- start
    def on_start(self) -> None:
        super().on_start()
        outcome = self.node.effect(self.address, b"spawn", self._spawn)
        if outcome != b"ok":
            self._exited = True
            self._fail_child(AdapterError(ErrorKind.UNAVAILABLE, outcome.decode("utf-8", "replace")))
            return
        self._rpc(
            "initialize",
            {"clientInfo": CLIENT_INFO, "capabilities": {"experimentalApi": True}},
            self._on_initialized,
        )

    def _spawn(self) -> bytes:
        launch = self.launch
        try:
            home = launch.codex_home
            if home is None:
                sweep_once()  # folders SIGKILLed owners left behind
                home = self._home = make_home()
            catalog = os.path.join(home, "kbus_model_catalog.json")
            with open(catalog, "w", encoding="utf-8") as file:
                json.dump(model_catalog(self.config, launch), file)
            env = {**os.environ, "CODEX_HOME": home, "NO_PROXY": "127.0.0.1,localhost", **dict(launch.env)}
            self._proc = subprocess.Popen(
                child_argv(self.config, launch, catalog),
                cwd=self.config.working_directory,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            self._remove_home()
            return f"cannot start {self.config.executable!r}: {exc}".encode()
        proc = self._proc
        assert proc.stdout is not None and proc.stderr is not None
        err = threading.Thread(target=self._read_stderr, args=(proc.stderr,), daemon=True)
        out = threading.Thread(target=self._read_stdout, args=(proc, err), daemon=True)
        writer = threading.Thread(target=self._write_loop, args=(proc,), daemon=True)
        self._readers = [err, out]
        self._writer = writer
        err.start()
        out.start()
        writer.start()
        return b"ok"

    # ------------------------------------------------------------------ reader threads (not the actor)
    def _post(self, message: ChildOutput) -> None:
        """Into the mailbox. With a capture running it travels as a bus tell, so the log records it as a
        delivery and a replay feeds it back; otherwise straight into the mailbox (no encode, no header):
        the same handler either way."""
        try:
            if self.node.capture is None:
                self.actor_ref.tell(message)
            else:
                src = self.child_srcs[{"stderr": 1, "stuck": 2}.get(message.stream, 0)]
                self.node.tell(self.address, message, src=src)
        except Exception:  # noqa: BLE001 - the actor or node is stopping: nobody is left to tell
            log.debug("%s: child output after stop dropped", self.address)

    def on_local(self, message: Any) -> Any:
        if isinstance(message, ChildOutput):
            self._child_output(message)
            return None
        if isinstance(message, _ReapDue):
            if not self._exited:  # closed REAP_TIMEOUT ago and still running: its exit follows the kill
                log.warning("%s: codex app-server ignored the close; killed", self.address)
                self._kill()
            return None
        return super().on_local(message)

    def _read_stderr(self, pipe: IO[bytes]) -> None:
        fd = pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            self._post(ChildOutput(stream="stderr", data=chunk))

    def _read_stdout(self, proc: subprocess.Popen[bytes], stderr_reader: threading.Thread) -> None:
        pipe = proc.stdout
        assert pipe is not None
        while True:
            try:
                line = pipe.readline(MAX_LINE + 1)
            except (OSError, ValueError):
                break
            if not line:
                break
            if len(line) > MAX_LINE and not line.endswith(b"\n"):
                self._post(ChildOutput(stream="stdout", data=line[:256] + b"...<line too long>"))
                # skip the rest of the oversized line
                while line and not line.endswith(b"\n"):
                    line = pipe.readline(MAX_LINE)
                continue
            self._post(ChildOutput(stream="stdout", data=line))
        stderr_reader.join(REAP_TIMEOUT)
        try:
            code = proc.wait(REAP_TIMEOUT)
        except subprocess.TimeoutExpired:  # stdout closed but the process lingers: end it
            proc.kill()
            code = proc.wait()
        self._post(ChildOutput(stream="exit", code=code))

    def _write_loop(self, proc: subprocess.Popen[bytes]) -> None:
        """The writer thread: the queued lines in order, each write bounded. A write that makes no progress
        for ``write_timeout`` is reported (``stuck``) and the thread ends; a failed write (the child is
        gone: its exit arrives from the stdout reader) ends it too. It owns stdin and closes it at its end."""
        pipe = proc.stdin
        assert pipe is not None
        try:
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            limit_ms = max(1, int(self.launch.write_timeout * 1000))
            while (line := self._writes.get()) is not None:
                view = memoryview(line)
                while view:
                    with contextlib.suppress(BlockingIOError):
                        view = view[os.write(fd, view) :]
                    if view and not poller.poll(limit_ms):
                        self._post(ChildOutput(stream="stuck", data=line[:200]))
                        return
        except (OSError, ValueError):
            return
        finally:
            with contextlib.suppress(OSError, ValueError):
                pipe.close()

    # ------------------------------------------------------------------------------------- handlers
    def handle(self, message: Any, ctx: Context) -> Any:
        if isinstance(message, ChildOutput):
            if ctx.header.src not in self.child_srcs:
                raise ProtocolError(f"child output from {ctx.header.src}")
            self._child_output(message)
            return None
        if isinstance(message, NextEvent):
            return self._next_event(message, ctx)
        if isinstance(message, Respond):
            return self._respond(message)
        if isinstance(message, StartTurn):
            return self._start_turn(message, ctx)
        if isinstance(message, Abandon):
            self._abandon(message.turn_id)
            return None
        if isinstance(message, TurnUsage):
            turn = self._turns.get(message.turn_id)
            if turn is not None:
                return TurnUsageReply(usage=turn.usage)
            if message.turn_id in self._gone:
                return TurnUsageReply(usage=self._gone[message.turn_id])
            raise AdapterError(ErrorKind.UNAVAILABLE, f"no turn {message.turn_id[:40]!r}")
        if isinstance(message, Diagnostics):
            return DiagnosticsReply(stderr=bytes(self._stderr))
        if isinstance(message, AwaitOpen):
            if self._failure is not None:
                raise self._failure
            if self._ready:
                return None
            self._open_waiters.append(ctx)
            return DEFER
        if isinstance(message, Retain):
            if self._closing:
                raise AdapterError(ErrorKind.UNAVAILABLE, "the adapter is closed")
            if len(self._handles) >= MAX_HANDLES:
                raise LimitExceeded(f"{self.address} holds {MAX_HANDLES} handles already", limit=MAX_HANDLES)
            token = uuid.uuid4().hex
            self._handles.add(token)
            return Retained(handle=token)
        if isinstance(message, Release):
            if message.handle not in self._handles:
                raise AdapterError(ErrorKind.PROTOCOL, "release of a handle this adapter did not give out")
            self._handles.discard(message.handle)
            self._close_waiters.append((ctx, Ok()))
            self._maybe_close()
            if self._closing:
                return DEFER  # answered once the child is reaped (AD-17)
            self._close_waiters.pop()
            return None
        raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")

    def _error(self, kind: ErrorKind, message: str) -> AdapterError:
        """An error caused by the child's state: with a snapshot of its stderr (AD-16)."""
        return AdapterError(kind, message, bytes(self._stderr))

    def _start_turn(self, message: StartTurn, ctx: Context) -> Any:
        if self._failure is not None:
            raise AdapterError(self._failure.kind, self._failure.message, bytes(self._stderr))
        if self._closing or not self._ready:
            raise AdapterError(ErrorKind.UNAVAILABLE, "the adapter is not open")
        key = message.conversation_key
        if key in self._active:
            raise AdapterError(ErrorKind.BUSY, f"conversation {key[:80]!r} has an active turn")
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
                turn, self._error(ErrorKind.SERVER, f"thread/start failed: {_rpc_text(error)}")
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
            self._reject_start(turn, self._error(ErrorKind.SERVER, f"turn/start failed: {_rpc_text(error)}"))
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
        self._maybe_close()

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
            if turn.state == "abandoned" or turn.terminal_delivered:
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
                turn.terminal_delivered = True
                if not turn.waiters:
                    # Waiting before the forget: if that was the last holder, the close it starts may end at
                    # once (the child had exited) and answers the caller then, or once the child is reaped.
                    waiter = (ctx, event)
                    self._close_waiters.append(waiter)
                    self._forget(turn)
                    if waiter not in self._close_waiters:  # answered: the close ended at once
                        continue
                    if self._closing and not self._stopping:
                        continue
                    self._close_waiters.remove(waiter)
            ctx.reply(event)
        if turn.state == "abandoned" or turn.terminal_delivered:
            self._forget(turn)

    def _forget(self, turn: _Turn) -> None:
        if self._turns.pop(turn.id, None) is None:
            return
        self._gone[turn.id] = turn.usage
        if len(self._gone) > MAX_GONE:
            del self._gone[next(iter(self._gone))]
        self._maybe_close()

    def _respond(self, message: Respond) -> Any:
        if self._failure is not None:
            raise AdapterError(self._failure.kind, self._failure.message, bytes(self._stderr))
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
        if turn is None or turn.state in ("finished", "abandoned"):
            return  # TU-06: nothing to do, nothing sent
        turn.state = "abandoned"
        turn.events.clear()
        turn.calls.clear()
        self._release_key(turn)
        if turn.native is not None and turn.thread is not None and self._failure is None:
            self._interrupt(turn.thread, turn.native)
        self._pump(turn)

    def _interrupt(self, thread: str, native: str) -> None:
        if self._failure is not None or not thread:
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
        if turn.state in ("finished", "abandoned"):
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
        if message.stream == "stderr":
            buf = self._stderr
            buf += message.data
            if len(buf) > MAX_DIAGNOSTICS:
                del buf[: len(buf) - MAX_DIAGNOSTICS]
        elif message.stream == "exit":
            self._on_exit(message.code)
        elif message.stream == "stuck":
            self._on_stuck()
        else:
            self._on_line(message.data)

    def _on_line(self, data: bytes) -> None:
        if not data.strip():
            return
        try:
            frame = json.loads(data)
        except ValueError:
            self._protocol(f"child wrote a line that is not JSON: {data[:200]!r}")
            return
        if not isinstance(frame, dict):
            self._protocol(f"child wrote a JSON {type(frame).__name__}, not an object: {data[:200]!r}")
            return
        method = frame.get("method")
        if isinstance(method, str):
            params = frame.get("params")
            if not isinstance(params, dict):
                params = {}
            if "id" in frame:
                self._server_request(frame["id"], method, params)
            else:
                self._notification(method, params)
            return
        rpc_id = frame.get("id")
        if "result" in frame or "error" in frame:
            then = self._calls.pop(rpc_id, None) if isinstance(rpc_id, int) else None
            if then is None:
                self._protocol(f"child answered a request never sent: {data[:200]!r}")
                return
            error = frame.get("error")
            if error is not None and not isinstance(error, dict):
                error = {"message": str(error)}
            then(frame.get("result"), error)
            return
        self._protocol(f"child wrote a frame that is no JSON-RPC message: {data[:200]!r}")

    def _route(self, params: dict[str, Any], native: Any = None) -> _Turn | None:
        native = native if native is not None else params.get("turnId")
        if native in self._dead_natives:
            return None
        tid = self._current.get(params.get("threadId"))  # type: ignore[arg-type]
        turn = self._turns.get(tid) if tid is not None else None
        if turn is None or turn.state in ("finished", "abandoned"):
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
        if method == "item/agentMessage/delta":
            turn = self._route(params)
            delta = params.get("delta")
            if turn is not None and isinstance(delta, str):
                turn.events.append(TextDelta(delta))
                self._pump(turn)
        elif method == "turn/completed":
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
        elif method == "thread/tokenUsage/updated":
            turn = self._route(params)
            usage = params.get("tokenUsage")
            last = usage.get("last") if isinstance(usage, dict) else None
            if turn is not None and isinstance(last, dict):
                turn.usage = _add_usage(turn.usage, last)
        elif method == "error":
            turn = self._route(params)
            error = params.get("error")
            if turn is not None and isinstance(error, dict) and isinstance(error.get("message"), str):
                turn.error_message = error["message"]

    def _protocol(self, why: str) -> None:
        """AD-19 / AD-05: malformed child output ends the turns in flight with ``PROTOCOL``."""
        log.warning("%s: %s", self.address, why)
        error = self._error(ErrorKind.PROTOCOL, why)
        if not self._ready:
            self._fail_child(error)
            self._kill()
            return
        for turn in list(self._turns.values()):
            if turn.state in ("starting", "active"):
                native, thread = turn.native, turn.thread
                self._finish(turn, ErrorEvent(error))
                if native is not None and thread is not None:
                    self._interrupt(thread, native)

    def _on_exit(self, code: int | None) -> None:
        self._exited = True
        self._kill()
        if self._closing:
            self._finish_close()
            return
        self._fail_child(self._error(ErrorKind.UNAVAILABLE, f"codex app-server exited (code {code})"))

    def _on_stuck(self) -> None:
        """The child stopped reading its stdin: it is killed, its turns end UNAVAILABLE (AD-18)."""
        log.warning("%s: codex app-server stopped reading its stdin", self.address)
        error = self._error(
            ErrorKind.UNAVAILABLE,
            f"codex app-server stopped reading its stdin (a write made no progress for "
            f"{self.launch.write_timeout:g} s); it was killed",
        )
        self._kill()
        self._fail_child(error)

    def _fail_child(self, error: AdapterError) -> None:
        """AD-18: the child is gone; every turn in flight ends UNAVAILABLE, later starts fail."""
        if self._failure is not None:
            return
        self._failure = error
        self._calls.clear()
        for ctx in self._open_waiters:
            if not ctx.done:
                ctx.fail(error)
        self._open_waiters.clear()
        for turn in list(self._turns.values()):
            if turn.state in ("starting", "active"):
                self._finish(turn, ErrorEvent(error))

    # ------------------------------------------------------------------------------- JSON-RPC out
    def _on_initialized(self, result: Any, error: dict[str, Any] | None) -> None:
        if error is not None:
            self._fail_child(self._error(ErrorKind.SERVER, f"initialize failed: {_rpc_text(error)}"))
            self._kill()
            return
        self._write({"method": "initialized"})
        self._ready = True
        for ctx in self._open_waiters:
            if not ctx.done:
                ctx.reply(Ok())
        self._open_waiters.clear()

    def _rpc(
        self, method: str, params: dict[str, Any], then: Callable[[Any, dict[str, Any] | None], None]
    ) -> None:
        self._next_rpc += 1
        self._calls[self._next_rpc] = then
        self._write({"id": self._next_rpc, "method": method, "params": params})

    def _write(self, frame: dict[str, Any]) -> None:
        line = json.dumps(frame, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        self.node.effect(self.address, b"stdin " + line, lambda: self._write_now(line))

    def _write_now(self, line: bytes) -> bytes:
        """Queued for the writer thread: the actor never blocks on the child's stdin."""
        if self._proc is None or self._writer is None:
            return b"no child"
        self._writes.put(line)
        return b""

    # ------------------------------------------------------------------------------------ closing
    def _maybe_close(self) -> None:
        if self._handles or self._closing:
            return
        if any(turn.live for turn in self._turns.values()):
            return  # AD-17: an unfinished Turn keeps the child
        self._closing = True
        # Closing stdin is the app-server's clean shutdown; its exit arrives as a message (the reader thread
        # reaps it, killing it if it lingers), and only then is the actor done: the mailbox never waits.
        # The writer thread closes it after the lines queued before.
        self._writes.put(None)
        if self._exited:
            self._finish_close()
        elif self._proc is not None:
            timer = self._reap_timer = threading.Timer(REAP_TIMEOUT, self._reap_due)
            timer.daemon = True
            timer.start()

    def _reap_due(self) -> None:
        """The reap timer's thread: into the mailbox (not captured: only the exit it causes is)."""
        try:
            self.actor_ref.tell(_ReapDue())
        except Exception:  # noqa: BLE001 - the actor stopped meanwhile: it reaped the child
            log.debug("%s: reap timer after stop", self.address)

    def _finish_close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._reap()
        for ctx, reply in self._close_waiters:
            if not ctx.done:
                ctx.reply(reply)
        self._close_waiters.clear()
        self.actor_ref.stop(block=False)

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()

    def _reap(self) -> bytes:
        """Close stdin (the app-server's clean shutdown), wait a bounded time, then kill; always reaped.
        Runs once (close, stop and failure may each ask)."""
        if self._reaped:
            return b""
        self._reaped = True
        timer = self._reap_timer
        if timer is not None:
            timer.cancel()
        proc = self._proc
        if proc is None:
            self._remove_home()
            return b""
        self._writes.put(None)  # the writer thread closes stdin after what was queued before
        if self._writer is None and proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.close()
        try:
            proc.wait(REAP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for reader in [*self._readers, *([self._writer] if self._writer is not None else [])]:
            reader.join(REAP_TIMEOUT)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._remove_home()
        return f"exit {proc.returncode}".encode()

    def _remove_home(self) -> None:
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None

    def on_stop(self) -> None:
        # Also when a close is under way (the child may not have exited yet): the child and its home go now.
        self._closing = True
        self._reap()
        for turn in self._turns.values():
            for ctx in turn.waiters:
                if not ctx.done:
                    ctx.fail(AdapterError(ErrorKind.UNAVAILABLE, "the adapter stopped"))
            turn.waiters.clear()
        super().on_stop()

    def on_failure(self, exception_type: Any, exception_value: Any, traceback: Any) -> None:
        self._closing = True
        self._reap()
        super().on_failure(exception_type, exception_value, traceback)


@dataclass(frozen=True, slots=True)
class _ReapDue:
    """Local only: REAP_TIMEOUT passed since the close; a child still running is killed."""


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


def _rpc_text(error: dict[str, Any]) -> str:
    return f"{error.get('code')} {str(error.get('message'))[:500]}"


def _short(value: Any) -> str:
    return repr(value)[:200]
