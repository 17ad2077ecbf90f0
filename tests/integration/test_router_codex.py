"""The Router's ``codex`` provider on the real ``codex app-server`` (npm @openai/codex 0.169.0) and the
project's fake Responses-API model server on 127.0.0.1: the same events and receipts as every provider.

The model server's request log is what the model saw: the one ``call_ktool`` dynamic tool, the system
instructions, and the tool's result as the ``function_call_output`` of the exact call.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import KbusNode
from peers.codex_support import PEERS, ModelServer, codex_children, function_outputs, start_model_server
from peers.turn_io import RecordingTurnIO

from actors.app.wiring import registry
from actors.inference.handle import PreparedRound
from actors.router.actor import CALL_KTOOL_PARAMETERS, RouterActor
from actors.router.catalog import ModelCatalog, ModelEntry, ProviderEntry
from actors.router.client import RouterClient
from actors.router.messages import (
    ProviderFailed,
    ProviderUnavailable,
    StartTurn,
    SubmitInput,
    TurnCancelled,
    TurnCompleted,
    TurnInput,
    TurnTextDelta,
    TurnToolCall,
    TurnUsage,
)
from actors.router.providers.base import ChatMessage, ProviderError, TextDelta, ToolSpec, TurnRequest
from actors.router.providers.codex import CodexProvider, instructions_of, render_input
from actors.runs.runtime import InferenceRuntime
from actors.runs.session import (
    HostActor,
    ProviderResume,
    RoundCompletion,
    RoundPreparation,
    SessionControl,
    SessionEvent,
    SessionRunRequest,
    SessionToolOutcome,
)
from actors.types import CALL_KTOOL, AgentProvider, TokenUsage, ToolCall, ToolCallError, ToolResult
from transport import Peer
from transport.errors import ProtocolError
from transport.node import Node

pytestmark = pytest.mark.integration

WAIT = 60.0  # every blocking wait in this file is bounded by this
MODEL = "codex-fake"
KTOOL_CALL = {
    "tool_calls": [
        {
            "call_id": "call_w1",
            "name": CALL_KTOOL,
            "arguments": {"name": "weather", "arguments": {"city": "Paris"}},
        }
    ]
}
TOOL_TURN = [KTOOL_CALL, {"text": ["Sunny ", "in ", "Paris."]}]


def catalog(server: ModelServer, workdir: Path, **options: Any) -> ModelCatalog:
    return ModelCatalog(
        [
            ModelEntry(
                model=MODEL,
                provider="cx",
                provider_model="fake-model",
                context_window=100_000,
                max_input_tokens=90_000,
            )
        ],
        [
            ProviderEntry(
                name="cx",
                kind="codex",
                options={"model_base_url": server.base_url, "working_directory": str(workdir), **options},
            )
        ],
    )


@pytest.fixture
def router(
    make_node: Callable[..., Node], spawn_peer: Callable[..., Any], tmp_path: Path
) -> Callable[..., tuple[Node, RouterClient, ModelServer]]:
    """A Router whose model ``codex-fake`` runs on codex, built from its catalog like a config would (with
    more provider ``options`` if given)."""

    def start(script: list[dict[str, Any]], **options: Any) -> tuple[Node, RouterClient, ModelServer]:
        server = start_model_server(spawn_peer, tmp_path, script)
        workdir = tmp_path / "ws"
        workdir.mkdir(exist_ok=True)
        node = make_node("n1", registry=registry())
        models = catalog(server, workdir, **options)
        node.spawn(RouterActor, "router", catalog=models, data_dir=tmp_path / "data")
        return node, RouterClient(node, "n1/router", timeout=WAIT), server

    return start


def start_turn(client: RouterClient, text: str, parent: uuid.UUID | None = None) -> uuid.UUID:
    spec = StartTurn(
        user_id="u1",
        parent_operation_id=parent or uuid.uuid4(),
        model=MODEL,
        input=text,
        tool_description="Run an application tool by name.",
        instructions="You are a weather assistant.",
    )
    return client.start_turn(spec).operation_id


def test_a_turn_with_text_and_a_tool_call_gives_one_receipt(
    router: Callable[[list[dict[str, Any]]], tuple[Node, RouterClient, ModelServer]],
) -> None:
    _, client, server = router(TOOL_TURN)
    op = start_turn(client, "Weather in Paris?")
    events: list[Any] = []
    while True:
        event = client.next_event(op, timeout=WAIT)
        events.append(event)
        if isinstance(event, TurnToolCall):
            assert event.call_id == "call_w1" and event.error is None
            assert event.arguments == {"name": "weather", "arguments": {"city": "Paris"}}
            client.respond(op, event.call_id, ToolResult(success=True, output="Sunny, 21C"), timeout=WAIT)
        if isinstance(event, TurnCompleted):
            break
    kinds = [type(e).__name__ for e in events]
    assert kinds[:3] == ["TurnInput", "TurnToolCall", "TurnInput"]
    assert isinstance(events[2], TurnInput) and events[2].context.continued is True
    first = events[0].context
    assert first.instructions == "You are a weather assistant."
    assert first.items[-1].text == "Weather in Paris?" and first.tools == (CALL_KTOOL,)
    deltas = [e.text for e in events if isinstance(e, TurnTextDelta)]
    assert "".join(deltas) == "Sunny in Paris."
    done = events[-1]
    assert done.answer == "Sunny in Paris."
    receipt = done.receipt
    assert (receipt.status, receipt.provider, receipt.model, receipt.provider_model) == (
        "completed",
        AgentProvider.CODEX,
        MODEL,
        "fake-model",
    )
    assert client.receipt(op, timeout=WAIT) == receipt  # exactly one receipt, whoever asks again
    # Usage: two model requests of 10 input + 5 output tokens each, reported once before the end.
    usage = TokenUsage(input_tokens=20, output_tokens=10, total_tokens=30)
    assert [e.usage for e in events if isinstance(e, TurnUsage)] == [usage]
    assert done.usage == receipt.usage == usage
    # What the model saw: the one native tool, the instructions, and the result of the exact call.
    requests = server.requests()
    assert len(requests) == 2
    tools = requests[0]["body"]["tools"]
    assert CALL_KTOOL in [t.get("name") for t in tools]
    assert "You are a weather assistant." in str(requests[0]["body"].get("input", ""))
    assert [(o["call_id"], o["output"]) for o in function_outputs(requests[1])] == [("call_w1", "Sunny, 21C")]


def test_submit_input_on_a_codex_turn_is_refused_with_a_typed_error(
    router: Callable[[list[dict[str, Any]]], tuple[Node, RouterClient, ModelServer]],
) -> None:
    """The codex thread keeps the turn's conversation, so a re-rendered input cannot reach the model: the
    Router refuses SubmitInput with ProtocolError (instead of answering Ok and dropping it); the turn goes
    on as before."""
    node, client, server = router(TOOL_TURN)
    op = start_turn(client, "Weather in Paris?")
    events = client.events(op, timeout=WAIT)
    call = next(e for e in events if isinstance(e, TurnToolCall))
    with pytest.raises(ProtocolError, match="SubmitInput is not supported"):
        node.request("n1/router", SubmitInput(operation_id=op, input="a re-rendered input"), timeout=WAIT)
    client.respond(op, call.call_id, ToolResult(success=True, output="Sunny, 21C"), timeout=WAIT)
    done = [e for e in events if isinstance(e, TurnCompleted)]
    assert [d.answer for d in done] == ["Sunny in Paris."]
    assert "a re-rendered input" not in str(server.requests())


def test_the_receipt_carries_the_turns_token_usage(
    router: Callable[[list[dict[str, Any]]], tuple[Node, RouterClient, ModelServer]],
) -> None:
    _, client, _ = router([{"text": ["Hi."]}])
    op = start_turn(client, "Hello?")
    done = list(client.events(op, timeout=WAIT))[-1]
    assert isinstance(done, TurnCompleted)
    # The fake model server reports 10 input, 5 output, 15 total tokens per request.
    assert done.receipt.usage == TokenUsage(input_tokens=10, output_tokens=5, total_tokens=15)


def test_a_model_server_error_fails_the_turn_with_one_failed_receipt(
    router: Callable[[list[dict[str, Any]]], tuple[Node, RouterClient, ModelServer]],
) -> None:
    _, client, _ = router([{"status": 500}])
    op = start_turn(client, "Hello?")
    with pytest.raises(ProviderFailed) as err:
        list(client.events(op, timeout=WAIT))
    receipt = err.value.receipt
    assert receipt is not None and receipt.status == "failed" and receipt.provider is AgentProvider.CODEX
    assert client.receipt(op, timeout=WAIT) == receipt


def test_cancelling_a_turn_waiting_for_its_tool_result_interrupts_codex(
    router: Callable[[list[dict[str, Any]]], tuple[Node, RouterClient, ModelServer]],
) -> None:
    _, client, server = router([KTOOL_CALL, {"text": ["next turn"]}])
    op = start_turn(client, "Weather?")
    while not isinstance(client.next_event(op, timeout=WAIT), TurnToolCall):
        pass
    assert client.cancel(op, timeout=WAIT) == (op,)
    receipt = client.receipt(op, timeout=WAIT)
    assert receipt.status == "interrupted"
    # The provider is still usable: the next turn runs on the same child.
    op2 = start_turn(client, "Again?")
    done = list(client.events(op2, timeout=WAIT))[-1]
    assert isinstance(done, TurnCompleted) and done.answer == "next turn"
    assert len(server.requests()) == 2


def turn_threads() -> set[str]:
    """The running threads that host provider turns (a ``TurnWorker``'s thread is ``kbus-turn-<name>``)."""
    return {t.name for t in threading.enumerate() if t.name.startswith("kbus-turn-")}


def test_a_codex_tool_turn_is_stepped_by_the_router_itself_with_no_worker_thread(
    router: Callable[[list[dict[str, Any]]], tuple[Node, RouterClient, ModelServer]],
) -> None:
    """Issue 15, item 5 (the Router reaches the codex adapter by message): a codex tool turn completes,
    its tool result answered on the same codex turn, while no turn-worker thread starts, neither while it
    waits for the tool result nor after: the Router steps it on its own thread."""
    before = turn_threads()
    _, client, server = router(TOOL_TURN)
    op = start_turn(client, "Weather in Paris?")
    events = client.events(op, timeout=WAIT)
    call = next(e for e in events if isinstance(e, TurnToolCall))
    waiting = turn_threads()
    client.respond(op, call.call_id, ToolResult(success=True, output="Sunny, 21C"), timeout=WAIT)
    done = [e for e in events if isinstance(e, TurnCompleted)]
    assert [d.answer for d in done] == ["Sunny in Paris."]
    assert done[0].receipt.status == "completed" and client.receipt(op, timeout=WAIT) == done[0].receipt
    assert waiting - before == set() and turn_threads() - before == set()
    assert [(o["call_id"], o["output"]) for o in function_outputs(server.requests()[1])] == [
        ("call_w1", "Sunny, 21C")
    ]


def test_cancelling_a_codex_turn_mid_stream_interrupts_it_and_settles_one_receipt(
    router: Callable[..., tuple[Node, RouterClient, ModelServer]],
) -> None:
    """Issue 15, item 5: a cancel while the turn waits on its adapter (a next_event request, the model
    mid-stream) is thrown into the turn, which abandons its native turn: codex interrupts it and drops the
    model's stream (the model server sees the connection close; CODEX.md, turn/interrupt while streaming)
    while the child lives on and serves the next turn. The cancelled turn has one receipt, "interrupted",
    the same however it is asked for, and no turn-worker thread ran either turn."""
    before = turn_threads()
    script = [{"text": ["part"], "then": "hang"}, {"text": ["next turn"]}]
    # codex's own stream idle timeout far beyond WAIT: only the interrupt can end the model's stream here.
    _, client, server = router(script, stream_idle_timeout_ms=600_000)
    parent = uuid.uuid4()
    op = start_turn(client, "Go", parent)
    while not isinstance(client.next_event(op, timeout=WAIT), TurnTextDelta):
        pass
    server.peer.expect_line("STREAMING", timeout=WAIT)
    children = codex_children()
    assert len(children) == 1
    assert client.cancel(op, timeout=WAIT) == (op,)
    server.peer.expect_line("DISCONNECTED", timeout=WAIT)  # codex gave up the model request: interrupted
    receipt = client.receipt(op, timeout=WAIT)
    assert receipt.status == "interrupted"
    with pytest.raises(TurnCancelled) as err:
        client.next_event(op, timeout=WAIT)
    assert err.value.receipt == receipt
    op2 = start_turn(client, "Again?", parent)
    done = list(client.events(op2, timeout=WAIT))[-1]
    assert isinstance(done, TurnCompleted) and done.answer == "next turn"
    assert codex_children() == children  # the same child
    assert client.receipts_for(parent, timeout=WAIT) == (receipt, done.receipt)
    assert client.receipt(op, timeout=WAIT) == receipt
    assert turn_threads() - before == set()


# ------------------------------------------------------------------------------------------ run_session


class WeatherHost:
    """One round: the model calls ``weather`` once, the host answers it, and the round's answer ends it."""

    def __init__(self) -> None:
        self.trace: list[Any] = []

    def prepare_round(self, round: int) -> Any:
        self.trace.append(("prepare_round", round))
        prepared = PreparedRound(
            input="Weather in Paris?",
            provider_input="Weather in Paris?",
            continuation=None,
            model=MODEL,
            reasoning_effort="",
            tool_description="Run an application tool by name.",
            timeout=WAIT,
        )
        return RoundPreparation.Run(prepared=prepared)

    def record(self, event: Any) -> None:
        self.trace.append(("record", event))

    def execute_tool(self, call: ToolCall | ToolCallError, provider_operation_id: uuid.UUID) -> Any:
        self.trace.append(("execute_tool", call))
        return SessionToolOutcome(text="Sunny, 21C", ok=True)

    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any:
        return ProviderResume.Continue(outcome=outcome)

    def complete_capture(self, capture: Any, contents: str) -> Any:
        raise AssertionError("no capture in this session")

    def complete_round(self, completion: RoundCompletion) -> Any:
        self.trace.append(("complete_round", completion))
        return SessionControl.Complete(answer=completion.answer)


def test_run_session_on_codex_one_round_with_a_tool_call(
    router: Callable[[list[dict[str, Any]]], tuple[Node, RouterClient, ModelServer]],
) -> None:
    node, client, server = router(TOOL_TURN)
    host = WeatherHost()
    node.spawn(HostActor, "host", host=host)
    runtime = InferenceRuntime(node, client.address, timeout=WAIT)
    request = SessionRunRequest(user_id="u1", operation_id=uuid.uuid4(), rounds_used=0, round_limit=3)
    assert runtime.run_session(request, "n1/host", timeout=WAIT) == "Sunny in Paris."
    (call,) = [e[1] for e in host.trace if e[0] == "execute_tool"]
    assert call == ToolCall(name="weather", arguments={"city": "Paris"})
    receipts = [e[1].receipt for e in host.trace if isinstance(e[1], SessionEvent.ProviderReceipt)]
    assert len(receipts) == 1 and receipts[0].status == "completed"
    assert receipts[0].usage == TokenUsage(input_tokens=20, output_tokens=10, total_tokens=30)
    usage_events = [e[1] for e in host.trace if isinstance(e[1], SessionEvent.UsageUpdated)]
    assert [e.usage for e in usage_events] == [receipts[0].usage]
    assert receipts[0].provider is AgentProvider.CODEX
    (completion,) = [e[1] for e in host.trace if e[0] == "complete_round"]
    assert completion.used_tool is True
    assert [(o["call_id"], o["output"]) for o in function_outputs(server.requests()[1])] == [
        ("call_w1", "Sunny, 21C")
    ]


# ------------------------------------------------------------------------------- the provider directly


def test_a_cancelled_stream_abandons_the_codex_turn_and_the_child_serves_the_next(
    spawn_peer: Callable[..., Any], tmp_path: Path
) -> None:
    """Cancellation while the model streams: the provider stops waiting, interrupts the native turn
    (the hanging model stream is dropped) and the same child runs the next turn."""
    server = start_model_server(spawn_peer, tmp_path, [{"text": ["part"], "then": "hang"}, {"text": ["ok"]}])
    provider = CodexProvider(model_base_url=server.base_url, working_directory=str(tmp_path))
    resolved, _, _ = catalog(server, tmp_path).resolve(MODEL)
    request = TurnRequest(
        model=resolved,
        messages=(ChatMessage("user", "Go"),),
        tool=ToolSpec(CALL_KTOOL, "Run an application tool by name.", CALL_KTOOL_PARAMETERS),
    )

    def cancel_on_text(io: RecordingTurnIO, event: Any) -> None:
        if isinstance(event, TextDelta):
            io.cancelled.set()

    try:
        io = RecordingTurnIO(on_emit=cancel_on_text)
        with pytest.raises(ProviderError) as err:
            provider.run_turn(request, io)
        assert (err.value.kind, err.value.started) == ("cancelled", True)
        outcome = provider.run_turn(request, RecordingTurnIO())
        assert outcome.answer == "ok"
        assert len(server.requests()) == 2
    finally:
        provider.close()


def test_a_dead_child_is_replaced_for_the_next_turn(spawn_peer: Callable[..., Any], tmp_path: Path) -> None:
    """AD-18: once codex died every start on that adapter is UNAVAILABLE; the provider reports the turn
    unavailable and opens a new child for the next one."""
    server = start_model_server(spawn_peer, tmp_path, [{"text": ["first"]}, {"text": ["after the restart"]}])
    provider = CodexProvider(model_base_url=server.base_url, working_directory=str(tmp_path))
    resolved, _, _ = catalog(server, tmp_path).resolve(MODEL)
    request = TurnRequest(
        model=resolved,
        messages=(ChatMessage("user", "Go"),),
        tool=ToolSpec(CALL_KTOOL, "Run an application tool by name.", CALL_KTOOL_PARAMETERS),
    )
    try:
        before = set(codex_children())
        assert provider.run_turn(request, RecordingTurnIO()).answer == "first"
        (child,) = set(codex_children()) - before
        os.kill(child, signal.SIGKILL)
        with pytest.raises(ProviderError) as err:
            for _ in range(50):  # until the adapter has seen its child exit (bounded)
                provider.run_turn(request, RecordingTurnIO())
        assert err.value.kind == "unavailable"
        assert provider.run_turn(request, RecordingTurnIO()).answer == "after the restart"
        assert len(set(codex_children()) - before) == 1 and child not in codex_children()
    finally:
        provider.close()


def scripted_codex(tmp_path: Path, mode: str) -> Path:
    """An executable that runs ``scripted_codex_child`` in ``mode`` (for what the real binary cannot do)."""
    exe = tmp_path / f"codex-{mode}"
    child = PEERS / "scripted_codex_child.py"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -P "{child}" {mode} "{tmp_path / mode}.jsonl" "$@"\n')
    exe.chmod(0o700)
    return exe


def test_a_codex_child_that_never_finishes_its_handshake_is_unavailable(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """The adapter's open timing out (Expired, a BusError) is the provider being unavailable: the turn
    fails ProviderUnavailable with one "unavailable" receipt, and no child is left."""
    workdir = tmp_path / "ws"
    workdir.mkdir()
    options = {"executable": str(scripted_codex(tmp_path, "mute")), "working_directory": str(workdir)}
    models = ModelCatalog(
        [ModelEntry(model=MODEL, provider="cx", provider_model="m", context_window=99, max_input_tokens=90)],
        [ProviderEntry(name="cx", kind="codex", options={**options, "open_timeout": 0.5})],
    )
    node = make_node("n1", registry=registry())
    node.spawn(RouterActor, "router", catalog=models, data_dir=tmp_path / "data")
    client = RouterClient(node, "n1/router", timeout=WAIT)
    op = start_turn(client, "Hello?")
    with pytest.raises(ProviderUnavailable) as err:
        list(client.events(op, timeout=WAIT))
    receipt = err.value.receipt
    assert receipt is not None and receipt.status == "unavailable" and receipt.provider is AgentProvider.CODEX
    assert client.receipt(op, timeout=WAIT) == receipt
    assert codex_children() == []


def test_render_input_keeps_the_last_user_message_verbatim_after_the_history() -> None:
    assert render_input([ChatMessage("system", "S"), ChatMessage("user", "hi")]) == "hi"
    history = [
        ChatMessage("system", "S"),
        ChatMessage("user", "q1"),
        ChatMessage("assistant", "a1"),
        ChatMessage("user", "q2"),
    ]
    assert render_input(history) == (
        "<conversation>\n<user>\nq1\n</user>\n<assistant>\na1\n</assistant>\n</conversation>\n\nq2"
    )
    assert instructions_of("base", history) == "base\n\nS"
    assert instructions_of("", [ChatMessage("user", "x")]) == ""


# ----------------------------------------------------------------------------- a Router in its own process


def _children_running_codex(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` and whose command line runs ``app-server`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid and b"app-server" in cmdline:
            found.append(int(entry.name))
    return found


def test_a_router_node_from_config_serves_codex_and_reaps_its_child(
    spawn_peer: Callable[..., Any],
    kbus_node: Callable[..., KbusNode],
    make_node: Callable[..., Node],
    ipc_dir: Path,
    tmp_path: Path,
) -> None:
    """``[providers.NAME] kind = "codex"`` in a node's config: a tool turn from another process, and the
    codex child ends with the node."""
    server = start_model_server(spawn_peer, tmp_path, TOOL_TURN)
    workdir = tmp_path / "ws"
    workdir.mkdir()
    config = ipc_dir / "brain.toml"
    config.write_text(f"""
[node]
name = "brain"
bind = ["ipc://brain.sock"]
data_dir = "data"
[providers.cx]
kind = "codex"
model_base_url = "{server.base_url}"
working_directory = "{workdir}"
[models.{MODEL}]
provider = "cx"
provider_model = "fake-model"
context_window = 100000
max_input_tokens = 90000
[actors.router]
type = "router"
""")
    brain = kbus_node(config)
    node = make_node("app", registry=registry(), peers=[Peer("brain", f"ipc://{ipc_dir}/brain.sock")])
    client = RouterClient(node, "brain/router", timeout=WAIT)
    op = start_turn(client, "Weather in Paris?")
    event = client.next_event(op, timeout=WAIT)
    while not isinstance(event, TurnToolCall):
        event = client.next_event(op, timeout=WAIT)
    children = _children_running_codex(brain.proc.pid)
    assert len(children) == 1
    client.respond(op, event.call_id, ToolResult(success=True, output="Sunny, 21C"), timeout=WAIT)
    done = list(client.events(op, timeout=WAIT))[-1]
    assert isinstance(done, TurnCompleted) and done.answer == "Sunny in Paris."
    assert done.receipt.provider is AgentProvider.CODEX and client.receipt(op) == done.receipt
    assert brain.stop() == 0, "".join(brain.output)
    assert "closing provider" not in "".join(brain.output)  # released cleanly at the Router's stop
    assert not Path(f"/proc/{children[0]}").exists()  # reaped with the node, not orphaned
