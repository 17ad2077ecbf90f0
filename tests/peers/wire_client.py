"""A kbus client written from ``transport/WIRE.md`` alone: pyzmq, msgpack and the standard library only.

Usage: ``wire_client.py ENDPOINT --node NAME``. Against a node with an echo actor it runs the scenarios of
WIRE.md (echo, ping, a stream, a tell and its error tells, an expired deadline, an unknown actor, the
node's counters) and prints one ``RESULT {json}`` line: what each scenario saw, and which kbus modules
were loaded (none may be: this is what a client in another language has to go on).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Any

import msgpack
import zmq

WAIT_MS = 20_000


class WireClient:
    """One DEALER to one node, speaking WIRE.md by hand."""

    def __init__(self, endpoint: str, node: str, me: str = "wc") -> None:
        self.node = node
        self.me = me
        self.src = f"{me}/main"
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self._prefix = os.urandom(8)  # WIRE.md §3: 8 random bytes, then a 64-bit counter
        self._count = itertools.count(1)
        self._seq: dict[str, int] = {}

    def new_id(self) -> bytes:
        return self._prefix + next(self._count).to_bytes(8, "big")

    def send(
        self, kind: str, body: dict[str, Any], *, dst: str, flow: str, deadline: float | None = 0.0
    ) -> bytes:
        """Send one message; ``deadline`` 0.0 means 20 s from now, None means none. Returns its id."""
        now = time.time()
        if deadline == 0.0:
            deadline = now + WAIT_MS / 1000
        seq = self._seq.get(dst, 0) + 1  # WIRE.md §7: per (src, dst), for tell/ask/stream
        self._seq[dst] = seq
        msg_id = self.new_id()
        header = [
            msg_id,  # 0 id
            kind,  # 1 kind
            self.src,  # 2 src
            dst,  # 3 dst
            flow,  # 4 flow
            now,  # 5 ts
            seq,  # 6 seq
            None,  # 7 corr
            None,  # 8 cause
            None,  # 9 conv
            None,  # 10 turn
            None,  # 11 idem
            1,  # 12 attempt
            deadline,  # 13 deadline
            None,  # 14 auth
            1,  # 15 v
        ]
        frames = [b"", msgpack.packb(header, use_bin_type=True), msgpack.packb(body, use_bin_type=True)]
        self.sock.send_multipart(frames)
        return msg_id

    def recv(self) -> dict[str, Any]:
        """The next message: its header slots by name, and its body."""
        if not self.sock.poll(WAIT_MS):
            raise TimeoutError("no message within the wait")
        empty, head, body = self.sock.recv_multipart()
        assert empty == b""
        slots = msgpack.unpackb(head, raw=False)
        names = ("id", "kind", "src", "dst", "flow", "ts", "seq", "corr", "cause", "conv", "turn", "idem")
        names += ("attempt", "deadline", "auth", "v")
        assert len(slots) == 16, slots
        message = dict(zip(names, slots, strict=True))
        message["body"] = msgpack.unpackb(body, raw=False)
        return message

    def ask(self, kind: str, body: dict[str, Any], dst: str, **kw: Any) -> dict[str, Any]:
        sent = self.send(kind, body, dst=dst, flow="ask", **kw)
        answer = self.recv()
        assert answer["corr"] == sent and answer["flow"] == "reply", answer
        return answer

    def close(self) -> None:
        self.sock.close(0)


def shown(message: dict[str, Any]) -> dict[str, Any]:
    """A received message as JSON can hold it (bin as hex)."""

    def plain(value: Any) -> Any:
        if isinstance(value, bytes):
            return value.hex()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return value

    return {k: plain(message[k]) for k in ("kind", "src", "dst", "flow", "body")}


def run(client: WireClient) -> dict[str, Any]:
    echo, directory = f"{client.node}/echo", f"{client.node}/node"
    out: dict[str, Any] = {}
    out["echo"] = shown(client.ask("echo", {"text": "hi", "seq": 7, "payload": b"\x00\x01"}, echo))
    out["ping"] = shown(client.ask("sys.ping", {"nonce": 42}, echo))

    sent = client.send("echo.stream", {"count": 3}, dst=echo, flow="stream")
    answers = [client.recv() for _ in range(4)]
    assert all(a["corr"] == sent for a in answers)
    out["stream"] = [(a["flow"], a["body"]["seq"]) for a in answers]

    # A tell: first sys.hello (WIRE.md §8), so that error tells can find their way back.
    client.send("sys.hello", {"node": client.me}, dst=directory, flow="tell")
    client.send("echo", {"text": "told"}, dst=echo, flow="tell")  # succeeds: nothing comes back
    failing = client.send("echo.fail", {"error": "protocol", "message": "asked to"}, dst=echo, flow="tell")
    lost = client.send("echo", {}, dst=f"{client.node}/ghost", flow="tell")
    # Two error tells, in either order (the node and the actor answer on their own threads: match by corr).
    seen = [client.recv() for _ in range(2)]
    out["tell_errors"] = [
        {"re": "failing" if m["corr"] == failing else "lost" if m["corr"] == lost else "?", **shown(m)}
        for m in seen
    ]
    out["after_tells"] = shown(client.ask("sys.ping", {"nonce": 1}, echo))

    # An expired deadline: dropped unanswered; the ping sent after it is the next thing to arrive.
    expired = client.send("echo", {"text": "late"}, dst=echo, flow="ask", deadline=time.time() - 10)
    after = client.ask("sys.ping", {"nonce": 2}, echo)
    out["expired"] = {"answered": after["corr"] == expired, "next": shown(after)}

    out["unknown_actor"] = shown(client.ask("echo", {}, f"{client.node}/ghost"))
    stats = client.ask("sys.stats", {}, directory)
    out["stats"] = {
        "kind": stats["kind"],
        "expired_on_arrival": stats["body"]["counters"]["expired_on_arrival"],
        "actors": sorted(a["actor"] for a in stats["body"]["actors"]),
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--node", required=True)
    args = ap.parse_args()
    client = WireClient(args.endpoint, args.node)
    try:
        result = run(client)
    finally:
        client.close()
    result["kbus_modules"] = sorted(
        m for m in sys.modules if m.partition(".")[0] in ("transport", "actors", "config")
    )
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
