"""A background-job runner in its own process: a node with a ``JobRunnerActor`` at ``<name>/jobs``.
Prints ``READY {"endpoints": [...]}`` once bound; serves until SIGTERM or stdin closes."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from actors.app.wiring import registry
from actors.conversation.jobs import JobRunnerActor
from transport import Node, Peer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--stdin-lifeline", action="store_true", help="stop when stdin closes (always on)")
    ap.add_argument("--peer", action="append", default=[], help="NAME=ENDPOINT of a jobs' owner node")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="runner %(name)s: %(message)s")
    peers = [Peer(*spec.split("=", 1)) for spec in args.peer]
    node = Node(args.name, bind=[args.bind], registry=registry(), peers=peers)
    node.start()
    node.spawn(JobRunnerActor, "jobs")
    for peer in peers:  # the runner tells each job's owner when the job ends: be connected before READY
        node.connect(node.peers()[peer.name], wait=20)
    print("READY " + json.dumps({"endpoints": list(node.endpoints)}), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())

    def lifeline() -> None:
        for _ in sys.stdin:
            pass
        done.set()

    threading.Thread(target=lifeline, daemon=True).start()
    done.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
