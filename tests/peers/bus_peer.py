"""A bus node in its own process, for integration tests: echo actor, optional CURVE, optional capture.

Prints one line ``READY {"endpoints": [...], "public_key": ...}`` on stdout once bound, then serves until
SIGTERM/SIGINT (or stdin closes when --stdin-lifeline is given, so a dying test never leaves it behind).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from actors.echo import EchoActor
from transport import KeyPair, Node, Peer, Security
from transport.capture import CaptureWriter
from transport.codec import Registry
from transport.messages import SYSTEM_MESSAGES


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
    for actor in args.actor:
        node.spawn(EchoActor, actor)
    print("READY " + json.dumps({"endpoints": list(node.endpoints),
                                 "public_key": keys.public if keys else None}), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    if args.stdin_lifeline:
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
