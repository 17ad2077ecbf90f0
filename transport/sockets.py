"""Socket construction and the caller-owned channel used by blocking requests.

Every socket here is made, used and closed by one thread. ``Channel`` is the fast path: a plain thread
that blocks on a request owns a DEALER to the peer and waits on it itself, so the reply needs no hop
through the node's I/O thread (DESIGN.md §4: each hop costs ~15 µs).
"""

from __future__ import annotations

import contextlib
import logging
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq
from zmq.backend import zmq_poll as _zmq_poll
from zmq.utils.monitor import recv_monitor_message

from transport.codec import (
    BATCH_TAG,
    Registry,
    decode_header,
    encode_batch_body,
    encode_header,
)
from transport.envelope import Header, node_of
from transport.errors import BusError, Expired, NotDelivered, ProtocolError, Unavailable
from transport.messages import ErrorReply
from transport.records import frozen
from transport.security import Security, SecurityError, configure_client, configure_server

log = logging.getLogger(__name__)

Ctx = zmq.Context[zmq.Socket[bytes]]
Sock = zmq.Socket[bytes]

# Plain-int flags and the backend's own send/recv/get: pyzmq's sugar layer turns flags into enum.IntFlag
# values and loops in Python, which showed as ~10 µs per round trip on the hot path.
_BaseSocket = zmq.backend.Socket
POLLIN = int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | NOBLOCK


def readable(sock: Sock) -> bool:
    """A message is waiting (a zero-timeout zmq_poll: cheaper than reading EVENTS through pyzmq)."""
    return bool(_zmq_poll([(sock, POLLIN)], 0))


def send_frames(sock: Sock, frames: list[bytes]) -> None:
    """Non-blocking multipart send; raises zmq.Again (nothing sent) when the peer cannot take it."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _BaseSocket.send(sock, frame, _SNDMORE_NOBLOCK if i < last else NOBLOCK)


def send_envelope(sock: Sock, first: bytes, header: bytes, body: bytes) -> None:
    """``send_frames`` for the usual three frames (delimiter or routing id, header, body): no loop."""
    send = _BaseSocket.send
    send(sock, first, _SNDMORE_NOBLOCK)
    send(sock, header, _SNDMORE_NOBLOCK)
    send(sock, body, NOBLOCK)


def send_routed(sock: Sock, routing_id: bytes, header: bytes, body: bytes) -> None:
    """``send_frames`` for an answer on a ROUTER: routing id, delimiter, header, body; no loop."""
    send = _BaseSocket.send
    send(sock, routing_id, _SNDMORE_NOBLOCK)
    send(sock, b"", _SNDMORE_NOBLOCK)
    send(sock, header, _SNDMORE_NOBLOCK)
    send(sock, body, NOBLOCK)


def recv_frames(sock: Sock) -> list[bytes]:
    """Receive one multipart message that poll/EVENTS said is there."""
    parts = []
    while True:
        # Frame.more reads the message itself; asking the socket for RCVMORE costs more per part.
        frame: Any = _BaseSocket.recv(sock, NOBLOCK, copy=False)
        parts.append(frame.bytes)
        if not frame.more:
            return parts


_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
)


@frozen
class SocketOptions:
    max_message_bytes: int
    sndhwm: int = 1000
    rcvhwm: int = 1000
    heartbeat_ivl_ms: int = 1000
    heartbeat_timeout_ms: int = 5000


@frozen
class Peer:
    """A node this node connects to: its name, endpoint and (for CURVE) server public key."""

    name: str
    endpoint: str
    server_key: str | None = None


class BindError(Exception):
    """A node could not bind one of its endpoints (address in use, no permission, no such interface)."""


def _common(sock: Sock, endpoint: str, opts: SocketOptions) -> None:
    sock.linger = 0
    sock.sndhwm = opts.sndhwm
    sock.rcvhwm = opts.rcvhwm
    # A peer sending a frame past the limit is disconnected by libzmq before we ever see it.
    sock.maxmsgsize = opts.max_message_bytes
    if endpoint.startswith("tcp://") and opts.heartbeat_ivl_ms > 0:
        sock.heartbeat_ivl = opts.heartbeat_ivl_ms
        sock.heartbeat_timeout = opts.heartbeat_timeout_ms
        sock.heartbeat_ttl = opts.heartbeat_timeout_ms


def make_router(ctx: Ctx, endpoint: str, opts: SocketOptions, security: Security, domain: str) -> Sock:
    """A bound ROUTER: mandatory routing, no handover, CURVE where the security says so."""
    sock = ctx.socket(zmq.ROUTER)
    try:
        _common(sock, endpoint, opts)
        # Unroutable replies raise at once instead of vanishing; a second peer may not steal a routing id.
        sock.router_mandatory = 1
        sock.router_handover = 0
        if security.uses_curve(endpoint):
            configure_server(sock, security, domain)
        elif endpoint.startswith("tcp://") and not security.plain_insecure_for_benchmarks:
            raise SecurityError(f"{endpoint}: tcp without CURVE needs plain_insecure_for_benchmarks")
        if endpoint.startswith("ipc://"):
            _private_ipc_dir(endpoint)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise BindError(f"cannot bind {endpoint}: {exc.strerror}") from exc
        return sock
    except BaseException:
        sock.close(0)
        raise


def _private_ipc_dir(endpoint: str) -> None:
    """Make sure an ipc socket's folder is fit for it; raise ``SecurityError`` if not.

    A missing folder is created mode 0700 (each missing level), since ipc has no CURVE by default and the
    folder's mode is its lock. A folder that exists is never changed (it may be shared: ``/run``,
    ``/dev/shm``, a symlink to one). One that anyone may write into without the sticky bit is refused:
    another user could replace the socket. Linux's abstract names (``@name``) and ``*`` have no folder.
    """
    path = endpoint.removeprefix("ipc://")
    if path.startswith("@") or path == "*":
        return
    folder = Path(path).parent
    missing: list[Path] = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for level in reversed(missing):
        try:
            level.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made meanwhile by someone else: checked below like any existing folder
        except OSError as exc:
            raise SecurityError(f"{endpoint}: cannot create the socket's folder {level}: {exc}") from exc
    folder = Path(path).parent
    try:
        info = folder.stat()  # through a symlink: the folder the socket lands in
    except OSError as exc:
        raise SecurityError(f"{endpoint}: cannot read the socket's folder {folder}: {exc}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise SecurityError(f"{endpoint}: {folder} is not a folder")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise SecurityError(
            f"{endpoint}: the socket's folder {folder} is writable by anyone and has no sticky bit "
            "(another user could replace the socket): use a private folder"
        )


def make_dealer(ctx: Ctx, peer: Peer, opts: SocketOptions, security: Security) -> Sock:
    sock = ctx.socket(zmq.DEALER)
    try:
        _common(sock, peer.endpoint, opts)
        # Without a live connection a send fails at once (NotDelivered) instead of queueing forever.
        sock.immediate = 1
        if security.uses_curve(peer.endpoint):
            configure_client(sock, security, peer.server_key)
        return sock
    except BaseException:
        sock.close(0)
        raise


def monitor_event(monitor: Sock) -> int:
    msg: Any = recv_monitor_message(monitor)
    return int(msg["event"])


def handshake_refusal(event: int) -> str | None:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "the peer refused our key (authentication failed)"
    if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        return "the security handshake failed (wrong server key or mechanism?)"
    return None


class Channel:
    """A blocking caller's own DEALER to one peer. Owned by exactly one thread; never shared.

    A reply that does not answer the request in flight (a late reply to an earlier, expired request) is
    dropped and counted, never returned.
    """

    def __init__(
        self,
        ctx: Ctx,
        peer: Peer,
        opts: SocketOptions,
        security: Security,
        registry: Registry,
        monotonic: Callable[[], float],
        on_drop: Callable[[str], None],
    ) -> None:
        self.peer = peer
        self._registry = registry
        self._monotonic = monotonic
        self._on_drop = on_drop
        self._max_header = 8192
        self.sock = make_dealer(ctx, peer, opts, security)
        self.monitor = self.sock.get_monitor_socket(_MONITOR_EVENTS)
        try:
            self.sock.connect(peer.endpoint)
        except zmq.ZMQError as exc:  # an endpoint zmq refuses: nothing can be sent over it
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0)
            raise NotDelivered(f"cannot connect to {peer.name} at {peer.endpoint}: {exc.strerror}") from exc
        self._both = [(self.sock, POLLIN), (self.monitor, POLLIN)]
        # inproc has no ZMTP handshake, so no monitor event ever says it is ready: it is once connected.
        self.ready = peer.endpoint.startswith("inproc://")
        # Tells that come back over this connection (errors for tells sent on it) go here.
        self.on_tell: Callable[[Header, bytes], None] | None = None
        self.refusal: str | None = None
        self.closed = False
        # Tells held for one batch frame (WIRE.md 7a; Node._channel_tell decides what is held). Only the
        # owner thread adds to them; the owner, or the node's I/O thread when the owner has moved on,
        # sends them. Every use of the socket is under ``lock``: libzmq lets a socket move between threads
        # behind a full memory barrier, and a lock is one.
        self.lock = threading.RLock()
        self.held_head: Header | None = None  # the first held tell's header: the batch shares its slots
        self.held: list[Any] = []  # id, kind, body of each held tell, flat
        self.held_bytes = 0
        self.held_since = float("-inf")  # monotonic time the held batch's first tell was held
        self.flush_due = False  # the node's timer for this channel's held tells is set (Node._flush_later)
        self.flush_gen = 0  # moved on by the owner to end that timer (Node._flush_mine)
        self.last_tell = float("-inf")  # monotonic time of the last tell this channel took

    def hold(self, header: Header, body: bytes, cost: int) -> None:
        """Hold a tell (owner thread, under ``lock``): ``header`` is the first held one's or shares its
        slots but id, kind and seq (``split_batch`` rebuilds it so on the far side). ``cost`` is its share of
        the batch body's bound (``held_bytes``; see ``Node._hold``)."""
        if self.held_head is None:
            self.held_head = header
        self.held += (header.id, header.kind, body)
        self.held_bytes += cost

    def flush_held(self, batch_id: bytes) -> tuple[list[bytes], BusError | None]:
        """Send what is held (under ``lock``): one tell as it is, more as one ``sys.batch`` frame with id
        ``batch_id``. Returns the ids of the tells that could not leave and why (none: ``[], None``)."""
        head = self.held_head
        if head is None:
            return [], None
        items = self.held
        self.held_head, self.held, self.held_bytes = None, [], 0
        # Errors that came back for earlier tells, and monitor events, first (what Channel.tell did).
        for sock, _ in _zmq_poll(self._both, 0):
            if sock is self.sock:
                self.drain()
            else:
                while readable(self.monitor):
                    self._monitor()
        if len(items) == 3:
            frames = [encode_header(head), items[2]]
        else:
            frames = [encode_header(head._replace(id=batch_id, kind=BATCH_TAG)), encode_batch_body(items)]
        try:
            self._send(frames)
        except NotDelivered as exc:
            return list(items[0::3]), exc
        return [], None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0)

    def _monitor(self) -> bool:
        """Apply one monitor event; True when the connection dropped."""
        event = monitor_event(self.monitor)
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.ready, self.refusal = True, None
        elif event == zmq.EVENT_DISCONNECTED:
            self.ready = False
            return True
        elif (why := handshake_refusal(event)) is not None:
            self.ready, self.refusal = False, why
        return False

    def _wait_ready(self, deadline: float) -> None:
        """Wait for the handshake until ``deadline``; NotDelivered (nothing was sent) if it does not come."""
        # Apply events that arrived while idle (a drop, a reconnect) before deciding; EVENTS is cheaper
        # than a poll on the path of every request.
        while readable(self.monitor):
            self._monitor()
        while not self.ready:
            if self.refusal is not None:
                raise NotDelivered(f"{self.peer.name} ({self.peer.endpoint}): {self.refusal}")
            left = deadline - self._monotonic()
            if left <= 0:
                raise NotDelivered(f"no connection to {self.peer.name} at {self.peer.endpoint}")
            if self.monitor.poll(max(1, int(left * 1000))):
                self._monitor()

    def send(self, frames: list[bytes], connect_by: float) -> None:
        with self.lock:
            self._wait_ready(connect_by)
            self._send(frames)

    def _send(self, frames: list[bytes]) -> None:
        try:
            if len(frames) == 2:
                send_envelope(self.sock, b"", frames[0], frames[1])
            else:
                send_frames(self.sock, [b"", *frames])
        except zmq.Again:
            raise NotDelivered(f"{self.peer.name}: send queue full or no connection") from None

    def tell(self, frames: list[bytes], connect_by: float) -> None:
        """``drain()`` then ``send()``, with one look at both sockets instead of one each (a tell's path)."""
        with self.lock:
            self._tell(frames, connect_by)

    def _tell(self, frames: list[bytes], connect_by: float) -> None:
        ready = _zmq_poll(self._both, 0)
        if ready:
            for sock, _ in ready:
                if sock is self.sock:
                    self.drain()
                else:
                    while readable(self.monitor):
                        self._monitor()
        if not self.ready:
            self._wait_ready(connect_by)
        self._send(frames)

    def next_reply(self, header: Header, deadline: float) -> tuple[Header, bytes]:
        """The next reply (partial or final) to ``header``; other frames are dropped and counted."""
        with self.lock:
            return self._next_reply(header, deadline)

    def _next_reply(self, header: Header, deadline: float) -> tuple[Header, bytes]:
        sock = self.sock
        dropped = False
        while True:
            if dropped or (left := deadline - self._monotonic()) <= 0:
                if not readable(sock):
                    if dropped:
                        # Disconnected, and nothing that arrived before it is left to read: the outcome is
                        # unknown. (A reply sent just before the peer closed is read first, never lost.)
                        raise Unavailable(f"{self.peer.name} disconnected with {header.kind} in flight")
                    raise Expired(f"{header.kind} to {header.dst}: no reply within the deadline")
            else:
                # One zmq_poll on both sockets: it returns at once when a reply is already there (a
                # stream's next part), so no separate look first; pyzmq's Poller wrapper costs more.
                sock_ready = False
                for ready, _ in _zmq_poll(self._both, max(1, int(left * 1000))):
                    if ready is sock:
                        sock_ready = True
                    elif self._monitor():
                        dropped = True
                if dropped or not sock_ready:
                    continue
            parts = recv_frames(sock)
            if len(parts) != 3 or parts[0]:
                self._on_drop("malformed")
                continue
            try:
                reply = decode_header(parts[1], max_bytes=self._max_header)
            except ProtocolError:
                self._on_drop("malformed")
                continue
            if reply.flow == "tell":
                self._tell_arrived(reply, parts[2])
                continue
            if reply.corr != header.id or not reply.is_reply:
                self._on_drop("late_reply")
                continue
            if node_of(reply.src) != self.peer.name:
                self._on_drop("spoofed")
                continue
            return reply, parts[2]

    def _tell_arrived(self, header: Header, body: bytes) -> None:
        if node_of(header.src) != self.peer.name:
            self._on_drop("spoofed")
        elif self.on_tell is not None:
            self.on_tell(header, body)
        else:
            self._on_drop("unsolicited")

    def drain(self) -> None:
        """Take in whatever has arrived unasked (tell errors) without waiting."""
        with self.lock:
            self._drain()

    def _drain(self) -> None:
        sock = self.sock
        while readable(sock):
            parts = recv_frames(sock)
            try:
                header = decode_header(parts[1], max_bytes=self._max_header) if len(parts) == 3 else None
            except ProtocolError:
                header = None
            if header is None or parts[0]:
                self._on_drop("malformed")
            elif header.flow == "tell":
                self._tell_arrived(header, parts[2])
            else:
                self._on_drop("late_reply")

    def call(
        self, header: Header, frames: list[bytes], deadline: float, connect_by: float | None = None
    ) -> Iterator[tuple[Header, bytes]]:
        """Send one request and yield each reply addressed to it (partials, then the final one)."""
        self.send(frames, deadline if connect_by is None else min(deadline, connect_by))
        while True:
            reply, body = self.next_reply(header, deadline)
            yield reply, body
            if reply.flow == "reply":
                return


def raise_if_error(registry: Registry, header: Header, body: bytes) -> Any:
    """Decode a reply body; an ``ErrorReply`` is raised as the error class it names."""
    message = registry.decode(header.kind, body)
    if isinstance(message, ErrorReply):
        raise registry.rebuild_error(message)
    return message


def error_of(registry: Registry, header: Header, body: bytes) -> BusError | None:
    try:
        raise_if_error(registry, header, body)
    except BusError as exc:
        return exc
    return None
