"""A node: one process's bus endpoint. Routes envelopes between local actor mailboxes and peer nodes.

Threads and sockets:

- The **I/O thread** owns every bound ROUTER, every outbound DEALER and their monitors. It decodes headers
  (never bodies), authorises, and puts each inbound message straight into the target actor's mailbox.
- Other threads hand outbound frames to it through a queue plus an eventfd wake-up (one hop).
- A plain thread that *blocks* on a request to a peer uses its own ``Channel`` (fast path, no hop). Its
  tells take the same channel; a burst of them is coalesced into ``sys.batch`` frames (WIRE.md 7a) that
  the receiving node splits back into the tells, each with its own id and ``seq``, handed to the actor
  as one mailbox item (``InboundBatch``). The thread's next other send, or the I/O thread's timer
  ``tell_linger`` later, sends what a channel holds: order per (src, dst) is the order of the calls.
- Messages between actors of the same node never touch a socket. A message that is immutable all the way
  down (``Registry.shareable``) is handed over as it is, without an encode and a decode: sharing it is as
  isolated as a copy. One whose only mutable parts are JSON values (a tool call's arguments) is handed
  over as a copy of those values, taken at the send (``Registry.local_copy``). Any other message, and
  every message while the node captures, still goes as its encoded body, so capture sees the same bytes
  a socket would carry.

Delivery is at-most-once. Every request ends in exactly one terminal outcome: a reply, an application
error, ``NotDelivered`` (nothing ran), ``Unavailable`` (outcome unknown) or ``Expired``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pykka
import zmq

from transport.affinity import colocate, colocate_by_default, pin_io_threads
from transport.codec import (
    BATCH_ITEM_OVERHEAD,
    MAX_HEADER_BYTES,
    Registry,
    decode_header,
    encode_header,
    split_batch,
)
from transport.envelope import (
    FORMAT_VERSION,
    Address,
    Flow,
    Header,
    Inbound,
    InboundBatch,
    Route,
    TellBatch,
    is_node_name,
    new_id,
    node_of,
)
from transport.errors import BusError, NotDelivered, ProtocolError, Unavailable
from transport.io_thread import IoThread
from transport.logs import LogLimiter
from transport.messages import SYSTEM_MESSAGES, ActorStats, ErrorReply, NodeStats, Resolve, Resolved
from transport.pending import (
    BusFuture,
    PendingRequest,
    PendingTable,
    Reply,
    Timers,
    current_actor,
    forbid_blocking,
)
from transport.security import Security, SecurityError, ZapService
from transport.sockets import (
    Channel,
    Ctx,
    Peer,
    SocketOptions,
    error_of,
    raise_if_error,
)

if TYPE_CHECKING:
    from config.settings import Settings
    from transport.capture import CaptureWriter, RecordKind

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_TIMEOUT = 30.0
_SEQ_TRACKED = 4096  # (src, dst) pairs whose sequence numbers are remembered for gap detection
_SEQ_SENDERS = 16384  # (src, dst) pairs a thread numbers its sends for
_SEQ_FLOWS = frozenset(("ask", "stream", "tell"))  # the flows that carry a per-(src, dst) sequence number
MAX_HELD = 256  # tells a plain thread's channel holds for one batch frame at most (see _channel_tell)
_HELD_SLOTS = 3 * MAX_HELD  # Channel.held is flat: id, kind, body per tell
_NO_LANES: dict[str, Any] = {}  # a thread that has no lanes yet (read only)
TELL_LINGER = 0.001  # seconds: a tell this soon after the previous one on its channel is held
_new_header: Callable[[type[Header], tuple[Any, ...]], Header] = tuple.__new__


# A local message every BusActor answers with None once everything before it in its mailbox is handled.
BARRIER = object()


class ActorRefLike(Protocol):
    def tell(self, message: Any) -> None: ...

    def stop(self, block: bool = ..., timeout: float | None = ...) -> Any: ...


# Counters a ``sys.stats`` answer always names, 0 until something is counted: what hostile or lost input
# costs an operator to know about. Others (hops, fallbacks, ...) appear once counted.
STATS_ALWAYS: tuple[str, ...] = (
    "malformed",  # a frame whose header does not decode (or an envelope of the wrong shape)
    "spoofed",  # an authenticated key claiming a src of another node
    "unauthenticated",  # a CURVE frame without an authenticated key
    "misrouted",  # addressed to another node
    "not_delivered",  # no such actor, or a send that could not leave
    "expired_on_arrival",  # a request already past its deadline: dropped unanswered
    "dropped_replies",  # a reply nobody waits for (late, or to a request never sent)
    "dropped_error_reports",  # an error about an error: never answered
    "seq_gaps",
    "actor_input_failures",
    "answer_send_failures",
)


class _Lane:
    """A plain thread's way to one actor it has told before: the channel its tells take, cached (one per
    thread and destination; see ``Node._hold``)."""

    __slots__ = ("channel", "direct", "dst", "encode", "key", "peer", "seqs", "src")

    def __init__(
        self,
        channel: Channel,
        peer: Peer,
        direct: Peer | None,
        src: str,
        dst: str,
        seqs: dict[tuple[str, str], int],
        encode: Callable[[Any], bytes],
    ) -> None:
        self.channel = channel
        self.encode = encode  # a Registry.encoder() of the thread's own
        self.peer = peer
        self.direct = direct
        self.src = src
        self.dst = dst
        self.key = (src, dst)  # its entry in seqs
        self.seqs = seqs  # the thread's own per-(src, dst) numbering (Node._next_seq)

    def open(self, peers: dict[str, Peer]) -> bool:
        """Still the way for a request (which waits for the connection itself): open, same peer."""
        return not self.channel.closed and peers.get(self.peer.name) is self.peer


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


class ActorCounts:
    """One actor's bus counters, written by that actor's thread only (so no lock) and read by anyone."""

    __slots__ = ("failed", "handled")

    def __init__(self) -> None:
        self.handled = 0  # bus messages taken from the mailbox (requests, tells, replies' deliveries not)
        self.failed = 0  # of those, answered with an error (decode failure, a raised error, a bug)


def _mailbox_depth(ref: Any) -> int:
    """Items waiting in an actor's mailbox (pykka's SimpleQueue, or a direct actor's SocketInbox)."""
    inbox = getattr(ref, "actor_inbox", None)
    qsize = getattr(inbox, "qsize", None)
    try:
        return int(qsize()) if qsize is not None else 0
    except Exception:  # noqa: BLE001 - a gauge, never a reason to fail a stats answer
        return 0


def pick_direct(peer: Peer, endpoints: Iterable[str]) -> Peer | None:
    """The direct endpoint reachable the way ``peer`` is: same transport; for tcp, the host we already use."""
    scheme = peer.endpoint.partition("://")[0]
    for endpoint in endpoints:
        if not endpoint.startswith(scheme + "://"):
            continue
        if scheme == "tcp":
            host = peer.endpoint[6:].rpartition(":")[0]
            port = endpoint.rpartition(":")[2]
            endpoint = f"tcp://{host}:{port}"
        return Peer(peer.name, endpoint, peer.server_key)
    return None


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
        tell_linger: float = TELL_LINGER,
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
        self._batch_bytes = self.registry.max_body_bytes // 2  # what a batch of held tells may carry
        self.security = security or Security()
        self.options = options or SocketOptions(max_message_bytes=self.registry.max_body_bytes + 65536)
        self.context: Ctx = context or zmq.Context.instance()
        self.request_timeout = request_timeout
        self.tell_linger = tell_linger
        self.max_header_bytes = max_header_bytes
        self.clock = clock
        self.monotonic = monotonic
        self.ids = ids
        if capture is None:  # KBUS_CAPTURE=DIR: every node of the run captures to DIR/<name>.buslog
            from transport.capture import capture_from_env

            capture = capture_from_env(name, self.registry.schema_hash())
        self.capture = capture
        self.stats = Stats()
        # Lines hostile input can repeat (drops, refusals, handler errors) go through here: see logs.py.
        self.log_limit = LogLimiter(monotonic=monotonic)
        self.pending = PendingTable(monotonic, self.log_limit)
        self.timers = Timers(monotonic)
        self._binds = tuple(bind)
        self._peers: dict[str, Peer] = {p.name: p for p in peers}
        self._actors: dict[str, ActorRefLike] = {}
        self._direct: dict[str, tuple[str, ...]] = {}  # actor -> endpoints of its own socket
        self._counts: dict[str, ActorCounts] = {}  # actor -> its counters (sys.stats)
        self._tell_error_listeners: list[Callable[[BusError, bytes | None], None]] = []
        self._tls = threading.local()
        self._channels: list[Channel] = []
        self._channels_lock = threading.Lock()
        self._shared: dict[Hashable, Any] = {}  # see shared()
        self._shared_lock = threading.Lock()
        self._io: IoThread | None = None
        self._running = False
        self.endpoints: tuple[str, ...] = ()
        self.stuck: tuple[str, ...] = ()  # actors the last stop() left behind, stuck in a handler

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
        colocate(node.colocate_waits)  # process-wide (transport/affinity.py): the file's choice
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
        colocate_by_default()  # the bus threads' waits on one CPU, unless the process chose (affinity.py)
        pin_io_threads(self.context)
        if any(self.security.uses_curve(e) for e in self._binds):
            # Fail closed: a CURVE server without a running ZAP handler would accept any client key.
            if self.security.keys is None:
                raise SecurityError(f"node {self.name}: a CURVE bind needs this node's key pair")
            ZapService.register(self.context, self.name, self.security.allow)
        self._io = IoThread(self, self._binds)
        self._io.start()
        if not self._io.ready.wait(timeout):
            raise RuntimeError(f"node {self.name}: I/O thread did not start within {timeout}s")
        if self._io.failure is not None:
            failure = self._io.failure
            self._io.join(timeout)
            self._io = None
            ZapService.unregister(self.context, self.name)
            raise failure
        self.endpoints = self._io.endpoints
        self._running = True
        for endpoint in self.endpoints:
            self._warn_if_plain(endpoint, "listens on")
        for peer in self._peers.values():
            self._warn_if_plain(peer.endpoint, f"connects to {peer.name} at")
            self._outbox_put(("connect", peer))
        return self

    def _warn_if_plain(self, endpoint: str, what: str) -> None:
        if endpoint.startswith("tcp://") and not self.security.uses_curve(endpoint):
            log.warning(
                "node %s %s %s over PLAIN tcp: not encrypted, not authenticated (security mode %s)",
                self.name,
                what,
                endpoint,
                "plain-insecure-for-benchmarks",
            )

    def stop(self, timeout: float = 5.0) -> tuple[str, ...]:
        """Stop local actors, close every socket, fail what is still in flight with ``Unavailable``.

        Bounded: the actors are stopped in the order they were spawned, all within ``timeout`` seconds
        (each gets what is left of it, and at least 0.2 s). An actor stuck in a handler is left behind, said
        in one line; the addresses of those are returned (also in ``stuck``). Its thread cannot be ended
        from outside: ``kbus node`` then exits the process anyway.
        """
        if not self._running:
            return ()
        self._running = False
        deadline = self.monotonic() + timeout
        with self._channels_lock:
            channels = list(self._channels)
        for channel in channels:  # tells still held leave first (bounded: an owner mid-call keeps its lock)
            if channel.held_head is not None and channel.lock.acquire(timeout=0.5):
                try:
                    self._flush_held(channel)
                finally:
                    channel.lock.release()
        stuck: list[str] = []
        for key, ref in list(self._actors.items()):
            wait = max(0.2, deadline - self.monotonic())
            try:
                ref.stop(block=True, timeout=wait)
            except pykka.Timeout:  # busy in a handler that does not return: left behind, said in one line
                stuck.append(f"{self.name}/{key}")
                log.warning("node %s: actor %s still busy after %.1fs: left behind", self.name, key, timeout)
            except Exception:  # an actor that is already dead or stuck must not stop the shutdown
                log.warning("node %s: actor %s did not stop cleanly", self.name, key, exc_info=True)
        self._actors.clear()
        self.stuck = tuple(stuck)
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
        self.log_limit.flush()
        return self.stuck

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
            self._warn_if_plain(peer.endpoint, f"connects to {peer.name} at")
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

    def actor_counts(self, name: str) -> ActorCounts:
        """The counters of actor ``name`` (a ``BusActor`` takes them at its start; kept after it stops)."""
        counts = self._counts.get(name)
        if counts is None:
            counts = self._counts[name] = ActorCounts()
        return counts

    def stats_report(self) -> NodeStats:
        """The answer to ``sys.stats``: the node's counters and, per running actor, its own."""
        counters = dict.fromkeys(STATS_ALWAYS, 0)
        counters.update(self.stats.snapshot())
        counters["pending_requests"] = len(self.pending)
        actors = []
        for name, ref in list(self._actors.items()):
            counts = self._counts.get(name) or ActorCounts()
            actors.append(
                ActorStats(
                    actor=name, handled=counts.handled, failed=counts.failed, mailbox=_mailbox_depth(ref)
                )
            )
        return NodeStats(node=self.name, counters=counters, actors=tuple(actors))

    def lookup(self, name: str) -> ActorRefLike | None:
        return self._actors.get(name)

    def peer(self, name: str) -> Peer | None:
        """The peer ``connect`` made for node ``name``, if any (the entry changes when it reconnects)."""
        return self._peers.get(name)

    def own_lanes(self, lanes: Any, old: Any = None) -> None:
        """Make ``lanes`` (a mailbox with lanes, transport/inbox.py) the calling thread's way out for its
        remote sends; ``None`` ends it (only while ``old`` is the thread's)."""
        if lanes is None:
            if getattr(self._tls, "actor_lanes", None) is old:
                self._tls.actor_lanes = None
        else:
            self._tls.actor_lanes = lanes

    def shared(self, key: Hashable, make: Callable[[], _T]) -> _T:
        """The node's one value for ``key``, made by ``make()`` the first time any thread asks (once, however
        many ask at the same moment). For the layers above that keep per-node state many threads reach (the
        host pools in ``actors/base.py``): the lock such state needs is plumbing, so it lives here and the
        actors stay lock-free (MB-01). ``make`` runs under that lock: keep it short, and never call
        ``shared`` from inside it."""
        with self._shared_lock:
            try:
                return self._shared[key]  # type: ignore[no-any-return]
            except KeyError:
                value = self._shared[key] = make()
                return value

    def actors(self) -> tuple[str, ...]:
        return tuple(self._actors)

    # ----------------------------------------------------------------------------------- client API
    def client_address(self, *, via_node: bool = False) -> str:
        """The address a plain (non-actor) thread sends from; errors to its tells come back here.

        A thread has two ordered streams: its blocking calls and tells go over its own connection,
        its futures through the node's I/O thread. Each stream is its own sender (FIFO holds within
        each, MB-05), so the futures stream has its own address.
        """
        key = "src_node" if via_node else "src"
        src: str | None = getattr(self._tls, key, None)
        if src is None:
            src = f"{self.name}/client.{threading.get_ident()}{'.f' if via_node else ''}"
            setattr(self._tls, key, src)
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
        # Positional, straight into the tuple: Header(...) with keywords costs twice as much, on a path
        # every message takes. The order is Header's field order (codec.py checks it at import).
        return _new_header(
            Header,
            (
                self.ids(),
                kind,
                src,
                dst,
                flow,
                now,
                self._next_seq(src, dst) if flow in _SEQ_FLOWS else 0,
                corr,
                cause,
                conv,
                turn,
                idem,
                attempt,
                None if timeout is None else now + timeout,
                None,
                FORMAT_VERSION,
            ),
        )

    def _next_seq(self, src: str, dst: str) -> int:
        # Per (src, dst): src is a thread (client) or an actor (one thread), so a thread-local table is
        # exact without a lock.
        table: dict[tuple[str, str], int] | None = getattr(self._tls, "seq", None)
        if table is None:
            table = self._tls.seq = {}
        n = table.get((src, dst), 0) + 1
        table[(src, dst)] = n
        if len(table) > _SEQ_SENDERS:
            # Bounded: hostile peers can make a node answer many made-up addresses. The oldest pair forgets
            # its count (its receiver may note one sequence gap).
            del table[next(iter(table))]
        return n

    def request(self, dst: str, message: Any, *, timeout: float | None = None, **fields: Any) -> Any:
        """Send ``message`` to actor ``dst`` and block for its reply (raises the typed error instead)."""
        if not fields:
            # A plain thread asking an actor it has asked or told before: its lane (no lookups).
            lanes: dict[str, _Lane] | None = getattr(self._tls, "lanes", None)
            if lanes is not None:
                lane = lanes.get(dst)
                if lane is not None and self._running and lane.open(self._peers):
                    return self._lane_ask(lane, message, self.request_timeout if timeout is None else timeout)
        forbid_blocking("Node.request()")
        timeout = self.request_timeout if timeout is None else timeout
        peer = self._peers.get(node_of(dst))
        if peer is None or node_of(dst) == self.name:
            return self.request_future(dst, message, timeout=timeout, **fields).result(timeout + 1.0)
        reply = self._channel_ask(peer, dst, message, timeout, fields)
        self._make_lane(peer, dst)
        return reply

    def _lane_ask(self, lane: _Lane, message: Any, timeout: float) -> Any:
        """``_channel_ask`` over a known lane: the same frames and outcomes, with what is known reused."""
        self._flush_mine()
        now = self.monotonic()
        deadline = now + timeout
        body = self.registry.encode(message)  # raises for what is not a registered message
        src, dst = lane.src, lane.dst
        key = (src, dst)
        seqs = lane.seqs
        seq = seqs.get(key, 0) + 1
        seqs[key] = seq
        wall = self.clock()
        deadline_at = wall + timeout
        # Positional, in Header's field order (see header()); no fields beyond the defaults.
        slots = (self.ids(), message.TAG, src, dst, "ask", wall, seq, None, None, None, None, None, 1)
        header = _new_header(Header, (*slots, deadline_at, None, FORMAT_VERSION))
        frames = [encode_header(header), body]
        capture = self.capture
        if capture is not None:
            capture.record("send", src, frames)
        channel = lane.channel
        try:
            channel.send(frames, min(deadline, now + 1.0) if lane.direct is not None else deadline)
        except NotDelivered:
            if lane.direct is None:
                raise
            # A stale direct endpoint: forget it and go through the node (nothing was sent: safe).
            self._tls.direct.pop(dst, None)
            self._tls.lanes.pop(dst, None)
            self.stats.incr("direct_fallbacks")
            channel = self._channel(lane.peer)
            channel.send(frames, deadline)
        reply, reply_body = channel.next_reply(header, deadline)
        if capture is not None:
            capture.record("deliver", src, [encode_header(reply), reply_body])
        return raise_if_error(self.registry, reply, reply_body)

    def _make_lane(self, peer: Peer, dst: str) -> None:
        """Remember this thread's way to ``dst`` (after a first send there resolved it)."""
        cache: dict[str, Peer | None] | None = getattr(self._tls, "direct", None)
        if cache is None or dst not in cache:
            return  # not resolved (the directory did not answer): the next call asks again
        lanes: dict[str, _Lane] | None = getattr(self._tls, "lanes", None)
        if lanes is None:
            lanes = self._tls.lanes = {}
        if dst in lanes:
            return
        if len(lanes) >= _SEQ_SENDERS:
            del lanes[next(iter(lanes))]
        direct = cache[dst]
        channel = self._channel(direct or peer)
        if not channel.closed:
            encode = self.registry.encoder()  # this thread's alone, as the lane is
            lanes[dst] = _Lane(channel, peer, direct, self.client_address(), dst, self._tls.seq, encode)

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
        self._flush_mine()
        deadline = self.monotonic() + timeout
        direct = self._direct_peer(peer, dst, deadline)
        if direct is not None:
            channel = self._channel(direct)
            try:
                # A direct socket that does not answer the handshake quickly is stale (its actor moved or
                # stopped): fall back to the node, which routes to the actor wherever it now is.
                yield from self._call_on(
                    channel,
                    dst,
                    message,
                    flow,
                    deadline,
                    fields,
                    connect_by=min(deadline, self.monotonic() + 1.0),
                )
                return
            except NotDelivered:
                self._tls.direct.pop(dst, None)
                self.stats.incr("direct_fallbacks")
        yield from self._call_on(self._channel(peer), dst, message, flow, deadline, fields)

    def _channel_ask(self, peer: Peer, dst: str, message: Any, timeout: float, fields: dict[str, Any]) -> Any:
        """``_channel_call`` for one plain reply, without generator layers (the hot path of the bench)."""
        if not self._running:
            raise Unavailable(f"node {self.name} is not running")
        self._flush_mine()
        deadline = self.monotonic() + timeout
        cache: dict[str, Peer | None] | None = getattr(self._tls, "direct", None)
        direct = cache.get(dst, peer) if cache is not None else peer
        if direct is peer or (cache is not None and dst not in cache):
            direct = self._direct_peer(peer, dst, deadline)
        src = self.client_address()
        header = self.header(self.registry.tag_of(message), src, dst, "ask", timeout=timeout, **fields)
        frames = [encode_header(header), self.registry.encode(message)]
        capture = self.capture
        if capture is not None:
            capture.record("send", src, frames)
        channel = self._channel(direct or peer)
        try:
            channel.send(frames, min(deadline, self.monotonic() + 1.0) if direct is not None else deadline)
        except NotDelivered:
            if direct is None:
                raise
            # A stale direct endpoint: forget it and go through the node (nothing was sent: safe).
            self._tls.direct.pop(dst, None)
            self.stats.incr("direct_fallbacks")
            channel = self._channel(peer)
            channel.send(frames, deadline)
        reply, body = channel.next_reply(header, deadline)
        if capture is not None:
            capture.record("deliver", src, [encode_header(reply), body])
        return raise_if_error(self.registry, reply, body)

    def _channel(self, peer: Peer) -> Channel:
        channels: dict[str, Channel] | None = getattr(self._tls, "channels", None)
        if channels is None:
            channels = self._tls.channels = {}
        channel = channels.get(peer.endpoint)
        if channel is None or channel.closed or (channel.peer is not peer and channel.peer != peer):
            if channel is not None:
                with channel.lock:  # tells it still holds leave (or are reported) before it closes
                    if not channel.closed:
                        self._flush_held(channel)
                    channel.close()
            channel = Channel(
                self.context,
                peer,
                self.options,
                self.security,
                self.registry,
                self.monotonic,
                self.stats.incr,
            )
            channel.on_tell = self._client_tell_error
            channels[peer.endpoint] = channel
            with self._channels_lock:
                self._channels.append(channel)
        return channel

    def _direct_peer(self, peer: Peer, dst: str, deadline: float) -> Peer | None:
        """The peer entry for ``dst``'s own socket, resolved once per thread (None: go via its node)."""
        cache: dict[str, Peer | None] | None = getattr(self._tls, "direct", None)
        if cache is None:
            cache = self._tls.direct = {}
        if dst in cache:
            return cache[dst]
        try:
            answer: Any = None
            for answer in self._call_on(  # noqa: B007 - the last reply is the answer
                self._channel(peer),
                f"{peer.name}/node",
                Resolve(actor=dst.partition("/")[2]),
                "ask",
                deadline,
                {},
            ):
                pass
        except BusError:
            return None  # not cached: the node path works, and the next call asks again
        cache[dst] = pick_direct(peer, answer.endpoints if isinstance(answer, Resolved) else ())
        return cache[dst]

    def _call_on(
        self,
        channel: Channel,
        dst: str,
        message: Any,
        flow: Flow,
        deadline: float,
        fields: dict[str, Any],
        connect_by: float | None = None,
    ) -> Iterator[Any]:
        src = self.client_address()
        header = self.header(
            self.registry.tag_of(message), src, dst, flow, timeout=deadline - self.monotonic(), **fields
        )
        frames = [encode_header(header), self.registry.encode(message)]
        if self.capture is not None:
            self.capture.record("send", src, frames)
        for reply, body in channel.call(header, frames, deadline, connect_by):
            if self.capture is not None:
                self.capture.record("deliver", src, [encode_header(reply), body])
            yield raise_if_error(self.registry, reply, body)

    def request_future(
        self, dst: str, message: Any, *, timeout: float | None = None, stream: bool = False, **fields: Any
    ) -> BusFuture:
        """Send a request; the returned future resolves with the reply or the typed error."""
        timeout = self.request_timeout if timeout is None else timeout
        future = BusFuture()
        src = fields.pop("src", None) or self.client_address(via_node=True)

        def deliver(reply: Reply) -> None:
            if reply.final or reply.error is not None:
                # A malformed partial ends the stream with its error rather than yielding a hole.
                future._finish(reply)
            else:
                future._part(reply.message)

        header = self.header(
            self.registry.tag_of(message), src, dst, "stream" if stream else "ask", timeout=timeout, **fields
        )
        future.request_id = header.id
        future._on_cancel = lambda: self.pending.discard(header.id)
        body, local = self.encode_for(dst, message)
        self.send(header, body, deliver=deliver, timeout=timeout, message=local)
        return future

    def tell(self, dst: str, message: Any, *, src: str | None = None, **fields: Any) -> bytes:
        """One-way send; returns the message id. A handler error comes back as a tell error (see
        ``on_tell_error``); delivery failures known at once are reported the same way."""
        if src is None and not fields:
            # A plain thread's next tell on a lane it has used, still the way (its channel open and
            # connected, its peer not replaced by ``connect``): straight to its channel (see _hold).
            lane = getattr(self._tls, "lanes", _NO_LANES).get(dst)
            if lane is not None and self._running:
                channel = lane.channel
                if channel.ready and not channel.closed and self._peers.get(lane.peer.name) is lane.peer:
                    return self._hold(lane, message)
        if src is None and current_actor() is None and self._running:
            peer = self._peers.get(node_of(dst))
            if peer is not None and peer.name != self.name:
                return self._channel_tell(peer, dst, message, fields)
        src = src or self.client_address()
        header = self.header(self.registry.tag_of(message), src, dst, "tell", **fields)
        body, local = self.encode_for(dst, message)
        self.send(header, body, message=local)
        return header.id

    def _channel_tell(self, peer: Peer, dst: str, message: Any, fields: dict[str, Any]) -> bytes:
        """A plain thread's tell goes over the same connection as its blocking requests: one FIFO stream
        per (thread, actor), so a tell is never overtaken by a later request (MB-05), and no hop. The
        first tell to ``dst`` (or one with header fields) goes at once and makes the thread a lane to
        ``dst`` for the next ones (``_hold``)."""
        self._flush_mine()
        registry = self.registry
        tell_id = self._tell_now(
            peer, dst, None, registry.tag_of(message), registry.encode(message), fields, True
        )
        self._make_lane(peer, dst)
        lane = self._tls.lanes.get(dst) if hasattr(self._tls, "lanes") else None
        if lane is not None:
            lane.channel.last_tell = self.monotonic()
        return tell_id

    def _hold(self, lane: _Lane, message: Any) -> bytes:
        """A tell over ``lane``: coalesced when it follows the channel's previous one within
        ``tell_linger``. What is held leaves as one ``sys.batch`` frame (WIRE.md 7a) when ``MAX_HELD`` are
        held, when this thread next sends anything else over the bus, or ``tell_linger`` after the first
        was held (then the I/O thread sends it, under the channel's lock). A tell after a pause leaves at
        once. Order and per-(src, dst) ``seq`` are those of the calls; capture records each tell."""
        now = self.monotonic()
        channel = lane.channel
        body = lane.encode(message)  # raises for what is not a registered message
        kind: str = message.TAG
        dst = lane.dst
        # Its share of the batch body's bound (held_bytes sums them): body, kind and BATCH_ITEM_OVERHEAD.
        cost = len(body) + len(kind) + BATCH_ITEM_OVERHEAD
        with channel.lock:
            head = channel.held_head
            if head is not None:
                if (
                    head.dst == dst
                    and len(channel.held) < _HELD_SLOTS
                    and channel.held_bytes + cost <= self._batch_bytes
                ):
                    channel.last_tell = now
                    seqs = lane.seqs
                    seq = seqs.get(lane.key, 0) + 1
                    seqs[lane.key] = seq
                    tell_id = self.ids()
                    channel.held += (tell_id, kind, body)
                    channel.held_bytes += cost
                    if self.capture is not None:
                        # The header split_batch rebuilds for it on the far side: the first held one's slots.
                        header = _new_header(
                            Header, (tell_id, kind, lane.src, dst, "tell", head.ts, seq, *head[7:])
                        )
                        self.capture.record("send", lane.src, [encode_header(header), body])
                    return tell_id
                self._flush_held(channel)
            recent = now - channel.last_tell < self.tell_linger
            channel.last_tell = now
            if not recent:
                return self._tell_now(lane.peer, dst, lane.direct, kind, body, {})
            header = self.header(kind, lane.src, dst, "tell")
            channel.hold(header, body, cost)
            channel.held_since = now
            if not channel.flush_due:
                # One timer a channel at a time: set while a burst goes on, it re-arms itself for each new
                # batch's own deadline (_flush_later) rather than being set again, so the I/O thread is
                # woken once a burst, not once a batch.
                channel.flush_due = True
                gen = channel.flush_gen
                self.call_at(now + self.tell_linger, lambda: self._flush_later(channel, gen))
            if self.capture is not None:
                self.capture.record("send", lane.src, [encode_header(header), body])
            return header.id

    def _tell_now(
        self,
        peer: Peer,
        dst: str,
        direct: Peer | None,
        kind: str,
        body: bytes,
        fields: dict[str, Any],
        resolve: bool = False,
    ) -> bytes:
        deadline = self.monotonic() + self.request_timeout
        if resolve:
            cache: dict[str, Peer | None] | None = getattr(self._tls, "direct", None)
            direct = (
                cache[dst] if cache is not None and dst in cache else self._direct_peer(peer, dst, deadline)
            )
        src = self.client_address()
        header = self.header(kind, src, dst, "tell", **fields)
        frames = [encode_header(header), body]
        if self.capture is not None:
            self.capture.record("send", src, frames)
        channel = self._channel(direct or peer)
        try:
            channel.tell(frames, min(deadline, self.monotonic() + 1.0) if direct is not None else deadline)
        except NotDelivered as exc:
            if direct is None:
                self._report_tell_error(exc, header.id)
                return header.id
            self._tls.direct.pop(dst, None)
            lanes: dict[str, _Lane] | None = getattr(self._tls, "lanes", None)
            if lanes is not None:
                lanes.pop(dst, None)
            self.stats.incr("direct_fallbacks")
            try:
                self._channel(peer).send(frames, deadline)
            except NotDelivered as again:
                self._report_tell_error(again, header.id)
        return header.id

    def _flush_held(self, channel: Channel) -> None:
        """Send the tells ``channel`` holds (the caller holds its lock); those that cannot leave are
        reported ``NotDelivered``, each by its own id."""
        if len(channel.held) > 3:
            self.stats.incr("tell_batches_sent")
        failed, error = channel.flush_held(self.ids())
        if error is not None:
            self.stats.incr("not_delivered", len(failed))
            for tell_id in failed:
                self._report_tell_error(error, tell_id)

    def _flush_mine(self) -> None:
        """Before this thread sends anything else: the tells its channels hold leave first (MB-05)."""
        channels: dict[str, Channel] | None = getattr(self._tls, "channels", None)
        if channels:
            for channel in channels.values():
                if channel.held_head is not None or channel.flush_due:
                    with channel.lock:
                        self._flush_held(channel)
                        # The channel's timer ends (_flush_later): this thread may now hold the lock for a
                        # whole blocking call, and nothing is held for the timer to send.
                        channel.flush_due = False
                        channel.flush_gen += 1

    def _flush_later(self, channel: Channel, gen: int) -> None:
        """The channel's timer, on the I/O thread: send what it holds once the first held tell is
        ``tell_linger`` old, unless its owner is using the socket (then the owner's own send flushes them
        first, or, if the owner was only adding a tell, this tries again shortly). What is younger (a batch
        begun after the one the timer was set for left) is left to fill: the timer is set again for that
        batch's own deadline. Nothing held: the timer ends; so does one whose ``gen`` the owner has moved
        on (``_flush_mine``: it sent what was held, and a later batch sets a timer of its own). Never
        blocks."""
        if not channel.lock.acquire(blocking=False):
            if channel.flush_gen == gen:  # read unlocked: at worst one more try, which then ends
                self.call_at(self.monotonic() + 0.0002, lambda: self._flush_later(channel, gen))
            return
        try:
            if channel.flush_gen != gen:
                return
            if channel.closed or channel.held_head is None:
                channel.flush_due = False
                return
            due = channel.held_since + self.tell_linger
            if self.monotonic() < due:
                self.call_at(due, lambda: self._flush_later(channel, gen))
                return
            channel.flush_due = False
            self._flush_held(channel)
        finally:
            channel.lock.release()

    def _report_tell_error(self, error: BusError, tell_id: bytes) -> None:
        self.stats.incr("tell_errors")
        if not self._tell_error_listeners:
            self.log_limit.log(
                log,
                logging.WARNING,
                ("tell_error", type(error)),
                "node %s: tell %s failed: %r",
                self.name,
                tell_id.hex(),
                error,
            )
        for listener in list(self._tell_error_listeners):
            try:
                listener(error, tell_id)
            except Exception:
                log.exception("tell-error listener failed")

    def on_tell_error(self, callback: Callable[[BusError, bytes | None], None]) -> None:
        """Call ``callback(error, tell_id)`` for errors coming back to this node's client threads.

        A plain thread's tells share its own connection to the peer, so an error the far side reports
        for one is read when that thread next uses the connection (its next tell or blocking call);
        delivery failures known at the send are reported at once.
        """
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

    def local_message(self, dst: str, message: Any, *, moved: bool = False) -> Any:
        """What a send to ``dst`` may hand over unencoded (``send(..., message=)``) when ``dst`` is on this
        node and the node does not capture: ``Registry.local_copy`` of ``message`` (itself, or a copy of its
        JSON values; ``moved``: itself). Otherwise None: the caller encodes the body."""
        if (
            self.capture is None
            and node_of(dst) == self.name
            and type(message) is not ErrorReply  # rebuilt into its error on arrival: always encoded
        ):
            return self.registry.local_copy(message, moved=moved)
        return None

    def encode_for(self, dst: str, message: Any, *, moved: bool = False) -> tuple[bytes, Any]:
        """The ``(body, message)`` pair ``send`` takes for ``message`` to ``dst``: ``(b"", message)`` when it
        may go unencoded (``local_message``), else ``(encoded body, None)``. Raises when it cannot travel."""
        local = self.local_message(dst, message, moved=moved)
        if local is not None:
            return b"", local
        return self.registry.encode(message), None

    def send(
        self,
        header: Header,
        body: bytes,
        *,
        deliver: Callable[[Reply], None] | None = None,
        timeout: float | None = None,
        route: Route | None = None,
        message: Any = None,
    ) -> None:
        """Send one envelope from any thread. For a request, ``deliver`` receives each reply (or the
        terminal error) on whichever thread resolves it; it must not block. ``message`` (with an empty
        ``body``) is a message ``local_message`` let go unencoded to an actor of this node."""
        if route is not None and route[0] == "self" and deliver is None and message is None:
            # An answer over a direct actor's own socket, from that actor's thread (its owner).
            frames = [encode_header(header), body]
            if self.capture is not None:
                self.capture.record("send", header.src, frames)
            if not self._running:
                self.fail_send(header, NotDelivered(f"node {self.name} is not running"))
            elif not route[2].send(route[1], frames):
                self.fail_send(header, NotDelivered(f"{header.dst}: connection gone"), None)
            return
        if timeout is not None and not math.isfinite(timeout):
            # A NaN or infinite wait would never expire, and a NaN at the head of the deadline heap would
            # stop every other request behind it from expiring (it once ended the I/O thread).
            raise ProtocolError(f"{header.kind}: a timeout must be a finite number of seconds: {timeout!r}")
        dst_node = node_of(header.dst)
        if message is not None and (dst_node != self.name or self.capture is not None):
            body, message = self.registry.encode(message), None  # not what local_message allows: encoded
        if message is None:
            frames = [encode_header(header), body]
            if self.capture is not None:
                self.capture.record("send", header.src, frames)
        if deliver is not None:
            deadline = self.monotonic() + (self.request_timeout if timeout is None else timeout)
            self.pending.add(PendingRequest(header.id, dst_node, deadline, deliver, header.flow == "stream"))
            io = self._io
            if io is not None and deadline < io.poll_until:
                io.wake()  # the I/O thread sleeps past this deadline: let it re-arm its timer
        if not self._running:
            self.fail_send(header, NotDelivered(f"node {self.name} is not running"))
            return
        if message is not None:
            self.deliver_local(header, body, message=message)
        elif route is not None and route[0] == "self":
            # Over a direct actor's own socket: this is that actor's thread, the socket's owner.
            if not route[2].send(route[1], frames):
                self.fail_send(header, NotDelivered(f"{header.dst}: connection gone"), None)
        elif header.is_reply and route is not None:
            self._outbox_put(("reply", route, frames, header))
        elif dst_node == self.name:
            self.deliver_local(header, body)
        else:
            lanes = getattr(self._tls, "actor_lanes", None)  # an actor thread's own (transport/inbox.py)
            if lanes is None or not lanes.lane_send(dst_node, header, frames):
                self._outbox_put(("send", dst_node, frames, header))

    def deliver_local(
        self, header: Header, body: bytes, route: Route | None = None, *, message: Any = None
    ) -> None:
        """Route one envelope that arrived for this node (from a socket or from a local sender; a local
        sender's ``message`` comes unencoded, see ``send``)."""
        if header.is_reply:
            reply = (
                self.reply_of(header, body)
                if message is None
                else Reply(message, None, header.flow == "reply", header)
            )
            self.pending.resolve(header.corr or b"", reply)
            return
        actor_key = header.dst.partition("/")[2]
        ref = self._actors.get(actor_key)
        if ref is None:
            if header.kind == ErrorReply.TAG and actor_key.startswith("client."):
                self._client_tell_error(header, body)
                return
            self.stats.incr("not_delivered")
            self.fail_send(header, NotDelivered(f"no actor {header.dst}"), route)
            return
        try:
            ref.tell(Inbound(header, body, route, message))
        except Exception:  # noqa: BLE001 - pykka.ActorDeadError: it stopped between lookup and tell
            self.unregister(actor_key, ref)
            self.fail_send(header, NotDelivered(f"actor {header.dst} has stopped"), route)

    def deliver_batch(self, actor_key: str, ref: ActorRefLike, batch: list[Inbound | TellBatch]) -> None:
        """Put messages that arrived together for one actor into its mailbox as one item (the actor's
        class takes ``InboundBatch``); if it has stopped, each one fails as ``deliver_local`` fails it."""
        try:
            ref.tell(batch[0] if len(batch) == 1 else InboundBatch(batch))
        except Exception:  # noqa: BLE001 - pykka.ActorDeadError: it stopped between lookup and tell
            self.unregister(actor_key, ref)
            for inbound in InboundBatch(batch):
                header = inbound.header
                self.fail_send(header, NotDelivered(f"actor {header.dst} has stopped"), inbound.route)

    def reply_of(self, header: Header, body: bytes) -> Reply:
        try:
            message = self.registry.decode(header.kind, body)
        except ProtocolError as exc:
            return Reply(None, exc, header.flow == "reply", header)
        if isinstance(message, ErrorReply):
            return Reply(None, self.registry.rebuild_error(message), True, header)
        return Reply(message, None, header.flow == "reply", header)

    def admit(
        self, head: bytes, auth: str | None, seq_seen: OrderedDict[tuple[str, str], int]
    ) -> Header | None:
        """The checks every inbound envelope passes, on whichever thread owns its socket.

        Decodes the header (never the body), checks that the authenticated identity may speak for the
        claimed ``src`` and stamps ``auth``, tracks sequence gaps, and drops requests already past their
        deadline. ``None`` means dropped (and counted): there is nobody trustworthy to answer.
        """
        try:
            header = decode_header(head, max_bytes=self.max_header_bytes)
        except ProtocolError as exc:
            self.stats.incr("malformed")
            self.log_limit.log(
                log, logging.INFO, "malformed", "node %s: dropped a malformed frame: %s", self.name, exc
            )
            return None
        if auth is not None:
            allowed = auth[5:] if auth.startswith("peer:") else self.security.node_for_key(auth)
            if allowed != node_of(header.src):
                self.stats.incr("spoofed")
                self.log_limit.log(
                    log,
                    logging.WARNING,
                    ("spoofed", allowed),
                    "node %s: dropped %s claiming src %s from key of %s",
                    self.name,
                    header.kind,
                    header.src,
                    allowed,
                )
                return None
            header = header.with_auth(auth)
        elif header.auth is not None:
            header = header.with_auth(None)  # only the receiving node may stamp auth
        if header.seq:
            key = (header.src, header.dst)
            last = seq_seen.pop(key, None)
            if last is not None and header.seq != last + 1:
                self.stats.incr("seq_gaps")
                self.log_limit.log(
                    log,
                    logging.INFO,
                    "seq_gap",
                    "node %s: sequence gap %s -> %s from %s",
                    self.name,
                    last,
                    header.seq,
                    header.src,
                )
            seq_seen[key] = header.seq
            if len(seq_seen) > _SEQ_TRACKED:
                seq_seen.popitem(last=False)
        if header.is_request and header.deadline is not None and header.deadline < self.clock():
            self.stats.incr("expired_on_arrival")
            return None
        return header

    def split_tells(
        self,
        header: Header,
        body: bytes,
        route: Route | None,
        seq_seen: OrderedDict[tuple[str, str], int],
    ) -> TellBatch | None:
        """The tells of an admitted ``sys.batch`` frame, in order, as one mailbox item (see
        ``codec.split_batch``), its last ``seq`` remembered for gap detection. A malformed or oversized
        batch is counted (``malformed_batches``) and answered to its sender as one error tell whose
        ``corr`` is the batch's id; None then (nothing of it is delivered)."""
        try:
            tells = split_batch(header, body, route, max_body_bytes=self.registry.max_body_bytes)
        except BusError as exc:
            self.stats.incr("malformed_batches")
            self.log_limit.log(
                log,
                logging.INFO,
                "malformed_batch",
                "node %s: refused a batch from %s: %s",
                self.name,
                header.src,
                exc,
            )
            self.fail_send(header, exc, route)
            return None
        self.stats.incr("tell_batches_received")
        if header.seq and len(tells) > 1:
            key = (header.src, header.dst)
            if key in seq_seen:
                seq_seen[key] = header.seq + len(tells) - 1
        return tells

    @property
    def directory_address(self) -> str:
        return f"{self.name}/node"

    def direct_endpoints(self, actor: str) -> tuple[str, ...]:
        """Endpoints where ``actor`` takes traffic on its own socket (empty: only via this node)."""
        return self._direct.get(actor, ())

    def publish_direct(self, actor: str, endpoints: tuple[str, ...]) -> None:
        if endpoints:
            self._direct[actor] = endpoints
        else:
            self._direct.pop(actor, None)

    def _client_tell_error(self, header: Header, body: bytes) -> None:
        if header.kind != ErrorReply.TAG:
            self.stats.incr("unsolicited")
            return
        error = error_of(self.registry, header, body) or ProtocolError("empty tell error")
        self._report_tell_error(error, header.corr or b"")

    def fail_send(self, header: Header, error: BusError, route: Route | None = None) -> None:
        """A send that is known to have failed: the request's waiter or the tell's sender hears of it."""
        if header.is_request and header.id in self.pending:
            self.pending.resolve(header.id, Reply(None, error, True))
        elif header.is_request or header.flow == "tell":
            if header.kind == ErrorReply.TAG:
                self.stats.incr("dropped_error_reports")  # never answer an error with an error
                return
            reply = self.header(
                ErrorReply.TAG,
                f"{self.name}/node",
                header.src,
                "reply" if header.is_request else "tell",
                corr=header.id,
            )
            self.send(reply, self.registry.encode_error(error), route=route)
        else:
            self.stats.incr("dropped_replies")

    def _outbox_put(self, item: tuple[Any, ...]) -> None:
        io = self._io
        if io is not None:  # else the node is not running: nothing would ever read it
            self.stats.incr("hops_to_io")
            io.put(item)

    def call_at(self, at: float, callback: Callable[[], None]) -> int:
        """Run ``callback`` on the I/O thread once ``self.monotonic() >= at`` (it must not block); returns
        a handle for ``cancel_call``. Nothing runs after the node stopped. ``at`` must be finite."""
        if not math.isfinite(at):
            raise ProtocolError(f"a timer must be set for a finite time, not {at!r}")
        handle = self.timers.add(at, callback)
        io = self._io
        if io is not None and at < io.poll_until:
            io.wake()  # the I/O thread sleeps past this time: let it re-arm
        return handle

    def cancel_call(self, handle: int) -> None:
        self.timers.cancel(handle)

    def call_in_io_thread(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Run ``fn`` on the I/O thread (for tests and diagnostics) and return its result."""
        forbid_blocking("Node.call_in_io_thread()")
        future: BusFuture = BusFuture()
        self._outbox_put(("call", fn, future))
        return future.result(timeout)
