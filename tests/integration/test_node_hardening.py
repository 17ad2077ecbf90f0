"""Issue 18 against real ``kbus node`` processes: hostile frames, stuck actors, held requests, operations.

Every node is a real process started by the ``kbus_node`` fixture and ended by its PID; clients speak the
wire over real ipc/tcp sockets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conftest import KbusNode

from transport.codec import Registry, decode_header, encode_header
from transport.envelope import Header, new_id
from transport.messages import SYSTEM_MESSAGES, Echo, EchoStream, ErrorReply, Fail, Ping, Pong

pytestmark = pytest.mark.integration

KBUS = [sys.executable, "-P", "-m", "actors.app.cli"]
REGISTRY = Registry(SYSTEM_MESSAGES)
WAIT = 20.0


def kbus(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KBUS, *args], capture_output=True, text=True, timeout=timeout, check=False)


def echo_node_config(folder: Path, extra: str = "") -> Path:
    config = folder / "n1.toml"
    config.write_text(
        f'[node]\nname = "n1"\nbind = ["ipc://n1.sock"]\n{extra}\n[actors.echo]\ntype = "echo"\n'
    )
    return config


class RawClient:
    """A bare DEALER speaking the wire by hand (what a hostile or foreign client does)."""

    def __init__(self, endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.sndtimeo = int(WAIT * 1000)
        self.sock.connect(endpoint)

    def send(
        self, kind: str, body: bytes, *, dst: str = "n1/echo", flow: str = "ask", timeout: float = WAIT
    ) -> bytes:
        now = time.time()
        header = Header(
            id=new_id(),
            kind=kind,
            src="raw/c",
            dst=dst,
            flow=flow,
            ts=now,
            deadline=now + timeout,  # type: ignore[arg-type]
        )
        self.sock.send_multipart([b"", encode_header(header), body])
        return header.id

    def recv(self, timeout: float = WAIT) -> tuple[Header, Any]:
        assert self.sock.poll(int(timeout * 1000)), f"no answer within {timeout}s"
        _, head, body = self.sock.recv_multipart()
        header = decode_header(head)
        return header, REGISTRY.decode(header.kind, body)

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def raw_client() -> Any:
    clients: list[RawClient] = []

    def make(endpoint: str) -> RawClient:
        clients.append(RawClient(endpoint))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def test_a_frame_of_many_unknown_fields_leaves_the_echo_actor_answering(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode], raw_client: Callable[[str], RawClient]
) -> None:
    """Issue 18 item 1: that one frame used to stop the echo actor for good ("no actor n1/echo")."""
    kbus_node(echo_node_config(ipc_dir))
    client = raw_client(f"ipc://{ipc_dir}/n1.sock")
    hostile = msgpack.packb({("\x01" * 8) + str(i): 0 for i in range(60_000)})
    sent = client.send("echo", hostile)
    header, error = client.recv()
    assert header.corr == sent and isinstance(error, ErrorReply) and error.error == "protocol"
    sent = client.send(Ping.TAG, REGISTRY.encode(Ping(nonce=4)))
    header, pong = client.recv()
    assert header.corr == sent and pong == Pong(nonce=4, actor="n1/echo")
    ping = kbus("ping", f"ipc://{ipc_dir}/n1.sock", "--node", "n1", "--count", "1")
    assert ping.returncode == 0, ping.stdout + ping.stderr


PEERS = Path(__file__).resolve().parents[1] / "peers"


def test_sigterm_ends_a_node_whose_actor_is_stuck_in_a_handler_and_names_it(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode], raw_client: Callable[[str], RawClient]
) -> None:
    """Issue 18 item 2: ``kbus node`` printed "stopped" and then stayed alive until SIGKILL."""
    config = echo_node_config(ipc_dir, extra="")
    config.write_text(config.read_text() + '[actors.wedge]\ntype = "wedge"\n')
    node = kbus_node(config, script=PEERS / "wedge_node.py", args=("--grace", "1"))
    client = raw_client(f"ipc://{ipc_dir}/n1.sock")
    client.send(Echo.TAG, REGISTRY.encode(Echo()), dst="n1/wedge", flow="tell")
    node.expect_line("WEDGED n1/wedge")
    ping = kbus("ping", f"ipc://{ipc_dir}/n1.sock", "--node", "n1", "--count", "1")
    assert ping.returncode == 0, ping.stdout + ping.stderr  # the other actors still serve
    code = node.stop(timeout=30)  # SIGTERM; fails the test if the process outlives the bound
    output = "".join(node.output)
    assert code == 3, output
    assert "actor n1/wedge did not finish within 1s" in output
    assert "exiting anyway" in output


def test_the_echo_actors_limits_hold_over_the_wire_and_the_node_stops_cleanly(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode], raw_client: Callable[[str], RawClient]
) -> None:
    """Issue 18 item 2: ``echo.stream`` with ``count = 10**12`` kept the echo actor busy for good."""
    node = kbus_node(echo_node_config(ipc_dir))
    client = raw_client(f"ipc://{ipc_dir}/n1.sock")
    sent = client.send(EchoStream.TAG, REGISTRY.encode(EchoStream(count=10**12)), flow="stream")
    header, error = client.recv()
    assert header.corr == sent and isinstance(error, ErrorReply)
    assert error.error == "limit_exceeded" and error.fields["field"] == "count"
    ping = kbus("ping", f"ipc://{ipc_dir}/n1.sock", "--node", "n1", "--count", "1")
    assert ping.returncode == 0, ping.stdout + ping.stderr
    assert node.stop(timeout=30) == 0
    assert "kbus node n1: stopped" in "".join(node.output)


def test_plain_tcp_says_so_at_start_for_every_plain_endpoint(
    tmp_path: Path, kbus_node: Callable[..., KbusNode]
) -> None:
    """Issue 18 item 5: ``mode = "plain-insecure-for-benchmarks"`` used to start without a word."""
    config = tmp_path / "n1.toml"
    config.write_text(
        '[node]\nname = "n1"\nbind = ["tcp://127.0.0.1:0", "ipc://n1.sock"]\n'
        '[security]\nmode = "plain-insecure-for-benchmarks"\n[actors.echo]\ntype = "echo"\n'
    )
    node = kbus_node(config)
    endpoint = f"tcp://127.0.0.1:{node.port}"
    warnings = [line for line in node.output if "PLAIN tcp" in line]
    assert any(f"node n1 listens on {endpoint} over PLAIN tcp" in line for line in warnings), node.output
    # The echo actor's own (direct) tcp socket is named too, once its thread has bound it.
    ping = kbus("ping", endpoint, "--node", "n1", "--count", "1", "--plain")
    assert ping.returncode == 0, ping.stdout + ping.stderr
    direct = "actor echo listens on tcp://127.0.0.1:"
    line = next((x for x in node.output if direct in x), None) or node.expect_line(direct)
    assert "PLAIN tcp" in line
    assert not [line for line in node.output if "PLAIN" in line and "ipc://" in line]


def test_the_environment_alone_cannot_turn_curve_off(tmp_path: Path) -> None:
    config = tmp_path / "n1.toml"
    config.write_text('[node]\nname = "n1"\nbind = ["ipc://n1.sock"]\n')
    env = {**os.environ, "KBUS_SECURITY_MODE": "plain-insecure-for-benchmarks"}
    result = subprocess.run(
        [*KBUS, "node", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "KBUS_SECURITY_MODE" in result.stderr and "config file" in result.stderr


def test_a_flood_of_hostile_frames_is_summarised_not_logged_per_frame(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode], raw_client: Callable[[str], RawClient]
) -> None:
    """Issue 18 item 6: an ERROR with a traceback per unhandled message, a WARNING per failed tell."""
    node = kbus_node(echo_node_config(ipc_dir))
    client = raw_client(f"ipc://{ipc_dir}/n1.sock")
    n = 500
    for _ in range(n):
        client.send(Fail.TAG, REGISTRY.encode(Fail(message="z" * 100_000)))  # a bug, each with a big text
        client.send(Fail.TAG, REGISTRY.encode(Fail(message="bad tell")), flow="tell", dst="n1/echo")
        client.send(Echo.TAG, REGISTRY.encode(Echo()), dst="n1/nobody", flow="tell")
    replies = 0
    while replies < n:  # error tells to this client (it never said hello) are dropped by the node
        header, body = client.recv()
        if header.flow == "reply":
            assert isinstance(body, ErrorReply) and body.error == "handler"
            replies += 1
    assert node.stop(timeout=30) == 0
    output = "".join(node.output)
    assert output.count("Traceback") <= 2, output[:3000]
    assert len(output) < 40_000, f"{len(output)} characters of log for {3 * n} hostile frames"
    assert "more like this" in output  # the summary at stop says how many were left out


def test_a_second_signal_ends_the_grace_period_at_once(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode], raw_client: Callable[[str], RawClient]
) -> None:
    config = echo_node_config(ipc_dir)
    config.write_text(config.read_text() + '[actors.wedge]\ntype = "wedge"\n')
    node = kbus_node(config, script=PEERS / "wedge_node.py", args=("--grace", "600"))
    raw_client(f"ipc://{ipc_dir}/n1.sock").send(
        Echo.TAG, REGISTRY.encode(Echo()), dst="n1/wedge", flow="tell"
    )
    node.expect_line("WEDGED n1/wedge")
    os.kill(node.proc.pid, signal.SIGTERM)
    node.expect_line("stopping (grace 600s)")
    os.kill(node.proc.pid, signal.SIGTERM)
    assert node.proc.wait(timeout=60) == 3  # far inside the 600 s grace: the second signal ended it
    assert node.pump is not None
    node.pump.join(30)
    assert "second signal: exiting now" in "".join(node.output)
