"""The bridge between pykka mailboxes and the bus: ``BusActor`` and the per-message ``Context``.

An actor's thread is its only lock. No input, and no failure while answering it, stops an actor: a decode
failure, a ``BusError`` or any other exception becomes an error reply (for a request) or an error tell back
to the sender (for a tell), and the actor goes on serving. An error reply is bounded (texts cut, their
original size noted; fields that cannot travel dropped, saying so); a reply that cannot be encoded is
answered with that error; an answer that cannot be sent, and a failure past all of these, is counted in
``node.stats`` (``answer_send_failures``, ``actor_input_failures``) and logged once per actor, never
raised. A deferred request is forgotten when its deadline passes, so memory returns.

An actor never blocks on another actor's reply: it sends a request with a continuation (``ask``) and the
reply arrives through its own mailbox.

An actor may *host* another (``host_actor``): the hosted actor is addressed, registered, started and stopped
like any other and keeps its own state and rules, but it has no thread of its own: its mailbox items go into
its host's mailbox and run on the host's thread, between the host's own messages. A request between host
and hosted actor then costs no thread hand-off. A session loop hosts its inference handles this way.

A node's ``HostPool`` (``HostPool.of(node, kind)``) is a few ``HostingActor``s whose only job is to host
others: ``pool.spawn(actor_class, name, ...)`` places the actor on the one hosting fewest, by a message to it,
instead of starting a thread for it. So threads grow with the pool's size, not with the actors placed. A
hosted actor that fails (a bug) stops alone; its host and the actors beside it go on.

The node's *loop* pool (``LOOP_HOSTS``, ``[node] hosts`` threads, one by default) carries the actors that
never block: conversations, runs with their handles, plan gates, and the Router, which ``Node.spawn`` places
there (``BusActor.PLACED_ON``). Under CPython's GIL their Python code cannot run in parallel anyway, while
every message between two threads costs a thread wake-up (tens of µs when the two threads sit on different
CPUs, as they do on a small VM): on one thread a round's messages between them cost none. What may block (a
tool, a host's callbacks, a blocking provider) keeps threads of its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Final

import pykka

from transport.affinity import HomeQueue
from transport.codec import encode_header
from transport.envelope import Address, Header, Inbound, InboundBatch, Route, TellBatch, node_of
from transport.errors import BusError, Expired, ProtocolError, Unavailable
from transport.inbox import SocketInbox
from transport.messages import ErrorReply, Ok, Ping, Pong
from transport.node import BARRIER, Node
from transport.pending import Reply, current_actor, mark_actor_thread
from transport.records import frozen

log = logging.getLogger(__name__)


@frozen
class ReplyArrived:
    """A reply (or terminal error) to a request this actor sent, delivered through its own mailbox."""

    request_id: bytes
    reply: Reply


@frozen
class _FutureDone:
    """A future an ``answer_when_done`` handler returned has resolved (posted by its done-callback)."""

    ctx: Context
    future: concurrent.futures.Future[Any]
    then: Callable[[Any, BaseException | None], None] | None


@frozen
class _Expire:
    """A deferred request's deadline passed (posted by the node's timer): forget it."""

    request_id: bytes


class _Hosted:
    """A mailbox item of a hosted actor, in its host's mailbox (``BusActor.host_actor``). It is its own
    envelope there (pykka 4's loop, pinned in setup.cfg, reads an item's ``message`` and ``reply_to``): one
    allocation per hosted message, not a second envelope around it."""

    __slots__ = ("actor", "envelope")

    reply_to = None  # the host's loop answers nobody for it: the hosted actor's own envelope may

    def __init__(self, actor: BusActor, envelope: Any) -> None:
        self.actor = actor
        self.envelope = envelope  # pykka's Envelope, as the hosted actor's own inbox would have held it

    @property
    def message(self) -> _Hosted:
        return self


class _HostedInbox:
    """A hosted actor's inbox (pykka's put/get/empty): every item goes into its host's mailbox."""

    __slots__ = ("_actor", "_host", "owner")

    def __init__(self, host: Any, actor: BusActor, owner: BusActor) -> None:
        self._host = host
        self._actor = actor
        self.owner = owner  # the hosting actor

    def put(self, envelope: Any) -> None:
        self._host.put(_Hosted(self._actor, envelope))

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        raise RuntimeError("a hosted actor's items are taken by its host")

    def empty(self) -> bool:
        return True


DRAIN_BOUND: Final = 256  # a host's items after which a hosted actor's ``when_drained`` is called anyway


# Kinds ``_take`` answers without the handler (a ping) or turns into ``on_tell_error`` (a tell error).
_ANSWERED_BY_THE_ACTOR: Final = frozenset((Ping.TAG, ErrorReply.TAG))


class Deferred:
    """Returned by a handler that will answer later through ``Context.reply`` / ``Context.fail``."""


DEFER = Deferred()


class Context:
    """The request being handled: its header and the way to answer it (once, finally).

    Answering never raises for the answer's sake: a reply that cannot be encoded is answered with that
    error instead, an error is bounded in size (``Registry.encode_error``), and a send that fails is
    counted and logged once per actor (``BusActor.answer_failures``).
    """

    __slots__ = ("_actor", "done", "expired", "header", "route")

    def __init__(self, actor: BusActor, header: Header, route: Route | None) -> None:
        self._actor = actor
        self.header = header
        self.route = route
        self.done = False
        # Deferred past its deadline: forgotten by the actor. Answering it later is a counted no-op (the
        # requester gave up at that deadline, so the answer would only be dropped there as late).
        self.expired = False

    @property
    def wants_reply(self) -> bool:
        return self.header.is_request

    def partial(self, message: Any) -> None:
        """One partial reply of a streamed request (ignored for a plain ask: it has one reply only).

        Raises (to the handler, which then fails the request) when ``message`` cannot be encoded."""
        if self.expired:
            self._actor._bus_late_answer()
            return
        if self.done:
            raise RuntimeError(f"{self.header.kind}: already answered")
        if self.header.flow == "stream":
            node = self._actor.node
            body, local = node.encode_for(self.header.src, message)
            self._actor._bus_send_answer(self, node.registry.tag_of(message), body, "part", local)

    def reply(self, message: Any, *, moved: bool = False) -> None:
        """Answer with ``message`` (a tell's context is only marked done). ``moved``: this actor will not
        read or change a mutable value in ``message`` again and nobody else holds one (see
        ``Registry.local_copy``): a requester in this process takes ``message`` itself, instead of a copy
        of its JSON values and a walk over all of it; one elsewhere gets it encoded, as always."""
        if self.expired:
            self._actor._bus_late_answer()
            return
        if self.done:
            raise RuntimeError(f"{self.header.kind}: already answered")
        if not self.header.is_request:
            self._finish()
            return
        node = self._actor.node
        try:
            tag = node.registry.tag_of(message)
            body, local = node.encode_for(self.header.src, message, moved=moved)
        except Exception as exc:  # noqa: BLE001 - a reply that cannot travel is answered with why
            self.fail(exc)
            return
        self._finish()
        self._actor._bus_send_answer(self, tag, body, "reply", local)

    def fail(self, error: BaseException) -> None:
        """Answer with a typed error: the requester gets it raised; a tell's sender gets a tell error."""
        if self.expired:
            self._actor._bus_late_answer()
            return
        if self.done:
            raise RuntimeError(f"{self.header.kind}: already answered")
        self._finish()
        if self.header.is_request:
            flow = "reply"
        elif self.header.flow == "tell" and self.header.kind != ErrorReply.TAG:
            flow = "tell"
        else:
            return
        self._actor._bus_send_answer(
            self, ErrorReply.TAG, self._actor.node.registry.encode_error(error), flow
        )

    def _finish(self) -> None:
        self.done = True
        self._actor._bus_forget(self.header.id)


class BusActor(pykka.ThreadingActor):
    """A pykka actor reachable on the bus at ``node/name``.

    Subclasses implement ``handle(message, ctx)``: return the reply (``None`` means ``Ok``), raise to
    answer with an error, or return ``DEFER`` and answer later through ``ctx``. Replies to requests this
    actor sent with ``ask`` arrive as calls to their continuation, on this actor's thread.
    """

    @staticmethod
    def _create_actor_inbox() -> Any:
        # SimpleQueue (C) instead of pykka's queue.Queue: the mailbox hop is on every message's path. Its
        # waits sit on the process's home CPU (transport/affinity.py).
        return HomeQueue()

    # A direct actor also takes peers' traffic on its own socket (transport/inbox.py): no thread hand-off
    # between a remote caller and the handler. For actors on the hot path of blocking calls.
    DIRECT: ClassVar[bool] = False
    # The node's I/O thread may hand over a burst of messages as one mailbox item (transport InboundBatch,
    # TellBatch).
    TAKES_INBOUND_BATCH: ClassVar[bool] = True
    # The node host pool ``Node.spawn`` (through ``start``) places this class's actors on, or None: a thread
    # of their own. Only for actors that never block their thread: the others hosted there would wait.
    PLACED_ON: ClassVar[str | None] = None

    @classmethod
    def start(cls, *args: Any, **kwargs: Any) -> Any:
        """pykka's start, ``(node, address, ...)``: on the node's ``PLACED_ON`` pool when the class names one
        and the pool has hosts (a direct actor on a node with endpoints keeps its thread: its socket needs
        it), else on a thread of its own."""
        kind = cls.PLACED_ON
        if kind is not None and len(args) >= 2 and isinstance(args[0], Node):
            node, address = args[0], args[1]
            pool = HostPool.of(node, kind)
            if pool.size > 0 and not (cls.DIRECT and node.endpoints):
                return pool.spawn(cls, str(address).partition("/")[2], *args[2:], **kwargs)
        return super().start(*args, **kwargs)

    def __init__(self, node: Node, address: str) -> None:
        super().__init__()
        if self.DIRECT and node.endpoints:
            inbox = SocketInbox(node, address.partition("/")[2])
            self.actor_inbox = inbox
            self.actor_ref.actor_inbox = inbox
        self.node = node
        self.address = address
        self.name = address.partition("/")[2]
        self._continuations: dict[bytes, Callable[[Reply], None]] = {}
        self._open: dict[bytes, Context] = {}  # deferred requests not yet answered
        self._bus_expiry: dict[bytes, int] = {}  # deferred request -> its node timer (see _bus_defer)
        self.bus_answer_failures = 0  # answers that could not be sent (node.stats: answer_send_failures)
        self.bus_input_failures = 0  # inbound messages whose handling failed past every error reply
        self.bus_counts = node.actor_counts(self.name)  # handled / failed, read by sys.stats
        self._hosted: set[BusActor] = set()  # actors this one hosts (host_actor), until they stop
        self._held_answers: list[tuple[Context, str, bytes, str, Any]] | None = None  # see hold_answers
        self._drain_wanted = False  # see when_drained
        self._drain_waiters: dict[BusActor, int] = {}  # hosted actors waiting for a drain -> items since

    # ------------------------------------------------------------------------------- subclass API
    def handle(self, message: Any, ctx: Context) -> Any:
        raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")

    def on_expired(self, ctx: Context) -> None:
        """A deferred request's deadline passed and the actor forgot it (``ctx.expired``; answering it now
        does nothing). Override to drop what the actor keeps for it. Runs on the actor's thread."""

    def on_tell_error(self, error: BusError, tell_id: bytes | None) -> None:
        """A tell this actor sent failed on the far side (or could not be delivered)."""
        self.node.log_limit.log(
            log,
            logging.WARNING,
            (self.address, "tell_error", type(error)),
            "%s: tell %s failed: %r",
            self.address,
            (tell_id or b"").hex(),
            error,
        )

    def ask(
        self,
        dst: str,
        message: Any,
        then: Callable[[Reply], None],
        *,
        timeout: float | None = None,
        stream: bool = False,
        moved: bool = False,
        **fields: Any,
    ) -> bytes:
        """Send a request without blocking; ``then(reply)`` runs on this actor's thread for each reply
        (partials first when ``stream``) and for the terminal error. Returns the request id. ``moved``: as
        ``Context.reply``'s, for the request."""
        node = self.node
        header = node.header(
            node.registry.tag_of(message),
            self.address,
            dst,
            "stream" if stream else "ask",
            timeout=timeout if timeout is not None else node.request_timeout,
            **fields,
        )
        body, local = node.encode_for(dst, message, moved=moved)  # raises before anything is registered
        self._continuations[header.id] = then
        ref = self.actor_ref

        def deliver(reply: Reply) -> None:
            try:
                ref.tell(ReplyArrived(header.id, reply))
            except pykka.ActorDeadError:
                log.info("%s stopped before its reply arrived", self.address)

        try:
            node.send(header, body, deliver=deliver, timeout=timeout, message=local)
        except BaseException:  # refused (a timeout that is not a finite number): nothing waits for it
            self._continuations.pop(header.id, None)
            raise
        return header.id

    def tell_to(self, dst: str, message: Any, **fields: Any) -> bytes:
        return self.node.tell(dst, message, src=self.address, **fields)

    def host_actor(self, actor_class: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        """Start ``actor_class(node, address, *args, **kwargs)`` at ``node/name`` on this actor's thread
        (see the module docstring) and return its ref. Call it from this actor's thread only. The hosted
        actor is stopped when it stops itself, when its ref is stopped, and at the latest with its host."""
        if actor_class.DIRECT and self.node.endpoints:
            raise ValueError(f"{actor_class.__name__} takes traffic on its own socket: it needs its thread")
        address = str(Address.parse(f"{self.node.name}/{name}"))
        if self.node.lookup(name) is not None:
            raise ValueError(f"{address} exists already")
        actor = actor_class(self.node, address, *args, **kwargs)
        inbox = _HostedInbox(self.actor_inbox, actor, self)
        actor.actor_inbox = inbox
        actor.actor_ref.actor_inbox = inbox
        self._hosted.add(actor)
        self.node.register(name, actor.actor_ref)
        caller = current_actor()  # this actor, or one it hosts starting a companion
        mark_actor_thread(address)
        try:
            actor.on_start()
        except Exception:  # noqa: BLE001 - as pykka does for a failing on_start: logged, actor stopped
            actor._handle_failure(*sys.exc_info())
            self._hosted.discard(actor)
            self.node.unregister(name, actor.actor_ref)
        finally:
            mark_actor_thread(caller or self.address)
        return actor.actor_ref

    def _run_hosted(self, hosted: _Hosted) -> None:
        """One mailbox item of a hosted actor, run as its own thread's loop would (pykka's actor loop)."""
        actor, envelope = hosted.actor, hosted.envelope
        if actor.actor_stopped.is_set():  # items left behind when it stopped: as pykka's loop teardown
            if envelope.reply_to is not None:
                if isinstance(envelope.message, pykka.messages._ActorStop):
                    envelope.reply_to.set(None)
                else:
                    dead = pykka.ActorDeadError(f"{actor.address} stopped before handling the message")
                    envelope.reply_to.set_exception(exc_info=(type(dead), dead, None))
            return
        mark_actor_thread(actor.address)
        try:
            response = actor._handle_receive(envelope.message)
            if envelope.reply_to is not None:
                envelope.reply_to.set(response)
        except Exception:  # noqa: BLE001 - as pykka's loop: to the asker, else logged and the actor stops
            if envelope.reply_to is not None:
                envelope.reply_to.set_exception()
            else:  # as pykka: the hosted actor fails and stops; its host lives on
                actor._handle_failure(*sys.exc_info())
                try:
                    actor.on_failure(*sys.exc_info())
                except Exception:
                    log.exception("%s: on_failure raised", actor.address)
        finally:
            mark_actor_thread(self.address)
        if actor.actor_stopped.is_set():
            self._hosted.discard(actor)

    def _stop_hosted(self) -> None:
        for actor in list(self._hosted):
            if not actor.actor_stopped.is_set():
                mark_actor_thread(actor.address)
                try:
                    actor._stop()
                finally:
                    mark_actor_thread(self.address)
        self._hosted.clear()

    # ----------------------------------------------------------------------------- pykka plumbing
    def on_start(self) -> None:
        mark_actor_thread(self.address)

    def on_stop(self) -> None:
        self._stop_hosted()
        self.node.unregister(self.name, self.actor_ref)
        # Answer deferred requests first: some came in over the direct socket, closed just below.
        for ctx in list(self._open.values()):
            if not ctx.done:
                ctx.fail(Unavailable(f"{self.address} stopped before answering"))
        self._open.clear()
        for handle in self._bus_expiry.values():
            self.node.cancel_call(handle)
        self._bus_expiry.clear()
        if isinstance(self.actor_inbox, SocketInbox):
            self.actor_inbox.close()

    def on_failure(self, exception_type: Any, exception_value: Any, traceback: Any) -> None:
        self._stop_hosted()
        self.node.unregister(self.name, self.actor_ref)
        if isinstance(self.actor_inbox, SocketInbox):
            self.actor_inbox.close()

    def _handle_receive(self, message: Any) -> Any:
        try:
            return self._dispatch(message)
        finally:
            if self._drain_wanted or self._drain_waiters:
                self._after_item()

    def _dispatch(self, message: Any) -> Any:
        # Bus traffic skips pykka's checks for its own system messages (stop, proxy calls): it is the
        # bulk of what an actor receives, and the hot path of every request.
        kind = type(message)
        if kind is Inbound:
            self._inbound(message)
            return None
        if kind is TellBatch:
            self._inbound_each(message)
            return None
        if kind is InboundBatch:
            for part in message.parts:
                if type(part) is Inbound:
                    self._inbound(part)
                else:
                    self._inbound_each(part)
            return None
        if kind is _Hosted:
            self._run_hosted(message)
            return None
        return super()._handle_receive(message)

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, Inbound):
            self._inbound(message)
            return None
        if isinstance(message, ReplyArrived):
            self._reply_arrived(message)
            return None
        if isinstance(message, _FutureDone):
            self._future_done(message)
            return None
        if isinstance(message, _Expire):
            self._bus_expire(message.request_id)
            return None
        if message is BARRIER:
            return None
        return self.on_local(message)

    def answer_when_done(
        self,
        result: Any,
        ctx: Context,
        then: Callable[[Any, BaseException | None], None] | None = None,
    ) -> Any:
        """For a handler whose application call returns either a value or a future of it (a host method):
        a value is returned as the answer now; a future answers ``ctx`` when it resolves, through this
        actor's mailbox, so the actor serves other messages meanwhile. ``then(value, error)`` runs first, on
        the actor's thread. ``None`` is answered as ``Ok``."""
        if not isinstance(result, concurrent.futures.Future):
            return result
        ref = self.actor_ref
        result.add_done_callback(lambda fut: ref.tell(_FutureDone(ctx, fut, then)))
        return DEFER

    def _future_done(self, done: _FutureDone) -> None:
        future, ctx = done.future, done.ctx
        error = future.exception() if not future.cancelled() else concurrent.futures.CancelledError()
        value = None if error is not None else future.result()
        if done.then is not None:
            try:
                done.then(value, error)
            except Exception as exc:  # a bug in the continuation answers the request
                log.exception("%s: continuation for %s raised", self.address, ctx.header.kind)
                if not ctx.done:
                    ctx.fail(exc)
                return
        if ctx.done:
            return
        if error is not None:
            ctx.fail(error)
        else:
            ctx.reply(Ok() if value is None else value)

    def on_local(self, message: Any) -> Any:
        """Plain pykka messages from in-process callers (not bus traffic)."""
        raise TypeError(f"{self.address}: unexpected local message {type(message).__name__}")

    def _inbound(self, inbound: Inbound) -> None:
        # The invariant of every actor: no input, and no failure while answering it, stops the actor.
        self.bus_counts.handled += 1
        try:
            self._take(inbound.header, inbound.body, inbound.route, inbound.message)
        except Exception:  # noqa: BLE001 - past every error reply: counted, logged once, the actor lives
            self._inbound_failed(inbound.header)

    def _inbound_each(self, tells: TellBatch) -> None:
        """``_inbound`` for each tell of a batch frame, in order: each header made as it is taken, and no
        ``Inbound`` around it (the hot path of a burst of tells). What ``_take`` asks of every message is
        the same for every tell of a frame, so it is asked once: each is a tell (not a request, so the
        handler's result answers nothing), and on a node that does not capture, a tell of a kind the actor
        does not answer itself (a ping, a tell error: those take ``_take``'s way) is decoded and handled."""
        counts, take, route = self.bus_counts, self._take, tells.route
        node = self.node
        if node.capture is not None:
            for header, body in tells.pairs():
                counts.handled += 1
                try:
                    take(header, body, route, None)
                except Exception:  # noqa: BLE001 - as in _inbound
                    self._inbound_failed(header)
            return
        decode, handle = node.registry.decode, self.handle
        for header, body in tells.pairs():
            counts.handled += 1
            try:
                kind = header.kind
                if kind in _ANSWERED_BY_THE_ACTOR:
                    take(header, body, route, None)
                    continue
                ctx = Context(self, header, route)
                try:
                    handle(decode(kind, body), ctx)
                except Exception as exc:  # noqa: BLE001 - answered as _take answers it
                    self._handler_failed(ctx, exc)
            except Exception:  # noqa: BLE001 - as in _inbound
                self._inbound_failed(header)

    def _inbound_failed(self, header: Header) -> None:
        self.bus_counts.failed += 1
        self.bus_input_failures += 1
        self.node.stats.incr("actor_input_failures")
        if self.bus_input_failures == 1:
            log.exception(
                "%s: handling %s failed (counted from now on, logged only once)", self.address, header.kind
            )

    def _take(self, header: Header, body: bytes, route: Route | None, message: Any) -> None:
        """One message off the bus (an ``Inbound``'s slots; ``message`` None: decode ``body``), handled and
        answered: its error, if any, answered too."""
        node = self.node
        if node.capture is not None:
            node.record("deliver", self.address, [encode_header(header), body])
        ctx = Context(self, header, route)
        try:
            if message is None:
                message = node.registry.decode(header.kind, body)
            if isinstance(message, ErrorReply) and header.flow == "tell":
                self.on_tell_error(node.registry.rebuild_error(message), header.corr)
                return
            if isinstance(message, Ping):
                result: Any = Pong(nonce=message.nonce, actor=self.address)
            else:
                result = self.handle(message, ctx)
        except Exception as exc:  # noqa: BLE001 - answered, counted and logged (rate-limited)
            self._handler_failed(ctx, exc)
            return
        if ctx.done or not header.is_request:
            return
        if result is DEFER:
            self._bus_defer(ctx)
            return
        ctx.reply(Ok() if result is None else result)

    def _handler_failed(self, ctx: Context, exc: Exception) -> None:
        """What decoding or handling ``ctx``'s message raised: a typed error is answered with and logged at
        INFO; anything else is a bug in a handler, reported to the sender and logged loudly, with its
        traceback. Both rate-limited; the actor lives on."""
        header = ctx.header
        self.bus_counts.failed += 1
        if isinstance(exc, BusError):
            self.node.log_limit.log(
                log,
                logging.INFO,
                (self.address, "answered", header.kind, type(exc)),
                "%s: %s answered with %r",
                self.address,
                header.kind,
                exc,
            )
        else:
            self.node.log_limit.log(
                log,
                logging.ERROR,
                (self.address, "raised", header.kind, type(exc)),
                "%s: handler for %s raised %s",
                self.address,
                header.kind,
                type(exc).__name__,
                exc=exc,
            )
        if not ctx.done:
            ctx.fail(exc)

    # ------------------------------------------------------------------------ deferred requests
    def _bus_defer(self, ctx: Context) -> None:
        """Hold ``ctx`` until it is answered or its deadline passes (then it is forgotten: memory returns).

        A request without a deadline (only a foreign client sends one) is held for the node's
        ``request_timeout`` and then answered ``Expired``.
        """
        node = self.node
        header = ctx.header
        self._open[header.id] = ctx
        deadline = header.deadline if header.deadline is not None else node.clock() + node.request_timeout
        at = node.monotonic() + max(0.0, deadline - node.clock())
        ref = self.actor_ref
        request_id = header.id

        def expire() -> None:  # on the I/O thread: only a hand-off to this actor's mailbox
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(_Expire(request_id))

        self._bus_expiry[request_id] = node.call_at(at, expire)

    def _bus_forget(self, request_id: bytes) -> None:
        self._open.pop(request_id, None)
        handle = self._bus_expiry.pop(request_id, None)
        if handle is not None:
            self.node.cancel_call(handle)

    def _bus_expire(self, request_id: bytes) -> None:
        self._bus_expiry.pop(request_id, None)
        ctx = self._open.pop(request_id, None)
        if ctx is None or ctx.done:
            return
        self.node.stats.incr("deferred_expired")
        if ctx.header.deadline is None and ctx.header.is_request:
            ctx.fail(Expired(f"{self.address}: no answer within {self.node.request_timeout}s"))
        ctx.done = ctx.expired = True
        try:
            self.on_expired(ctx)
        except Exception:
            log.exception("%s: on_expired raised", self.address)

    def _bus_late_answer(self) -> None:
        self.node.stats.incr("late_answers")

    # ---------------------------------------------------------------------------- held answers
    def hold_answers(self) -> None:
        """Keep every answer this actor gives from now on (replies, partials, tell errors) until
        ``release_answers``: for an actor whose answers report facts that are not durable yet (a group
        commit in progress). Their order is kept. Idempotent while holding."""
        if self._held_answers is None:
            self._held_answers = []

    def when_drained(self) -> None:
        """Ask for one call of ``on_drained``, on this actor's thread, once nothing more waits in its mailbox
        after an item (a hosted actor: its host's mailbox, or after ``DRAIN_BOUND`` of the host's items, so
        that a busy host's other actors cannot put it off for ever)."""
        inbox = self.actor_inbox
        if isinstance(inbox, _HostedInbox):
            inbox.owner._drain_waiters.setdefault(self, 0)
        else:
            self._drain_wanted = True

    def on_drained(self) -> None:
        """See ``when_drained``."""

    def _after_item(self) -> None:
        if self._drain_wanted and not self.mail_waiting():
            self._drain_wanted = False
            self.on_drained()
        if not self._drain_waiters:
            return
        waiting = self.mail_waiting()
        for actor, seen in list(self._drain_waiters.items()):
            if waiting and seen + 1 < DRAIN_BOUND:
                self._drain_waiters[actor] = seen + 1
                continue
            del self._drain_waiters[actor]
            mark_actor_thread(actor.address)
            try:
                actor.on_drained()
            except Exception:  # as a hosted item's failure: logged, the host lives on
                log.exception("%s: on_drained raised", actor.address)
            finally:
                mark_actor_thread(self.address)

    def mail_waiting(self) -> bool:
        """Whether another item waits in this actor's own mailbox right now (a direct actor's: its local
        items and its own socket). Not for a hosted actor: its host's mailbox holds others' items too."""
        inbox = self.actor_inbox
        if isinstance(inbox, _HostedInbox):
            raise RuntimeError(f"{self.address} is hosted: its host's mailbox is not its own")
        if isinstance(inbox, SocketInbox):
            return inbox.waiting()
        return not inbox.empty()

    def release_answers(self, failed: Callable[[Context], BaseException | None] | None = None) -> None:
        """Send the held answers, in order, and stop holding. ``failed(ctx)`` may name an error for a held
        request instead: that request is then answered with it once (what was held for it is dropped)."""
        held, self._held_answers = self._held_answers, None
        if not held:
            return
        errors: dict[int, BaseException | None] = {}
        for ctx, tag, body, flow, message in held:
            key = id(ctx)
            if key not in errors:
                error = errors[key] = failed(ctx) if failed is not None else None
                if error is not None:
                    self._bus_send_answer(
                        ctx,
                        ErrorReply.TAG,
                        self.node.registry.encode_error(error),
                        "reply" if ctx.header.is_request else "tell",
                    )
            if errors[key] is None:
                self._bus_send_answer(ctx, tag, body, flow, message)

    def _bus_send_answer(self, ctx: Context, tag: str, body: bytes, flow: str, message: Any = None) -> None:
        """Send an answer to ``ctx``'s sender (encoded, or ``message`` itself as ``Node.encode_for`` gave
        it); a failure is counted and logged once, never raised. Kept instead while answers are held."""
        if self._held_answers is not None:
            self._held_answers.append((ctx, tag, body, flow, message))
            return
        node = self.node
        header = ctx.header
        try:
            reply = node.header(
                tag,
                self.address,
                header.src,
                flow,  # type: ignore[arg-type]
                corr=header.id,
                conv=header.conv,
                turn=header.turn,
            )
            route = ctx.route if node_of(header.src) != node.name else None
            node.send(reply, body, route=route, message=message)
        except Exception:  # an answer that cannot be sent must not stop the actor
            self.bus_answer_failures += 1
            node.stats.incr("answer_send_failures")
            if self.bus_answer_failures == 1:
                log.warning(
                    "%s: could not send a %s answer to %s (counted from now on, logged only once)",
                    self.address,
                    flow,
                    header.src,
                    exc_info=True,
                )

    def _record_reply(self, request_id: bytes, reply: Reply) -> None:
        node = self.node
        if reply.error is not None:
            # Locally decided outcomes (Expired, NotDelivered, Unavailable) have no frames of their own:
            # record them as the error reply they stand for, so a replay reproduces them.
            body = node.registry.encode(node.registry.error_reply(reply.error))
            header = node.header(ErrorReply.TAG, f"{node.name}/node", self.address, "reply", corr=request_id)
        else:
            body = node.registry.encode(reply.message)
            header = reply.header or node.header(
                node.registry.tag_of(reply.message),
                f"{node.name}/node",
                self.address,
                "reply" if reply.final else "part",
                corr=request_id,
            )
        node.record("deliver", self.address, [encode_header(header), body])

    def _reply_arrived(self, arrived: ReplyArrived) -> None:
        reply = arrived.reply
        then = (
            self._continuations.pop(arrived.request_id, None)
            if reply.final
            else self._continuations.get(arrived.request_id)
        )
        if then is None:
            self.node.log_limit.log(
                log,
                logging.INFO,
                (self.address, "unawaited"),
                "%s: dropped a reply to %s nobody waits for",
                self.address,
                arrived.request_id.hex(),
            )
            return
        try:
            if self.node.capture is not None:
                self._record_reply(arrived.request_id, reply)
            then(reply)
        except Exception:
            log.exception("%s: continuation for %s raised", self.address, arrived.request_id.hex())


# ------------------------------------------------------------------------------------------ hosting pool
# Hosting actors a pool starts when its node's settings did not say (``[node] hosts``). One: what a pool
# hosts never blocks, and more threads only add hand-offs between them (see the module docstring).
DEFAULT_HOSTS = 1
# The pool of a node's never-blocking actors (the module docstring): conversations, runs, the Router.
LOOP_HOSTS: Final = "conversation"
PLACE_TIMEOUT = 30.0  # seconds a placement waits for its host (it only constructs and starts the actor)

_on_host = threading.local()  # ``.actor``: the HostingActor whose thread this is


@frozen
class _Place:
    """Host ``actor_class(node, address, *args, **kwargs)`` at ``node/name`` (a HostingActor's message)."""

    actor_class: Any
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class HostingActor(BusActor):
    """An actor whose only job is to host others (``HostPool.spawn``); it serves no bus traffic of its own.

    Its thread is a daemon thread: what it hosts may run code that does not return (a tool), and the process
    must still be able to exit once an explicit stop has given up on it."""

    use_daemon_thread = True

    def __init__(self, node: Node, address: str, *, pool: HostPool) -> None:
        super().__init__(node, address)
        # A mailbox with lanes (transport/inbox.py): what it hosts reaches peers' direct actors (a remote
        # Router) on sockets this thread owns, not through the node's I/O thread. No socket of its own.
        inbox = SocketInbox(node, self.name, serve=False)
        self.actor_inbox = inbox
        self.actor_ref.actor_inbox = inbox
        self.generation = 0  # the how-manieth start of this host's name (HostPool.hosts)
        self.pool = pool
        pool._joined(self)

    @property
    def hosted(self) -> int:
        """How many actors it hosts now (read from any thread: a hint for placement, not a fact)."""
        return len(self._hosted)

    def on_start(self) -> None:
        super().on_start()
        _on_host.actor = self

    def on_local(self, message: Any) -> Any:
        if isinstance(message, _Place):
            return self.host_actor(message.actor_class, message.name, *message.args, **message.kwargs)
        return super().on_local(message)


class HostPool:
    """The hosting actors of one node for one kind of actor: ``<kind>-host.0`` .. ``<kind>-host.<size-1>``,
    started when the first actor is placed (and again if one has stopped). Size 0 means no pool: ``spawn``
    starts each actor on its own thread, as ``Node.spawn`` does."""

    # Per-node state lives on the node (Node.shared): the pool table and the one start of each host are
    # made once however many threads ask, with the node's lock, so this code needs none of its own (MB-01).

    def __init__(self, node: Node, kind: str, size: int) -> None:
        if size < 0:
            raise ValueError(f"a host pool's size is 0 or more, not {size}")
        self.node = node
        self.kind = kind
        self.size = size
        self._hosts: dict[str, HostingActor] = {}  # name -> the hosting actor (joined in its __init__)

    @staticmethod
    def _sizes(node: Node) -> dict[str, int]:
        return node.shared((HostPool, "sizes"), dict)

    @classmethod
    def configure(cls, node: Node, kind: str, size: int) -> None:
        """The size of ``node``'s pool for ``kind`` (before its first placement; later calls change nothing
        once the pool exists)."""
        if size < 0:
            raise ValueError(f"a host pool's size is 0 or more, not {size}")
        cls._sizes(node)[kind] = size

    @classmethod
    def of(cls, node: Node, kind: str) -> HostPool:
        """``node``'s pool for ``kind``, made on first use: of the configured size, else ``DEFAULT_HOSTS``."""
        sizes = cls._sizes(node)  # not inside make: Node.shared's make must not call shared again
        return node.shared(
            (HostPool, "pool", kind), lambda: HostPool(node, kind, sizes.get(kind, DEFAULT_HOSTS))
        )

    def _joined(self, host: HostingActor) -> None:
        self._hosts[host.name] = host

    def _started(self, name: str, generation: int) -> HostingActor:
        self.node.spawn(HostingActor, name, pool=self)
        host = self._hosts[name]
        host.generation = generation
        return host

    def hosts(self) -> list[HostingActor]:
        """The pool's running hosting actors, started (or restarted) as needed: each start happens once, the
        key naming its generation."""
        running = []
        for i in range(self.size):
            name = f"{self.kind}-host.{i}"
            host = self._hosts.get(name)
            if host is None or host.actor_stopped.is_set():
                generation = 1 if host is None else host.generation + 1

                def start(name: str = name, generation: int = generation) -> HostingActor:
                    return self._started(name, generation)

                host = self.node.shared((HostPool, "host", self.kind, name, generation), start)
            running.append(host)
        return running

    def spawn(self, actor_class: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        """Start ``actor_class(node, address, *args, **kwargs)`` at ``node/name`` on the pool's host with
        the fewest actors, and return its ref (as ``Node.spawn``). Called on the thread of one of this pool's
        own hosts (an actor placed there starting its companions) it is hosted right there, without a wait;
        from any other thread, another pool's hosts included (a tool host's thread may block, and may wait
        for what it places), the placement waits up to ``PLACE_TIMEOUT``. An actor that takes traffic on its
        own socket (``DIRECT`` on a node with endpoints), or any actor when the pool's size is 0, gets its own
        thread."""
        if self.size == 0 or (actor_class.DIRECT and self.node.endpoints):
            return self.node.spawn(actor_class, name, *args, **kwargs)
        here = getattr(_on_host, "actor", None)
        if isinstance(here, HostingActor) and here.pool is self and not here.actor_stopped.is_set():
            return here.host_actor(actor_class, name, *args, **kwargs)
        host = min(self.hosts(), key=lambda h: h.hosted)
        return host.actor_ref.ask(_Place(actor_class, name, args, kwargs), timeout=PLACE_TIMEOUT)
