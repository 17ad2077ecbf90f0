"""Actor-local replay: feed one actor its recorded deliveries and compare everything it sends.

The harness reads a ``.buslog``, takes the records of one actor address, and runs a fresh instance of the
actor on a ``ReplayNode`` (no sockets, no I/O thread):

- message ids are served from the recorded sends, in order, so a replayed request carries the recorded id
  and the recorded reply to it finds its continuation;
- the clock is virtual: each delivery sets it to the recorded header time, and ``clock`` records are served
  in order to ``Node.now``; ``effect`` records are served to ``Node.effect`` (provider and tool results);
- every outbound message is compared, header and body field by field, with the next recorded send; the
  first difference raises ``ReplayDivergence`` with the record index and a field diff.

Fields a transport assigns per run (``ts``, ``deadline``, ``seq``, ``auth``) are not compared.

**The determinism seams.** An actor takes its ids, clock readings and randomness through the functions below
(``recorded_uuid``, ``recorded_clock``, ``recorded_random``): on a capturing node each is an ``effect``
record of the actor, on a ``ReplayNode`` it is served from the log (in order, its key checked), and on a plain
node it costs one call. Messages that reach an actor's mailbox from its own threads rather than from the bus
(a provider's events reaching the Router) are recorded with ``record_mailbox`` where the actor takes them, and
a replay tells them to the actor as ``ReplayedMailbox`` at the same place among its deliveries; an actor asks
``replaying(node)`` to start no such thread (no worker, no ticker, no timer) on a replay.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any

from transport.capture import CaptureLog, Record, read_log
from transport.codec import Registry, decode_header, encode_header
from transport.envelope import Header, Inbound, Route, new_id, node_of
from transport.node import BARRIER, Node
from transport.pending import PendingRequest, current_actor
from transport.records import frozen

IGNORED_HEADER_FIELDS = frozenset(("ts", "deadline", "seq", "auth"))

# The key of an effect record that holds a mailbox message (record_mailbox), not a value an actor asked for.
MAILBOX = b"mailbox"
# The key of a monotonic clock reading (``recorded_clock(node, actor, MONOTONIC, time.monotonic)``). Such a
# reading only times an actor's own waits (liveness, how long it keeps something in memory) and is never
# part of a message. A live replay (actors/app/replay_plugin.py) reads it from the live clock: the ticks and
# timers that read it are live there, so how many readings there are and in which order depends on how fast
# the replay runs, and a recorded one served to another read mixes two machines' clocks.
MONOTONIC = b"monotonic"
# Transport-level liveness and directory traffic: a heartbeat (``sys.ping``, answered by the receiver's
# mailbox, never by its handler, with ``sys.pong``) and a ``sys.resolve`` of a node's directory (a
# heartbeat of a plain client's node, or a lookup of an actor's own socket) with its ``sys.resolved``. How
# many of them an actor sends depends only on how much wall time passed, so two runs of one scenario
# compare without them (``first_divergence``); what the actor does about a heartbeat that failed (a turn
# interrupted) is a message of its own, and is compared.
LIVENESS_KINDS = frozenset(("sys.ping", "sys.pong", "sys.resolve", "sys.resolved"))
_DOUBLE = struct.Struct(">d")


def replaying(node: object) -> bool:
    """True on a ``ReplayNode``: the actor's inputs come from the log, so it starts no thread of its own."""
    return bool(getattr(node, "replaying", False))


def recorded_uuid(node: Node, actor: str) -> uuid.UUID:
    """A fresh UUID4 for ``actor``: an ``effect`` record when capturing, the recorded one on a replay."""
    return uuid.UUID(bytes=node.effect(actor, b"uuid", lambda: uuid.uuid4().bytes))


def recorded_clock(
    node: Node, actor: str, key: bytes = b"time", source: Callable[[], float] = time.time
) -> float:
    """A reading of ``source`` (the wall clock, or e.g. ``time.monotonic`` under its own ``key``) as
    ``actor`` sees it: recorded when capturing, served from the log on a replay."""
    if node.capture is None and type(node).effect is Node.effect:
        return float(source())  # nothing records it, nothing serves it (the Router reads it often a turn)
    value = node.effect(actor, key, lambda: _DOUBLE.pack(source()))
    return float(_DOUBLE.unpack(value)[0])


def recorded_random(node: Node, actor: str, size: int) -> bytes:
    """``size`` random bytes for ``actor`` (``os.urandom``): recorded when capturing, served on a replay."""
    return node.effect(actor, b"random", lambda: os.urandom(size))


def record_mailbox(node: Node, actor: str, payload: bytes) -> None:
    """Record a message ``actor`` takes from its own mailbox (not from the bus), encoded by the actor."""
    if node.capture is not None:
        node.record("effect", actor, [MAILBOX, payload])


@frozen
class ReplayedMailbox:
    """A recorded mailbox message, told to the replayed actor where the log has it; the actor decodes it."""

    payload: bytes


class ReplayDivergence(AssertionError):
    """The replayed actor did something other than what the log recorded."""

    def __init__(self, index: int | None, what: str, diff: list[str]) -> None:
        where = "end of log" if index is None else f"record {index}"
        super().__init__(f"first divergence at {where}: {what}" + "".join(f"\n  {d}" for d in diff))
        self.index = index
        self.what = what
        self.diff = diff


@frozen
class ReplayResult:
    actor: str
    delivered: int
    compared: int


class ReplayNode(Node):
    """A node with no sockets: sends are collected for comparison, ids and time come from the log."""

    def __init__(
        self,
        name: str,
        registry: Registry,
        ids: Callable[[], bytes],
        clock: Callable[[], float],
        actor: str | None = None,
    ):
        # Recorded ids go to the replayed actor's thread only: an actor it spawns (a helper whose own
        # behaviour is not under test) must not take ids from the recorded sequence.
        def ids_for_actor() -> bytes:
            return ids() if actor is None or current_actor() == actor else new_id()

        super().__init__(name, registry=registry, ids=ids_for_actor, clock=clock, monotonic=clock)
        self.actor = actor
        self.sent: collections.deque[tuple[Header, bytes]] = collections.deque()
        self.clock_values: collections.deque[float] = collections.deque()
        self.effects: collections.deque[tuple[bytes, bytes]] = collections.deque()
        # A divergence raised inside the actor's handler would become an error reply; keep the first one
        # so the harness reports it as what it is.
        self.divergence: ReplayDivergence | None = None
        self._running = True

    replaying = True

    def start(self, timeout: float = 10.0) -> Node:
        return self

    def stop(self, timeout: float = 5.0) -> tuple[str, ...]:
        self._running = False
        for ref in list(self._actors.values()):
            ref.stop(block=True, timeout=timeout)
        self._actors.clear()
        return ()

    def local_message(self, dst: str, message: Any, *, moved: bool = False) -> Any:
        return None  # every send is compared as its encoded body: never hand a message over unencoded

    def send(
        self,
        header: Header,
        body: bytes,
        *,
        deliver: Callable[..., None] | None = None,
        timeout: float | None = None,
        route: Route | None = None,
        message: Any = None,  # always None here (local_message above)
    ) -> None:
        if deliver is not None:
            self.pending.add(PendingRequest(header.id, node_of(header.dst), float("inf"), deliver))
        if self.actor is None or header.src == self.actor:
            self.sent.append((header, body))  # what other (spawned) actors send is not under comparison

    def now(self, actor: str) -> float:
        if not self.clock_values:
            self._diverge(ReplayDivergence(None, f"{actor} read the clock more often than recorded", []))
        return self.clock_values.popleft()

    def _diverge(self, divergence: ReplayDivergence) -> None:
        if self.divergence is None:
            self.divergence = divergence
        raise divergence

    def effect(self, actor: str, key: bytes, produce: Callable[[], bytes]) -> bytes:
        if self.actor is not None and actor != self.actor:
            return produce()  # a helper actor's own effect: not under replay
        if not self.effects:
            self._diverge(ReplayDivergence(None, f"{actor} asked for effect {key!r} that the log lacks", []))
        recorded_key, value = self.effects.popleft()
        if recorded_key != key:
            self._diverge(
                ReplayDivergence(None, f"{actor} asked for effect {key!r}", [f"recorded: {recorded_key!r}"])
            )
        return value


class Replay:
    """Replay ``actor`` (an address such as ``n1/echo``) from ``log`` against ``actor_class``."""

    def __init__(
        self,
        log: CaptureLog | str | os.PathLike[str],
        actor: str,
        registry: Registry,
        *,
        timeout: float = 10.0,
        window: int = 64,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, not {window!r}")
        self.log = log if isinstance(log, CaptureLog) else read_log(log)
        if self.log.torn is not None:
            raise ValueError(f"{self.log.path}: torn tail at byte {self.log.torn.offset}; refusing to replay")
        self.actor = actor
        self.registry = registry
        self.timeout = timeout
        self.window = window
        self.records = [r for r in self.log.records if r.actor == actor]
        self.expected = [r for r in self.records if r.at == "send"]
        self._now = 0.0

    def run(self, actor_class: Any, *args: Any, **kwargs: Any) -> ReplayResult:
        recorded_ids = collections.deque(decode_header(r.frames[0]).id for r in self.expected)
        node = ReplayNode(
            node_of(self.actor),
            self.registry,
            ids=lambda: recorded_ids.popleft() if recorded_ids else os.urandom(16),
            clock=lambda: self._now,
            actor=self.actor,
        )
        for r in self.records:
            if r.at == "clock":
                node.clock_values.append(float(r.frames[0].decode()))
            elif r.at == "effect" and r.frames[0] != MAILBOX:
                node.effects.append((r.frames[0], r.frames[1]))
        ref = node.spawn(actor_class, self.actor.partition("/")[2], *args, **kwargs)
        compared = delivered = told = 0
        try:
            expected = iter(self.expected)

            def settle() -> int:
                # Wait until the actor has handled everything told so far (a mailbox round trip), then compare
                # what it sent, in order, with the recorded sends.
                ref.ask(BARRIER, timeout=self.timeout)
                if node.divergence is not None:
                    raise node.divergence
                return self._compare_sent(node, expected)

            for record in self.records:
                if record.at == "effect" and record.frames[0] == MAILBOX:
                    ref.tell(ReplayedMailbox(record.frames[1]))
                elif record.at != "deliver":
                    continue
                else:
                    header = decode_header(record.frames[0])
                    if header.is_reply:
                        # The request it answers must have been sent (its continuation registered) first.
                        if told:
                            compared += settle()
                            told = 0
                        self._now = header.ts
                        node.pending.resolve(header.corr or b"", node.reply_of(header, record.frames[1]))
                    else:
                        self._now = header.ts
                        ref.tell(Inbound(header, record.frames[1], None))
                delivered += 1
                told += 1
                if told >= self.window:
                    compared += settle()
                    told = 0
            compared += settle()
            leftover = next(expected, None)
            if leftover is not None:
                raise ReplayDivergence(
                    leftover.n,
                    "the actor never sent this recorded message",
                    [_describe(self.registry, leftover)],
                )
        finally:
            node.stop(self.timeout)
        return ReplayResult(self.actor, delivered, compared)

    def _compare_sent(self, node: ReplayNode, expected: Any) -> int:
        count = 0
        while node.sent:
            header, body = node.sent.popleft()
            record: Record | None = next(expected, None)
            if record is None:
                raise ReplayDivergence(
                    None, f"the actor sent {header.kind} to {header.dst} beyond the log", []
                )
            diff = _diff_sent(self.registry, record.frames, header, body)
            if diff:
                raise ReplayDivergence(record.n, f"{header.kind} from {header.src}", diff)
            count += 1
        return count


_COMPARED = tuple(i for i, name in enumerate(Header._fields) if name not in IGNORED_HEADER_FIELDS)


def _diff_sent(registry: Registry, expected: tuple[bytes, ...], header: Header, body: bytes) -> list[str]:
    """``diff_envelopes`` for a message the replayed actor sent, with a fast path for an equal one."""
    recorded = decode_header(expected[0])
    if body == expected[1] and all(recorded[i] == header[i] for i in _COMPARED):
        return []
    return diff_envelopes(registry, expected, [encode_header(header), body])


def _describe(registry: Registry, record: Record) -> str:
    header = decode_header(record.frames[0])
    return f"{header.kind} {header.src} -> {header.dst} ({header.flow})"


def diff_envelopes(
    registry: Registry,
    expected: tuple[bytes, ...] | list[bytes],
    actual: list[bytes],
    ignored: frozenset[str] = IGNORED_HEADER_FIELDS,
) -> list[str]:
    """Field-by-field differences between two recorded envelopes (header, then body)."""
    eh, ah = decode_header(expected[0]), decode_header(actual[0])
    diff = [
        f"header.{name}: expected {getattr(eh, name)!r}, got {getattr(ah, name)!r}"
        for name in Header._fields
        if name not in ignored and _header_value(name, eh) != _header_value(name, ah)
    ]
    if eh.kind != ah.kind:
        return diff
    eb = registry.decode(eh.kind, expected[1])
    ab = registry.decode(ah.kind, actual[1])
    diff.extend(_diff_values("body", eb, ab))
    return diff


def _header_value(name: str, header: Header) -> Any:
    value = getattr(header, name)
    if name in ("src", "dst") and isinstance(value, str) and _is_client(value):
        return "client"  # a plain thread's address is made per run
    return value


def _diff_values(path: str, expected: Any, actual: Any) -> list[str]:
    if dataclasses.is_dataclass(expected) and type(expected) is type(actual):
        out: list[str] = []
        for f in dataclasses.fields(expected):
            out.extend(_diff_values(f"{path}.{f.name}", getattr(expected, f.name), getattr(actual, f.name)))
        return out
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for key in sorted(expected.keys() | actual.keys(), key=str):
            out.extend(
                _diff_values(f"{path}[{key!r}]", expected.get(key, _MISSING), actual.get(key, _MISSING))
            )
        return out
    if expected != actual:
        return [f"{path}: expected {expected!r}, got {actual!r}"]
    return []


_MISSING = type("_Missing", (), {"__repr__": lambda self: "<missing>"})()


# ------------------------------------------------------------------------------- two logs of one scenario
# A header field that differs between two runs of the same scenario by construction: message ids are drawn
# per run (so ``corr``, which names one, too).
RUN_HEADER_FIELDS = IGNORED_HEADER_FIELDS | {"id", "corr"}


@frozen
class LogDivergence:
    """The first place two logs of one scenario differ: ``index`` is the record ``n`` in the first log (None:
    past its end), ``actor`` the actor whose sends differ, ``what`` a sentence and ``diff`` the fields."""

    index: int | None
    actor: str
    what: str
    diff: tuple[str, ...]

    def __str__(self) -> str:
        where = "past the end of the first log" if self.index is None else f"record {self.index}"
        return f"first divergence at {where} ({self.actor}): {self.what}" + "".join(
            f"\n  {d}" for d in self.diff
        )


def _is_client(address: str) -> bool:
    # A plain thread's address (``node/client.<thread id>.<n>``) is made per run.
    return address.partition("/")[2].startswith("client.")


def _sends_by_actor(log: CaptureLog) -> dict[str, list[Record]]:
    sends: dict[str, list[Record]] = {}
    for record in log.records:
        if (
            record.at == "send"
            and not _is_client(record.actor)
            and decode_header(record.frames[0]).kind not in LIVENESS_KINDS
        ):
            sends.setdefault(record.actor, []).append(record)
    return sends


def first_divergence(expected: CaptureLog, actual: CaptureLog, registry: Registry) -> LogDivergence | None:
    """Compare every actor's sends in two logs of one scenario (a recording and a later run of it), in
    order, header and body field by field, ignoring what differs per run by construction (message ids,
    times, sequence numbers, a plain thread's address, the heartbeats and directory lookups of
    ``LIVENESS_KINDS``); the earliest difference in ``expected`` wins."""
    want, got = _sends_by_actor(expected), _sends_by_actor(actual)
    found: list[LogDivergence] = []
    for actor in sorted(want.keys() | got.keys()):
        a, b = want.get(actor, []), got.get(actor, [])
        for i in range(max(len(a), len(b))):
            if i >= len(a):
                found.append(
                    LogDivergence(None, actor, "sent beyond the first log", (_describe(registry, b[i]),))
                )
                break
            if i >= len(b):
                found.append(
                    LogDivergence(
                        a[i].n, actor, "never sent this recorded message", (_describe(registry, a[i]),)
                    )
                )
                break
            diff = diff_envelopes(registry, a[i].frames, list(b[i].frames), RUN_HEADER_FIELDS)
            if diff:
                found.append(
                    LogDivergence(a[i].n, actor, f"{decode_header(a[i].frames[0]).kind} differs", tuple(diff))
                )
                break
    if not found:
        return None
    return min(found, key=lambda d: (d.index is None, d.index or 0))
