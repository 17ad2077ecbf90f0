"""The Codex adapter's facades: ``Adapter`` and ``Turn`` (RULES.md Appendix C.2), usable from any thread of
any process on the bus; the state lives in one ``CodexAdapterActor`` per child (``actors.codex.actor``).
``bus=None`` runs the actor on a private node made once per process (the codex package's own registry,
``messages.codex_registry``: no Router, no application wiring).

Signatures (C.2, with these additions and nothing removed):

    Adapter.open(config, *, bus=None, timeout=None, launch: LaunchOptions | None = None, name=None) -> Adapter
        ``launch`` (addition): model server URL / CODEX_HOME / extra args for the child (see LaunchOptions).
        ``bus``: the Node to spawn the actor on (None: a private in-process node, made once per process).
    Adapter.open_future(config, *, bus=None, timeout=None, launch=None, name=None) -> Future[Adapter]
    Adapter.attach(bus, address, *, timeout=None) -> Adapter        (addition) a new handle (Retain) on an
        adapter actor that runs elsewhere, e.g. in another process.
    Adapter.clone() -> Adapter;  Adapter.close() -> None;  with Adapter ...: (exit == close)
    Adapter.clone_future() -> Future[Adapter];  Adapter.close_future(*, timeout=None) -> Future[None]
    Adapter.start_turn(conversation_key, input, *, timeout=None) -> Turn
    Adapter.start_turn_future(conversation_key, input, *, timeout=None) -> Future[Turn]
    Adapter.diagnostics(*, timeout=None) -> bytes
    Adapter.address -> str  (the actor)
    Turn.next_event(*, timeout=None) -> Event | None;  Turn.next_event_future(*, timeout=None)
    Turn.respond(call_id, result, *, timeout=None) -> None
    Turn.respond_future(call_id, result, *, timeout=None) -> Future[None]
    Turn.abandon(*, timeout=None) -> None;  with Turn ...: (exit == abandon)
    Turn.abandon_future(*, timeout=None) -> Future[None]
    Turn.usage(*, timeout=None) -> TokenUsage | None   (addition) codex's token counts for the turn so far
    Turn.usage_future(*, timeout=None) -> Future[TokenUsage | None]
    Turn.conversation_key, Turn.turn_id

Every failure is an ``AdapterError``; a vanished adapter actor (``NotDelivered``/``Unavailable``) is raised
as ``AdapterError(UNAVAILABLE)`` (MB-10); a ``timeout`` that runs out raises ``BusTimeout`` (Expired). A
``*_future`` twin (C.1) only sends its request: it never blocks, so an actor may call it and wait for the
future by message (the Router's codex turns do); the future settles with what its blocking twin returns or
raises.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import itertools
import os
import secrets
import threading
import warnings
from collections.abc import Callable
from typing import Any

from actors.codex.actor import CodexAdapterActor
from actors.codex.child import REAP_TIMEOUT, LaunchOptions
from actors.codex.messages import (
    Abandon,
    AwaitOpen,
    Diagnostics,
    DiagnosticsReply,
    NextEvent,
    Release,
    Respond,
    Retain,
    StartTurn,
    TurnStarted,
    TurnUsage,
    TurnUsageReply,
    codex_registry,
)
from actors.codex.types import (
    AdapterConfig,
    AdapterError,
    Done,
    ErrorEvent,
    ErrorKind,
    Event,
    validate_config,
)
from actors.types import TokenUsage, ToolResult
from transport.errors import BusError, NotDelivered, Unavailable
from transport.messages import Ok
from transport.node import Node
from transport.pending import chained, forbid_blocking

DEFAULT_TIMEOUT = 60.0
_names = itertools.count(1)
_private: list[Node] = []  # the process's private node for ``bus=None`` (made once, on first use)
# Not an actor: any thread may open the first adapter, so a lock makes exactly one private node.
_private_lock = threading.Lock()


def _private_node() -> Node:
    with _private_lock:
        if not _private or not _private[0].running:
            node = Node(f"codex-{os.getpid()}-{next(_names)}", registry=codex_registry()).start()
            atexit.register(node.stop)
            _private.insert(0, node)
        return _private[0]


class _PrivateCodexAdapterActor(CodexAdapterActor):
    use_daemon_thread = True


def _typed(error: BaseException, address: str) -> BaseException:
    if isinstance(error, NotDelivered | Unavailable) and not isinstance(error, AdapterError):
        gone = AdapterError(ErrorKind.UNAVAILABLE, f"codex adapter {address} is gone: {error.message}")
        gone.__cause__ = error
        return gone
    return error


class _Link:
    """The node and actor address a facade talks to, with its default timeout."""

    __slots__ = ("address", "node", "timeout")

    def __init__(self, node: Node, address: str, timeout: float) -> None:
        self.node = node
        self.address = address
        self.timeout = timeout

    def t(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def call(self, message: Any, timeout: float | None) -> Any:
        forbid_blocking("the codex adapter facade")
        try:
            return self.node.request(self.address, message, timeout=self.t(timeout))
        except (NotDelivered, Unavailable) as exc:
            if isinstance(exc, AdapterError):
                raise
            raise _typed(exc, self.address) from exc

    def future(
        self, message: Any, timeout: float | None, convert: Callable[[Any], Any]
    ) -> concurrent.futures.Future[Any]:
        inner = self.node.request_future(self.address, message, timeout=self.t(timeout))
        return chained(inner, convert, lambda error: _typed(error, self.address))

    def quiet_future(self, message: Any, timeout: float | None) -> concurrent.futures.Future[None]:
        """A request whose answer is ``None``, an ``AdapterError`` included (the actor is gone: nothing is
        left to do); other errors (``Expired``) are the future's."""
        inner = self.node.request_future(self.address, message, timeout=self.t(timeout))
        outer: concurrent.futures.Future[None] = concurrent.futures.Future()

        def done(fut: concurrent.futures.Future[Any]) -> None:
            error = fut.exception()
            typed = None if error is None else _typed(error, self.address)
            if typed is None or isinstance(typed, AdapterError):
                outer.set_result(None)
            else:
                outer.set_exception(typed)

        inner.add_done_callback(done)
        return outer


def _settled(value: Any = None) -> concurrent.futures.Future[Any]:
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    done.set_result(value)
    return done


class Adapter:
    """A handle on one Codex-adapter actor (one child). Clones share the child and the key registry."""

    def __init__(self, link: _Link, handle: str) -> None:
        self._link = link
        self._handle = handle  # this handle's token (Retained.handle): what Release names
        self._closed = False

    @property
    def address(self) -> str:
        return self._link.address

    @classmethod
    def open(
        cls,
        config: AdapterConfig,
        *,
        bus: Node | None = None,
        timeout: float | None = None,
        launch: LaunchOptions | None = None,
        name: str | None = None,
    ) -> Adapter:
        """AD-04/05/06: validate (nothing spawned on a bad config), start the child, finish the handshake."""
        ref, link, handle = cls._spawn(config, bus, timeout, launch, name)
        try:
            link.call(AwaitOpen(), timeout)
        except BaseException:
            ref.stop(block=True, timeout=10)  # reaps the child (AD-05)
            raise
        return cls(link, handle)

    @classmethod
    def open_future(
        cls,
        config: AdapterConfig,
        *,
        bus: Node | None = None,
        timeout: float | None = None,
        launch: LaunchOptions | None = None,
        name: str | None = None,
    ) -> concurrent.futures.Future[Any]:
        """``open`` without blocking: the actor is spawned here (a bad config raises here, nothing spawned),
        and the future settles with the handle once the handshake finished. If it fails, the opener's handle
        is released first (the child is closed and reaped, AD-05/AD-17) and the future then raises what
        ``open`` would. A future cancelled before it settled releases the handle it would have given."""
        ref, link, handle = cls._spawn(config, bus, timeout, launch, name)
        opened: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def answered(fut: concurrent.futures.Future[Any]) -> None:
            error = fut.exception()
            if error is None:
                adapter = cls(link, handle)
                if opened.set_running_or_notify_cancel():
                    opened.set_result(adapter)
                else:  # nobody takes the handle: released (the child is closed)
                    adapter.close_future()
                return
            failure = _typed(error, link.address)

            def reaped(_: concurrent.futures.Future[Any]) -> None:
                with contextlib.suppress(Exception):  # stopped already
                    ref.stop(block=False)  # in case the release did not end it in time
                if opened.set_running_or_notify_cancel():
                    opened.set_exception(failure)

            # Answered once the child is reaped; bounded by the child's close (a child that ignores it is
            # killed after REAP_TIMEOUT) and by the handle's timeout.
            release = link.quiet_future(Release(handle=handle), max(link.timeout, REAP_TIMEOUT + 2.0))
            release.add_done_callback(reaped)

        link.node.request_future(link.address, AwaitOpen(), timeout=link.timeout).add_done_callback(answered)
        return opened

    @staticmethod
    def _spawn(
        config: AdapterConfig,
        bus: Node | None,
        timeout: float | None,
        launch: LaunchOptions | None,
        name: str | None,
    ) -> tuple[Any, _Link, str]:
        """Validate ``config`` and start its actor (which spawns the child on its own thread): its ref, the
        link to it and the opener's handle."""
        validate_config(config)
        node = bus if bus is not None else _private_node()
        actor_name = name or f"codex-{os.getpid()}-{next(_names)}"
        # On the private node the actor's thread is a daemon: a handle left open must not keep the interpreter
        # from reaching its atexit hooks, where the node stops and the child is closed and reaped.
        kind = CodexAdapterActor if bus is not None else _PrivateCodexAdapterActor
        handle = secrets.token_hex(16)  # the opener's handle: only this token closes it
        ref = node.spawn(kind, actor_name, config=config, launch=launch, handle=handle)
        link = _Link(node, f"{node.name}/{actor_name}", DEFAULT_TIMEOUT if timeout is None else timeout)
        return ref, link, handle

    @classmethod
    def attach(cls, bus: Node, address: str, *, timeout: float | None = None) -> Adapter:
        """A new handle on a running adapter actor at ``address`` (any node ``bus`` reaches)."""
        link = _Link(bus, address, DEFAULT_TIMEOUT if timeout is None else timeout)
        retained = link.call(Retain(), timeout)
        return cls(link, retained.handle)

    @property
    def node(self) -> Node:
        """The node this handle talks through (a Shim's actor runs there)."""
        return self._link.node

    def clone(self) -> Adapter:
        """AD-08: another handle on the same child; ``close`` each one."""
        self._check()
        retained = self._link.call(Retain(), None)
        return Adapter(self._link, retained.handle)

    def clone_future(self) -> concurrent.futures.Future[Any]:
        self._check()
        link = self._link
        return link.future(Retain(), None, lambda retained: Adapter(link, retained.handle))

    def close(self, *, timeout: float | None = None) -> None:
        """AD-17: release this handle; the last release closes and reaps the child. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(AdapterError):  # the actor is gone already: nothing left to release
            self._link.call(Release(handle=self._handle), timeout)

    def close_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[None]:
        """``close`` without blocking: the future settles (``None``) once the release was answered (the last
        one: once the child is reaped); a gone actor is ``None`` too, an unanswered release ``Expired``."""
        if self._closed:
            return _settled()
        self._closed = True
        return self._link.quiet_future(Release(handle=self._handle), timeout)

    def _check(self) -> None:
        if self._closed:
            raise AdapterError(ErrorKind.UNAVAILABLE, "this adapter handle is closed")

    def start_turn(self, conversation_key: str, input: str, *, timeout: float | None = None) -> Turn:
        """AD-09/AD-14: returns once the app-server accepted the turn; ``BUSY`` if the key has one."""
        self._check()
        reply = self._link.call(StartTurn(conversation_key=conversation_key, input=input), timeout)
        return Turn(self._link, conversation_key, reply.turn_id)

    def start_turn_future(
        self, conversation_key: str, input: str, *, timeout: float | None = None
    ) -> concurrent.futures.Future[Any]:
        self._check()
        link = self._link

        def turn(reply: TurnStarted) -> Turn:
            return Turn(link, conversation_key, reply.turn_id)

        return link.future(StartTurn(conversation_key=conversation_key, input=input), timeout, turn)

    def diagnostics(self, *, timeout: float | None = None) -> bytes:
        """AD-15: a copy of the most recent (≤ 1 MiB) stderr bytes of the child."""
        reply: DiagnosticsReply = self._link.call(Diagnostics(), timeout)
        return reply.stderr

    def __enter__(self) -> Adapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Adapter({self._link.address}{', closed' if self._closed else ''})"

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"{self!r} was not closed", ResourceWarning, stacklevel=1)


class Turn:
    """One active turn on a conversation key. ``abandon()`` (or leaving ``with``) is the Rust drop."""

    def __init__(self, link: _Link, conversation_key: str, turn_id: str) -> None:
        self._link = link
        self.conversation_key = conversation_key
        self.turn_id = turn_id
        self._state = "active"  # local view for repr (TU-11): active | finished | abandoned

    def _seen(self, event: Any) -> Event | None:
        if isinstance(event, Ok) or event is None:
            if self._state == "active":
                self._state = "finished"
            return None
        if isinstance(event, Done | ErrorEvent):
            self._state = "finished"
        return event  # type: ignore[no-any-return]

    def next_event(self, *, timeout: float | None = None) -> Event | None:
        """TU-01/02: the next provider event; the terminal one once; then ``None``."""
        if self._state != "active":
            return None
        return self._seen(self._link.call(NextEvent(turn_id=self.turn_id), timeout))

    def next_event_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        if self._state != "active":
            return _settled()
        return self._link.future(NextEvent(turn_id=self.turn_id), timeout, self._seen)

    def respond(self, call_id: str, result: ToolResult, *, timeout: float | None = None) -> None:
        """TU-07/08: answer a surfaced, still pending call; any other id is ``INVALID_TOOL_RESULT``."""
        self._link.call(Respond(turn_id=self.turn_id, call_id=call_id, result=result), timeout)

    def respond_future(
        self, call_id: str, result: ToolResult, *, timeout: float | None = None
    ) -> concurrent.futures.Future[Any]:
        return self._link.future(
            Respond(turn_id=self.turn_id, call_id=call_id, result=result), timeout, lambda _: None
        )

    def usage(self, *, timeout: float | None = None) -> TokenUsage | None:
        """The token usage codex reported for this turn so far (sum over its model requests); ``None``
        before the first report. Readable after the turn ended (not part of the seed: an addition)."""
        reply: TurnUsageReply = self._link.call(TurnUsage(turn_id=self.turn_id), timeout)
        return reply.usage

    def usage_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        return self._link.future(TurnUsage(turn_id=self.turn_id), timeout, lambda reply: reply.usage)

    def abandon(self, *, timeout: float | None = None) -> None:
        """TU-05/06: interrupt an unfinished turn and free its key; a no-op when finished or abandoned."""
        if self._state != "active":
            return
        self._state = "abandoned"
        with contextlib.suppress(AdapterError):
            self._link.call(Abandon(turn_id=self.turn_id), timeout)

    def abandon_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[None]:
        """``abandon`` without blocking; settles (``None``) once the adapter took it (at once when there was
        nothing to abandon); an unanswered abandon is ``Expired``."""
        if self._state != "active":
            return _settled()
        self._state = "abandoned"
        return self._link.quiet_future(Abandon(turn_id=self.turn_id), timeout)

    def __enter__(self) -> Turn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abandon()

    def __repr__(self) -> str:
        return f"Turn(key={self.conversation_key!r}, id={self.turn_id}, state={self._state})"


__all__ = ["Adapter", "BusError", "LaunchOptions", "Turn"]
