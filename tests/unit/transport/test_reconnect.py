"""Replacing a peer connection keeps the handshake observable (``Node.connect(wait=...)``).

A node started with a configured peer connects at start; an explicit ``connect`` right after replaces that
connection. The replaced DEALER's monitor must be disabled before it closes: otherwise its monitor
endpoint (named after the socket's file descriptor) outlives it, a new DEALER reusing the descriptor gets
a monitor that never reports, and ``connect(wait=...)`` (and every later send) fails although the peer is
up.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from actors.app.wiring import registry
from transport import Node, Peer


def test_connect_right_after_start_replaces_the_start_connection_cleanly(
    make_node: Callable[..., Node], ipc_dir: Path
) -> None:
    endpoint = f"ipc://{ipc_dir}/a.sock"
    make_node("a", bind=[endpoint], registry=registry())
    for i in range(60):  # before the fix: usually failed within 60 rounds (descriptors get reused)
        node = Node(f"b{i}", registry=registry(), peers=[Peer("a", endpoint)]).start()
        try:
            node.connect(node.peers()["a"], wait=5)
        finally:
            node.stop()
