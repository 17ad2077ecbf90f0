"""A bus node in its own process, for integration tests: echo actor, optional CURVE, optional capture.

Prints one line ``READY {"endpoints": [...], "public_key": ...}`` on stdout once bound, then serves until
SIGTERM/SIGINT (or stdin closes when --stdin-lifeline is given, so a dying test never leaves it behind).

Test-only actors (also importable in-process as ``peers.bus_peer``):

- ``RecorderActor`` (``--recorder NAME``): records the ``seq`` of every ``Echo`` it receives, in mailbox
  order; answers ``Echo(text="count")`` with ``Echo(seq=<how many>)``, ``Echo(text="dump")`` with
  ``Echo(data=[seq, ...])``, and ``Echo(text="await", seq=N)`` once it has recorded N (a barrier that
  needs no ordering between the asker's connections); any other asked ``Echo`` is recorded and sent back.
- ``StatsActor`` (``--stats-actor``, at ``NODE/stats``): answers any request with the node's counters as
  ``Echo(data={counter: n})``, so a test can read an out-of-process node's drops.
- ``--announce-hold``: echo actors print ``HELD <note>`` on stdout when they accept a ``Hold`` request, so a
  test knows the request is in flight before it kills this process.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from actors.app.echo import EchoActor
from actors.base import DEFER, Context
from transport import KeyPair, Node, Peer, Security
from transport.capture import CaptureWriter
from transport.codec import Registry
from transport.messages import SYSTEM_MESSAGES, Echo, Hold

_stdout_lock = threading.Lock()


class RecorderActor(EchoActor):
    """Records ``Echo.seq`` values in arrival (mailbox) order; see the module docstring."""

    def __init__(self, node: Any, address: str) -> None:
        super().__init__(node, address)
        self.seen: list[int] = []
        self.waiting: list[tuple[int, Context]] = []  # "await" requests: (count wanted, their context)

    def handle(self, message: Any, ctx: Context) -> Any:
        if not isinstance(message, Echo):
            return super().handle(message, ctx)
        self.handled += 1
        if ctx.wants_reply and message.text == "count":
            return Echo(text="count", seq=len(self.seen))
        if ctx.wants_reply and message.text == "dump":
            return Echo(text="dump", seq=len(self.seen), data=list(self.seen))
        if ctx.wants_reply and message.text == "await":
            if len(self.seen) >= message.seq:
                return Echo(text="await", seq=len(self.seen))
            self.waiting.append((message.seq, ctx))
            return DEFER  # answered by a later recording, or failed (Unavailable) if this actor stops
        self.seen.append(message.seq)
        if self.waiting:
            still = []
            for wanted, waiter in self.waiting:
                if len(self.seen) >= wanted:
                    waiter.reply(Echo(text="await", seq=len(self.seen)))
                else:
                    still.append((wanted, waiter))
            self.waiting = still
        return message


class NodeRecorderActor(RecorderActor):
    """A ``RecorderActor`` without a socket of its own: everything reaches it through its node."""

    DIRECT = False


class StatsActor(EchoActor):
    """Answers every request with its node's counters (``Stats.snapshot()``)."""

    def handle(self, message: Any, ctx: Context) -> Any:
        self.handled += 1
        snapshot: dict[str, Any] = dict(self.node.stats.snapshot())
        return Echo(text="stats", data=snapshot)


class AnnouncingEchoActor(EchoActor):
    """An echo actor that says on stdout when it has accepted a ``Hold`` (it never answers one)."""

    def handle(self, message: Any, ctx: Context) -> Any:
        result = super().handle(message, ctx)
        if isinstance(message, Hold):
            with _stdout_lock:
                print(f"HELD {message.note}", flush=True)
        return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--bind", action="append", default=[])
    ap.add_argument("--secret-key-file")
    ap.add_argument("--allow", action="append", default=[], help="NODE=Z85KEY")
    ap.add_argument("--peer", action="append", default=[], help="NAME=ENDPOINT[=SERVERKEY]")
    ap.add_argument("--plain-tcp", action="store_true")
    ap.add_argument("--capture")
    ap.add_argument("--actor", action="append", default=["echo"])
    ap.add_argument("--recorder", action="append", default=[], help="spawn a RecorderActor with this name")
    ap.add_argument(
        "--node-recorder", action="append", default=[], help="spawn a NodeRecorderActor with this name"
    )
    ap.add_argument("--stats-actor", action="store_true", help="spawn a StatsActor named 'stats'")
    ap.add_argument("--announce-hold", action="store_true", help="echo actors print 'HELD <note>'")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20)
    ap.add_argument("--stdin-lifeline", action="store_true")
    args = ap.parse_args()

    keys = KeyPair.load(args.secret_key_file) if args.secret_key_file else None
    allow = {key: node for node, key in (a.split("=", 1) for a in args.allow)}
    security = Security(keys=keys, allow=allow, plain_insecure_for_benchmarks=args.plain_tcp)
    peers = []
    for text in args.peer:
        name, endpoint, *key = text.split("=", 2)
        peers.append(Peer(name, endpoint, key[0] if key else None))
    registry = Registry(SYSTEM_MESSAGES, max_body_bytes=args.max_body_bytes)
    capture = (
        CaptureWriter(args.capture, node=args.name, schema=registry.schema_hash()) if args.capture else None
    )
    node = Node(args.name, bind=args.bind, peers=peers, security=security, registry=registry, capture=capture)
    node.start()
    echo_class = AnnouncingEchoActor if args.announce_hold else EchoActor
    for actor in dict.fromkeys(args.actor):  # "echo" is always there; naming it again is harmless
        node.spawn(echo_class, actor)
    for actor in args.recorder:
        node.spawn(RecorderActor, actor)
    for actor in args.node_recorder:
        node.spawn(NodeRecorderActor, actor)
    if args.stats_actor:
        node.spawn(StatsActor, "stats")
    with _stdout_lock:
        print(
            "READY "
            + json.dumps({"endpoints": list(node.endpoints), "public_key": keys.public if keys else None}),
            flush=True,
        )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    if args.stdin_lifeline:

        def lifeline() -> None:
            sys.stdin.read()  # returns when the test process (our stdin's writer) goes away
            done.set()

        threading.Thread(target=lifeline, daemon=True).start()
    done.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
