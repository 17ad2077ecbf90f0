"""The Router in its own process (``kbus node``), used from this one over ipc and over tcp+CURVE."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import KbusNode

from actors.app.wiring import registry
from actors.router.client import RouterClient
from actors.router.messages import StartTurn, TurnCompleted, TurnToolCall
from actors.types import ToolResult
from transport import KeyPair, Node, Peer, Security
from transport.security import create_keys, load_public_key

pytestmark = pytest.mark.integration

SCRIPTS = """
[providers.scripted]
kind = "scripted"
scripts = [
  [ { call = { name = "calc", arguments = { expression = "6*7" } }, id = "call-1" },
    { text = "The answer is 42.", chunks = 4 },
    { usage = { input_tokens = 12, output_tokens = 6, total_tokens = 18 } } ],
]
[models.scripted]
provider = "scripted"
provider_model = "scripted-v1"
context_window = 4096
max_input_tokens = 4000
"""


def run_tool_turn(client: RouterClient) -> Any:
    op = client.start_turn(
        StartTurn(
            user_id="u1",
            parent_operation_id=uuid.uuid4(),
            model="scripted",
            input="what is 6*7?",
            tool_description="tools: calc",
        )
    ).operation_id
    event: Any = None
    while not isinstance(event, TurnToolCall):
        event = client.next_event(op)
    assert event.call_id == "call-1"
    assert event.arguments == {"name": "calc", "arguments": {"expression": "6*7"}}
    client.respond(op, event.call_id, ToolResult(success=True, output="42"))
    events = list(client.events(op))
    done = events[-1]
    assert isinstance(done, TurnCompleted)
    assert done.answer == "The answer is 42."
    assert done.receipt.status == "completed"
    assert done.receipt.provider_model == "scripted-v1"
    assert client.receipt(op) == done.receipt
    return done


def test_router_in_another_process_over_ipc(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode], make_node: Callable[..., Node]
) -> None:
    config = ipc_dir / "router.toml"
    config.write_text(
        '[node]\nname = "brain"\nbind = ["ipc://brain.sock"]\ndata_dir = "data"\n'
        '[actors.router]\ntype = "router"\n' + SCRIPTS
    )
    kbus_node(config)
    client_node = make_node("app", registry=registry(), peers=[Peer("brain", f"ipc://{ipc_dir}/brain.sock")])
    done = run_tool_turn(RouterClient(client_node, "brain/router", timeout=20))
    assert (ipc_dir / "data" / "receipts.sqlite3").exists()
    assert done.usage is not None and done.usage.total_tokens == 18


def test_router_in_another_process_over_tcp_with_curve(
    tmp_path: Path, kbus_node: Callable[..., KbusNode], make_node: Callable[..., Node]
) -> None:
    keys = tmp_path / "keys"
    _, server_secret = create_keys(keys, "brain")
    _, client_secret = create_keys(keys, "app")
    client_public = load_public_key(keys / "app.key")
    config = tmp_path / "router.toml"
    config.write_text(
        '[node]\nname = "brain"\nbind = ["tcp://127.0.0.1:0"]\ndata_dir = "data"\n'
        f'[security]\nsecret_key_file = "keys/brain.key_secret"\n'
        f'allow = [{{ node = "app", public_key = "{client_public}" }}]\n'
        '[actors.router]\ntype = "router"\n' + SCRIPTS
    )
    line = kbus_node(config).line
    port = int(line.split("listening on ")[1].split(";")[0].rpartition(":")[2])
    security = Security(keys=KeyPair.load(client_secret))
    peer = Peer("brain", f"tcp://127.0.0.1:{port}", load_public_key(keys / "brain.key"))
    client_node = make_node("app", registry=registry(), security=security, peers=[peer])
    run_tool_turn(RouterClient(client_node, "brain/router", timeout=20))
    assert server_secret.exists()
