"""The subagent run with its ``Host`` in another process (tests/peers/subagent_host_peer.py) over ipc."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import PEERS, PeerProcess

from actors.app.wiring import registry
from actors.router.actor import RouterActor
from actors.router.catalog import ModelCatalog, ModelEntry, ProviderEntry
from actors.router.providers.scripted import ScriptedProvider
from actors.runs.projection import UPDATED_MARKER
from actors.runs.runtime import InferenceRuntime
from actors.runs.subagent import RunRequest
from transport import Node, Peer

pytestmark = pytest.mark.integration

CATALOG = ModelCatalog(
    (
        ModelEntry(
            model="sub",
            provider="scripted",
            provider_model="scripted-sub",
            context_window=32768,
            max_input_tokens=8000,
        ),
    ),
    (ProviderEntry(name="scripted", kind="scripted"),),
)


def call(call_id: str, name: str, **arguments: object) -> dict[str, object]:
    return {"call": {"name": name, "arguments": arguments}, "id": call_id}


def test_run_with_the_host_in_another_process(
    ipc_dir: Path, tmp_path: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node]
) -> None:
    """Two successive state updates, a tool answered through a future, and a capture, with the Host in its
    own process: the budget crosses the boundary and answers fits_state there; the second update replaces
    the first displayed result in place; the capture's completion is the run's answer."""
    host = spawn_peer(
        "--name", "app", "--bind", f"ipc://{ipc_dir}/app.sock", script=PEERS / "subagent_host_peer.py"
    )
    node = make_node("loop", registry=registry(), peers=[Peer("app", f"ipc://{ipc_dir}/app.sock")])
    node.connect(node.peers()["app"], wait=20)
    provider = ScriptedProvider(
        [
            [
                call("c1", "note", text="milk"),
                call("c2", "note", text="eggs"),
                call("c3", "slow"),
                call("c4", "save", file="list.txt"),
                {"text": "milk and eggs"},
            ]
        ]
    )
    node.spawn(RouterActor, "router", catalog=CATALOG, data_dir=tmp_path, providers={"scripted": provider})
    request = RunRequest(
        user_id="u1",
        parent_operation_id=uuid.uuid4(),
        model="sub",
        reasoning_effort="low",
        context=("Tools: note(text), slow(), save(file).",),
        task="Write down milk and eggs, then save the list.",
        timeout=None,
        start_metadata={"host": "app"},
    )
    result = InferenceRuntime(node, "loop/router", timeout=30).run(
        request, "app/host", timeout=60, protocol_reserve_tokens=200
    )
    assert result.answer == "saved 13 characters to list.txt"
    assert result.model.model == "sub"

    lines = []
    while not lines or lines[-1] != "CALL record Completed":
        lines.append(host.expect_line("CALL", timeout=20))
    shape = [" ".join(line.split()[:3]) for line in lines]
    assert shape == [
        "CALL record Started",
        "CALL record InferenceSubmitted",
        *(
            step
            for name in ("note", "note", "slow", "save")
            for step in (
                f"CALL render {name}",
                "CALL record ToolCall",
                f"CALL execute_tool {name}",
                "CALL record ToolResult",
                "CALL record InferenceSubmitted",
            )
        ),
        "CALL record ProviderReceipt",
        'CALL complete_capture {"file":',
        "CALL record Completed",
    ]
    executed = [line.split() for line in lines if line.startswith("CALL execute_tool")]
    assert all(parts[-1] == "True" and parts[-2] == "8000" for parts in executed)  # fits_state, over there
    estimates = [int(parts[3]) for parts in executed]
    assert estimates == sorted(estimates) and len(set(estimates)) == 4
    # In the last request the first note's displayed result is the marker; the state holds both notes.
    last = provider.inputs[-1]
    assert last.count(UPDATED_MARKER) == 1
    assert last.endswith('<value key="notes">\nmilk\neggs\n</value>\n</state>')
    assert 'CALL complete_capture {"file": "list.txt"} "milk and eggs"' in lines
