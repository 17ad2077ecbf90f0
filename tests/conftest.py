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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pykka
import pytest
from peers.cli_kit import KBUS, Start

from transport import KeyPair, Node
from transport.security import create_keys

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
def make_keys(tmp_path: Path) -> Callable[[str], tuple[KeyPair, Path]]:
    """``make_keys(name)`` writes a CURVE certificate pair (secret 0600); returns (keys, secret file)."""
    folder = tmp_path / "keys"

    def make(name: str) -> tuple[KeyPair, Path]:
        _, secret = create_keys(folder, name)
        return KeyPair.load(secret), secret

    return make


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
    # Lines the peer prints after READY (filled by one reader thread; None marks end of output).
    lines: queue.SimpleQueue[str | None] = field(default_factory=queue.SimpleQueue)

    @property
    def endpoint(self) -> str:
        return str(self.info["endpoints"][0])

    def expect_line(self, prefix: str, timeout: float = 20.0) -> str:
        """Wait for the next stdout line starting with ``prefix`` (other lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"peer {self.proc.pid}: no {prefix!r} line within {timeout}s") from None
            if line is None:
                self.lines.put(None)
                raise AssertionError(f"peer {self.proc.pid} ended before printing {prefix!r}")
            if line.startswith(prefix):
                return line.rstrip("\n")

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
        raise AssertionError(f"peer {proc.args!r} not ready within {timeout}s") from None
    if not line.startswith("READY "):
        raise AssertionError(f"peer {proc.args!r} failed to start: {line!r} (exit {proc.poll()})")
    info: dict[str, Any] = json.loads(line[6:])
    return info


def _pump_lines(peer: PeerProcess) -> None:
    """One reader thread per peer: every later stdout line lands in ``peer.lines``; EOF ends it."""
    stdout = peer.proc.stdout
    assert stdout is not None

    def pump() -> None:
        try:
            for line in stdout:
                peer.lines.put(line)
        except (OSError, ValueError):  # the finaliser closed the pipe
            pass
        peer.lines.put(None)

    threading.Thread(target=pump, name=f"peer-{peer.proc.pid}-stdout", daemon=True).start()


@pytest.fixture
def spawn_peer() -> Iterator[Callable[..., PeerProcess]]:
    """Start ``tests/peers/bus_peer.py`` in its own process; ended by its PID in the finaliser."""
    started: list[PeerProcess] = []

    def spawn(
        *args: str, netns: str | None = None, timeout: float = 20.0, script: Path = PEERS / "bus_peer.py"
    ) -> PeerProcess:
        # -P: the child must not import modules from its working directory (STYLE.md 3.2).
        cmd = [sys.executable, "-P", str(script), "--stdin-lifeline", *args]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        peer = PeerProcess(proc, {})
        started.append(peer)
        peer.info = _read_ready(proc, timeout)
        _pump_lines(peer)
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


@dataclass
class KbusNode:
    """A ``kbus node --config FILE`` process: its 'listening' line and everything it printed so far."""

    proc: subprocess.Popen[str]
    line: str
    output: list[str] = field(default_factory=list)
    pump: threading.Thread | None = None
    # Every line after the first, as the reader sees it (None marks the end of the output).
    lines: queue.SimpleQueue[str | None] = field(default_factory=queue.SimpleQueue)

    def expect_line(self, text: str, timeout: float = 20.0) -> str:
        """Wait for the next output line containing ``text`` (other lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"kbus node {self.proc.pid}: no {text!r} line within {timeout}s"
                ) from None
            if line is None:
                self.lines.put(None)
                raise AssertionError(f"kbus node {self.proc.pid} ended before printing {text!r}")
            if text in line:
                return line.rstrip("\n")

    @property
    def port(self) -> int:
        """The tcp port of the node's first endpoint (from the 'listening on …' line)."""
        return int(self.line.split("listening on ")[1].split(";")[0].split(",")[0].rpartition(":")[2])

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM by PID and wait: the node's clean shutdown; returns its exit code. ``output`` is then
        complete (the reader has seen the end of the pipe)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        if self.pump is not None:
            self.pump.join(timeout)
        return code


@pytest.fixture
def kbus_node() -> Iterator[Callable[..., KbusNode]]:
    """Start ``kbus node --config FILE`` (``-P``, own session) and wait for its 'listening' line; every
    node still running at the end is ended by its PID (SIGTERM, then SIGKILL)."""
    started: list[KbusNode] = []

    def start(
        config: Path,
        *,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        args: tuple[str, ...] = (),
        script: Path | None = None,
    ) -> KbusNode:
        """``args`` follow ``--config FILE``; ``script``: a test peer wrapping ``kbus node`` runs instead."""
        command = [str(script)] if script is not None else ["-m", "actors.app.cli", "node"]
        proc = subprocess.Popen(
            [sys.executable, "-P", *command, "--config", str(config), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
        )
        node = KbusNode(proc, "")
        started.append(node)
        lines = node.lines
        out = proc.stdout
        assert out is not None

        def pump() -> None:  # drains the pipe for the node's whole life, so its output never blocks it
            for text in out:
                node.output.append(text)
                lines.put(text)
            lines.put(None)

        node.pump = threading.Thread(target=pump, daemon=True)
        node.pump.start()
        # Warnings may come first (plain tcp endpoints); the 'listening' line says the node is up.
        deadline = time.monotonic() + timeout
        while True:
            try:
                first = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"kbus node {config} not listening within {timeout}s") from None
            assert first is not None, f"kbus node {config} failed: {''.join(node.output)}"
            if "listening" in first:
                break
            assert " WARNING " in first, f"kbus node {config} failed: {''.join(node.output)}"
        node.line = first
        return node

    yield start
    for node in started:
        try:
            node.stop(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(node.proc.pid, signal.SIGKILL)
            node.proc.wait(timeout=10)
        if node.proc.stdout is not None:
            node.proc.stdout.close()


@pytest.fixture
def kbus_process() -> Iterator[Start]:
    """Start ``kbus ARGS...`` (own session, pipes unless given); every one still running at the end is
    ended by its PID (SIGTERM, then SIGKILL)."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, **popen: object) -> subprocess.Popen[str]:
        options: dict[str, object] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
        proc = subprocess.Popen([*KBUS, *args], text=True, start_new_session=True, **options)  # type: ignore[call-overload]
        started.append(proc)
        return proc  # type: ignore[no-any-return]

    yield start
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
