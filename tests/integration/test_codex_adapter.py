"""The Codex-adapter actor against the real ``codex app-server`` (npm @openai/codex 0.169.0, native binary)
and the project's FakeResponsesServer on 127.0.0.1 (RULES.md AD-*, TU-*, MB-01; CODEX.md)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from peers.codex_support import (
    ModelServer,
    codex_children,
    function_outputs,
    start_model_server,
    weather_config,
)

from actors.codex.child import LaunchOptions
from actors.codex.facade import Adapter, Turn
from actors.codex.types import (
    AdapterError,
    CodexToolCall,
    Done,
    ErrorEvent,
    ErrorKind,
    Event,
    TextDelta,
    ToolCallEvent,
    ToolResult,
)
from actors.types import TokenUsage

pytestmark = pytest.mark.integration

TOOL_TURN = [
    {"tool_calls": [{"call_id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}]},
    {"text": ["Sunny ", "in ", "Paris"]},
]
T = 20.0  # every wait is bounded


@pytest.fixture
def open_adapter(tmp_path: Path) -> Iterator[Callable[..., Adapter]]:
    opened: list[Adapter] = []

    def open_(server: ModelServer | None, *, base_url: str | None = None, **config: Any) -> Adapter:
        workdir = tmp_path / "ws"
        workdir.mkdir(exist_ok=True)
        url = base_url if base_url is not None else server.base_url if server is not None else None
        adapter = Adapter.open(
            weather_config(workdir, **config), launch=LaunchOptions(model_base_url=url), timeout=T
        )
        opened.append(adapter)
        return adapter

    yield open_
    for adapter in opened:
        adapter.close()


@pytest.fixture
def model(spawn_peer: Callable[..., Any], tmp_path: Path) -> Callable[[list[dict[str, Any]]], ModelServer]:
    return lambda script: start_model_server(spawn_peer, tmp_path, script)


def drain(turn: Turn, answer: Callable[[CodexToolCall], ToolResult] | None = None) -> list[Event]:
    events: list[Event] = []
    while True:
        event = turn.next_event(timeout=T)
        assert event is not None, f"no terminal event after {events}"
        events.append(event)
        if isinstance(event, ToolCallEvent) and answer is not None:
            turn.respond(event.call.call_id, answer(event.call), timeout=T)
        if isinstance(event, Done | ErrorEvent):
            # TU-03: only text and tool calls come before the one terminal event
            assert all(isinstance(e, TextDelta | ToolCallEvent) for e in events[:-1]), events
            return events


def sunny(call: CodexToolCall) -> ToolResult:
    return ToolResult(success=True, output=f"Sunny, 21C in {call.arguments['city']}")  # type: ignore[index]


def test_dynamic_tool_turn_on_the_real_binary(open_adapter: Any, model: Any) -> None:
    """AD-04, AD-12, AD-13, TU-01, TU-02, TU-08, TU-09: one tool round trip, events in provider order; the
    thread carries the base instructions and the tool; a later turn on the key continues the thread."""
    server = model([*TOOL_TURN, {"echo": True}])
    adapter = open_adapter(server)
    turn = adapter.start_turn("k", "What is the weather in Paris?", timeout=T)
    events = drain(turn, sunny)
    assert events == [
        ToolCallEvent(CodexToolCall(call_id="call_1", name="get_weather", arguments={"city": "Paris"})),
        TextDelta("Sunny "),
        TextDelta("in "),
        TextDelta("Paris"),
        Done(),
    ]
    assert [turn.next_event(timeout=T) for _ in range(3)] == [None, None, None]
    # Two model requests, each reported by the fake server as 10 in / 5 out / 15 total tokens.
    assert turn.usage(timeout=T) == TokenUsage(input_tokens=20, output_tokens=10, total_tokens=30)
    first, second = server.requests()
    body = first["body"]
    assert body["model"] == "fake-model"
    assert body["input"][0]["content"][0]["text"] == "You are the kbus test model."
    assert "get_weather" in {t.get("name") for t in body["tools"]}
    assert [(o["call_id"], o["output"]) for o in function_outputs(second)] == [
        ("call_1", "Sunny, 21C in Paris")
    ]

    again = drain(adapter.start_turn("k", "and tomorrow?", timeout=T))
    assert again == [TextDelta("echo: "), TextDelta("and tomorrow?"), Done()]
    third = server.requests()[2]["body"]
    assert third["prompt_cache_key"] == body["prompt_cache_key"]  # the same app-server thread
    drain(adapter.start_turn("other", "hi", timeout=T))
    assert server.requests()[3]["body"]["prompt_cache_key"] != body["prompt_cache_key"]


def test_two_keys_run_concurrently_and_keep_their_own_events(open_adapter: Any, model: Any) -> None:
    """AD-10 (and AD-08 through a clone): two keys active at once, each sees only its own deltas."""
    server = model([{"echo": True, "delay": 0.2}])
    adapter = open_adapter(server)
    other = adapter.clone()
    try:
        a = adapter.start_turn("a", "alpha", timeout=T)
        b = other.start_turn("b", "beta", timeout=T)
        results: dict[str, list[Event]] = {}
        threads = [
            threading.Thread(target=lambda t=t: results.update({t.conversation_key: drain(t)}))
            for t in (a, b)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(T)
        assert results["a"] == [TextDelta("echo: "), TextDelta("alpha"), Done()]
        assert results["b"] == [TextDelta("echo: "), TextDelta("beta"), Done()]
        assert adapter.diagnostics() == other.diagnostics()
    finally:
        other.close()


def test_fifty_concurrent_starts_on_one_key_one_accepted(open_adapter: Any, model: Any) -> None:
    """MB-01 / AD-09: 50 threads start a turn on one key at once: one accepted, 49 BUSY answered by the
    adapter itself (the real server would merge them), one model request."""
    server = model([{"text": ["one"], "delay": 0.3}])
    adapter = open_adapter(server)
    barrier = threading.Barrier(50)
    accepted: list[Turn] = []
    busy: list[AdapterError] = []
    other: list[BaseException] = []

    def start(i: int) -> None:
        barrier.wait(T)
        try:
            accepted.append(adapter.start_turn("k", f"input {i}", timeout=T))
        except AdapterError as exc:
            (busy if exc.kind is ErrorKind.BUSY else other).append(exc)
        except BaseException as exc:  # noqa: BLE001 - reported below
            other.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(T)
    assert (len(accepted), len(busy), other) == (1, 49, [])
    assert drain(accepted[0]) == [TextDelta("one"), Done()]
    assert len(server.requests()) == 1
    texts = [
        c.get("text", "")
        for i in server.requests()[0]["body"]["input"]
        if i.get("role") == "user"
        for c in i["content"]
    ]
    assert len([t for t in texts if t.startswith("input ")]) == 1


def test_wrong_late_and_duplicate_call_ids_are_invalid_and_send_nothing(
    open_adapter: Any, model: Any
) -> None:
    """TU-07, TU-10: exact, case-sensitive matching; a duplicate or late answer raises and sends nothing."""
    server = model(TOOL_TURN)
    adapter = open_adapter(server)
    turn = adapter.start_turn("k", "weather?", timeout=T)
    call = turn.next_event(timeout=T)
    assert isinstance(call, ToolCallEvent)
    for wrong in ("CALL_1", "call_", "x"):
        with pytest.raises(AdapterError) as err:
            turn.respond(wrong, ToolResult(success=True, output="wrong"), timeout=T)
        assert err.value.kind is ErrorKind.INVALID_TOOL_RESULT
    turn.respond("call_1", ToolResult(success=False, output="nope"), timeout=T)
    with pytest.raises(AdapterError) as dup:
        turn.respond("call_1", ToolResult(success=True, output="again"), timeout=T)
    assert dup.value.kind is ErrorKind.INVALID_TOOL_RESULT
    assert drain(turn)[-1] == Done()
    with pytest.raises(AdapterError) as late:
        turn.respond("call_1", ToolResult(success=True, output="late"), timeout=T)
    assert late.value.kind is ErrorKind.INVALID_TOOL_RESULT
    outputs = [o for r in server.requests() for o in function_outputs(r)]
    assert [(o["call_id"], o["output"]) for o in outputs] == [("call_1", "nope")]


def test_abandon_mid_tool_call_interrupts_and_frees_the_key(open_adapter: Any, model: Any) -> None:
    """TU-05, TU-06, TU-11, AD-11: abandon while a call is pending sends turn/interrupt (the model's next
    request shows the call cancelled), yields no more events, repr shows the key and state, and the key
    takes a new turn at once."""
    server = model([TOOL_TURN[0], {"echo": True}])
    adapter = open_adapter(server)
    turn = adapter.start_turn("k", "weather?", timeout=T)
    assert isinstance(turn.next_event(timeout=T), ToolCallEvent)
    turn.abandon(timeout=T)
    assert turn.next_event(timeout=T) is None
    turn.abandon(timeout=T)  # TU-06: nothing
    assert "abandoned" in repr(turn) and "'k'" in repr(turn)
    events = drain(adapter.start_turn("k", "next", timeout=T))
    assert events[-1] == Done()
    assert TextDelta("next") in events
    cancelled = function_outputs(server.requests()[1])
    assert [o["call_id"] for o in cancelled] == ["call_1"]
    assert "cancelled" in str(cancelled[0]["output"])


def test_model_server_killed_mid_stream_ends_the_turn_with_error(open_adapter: Any, model: Any) -> None:
    """TU-04: the provider turn fails (stream disconnected) → Error(SERVER); the adapter stays usable."""
    server = model([{"text": ["par"], "then": "hang"}])
    adapter = open_adapter(server)
    turn = adapter.start_turn("k", "go", timeout=T)
    assert turn.next_event(timeout=T) == TextDelta("par")
    server.peer.kill()
    event = turn.next_event(timeout=T)
    assert isinstance(event, ErrorEvent) and event.error.kind is ErrorKind.SERVER
    assert "stream" in event.error.message or "disconnected" in event.error.message
    assert turn.next_event(timeout=T) is None


def test_model_server_down_fails_fast(open_adapter: Any, tmp_path: Path) -> None:
    """CODEX.md pitfall 3: with connection retries off, a refused connection fails the turn (no hang)."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    adapter = open_adapter(None, base_url=f"http://127.0.0.1:{port}/v1")
    events = drain(adapter.start_turn("k", "hello", timeout=T))
    assert isinstance(events[-1], ErrorEvent) and events[-1].error.kind is ErrorKind.SERVER


def test_http_500_is_a_server_error(open_adapter: Any, model: Any) -> None:
    adapter = open_adapter(model([{"status": 500}]))
    events = drain(adapter.start_turn("k", "hello", timeout=T))
    assert isinstance(events[-1], ErrorEvent) and events[-1].error.kind is ErrorKind.SERVER


def test_child_killed_mid_turn_is_unavailable_with_diagnostics(open_adapter: Any, model: Any) -> None:
    """AD-16, AD-18, TU-08: the child dies mid-turn → Error(UNAVAILABLE) with its stderr, then None; later
    starts and responds raise UNAVAILABLE."""
    server = model(TOOL_TURN)
    adapter = open_adapter(server)
    turn = adapter.start_turn("k", "weather?", timeout=T)
    assert isinstance(turn.next_event(timeout=T), ToolCallEvent)
    (pid,) = codex_children()
    os.kill(pid, signal.SIGKILL)
    event = turn.next_event(timeout=T)
    assert isinstance(event, ErrorEvent) and event.error.kind is ErrorKind.UNAVAILABLE
    assert b"bubblewrap" in event.error.diagnostics  # the child's own stderr
    assert turn.next_event(timeout=T) is None
    with pytest.raises(AdapterError) as start:
        adapter.start_turn("k2", "again", timeout=T)
    assert start.value.kind is ErrorKind.UNAVAILABLE and start.value.diagnostics
    with pytest.raises(AdapterError) as respond:
        turn.respond("call_1", ToolResult(success=True, output="x"), timeout=T)
    assert respond.value.kind is ErrorKind.UNAVAILABLE
    assert codex_children() == []


def test_last_release_closes_and_reaps_the_child(model: Any, tmp_path: Path) -> None:
    """AD-17: the child outlives the first close, and is reaped (gone from /proc) when close returns."""
    server = model([{"text": ["x"]}])
    a = Adapter.open(
        weather_config(tmp_path), launch=LaunchOptions(model_base_url=server.base_url), timeout=T
    )
    b = a.clone()
    (pid,) = codex_children()
    a.close()
    assert drain(b.start_turn("k", "still here", timeout=T))[-1] == Done()
    b.close()
    assert not Path(f"/proc/{pid}").exists()
    with pytest.raises(AdapterError) as err:
        b.start_turn("k", "closed", timeout=T)
    assert err.value.kind is ErrorKind.UNAVAILABLE


def test_an_unfinished_turn_keeps_the_child(model: Any, tmp_path: Path) -> None:
    """AD-17: closing every handle while a turn runs leaves the child until the turn ends."""
    server = model([{"text": ["late"], "delay": 0.3}])
    a = Adapter.open(
        weather_config(tmp_path), launch=LaunchOptions(model_base_url=server.base_url), timeout=T
    )
    turn = a.start_turn("k", "go", timeout=T)
    (pid,) = codex_children()
    a.close()
    assert drain(turn) == [TextDelta("late"), Done()]
    assert turn.next_event(timeout=T) is None
    assert not Path(f"/proc/{pid}").exists()


def test_adapter_in_another_process_over_ipc(
    spawn_peer: Any, model: Any, make_node: Any, tmp_path: Path, ipc_dir: Path
) -> None:
    """The adapter actor runs in a peer process (owning the child); this process uses the facade over ipc:
    a full tool turn, BUSY across processes, and the child reaped when the peer's node stops."""
    from actors.app.wiring import registry
    from actors.codex.binary import find_codex
    from transport import Peer

    server = model(TOOL_TURN)
    (tmp_path / "ws").mkdir()
    peer = spawn_peer(
        "--name", "cx", "--bind", f"ipc://{ipc_dir}/cx.sock", "--codex", str(find_codex()),
        "--workdir", str(tmp_path / "ws"), "--base-url", server.base_url,
        script=Path(__file__).parent.parent / "peers" / "codex_peer.py",
    )  # fmt: skip
    node = make_node("client", registry=registry(), peers=[Peer("cx", peer.endpoint)])
    node.connect(Peer("cx", peer.endpoint), wait=20)
    adapter = Adapter.attach(node, peer.info["address"], timeout=T)
    try:
        turn = adapter.start_turn("k", "weather?", timeout=T)
        with pytest.raises(AdapterError) as busy:
            adapter.start_turn("k", "again", timeout=T)
        assert busy.value.kind is ErrorKind.BUSY
        events = drain(turn, sunny)
        assert [type(e) for e in events] == [ToolCallEvent, TextDelta, TextDelta, TextDelta, Done]
        assert b"bubblewrap" in adapter.diagnostics()
    finally:
        adapter.close()
    (child,) = peer.info["child"]
    assert Path(f"/proc/{child}").exists()  # the peer's own handle keeps it
    assert peer.proc.stdin is not None
    peer.proc.stdin.close()
    assert peer.proc.wait(timeout=T) == 0
    assert not Path(f"/proc/{child}").exists()


def test_stopping_the_node_reaps_the_child(model: Any, make_node: Any, tmp_path: Path) -> None:
    """AD-17: a handle is also released when its actor stops; node.stop() ends and reaps the child."""
    from actors.app.wiring import registry

    server = model([{"text": ["x"]}])
    node = make_node("owner", registry=registry())
    adapter = Adapter.open(
        weather_config(tmp_path), bus=node, launch=LaunchOptions(model_base_url=server.base_url), timeout=T
    )
    (pid,) = codex_children()
    node.stop()
    assert not Path(f"/proc/{pid}").exists()
    adapter.close()  # the actor is gone: nothing left to release, and no error


def test_a_next_event_that_times_out_loses_no_event(open_adapter: Any, model: Any) -> None:
    """A caller's timeout raises BusTimeout; the event that arrives later goes to the next next_event."""
    from transport.errors import BusTimeout

    server = model([{"text": ["slow"], "delay": 1.0}])
    adapter = open_adapter(server)
    turn = adapter.start_turn("k", "go", timeout=T)
    with pytest.raises(BusTimeout):
        turn.next_event(timeout=0.2)
    assert drain(turn) == [TextDelta("slow"), Done()]


def test_two_pending_calls_are_answered_in_any_order(open_adapter: Any, model: Any) -> None:
    """TU-10, AD-08: two calls surfaced together; answered in reverse order through a clone's turn view,
    each result reaches the model under its own call id."""
    calls = [
        {"call_id": "c1", "name": "get_weather", "arguments": {"city": "Paris"}},
        {"call_id": "c2", "name": "get_weather", "arguments": {"city": "Rome"}},
    ]
    server = model([{"tool_calls": calls}, {"text": ["both"]}])
    adapter = open_adapter(server)
    turn = adapter.start_turn("k", "two cities", timeout=T)
    first, second = turn.next_event(timeout=T), turn.next_event(timeout=T)
    assert isinstance(first, ToolCallEvent) and isinstance(second, ToolCallEvent)
    assert {first.call.call_id, second.call.call_id} == {"c1", "c2"}
    other = adapter.clone()
    try:
        with pytest.raises(AdapterError) as busy:
            other.start_turn("k", "meanwhile", timeout=T)
        assert busy.value.kind is ErrorKind.BUSY
    finally:
        other.close()
    turn.respond("c2", ToolResult(success=True, output="Rome: rain"), timeout=T)
    turn.respond("c1", ToolResult(success=True, output="Paris: sun"), timeout=T)
    assert drain(turn) == [TextDelta("both"), Done()]
    outputs = {o["call_id"]: o["output"] for o in function_outputs(server.requests()[1])}
    assert outputs == {"c1": "Paris: sun", "c2": "Rome: rain"}


LEAKED_HANDLE = """
import os, sys
from actors.codex.facade import Adapter
from actors.codex.binary import find_codex
from actors.codex.types import AdapterConfig

config = AdapterConfig(executable=str(find_codex()), working_directory=sys.argv[1], model="fake-model",
                       reasoning_effort=None, base_instructions="x", tools=())
adapter = Adapter.open(config, timeout=20)  # never closed
children = [p for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/stat")
            and open(f"/proc/{p}/stat").read().rpartition(")")[2].split()[1] == str(os.getpid())]
print(" ".join(children), flush=True)
"""


def test_a_handle_never_closed_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    """AD-17 / C.1 (drop -> explicit release): a process that forgets to close its last handle still exits,
    and its exit hook closes and reaps the child (the private node's adapter thread is a daemon)."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", LEAKED_HANDLE, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        children = [int(p) for p in proc.stdout.readline().split()]
        assert children, "the adapter started no child"
        assert proc.wait(timeout=T) == 0
        for pid in children:  # reaped by its parent's exit hook: no zombie, no orphan left running
            assert not Path(f"/proc/{pid}").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=T)
