"""A client node in its own process (e.g. in another network namespace): connects to one server node, runs
ask + ping + stream + tells, prints one ``RESULT {json}`` line and exits 0.

On the first bus error it prints ``RESULT {"error": <class name>, "message": ..., "step": ...}`` instead
(still exit 0: the test reads the outcome). The server is a ``bus_peer.py`` with an echo actor and a
recorder (``--recorder rec``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from transport import BusError, KeyPair, Node, Peer, Security
from transport.messages import Echo, EchoStream, Hold, Ping
from transport.sockets import SocketOptions


def run(node: Node, server: str, args: argparse.Namespace) -> dict[str, Any]:
    echo, rec = f"{server}/{args.echo}", f"{server}/{args.recorder}"
    timeout = args.timeout
    if args.hold:
        # One request the server accepts and never answers: only the connection's fate decides it.
        try:
            node.request(echo, Hold(note="held"), timeout=timeout)
        except BusError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "step": "hold"}
        return {"error": None, "step": "hold"}
    result: dict[str, Any] = {}
    step = "ask"
    try:
        reply = node.request(echo, Echo(text="across", seq=7, payload=b"\x00\x01"), timeout=timeout)
        result["ask"] = {"text": reply.text, "seq": reply.seq, "payload": reply.payload.hex()}
        step = "ping"
        result["pong"] = node.request(echo, Ping(nonce=5), timeout=timeout).nonce
        step = "stream"
        result["stream"] = [m.seq for m in node.stream(echo, EchoStream(count=3), timeout=timeout)]
        step = "connect"
        node.connect(node.peers()[server], wait=timeout)  # the I/O thread's own connection, for tells
        step = "tell"
        for n in args.tell:
            node.tell(rec, Echo(seq=n))
        step = "await"
        node.request(rec, Echo(text="await", seq=len(args.tell)), timeout=timeout)  # all recorded
        result["recorded"] = list(node.request(rec, Echo(text="dump"), timeout=timeout).data)
    except BusError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "step": step, **result}
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--server", required=True, help="NAME=ENDPOINT[=SERVERKEY]")
    ap.add_argument("--secret-key-file")
    ap.add_argument("--echo", default="echo")
    ap.add_argument("--recorder", default="rec")
    ap.add_argument("--tell", type=int, action="append", default=[])
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--hold", action="store_true", help="send one Hold request and report how it ended")
    ap.add_argument("--heartbeat-ms", help="IVL,TIMEOUT: ZMTP heartbeat interval and timeout on tcp")
    args = ap.parse_args()

    name, endpoint, *key = args.server.split("=", 2)
    keys = KeyPair.load(args.secret_key_file) if args.secret_key_file else None
    options = None
    if args.heartbeat_ms:
        ivl, hb_timeout = (int(x) for x in args.heartbeat_ms.split(","))
        options = SocketOptions(
            max_message_bytes=1 << 21, heartbeat_ivl_ms=ivl, heartbeat_timeout_ms=hb_timeout
        )
    node = Node(
        args.name,
        peers=[Peer(name, endpoint, key[0] if key else None)],
        security=Security(keys=keys),
        options=options,
    )
    node.start()
    try:
        result = run(node, name, args)
    finally:
        node.stop()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
