"""The Shim over the real Codex adapter: the real ``codex app-server`` (npm @openai/codex 0.169.0) pointed at
the project's fake Responses-API model server on 127.0.0.1 (SH-02..SH-07, SH-13..SH-15, SH-18..SH-20).

The model server's request log is what the model actually saw: each acknowledgement arrives there as the
``function_call_output`` of its exact call, and a poisoned shim adds no request.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from peers.codex_support import ModelServer, function_outputs, start_model_server, weather_config

from actors.app.wiring import registry
from actors.codex.binary import find_codex
from actors.codex.child import LaunchOptions
from actors.codex.facade import Adapter
from actors.codex.shim import LaunchRejected, Shim, ShimBox, ShimText
from actors.codex.types import ASYNC_TOOL_ACKNOWLEDGEMENT, AdapterError, CodexToolCall, ErrorKind, TextDelta
from transport import Peer
from transport.node import Node

WAIT = 60.0  # every blocking wait in this file is bounded by this

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Box:
    call_id: str
    city: str

    @property
    def text(self) -> str:
        return f"[weather job {self.call_id} for {self.city}]"


class WeatherCodec:
    def __init__(self) -> None:
        self.converted: list[str] = []

    def tool_call_box(self, call: CodexToolCall) -> Box:
        self.converted.append(call.call_id)
        arguments = call.arguments if isinstance(call.arguments, dict) else {}
        return Box(call.call_id, str(arguments.get("city", "?")))

    def box_text(self, box: Box) -> str:
        return box.text


class JobLauncher:
    """Queues jobs (what a real consumer would do: start the tool elsewhere, return at once)."""

    def __init__(self, reject: dict[str, str] | None = None, future_for: set[str] | None = None) -> None:
        self.reject = reject or {}
        self.future_for = future_for or set()
        self.launched: list[Box] = []
        self.futures: dict[str, concurrent.futures.Future[None]] = {}
        self.future_made = threading.Event()

    def launch(self, box: Box) -> concurrent.futures.Future[None] | None:
        if box.call_id in self.reject:
            raise LaunchRejected(self.reject[box.call_id])
        self.launched.append(box)
        if box.call_id in self.future_for:
            future: concurrent.futures.Future[None] = concurrent.futures.Future()
            self.futures[box.call_id] = future
            self.future_made.set()
            return future
        return None


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node("n1", registry=registry())


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    folder = tmp_path / "ws"
    folder.mkdir()
    return folder


@pytest.fixture
def open_adapter(node: Node, workdir: Path) -> Iterator[Callable[[ModelServer], Adapter]]:
    opened: list[Adapter] = []

    def open_(server: ModelServer) -> Adapter:
        adapter = Adapter.open(
            weather_config(workdir),
            bus=node,
            timeout=WAIT,
            launch=LaunchOptions(model_base_url=server.base_url),
        )
        opened.append(adapter)
        return adapter

    yield open_
    for adapter in opened:
        adapter.close()


def calls(*ids_and_cities: tuple[str, str]) -> dict[str, Any]:
    return {
        "tool_calls": [
            {"call_id": call_id, "name": "get_weather", "arguments": {"city": city}}
            for call_id, city in ids_and_cities
        ]
    }


def test_three_calls_launched_in_order_and_acknowledged_byte_exact(
    spawn_peer: Callable[..., Any], tmp_path: Path, open_adapter: Callable[[ModelServer], Adapter]
) -> None:
    """SH-02..SH-05, SH-09, SH-11, SH-20 on the real binary: three calls, one per model response, each
    converted once, launched in provider order, answered with the acknowledgement, all in one turn."""
    server = start_model_server(
        spawn_peer,
        tmp_path,
        [
            calls(("call_a", "Paris")),
            calls(("call_b", "Oslo")),
            calls(("call_c", "Rome")),
            {"text": ["Jobs ", "started."]},
        ],
    )
    adapter = open_adapter(server)
    codec, launcher = WeatherCodec(), JobLauncher(future_for={"call_a"})
    with Shim(adapter.clone(), "conv-1", codec, launcher) as shim:
        future = shim.infer_future("Weather in three cities?")
        assert launcher.future_made.wait(WAIT)
        assert shim.pending_box_count() == 0  # the mailbox answers while a launch is outstanding
        assert len(server.requests()) == 1  # call_a is not answered before its launch returned
        launcher.futures["call_a"].set_result(None)
        out = future.result(WAIT)
        assert shim.pending_box_count() == 0  # SH-20
    assert codec.converted == ["call_a", "call_b", "call_c"]
    assert [b.call_id for b in launcher.launched] == ["call_a", "call_b", "call_c"]
    assert out.items == (
        ShimBox(Box("call_a", "Paris")),
        ShimBox(Box("call_b", "Oslo")),
        ShimBox(Box("call_c", "Rome")),
        ShimText("Jobs started."),
    )
    requests = server.requests()
    assert len(requests) == 4  # one native turn: three call responses, then the answer
    for n, seen in ((1, ["call_a"]), (2, ["call_a", "call_b"]), (3, ["call_a", "call_b", "call_c"])):
        outputs = function_outputs(requests[n])
        assert [(o["call_id"], o["output"]) for o in outputs] == [
            (c, ASYNC_TOOL_ACKNOWLEDGEMENT) for c in seen
        ]


def test_parallel_calls_in_one_response_are_launched_one_at_a_time_in_event_order(
    spawn_peer: Callable[..., Any], tmp_path: Path, open_adapter: Callable[[ModelServer], Adapter]
) -> None:
    """SH-05 with three calls in one model response: codex may surface them in any order; the shim
    converts, launches and acknowledges them in the order it received them, and the output keeps it."""
    server = start_model_server(
        spawn_peer,
        tmp_path,
        [calls(("call_a", "Paris"), ("call_b", "Oslo"), ("call_c", "Rome")), {"text": ["Jobs ", "started."]}],
    )
    adapter = open_adapter(server)
    codec, launcher = WeatherCodec(), JobLauncher()
    with Shim(adapter.clone(), "conv-1", codec, launcher) as shim:
        out = shim.infer("Weather in three cities?", timeout=WAIT)
    order = codec.converted
    assert sorted(order) == ["call_a", "call_b", "call_c"]
    assert [b.call_id for b in launcher.launched] == order
    assert [i.box.call_id for i in out.items if isinstance(i, ShimBox)] == order
    assert out.items[-1] == ShimText("Jobs started.")
    requests = server.requests()
    assert len(requests) == 2
    outputs = function_outputs(requests[1])
    assert sorted(o["call_id"] for o in outputs) == ["call_a", "call_b", "call_c"]
    assert all(o["output"] == ASYNC_TOOL_ACKNOWLEDGEMENT for o in outputs)


def test_pending_boxes_prefix_the_next_turn_and_a_dynamic_box_does_not(
    spawn_peer: Callable[..., Any], tmp_path: Path, open_adapter: Callable[[ModelServer], Adapter]
) -> None:
    """SH-17..SH-21: recorded boxes reach Codex as their text before the input, then are gone."""
    server = start_model_server(
        spawn_peer, tmp_path, [calls(("call_a", "Paris")), {"text": ["ok"]}, {"text": ["fine"]}]
    )
    adapter = open_adapter(server)
    with Shim(adapter.clone(), "conv-2", WeatherCodec(), JobLauncher()) as shim:
        shim.infer("first", timeout=WAIT)
        shim.record_boxes([Box("job-1", "Paris: sunny"), Box("job-2", "Oslo: snow")])
        assert shim.pending_box_count() == 2
        assert shim.infer("second", timeout=WAIT).items == (ShimText("fine"),)
        assert shim.pending_box_count() == 0
    last_user = _user_texts(server.requests()[-1])
    assert (
        last_user[-1]
        == "[weather job job-1 for Paris: sunny]\n\n[weather job job-2 for Oslo: snow]\n\nsecond"
    )
    assert not any("call_a" in text for text in last_user)  # the dynamic call's box was never queued


def test_a_rejected_launch_abandons_the_turn_and_poisons_the_shim(
    spawn_peer: Callable[..., Any], tmp_path: Path, open_adapter: Callable[[ModelServer], Adapter]
) -> None:
    """SH-07, SH-13, SH-14 on the real binary: call_b is rejected; call_a stays launched and acknowledged,
    call_b is never answered (the model never gets to its next request), and the next infer fails at once
    without a model request."""
    server = start_model_server(
        spawn_peer,
        tmp_path,
        [calls(("call_a", "Paris")), calls(("call_b", "Oslo")), {"text": ["a later turn"]}],
    )
    adapter = open_adapter(server)
    launcher = JobLauncher(reject={"call_b": "job queue full"})
    with Shim(adapter.clone(), "conv-3", WeatherCodec(), launcher) as shim:
        with pytest.raises(AdapterError) as err:
            shim.infer("go", timeout=WAIT)
        assert (err.value.kind, err.value.message) == (ErrorKind.LAUNCH_REJECTED, "job queue full")
        assert [b.call_id for b in launcher.launched] == ["call_a"]
        seen = len(server.requests())
        assert seen == 2  # call_b was never answered: no request carries its output
        with pytest.raises(AdapterError) as again:
            shim.infer("again", timeout=WAIT)
        assert again.value.message == "shim poisoned: launch_rejected: job queue full"
        shim.record_box(Box("job-9", "x"))
        assert shim.pending_box_count() == 1
    # The abandoned turn freed its key: the same conversation key takes a new turn on the same child.
    turn = adapter.start_turn("conv-3", "after", timeout=WAIT)
    events = _drain(turn)
    assert events[-1].__class__.__name__ == "Done"
    requests = server.requests()
    assert len(requests) == seen + 1  # the poisoned infer made no request; only this direct turn did
    outputs = function_outputs(requests[-1])
    # In the thread's history call_a carries the acknowledgement; call_b never got one.
    answered = {o["call_id"]: o["output"] for o in outputs}
    assert answered["call_a"] == ASYNC_TOOL_ACKNOWLEDGEMENT
    assert answered.get("call_b") != ASYNC_TOOL_ACKNOWLEDGEMENT


def test_a_failed_model_turn_poisons_and_a_busy_start_leaves_the_shim_ready(
    spawn_peer: Callable[..., Any], tmp_path: Path, open_adapter: Callable[[ModelServer], Adapter]
) -> None:
    """SH-12/SH-13 (HTTP 500 -> SERVER, poisoned) and SH-15/SH-19 (BUSY start: ready, boxes kept)."""
    server = start_model_server(
        spawn_peer,
        tmp_path,
        [{"text": ["holding"], "then": "hang"}, {"text": ["after the busy turn"]}, {"status": 500}],
    )
    adapter = open_adapter(server)
    # Another holder keeps key "conv-4" busy with a turn that streams and then hangs.
    other = adapter.start_turn("conv-4", "hold the key", timeout=WAIT)
    assert isinstance(other.next_event(timeout=WAIT), TextDelta)
    with Shim(adapter.clone(), "conv-4", WeatherCodec(), JobLauncher()) as shim:
        shim.record_box(Box("job-1", "kept"))
        with pytest.raises(AdapterError) as err:
            shim.infer("X", timeout=WAIT)
        assert err.value.kind is ErrorKind.BUSY
        assert shim.pending_box_count() == 1  # SH-15: untouched
        other.abandon()
        out = shim.infer("X", timeout=WAIT)
        assert out.items == (ShimText("after the busy turn"),)
        assert _user_texts(server.requests()[-1])[-1] == "[weather job job-1 for kept]\n\nX"
        assert shim.pending_box_count() == 0
        with pytest.raises(AdapterError) as failed:
            shim.infer("Y", timeout=WAIT)
        assert failed.value.kind is ErrorKind.SERVER
        seen = len(server.requests())
        with pytest.raises(AdapterError) as poisoned:
            shim.infer("Z", timeout=WAIT)
        assert poisoned.value.message.startswith("shim poisoned: server: ")
        assert len(server.requests()) == seen


def _user_texts(request: dict[str, Any]) -> list[str]:
    texts = []
    for item in request["body"].get("input", []):
        if isinstance(item, dict) and item.get("role") == "user":
            texts.append("".join(c.get("text", "") for c in item.get("content", []) if isinstance(c, dict)))
    return texts


def _drain(turn: Any) -> list[Any]:
    events = []
    for _ in range(100):
        event = turn.next_event(timeout=WAIT)
        if event is None:
            return events
        events.append(event)
    raise AssertionError("turn did not end")


def test_a_shim_drives_an_adapter_in_another_process_over_ipc(
    spawn_peer: Callable[..., Any], make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """The adapter actor and its child live in a peer process; the shim's actor here reaches it only
    through the bus (ipc): the same launch/acknowledge sequence."""
    server = start_model_server(
        spawn_peer, tmp_path, [calls(("call_a", "Paris")), calls(("call_b", "Oslo")), {"text": ["done"]}]
    )
    (tmp_path / "ws").mkdir()
    peer = spawn_peer(
        "--name", "cx", "--bind", f"ipc://{tmp_path}/cx.sock", "--codex", str(find_codex()),
        "--workdir", str(tmp_path / "ws"), "--base-url", server.base_url,
        script=Path(__file__).parent.parent / "peers" / "codex_peer.py",
    )  # fmt: skip
    node = make_node("app", registry=registry(), peers=[Peer("cx", peer.endpoint)])
    node.connect(Peer("cx", peer.endpoint), wait=20)
    launcher = JobLauncher()
    with Shim(
        Adapter.attach(node, peer.info["address"], timeout=WAIT), "k", WeatherCodec(), launcher
    ) as shim:
        out = shim.infer("two cities", timeout=WAIT)
    assert out.items == (ShimBox(Box("call_a", "Paris")), ShimBox(Box("call_b", "Oslo")), ShimText("done"))
    outputs = function_outputs(server.requests()[2])
    assert [(o["call_id"], o["output"]) for o in outputs] == [
        ("call_a", ASYNC_TOOL_ACKNOWLEDGEMENT),
        ("call_b", ASYNC_TOOL_ACKNOWLEDGEMENT),
    ]


def test_two_shims_on_two_keys_share_one_child_and_infer_concurrently(
    spawn_peer: Callable[..., Any], tmp_path: Path, open_adapter: Callable[[ModelServer], Adapter]
) -> None:
    """SH-22: shims on keys k1 and k2 with clones of one adapter: k2's whole turn runs while k1's turn is
    still streaming; closing k1's shim then abandons its turn."""
    server = start_model_server(spawn_peer, tmp_path, [{"text": ["one"], "then": "hang"}, {"text": ["two"]}])
    adapter = open_adapter(server)
    one = Shim(adapter.clone(), "k1", WeatherCodec(), JobLauncher())
    try:
        first = one.infer_future("from one")
        server.peer.expect_line("STREAMING", timeout=WAIT)  # k1's model request is mid-stream
        with Shim(adapter.clone(), "k2", WeatherCodec(), JobLauncher()) as two:
            assert two.infer("from two", timeout=WAIT).items == (ShimText("two"),)
        assert not first.done()
    finally:
        one.close()
    with pytest.raises(AdapterError):
        first.result(WAIT)
    assert [_user_texts(r)[-1] for r in server.requests()] == ["from one", "from two"]
