"""Requests in flight: correlation id -> who waits, until which deadline, over which peer.

Every request ends in exactly one terminal outcome (reply, error, NotDelivered, Unavailable, Expired): the
entry is removed by whichever outcome comes first, so a duplicate or late reply finds nothing and is
counted and dropped (MB-04).
"""

from __future__ import annotations

import concurrent.futures
import heapq
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from transport.envelope import Header
from transport.errors import BusError, Expired
from transport.logs import LogLimiter
from transport.records import frozen

log = logging.getLogger(__name__)

_actor_thread = threading.local()


class BlockingCallInActor(RuntimeError):
    """An actor thread tried to wait for a reply: that would block its mailbox (DESIGN.md §2)."""


def mark_actor_thread(address: str | None) -> None:
    _actor_thread.address = address


def current_actor() -> str | None:
    return getattr(_actor_thread, "address", None)


def forbid_blocking(what: str) -> None:
    address = current_actor()
    if address is not None:
        raise BlockingCallInActor(
            f"{what} from actor {address}'s own thread would block its mailbox; "
            "send a request with a continuation instead"
        )


@frozen
class Reply:
    """One reply (partial or final) or a terminal error, as seen by whoever waits."""

    message: Any
    error: BusError | None
    final: bool
    header: Header | None = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.message


_END = object()


class BusFuture(concurrent.futures.Future[Any]):
    """A request's terminal reply. Waiting on it from an actor thread raises ``BlockingCallInActor``.

    For a streamed request, ``parts()`` yields each partial reply as it arrives, then the final one.
    """

    def __init__(self) -> None:
        super().__init__()
        self._parts: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.request_id: bytes = b""
        self._on_cancel: Callable[[], None] | None = None

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            forbid_blocking("BusFuture.result()")
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            forbid_blocking("BusFuture.exception()")
        return super().exception(timeout)

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled and self._on_cancel is not None:
            self._on_cancel()
        return cancelled

    def _part(self, message: Any) -> None:
        self._parts.put(message)

    def _finish(self, reply: Reply) -> None:
        # The future is settled before the stream's end is queued: a ``parts()`` reader on another thread
        # that takes the end at once reads the result with no wait (``result(0)``).
        if reply.error is not None:
            if not self.done():
                self.set_exception(reply.error)
            self._parts.put(reply.error)
        else:
            if not self.done():
                self.set_result(reply.message)
            self._parts.put(_END)

    def parts(self, timeout: float | None = None) -> Iterator[Any]:
        """Partial replies in order, then the final reply; raises the terminal error if there is one."""
        forbid_blocking("BusFuture.parts()")
        while True:
            try:
                item = self._parts.get(timeout=timeout)
            except queue.Empty:
                raise Expired(f"no reply part within {timeout}s") from None
            if item is _END:
                yield self.result(0)
                return
            if isinstance(item, BusError):
                raise item
            yield item


@dataclass(slots=True, eq=False)
class PendingRequest:
    """Who waits for ``id``: a future (any thread) or an actor continuation (delivered to its mailbox)."""

    id: bytes
    peer: str
    deadline: float  # monotonic seconds
    deliver: Callable[[Reply], None]
    stream: bool = False
    # Handed to a peer's socket. Only then can a lost connection leave the outcome unknown; a request still
    # waiting in the I/O thread's queue gets its own send outcome (sent, or NotDelivered).
    sent: bool = False


class PendingTable:
    """Thread-safe: senders register, the I/O thread (or a local replier) resolves, the I/O thread expires."""

    def __init__(self, monotonic: Callable[[], float], log_limit: LogLimiter | None = None) -> None:
        self._lock = threading.Lock()
        self._log_limit = log_limit or LogLimiter(monotonic=monotonic)
        self._entries: dict[bytes, PendingRequest] = {}
        # (deadline, request id): plain tuples, so the heap compares in C (a request's add is on every ask)
        self._timers: list[tuple[float, bytes]] = []
        self._monotonic = monotonic
        self.late_replies = 0

    def add(self, entry: PendingRequest) -> None:
        with self._lock:
            self._entries[entry.id] = entry
            heapq.heappush(self._timers, (entry.deadline, entry.id))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def discard(self, request_id: bytes) -> None:
        with self._lock:
            self._entries.pop(request_id, None)

    def resolve(self, request_id: bytes, reply: Reply) -> bool:
        """Hand ``reply`` to its waiter; False (and counted) when nobody waits any more."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                self.late_replies += 1
            elif reply.final:
                del self._entries[request_id]
        if entry is None:
            self._log_limit.log(
                log, logging.INFO, "late_reply", "dropped a late or duplicate reply to %s", request_id.hex()
            )
            return False
        _deliver(entry, reply)
        return True

    def mark_sent(self, request_id: bytes, sent: bool = True) -> bool:
        """Mark a request as having left (a lost connection then ends it ``Unavailable``), or, with
        ``sent=False``, as not having left after all. False: it has already ended."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                return False
            entry.sent = sent
            return True

    def fail_peer(self, peer: str, error_for: Callable[[PendingRequest], BusError]) -> int:
        """End every request in flight over ``peer`` (its connection dropped): those already sent."""
        with self._lock:
            gone = [e for e in self._entries.values() if e.peer == peer and e.sent]
            for e in gone:
                del self._entries[e.id]
        for e in gone:
            _deliver(e, Reply(None, error_for(e), True))
        return len(gone)

    def expire_due(self) -> float | None:
        """Expire what is due; return seconds until the next deadline (None when nothing waits)."""
        now = self._monotonic()
        due: list[PendingRequest] = []
        with self._lock:
            while self._timers and self._timers[0][0] <= now:
                _, request_id = heapq.heappop(self._timers)
                entry = self._entries.get(request_id)
                if entry is not None and entry.deadline <= now:
                    del self._entries[request_id]
                    due.append(entry)
            # Timers of resolved entries linger in the heap; drop them when they dominate it.
            if len(self._timers) > 64 and len(self._timers) > 4 * len(self._entries):
                self._timers = [t for t in self._timers if t[1] in self._entries]
                heapq.heapify(self._timers)
            nxt = self._timers[0][0] - now if self._timers else None
        for entry in due:
            _deliver(entry, Reply(None, Expired(f"no reply within the deadline (peer {entry.peer})"), True))
        return nxt

    def fail_all(self, error: BusError) -> None:
        with self._lock:
            gone = list(self._entries.values())
            self._entries.clear()
            self._timers.clear()
        for e in gone:
            _deliver(e, Reply(None, error, True))


class Timers:
    """One-shot callbacks at monotonic times, run by the node's I/O thread (its one timer). Thread-safe.

    A callback must not block: it runs on the thread every socket of the node depends on. A cancelled
    timer is forgotten lazily (its slot is dropped once cancelled ones dominate the heap).
    """

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int]] = []
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next = 0
        self._monotonic = monotonic

    def __len__(self) -> int:
        return len(self._callbacks)

    def add(self, at: float, callback: Callable[[], None]) -> int:
        """Run ``callback`` once ``monotonic() >= at``; returns a handle for ``cancel``."""
        with self._lock:
            self._next += 1
            handle = self._next
            self._callbacks[handle] = callback
            heapq.heappush(self._heap, (at, handle))
            return handle

    def cancel(self, handle: int) -> None:
        with self._lock:
            self._callbacks.pop(handle, None)
            if len(self._heap) > 64 and len(self._heap) > 4 * len(self._callbacks):
                self._heap = [t for t in self._heap if t[1] in self._callbacks]
                heapq.heapify(self._heap)

    def run_due(self) -> float | None:
        """Run what is due; return seconds until the next timer (None when none is set)."""
        now = self._monotonic()
        due: list[Callable[[], None]] = []
        with self._lock:
            heap = self._heap
            while heap and heap[0][0] <= now:
                callback = self._callbacks.pop(heapq.heappop(heap)[1], None)
                if callback is not None:
                    due.append(callback)
            nxt = heap[0][0] - now if heap else None
        for callback in due:
            try:
                callback()
            except Exception:  # a callback's bug must not kill the I/O thread
                log.exception("a timer callback failed")
        return nxt


def _deliver(entry: PendingRequest, reply: Reply) -> None:
    try:
        entry.deliver(reply)
    except Exception:  # a waiter's bug must not kill the thread that delivers
        log.exception("delivering the reply to %s failed", entry.id.hex())


def _unchanged(value: Any) -> Any:
    return value


def chained(
    inner: concurrent.futures.Future[Any],
    result: Callable[[Any], Any] = _unchanged,
    error: Callable[[BaseException], BaseException] = _unchanged,
) -> concurrent.futures.Future[Any]:
    """A future that settles when ``inner`` does: its value passed through ``result`` (an exception raised
    there becomes the outcome), its error through ``error``. Cancelling the returned future leaves ``inner``
    alone; its late outcome is then dropped."""
    outer: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def done(fut: concurrent.futures.Future[Any]) -> None:
        if not outer.set_running_or_notify_cancel():
            return
        failure = fut.exception()
        if failure is not None:
            outer.set_exception(error(failure))
            return
        try:
            outer.set_result(result(fut.result()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            outer.set_exception(exc)

    inner.add_done_callback(done)
    return outer
