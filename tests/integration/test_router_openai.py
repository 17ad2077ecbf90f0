"""The Router in its own process, serving a model through the openai provider from a real llama_cpp.server.

The server's API key reaches the Router only through the environment variable its config names; a scan of
both nodes' capture logs (every envelope sent or delivered, MB-09) must not find it anywhere, nor may the
Router process print it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import KbusNode
from peers.llama_server import API_KEY, LlamaServer, start_llama_server

from actors.app.wiring import registry
from actors.router.client import RouterClient
from actors.router.messages import ProviderUnavailable, StartTurn, TurnCompleted, TurnInput, TurnTextDelta
from actors.types import AgentProvider
from transport import Node, Peer
from transport.capture import CaptureWriter, read_log

pytestmark = pytest.mark.integration


@pytest.fixture
def llama() -> Iterator[Callable[[], LlamaServer]]:
    servers: list[LlamaServer] = []

    def start() -> LlamaServer:
        servers.append(start_llama_server())
        return servers[-1]

    yield start
    for server in servers:
        server.kill()


@pytest.fixture
def router_node(ipc_dir: Path, kbus_node: Callable[..., KbusNode]) -> Callable[[str], KbusNode]:
    """``kbus node`` running a Router whose model 'smol' is served by the given base URL; the key is only
    in the environment variable the config names."""

    def start(base_url: str) -> KbusNode:
        config = ipc_dir / "brain.toml"
        config.write_text(f"""
[node]
name = "brain"
bind = ["ipc://brain.sock"]
data_dir = "data"
capture = "brain.buslog"
[providers.lab]
kind = "openai"
base_url = "{base_url}"
api_key_env = "KBUS_TEST_LAB_KEY"
temperature = 0.0
seed = 7
max_attempts = 1
# llama_cpp.server cannot stream an "auto" tool choice (chatml-function-calling); these turns offer none.
tool_choice = "none"
[models.smol]
provider = "lab"
provider_model = "SmolLM2-135M-Instruct"
context_window = 2048
max_input_tokens = 1536
[actors.router]
type = "router"
""")
        return kbus_node(config, env={**os.environ, "KBUS_TEST_LAB_KEY": API_KEY})

    return start


def client_for(make_node: Callable[..., Node], ipc_dir: Path) -> tuple[Node, RouterClient]:
    capture = CaptureWriter(ipc_dir / "app.buslog", node="app", schema=registry().schema_hash())
    node = make_node(
        "app", registry=registry(), capture=capture, peers=[Peer("brain", f"ipc://{ipc_dir}/brain.sock")]
    )
    return node, RouterClient(node, "brain/router", timeout=120)


def start(client: RouterClient, text: str, **fields: Any) -> uuid.UUID:
    spec = StartTurn(
        user_id="u1",
        parent_operation_id=uuid.uuid4(),
        model="smol",
        input=text,
        tool_description="no tools are available; answer in plain text",
        **fields,
    )
    return client.start_turn(spec).operation_id


def test_streamed_turn_through_the_router_and_no_credential_on_the_wire(
    llama: Callable[[], LlamaServer],
    router_node: Callable[[str], KbusNode],
    make_node: Callable[..., Node],
    ipc_dir: Path,
) -> None:
    server = llama()
    router = router_node(server.base_url)
    node, client = client_for(make_node, ipc_dir)
    op = start(client, "Write one short sentence about the sea.", max_output_tokens=24)
    events = list(client.events(op))
    assert isinstance(events[0], TurnInput)
    deltas = [e.text for e in events if isinstance(e, TurnTextDelta)]
    assert len(deltas) >= 2
    done = events[-1]
    assert isinstance(done, TurnCompleted)
    assert done.answer == "".join(deltas)
    receipt = done.receipt
    assert (receipt.status, receipt.provider, receipt.model) == ("completed", AgentProvider.OPENAI, "smol")
    assert client.receipt(op) == receipt

    node.stop()  # flushes the client's capture
    assert router.stop() == 0
    assert_no_credential(ipc_dir, router)


def test_server_killed_mid_stream_gives_one_unavailable_receipt_with_the_cause(
    llama: Callable[[], LlamaServer],
    router_node: Callable[[str], KbusNode],
    make_node: Callable[..., Node],
    ipc_dir: Path,
) -> None:
    server = llama()
    router = router_node(server.base_url)
    node, client = client_for(make_node, ipc_dir)
    op = start(client, "Count from one to one hundred in words, slowly.", max_output_tokens=400)
    event: Any = None
    while not isinstance(event, TurnTextDelta):
        event = client.next_event(op)
    server.kill()  # by PID, mid-stream
    with pytest.raises(ProviderUnavailable) as err:
        while True:
            client.next_event(op)
    receipt = err.value.receipt
    assert receipt is not None and receipt.status == "unavailable"
    assert err.value.__cause__ is not None  # the provider's original error, rebuilt on this side
    assert client.receipt(op) == receipt
    assert client.finish_unavailable(op) == receipt  # exactly one receipt, whoever asks again

    node.stop()
    assert router.stop() == 0
    assert_no_credential(ipc_dir, router)


def assert_no_credential(ipc_dir: Path, router: KbusNode) -> None:
    """MB-09: the key appears in no captured frame of either node, and in nothing the Router printed."""
    secret = API_KEY.encode()
    for name in ("brain.buslog", "app.buslog"):
        log = read_log(ipc_dir / name)
        assert log.records, name
        leaks = [r.n for r in log.records if any(secret in frame for frame in r.frames)]
        assert not leaks, f"{name}: the API key is in records {leaks}"
        # The scan sees message contents as they travel (msgpack keeps strings as UTF-8 bytes): the model's
        # name, which every start request carries, is found the same way a key would be.
        assert any(b"smol" in frame for r in log.records for frame in r.frames), name
    assert API_KEY not in "".join(router.output)
