"""CodexProvider: Router turns on the real ``codex app-server``, through the Codex-adapter actor (seed 003).

One Router turn is one native Codex turn on a conversation key of its own (a fresh app-server thread): the
Router keeps the conversation, so the thread must not keep a second copy. The turn's input is the
conversation rendered as text (``render_input``); the system messages become the thread's base
instructions, and the one native tool ``call_ktool`` is declared as the thread's only dynamic tool.

- text: each ``TextDelta`` is emitted as it arrives; the answer is the text after the last tool call (the
  model's last request), as for the other providers;
- tool calls: each dynamic call is emitted as a ``ToolCallRequested`` with its exact call id and its
  arguments as JSON text (the Router parses them strictly), its result is awaited and answered on the same
  Codex turn, and the model's next request is reported as ``Submitted(continued=True)``;
- no thread of its own: a turn is a generator (``steps``) that yields ``AwaitFuture`` for every adapter call
  (the facade's ``*_future`` twins, bus requests to the adapter actor) and ``AwaitResult`` for a tool
  result, so the Router steps it on its own thread (``placement = "inline"``) and never blocks there;
  ``run_turn`` drives one on the calling thread for a direct caller;
- cancellation: thrown into the turn wherever it waits; the native turn is then abandoned
  (``turn/interrupt``, sent and not waited for), and the Router issues the receipt;
- usage: what codex reported for the turn (``thread/tokenUsage/updated``, summed over its model requests by
  the adapter, ``Turn.usage()``), read when the turn ends and emitted as one ``UsageUpdate``; ``None`` when
  codex reported none (none is invented).

Adapters (one ``codex app-server`` child each) are opened on first use (``Adapter.open_future``: the
adapter actor spawns the child on its own thread) and shared by every turn with the
same model, effort, instructions and tool description (``AdapterConfig`` is per child); at most
``max_children`` are kept, the least recently used closed first. Errors are ``ProviderError`` with the
``AdapterError`` as ``__cause__``: ``unavailable`` when the child or the model server could not be reached,
``cancelled`` for an interrupted turn, ``failed`` for everything else.

Options (``[providers.NAME]`` with ``kind = "codex"``): ``executable`` (default: ``find_codex()``),
``working_directory`` (default: the Router's working directory), ``base_instructions`` (prefixed to the
request's), ``model_base_url`` (a Responses-API server), ``codex_home``, ``stream_idle_timeout_ms``,
``context_window``, ``extra_args``, ``max_children``, ``open_timeout``, ``event_timeout``,
``recycle_after_turns`` (default 100; 0: never).

Memory: every turn is a fresh codex thread and the app-server never frees one (about 1 MB and 2 file
descriptors a turn). So a child leaves the table after ``recycle_after_turns`` turns, between turns: a turn
still running on it keeps it (its own handle) until it ends, and the next turn opens a new child.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Generator, Sequence
from typing import Any

from actors.codex.binary import find_codex
from actors.codex.child import LaunchOptions
from actors.codex.facade import Adapter, Turn
from actors.codex.types import (
    AdapterConfig,
    AdapterError,
    CodexToolCall,
    Done,
    DynamicTool,
    ErrorEvent,
    ErrorKind,
    TextDelta,
    ToolCallEvent,
)
from actors.router.providers.base import (
    AwaitFuture,
    AwaitResult,
    ChatMessage,
    NativeToolCall,
    ProviderError,
    ProviderOutcome,
    Submitted,
    ToolCallRequested,
    TurnCancelled,
    TurnIO,
    TurnRequest,
    TurnSteps,
    UsageUpdate,
    Wait,
    drive,
    model_context,
)
from actors.router.providers.base import TextDelta as ProviderTextDelta
from actors.types import TokenUsage
from transport.errors import BusError

log = logging.getLogger(__name__)

_KIND: dict[ErrorKind, str] = {
    ErrorKind.UNAVAILABLE: "unavailable",
    ErrorKind.INTERRUPTED: "cancelled",
}


def render_input(messages: Sequence[ChatMessage]) -> str:
    """The conversation as one Codex input text: the last user message as it is, preceded (when there is
    history) by the earlier messages, each in a ``<role>`` block; system messages are not part of it."""
    turns = [m for m in messages if m.role != "system"]
    if not turns:
        return ""
    *history, last = turns
    if not history and last.role == "user":
        return last.content
    blocks = []
    for m in (*history, last) if last.role != "user" else history:
        attrs = f' call_id="{m.tool_call_id}"' if m.tool_call_id else ""
        body = m.content
        for c in m.tool_calls:
            body += f'\n<call id="{c.call_id}" name="{c.name}">{c.arguments}</call>'
        blocks.append(f"<{m.role}{attrs}>\n{body}\n</{m.role}>")
    prefix = "<conversation>\n" + "\n".join(blocks) + "\n</conversation>"
    return prefix if last.role != "user" else f"{prefix}\n\n{last.content}"


def instructions_of(base: str, messages: Sequence[ChatMessage]) -> str:
    return "\n\n".join(p for p in (base, *(m.content for m in messages if m.role == "system")) if p)


def _logged(what: str) -> Callable[[concurrent.futures.Future[Any]], None]:
    """A done-callback that logs a failed release or abandon (the turn's outcome is decided already, and a
    node stop reaps the child)."""

    def done(future: concurrent.futures.Future[Any]) -> None:
        error = future.exception()
        if error is not None:
            log.warning("codex %s failed: %r", what, error)

    return done


def _let_go(adapter: Adapter) -> concurrent.futures.Future[None]:
    """Release a handle without waiting (the last release closes and reaps the child)."""
    future = adapter.close_future()
    future.add_done_callback(_logged(f"close of {adapter.address}"))
    return future


def _abandon(turn: Turn, timeout: float) -> concurrent.futures.Future[None]:
    """Abandon a native turn (``turn/interrupt``) without waiting."""
    future = turn.abandon_future(timeout=timeout)
    future.add_done_callback(_logged(f"abandon of turn {turn.turn_id}"))
    return future


def _let_go_when_opened(future: concurrent.futures.Future[Any]) -> None:
    """A turn cancelled while ``future`` (an open or a clone) was in flight: a handle it gives is released."""

    def done(settled: concurrent.futures.Future[Any]) -> None:
        if settled.exception() is None:
            _let_go(settled.result())

    future.add_done_callback(done)


def _abandon_when_started(future: concurrent.futures.Future[Any], timeout: float) -> None:
    """A turn cancelled while its start was in flight: a start accepted after all is abandoned."""

    def done(settled: concurrent.futures.Future[Any]) -> None:
        if settled.exception() is None:
            _abandon(settled.result(), timeout)

    future.add_done_callback(done)


def _cancelled(exc: BaseException) -> BaseException:
    """What a turn cancelled while it waited raises: ``ProviderError("cancelled")``, or the
    ``GeneratorExit`` of a turn closed there."""
    return exc if isinstance(exc, GeneratorExit) else ProviderError("cancelled", "turn cancelled")


class CodexProvider:
    """A client for the Codex app-server: one adapter (child) per distinct thread configuration. A turn
    (``steps``) waits on the adapter facade's futures only (``AwaitFuture``): the Router steps it on its own
    thread (``placement = "inline"``); ``run_turn`` drives one on the calling thread."""

    name = "codex"
    placement = "inline"
    # The native Codex thread keeps the conversation of a turn: a re-rendered input (Router SubmitInput)
    # cannot replace it, so the Router refuses SubmitInput for this provider instead of ignoring it.
    takes_input = False

    def __init__(
        self,
        *,
        executable: str | None = None,
        working_directory: str | None = None,
        base_instructions: str = "",
        model_base_url: str | None = None,
        codex_home: str | None = None,
        stream_idle_timeout_ms: int = 30_000,
        context_window: int = 100_000,
        extra_args: Sequence[str] = (),
        max_children: int = 4,
        open_timeout: float = 60.0,
        event_timeout: float = 3600.0,
        recycle_after_turns: int = 100,
    ) -> None:
        if max_children < 1:
            raise ValueError("max_children must be at least 1")
        if recycle_after_turns < 0:
            raise ValueError("recycle_after_turns must be 0 (never) or more")
        self._executable = executable
        self._workdir = working_directory
        self._base_instructions = base_instructions
        self._launch = LaunchOptions(
            model_base_url=model_base_url,
            codex_home=codex_home,
            stream_idle_timeout_ms=stream_idle_timeout_ms,
            context_window=context_window,
            extra_args=tuple(extra_args),
        )
        self._max_children = max_children
        # Each turn is a new codex thread, and the app-server frees none (about 1 MB and 2 file descriptors
        # a turn, measured): a child is retired from the table after this many turns. A turn it is running
        # holds a handle of its own, so the child lives until that turn ends; the next turn opens a new one.
        self._recycle_after = recycle_after_turns
        self._turns_on: dict[str, int] = {}  # adapter address -> turns started on it
        self._open_timeout = open_timeout
        self._event_timeout = event_timeout
        # The Router steps every turn on its own thread, but direct callers' run_turn may run on threads of
        # their own at once: this guards only the adapter table, and is never held across a wait.
        self._lock = threading.Lock()
        self._adapters: collections.OrderedDict[tuple[str, ...], Adapter] = collections.OrderedDict()
        self._closed = False

    def __repr__(self) -> str:
        return f"CodexProvider(children={len(self._adapters)})"

    def close(self) -> None:
        """Release every adapter handle (the last release reaps its child) and wait for the releases,
        bounded by ``open_timeout`` (the Router calls this as it stops; nothing waits for it then)."""
        with self._lock:
            self._closed = True
            adapters = list(self._adapters.values())
            self._adapters.clear()
        if adapters:
            concurrent.futures.wait([_let_go(adapter) for adapter in adapters], timeout=self._open_timeout)

    # ------------------------------------------------------------------------------------ adapters
    def _config(self, request: TurnRequest) -> AdapterConfig:
        executable = str(find_codex(self._executable))
        return AdapterConfig(
            executable=executable,
            working_directory=self._workdir or os.getcwd(),
            model=request.model.provider_model,
            reasoning_effort=request.reasoning_effort or None,
            base_instructions=instructions_of(self._base_instructions, request.messages),
            tools=(
                DynamicTool(
                    name=request.tool.name,
                    description=request.tool.description,
                    input_schema=json.loads(json.dumps(dict(request.tool.parameters))),
                ),
            ),
        )

    def _adapter(self, request: TurnRequest) -> Generator[Wait, Any, tuple[tuple[str, ...], Adapter]]:
        """The configuration's key, and a handle of its own on its adapter (release it after the turn):
        a clone of the cached one, or a new child opened (``Adapter.open_future``)."""
        try:
            config = self._config(request)
        except FileNotFoundError as exc:
            raise ProviderError("unavailable", str(exc)) from exc
        key = (
            config.model,
            config.reasoning_effort or "",
            config.base_instructions,
            request.tool.name,
            request.tool.description,
        )
        with self._lock:
            if self._closed:
                raise ProviderError("unavailable", "the codex provider is closed")
            adapter = self._adapters.get(key)
            if adapter is not None:
                self._adapters.move_to_end(key)
        if adapter is not None:
            clone = adapter.clone_future()
            try:
                mine: Adapter = yield AwaitFuture(clone)
            except (TurnCancelled, GeneratorExit) as exc:
                _let_go_when_opened(clone)
                raise _cancelled(exc) from None
            except BusError:  # the child is gone (or its actor does not answer): open a new one below
                with self._lock:
                    if self._adapters.get(key) is adapter:
                        del self._adapters[key]
                        self._turns_on.pop(adapter.address, None)
                _let_go(adapter)
            else:
                self._count_turn(key, adapter)
                return key, mine
        try:
            opening = Adapter.open_future(config, timeout=self._open_timeout, launch=self._launch)
        except BusError as exc:  # a config the adapter refuses (AdapterError): nothing was spawned
            raise ProviderError("unavailable", f"codex did not start: {exc!r}") from exc
        try:
            opened: Adapter = yield AwaitFuture(opening)
        except (TurnCancelled, GeneratorExit) as exc:
            _let_go_when_opened(opening)
            raise _cancelled(exc) from None
        except BusError as exc:  # AdapterError, or Expired when the handshake did not finish in time
            raise ProviderError("unavailable", f"codex did not start: {exc!r}") from exc
        clone = opened.clone_future()
        try:
            mine = yield AwaitFuture(clone)
        except (TurnCancelled, GeneratorExit) as exc:
            _let_go_when_opened(clone)
            self._keep(key, opened)  # a child that works: the next turn takes it
            raise _cancelled(exc) from None
        except BusError as exc:
            _let_go(opened)
            raise ProviderError("unavailable", f"codex did not start: {exc!r}") from exc
        if self._keep(key, opened):
            self._count_turn(key, opened)
        return key, mine

    def _keep(self, key: tuple[str, ...], opened: Adapter) -> bool:
        """Put a newly opened adapter in the table (the least recently used beyond ``max_children`` leave
        it); False when it was released instead (the provider closed, or another turn opened one first)."""
        evicted: list[Adapter] = []
        with self._lock:
            if self._is_closed() or key in self._adapters:
                evicted.append(opened)  # closed meanwhile, or another turn opened one: keep theirs
            else:
                self._adapters[key] = opened
                while len(self._adapters) > self._max_children:
                    evicted.append(self._adapters.popitem(last=False)[1])
            for old in evicted:
                self._turns_on.pop(old.address, None)
        for old in evicted:
            _let_go(old)  # a child still running a turn lives on until that turn's handle is released
        return not evicted or evicted[0] is not opened

    def _is_closed(self) -> bool:
        return self._closed

    def _count_turn(self, key: tuple[str, ...], adapter: Adapter) -> None:
        """One more turn (codex thread) on ``adapter``'s child; at ``recycle_after_turns`` the child leaves
        the table (this turn's own handle keeps it until the turn ends)."""
        with self._lock:
            count = self._turns_on.get(adapter.address, 0) + 1
            retire = 0 < self._recycle_after <= count and self._adapters.get(key) is adapter
            if retire:
                del self._adapters[key]
                self._turns_on.pop(adapter.address, None)
            else:
                self._turns_on[adapter.address] = count
        if retire:
            log.info(
                "codex child of %s served %d turns: retired after its running turns", adapter.address, count
            )
            _let_go(adapter)

    def _forget(self, key: tuple[str, ...], address: str) -> None:
        """Drop the cached adapter at ``address`` (its child is gone): the next turn opens a new one."""
        with self._lock:
            cached = self._adapters.get(key)
            if cached is None or cached.address != address:
                return
            del self._adapters[key]
            self._turns_on.pop(address, None)
        log.warning("codex child of %s is unavailable; the next turn starts a new one", address)
        _let_go(cached)

    # --------------------------------------------------------------------------------------- turns
    def run_turn(self, request: TurnRequest, io: TurnIO) -> ProviderOutcome:
        """One turn on the calling thread (a direct caller, never an actor): ``steps`` driven to its end."""
        return drive(self.steps(request, io), io)

    def steps(self, request: TurnRequest, io: TurnIO) -> TurnSteps:
        """One Router turn; every wait is a yield (``AwaitFuture`` on the adapter facade, ``AwaitResult`` for
        a tool result). It ends once its handle is released, except when cancelled: the release and the
        abandon are then sent and not waited for."""
        key, adapter = yield from self._adapter(request)
        try:
            outcome = yield from self._run(adapter, request, io)
        except ProviderError as exc:
            cause = exc.__cause__
            if isinstance(cause, AdapterError) and cause.kind is ErrorKind.UNAVAILABLE:
                self._forget(key, adapter.address)  # AD-18: that child takes no more turns
            released = _let_go(adapter)
            if exc.kind != "cancelled":  # a cancelled turn takes no more steps
                yield from self._settle(released)
            raise
        except BaseException:
            _let_go(adapter)
            raise
        yield from self._settle(_let_go(adapter))
        return outcome

    @staticmethod
    def _settle(future: concurrent.futures.Future[Any]) -> Generator[Wait, Any, None]:
        """Wait for a release or an abandon (bounded by its request's timeout; its failure is logged). A
        cancel here ends only the wait: the turn's outcome is decided already."""
        with contextlib.suppress(BusError, TurnCancelled):
            yield AwaitFuture(future)

    def _run(
        self, adapter: Adapter, request: TurnRequest, io: TurnIO
    ) -> Generator[Wait, Any, ProviderOutcome]:
        io.emit(Submitted(model_context(request)))
        key = f"router-turn-{uuid.uuid4().hex}"
        start = adapter.start_turn_future(key, render_input(request.messages), timeout=self._open_timeout)
        try:
            turn: Turn = yield AwaitFuture(start)
        except (TurnCancelled, GeneratorExit) as exc:
            _abandon_when_started(start, self._open_timeout)
            raise _cancelled(exc) from None
        except AdapterError as exc:
            raise ProviderError(_KIND.get(exc.kind, "failed"), f"codex turn not started: {exc}") from exc
        except BusError as exc:
            raise ProviderError("unavailable", f"codex turn not started: {exc!r}") from exc
        text: list[str] = []
        produced = False
        try:
            while True:
                event = yield AwaitFuture(turn.next_event_future(timeout=self._event_timeout))
                match event:
                    case TextDelta(text=delta):
                        produced = True
                        if delta:
                            text.append(delta)
                            io.emit(ProviderTextDelta(delta))
                    case ToolCallEvent(call=call):
                        produced = True
                        yield from self._call(turn, call, io)
                        text.clear()  # the answer is what follows the last tool call
                        io.emit(Submitted(model_context(request, continued=True)))
                    case Done():
                        usage = yield from self._usage(turn, io)
                        return ProviderOutcome("".join(text), usage)
                    case ErrorEvent() as failed:
                        error = failed.error
                        yield from self._usage(turn, io)  # what the finished requests cost: on the receipt
                        raise ProviderError(
                            _KIND.get(error.kind, "failed"), f"codex turn failed: {error}", started=produced
                        ) from error
                    case None:
                        raise ProviderError("failed", "codex turn ended without a terminal event")
                    case other:
                        raise ProviderError("failed", f"unexpected codex event {type(other).__name__}")
        except TurnCancelled:
            _abandon(turn, self._open_timeout)  # not waited for: a cancelled turn takes no more steps
            raise ProviderError("cancelled", "turn cancelled", started=produced) from None
        except GeneratorExit:
            _abandon(turn, self._open_timeout)
            raise
        except AdapterError as exc:
            yield from self._settle(_abandon(turn, self._open_timeout))
            raise ProviderError(_KIND.get(exc.kind, "failed"), str(exc), started=produced) from exc
        except BusError as exc:  # the adapter's deadline ran out (Expired) or its actor went away
            yield from self._settle(_abandon(turn, self._open_timeout))
            raise ProviderError("unavailable", f"codex adapter: {exc!r}", started=produced) from exc
        except BaseException:
            yield from self._settle(_abandon(turn, self._open_timeout))
            raise

    def _usage(self, turn: Turn, io: TurnIO) -> Generator[Wait, Any, TokenUsage | None]:
        """The turn's usage as codex reported it (the sum over its model requests), emitted once."""
        try:
            usage: TokenUsage | None = yield AwaitFuture(turn.usage_future(timeout=self._open_timeout))
        except BusError as exc:  # the numbers are lost, not the turn: the receipt then has none
            log.warning("codex usage of turn %s unreadable: %r", turn.turn_id, exc)
            return None
        if usage is not None:
            io.emit(UsageUpdate(usage))
        return usage

    def _call(self, turn: Turn, call: CodexToolCall, io: TurnIO) -> Generator[Wait, Any, None]:
        """Surface the tool call, wait for its result, and answer it on the same codex turn."""
        io.emit(ToolCallRequested(NativeToolCall(call.call_id, call.name, json.dumps(call.arguments))))
        result = yield AwaitResult(call.call_id)
        yield AwaitFuture(turn.respond_future(call.call_id, result, timeout=self._open_timeout))


__all__ = ["CodexProvider", "instructions_of", "render_input"]
