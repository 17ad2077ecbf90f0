"""A node: one process's bus endpoint. Routes envelopes between local actor mailboxes and peer nodes.

Threads and sockets:

- The **I/O thread** owns every bound ROUTER, every outbound DEALER and their monitors. It decodes headers
  (never bodies), authorises, and puts each inbound message straight into the target actor's mailbox.
- Other threads hand outbound frames to it through a queue plus an eventfd wake-up (one hop).
- A plain thread that *blocks* on a request to a peer uses its own ``Channel`` (fast path, no hop).
- Messages between actors of the same node never touch a socket (still encoded, so what works locally
  works remotely, and capture sees the same bytes).

Delivery is at-most-once. Every request ends in exactly one terminal outcome: a reply, an application
error, ``NotDelivered`` (nothing ran), ``Unavailable`` (outcome unknown) or ``Expired``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from transport.codec import MAX_HEADER_BYTES, Registry, decode_header, encode_header
from transport.envelope import Address, Flow, Header, is_node_name, new_id, node_of
from transport.errors import BusError, NotDelivered, ProtocolError, Unavailable
from transport.messages import SYSTEM_MESSAGES, ErrorReply, Hello
from transport.pending import BusFuture, PendingRequest, PendingTable, Reply, forbid_blocking
from transport.security import Security, SecurityError, ZapService, user_id
from transport.sockets import (
    Channel,
    Ctx,
    Peer,
    Sock,
    SocketOptions,
    error_of,
    handshake_refusal,
    make_dealer,
    make_router,
    monitor_event,
    raise_if_error,
)

if TYPE_CHECKING:
    from config.settings import Settings
    from transport.capture import CaptureWriter, RecordKind

log = logging.getLogger(__name__)

# ("r", router index, routing id) for a connection that came in on a bound ROUTER;
# ("d", peer name) for a connection this node opened.
Route = tuple[Any, ...]

DEFAULT_TIMEOUT = 30.0
_SEQ_TRACKED = 4096  # (src, dst) pairs whose sequence numbers are remembered for gap detection


@dataclass(frozen=True, slots=True)
class Inbound:
    """What lands in an actor's mailbox: the decoded header, the still-encoded body, the way back."""

    header: Header
    body: bytes
    route: Route | None


# A local message every BusActor answers with None once everything before it in its mailbox is handled.
BARRIER = object()


class ActorRefLike(Protocol):
    def tell(self, message: Any) -> None: ...

    def stop(self, block: bool = ..., timeout: float | None = ...) -> Any: ...


class Stats:
    """Counters a test or an operator can read: drops by reason, hops, gaps. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def __getitem__(self, name: str) -> int:
        return self._c[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


class Node:
    """One process's bus endpoint; see the module docstring. Use as a context manager or start()/stop()."""

    def __init__(
        self,
        name: str,
        *,
        bind: Iterable[str] = (),
        peers: Iterable[Peer] = (),
        security: Security | None = None,
        registry: Registry | None = None,
        options: SocketOptions | None = None,
        context: Ctx | None = None,
        request_timeout: float = DEFAULT_TIMEOUT,
        max_header_bytes: int = MAX_HEADER_BYTES,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        ids: Callable[[], bytes] = new_id,
        capture: CaptureWriter | None = None,
    ) -> None:
        if not is_node_name(name):
            raise ValueError(f"not a node name: {name!r}")
        self.name = name
        self.registry = registry or Registry(SYSTEM_MESSAGES)
        self.security = security or Security()
        self.options = options or SocketOptions(max_message_bytes=self.registry.max_body_bytes + 65536)
        self.context: Ctx = context or zmq.Context.instance()
        self.request_timeout = request_timeout
        self.max_header_bytes = max_header_bytes
        self.clock = clock
        self.monotonic = monotonic
        self.ids = ids
        self.capture = capture
        self.stats = Stats()
        self.pending = PendingTable(monotonic)
        self._binds = tuple(bind)
        self._peers: dict[str, Peer] = {p.name: p for p in peers}
        self._actors: dict[str, ActorRefLike] = {}
        self._tell_error_listeners: list[Callable[[BusError, bytes | None], None]] = []
        self._outbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._tls = threading.local()
        self._channels: list[Channel] = []
        self._channels_lock = threading.Lock()
        self._io: _IoThread | None = None
        self._running = False
        self.endpoints: tuple[str, ...] = ()

    # ------------------------------------------------------------------------------------ lifecycle
    @classmethod
    def from_settings(cls, settings: Settings, *, registry: Registry | None = None, **kwargs: Any) -> Node:
        """A node as a config file describes it (actors are spawned by the caller)."""
        from transport.capture import CaptureWriter
        from transport.security import KeyPair

        sec = settings.security
        node = settings.node
        registry = registry or Registry(SYSTEM_MESSAGES, max_body_bytes=node.max_frame_bytes)
        security = Security(
            keys=KeyPair.load(sec.secret_key_file) if sec.secret_key_file else None,
            allow={c.public_key: c.node for c in sec.allow},
            plain_insecure_for_benchmarks=sec.mode == "plain-insecure-for-benchmarks",
        )
        capture = kwargs.pop("capture", None)
        if capture is None and node.capture is not None:
            capture = CaptureWriter(node.capture, node=node.name, schema=registry.schema_hash())
        return cls(
            node.name,
            bind=node.bind,
            peers=[Peer(p.name, p.endpoint, p.public_key) for p in settings.peers],
            security=security,
            registry=registry,
            options=SocketOptions(
                max_message_bytes=node.max_frame_bytes + 65536,
                sndhwm=node.sndhwm,
                rcvhwm=node.rcvhwm,
                heartbeat_ivl_ms=node.heartbeat_ivl_ms,
                heartbeat_timeout_ms=node.heartbeat_timeout_ms,
            ),
            request_timeout=node.request_timeout,
            max_header_bytes=node.max_header_bytes,
            capture=capture,
            **kwargs,
        )

    def start(self, timeout: float = 10.0) -> Node:
        if self._io is not None:
            raise RuntimeError(f"node {self.name} already started")
        if any(self.security.uses_curve(e) for e in self._binds):
            # Fail closed: a CURVE server without a running ZAP handler would accept any client key.
            if self.security.keys is None:
                raise SecurityError(f"node {self.name}: a CURVE bind needs this node's key pair")
            ZapService.register(self.context, self.name, self.security.allow)
        self._io = _IoThread(self)
        self._io.start()
        if not self._io.ready.wait(timeout):
            raise RuntimeError(f"node {self.name}: I/O thread did not start within {timeout}s")
        if self._io.failure is not None:
            failure = self._io.failure
            self._io.join(timeout)
            self._io = None
            ZapService.unregister(self.context, self.name)
            raise failure
        self._running = True
        for peer in self._peers.values():
            self._outbox_put(("connect", peer))
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop local actors, close every socket, fail what is still in flight with ``Unavailable``."""
        if not self._running:
            return
        self._running = False
        for key, ref in list(self._actors.items()):
            try:
                ref.stop(block=True, timeout=timeout)
            except Exception:  # an actor that is already dead or stuck must not stop the shutdown
                log.warning("node %s: actor %s did not stop cleanly", self.name, key, exc_info=True)
        self._actors.clear()
        io = self._io
        if io is not None:
            self._outbox_put(("stop",))
            io.join(timeout)
            if io.is_alive():
                log.error("node %s: I/O thread did not stop within %ss", self.name, timeout)
        self._io = None
        with self._channels_lock:
            channels, self._channels = self._channels, []
        # Shutdown only: the owning threads are done with them (the node no longer runs).
        for channel in channels:
            channel.close()
        self.pending.fail_all(Unavailable(f"node {self.name} stopped"))
        ZapService.unregister(self.context, self.name)
        if self.capture is not None:
            self.capture.close()

    def __enter__(self) -> Node:
        if self._io is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._running

    # ------------------------------------------------------------------------------------ topology
    def connect(self, peer: Peer, *, wait: float | None = None) -> None:
        """Open (or replace) the connection to ``peer``; with ``wait``, block until its handshake."""
        if not is_node_name(peer.name):
            raise ValueError(f"not a node name: {peer.name!r}")
        self._peers[peer.name] = peer
        if self._io is not None:
            event = threading.Event()
            self._outbox_put(("connect", peer, event))
            if wait is not None:
                forbid_blocking("Node.connect(wait=...)")
                if not event.wait(wait):
                    raise NotDelivered(f"no handshake with {peer.name} at {peer.endpoint} within {wait}s")

    def peers(self) -> dict[str, Peer]:
        return dict(self._peers)

    def spawn(self, actor_class: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        """Start ``actor_class(node, address, *args, **kwargs)`` and address it as ``node/name``."""
        address = Address.parse(f"{self.name}/{name}")
        if name in self._actors:
            raise ValueError(f"{address} exists already")
        ref = actor_class.start(self, str(address), *args, **kwargs)
        self._actors[name] = ref
        return ref

    def register(self, name: str, ref: ActorRefLike) -> None:
        self._actors[name] = ref

    def unregister(self, name: str, ref: object | None = None) -> None:
        if ref is None or self._actors.get(name) is ref:
            self._actors.pop(name, None)

    def lookup(self, name: str) -> ActorRefLike | None:
        return self._actors.get(name)

    def actors(self) -> tuple[str, ...]:
        return tuple(self._actors)

    # ----------------------------------------------------------------------------------- client API
    def client_address(self) -> str:
        """The address a plain (non-actor) thread sends from; errors to its tells come back here."""
        src: str | None = getattr(self._tls, "src", None)
        if src is None:
            src = self._tls.src = f"{self.name}/client.{threading.get_ident()}"
        return src

    def header(
        self,
        kind: str,
        src: str,
        dst: str,
        flow: Flow,
        *,
        corr: bytes | None = None,
        timeout: float | None = None,
        conv: str | None = None,
        turn: str | None = None,
        idem: str | None = None,
        attempt: int = 1,
        cause: bytes | None = None,
    ) -> Header:
        now = self.clock()
        return Header(
            id=self.ids(),
            kind=kind,
            src=src,
            dst=dst,
            flow=flow,
            ts=now,
            seq=self._next_seq(src, dst) if flow in ("ask", "stream", "tell") else 0,
            corr=corr,
            cause=cause,
            conv=conv,
            turn=turn,
            idem=idem,
            attempt=attempt,
            deadline=None if timeout is None else now + timeout,
        )

    def _next_seq(self, src: str, dst: str) -> int:
        # Per (src, dst): src is a thread (client) or an actor (one thread), so a thread-local table is
        # exact without a lock.
        table: dict[tuple[str, str], int] | None = getattr(self._tls, "seq", None)
        if table is None:
            table = self._tls.seq = {}
        n = table.get((src, dst), 0) + 1
        table[(src, dst)] = n
        return n

    def request(self, dst: str, message: Any, *, timeout: float | None = None, **fields: Any) -> Any:
        """Send ``message`` to actor ``dst`` and block for its reply (raises the typed error instead)."""
        forbid_blocking("Node.request()")
        timeout = self.request_timeout if timeout is None else timeout
        peer = self._peers.get(node_of(dst))
        if peer is None or node_of(dst) == self.name:
            return self.request_future(dst, message, timeout=timeout, **fields).result(timeout + 1.0)
        reply: Any = None
        for reply in self._channel_call(peer, dst, message, "ask", timeout, fields):
            pass
        return reply

    def stream(self, dst: str, message: Any, *, timeout: float | None = None, **fields: Any) -> Iterator[Any]:
        """Send a streamed request; yield each partial reply, then the final one. ``timeout`` bounds all."""
        forbid_blocking("Node.stream()")
        timeout = self.request_timeout if timeout is None else timeout
        peer = self._peers.get(node_of(dst))
        if peer is None or node_of(dst) == self.name:
            yield from self.request_future(dst, message, timeout=timeout, stream=True, **fields).parts(
                timeout
            )
            return
        yield from self._channel_call(peer, dst, message, "stream", timeout, fields)

    def _channel_call(
        self, peer: Peer, dst: str, message: Any, flow: Flow, timeout: float, fields: dict[str, Any]
    ) -> Iterator[Any]:
        if not self._running:
            raise Unavailable(f"node {self.name} is not running")
        channels: dict[str, Channel] | None = getattr(self._tls, "channels", None)
        if channels is None:
            channels = self._tls.channels = {}
        channel = channels.get(peer.name)
        if channel is None or channel.closed or channel.peer != peer:
            if channel is not None:
                channel.close()
            channel = Channel(
                self.context, peer, self.options, self.security, self.registry, self.monotonic,
                self.stats.incr,
            )
            channels[peer.name] = channel
            with self._channels_lock:
                self._channels.append(channel)
        src = self.client_address()
        header = self.header(self.registry.tag_of(message), src, dst, flow, timeout=timeout, **fields)
        frames = [encode_header(header), self.registry.encode(message)]
        self.record("send", src, frames)
        for reply, body in channel.call(header, frames, self.monotonic() + timeout):
            self.record("deliver", src, [encode_header(reply), body])
            yield raise_if_error(self.registry, reply, body)

    def request_future(
        self, dst: str, message: Any, *, timeout: float | None = None, stream: bool = False, **fields: Any
    ) -> BusFuture:
        """Send a request; the returned future resolves with the reply or the typed error."""
        timeout = self.request_timeout if timeout is None else timeout
        future = BusFuture()
        src = fields.pop("src", None) or self.client_address()

        def deliver(reply: Reply) -> None:
            if reply.final:
                future._finish(reply)
            else:
                future._part(reply.message)

        header = self.header(
            self.registry.tag_of(message), src, dst, "stream" if stream else "ask", timeout=timeout, **fields
        )
        future.request_id = header.id
        future._on_cancel = lambda: self.pending.discard(header.id)
        self.send(header, self.registry.encode(message), deliver=deliver, timeout=timeout)
        return future

    def tell(self, dst: str, message: Any, *, src: str | None = None, **fields: Any) -> bytes:
        """One-way send; returns the message id. A handler error comes back as a tell error (see
        ``on_tell_error``); delivery failures known at once are reported the same way."""
        src = src or self.client_address()
        header = self.header(self.registry.tag_of(message), src, dst, "tell", **fields)
        self.send(header, self.registry.encode(message))
        return header.id

    def on_tell_error(self, callback: Callable[[BusError, bytes | None], None]) -> None:
        """Call ``callback(error, tell_id)`` for errors coming back to this node's client threads."""
        self._tell_error_listeners.append(callback)

    # --------------------------------------------------------------------------------------- routing
    def record(self, at: RecordKind, actor: str, frames: list[bytes]) -> None:
        if self.capture is not None:
            self.capture.record(at, actor, frames)

    def now(self, actor: str) -> float:
        """The wall clock as ``actor`` sees it: captured as a ``clock`` record, served from it on replay."""
        t = self.clock()
        if self.capture is not None:
            self.capture.record("clock", actor, [repr(t).encode()])
        return t

    def effect(self, actor: str, key: bytes, produce: Callable[[], bytes]) -> bytes:
        """Run a non-deterministic input (a provider or tool result) and capture it; replay serves it."""
        value = produce()
        if self.capture is not None:
            self.capture.record("effect", actor, [key, value])
        return value

    def send(
        self,
        header: Header,
        body: bytes,
        *,
        deliver: Callable[[Reply], None] | None = None,
        timeout: float | None = None,
        route: Route | None = None,
    ) -> None:
        """Send one envelope from any thread. For a request, ``deliver`` receives each reply (or the
        terminal error) on whichever thread resolves it; it must not block."""
        frames = [encode_header(header), body]
        self.record("send", header.src, frames)
        dst_node = node_of(header.dst)
        if deliver is not None:
            deadline = self.monotonic() + (self.request_timeout if timeout is None else timeout)
            self.pending.add(PendingRequest(header.id, dst_node, deadline, deliver, header.flow == "stream"))
            io = self._io
            if io is not None and deadline < io.poll_until:
                io.wake()  # the I/O thread sleeps past this deadline: let it re-arm its timer
        if not self._running:
            self._fail_send(header, NotDelivered(f"node {self.name} is not running"))
            return
        if header.is_reply and route is not None:
            self._outbox_put(("reply", route, frames, header))
        elif dst_node == self.name:
            self.deliver_local(header, body)
        else:
            self._outbox_put(("send", dst_node, frames, header))

    def deliver_local(self, header: Header, body: bytes, route: Route | None = None) -> None:
        """Route one envelope that arrived for this node (from a socket or from a local sender)."""
        if header.is_reply:
            self.pending.resolve(header.corr or b"", self.reply_of(header, body))
            return
        actor_key = header.dst.partition("/")[2]
        ref = self._actors.get(actor_key)
        if ref is None:
            if header.kind == ErrorReply.TAG and actor_key.startswith("client."):
                self._client_tell_error(header, body)
                return
            self.stats.incr("not_delivered")
            self._fail_send(header, NotDelivered(f"no actor {header.dst}"), route)
            return
        try:
            ref.tell(Inbound(header, body, route))
        except Exception:  # pykka.ActorDeadError: it stopped between lookup and tell
            self.unregister(actor_key, ref)
            self._fail_send(header, NotDelivered(f"actor {header.dst} has stopped"), route)

    def reply_of(self, header: Header, body: bytes) -> Reply:
        try:
            message = self.registry.decode(header.kind, body)
        except ProtocolError as exc:
            return Reply(None, exc, header.flow == "reply", header)
        if isinstance(message, ErrorReply):
            return Reply(None, self.registry.rebuild_error(message), True, header)
        return Reply(message, None, header.flow == "reply", header)

    def _client_tell_error(self, header: Header, body: bytes) -> None:
        error = error_of(self.registry, header, body) or ProtocolError("empty tell error")
        self.stats.incr("tell_errors")
        if not self._tell_error_listeners:
            log.warning("node %s: tell %s failed: %r", self.name, (header.corr or b"").hex(), error)
        for listener in list(self._tell_error_listeners):
            try:
                listener(error, header.corr)
            except Exception:
                log.exception("tell-error listener failed")

    def _fail_send(self, header: Header, error: BusError, route: Route | None = None) -> None:
        """A send that is known to have failed: the request's waiter or the tell's sender hears of it."""
        if header.is_request and header.id in self.pending:
            self.pending.resolve(header.id, Reply(None, error, True))
        elif header.is_request or header.flow == "tell":
            if header.kind == ErrorReply.TAG:
                self.stats.incr("dropped_error_reports")  # never answer an error with an error
                return
            reply = self.header(
                ErrorReply.TAG, f"{self.name}/node", header.src,
                "reply" if header.is_request else "tell", corr=header.id,
            )
            self.send(reply, self.registry.encode(self.registry.error_reply(error)), route=route)
        else:
            self.stats.incr("dropped_replies")

    def _outbox_put(self, item: tuple[Any, ...]) -> None:
        self._outbox.put(item)
        io = self._io
        if io is not None:
            self.stats.incr("hops_to_io")
            io.wake()

    def call_in_io_thread(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Run ``fn`` on the I/O thread (for tests and diagnostics) and return its result."""
        forbid_blocking("Node.call_in_io_thread()")
        future: BusFuture = BusFuture()
        self._outbox_put(("call", fn, future))
        return future.result(timeout)


class _IoThread(threading.Thread):
    """Owns every socket of the node; see the Node docstring."""

    def __init__(self, node: Node) -> None:
        super().__init__(name=f"kbus-io-{node.name}", daemon=True)
        self.node = node
        self.ready = threading.Event()
        self.failure: BaseException | None = None
        self.poll_until = 0.0  # monotonic time the current poll may sleep until
        self.routers: list[tuple[Sock, bool]] = []  # (socket, uses CURVE)
        self.dealers: dict[str, tuple[Sock, Sock, Peer]] = {}  # peer -> (dealer, monitor, peer)
        self.connected: dict[str, threading.Event] = {}
        self.routes: dict[str, Route] = {}  # node name -> way back over an inbound connection
        self.seq_seen: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.poller = zmq.Poller()
        self._wake_r, self._wake_w = _wake_pair()

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\x01")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the thread is awake anyway

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> None:
        node = self.node
        try:
            endpoints = []
            for endpoint in node._binds:
                sock = make_router(node.context, endpoint, node.options, node.security, node.name)
                self.routers.append((sock, node.security.uses_curve(endpoint)))
                self.poller.register(sock, zmq.POLLIN)
                endpoints.append(str(sock.getsockopt_string(zmq.LAST_ENDPOINT)))
            node.endpoints = tuple(endpoints)
            self.poller.register(self._wake_r, zmq.POLLIN)
        except BaseException as exc:
            self.failure = exc
            self._close()
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop()
        except Exception:
            log.exception("node %s: I/O thread crashed", node.name)
            node.pending.fail_all(Unavailable(f"node {node.name}: I/O thread crashed"))
        finally:
            self._close()

    def _close(self) -> None:
        for sock, _ in self.routers:
            sock.close(0)
        for dealer, monitor, _ in self.dealers.values():
            with contextlib.suppress(zmq.ZMQError):
                dealer.disable_monitor()
            monitor.close(0)
            dealer.close(0)
        self.routers, self.dealers = [], {}
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _loop(self) -> None:
        node = self.node
        wake = self._wake_r
        while True:
            wait = node.pending.expire_due()
            timeout_ms = 1000 if wait is None else max(0, min(1000, int(wait * 1000) + 1))
            self.poll_until = node.monotonic() + timeout_ms / 1000
            for sock, _ in self.poller.poll(timeout_ms):
                if sock == wake:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake, 4096)
                elif isinstance(sock, zmq.Socket):
                    self._readable(sock)
            # Drain the outbox after every poll: a wake-up may have been merged with socket events.
            while True:
                try:
                    item = node._outbox.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "stop":
                    return
                self._command(item)

    def _readable(self, sock: Sock) -> None:
        for index, (router, curve) in enumerate(self.routers):
            if sock is router:
                self._drain_router(index, router, curve)
                return
        for name, (dealer, monitor, _peer) in list(self.dealers.items()):
            if sock is dealer:
                self._drain_dealer(name, dealer)
                return
            if sock is monitor:
                self._monitor(name, monitor)
                return

    # ----------------------------------------------------------------------------------- inbound
    def _drain_router(self, index: int, sock: Sock, curve: bool) -> None:
        # Up to 256 messages per wake-up: fewer polls under load, fair to the other sockets.
        for _ in range(256):
            # EVENTS, not recv-until-Again: raising zmq.Again costs more than the message itself.
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            auth: str | None = None
            if curve:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                try:
                    auth = user_id(frames[-1])
                except ProtocolError:
                    self.node.stats.incr("unauthenticated")
                    continue
                parts = [f.bytes for f in frames]
            else:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            if len(parts) != 4 or parts[1]:
                self.node.stats.incr("malformed")
                continue
            self._inbound(parts[2], parts[3], ("r", index, parts[0]), auth)

    def _drain_dealer(self, name: str, sock: Sock) -> None:
        for _ in range(256):
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            parts = sock.recv_multipart(zmq.NOBLOCK)
            if len(parts) != 3 or parts[0]:
                self.node.stats.incr("malformed")
                continue
            # The server's key was checked by the CURVE handshake: this connection speaks for `name`.
            self._inbound(parts[1], parts[2], ("d", name), f"peer:{name}")

    def _inbound(self, head: bytes, body: bytes, route: Route, auth: str | None) -> None:
        node = self.node
        try:
            header = decode_header(head, max_bytes=node.max_header_bytes)
        except ProtocolError as exc:
            # No trustworthy header: nobody to answer. Count it; the connection stays up.
            node.stats.incr("malformed")
            log.info("node %s: dropped a malformed frame: %s", node.name, exc)
            return
        src_node = node_of(header.src)
        if auth is not None:
            allowed = auth[5:] if auth.startswith("peer:") else node.security.node_for_key(auth)
            if allowed != src_node:
                node.stats.incr("spoofed")
                log.warning("node %s: dropped %s claiming src %s from key of %s",
                            node.name, header.kind, header.src, allowed)
                return
            header = header.with_auth(auth)
        elif header.auth is not None:
            header = header.with_auth(None)  # only the receiving node may stamp auth
        if header.seq:
            self._track_seq(header)
        if header.kind == Hello.TAG:
            self.routes[src_node] = route
            return
        if node_of(header.dst) != node.name:
            node.stats.incr("misrouted")
            node._fail_send(header, NotDelivered(f"{header.dst} is not on node {node.name}"), route)
            return
        if header.is_request and header.deadline is not None and header.deadline < node.clock():
            node.stats.incr("expired_on_arrival")
            return
        node.stats.incr("hops_to_actor")
        node.deliver_local(header, body, route)

    def _track_seq(self, header: Header) -> None:
        key = (header.src, header.dst)
        last = self.seq_seen.pop(key, None)
        if last is not None and header.seq != last + 1:
            self.node.stats.incr("seq_gaps")
            log.info("node %s: sequence gap %s -> %s from %s", self.node.name, last, header.seq, header.src)
        self.seq_seen[key] = header.seq
        if len(self.seq_seen) > _SEQ_TRACKED:
            self.seq_seen.popitem(last=False)

    # ---------------------------------------------------------------------------------- commands
    def _command(self, item: tuple[Any, ...]) -> None:
        op = item[0]
        if op == "send":
            self._send(item[1], item[2], item[3])
        elif op == "reply":
            self._reply(item[1], item[2], item[3])
        elif op == "connect":
            self._connect(item[1], item[2] if len(item) > 2 else None)
        elif op == "call":
            fn, future = item[1], item[2]
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _send(self, dst_node: str, frames: list[bytes], header: Header) -> None:
        node = self.node
        try:
            if dst_node in self.dealers:
                self.dealers[dst_node][0].send_multipart([b"", *frames], zmq.NOBLOCK)
            elif (route := self.routes.get(dst_node)) is not None:
                self._via_route(route, frames)
            else:
                node._fail_send(header, NotDelivered(f"no route to node {dst_node}"))
        except zmq.Again:
            node.stats.incr("not_delivered")
            node._fail_send(header, NotDelivered(f"node {dst_node}: not connected, or its queue is full"))
        except zmq.ZMQError as exc:
            node.stats.incr("not_delivered")
            node._fail_send(header, NotDelivered(f"node {dst_node}: {exc}"))

    def _via_route(self, route: Route, frames: list[bytes]) -> None:
        if route[0] == "r":
            self.routers[route[1]][0].send_multipart([route[2], b"", *frames], zmq.NOBLOCK)
        else:
            self.dealers[route[1]][0].send_multipart([b"", *frames], zmq.NOBLOCK)

    def _reply(self, route: Route, frames: list[bytes], header: Header) -> None:
        try:
            self._via_route(route, frames)
        except (zmq.ZMQError, KeyError, IndexError):
            # The requester is gone or not reading: its own deadline ends the request. Never block here.
            self.node.stats.incr("dropped_replies")

    def _connect(self, peer: Peer, event: threading.Event | None) -> None:
        node = self.node
        old = self.dealers.pop(peer.name, None)
        if old is not None:
            self.poller.unregister(old[0])
            self.poller.unregister(old[1])
            old[1].close(0)
            old[0].close(0)
            node.pending.fail_peer(peer.name, lambda e: Unavailable(f"connection to {peer.name} replaced"))
        try:
            dealer = make_dealer(node.context, peer, node.options, node.security)
        except SecurityError:
            log.exception("node %s: cannot connect to %s", node.name, peer.name)
            return
        monitor = dealer.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        dealer.connect(peer.endpoint)
        self.dealers[peer.name] = (dealer, monitor, peer)
        self.connected[peer.name] = event or threading.Event()
        self.poller.register(dealer, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)

    def _monitor(self, name: str, monitor: Sock) -> None:
        node = self.node
        while monitor.poll(0):
            event = monitor_event(monitor)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                dealer = self.dealers[name][0]
                hello = node.header(Hello.TAG, f"{node.name}/node", f"{name}/node", "tell")
                with contextlib.suppress(zmq.ZMQError):
                    dealer.send_multipart(
                        [b"", encode_header(hello), node.registry.encode(Hello(node=node.name))],
                        zmq.NOBLOCK,
                    )
                self.connected[name].set()
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected[name] = threading.Event()
                failed = node.pending.fail_peer(
                    name, lambda e: Unavailable(f"{name} disconnected with the request in flight")
                )
                node.stats.incr("peer_disconnects")
                log.info("node %s: lost %s (%d requests in flight)", node.name, name, failed)
            elif (why := handshake_refusal(event)) is not None:
                node.stats.incr("handshake_failures")
                log.warning("node %s: %s: %s", node.name, name, why)


def _wake_pair() -> tuple[int, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w
