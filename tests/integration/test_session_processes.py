"""run_session with the session loop, the Router and the host in three separate processes over ipc."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import PEERS, KbusNode, PeerProcess

from actors.app.wiring import registry
from actors.runs.session import SessionRunRequest, run_session, run_session_future
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
    ipc_dir: Path,
    spawn_peer: Callable[..., PeerProcess],
    make_node: Callable[..., Node],
    kbus_node: Callable[..., KbusNode],
) -> None:
    (ipc_dir / "brain.toml").write_text(ROUTER_CONFIG)
    kbus_node(ipc_dir / "brain.toml")  # the Router, in its own process
    host = spawn_peer("--name", "app", "--bind", f"ipc://{ipc_dir}/app.sock", script=PEERS / "host_peer.py")
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


TWO_TOOLS = """
[node]
name = "brain"
bind = ["ipc://brain.sock"]
data_dir = "data"
[actors.router]
type = "router"
[providers.scripted]
kind = "scripted"
scripts = [
  [ { call = { name = "fast", arguments = {} }, id = "call-1" },
    { call = { name = "slow", arguments = {} }, id = "call-2" },
    { text = "both done" } ],
  [ { call = { name = "fast", arguments = {} }, id = "call-1" },
    { call = { name = "slow", arguments = {} }, id = "call-2" },
    { text = "both done" } ],
]
[models.scripted]
provider = "scripted"
provider_model = "scripted-v1"
context_window = 4096
max_input_tokens = 4000
"""


def test_host_killed_mid_tool_then_a_rerun_repeats_no_tool(
    ipc_dir: Path,
    spawn_peer: Callable[..., PeerProcess],
    make_node: Callable[..., Node],
    kbus_node: Callable[..., KbusNode],
) -> None:
    """The host process dies while its second tool runs: the run ends Unavailable (outcome unknown), the
    interrupted turn has exactly one receipt at the Router, and a rerun with the same operation (so the
    same idempotency keys) on a new host process over the same effect store runs no tool again: the first
    tool's stored outcome is reused, the cut-off one is reported as "outcome unknown" (to the host's
    prepare_provider_resume and so to the model), and the tools' own log shows each ran exactly once."""
    from actors.router.receipts import ReceiptLedger
    from transport.errors import Unavailable

    (ipc_dir / "brain.toml").write_text(TWO_TOOLS)
    router = kbus_node(ipc_dir / "brain.toml")
    log = ipc_dir / "effects.log"
    host_args = (
        "--name",
        "app",
        "--bind",
        f"ipc://{ipc_dir}/app.sock",
        "--app",
        "two-tools",
        "--effects",
        str(ipc_dir / "effects.sqlite3"),
        "--effect-log",
        str(log),
    )
    host = spawn_peer(*host_args, "--hang", script=PEERS / "host_peer.py")
    loop_node = make_node(
        "loop",
        registry=registry(),
        peers=[Peer("brain", f"ipc://{ipc_dir}/brain.sock"), Peer("app", f"ipc://{ipc_dir}/app.sock")],
    )
    for peer in loop_node.peers().values():
        loop_node.connect(peer, wait=20)
    request = SessionRunRequest(user_id="u1", operation_id=uuid.uuid4(), rounds_used=0, round_limit=5)
    future = run_session_future(loop_node, "brain/router", request, "app/host", timeout=60)
    assert host.expect_line("EXECUTE", timeout=20) == "EXECUTE fast"
    assert host.expect_line("EXECUTE", timeout=20) == "EXECUTE slow"
    host.kill()  # SIGKILL by PID, mid-tool
    with pytest.raises(Unavailable):
        future.result(60)

    # Exactly one receipt for the interrupted turn, in the Router's durable ledger (read with the
    # Router stopped; it comes back on the same data directory for the rerun).
    assert router.stop() == 0
    ledger = ReceiptLedger(ipc_dir / "data" / "receipts.sqlite3")
    try:
        (receipt,) = ledger.for_parent(request.operation_id)
        assert receipt.status == "interrupted"
    finally:
        ledger.close()
    router = kbus_node(ipc_dir / "brain.toml")  # the same data directory: the same ledger

    # The rerun: a new host process on the same effect store, the same operation id and round.
    host = spawn_peer(*host_args, script=PEERS / "host_peer.py")
    loop_node.connect(Peer("app", f"ipc://{ipc_dir}/app.sock"), wait=20)
    loop_node.connect(Peer("brain", f"ipc://{ipc_dir}/brain.sock"), wait=20)
    answer = run_session(loop_node, "brain/router", request, "app/host", timeout=60)
    assert answer == "six times seven is 42"  # round 2 of the app completes the session
    resumed = [host.expect_line("CALL prepare_provider_resume", timeout=20) for _ in range(2)]
    assert resumed[0] == "CALL prepare_provider_resume fast done"  # the stored outcome
    assert resumed[1].startswith("CALL prepare_provider_resume outcome unknown: tool 'slow' started at")
    # The run is over: every tool that ever ran is in the log, each once.
    assert log.read_text().splitlines() == ["fast", "slow"]
