"""run_session with the session loop, the Router and the host in three separate processes over ipc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import PEERS, PeerProcess

from actors.nodes import registry
from actors.session import SessionRunRequest, run_session
from transport import Node, Peer

pytestmark = pytest.mark.integration

ROUTER_CONFIG = """
[node]
name = "brain"
bind = ["ipc://brain.sock"]
data_dir = "data"
[actors.router]
type = "router"
[providers.scripted]
kind = "scripted"
scripts = [
  [ { call = { name = "calc", arguments = { expression = "6*7" } }, id = "call-1" },
    { text = "6*7 = 42", chunks = 2 },
    { usage = { input_tokens = 20, output_tokens = 5, total_tokens = 25 } } ],
]
[models.scripted]
provider = "scripted"
provider_model = "scripted-v1"
context_window = 4096
max_input_tokens = 4000
"""


def test_run_session_across_three_processes(
    ipc_dir: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node]
) -> None:
    (ipc_dir / "brain.toml").write_text(ROUTER_CONFIG)
    router = subprocess.Popen(
        [sys.executable, "-P", "-m", "actors.cli", "node", "--config", str(ipc_dir / "brain.toml")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert router.stdout is not None and "listening" in router.stdout.readline()
        host = spawn_peer(
            "--name", "app", "--bind", f"ipc://{ipc_dir}/app.sock", script=PEERS / "host_peer.py"
        )
        loop_node = make_node(
            "loop",
            registry=registry(),
            peers=[Peer("brain", f"ipc://{ipc_dir}/brain.sock"), Peer("app", f"ipc://{ipc_dir}/app.sock")],
        )
        for peer in loop_node.peers().values():
            loop_node.connect(peer, wait=20)
        request = SessionRunRequest(user_id="u1", operation_id=uuid.uuid4(), rounds_used=0, round_limit=5)
        answer = run_session(loop_node, "brain/router", request, "app/host", timeout=60)
        assert answer == "six times seven is 42"
        # The host's side of the protocol, in order, as its own process saw it.
        calls = [host.expect_line("CALL", timeout=20) for _ in range(10)]
        assert calls == [
            "CALL prepare_round 1",
            "CALL record InferenceSubmitted",  # recorded before the provider turn started
            "CALL record ProviderInput",
            "CALL execute_tool calc 1",  # the parsed call_ktool call; the tool ran once
            "CALL prepare_provider_resume 42",
            "CALL record ProviderInput",
            "CALL record UsageUpdated",
            "CALL record ProviderReceipt",  # the round's one receipt
            'CALL complete_round "6*7 = 42"',
            "CALL prepare_round 2",
        ]
    finally:
        if router.poll() is None:
            os.kill(router.pid, signal.SIGTERM)
            router.wait(timeout=30)
        if router.stdout is not None:
            router.stdout.close()
