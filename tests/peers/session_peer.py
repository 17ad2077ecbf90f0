"""One part of a run_session topology in its own process: ``--role router`` or ``--role loop``.

``router``: a node with a Router whose ``scripted`` provider takes its scripts from this process's stdin, so
a test can script each scenario as it goes. Commands, one per line: ``ADD <json list of scripts>`` (answers
``ADDED``) and ``TURNS`` (answers ``TURNS <json>``: per provider turn so far, its messages as
``[role, content]`` pairs, its reasoning effort and its tool's name and description).
``loop``: a node with a ``SessionLoopService`` at ``<name>/sessions``; each run it is asked for runs in a
session loop here, reaching the Router and the host through ``--peer NAME=ENDPOINT``; the stdin command
``CONNECT NAME=ENDPOINT`` reconnects to a peer that restarted (answers ``CONNECTED``).

Prints ``READY {"endpoints": [...]}`` once bound; stops when stdin closes or on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from actors.app.wiring import registry
from actors.router.actor import RouterActor
from actors.router.providers.scripted import ScriptedProvider
from actors.runs.session import SessionLoopService
from transport import Node, Peer


def serve_commands(provider: ScriptedProvider, done: threading.Event) -> None:
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "ADD":
            provider.add(*json.loads(argument))
            print("ADDED", flush=True)
        elif command == "TURNS":
            turns = [
                {
                    "messages": [[m.role, m.content] for m in turn.messages],
                    "reasoning_effort": turn.reasoning_effort,
                    "tool": [turn.tool.name, turn.tool.description],
                }
                for turn in list(provider.turns)
            ]
            print("TURNS " + json.dumps(turns), flush=True)
        elif command:
            print(f"UNKNOWN {command}", flush=True)
    done.set()


def serve_loop_commands(node: Node, done: threading.Event) -> None:
    """``CONNECT NAME=ENDPOINT``: reconnect to a peer that restarted, answering ``CONNECTED`` once the
    handshake is done (or ``NOT CONNECTED <why>``)."""
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "CONNECT":
            try:
                node.connect(Peer(*argument.split("=", 1)), wait=20)
            except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
                print(f"NOT CONNECTED {exc}", flush=True)
            else:
                print("CONNECTED", flush=True)
        elif command:
            print(f"UNKNOWN {command}", flush=True)
    done.set()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("router", "loop"), required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--data-dir", help="router: the receipt ledger's folder")
    ap.add_argument("--peer", action="append", default=[], help="NAME=ENDPOINT")
    ap.add_argument("--stdin-lifeline", action="store_true", help="stop when stdin closes (always on)")
    args = ap.parse_args()
    peers = [Peer(*p.split("=", 1)) for p in args.peer]
    node = Node(args.name, bind=[args.bind], registry=registry(), peers=peers)
    node.start()
    for peer in peers:
        node.connect(peer, wait=20)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    if args.role == "router":
        provider = ScriptedProvider()
        node.spawn(RouterActor, "router", data_dir=Path(args.data_dir), providers={"scripted": provider})
        print("READY " + json.dumps({"endpoints": list(node.endpoints)}), flush=True)
        threading.Thread(target=serve_commands, args=(provider, done), daemon=True).start()
    else:
        node.spawn(SessionLoopService, "sessions")
        print("READY " + json.dumps({"endpoints": list(node.endpoints)}), flush=True)
        threading.Thread(target=serve_loop_commands, args=(node, done), daemon=True).start()
    done.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
