"""The node's I/O thread: owns every bound ROUTER, every outbound DEALER and their monitors.

It decodes headers (never bodies), authorises, and puts each inbound message straight into the target
actor's mailbox; other threads hand it outbound commands through ``IoThread.put`` (its own queue plus a
wake-up pipe). It is also the node's one timer: it expires requests whose deadline passed.

It knows its node only through ``IoHost``, the public face the node shows it (this module never imports
``transport.node``): the node owns the thread, the thread serves the node.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from transport.affinity import park, unpark
from transport.codec import BATCH_TAG, Registry, encode_header
from transport.envelope import REPLY_FLOWS, Flow, Header, Inbound, Route, TellBatch, node_of
from transport.errors import BusError, NotDelivered, ProtocolError, Unavailable
from transport.logs import LogLimiter
from transport.messages import ErrorReply, Hello, NodeStats, Resolve, Resolved, StatsQuery
from transport.pending import PendingTable, Timers
from transport.security import Security, SecurityError, user_id
from transport.sockets import (
    Ctx,
    Peer,
    Sock,
    SocketOptions,
    handshake_refusal,
    make_dealer,
    make_router,
    monitor_event,
    readable,
    recv_frames,
    send_frames,
)

log = logging.getLogger("transport.node")

MAX_ROUTES = 16384  # nodes known by the hello on their inbound connection; the oldest is forgotten past it


class Counters(Protocol):
    def incr(self, name: str, n: int = 1) -> None: ...


class IoHost(Protocol):
    """What the I/O thread needs of its node: its settings and tables, and the routing it does for it.

    ``transport.node.Node`` is the one implementation; every member is public on it.
    """

    name: str
    context: Ctx
    options: SocketOptions
    security: Security
    registry: Registry
    pending: PendingTable
    timers: Timers
    log_limit: LogLimiter
    monotonic: Callable[[], float]

    @property
    def stats(self) -> Counters: ...

    @property
    def directory_address(self) -> str: ...

    def admit(
        self, head: bytes, auth: str | None, seq_seen: OrderedDict[tuple[str, str], int]
    ) -> Header | None: ...

    def lookup(self, name: str) -> Any: ...

    def deliver_local(
        self, header: Header, body: bytes, route: Route | None = None, *, message: Any = None
    ) -> None: ...

    def deliver_batch(self, actor_key: str, ref: Any, batch: list[Inbound | TellBatch]) -> None: ...

    def split_tells(
        self,
        header: Header,
        body: bytes,
        route: Route | None,
        seq_seen: OrderedDict[tuple[str, str], int],
    ) -> TellBatch | None: ...

    def fail_send(self, header: Header, error: BusError, route: Route | None = None) -> None: ...

    def direct_endpoints(self, actor: str) -> tuple[str, ...]: ...

    def stats_report(self) -> Any: ...

    def header(self, kind: str, src: str, dst: str, flow: Flow, *, corr: bytes | None = None) -> Header: ...


class IoThread(threading.Thread):
    """Owns every socket of the node; see the Node docstring. ``binds``: the endpoints to bind, in order
    (what they became, e.g. a tcp port picked by the OS, is ``endpoints`` once ``ready`` is set)."""

    def __init__(self, node: IoHost, binds: tuple[str, ...]) -> None:
        super().__init__(name=f"kbus-io-{node.name}", daemon=True)
        self.node = node
        self.binds = binds
        self.endpoints: tuple[str, ...] = ()
        self.ready = threading.Event()
        # Commands from other threads: ("send" | "reply" | "connect" | "call" | "stop", ...); see put().
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.failure: BaseException | None = None
        self.poll_until = 0.0  # monotonic time the current poll may sleep until
        self.input_failures = 0
        self.routers: list[tuple[Sock, bool]] = []  # (socket, uses CURVE)
        self.dealers: dict[str, tuple[Sock, Sock, Peer]] = {}  # peer -> (dealer, monitor, peer)
        self.connected: dict[str, threading.Event] = {}
        self.routes: dict[str, Route] = {}  # node name -> way back over an inbound connection
        self.seq_seen: OrderedDict[tuple[str, str], int] = OrderedDict()
        # Messages for one actor read in this wake-up, not yet in its mailbox (see _deliver).
        self._batch: list[Inbound | TellBatch] = []
        self._batch_ref: Any = None
        self._batch_key = ""
        self._prefix = f"{node.name}/"  # addresses of this node's actors start so
        self._directory = node.directory_address
        self.poller = zmq.Poller()
        self._wake_r, self._wake_w = _wake_pair()
        # Closed only when nothing can reach this thread object any more: a wake() racing shutdown must
        # never write into a descriptor number the process has since reused.
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)

    def wake(self) -> None:
        # A full pipe means wake-ups are pending already: the thread is awake anyway.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\x01")

    def put(self, command: tuple[Any, ...]) -> None:
        """Hand the thread a command (from any thread) and wake it; it runs in the order put."""
        self._commands.put(command)
        self.wake()

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> None:
        node = self.node
        try:
            endpoints = []
            for endpoint in self.binds:
                sock = make_router(node.context, endpoint, node.options, node.security, node.name)
                self.routers.append((sock, node.security.uses_curve(endpoint)))
                self.poller.register(sock, zmq.POLLIN)
                endpoints.append(str(sock.getsockopt_string(zmq.LAST_ENDPOINT)))
            self.endpoints = tuple(endpoints)
            self.poller.register(self._wake_r, zmq.POLLIN)
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
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

    def _loop(self) -> None:
        node = self.node
        wake = self._wake_r
        while True:
            # Until the poll below is armed, any timer added (Node.call_at, from another thread) must wake
            # it: with the last poll's end here, one added between run_due and the new poll_until saw an
            # old time, skipped the wake, and ran up to a second late. The pipe keeps the wake for the poll.
            self.poll_until = math.inf
            wait = node.pending.expire_due()
            timer = node.timers.run_due()
            if timer is not None and (wait is None or timer < wait):
                wait = timer
            # `not wait < 1.0` also catches what must never get here (NaN, inf): then it wakes each second.
            timeout_ms = 1000 if wait is None or not wait < 1.0 else max(0, int(wait * 1000) + 1)
            self.poll_until = node.monotonic() + timeout_ms / 1000
            parked = park() if timeout_ms else None  # the wait sits on the home CPU (transport/affinity.py)
            try:
                ready = self.poller.poll(timeout_ms)
            finally:
                unpark(parked)
            for sock, _ in ready:
                if sock == wake:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake, 4096)
                elif isinstance(sock, zmq.Socket):
                    self._readable(sock)
            # Drain the outbox after every poll: a wake-up may have been merged with socket events.
            # This thread is the only reader: not empty() means get_nowait() has an item (no Empty raised
            # on every turn of the loop).
            outbox = self._commands
            while not outbox.empty():
                item = outbox.get_nowait()
                if item[0] == "stop":
                    return
                try:
                    self._command(item)
                except Exception:  # one bad command must not end the thread
                    node.stats.incr("io_command_failures")
                    log.exception("node %s: I/O thread command %s failed", node.name, item[0])

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
        try:
            self._drain_router_batch(index, sock, curve)
        finally:
            self._flush()

    def _drain_router_batch(self, index: int, sock: Sock, curve: bool) -> None:
        # Up to 256 messages per wake-up: fewer polls under load, fair to the other sockets.
        for i in range(256):
            # The first needs no look: the poll that called us said a message is there. The second gets
            # a zero-timeout poll: raising zmq.Again costs twice that, so a lone message (a request)
            # ends its drain the cheap way. Past that it is a burst: read until zmq.Again (below).
            if i == 1 and not readable(sock):
                return
            auth: str | None = None
            try:
                if curve:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    try:
                        auth = user_id(frames[-1])
                    except ProtocolError:
                        self.node.stats.incr("unauthenticated")
                        continue
                    parts = [f.bytes for f in frames]
                else:
                    parts = recv_frames(sock)
            except zmq.Again:
                return
            if len(parts) != 4 or parts[1]:
                self.node.stats.incr("malformed")
                continue
            self._inbound(parts[2], parts[3], ("r", index, parts[0]), auth)

    def _drain_dealer(self, name: str, sock: Sock) -> None:
        try:
            for i in range(256):
                if i == 1 and not readable(sock):  # see _drain_router_batch
                    return
                try:
                    parts = recv_frames(sock)
                except zmq.Again:
                    return
                if len(parts) != 3 or parts[0]:
                    self.node.stats.incr("malformed")
                    continue
                # The server's key was checked by the CURVE handshake: this connection speaks for `name`.
                self._inbound(parts[1], parts[2], ("d", name), f"peer:{name}")
        finally:
            self._flush()

    def _inbound(self, head: bytes, body: bytes, route: Route, auth: str | None) -> None:
        # No frame may stop the I/O thread: a failure routing one is counted and logged once.
        try:
            self._route_inbound(head, body, route, auth)
        except Exception:  # the node's one I/O thread outlives any frame
            self.input_failures += 1
            self.node.stats.incr("io_input_failures")
            if self.input_failures == 1:
                log.exception(
                    "node %s: routing an inbound frame failed (counted, logged once)", self.node.name
                )

    def _route_inbound(self, head: bytes, body: bytes, route: Route, auth: str | None) -> None:
        node = self.node
        header = node.admit(head, auth, self.seq_seen)
        if header is None:
            return
        if header.kind == BATCH_TAG:
            self._route_batch(header, body, route)
            return
        self._route_header(header, body, route)

    def _route_batch(self, header: Header, body: bytes, route: Route) -> None:
        """A burst of tells in one frame: split, and each one routed as if it had come on its own (for an
        actor that takes batches: into the batch the drain hands over, with no per-tell lookup)."""
        tells = self.node.split_tells(header, body, route, self.seq_seen)
        if tells is None:
            return
        dst = header.dst
        if dst.startswith(self._prefix) and dst != self._directory:
            actor_key = dst[len(self._prefix) :]
            ref = self.node.lookup(actor_key)
            if ref is not None and getattr(getattr(ref, "actor_class", None), "TAKES_INBOUND_BATCH", False):
                if ref is not self._batch_ref:
                    self._flush()
                    self._batch_ref, self._batch_key = ref, actor_key
                self._batch.append(tells)
                return
        for tell_header, tell_body in tells.pairs():
            self._route_header(tell_header, tell_body, route)

    def _route_header(self, header: Header, body: bytes, route: Route) -> None:
        node = self.node
        dst = header.dst
        # A request or tell for a local actor (node_of(dst) == node.name: addresses were validated).
        if header.flow not in REPLY_FLOWS and dst.startswith(self._prefix) and dst != self._directory:
            # Held for an actor that takes batches; the drain that read it hands the batch over (_flush)
            # before it returns. Anything else is delivered on its own, as before.
            actor_key = dst[len(self._prefix) :]
            ref = node.lookup(actor_key)
            if ref is not None and getattr(getattr(ref, "actor_class", None), "TAKES_INBOUND_BATCH", False):
                if ref is not self._batch_ref:
                    self._flush()
                    self._batch_ref, self._batch_key = ref, actor_key
                self._batch.append(Inbound(header, body, route))
                return
        # Whatever is not batched happens in arrival order: what was batched before it goes out first.
        self._flush()
        if header.kind == Hello.TAG:
            routes = self.routes
            routes[node_of(header.src)] = route
            if len(routes) > MAX_ROUTES:  # bounded: any peer may say hello under made-up names
                del routes[next(iter(routes))]
                node.stats.incr("routes_forgotten")
            return
        if dst == self._directory and header.kind == Resolve.TAG:
            self._resolve(header, body, route)
            return
        if dst == self._directory and header.kind == StatsQuery.TAG and header.is_request:
            self._stats(header, body, route)
            return
        if node_of(dst) != node.name:
            node.stats.incr("misrouted")
            node.fail_send(header, NotDelivered(f"{dst} is not on node {node.name}"), route)
            return
        node.stats.incr("hops_to_actor")
        node.deliver_local(header, body, route)

    def _flush(self) -> None:
        batch = self._batch
        if batch:
            ref, key = self._batch_ref, self._batch_key
            self._batch, self._batch_ref = [], None
            self.node.stats.incr("hops_to_actor", sum(1 if type(p) is Inbound else len(p) for p in batch))
            self.node.deliver_batch(key, ref, batch)

    def _resolve(self, header: Header, body: bytes, route: Route) -> None:
        """Answer a directory query on the I/O thread itself: no actor, no hop."""
        node = self.node
        try:
            query = node.registry.decode(Resolve.TAG, body)
            # Only endpoints of the transport the query came over: a peer on tcp learns nothing of this
            # machine's ipc paths (and could not use them anyway).
            scheme = self._scheme_of(route)
            endpoints = tuple(e for e in node.direct_endpoints(query.actor) if e.startswith(scheme))
            answer = Resolved(actor=query.actor, endpoints=endpoints)
            tag, encoded = Resolved.TAG, node.registry.encode(answer)
        except ProtocolError as exc:
            tag, encoded = ErrorReply.TAG, node.registry.encode_error(exc)
        reply = node.header(tag, node.directory_address, header.src, "reply", corr=header.id)
        self._reply(route, [encode_header(reply), encoded], reply)

    def _stats(self, header: Header, body: bytes, route: Route) -> None:
        """Answer ``sys.stats`` on the I/O thread (no actor, no hop): the node's counters and each actor's."""
        node = self.node
        try:
            node.registry.decode(StatsQuery.TAG, body)
            tag, encoded = NodeStats.TAG, node.registry.encode(node.stats_report())
        except ProtocolError as exc:
            tag, encoded = ErrorReply.TAG, node.registry.encode_error(exc)
        reply = node.header(tag, node.directory_address, header.src, "reply", corr=header.id)
        self._reply(route, [encode_header(reply), encoded], reply)

    def _scheme_of(self, route: Route) -> str:
        """``tcp://``, ``ipc://`` or ``inproc://``: how the connection a message came in on was made."""
        if route[0] == "r" and route[1] < len(self.endpoints):
            endpoint = self.endpoints[route[1]]
        elif route[0] == "d" and route[1] in self.dealers:
            endpoint = self.dealers[route[1]][2].endpoint
        else:
            return "\0"  # unknown: match nothing
        return endpoint.partition("://")[0] + "://"

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
            except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(exc)

    def _send(self, dst_node: str, frames: list[bytes], header: Header) -> None:
        node = self.node
        try:
            if dst_node in self.dealers:
                send_frames(self.dealers[dst_node][0], [b"", *frames])
            elif (route := self.routes.get(dst_node)) is not None:
                self._via_route(route, frames)
            else:
                node.fail_send(header, NotDelivered(f"no route to node {dst_node}"))
                return
            if header.is_request:
                # From here a lost connection leaves the outcome unknown (fail_peer: Unavailable).
                node.pending.mark_sent(header.id)
        except zmq.Again:
            node.stats.incr("not_delivered")
            node.fail_send(header, NotDelivered(f"node {dst_node}: not connected, or its queue is full"))
        except zmq.ZMQError as exc:
            node.stats.incr("not_delivered")
            node.fail_send(header, NotDelivered(f"node {dst_node}: {exc}"))

    def _via_route(self, route: Route, frames: list[bytes]) -> None:
        if route[0] == "r":
            send_frames(self.routers[route[1]][0], [route[2], b"", *frames])
        else:
            send_frames(self.dealers[route[1]][0], [b"", *frames])

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
            with contextlib.suppress(zmq.ZMQError):
                old[0].disable_monitor()  # else its monitor endpoint outlives it (see below)
            old[1].close(0)
            old[0].close(0)
            node.pending.fail_peer(peer.name, lambda e: Unavailable(f"connection to {peer.name} replaced"))
        try:
            dealer = make_dealer(node.context, peer, node.options, node.security)
        except SecurityError as exc:
            node.log_limit.log(
                log,
                logging.ERROR,
                ("connect", peer.name),
                "node %s: cannot connect to %s: %s",
                node.name,
                peer.name,
                exc,
            )
            return
        monitor = dealer.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        try:
            dealer.connect(peer.endpoint)
        except zmq.ZMQError as exc:
            dealer.disable_monitor()
            monitor.close(0)
            dealer.close(0)
            node.log_limit.log(
                log,
                logging.ERROR,
                ("connect", peer.name),
                "node %s: cannot connect to %s at %s: %s",
                node.name,
                peer.name,
                peer.endpoint,
                exc,
            )
            return
        self.dealers[peer.name] = (dealer, monitor, peer)
        self.connected[peer.name] = event or threading.Event()
        self.poller.register(dealer, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)
        if peer.endpoint.startswith("inproc://"):
            self._handshake_done(peer.name)  # inproc has no ZMTP handshake: its monitor never reports one

    def _handshake_done(self, name: str) -> None:
        node = self.node
        dealer = self.dealers[name][0]
        hello = node.header(Hello.TAG, f"{node.name}/node", f"{name}/node", "tell")
        with contextlib.suppress(zmq.ZMQError):
            dealer.send_multipart(
                [b"", encode_header(hello), node.registry.encode(Hello(node=node.name))],
                zmq.NOBLOCK,
            )
        self.connected[name].set()

    def _monitor(self, name: str, monitor: Sock) -> None:
        node = self.node
        while monitor.poll(0):
            event = monitor_event(monitor)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake_done(name)
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected[name] = threading.Event()
                failed = node.pending.fail_peer(
                    name, lambda e: Unavailable(f"{name} disconnected with the request in flight")
                )
                node.stats.incr("peer_disconnects")
                log.info("node %s: lost %s (%d requests in flight)", node.name, name, failed)
            elif (why := handshake_refusal(event)) is not None:
                node.stats.incr("handshake_failures")
                node.log_limit.log(
                    log, logging.WARNING, ("handshake", name), "node %s: %s: %s", node.name, name, why
                )


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _wake_pair() -> tuple[int, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w
