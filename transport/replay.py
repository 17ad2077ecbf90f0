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
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transport.capture import CaptureLog, Record, read_log
from transport.codec import Registry, decode_header, encode_header
from transport.envelope import Header, Inbound, Route, new_id, node_of
from transport.node import BARRIER, Node
from transport.pending import PendingRequest, current_actor

IGNORED_HEADER_FIELDS = frozenset(("ts", "deadline", "seq", "auth"))


class ReplayDivergence(AssertionError):
    """The replayed actor did something other than what the log recorded."""

    def __init__(self, index: int | None, what: str, diff: list[str]) -> None:
        where = "end of log" if index is None else f"record {index}"
        super().__init__(f"first divergence at {where}: {what}" + "".join(f"\n  {d}" for d in diff))
        self.index = index
        self.what = what
        self.diff = diff


@dataclass(frozen=True, slots=True)
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

    def start(self, timeout: float = 10.0) -> Node:
        return self

    def stop(self, timeout: float = 5.0) -> tuple[str, ...]:
        self._running = False
        for ref in list(self._actors.values()):
            ref.stop(block=True, timeout=timeout)
        self._actors.clear()
        return ()

    def local_message(self, dst: str, message: Any) -> Any:
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
    ) -> None:
        self.log = log if isinstance(log, CaptureLog) else read_log(log)
        if self.log.torn is not None:
            raise ValueError(f"{self.log.path}: torn tail at byte {self.log.torn.offset}; refusing to replay")
        self.actor = actor
        self.registry = registry
        self.timeout = timeout
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
            elif r.at == "effect":
                node.effects.append((r.frames[0], r.frames[1]))
        ref = node.spawn(actor_class, self.actor.partition("/")[2], *args, **kwargs)
        compared = delivered = 0
        try:
            expected = iter(self.expected)
            for record in self.records:
                if record.at != "deliver":
                    continue
                header = decode_header(record.frames[0])
                self._now = header.ts
                if header.is_reply:
                    node.pending.resolve(header.corr or b"", node.reply_of(header, record.frames[1]))
                else:
                    ref.tell(Inbound(header, record.frames[1], None))
                delivered += 1
                # Wait until the actor has handled everything delivered so far (a mailbox round trip).
                ref.ask(BARRIER, timeout=self.timeout)
                if node.divergence is not None:
                    raise node.divergence
                compared += self._compare_sent(node, expected)
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
            diff = diff_envelopes(self.registry, record.frames, [encode_header(header), body])
            if diff:
                raise ReplayDivergence(record.n, f"{header.kind} from {header.src}", diff)
            count += 1
        return count


def _describe(registry: Registry, record: Record) -> str:
    header = decode_header(record.frames[0])
    return f"{header.kind} {header.src} -> {header.dst} ({header.flow})"


def diff_envelopes(
    registry: Registry, expected: tuple[bytes, ...] | list[bytes], actual: list[bytes]
) -> list[str]:
    """Field-by-field differences between two recorded envelopes (header, then body)."""
    eh, ah = decode_header(expected[0]), decode_header(actual[0])
    diff = [
        f"header.{name}: expected {getattr(eh, name)!r}, got {getattr(ah, name)!r}"
        for name in Header._fields
        if name not in IGNORED_HEADER_FIELDS and getattr(eh, name) != getattr(ah, name)
    ]
    if eh.kind != ah.kind:
        return diff
    eb = registry.decode(eh.kind, expected[1])
    ab = registry.decode(ah.kind, actual[1])
    diff.extend(_diff_values("body", eb, ab))
    return diff


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
