"""A direct actor's mailbox: its pykka inbox and its own ROUTER socket, waited on together; and the actor
thread's own lanes to peers' direct actors.

A blocking call that goes through the node costs two thread hand-offs on the serving side (I/O thread to
actor, actor back to I/O thread); on this kind of machine each is tens of µs. A *direct* actor binds a
socket of its own and its thread waits on it and on its local queue at once, so a peer's request reaches
the handler with no hand-off and the reply leaves from the same thread. The node still routes to the actor
as before (local senders, actor-to-actor traffic, peers that did not resolve the endpoint).

The socket is created, used and closed by the actor's thread only. Other threads only ``put``.

*Lanes* do the same for what the thread sends: a request or tell from an actor on this thread (hosted ones
included) to an actor of a peer that serves on a socket of its own leaves on a DEALER this thread owns,
connected to that socket, and the answer comes back on it, into this mailbox: no I/O-thread hand-off on
either side. ``Node.send`` offers each remote send to the sending thread's lanes first (``lane_send``).
Each (sender, receiver) pair keeps the way its first message took, so its order holds (MB-05): the first
send to an unresolved receiver goes through the node and asks the peer where the receiver listens; pairs
that start after the answer take the lane. An answer of no socket of its own (or none) holds for
``RESOLVE_AGAIN_AFTER`` seconds; a pair that starts later asks again (the receiver may have been starting).
A message the lane cannot take (no live connection yet or any more: ``immediate``; nothing is sent) goes
through the node, and so does every later one of its pair; a lane that refuses 16 in a row is closed and
its receiver resolved again. A request sent on a lane is marked sent,
so the peer's disconnect ends it ``Unavailable`` as it ends the node's.
A ``HostingActor``'s mailbox is one of these without a socket of its own (``serve=False``): what it hosts
(runs, handles) then reaches a remote Router without the node's I/O thread.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

import zmq
from pykka._envelope import Envelope  # pykka's own mailbox item; pinned to pykka 4 in setup.cfg
from zmq.backend import zmq_poll

from transport.affinity import park, unpark
from transport.codec import BATCH_TAG
from transport.envelope import Header, Inbound
from transport.errors import BusError, NotDelivered, ProtocolError
from transport.messages import Resolve, Resolved
from transport.node import pick_direct
from transport.security import SecurityError, user_id
from transport.sockets import (
    POLLIN,
    BindError,
    Peer,
    Sock,
    make_dealer,
    make_router,
    recv_frames,
    send_envelope,
    send_frames,
    send_routed,
)

if TYPE_CHECKING:
    from transport.node import Node
else:
    Node = Any

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_CLOSE_LINGER_MS = 500
_LANE_REFUSALS = 16  # sends a lane may refuse in a row (no connection) before it is dropped
_RESOLVE_TIMEOUT = 5.0  # seconds a lane's resolve waits for the peer; meanwhile the node's path is taken
# Seconds (node clock) a "no socket of its own" answer, or no answer, holds before a pair that starts later
# asks again: the receiver may have been starting (it binds on its own thread) or its peer slow to answer.
RESOLVE_AGAIN_AFTER = 10.0


def sibling_endpoint(endpoint: str, node: str, actor: str) -> str | None:
    """Where a direct actor binds, next to one of its node's endpoints (same transport, same host)."""
    tag = _UNSAFE.sub(".", actor)
    if endpoint.startswith("tcp://"):
        host = endpoint[6:].rpartition(":")[0]
        return f"tcp://{host}:0" if host else None
    if endpoint.startswith("ipc://"):
        path = endpoint[6:]
        base = path[:-5] if path.endswith(".sock") else path
        return f"ipc://{base}.{tag}.sock"
    if endpoint.startswith("inproc://"):
        return f"{endpoint}.{tag}"
    return None


_LANE_PAIRS = 4096  # (sender, receiver) pairs a thread remembers the way of; the oldest is forgotten


class SocketInbox:
    """pykka's ActorInbox protocol (put/get/empty) over a local deque plus the actor's own socket (when
    ``serve``) and the thread's lanes to peers' direct actors."""

    def __init__(self, node: Node, actor: str, *, serve: bool = True) -> None:
        self._serve = serve
        self._node = node
        self._actor = actor
        self._address = f"{node.name}/{actor}"
        self._local: collections.deque[Any] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Closed only when no thread can reach this inbox any more: a put() racing close() must never write
        # into a descriptor number the process has already reused.
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)
        self._sleeping = False
        self._sock: Sock | None = None
        self._curve = False
        # What get() polls: the wake-up pipe, and the actor's own socket once it has one.
        self._items: list[tuple[Any, int]] = [(self._wake_r, POLLIN)]
        self._opened = False
        self._closed = False
        self._seq_seen: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.endpoints: tuple[str, ...] = ()
        # Lanes (owner thread only, but _directs, which the resolve's callback fills from the I/O thread).
        self._lanes: dict[str, Sock] = {}  # direct endpoint -> this thread's DEALER to it
        # receiver -> (its node's peer, its own socket's, when a "none" answer is asked again)
        self._directs: dict[str, tuple[Peer, Peer | None, float]] = {}
        self._resolving: set[str] = set()
        self._pairs: OrderedDict[tuple[str, str], Peer | None] = OrderedDict()  # the way each pair took
        self._refused: dict[str, int] = {}  # lane endpoint -> sends it refused in a row

    # ---------------------------------------------------------------------------- any thread
    def put(self, envelope: Any) -> None:
        self._local.append(envelope)
        # Only wake a thread that is (about to be) asleep: the reader sets the flag *before* its last look
        # at the deque, so an append that misses the flag is seen by that look.
        if self._sleeping:
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"\x01")

    def empty(self) -> bool:
        return not self._local

    def waiting(self) -> bool:
        """Whether ``get`` would return at once: an item from a local sender, or a message on the actor's
        own socket (owner thread only; a lane's replies are not looked at)."""
        if self._local:
            return True
        sock = self._sock
        return sock is not None and bool(cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN)

    def qsize(self) -> int:
        """Items waiting from local senders (what waits on the socket is libzmq's to count)."""
        return len(self._local)

    # ------------------------------------------------------------------------ actor thread only
    def _open(self) -> None:
        self._opened = True
        node = self._node
        node.own_lanes(self)
        if not self._serve:
            return
        binds = [e for e in (sibling_endpoint(b, node.name, self._actor) for b in node.endpoints) if e]
        if not binds:
            return
        sock = None
        try:
            # One socket, one security setting: the node's first endpoint decides (CURVE on tcp), and only
            # siblings with the same setting are bound on it.
            first = binds[0]
            curve = node.security.uses_curve(first)
            sock = make_router(node.context, first, node.options, node.security, node.name)
            bound = [str(sock.getsockopt_string(zmq.LAST_ENDPOINT))]
            for extra in binds[1:]:
                if node.security.uses_curve(extra) == curve:
                    sock.bind(extra)
                    bound.append(str(sock.getsockopt_string(zmq.LAST_ENDPOINT)))
            self._curve = curve
            self.endpoints = tuple(bound)
        except (zmq.ZMQError, OSError, ValueError, SecurityError, BindError) as exc:
            log.warning(
                "%s/%s: no direct socket (%s); reachable through the node only", node.name, self._actor, exc
            )
            if sock is not None:
                sock.close(0)
            return
        self._sock = sock
        self._items.append((sock, POLLIN))
        for endpoint in self.endpoints:
            node._warn_if_plain(endpoint, f"actor {self._actor} listens on")
        node.publish_direct(self._actor, self.endpoints)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if not self._opened:
            self._open()
        sock = self._sock
        local = self._local
        items = self._items
        wake_r = self._wake_r
        socket_ready = False
        while True:
            if local:
                return local.popleft()
            if socket_ready:
                socket_ready = False
                envelope = self._receive(sock)  # type: ignore[arg-type]  # polled only once it exists
                if envelope is not None:
                    return envelope
                continue
            # No separate look at the socket first: the poll returns at once when a message waits.
            self._sleeping = True
            if local:
                self._sleeping = False
                continue
            parked = park()  # the wait sits on the home CPU (transport/affinity.py)
            try:
                events = zmq_poll(items, 1000)
            finally:
                unpark(parked)
            self._sleeping = False
            for fd, _ in events:
                if fd == wake_r:  # read the wake-up pipe only when it woke us: a syscall saved
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                elif fd is sock:
                    socket_ready = True  # the poll said so: no second look before receiving
                else:
                    self._lane_receive(fd)

    def _receive(self, sock: Sock) -> Any:
        node = self._node
        auth: str | None = None
        if self._curve:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            try:
                auth = user_id(frames[-1])
            except ProtocolError:
                node.stats.incr("unauthenticated")
                return None
            parts = [f.bytes for f in frames]
        else:
            parts = recv_frames(sock)
        if len(parts) != 4 or parts[1]:
            node.stats.incr("malformed")
            return None
        header = node.admit(parts[2], auth, self._seq_seen)
        if header is None:
            return None
        if header.dst != self._address:
            # A peer that took this socket for another actor's: tell it, rather than let it wait out its
            # deadline.
            node.stats.incr("misrouted")
            node.fail_send(header, NotDelivered(f"{header.dst} is not served here"), ("self", parts[0], self))
            return None
        route = ("self", parts[0], self)
        if header.kind == BATCH_TAG:
            tells = node.split_tells(header, parts[3], route, self._seq_seen)
            return None if tells is None else Envelope(tells)
        return Envelope(Inbound(header, parts[3], route))

    # ------------------------------------------------------------------------------- lanes
    def lane_send(self, dst_node: str, header: Header, frames: list[bytes]) -> bool:
        """Send ``frames`` on this thread's lane to ``header.dst`` if its pair takes one; False: the caller
        sends through the node (nothing was sent here). True also when a request the lane could not take
        had ended already (a disconnect failed it, or its deadline passed): nothing is left to do."""
        dst = header.dst
        if dst.endswith("/node"):
            return False  # the peer node itself (the resolve below goes there): never a direct actor
        key = (header.src, dst)
        pairs = self._pairs
        if key in pairs:
            direct = pairs[key]
        else:
            direct = self._direct_for(dst_node, dst)
            pairs[key] = direct
            if len(pairs) > _LANE_PAIRS:
                pairs.popitem(last=False)
        if direct is None:
            return False
        sock = self._lanes.get(direct.endpoint) or self._open_lane(direct)
        ended = False  # the request ended meanwhile (a disconnect, its deadline): nothing left to send
        if sock is not None:
            pending = self._node.pending
            if header.is_request:
                # Marked sent *before* it leaves: the peer's connection may drop (and the I/O thread fail
                # what was sent over it, Unavailable) before this thread runs again; marked after, the
                # request would miss that and wait out its deadline.
                pending.mark_sent(header.id)
            try:
                send_envelope(sock, b"", frames[0], frames[1])
                self._refused.pop(direct.endpoint, None)
                return True
            except zmq.Again:
                # No live connection (immediate): not yet (a lane just opened), or no more (its actor
                # stopped). Nothing was sent; this pair goes through the node. A lane that keeps refusing is
                # dropped and its receiver asked again.
                ended = header.is_request and not pending.mark_sent(header.id, sent=False)
                refused = self._refused.get(direct.endpoint, 0) + 1
                self._refused[direct.endpoint] = refused
                if refused < _LANE_REFUSALS:
                    pairs[key] = None
                    return ended
            except zmq.ZMQError:
                ended = header.is_request and not pending.mark_sent(header.id, sent=False)
            self._close_lane(direct.endpoint)
        pairs[key] = None
        self._directs.pop(dst, None)
        self._node.stats.incr("direct_fallbacks")
        return ended

    def _direct_for(self, dst_node: str, dst: str) -> Peer | None:
        """The peer entry of ``dst``'s own socket if known for the peer ``dst_node`` is now; else None, and
        the peer is asked (once at a time, and again once a "none" is ``RESOLVE_AGAIN_AFTER`` old) where
        ``dst`` listens, for the pairs that start later."""
        node = self._node
        peer = node.peer(dst_node)
        if peer is None:
            return None
        known = self._directs.get(dst)
        if known is not None and known[0] is peer and (known[1] is not None or node.monotonic() < known[2]):
            return known[1]
        if dst not in self._resolving:
            self._resolving.add(dst)
            directs, resolving = self._directs, self._resolving

            def resolved(future: Any) -> None:  # on the I/O thread: two single assignments
                try:
                    answer = future.result(0)
                except BaseException:  # noqa: BLE001 - not resolved: the node's path stays the way
                    answer = None
                direct = pick_direct(peer, answer.endpoints if isinstance(answer, Resolved) else ())
                directs[dst] = (peer, direct, node.monotonic() + RESOLVE_AGAIN_AFTER)
                resolving.discard(dst)

            try:
                future = node.request_future(
                    f"{dst_node}/node", Resolve(actor=dst.partition("/")[2]), timeout=_RESOLVE_TIMEOUT
                )
            except BusError:
                self._resolving.discard(dst)
            else:
                future.add_done_callback(resolved)
        return None

    def _open_lane(self, direct: Peer) -> Sock | None:
        node = self._node
        try:
            sock = make_dealer(node.context, direct, node.options, node.security)
            sock.connect(direct.endpoint)
        except (zmq.ZMQError, SecurityError, ValueError) as exc:
            log.info("%s: no lane to %s (%s)", self._address, direct.endpoint, exc)
            return None
        self._lanes[direct.endpoint] = sock
        self._items.append((sock, POLLIN))
        return sock

    def _close_lane(self, endpoint: str) -> None:
        sock = self._lanes.pop(endpoint, None)
        self._refused.pop(endpoint, None)
        if sock is None:
            return
        self._items[:] = [item for item in self._items if item[0] is not sock]  # get() holds this list
        sock.close(0)

    def _lane_receive(self, sock: Sock) -> None:
        """What came back on a lane (answers, tell errors) goes where the node's would: to the pending
        request, or to the actor's mailbox."""
        node = self._node
        while True:
            try:
                parts = recv_frames(sock)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            if len(parts) != 3 or parts[0]:
                node.stats.incr("malformed")
                continue
            header = node.admit(parts[1], None, self._seq_seen)
            if header is not None:
                node.deliver_local(header, parts[2])

    def send(self, routing_id: bytes, frames: list[bytes]) -> bool:
        """Answer over the connection a request came in on; False (counted) if the peer is gone or full."""
        sock = self._sock
        if sock is None:
            return False
        try:
            if len(frames) == 2:
                send_routed(sock, routing_id, frames[0], frames[1])
            else:
                send_frames(sock, [routing_id, b"", *frames])
        except zmq.ZMQError:
            self._node.stats.incr("dropped_replies")
            return False
        return True

    def close(self) -> None:
        """Close the socket (actor thread, at stop); messages still queued locally stay for pykka."""
        if self._closed:
            return
        self._closed = True
        self._node.publish_direct(self._actor, ())
        self._node.own_lanes(None, self)
        for endpoint in list(self._lanes):
            self._close_lane(endpoint)
        if self._sock is not None:
            # A short linger: replies sent just before closing (an actor answering its deferred requests
            # as it stops) still leave; with linger 0 libzmq would drop them with the socket.
            self._sock.close(linger=_CLOSE_LINGER_MS)
            self._sock = None


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
