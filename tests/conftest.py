"""Shared fixtures: actor clean-up, short ipc paths, nodes that always stop, peer processes ended by PID."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pykka
import pytest

from transport import Node

PEERS = Path(__file__).parent / "peers"


@pytest.fixture(autouse=True)
def _stop_all_actors() -> Iterator[None]:
    yield
    pykka.ActorRegistry.stop_all(block=True, timeout=5)


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short private folder for ipc sockets (a socket path must stay under ~107 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="kb-", dir="/tmp"))
    os.chmod(folder, 0o700)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def make_node() -> Iterator[Callable[..., Node]]:
    """Build and start nodes; every one is stopped at the end of the test, even on failure."""
    nodes: list[Node] = []

    def make(name: str, **kwargs: Any) -> Node:
        node = Node(name, **kwargs).start()
        nodes.append(node)
        return node

    yield make
    for node in reversed(nodes):
        node.stop()


@dataclass
class PeerProcess:
    proc: subprocess.Popen[str]
    info: dict[str, Any]

    @property
    def endpoint(self) -> str:
        return str(self.info["endpoints"][0])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def _read_ready(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"peer {proc.args} not ready within {timeout}s") from None
    if not line.startswith("READY "):
        raise AssertionError(f"peer {proc.args} failed to start: {line!r} (exit {proc.poll()})")
    info: dict[str, Any] = json.loads(line[6:])
    return info


@pytest.fixture
def spawn_peer() -> Iterator[Callable[..., PeerProcess]]:
    """Start ``tests/peers/bus_peer.py`` in its own process; ended by its PID in the finaliser."""
    started: list[PeerProcess] = []

    def spawn(*args: str, netns: str | None = None, timeout: float = 20.0) -> PeerProcess:
        # -P: the child must not import modules from its working directory (STYLE.md 3.2).
        cmd = [sys.executable, "-P", str(PEERS / "bus_peer.py"), "--stdin-lifeline", *args]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        peer = PeerProcess(proc, {})
        started.append(peer)
        peer.info = _read_ready(proc, timeout)
        return peer

    yield spawn
    for peer in started:
        if peer.proc.poll() is None:
            os.kill(peer.proc.pid, signal.SIGTERM)
            try:
                peer.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                peer.kill()
        for stream in (peer.proc.stdin, peer.proc.stdout):
            if stream is not None:
                stream.close()
