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
- cancellation: checked while waiting for each event and each tool result; the native turn is then
  abandoned (``turn/interrupt``), and the Router issues the receipt;
- usage: what codex reported for the turn (``thread/tokenUsage/updated``, summed over its model requests by
  the adapter, ``Turn.usage()``), read when the turn ends and emitted as one ``UsageUpdate``; ``None`` when
  codex reported none (none is invented).

Adapters (one ``codex app-server`` child each) are opened on first use and shared by every turn with the
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
from collections.abc import Sequence
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
    ChatMessage,
    NativeToolCall,
    ProviderError,
    ProviderOutcome,
    Submitted,
    ToolCallRequested,
    TurnCancelled,
    TurnIO,
    TurnRequest,
    UsageUpdate,
    model_context,
)
from actors.router.providers.base import TextDelta as ProviderTextDelta
from actors.types import TokenUsage
from transport.errors import BusError

log = logging.getLogger(__name__)

_POLL = 0.05  # how often a wait for the adapter looks at the turn's cancellation flag

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


class _Cancelled(Exception):
    pass


def _close_quietly(adapter: Adapter) -> None:
    """Release a handle; an adapter actor that does not answer in time is logged, not raised (the turn's
    outcome is decided already, and a node stop reaps the child)."""
    try:
        adapter.close()
    except BusError as exc:
        log.warning("codex adapter %s: close failed: %r", adapter.address, exc)


class CodexProvider:
    """A client for the Codex app-server: one adapter (child) per distinct thread configuration."""

    name = "codex"
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
        # Turns run on the Router's worker threads at once; this guards only the adapter table.
        self._lock = threading.Lock()
        self._adapters: collections.OrderedDict[tuple[str, ...], Adapter] = collections.OrderedDict()
        self._closed = False

    def __repr__(self) -> str:
        return f"CodexProvider(children={len(self._adapters)})"

    def close(self) -> None:
        """Release every adapter handle (the last release reaps its child). The Router calls this on its
        own actor thread, where the adapter facade may not block: each release runs on a thread of its
        own, and this waits for them (bounded)."""
        with self._lock:
            self._closed = True
            adapters = list(self._adapters.values())
            self._adapters.clear()
        closers = [
            threading.Thread(target=adapter.close, name=f"codex-close-{i}", daemon=True)
            for i, adapter in enumerate(adapters)
        ]
        for thread in closers:
            thread.start()
        for thread in closers:
            thread.join(self._open_timeout)

    def _is_closed(self) -> bool:
        return self._closed

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

    def _adapter(self, request: TurnRequest) -> tuple[tuple[str, ...], Adapter]:
        """The configuration's key, and a handle of its own on its adapter (close it after the turn)."""
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
        # The lock guards only the table: every adapter call (a bus round trip, up to open_timeout) is made
        # outside it, so one slow child cannot hold up the turns of the others.
        with self._lock:
            if self._closed:
                raise ProviderError("unavailable", "the codex provider is closed")
            adapter = self._adapters.get(key)
            if adapter is not None:
                self._adapters.move_to_end(key)
        if adapter is not None:
            try:
                mine = adapter.clone()
            except BusError:  # the child is gone (or its actor does not answer): open a new one below
                with self._lock:
                    if self._adapters.get(key) is adapter:
                        del self._adapters[key]
                        self._turns_on.pop(adapter.address, None)
                _close_quietly(adapter)
            else:
                self._count_turn(key, adapter)
                return key, mine
        try:
            opened = Adapter.open(config, timeout=self._open_timeout, launch=self._launch)
        except BusError as exc:  # AdapterError, or Expired when the handshake did not finish in time
            raise ProviderError("unavailable", f"codex did not start: {exc!r}") from exc
        try:
            mine = opened.clone()
        except BusError as exc:
            _close_quietly(opened)
            raise ProviderError("unavailable", f"codex did not start: {exc!r}") from exc
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
            _close_quietly(old)  # a child still running a turn lives on until that turn's handle is closed
        if not evicted or evicted[0] is not opened:
            self._count_turn(key, opened)
        return key, mine

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
            _close_quietly(adapter)

    def _forget(self, key: tuple[str, ...], address: str) -> None:
        """Drop the cached adapter at ``address`` (its child is gone): the next turn opens a new one."""
        with self._lock:
            cached = self._adapters.get(key)
            if cached is None or cached.address != address:
                return
            del self._adapters[key]
            self._turns_on.pop(address, None)
        log.warning("codex child of %s is unavailable; the next turn starts a new one", address)
        _close_quietly(cached)

    # --------------------------------------------------------------------------------------- turns
    def run_turn(self, request: TurnRequest, io: TurnIO) -> ProviderOutcome:
        key, adapter = self._adapter(request)
        try:
            return self._run(adapter, request, io)
        except ProviderError as exc:
            cause = exc.__cause__
            if isinstance(cause, AdapterError) and cause.kind is ErrorKind.UNAVAILABLE:
                self._forget(key, adapter.address)  # AD-18: that child takes no more turns
            raise
        finally:
            _close_quietly(adapter)

    def _run(self, adapter: Adapter, request: TurnRequest, io: TurnIO) -> ProviderOutcome:
        io.emit(Submitted(model_context(request)))
        key = f"router-turn-{uuid.uuid4().hex}"
        start = adapter.start_turn_future(key, render_input(request.messages), timeout=self._open_timeout)
        try:
            turn: Turn = self._wait(start, io)
        except _Cancelled:
            # Cancelled while the start is in flight: a start that is accepted after all is abandoned.
            with contextlib.suppress(BaseException):
                start.result(timeout=self._open_timeout).abandon(timeout=self._open_timeout)
            raise ProviderError("cancelled", "turn cancelled") from None
        except AdapterError as exc:
            raise ProviderError(_KIND.get(exc.kind, "failed"), f"codex turn not started: {exc}") from exc
        except BusError as exc:
            raise ProviderError("unavailable", f"codex turn not started: {exc!r}") from exc
        text: list[str] = []
        produced = False
        try:
            while True:
                event = self._wait(turn.next_event_future(timeout=self._event_timeout), io)
                match event:
                    case TextDelta(text=delta):
                        produced = True
                        if delta:
                            text.append(delta)
                            io.emit(ProviderTextDelta(delta))
                    case ToolCallEvent(call=call):
                        produced = True
                        self._call(turn, call, io)
                        text.clear()  # the answer is what follows the last tool call
                        io.emit(Submitted(model_context(request, continued=True)))
                    case Done():
                        return ProviderOutcome("".join(text), self._usage(turn, io))
                    case ErrorEvent() as failed:
                        error = failed.error
                        self._usage(turn, io)  # what the finished requests cost goes on the receipt too
                        raise ProviderError(
                            _KIND.get(error.kind, "failed"), f"codex turn failed: {error}", started=produced
                        ) from error
                    case None:
                        raise ProviderError("failed", "codex turn ended without a terminal event")
                    case other:
                        raise ProviderError("failed", f"unexpected codex event {type(other).__name__}")
        except _Cancelled:
            turn.abandon(timeout=self._open_timeout)
            raise ProviderError("cancelled", "turn cancelled", started=produced) from None
        except AdapterError as exc:
            turn.abandon(timeout=self._open_timeout)
            raise ProviderError(_KIND.get(exc.kind, "failed"), str(exc), started=produced) from exc
        except BusError as exc:  # the adapter's deadline ran out (Expired) or its actor went away
            turn.abandon(timeout=self._open_timeout)
            raise ProviderError("unavailable", f"codex adapter: {exc!r}", started=produced) from exc
        except BaseException:
            turn.abandon(timeout=self._open_timeout)
            raise

    def _usage(self, turn: Turn, io: TurnIO) -> TokenUsage | None:
        """The turn's usage as codex reported it (the sum over its model requests), emitted once."""
        try:
            usage = turn.usage(timeout=self._open_timeout)
        except BusError as exc:  # the numbers are lost, not the turn: the receipt then has none
            log.warning("codex usage of turn %s unreadable: %r", turn.turn_id, exc)
            return None
        if usage is not None:
            io.emit(UsageUpdate(usage))
        return usage

    def _call(self, turn: Turn, call: CodexToolCall, io: TurnIO) -> None:
        io.emit(ToolCallRequested(NativeToolCall(call.call_id, call.name, json.dumps(call.arguments))))
        try:
            result = io.wait_result(call.call_id)
        except TurnCancelled:
            raise _Cancelled() from None
        self._wait(turn.respond_future(call.call_id, result, timeout=self._open_timeout), io)

    @staticmethod
    def _wait(future: concurrent.futures.Future[Any], io: TurnIO) -> Any:
        """The future's result; ``_Cancelled`` once the turn is cancelled (the caller abandons the turn)."""
        while True:
            try:
                return future.result(timeout=_POLL)
            except concurrent.futures.TimeoutError:
                if io.cancelled.is_set():
                    raise _Cancelled() from None


__all__ = ["CodexProvider", "instructions_of", "render_input"]
