"""The envelope: a header that routers read, a body they never decode, and actor addresses.

On the wire a message is ZeroMQ multipart ``[routing…, b"", header, body]``; both frames are msgpack
(``transport.codec``). Routers route and authorise on the header alone.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

from transport.records import frozen

FORMAT_VERSION = 1

Flow = Literal["tell", "ask", "stream", "reply", "part"]
# tell: one-way; ask: one terminal reply; stream: zero or more `part` replies then one `reply`.
FLOWS: frozenset[str] = frozenset(("tell", "ask", "stream", "reply", "part"))
REQUEST_FLOWS: frozenset[str] = frozenset(("ask", "stream"))
REPLY_FLOWS: frozenset[str] = frozenset(("reply", "part"))

_NODE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_PART_RE = re.compile(r"[A-Za-z0-9_.:@+-]{1,128}")


def id_source() -> Callable[[], bytes]:
    """A source of message ids: 8 random bytes, then a counter. Unique across processes and hosts without
    coordination, and no system call per message (os.urandom per send showed in the round-trip time).

    Every message takes one, so it is C calls only (60 ns here, against 123 for the same as a Python
    method): ``next`` of a ``map`` of ``int.to_bytes`` over a counter, which runs no Python code, so no
    other thread can come between a number and its bytes."""
    prefix = int.from_bytes(os.urandom(8), "big") << 64
    numbers = itertools.count(prefix | 1)
    big: itertools.repeat[Literal["big"]] = itertools.repeat("big")
    return functools.partial(next, map(int.to_bytes, numbers, itertools.repeat(16), big))


new_id = id_source()


@frozen
class Address:
    """``node/actor[/instance]``; ``actor`` (with its instance) is the key a node looks actors up by."""

    node: str
    actor: str

    @classmethod
    def parse(cls, text: str) -> Address:
        node, sep, actor = text.partition("/")
        parts = actor.split("/")
        if (
            not sep
            or not _NODE_RE.fullmatch(node)
            or not 1 <= len(parts) <= 2
            or not all(_PART_RE.fullmatch(p) for p in parts)
        ):
            raise ValueError(f"not an actor address (node/actor[/instance]): {text!r}")
        return cls(node, actor)

    def __str__(self) -> str:
        return f"{self.node}/{self.actor}"


@functools.lru_cache(maxsize=4096)
def is_address(text: str) -> bool:
    """Cached: the same few addresses arrive over and over, and a regex per frame shows in the bench."""
    try:
        Address.parse(text)
    except ValueError:
        return False
    return True


def is_node_name(text: str) -> bool:
    return _NODE_RE.fullmatch(text) is not None


def node_of(address: str) -> str:
    """The node part of an address (no validation: callers validated the address on decode)."""
    return address.partition("/")[0]


class Header(NamedTuple):
    """Everything a router needs; the body stays opaque bytes until the target actor decodes it.

    ``auth`` is stamped by the *receiving* node from the authenticated transport identity; whatever a sender
    puts there is overwritten. ``idem`` is stable across retries and never contains ``attempt``.
    ``deadline`` is absolute wall-clock seconds, so it survives the hop between hosts (their clocks are
    assumed NTP-close; each side also keeps its own monotonic timer).
    """

    id: bytes
    kind: str
    src: str
    dst: str
    flow: Flow
    ts: float
    seq: int = 0
    corr: bytes | None = None
    cause: bytes | None = None
    conv: str | None = None
    turn: str | None = None
    idem: str | None = None
    attempt: int = 1
    deadline: float | None = None
    auth: str | None = None
    v: int = FORMAT_VERSION

    # A NamedTuple rather than a frozen dataclass: immutable all the same, and five times cheaper to build,
    # which matters on a path that builds two per round trip.

    def with_auth(self, auth: str | None) -> Header:
        return self._replace(auth=auth)

    @property
    def is_request(self) -> bool:
        return self.flow in REQUEST_FLOWS

    @property
    def is_reply(self) -> bool:
        return self.flow in REPLY_FLOWS


# The way back to a sender: ("r", router index, routing id) for a connection that came in on one of the
# node's ROUTERs, ("d", peer name) for one this node opened, ("self", routing id, inbox) for a direct
# actor's own socket.
Route = tuple[Any, ...]


class Inbound(NamedTuple):
    """What lands in an actor's mailbox: the decoded header, the still-encoded body, the way back.

    From a sender in the same process (and no capture), ``message`` is the sent message itself and ``body``
    is empty: the message was ``Registry.shareable`` (immutable all the way down) or is the sender's copy of
    it (``Registry.local_copy``: its JSON values copied), so handing it over is as isolated as an encoded
    body, without the encode and the decode.

    A NamedTuple, like ``Header``: one is built per message received, a burst of them per batch frame."""

    header: Header
    body: bytes
    route: Route | None
    message: Any = None


class TellBatch:
    """The tells of one ``sys.batch`` frame (WIRE.md 7a), checked as a whole where the frame was read
    (``codec.split_batch``), each tell's header made only as the tell is taken, on the thread that takes
    it (``pairs``; an actor takes them so, and iterating gives each as its ``Inbound``): tell *i*'s
    header is the batch header with its own id, kind and seq (the batch's ``seq + i``; 0 stays 0).

    So the thread that read the frame (the node's I/O thread, for most actors) builds nothing per tell,
    and each tell's header is made, used and dropped in turn by the actor's thread instead of a burst of
    them being made on one thread and freed on another (about 0.3 µs of the I/O thread per tell instead
    of 0.8 in ``scripts/bench --only throughput``). Taking them again makes them again."""

    __slots__ = ("bodies", "header", "ids", "kinds", "route")

    def __init__(
        self,
        header: Header,
        ids: Sequence[bytes],
        kinds: Sequence[str],
        bodies: Sequence[bytes],
        route: Route | None,
    ) -> None:
        self.header = header
        self.ids = ids
        self.kinds = kinds
        self.bodies = bodies
        self.route = route

    def __len__(self) -> int:
        return len(self.ids)

    def pairs(self) -> Iterator[tuple[Header, bytes]]:
        """Each tell's header, made as it is taken, and its body, in order."""
        # Column-wise, in C loops (zip, map): the batch header's slots repeated, each tell's own id, kind
        # and seq; a Python loop building the same tuples cost a fifth more per tell.
        header, again = self.header, itertools.repeat
        src, dst, flow, ts, seq = header[2:7]
        seqs = range(seq, seq + len(self.ids)) if seq else again(0)
        columns = (
            self.ids,
            self.kinds,
            again(src),
            again(dst),
            again(flow),
            again(ts),
            seqs,
            *map(again, header[7:]),
        )
        headers = map(functools.partial(_new_tuple, Header), zip(*columns, strict=False))  # repeats: endless
        return zip(headers, self.bodies, strict=False)

    def __iter__(self) -> Iterator[Inbound]:
        route = self.route
        for header, body in self.pairs():
            yield Inbound(header, body, route)

    def __repr__(self) -> str:
        return f"TellBatch({len(self.ids)} tells, {self.header.src} -> {self.header.dst})"


class InboundBatch:
    """Several messages for one actor, put into its mailbox as one item: one hand-off and one wake-up for
    a burst instead of one per message. ``parts`` holds them in arrival order, each an ``Inbound`` or a
    ``TellBatch`` of several. Only actors whose class sets ``TAKES_INBOUND_BATCH`` get one; they handle
    every message in order, exactly as if each had been its own mailbox item (iterating the batch gives
    them so)."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[Inbound | TellBatch]) -> None:
        self.parts = parts

    def __iter__(self) -> Iterator[Inbound]:
        for part in self.parts:
            if isinstance(part, TellBatch):
                yield from part
            else:
                yield part

    def __repr__(self) -> str:
        return f"InboundBatch({len(self.parts)} parts)"


_new_tuple = tuple.__new__  # a NamedTuple built from a tuple of its slots, past its Python __new__
