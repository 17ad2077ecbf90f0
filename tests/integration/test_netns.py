"""Another host, for real: a server node and a client node in two network namespaces joined by a veth pair,
talking tcp+CURVE across it (DESIGN.md §9: network namespaces stand in for "another host").

Addresses are a private /30 that exists only inside the two namespaces each test creates and deletes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import PEERS, PeerProcess

from transport import KeyPair

pytestmark = [pytest.mark.integration, pytest.mark.netns]

MakeKeys = Callable[[str], tuple[KeyPair, Path]]
_numbers = itertools.count()


@dataclass(frozen=True)
class NetnsPair:
    a: str
    b: str
    addr_a: str
    addr_b: str
    veth_a: str = ""


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def _end_processes_in(ns: str) -> None:
    """SIGKILL, by PID, whatever still runs inside ``ns`` (only processes this test started live there)."""
    try:
        pids = _ip("netns", "pids", ns).split()
    except AssertionError:
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.fixture
def netns_pair() -> Iterator[NetnsPair]:
    """Two fresh namespaces, lo up in each, joined by a veth pair carrying 10.200.0.1/30 <-> .2/30."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    tag = f"{os.getpid()}{next(_numbers)}"
    veth_a, veth_b = f"kv{tag}a", f"kv{tag}b"  # interface names: at most 15 characters
    pair = NetnsPair(f"kb{tag}a", f"kb{tag}b", "10.200.0.1", "10.200.0.2", veth_a)
    assert len(veth_a) <= 15
    created: list[str] = []
    try:
        for ns in (pair.a, pair.b):
            _ip("netns", "add", ns)
            created.append(ns)
        # Created in the root namespace and moved at once; deleting a namespace deletes its end.
        _ip("link", "add", veth_a, "netns", pair.a, "type", "veth", "peer", "name", veth_b, "netns", pair.b)
        for ns, dev, addr in ((pair.a, veth_a, pair.addr_a), (pair.b, veth_b, pair.addr_b)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield pair
    finally:
        for ns in reversed(created):
            _end_processes_in(ns)
            _ip("netns", "delete", ns)


@pytest.fixture
def run_client() -> Iterator[Callable[..., dict[str, Any]]]:
    """Run ``tests/peers/bus_client.py`` inside a namespace to completion; read its RESULT line."""
    started: list[subprocess.Popen[str]] = []

    def run(ns: str, *args: str, timeout: float = 60.0) -> dict[str, Any]:
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-P", str(PEERS / "bus_client.py"), *args]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        started.append(proc)
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"client exited {proc.returncode}:\n{out}\n{err}"
        results = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert results, f"client printed no RESULT line:\n{out}\n{err}"
        result: dict[str, Any] = json.loads(results[-1][len("RESULT ") :])
        return result

    yield run
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)


def _server(
    spawn_peer: Callable[..., PeerProcess],
    pair: NetnsPair,
    make_keys: MakeKeys,
    allow: dict[str, KeyPair],
    *extra: str,
) -> tuple[PeerProcess, str]:
    keys, secret = make_keys("srv")
    peer = spawn_peer(
        "--name",
        "srv",
        "--bind",
        f"tcp://{pair.addr_a}:*",
        f"--secret-key-file={secret}",
        *(f"--allow={name}={kp.public}" for name, kp in allow.items()),
        "--recorder",
        "rec",
        *extra,
        netns=pair.a,
    )
    assert peer.endpoint.startswith(f"tcp://{pair.addr_a}:"), peer.endpoint
    return peer, f"srv={peer.endpoint}={keys.public}"


def test_ask_stream_and_tell_across_namespaces(
    netns_pair: NetnsPair,
    spawn_peer: Callable[..., PeerProcess],
    run_client: Callable[..., dict[str, Any]],
    make_keys: MakeKeys,
) -> None:
    client_keys, client_secret = make_keys("cli")
    _, server = _server(spawn_peer, netns_pair, make_keys, {"cli": client_keys})
    result = run_client(
        netns_pair.b,
        "--name",
        "cli",
        "--server",
        server,
        f"--secret-key-file={client_secret}",
        "--tell",
        "1",
        "--tell",
        "2",
        "--tell",
        "3",
    )
    assert result == {
        "ask": {"text": "across", "seq": 7, "payload": "0001"},
        "pong": 5,
        "stream": [0, 1, 2, 3],
        "recorded": [1, 2, 3],
    }


def test_unlisted_client_key_is_refused_across_namespaces(
    netns_pair: NetnsPair,
    spawn_peer: Callable[..., PeerProcess],
    run_client: Callable[..., dict[str, Any]],
    make_keys: MakeKeys,
) -> None:
    good_keys, good_secret = make_keys("cli")
    _, bad_secret = make_keys("bad")
    _, server = _server(spawn_peer, netns_pair, make_keys, {"cli": good_keys})
    # The unlisted client asks the recorder itself: had anything been delivered, it would be recorded.
    refused = run_client(
        netns_pair.b,
        "--name",
        "cli",
        "--server",
        server,
        f"--secret-key-file={bad_secret}",
        "--echo",
        "rec",
        "--tell",
        "99",
    )
    assert refused["error"] == "NotDelivered", refused
    assert "authentication" in refused["message"], refused
    assert refused["step"] == "ask"
    allowed = run_client(
        netns_pair.b,
        "--name",
        "cli",
        "--server",
        server,
        f"--secret-key-file={good_secret}",
        "--tell",
        "1",
    )
    assert allowed.get("recorded") == [1], allowed  # nothing from the refused client got in


def test_a_host_that_drops_off_the_network_is_noticed_by_zmtp_heartbeats(
    netns_pair: NetnsPair,
    spawn_peer: Callable[..., PeerProcess],
    run_client: Callable[..., dict[str, Any]],
    make_keys: MakeKeys,
) -> None:
    """DESIGN.md §4: a dead host sends no FIN or RST; only heartbeats notice it. The server's link goes
    down while it holds the client's request: the client's request ends Unavailable (outcome unknown),
    long before its 60 s deadline would have made it Expired."""
    client_keys, client_secret = make_keys("cli")
    server_peer, server = _server(spawn_peer, netns_pair, make_keys, {"cli": client_keys}, "--announce-hold")
    outcome: queue.SimpleQueue[dict[str, Any] | BaseException] = queue.SimpleQueue()

    def client() -> None:
        try:
            outcome.put(
                run_client(
                    netns_pair.b,
                    "--name",
                    "cli",
                    "--server",
                    server,
                    f"--secret-key-file={client_secret}",
                    "--hold",
                    "--timeout",
                    "60",
                    "--heartbeat-ms",
                    "200,1000",
                    timeout=90,
                )
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.put(exc)

    threading.Thread(target=client, daemon=True).start()
    server_peer.expect_line("HELD", timeout=30)
    _ip("-n", netns_pair.a, "link", "set", netns_pair.veth_a, "down")  # packets vanish: no RST, no FIN
    result = outcome.get(timeout=90)
    assert not isinstance(result, BaseException), result
    assert result.get("error") == "Unavailable", result
    assert result["step"] == "hold"


def test_run_session_over_tcp_curve_between_namespaces(
    netns_pair: NetnsPair,
    spawn_peer: Callable[..., PeerProcess],
    make_keys: MakeKeys,
) -> None:
    """Issue 5's other-host scenario: the session loop in one namespace; the Router and the host in the
    other, reached over tcp+CURVE on the veth pair."""
    server_keys, server_secret = make_keys("app")
    client_keys, client_secret = make_keys("loop")
    script = json.dumps(
        [
            {"call": {"name": "calc", "arguments": {"expression": "6*7"}}, "id": "call-1"},
            {"text": "6*7 = 42"},
        ]
    )
    server = spawn_peer(
        "--name",
        "app",
        "--bind",
        f"tcp://{netns_pair.addr_a}:*",
        f"--secret-key-file={server_secret}",
        f"--allow=loop={client_keys.public}",
        f"--router-script={script}",
        netns=netns_pair.a,
        script=PEERS / "host_peer.py",
    )
    cmd = [
        "ip",
        "netns",
        "exec",
        netns_pair.b,
        sys.executable,
        "-P",
        str(PEERS / "session_client.py"),
        "--name",
        "loop",
        "--server",
        f"app={server.endpoint}={server_keys.public}",
        f"--secret-key-file={client_secret}",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert results, f"no RESULT line:\n{out}\n{err}"
    assert json.loads(results[-1][len("RESULT ") :]) == {"answer": "six times seven is 42"}
    assert server.expect_line("CALL execute_tool", timeout=10) == "CALL execute_tool calc 1"
