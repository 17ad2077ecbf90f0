"""The owner of one Router turn, in its own process: starts the turn, reads it up to its first tool call,
prints ``TOOL_CALL {"operation_id": ...}`` and then never answers it (a test SIGKILLs this process there).

``--owner handle``: the turn is started by an inference handle actor (``InferenceRuntime``), as the
session loops do; the Router's heartbeat reaches that actor's mailbox. ``--owner client``: the turn is
started by this process's main thread with ``RouterClient``; the heartbeat can only reach the node.

Prints ``READY {}`` once connected, like the other peers, and serves until SIGTERM/SIGINT or until stdin
closes (``--stdin-lifeline``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import uuid
from typing import Any

from actors.app.wiring import registry
from actors.inference.handle import PreparedRound, SessionInferenceEvent, SessionInferenceRequest
from actors.router.client import RouterClient
from actors.router.messages import StartTurn, TurnToolCall
from actors.runs.runtime import InferenceRuntime
from transport import Node, Peer


def by_handle(node: Node, router: str) -> tuple[uuid.UUID, Any]:
    request = SessionInferenceRequest(
        user_id="owner",
        operation_id=uuid.uuid4(),
        round=1,
        prepared=PreparedRound(
            input="run the tool",
            provider_input="run the tool",
            continuation=None,
            model="scripted",
            reasoning_effort="",
            tool_description="tools: slow",
            timeout=None,
        ),
    )
    handle = InferenceRuntime(node, router, timeout=20).start_session_inference(request)
    while not isinstance(handle.next_event(), SessionInferenceEvent.ToolCall):
        pass
    return handle.operation_id, handle  # the handle is kept: it is never closed nor answered


def by_client(node: Node, router: str) -> tuple[uuid.UUID, Any]:
    client = RouterClient(node, router, timeout=20)
    op = client.start_turn(
        StartTurn(
            user_id="owner",
            parent_operation_id=uuid.uuid4(),
            model="scripted",
            input="run the tool",
            tool_description="tools: slow",
        )
    ).operation_id
    while not isinstance(client.next_event(op), TurnToolCall):
        pass
    return op, client


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--router", required=True, help="NODE=ENDPOINT of the Router's node")
    ap.add_argument("--owner", choices=("handle", "client"), default="handle")
    ap.add_argument("--stdin-lifeline", action="store_true")
    args = ap.parse_args()
    router_node, endpoint = args.router.split("=", 1)
    node = Node(args.name, registry=registry(), peers=[Peer(router_node, endpoint)])
    node.start()
    node.connect(node.peers()[router_node], wait=20)
    print("READY {}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    if args.stdin_lifeline:

        def lifeline() -> None:
            sys.stdin.read()  # returns when the test process (our stdin's writer) goes away
            done.set()

        threading.Thread(target=lifeline, daemon=True).start()
    start = by_handle if args.owner == "handle" else by_client
    op, _keep = start(node, f"{router_node}/router")
    print("TOOL_CALL " + json.dumps({"operation_id": str(op)}), flush=True)
    done.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
