"""run_session over the real Router (scripted provider) and a HostActor around a RecordingHost (RS-*, EV-*).

Every scenario runs in two topologies (the ``topology`` fixture): all in this process, and the session
loop, the Router and the host each in its own process over ipc (the host stays in this process, so the
RecordingHost's trace and scripts are at hand; the Router's scripted provider is scripted over its stdin).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import queue
import random
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import PEERS, PeerProcess

from actors.app.wiring import registry
from actors.inference.handle import PreparedRound, ProviderEndedError
from actors.router.actor import RouterActor
from actors.router.messages import ResolveModel
from actors.router.providers.base import ChatMessage
from actors.router.providers.scripted import ScriptedProvider
from actors.runs.session import (
    HostActor,
    HostExecuteTool,
    HostRecord,
    InvalidSessionRequest,
    ProviderResume,
    RoundCompletion,
    RoundPreparation,
    RunSession,
    SessionControl,
    SessionEvent,
    SessionHostError,
    SessionLoopService,
    SessionRoundLimitError,
    SessionRunRequest,
    SessionToolOutcome,
    idempotency_key,
    is_session_round_limit,
    run_session_future,
)
from actors.types import ToolCall, ToolCallError
from transport import Peer
from transport.errors import BusError, Expired
from transport.messages import Ok, Ping, Pong
from transport.node import Node

OP = uuid.UUID("00000000-0000-4000-8000-0000000000aa")
WAIT = 10.0


def prepared(**fields: Any) -> PreparedRound:
    values: dict[str, Any] = {
        "input": "FULL",
        "provider_input": "DELTA",
        "continuation": None,
        "model": "scripted",
        "reasoning_effort": "low",
        "tool_description": "run an application tool",
        "timeout": None,
    }
    values.update(fields)
    return PreparedRound(**values)


def tool(call_id: str, name: str = "t") -> dict[str, Any]:
    return {"call": {"name": name, "arguments": {}}, "id": call_id}


class RecordingHost:
    """The application object: every call in one ordered trace, scripted answers."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.trace: list[tuple[Any, ...]] = []
        self.prepare: Callable[[int], Any] = lambda r: RoundPreparation.Run(prepared=prepared())
        self.tool: Callable[[Any], Any] = lambda call: SessionToolOutcome.success("tool ok")
        self.resume: Callable[[SessionToolOutcome], Any] = lambda o: ProviderResume.Continue(outcome=o)
        self.control: Callable[[], Any] = lambda: SessionControl.Complete(answer="final")
        self.starts_at_submit: list[int] = []
        self.fail_on: str | None = None
        self.fail_record_of: type[Any] | None = None  # fail the first record of this event class
        self.record_with: Callable[[Any], Any] = lambda event: None  # what record returns (a Future?)
        self.seen: queue.SimpleQueue[str] = queue.SimpleQueue()  # every call's name, as it starts

    def _check(self, name: str) -> None:
        entry = self.trace[-1]
        self.seen.put(entry[0] if entry[0] != "record" else type(entry[1]).__name__)
        if self.fail_on == name:
            raise SessionHostError(f"{name} failed")

    def wait_for(self, name: str) -> None:
        """Block (bounded) until a call named ``name`` started (host method, or a record's event class)."""
        while True:
            try:
                if self.seen.get(timeout=WAIT) == name:
                    return
            except queue.Empty:
                raise AssertionError(f"no {name} within {WAIT}s; trace {self.names()}") from None

    def prepare_round(self, round: int) -> Any:
        self.trace.append(("prepare_round", round))
        self._check("prepare_round")
        return self.prepare(round)

    def record(self, event: Any) -> Any:
        if isinstance(event, SessionEvent.InferenceSubmitted):
            self.starts_at_submit.append(len(self.provider.turns))
        self.trace.append(("record", event))
        self._check("record")
        if self.fail_record_of is not None and isinstance(event, self.fail_record_of):
            self.fail_record_of = None
            raise SessionHostError("record failed")
        return self.record_with(event)

    def execute_tool(self, call: ToolCall | ToolCallError, provider_operation_id: uuid.UUID) -> Any:
        self.trace.append(("execute_tool", call, provider_operation_id))
        self._check("execute_tool")
        return self.tool(call)

    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any:
        self.trace.append(("resume", outcome))
        self._check("resume")
        return self.resume(outcome)

    def complete_capture(self, capture: Any, contents: str) -> Any:
        self.trace.append(("complete_capture", capture, contents))
        self._check("complete_capture")
        return self.control()

    def complete_round(self, completion: RoundCompletion) -> Any:
        self.trace.append(("complete_round", completion))
        self._check("complete_round")
        return self.control()

    # ------------------------------------------------------------------------------ views
    def names(self) -> list[str]:
        return [entry[0] if entry[0] != "record" else type(entry[1]).__name__ for entry in self.trace]

    def events(self, kind: type[Any]) -> list[Any]:
        return [e[1] for e in self.trace if e[0] == "record" and isinstance(e[1], kind)]

    def rounds(self) -> list[int]:
        return [e[1] for e in self.trace if e[0] == "prepare_round"]


# ------------------------------------------------------------------------------------------ topologies


class RemoteScripts:
    """The scripted provider of a Router in another process (tests/peers/session_peer.py), scripted and read
    through that process's stdin/stdout: ``add`` and ``turns`` as on ``ScriptedProvider``."""

    def __init__(self, peer: PeerProcess) -> None:
        self.peer = peer
        self._lock = threading.Lock()  # the host actor's thread may ask too (RecordingHost.record)

    def _ask(self, line: str, answer: str) -> str:
        stdin = self.peer.proc.stdin
        assert stdin is not None
        with self._lock:
            stdin.write(line + "\n")
            stdin.flush()
            return self.peer.expect_line(answer, timeout=WAIT)

    def add(self, *scripts: Any) -> None:
        self._ask("ADD " + json.dumps(list(scripts)), "ADDED")

    @property
    def turns(self) -> list[Any]:
        rows = json.loads(self._ask("TURNS", "TURNS ")[len("TURNS ") :])
        return [
            SimpleNamespace(
                messages=tuple(ChatMessage(role, content) for role, content in row["messages"]),
                reasoning_effort=row["reasoning_effort"],
                tool=SimpleNamespace(name=row["tool"][0], description=row["tool"][1]),
            )
            for row in rows
        ]


@dataclass
class Topology:
    """Where the parts of a run live: the test's node (it serves the host), the Router, the session loop."""

    name: str
    node: Node
    provider: Any  # ScriptedProvider, or RemoteScripts for a Router in another process
    router: str
    host_address: str
    loop_at: str | None = None

    def run_future(self, request: SessionRunRequest, timeout: float = WAIT) -> concurrent.futures.Future[Any]:
        return run_session_future(
            self.node, self.router, request, self.host_address, timeout=timeout, loop_at=self.loop_at
        )

    def cancel_reached_loop(self) -> None:
        """After ``future.cancel()``: the cancel is in the loop's mailbox. In-process the cancel is put there
        at once; across processes it travels the node's ordered stream to the loop service, which passes it
        on before it answers this Ping, sent on the same stream."""
        if self.loop_at is not None:
            self.node.request_future(self.loop_at, Ping(nonce=0), timeout=WAIT).result(WAIT)


@pytest.fixture(params=["inproc", pytest.param("processes", marks=pytest.mark.integration)])
def topology(
    request: pytest.FixtureRequest,
    make_node: Callable[..., Node],
    ipc_dir: Path,
    spawn_peer: Callable[..., PeerProcess],
    tmp_path: Path,
) -> Topology:
    """The same scenarios two ways: everything in this process, or the session loop, the Router and the
    host (this process) each in its own process over ipc."""
    if request.param == "inproc":
        node = make_node("n1", registry=registry())
        provider = ScriptedProvider()
        node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider})
        return Topology("inproc", node, provider, "n1/router", "n1/host")
    sock = {name: f"ipc://{ipc_dir}/{name}.sock" for name in ("t", "brain", "loop")}
    node = make_node(
        "t",
        registry=registry(),
        bind=[sock["t"]],
        peers=[Peer("brain", sock["brain"]), Peer("loop", sock["loop"])],
    )
    script = PEERS / "session_peer.py"
    router = spawn_peer(
        "--role",
        "router",
        "--name",
        "brain",
        "--bind",
        sock["brain"],
        "--data-dir",
        str(tmp_path),
        script=script,
    )
    peers = ("--peer", f"brain={sock['brain']}", "--peer", f"t={sock['t']}")
    spawn_peer("--role", "loop", "--name", "loop", "--bind", sock["loop"], *peers, script=script)
    for peer in node.peers().values():
        node.connect(peer, wait=20)
    return Topology(
        "processes", node, RemoteScripts(router), "brain/router", "t/host", loop_at="loop/sessions"
    )


@pytest.fixture
def provider(topology: Topology) -> Any:
    return topology.provider


@pytest.fixture
def host(topology: Topology) -> RecordingHost:
    app = RecordingHost(topology.provider)
    topology.node.spawn(HostActor, "host", host=app)
    return app


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    """A node of its own, for the host actor's tests."""
    return make_node("n1", registry=registry())


def request_of(*, rounds_used: int = 0, round_limit: int = 5, **fields: Any) -> SessionRunRequest:
    return SessionRunRequest(
        user_id="u1", operation_id=OP, rounds_used=rounds_used, round_limit=round_limit, **fields
    )


def run(topology: Topology, *, rounds_used: int = 0, round_limit: int = 5, **fields: Any) -> str | None:
    request = request_of(rounds_used=rounds_used, round_limit=round_limit, **fields)
    return topology.run_future(request).result(WAIT + 1)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(("used", "limit"), [(0, 0), (6, 5)])
def test_rs02_rs03_invalid_requests_touch_nothing(
    topology: Topology, host: RecordingHost, provider: Any, used: int, limit: int
) -> None:
    """RS-02, RS-03: a zero limit or rounds_used > limit → InvalidSessionRequest, empty trace, 0 starts."""
    with pytest.raises(InvalidSessionRequest) as err:
        run(topology, rounds_used=used, round_limit=limit)
    assert isinstance(err.value, ValueError)
    assert not is_session_round_limit(err.value)
    assert host.trace == [] and provider.turns == []


# -------------------------------------------------------------------------------------------- rounds


def test_rs01_rs04_rs27_rounds_are_cumulative_and_one_inference_each(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-01, RS-04, RS-27: rounds_used=7 → prepare_round(8), Continue → (9), Complete("z") → "z"; one
    provider turn per round."""
    controls = iter([SessionControl.Continue(), SessionControl.Complete(answer="z")])
    host.control = lambda: next(controls)
    assert run(topology, rounds_used=7, round_limit=20) == "z"
    assert host.rounds() == [8, 9]
    assert len(provider.turns) == 2
    assert [e.round for e in host.events(SessionEvent.ProviderReceipt)] == [8, 9]


def test_rs05_round_limit_before_prepare_round(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-05 (RT-13): rounds_used=3, limit=5, always Continue → rounds 4, 5, then SessionRoundLimitError."""
    host.control = lambda: SessionControl.Continue()
    with pytest.raises(SessionRoundLimitError) as err:
        run(topology, rounds_used=3, round_limit=5)
    assert err.value.limit == 5
    assert is_session_round_limit(err.value)
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = err.value
    assert is_session_round_limit(wrapped)
    assert not is_session_round_limit(RuntimeError(str(err.value)))  # by type, never by text
    assert host.rounds() == [4, 5]
    assert len(provider.turns) == 2


def test_rs05_exhausted_at_once(topology: Topology, host: RecordingHost) -> None:
    """RS-05: rounds_used == round_limit raises at once with 0 host calls."""
    with pytest.raises(SessionRoundLimitError):
        run(topology, rounds_used=5, round_limit=5)
    assert host.trace == []


@pytest.mark.parametrize("answer", ["done", None])
def test_rs06_complete_at_prepare_round(
    topology: Topology, host: RecordingHost, provider: Any, answer: str | None
) -> None:
    """RS-06: prepare_round → Complete(answer) returns answer with no provider call."""
    host.prepare = lambda r: RoundPreparation.Complete(answer=answer)
    assert run(topology) == answer
    assert provider.turns == []
    assert host.names() == ["prepare_round"]


def test_rs07_ev08_inference_submitted_before_the_handle_starts(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-07, EV-08: InferenceSubmitted(round, sha256(input), model) is recorded before the Router start."""
    host.prepare = lambda r: RoundPreparation.Run(prepared=prepared(input="abc"))
    assert run(topology) == "final"
    (submitted,) = host.events(SessionEvent.InferenceSubmitted)
    assert submitted.manifest_hash == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert submitted.manifest_hash == hashlib.sha256(b"abc").hexdigest()
    assert submitted.model == "scripted" and submitted.round == 1
    assert host.starts_at_submit == [0]  # no turn had started when it was recorded
    text = str(provider.turns[0].messages)
    assert "DELTA" in text and "FULL" not in text and "abc" not in text  # RS-08/RS-09: provider_input


def test_rs07_failing_submit_record_starts_nothing(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-07, RS-35: if recording InferenceSubmitted fails, 0 router starts and the error propagates."""
    host.fail_on = "record"
    with pytest.raises(SessionHostError):
        run(topology)
    assert provider.turns == []


def test_rs10_rs23_ev07_events_in_order_and_receipt_once(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-10, RS-22, RS-23, EV-07: IS (PI|UU)* PR, all with the round; receipt before complete_round."""
    provider.add([{"usage": {"input_tokens": 1, "output_tokens": 1}}, {"text": "body"}])
    assert run(topology) == "final"
    names = host.names()
    assert names[0] == "prepare_round" and names[1] == "InferenceSubmitted"
    assert names[-2:] == ["ProviderReceipt", "complete_round"]
    assert set(names[2:-2]) <= {"ProviderInput", "UsageUpdated"} and "UsageUpdated" in names
    assert {e[1].round for e in host.trace if e[0] == "record"} == {1}
    (completion,) = [e[1] for e in host.trace if e[0] == "complete_round"]
    assert completion == RoundCompletion(
        answer="body", used_tool=False, finish_requested=False, emitted_response=False
    )


# --------------------------------------------------------------------------------------------- tools


def test_rs11_rs13_rs14_rs22_tool_round_continue(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-11, RS-13, RS-14, RS-22, RS-36: valid and invalid calls go to execute_tool; the amended outcome
    is sent; flags OR'd into the RoundCompletion."""
    provider.add(
        [
            tool("c1"),
            {"raw_call": {"name": "call_ktool", "arguments": "{bad"}, "id": "c2"},
            {"text": "after"},
        ]
    )
    amended = iter(
        [
            SessionToolOutcome(text="b", ok=False, finish_after_round=True),
            SessionToolOutcome(text="c", ok=True, emitted_response=True),
        ]
    )
    host.resume = lambda o: ProviderResume.Continue(outcome=next(amended))
    assert run(topology) == "final"
    calls = [e for e in host.trace if e[0] == "execute_tool"]
    assert isinstance(calls[0][1], ToolCall) and isinstance(calls[1][1], ToolCallError)
    names = host.names()
    assert names.index("resume") < names.index("execute_tool", names.index("resume"))  # RS-36
    assert [e for e in names if e in ("execute_tool", "resume")] == ["execute_tool", "resume"] * 2
    (completion,) = [e[1] for e in host.trace if e[0] == "complete_round"]
    assert completion == RoundCompletion(
        answer="after", used_tool=True, finish_requested=True, emitted_response=True
    )
    assert len(host.events(SessionEvent.ProviderReceipt)) == 1


def test_a_tool_that_changes_its_arguments_in_place_changes_nothing_else_of_the_run(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """Isolation at the host (RS-11): each call reaches the tool as the run's own arguments (in one process
    they are handed on, not copied, from the handle to the loop to the host: neither reads them again),
    and a tool that changes them in place changes nothing else of the run: the next call comes with its
    own arguments as the model sent them, and the run completes."""
    sent = {"city": "Paris", "days": [1, 2]}
    provider.add(
        [
            {"call": {"name": "t", "arguments": sent}, "id": "c1"},
            {"call": {"name": "t", "arguments": sent}, "id": "c2"},
            {"text": "after"},
        ]
    )
    seen: list[str] = []

    def vandal(call: Any) -> SessionToolOutcome:
        seen.append(json.dumps(call.arguments, sort_keys=True))
        call.arguments["days"].append(3)
        call.arguments.clear()
        call.arguments["city"] = "changed"
        return SessionToolOutcome.success("tool ok")

    host.tool = vandal
    assert run(topology) == "final"
    assert seen == [json.dumps(sent, sort_keys=True)] * 2
    assert sent == {"city": "Paris", "days": [1, 2]}  # the script's own, untouched


def test_rs12_host_tool_error_aborts_after_accounting(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-12, RS-35: execute_tool raises X → run raises X after 1 interrupted ProviderReceipt."""
    provider.add([tool("c1"), {"text": "never"}])
    host.fail_on = "execute_tool"
    with pytest.raises(SessionHostError, match="execute_tool failed"):
        run(topology)
    (receipt,) = host.events(SessionEvent.ProviderReceipt)
    assert receipt.usage is None and receipt.continuation is None
    assert "complete_round" not in host.names()


def test_rs15_complete_at_the_resume_boundary(topology: Topology, host: RecordingHost, provider: Any) -> None:
    """RS-15, RS-25: Complete(answer) at prepare_provider_resume → no respond, the interrupted call
    accounted once, answer returned; stop on the original outcome is overridden."""
    provider.add([tool("c1"), {"text": "never"}])
    host.tool = lambda call: SessionToolOutcome(text="x", ok=True, stop=True)
    host.resume = lambda o: ProviderResume.Complete(answer="early")
    assert run(topology) == "early"
    assert host.names()[-2:] == ["resume", "ProviderReceipt"]
    assert len(host.events(SessionEvent.ProviderReceipt)) == 1
    assert host.rounds() == [1]


def test_rs16_rs19_restart_fresh(topology: Topology, host: RecordingHost, provider: Any) -> None:
    """RS-16, RS-26: RestartFresh → no respond, no complete_round for that round, the receipt
    recorded once, round r+1 prepared, the outcome's capture/stop not kept."""
    provider.add([tool("c1"), {"text": "never"}], [{"text": "second"}])
    host.tool = lambda call: SessionToolOutcome(text="x", ok=True, stop=True, capture={"t": 1})
    host.resume = lambda o: ProviderResume.RestartFresh()
    assert run(topology) == "final"
    assert host.rounds() == [1, 2]
    receipts = host.events(SessionEvent.ProviderReceipt)
    assert [r.round for r in receipts] == [1, 2]
    assert len({r.receipt.receipt_id for r in receipts}) == 2
    names = host.names()
    assert names[names.index("resume") + 1 : names.index("resume") + 3] == [
        "ProviderReceipt",
        "prepare_round",
    ]
    completions = [e[1] for e in host.trace if e[0] == "complete_round"]
    assert completions == [
        RoundCompletion(answer="second", used_tool=False, finish_requested=False, emitted_response=False)
    ]
    assert "complete_capture" not in names


def test_rs21_capture_goes_to_complete_capture(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-21: a Continue outcome with capture → complete_capture(capture, answer), no complete_round."""
    provider.add([tool("c1"), {"text": "body"}])
    host.resume = lambda o: ProviderResume.Continue(
        outcome=SessionToolOutcome(text="t", ok=True, capture={"t": 1})
    )
    host.control = lambda: SessionControl.Complete(answer="captured")
    assert run(topology) == "captured"
    assert ("complete_capture", {"t": 1}, "body") in host.trace
    assert "complete_round" not in host.names()
    assert host.names().index("ProviderReceipt") < host.names().index("complete_capture")


def test_rs24_stop_after_resumed_response(topology: Topology, host: RecordingHost, provider: Any) -> None:
    """RS-24: Continue(o2 with stop=True) → respond, then accounted; result None, no completion callback."""
    provider.add([tool("c1"), {"text": "never"}])
    host.tool = lambda call: SessionToolOutcome(text="x", ok=True, stop=True)
    assert run(topology) is None
    names = host.names()
    assert "complete_round" not in names and "complete_capture" not in names
    assert len(host.events(SessionEvent.ProviderReceipt)) == 1


def test_rs31_provider_end_accounts_and_raises(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-31: the stream closes without an answer → 1 receipt, ProviderEndedError."""
    provider.add([{"close": True}])
    with pytest.raises(ProviderEndedError):
        run(topology)
    assert len(host.events(SessionEvent.ProviderReceipt)) == 1


def test_rs32_resume_preparation_error_accounts_and_raises_it(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-32: prepare_provider_resume raises → finish_unavailable, 1 interrupted receipt, the same error;
    the provider got no response (it never continued past the call)."""
    provider.add([tool("c1"), {"text": "never"}])
    host.fail_on = "resume"
    with pytest.raises(SessionHostError, match="resume failed"):
        run(topology)
    (receipt,) = host.events(SessionEvent.ProviderReceipt)
    assert receipt.receipt.status == "interrupted" and receipt.usage is None
    assert host.names()[-2:] == ["resume", "ProviderReceipt"]
    # No tool result reached the provider: its one turn holds no second submission.
    assert len(provider.turns) == 1 and len(host.events(SessionEvent.ProviderInput)) == 1


FAULTS = [
    ("prepare_round", None),
    ("record", SessionEvent.InferenceSubmitted),
    ("record", SessionEvent.ProviderInput),
    ("record", SessionEvent.UsageUpdated),
    ("record", SessionEvent.ProviderReceipt),
    ("execute_tool", None),
    ("resume", None),
    ("complete_capture", None),
    ("complete_round", None),
]


@pytest.mark.parametrize(
    ("method", "event"), FAULTS, ids=[m if e is None else f"record-{e.__name__}" for m, e in FAULTS]
)
def test_rs35_every_host_method_fault_aborts_the_run(
    topology: Topology, host: RecordingHost, provider: Any, method: str, event: type[Any] | None
) -> None:
    """RS-35, EV-09: a fault at each SessionHost method (and at record mid-stream, per event kind) aborts the
    run with that error, after accounting for an active handle: the receipts handed to record equal the
    provider turns the Router ran, each once, and no further round is selected."""
    provider.add([{"usage": {"input_tokens": 3, "output_tokens": 1}}, tool("c1"), {"text": "body"}])
    if method == "complete_capture":
        host.resume = lambda o: ProviderResume.Continue(
            outcome=SessionToolOutcome(text="t", ok=True, capture={"t": 1})
        )
    if event is None:
        host.fail_on = method
    else:
        host.fail_record_of = event
    with pytest.raises(SessionHostError, match=f"{method} failed"):
        run(topology)
    receipts = host.events(SessionEvent.ProviderReceipt)
    assert len(receipts) == len(provider.turns)
    assert len({r.receipt.receipt_id for r in receipts}) == len(receipts)
    assert host.rounds() == [1]
    if event is SessionEvent.InferenceSubmitted or method == "prepare_round":
        assert provider.turns == []
    else:
        assert len(provider.turns) == 1
    names = host.names()
    assert "complete_round" not in names[: -1 if method == "complete_round" else None]
    # The failing call is the last one, except the interrupted turn's receipt recorded after it.
    last = names[-1] if names[-1] != "ProviderReceipt" or event is SessionEvent.ProviderReceipt else names[-2]
    assert last == (method if event is None else event.__name__)


# ---------------------------------------------------------------------------------- RS-08/09/19/37


def test_rs08_the_handle_starts_with_prepared_unchanged(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-08: the provider gets provider_input, reasoning effort and tool description exactly as the host
    prepared them (model "scripted"); the timeout is passed too (a generous one changes nothing)."""
    host.prepare = lambda r: RoundPreparation.Run(
        prepared=prepared(
            provider_input="Δ delta ✓", reasoning_effort="high", tool_description="ktool ✓", timeout=30.0
        )
    )
    assert run(topology) == "final"
    (turn,) = provider.turns
    assert [(m.role, m.content) for m in turn.messages] == [("user", "Δ delta ✓")]
    assert turn.reasoning_effort == "high"
    assert (turn.tool.name, turn.tool.description) == ("call_ktool", "ktool ✓")


def test_rs09_inconsistent_inputs_are_neither_checked_nor_repaired(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-09: continuation=None with provider_input != input → the provider gets provider_input verbatim
    and nothing complains; the audit identity is still sha256(input)."""
    host.prepare = lambda r: RoundPreparation.Run(
        prepared=prepared(input="the whole projection", provider_input="only a delta", continuation=None)
    )
    assert run(topology) == "final"
    (turn,) = provider.turns
    assert [m.content for m in turn.messages] == ["only a delta"]
    (submitted,) = host.events(SessionEvent.InferenceSubmitted)
    assert submitted.manifest_hash == hashlib.sha256(b"the whole projection").hexdigest()


def history(turn: Any) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in turn.messages]


def test_rs19_after_restart_fresh_a_none_continuation_starts_a_fresh_thread(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-19: round 1 completes with a continuation; round 2 continues it and ends in RestartFresh; round 3's
    prepare_round returns continuation=None → the provider starts a fresh thread (only round 3's input),
    never the earlier continuation reused by the runtime."""
    provider.add([{"text": "one"}], [tool("c1"), {"text": "never"}], [{"text": "three"}])

    def prepare(r: int) -> Any:
        kept = host.events(SessionEvent.ProviderReceipt)
        continuation = kept[0].continuation if r == 2 else None
        return RoundPreparation.Run(prepared=prepared(provider_input=f"in{r}", continuation=continuation))

    controls = iter([SessionControl.Continue(), SessionControl.Complete(answer="done")])
    host.prepare = prepare
    host.control = lambda: next(controls)
    host.resume = lambda o: ProviderResume.RestartFresh()
    assert run(topology) == "done"
    first, second, third = provider.turns
    assert history(first) == [("user", "in1")]
    assert history(second) == [("user", "in1"), ("assistant", "one"), ("user", "in2")]  # the host's choice
    assert history(third) == [("user", "in3")]  # fresh: nothing of rounds 1 and 2
    receipts = host.events(SessionEvent.ProviderReceipt)
    assert [r.round for r in receipts] == [1, 2, 3]
    assert receipts[0].continuation is not None and receipts[1].continuation is None  # 2 was interrupted


def test_rs37_between_rounds_only_the_round_number_is_kept(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-37: round 1's Completed carries continuation X (the host gets it in ProviderReceipt); a host
    returning None for round 2 gets a fresh thread; returning X for round 3 gets X's conversation."""
    provider.add([{"text": "one"}], [{"text": "two"}], [{"text": "three"}])

    def prepare(r: int) -> Any:
        kept = host.events(SessionEvent.ProviderReceipt)
        continuation = kept[0].continuation if r == 3 else None
        return RoundPreparation.Run(prepared=prepared(provider_input=f"in{r}", continuation=continuation))

    controls = iter(
        [SessionControl.Continue(), SessionControl.Continue(), SessionControl.Complete(answer="z")]
    )
    host.prepare = prepare
    host.control = lambda: next(controls)
    assert run(topology) == "z"
    _, second, third = provider.turns
    assert history(second) == [("user", "in2")]
    assert history(third) == [("user", "in1"), ("assistant", "one"), ("user", "in3")]
    assert host.events(SessionEvent.ProviderReceipt)[0].continuation is not None


# ------------------------------------------------------------------------------------- RS-28 / EV-07


def random_session(rng: random.Random) -> tuple[list[Any], dict[str, Any]]:
    """A random host script: per round, a provider script and the host's resume and control choices."""
    scripts: list[Any] = []
    plan: dict[str, Any] = {"resumes": [], "controls": [], "complete_at": rng.choice([None, 2, 4, 6])}
    for _ in range(8):
        steps: list[Any] = []
        if rng.random() < 0.5:
            steps.append({"usage": {"input_tokens": rng.randint(1, 9), "output_tokens": 1}})
        for n in range(rng.randint(0, 2)):
            steps.append(tool(f"c{n}"))
        steps.append({"text": "answer"})
        scripts.append(steps)
    for _ in range(20):
        plan["resumes"].append(rng.choice(["continue", "continue", "restart", "complete", "stop"]))
        plan["controls"].append(rng.choice(["continue", "continue", "complete"]))
    return scripts, plan


@pytest.mark.parametrize("seed", range(4))
def test_rs28_ev07_rounds_are_affine_under_a_random_host(
    topology: Topology, host: RecordingHost, provider: Any, seed: int
) -> None:
    """RS-28, EV-07: under a randomized host script, prepare_round arguments increase by exactly 1, each
    round has at most one InferenceSubmitted and at most one ProviderReceipt, and each round's events match
    ``IS (PI|UU)* PR?`` with that round's number."""
    scripts, plan = random_session(random.Random(seed))
    provider.add(*scripts)
    resumes, controls = iter(plan["resumes"]), iter(plan["controls"])

    def resume(o: SessionToolOutcome) -> Any:
        match next(resumes):
            case "restart":
                return ProviderResume.RestartFresh()
            case "complete":
                return ProviderResume.Complete(answer="early")
            case "stop":
                return ProviderResume.Continue(outcome=SessionToolOutcome(text="s", ok=True, stop=True))
        return ProviderResume.Continue(outcome=o)

    host.resume = resume
    host.control = lambda: (
        SessionControl.Continue() if next(controls) == "continue" else SessionControl.Complete(answer="z")
    )
    complete_at = plan["complete_at"]
    host.prepare = lambda r: (
        RoundPreparation.Complete(answer="prepared")
        if r == complete_at
        else RoundPreparation.Run(prepared=prepared(provider_input=f"in{r}"))
    )
    with contextlib.suppress(SessionRoundLimitError):
        run(topology, rounds_used=2, round_limit=9)
    rounds = host.rounds()
    assert rounds == list(range(3, 3 + len(rounds)))
    letters = {"InferenceSubmitted": "S", "ProviderInput": "I", "UsageUpdated": "U", "ProviderReceipt": "R"}
    for r in rounds:
        events = [e[1] for e in host.trace if e[0] == "record" and e[1].round == r]
        word = "".join(letters[type(e).__name__] for e in events)
        assert re.fullmatch(r"(S[IU]*R?)?", word), (r, word)
    receipts = [e.receipt.receipt_id for e in host.events(SessionEvent.ProviderReceipt)]
    assert len(receipts) == len(set(receipts)) == len(provider.turns)


# ------------------------------------------------------------------------------------------------ EV-10


def test_ev10_recording_is_awaited(topology: Topology, host: RecordingHost, provider: Any) -> None:
    """EV-10: every record is a Future the test resolves by hand; while one is unresolved no other host
    call starts and (for InferenceSubmitted) no provider turn starts, even after a round trip through the
    host's and the Router's mailboxes."""
    provider.add([{"usage": {"input_tokens": 1, "output_tokens": 1}}, tool("c1"), {"text": "body"}])
    pending: queue.SimpleQueue[concurrent.futures.Future[Any]] = queue.SimpleQueue()

    def gate(event: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        pending.put(future)
        return future

    host.record_with = gate
    result = topology.run_future(request_of())
    expected = ["InferenceSubmitted", "ProviderInput", "UsageUpdated", "ProviderInput", "ProviderReceipt"]
    for records in range(len(expected)):
        future = pending.get(timeout=WAIT)
        length, turns = len(host.trace), len(provider.turns)
        # Round trips through the host's mailbox and the Router's: anything the loop sent meanwhile is in.
        topology.node.request(topology.host_address, Ping(nonce=records), timeout=WAIT)
        topology.node.request(topology.router, ResolveModel(requested="scripted"), timeout=WAIT)
        assert len(host.trace) == length and host.trace[-1][0] == "record"
        assert len(provider.turns) == turns
        future.set_result(None)
    assert result.result(WAIT) == "final"
    assert [type(e).__name__ for e in host.events(object)] == expected


# ------------------------------------------------------------------------------ cancel (run_session_future)


def test_cancelling_the_future_mid_stream_interrupts_the_turn_once(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """Cancelling run_session_future while the provider streams (it hangs) ends the run: the open turn is
    accounted for as interrupted and its receipt recorded exactly once; no further host call follows."""
    provider.add([{"hang": True}])
    future = topology.run_future(request_of())
    host.wait_for("ProviderInput")
    assert future.cancel()
    host.wait_for("ProviderReceipt")
    (receipt,) = host.events(SessionEvent.ProviderReceipt)
    assert receipt.receipt.status == "interrupted" and receipt.round == 1
    barrier(topology)
    assert host.names() == ["prepare_round", "InferenceSubmitted", "ProviderInput", "ProviderReceipt"]


def test_cancelling_the_future_during_a_tool_ends_at_the_next_step(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """A cancel while a tool runs takes effect when the tool's outcome is in: the host's resume decision
    comes with that outcome (one ``HostRunTool`` request, RS-13), but no response reaches the provider; the
    interrupted turn's receipt is recorded once."""
    provider.add([tool("c1"), {"text": "never"}])
    outcome: concurrent.futures.Future[Any] = concurrent.futures.Future()
    host.tool = lambda call: outcome
    future = topology.run_future(request_of())
    host.wait_for("execute_tool")
    assert future.cancel()
    topology.cancel_reached_loop()
    outcome.set_result(SessionToolOutcome.success("done"))
    host.wait_for("ProviderReceipt")
    (receipt,) = host.events(SessionEvent.ProviderReceipt)
    assert receipt.receipt.status == "interrupted"
    barrier(topology)
    assert host.names()[-3:] == ["execute_tool", "resume", "ProviderReceipt"]
    # No tool result reached the provider: its one turn holds no second submission.
    assert len(provider.turns) == 1 and len(host.events(SessionEvent.ProviderInput)) == 1


class CountingHostActor(HostActor):
    """``HostActor`` noting the class of every request it serves: the bus calls a run makes to its host."""

    def __init__(self, *args: Any, served: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served = served

    def handle(self, message: Any, ctx: Any) -> Any:
        self.served.append(type(message).__name__)
        return super().handle(message, ctx)


def test_rs11_rs13_each_tool_call_is_one_request_to_the_host(topology: Topology, provider: Any) -> None:
    """RS-11, RS-13 on the bus: each tool call costs one host request (``HostRunTool``: execute_tool, then
    prepare_provider_resume on its outcome, in that order), not one per host method."""
    served: list[str] = []
    app = RecordingHost(topology.provider)
    topology.node.spawn(CountingHostActor, "host", host=app, served=served)
    provider.add([tool("c1"), tool("c2"), {"text": "done"}])
    assert run(topology) == "final"
    barrier(topology)
    assert [name for name in served if name != "HostRecord"] == [
        "HostPrepareRound",
        "HostRunTool",
        "HostRunTool",
        "HostCompleteRound",
    ]
    calls = [name for name in app.names() if name in ("execute_tool", "resume")]
    assert calls == ["execute_tool", "resume", "execute_tool", "resume"]


def barrier(topology: Topology) -> None:
    """A round trip through the host's mailbox: the loop's calls sent before it are in the trace."""
    topology.node.request(topology.host_address, Ping(nonce=0), timeout=WAIT)


# ----------------------------------------------------------------------------------- call_timeout
# The bound applies to every call of the run, so it must leave the calls that do answer (a Router commit
# with fsync, a cross-process hop on a loaded machine) their time: 0.5 s was not enough under load.
CALL_BOUND = 3.0


def test_an_expired_host_call_ends_the_run_after_accounting_once(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """SessionRunRequest.call_timeout bounds each host call: a tool that never answers (its Future is never
    resolved) ends the run with Expired; the open turn is accounted for and its receipt recorded once."""
    provider.add([tool("c1"), {"text": "never"}])
    never: concurrent.futures.Future[Any] = concurrent.futures.Future()
    host.tool = lambda call: never
    with pytest.raises(Expired):
        run(topology, call_timeout=CALL_BOUND)
    (receipt,) = host.events(SessionEvent.ProviderReceipt)
    assert receipt.receipt.status == "interrupted"
    assert host.names()[-2:] == ["execute_tool", "ProviderReceipt"]


def test_an_expired_handle_call_ends_the_run_after_accounting_once(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """call_timeout bounds the handle calls too: a provider that hangs (no next event) ends the run with
    Expired; the turn is accounted for at the Router as interrupted and its receipt recorded once."""
    provider.add([{"hang": True}])
    with pytest.raises(Expired):
        run(topology, call_timeout=CALL_BOUND)
    (receipt,) = host.events(SessionEvent.ProviderReceipt)
    assert receipt.receipt.status == "interrupted"
    assert host.names() == ["prepare_round", "InferenceSubmitted", "ProviderInput", "ProviderReceipt"]


def test_the_runs_own_deadline_running_out_stops_the_loop(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """When the caller's timeout for the whole run runs out, the caller gets Expired and the loop is told
    to stop: the open turn is accounted for and its receipt recorded once; nothing runs after it."""
    provider.add([{"hang": True}])
    with pytest.raises(Expired):
        topology.run_future(request_of(), timeout=1.0).result(WAIT)
    host.wait_for("ProviderReceipt")
    (receipt,) = host.events(SessionEvent.ProviderReceipt)
    assert receipt.receipt.status == "interrupted"
    barrier(topology)
    assert host.names() == ["prepare_round", "InferenceSubmitted", "ProviderInput", "ProviderReceipt"]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_a_non_positive_call_timeout_is_an_invalid_request(
    topology: Topology, host: RecordingHost, bad: float
) -> None:
    """A call_timeout that is not positive is refused before any host call, like RS-02."""
    with pytest.raises(InvalidSessionRequest):
        run(topology, call_timeout=bad)
    assert host.trace == []


# ---------------------------------------------------------------------------------------- host actor


def test_host_actor_idempotent_execute_tool(node: Node) -> None:
    """Idempotent tool effects: the same key twice → the tool runs once and both get its outcome."""
    app = RecordingHost(ScriptedProvider())
    runs: list[Any] = []

    def effect(call: Any) -> SessionToolOutcome:
        runs.append(call)
        return SessionToolOutcome.success(f"ran {len(runs)}")

    app.tool = effect
    node.spawn(HostActor, "host", host=app)
    key = idempotency_key(OP, 1, "c1")
    message = HostExecuteTool(
        call_id="c1", call=ToolCall(name="t", arguments={}), operation_id=OP, idempotency_key=key
    )
    first = node.request("n1/host", message, timeout=WAIT)
    second = node.request("n1/host", message, timeout=WAIT)
    assert first == second == SessionToolOutcome.success("ran 1")
    assert len(runs) == 1
    other = HostExecuteTool(
        call_id="c2",
        call=ToolCall(name="t", arguments={}),
        operation_id=OP,
        idempotency_key=idempotency_key(OP, 1, "c2"),
    )
    assert node.request("n1/host", other, timeout=WAIT) == SessionToolOutcome.success("ran 2")


def test_an_unknown_tool_outcome_reaches_the_host_and_the_model_as_a_failure(
    node: Node, tmp_path: Path
) -> None:
    """A rerun of a call whose earlier run was cut off (its host died mid-tool; the store holds its intent
    and no outcome): execute_tool is not called, prepare_provider_resume gets
    ``SessionToolOutcome(ok=False, unknown=True)``, and the model a failed tool result that says so."""
    from actors.effects import EffectStore

    provider = ScriptedProvider()
    node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider})
    store = tmp_path / "effects.sqlite3"
    dead = EffectStore(store, incarnation="dead-host")  # the rows a host that died mid-tool leaves
    dead.claim(idempotency_key(OP, 1, "c1"), "tool 't'")
    dead.close()
    app = RecordingHost(provider)
    node.spawn(HostActor, "host", host=app, effects=store)
    provider.add([tool("c1"), {"text": "after"}])
    assert run(Topology("inproc", node, provider, "n1/router", "n1/host")) == "final"
    assert "execute_tool" not in app.names()
    (resume,) = [e[1] for e in app.trace if e[0] == "resume"]
    assert (resume.ok, resume.unknown) == (False, True)
    assert resume.text.startswith("outcome unknown: tool 't' started at")
    ((call_id, result),) = provider.results
    assert (call_id, result.success, result.output) == ("c1", False, resume.text)


def test_host_actor_future_keeps_record_flowing(node: Node) -> None:
    """HostFuture: a tool returning a Future is answered later; record is served meanwhile; a duplicate
    key waits for the same run."""
    app = RecordingHost(ScriptedProvider())
    pending: concurrent.futures.Future[Any] = concurrent.futures.Future()
    runs: list[Any] = []

    def effect(call: Any) -> Any:
        runs.append(call)
        return pending

    app.tool = effect
    node.spawn(HostActor, "host", host=app)
    message = HostExecuteTool(
        call_id="c1",
        call=ToolCall(name="t", arguments={}),
        operation_id=OP,
        idempotency_key=idempotency_key(OP, 1, "c1"),
    )
    tool_future = node.request_future("n1/host", message, timeout=WAIT)
    duplicate = node.request_future("n1/host", message, timeout=WAIT)
    event = SessionEvent.InferenceSubmitted(round=1, manifest_hash="h", model="m")
    assert isinstance(node.request("n1/host", HostRecord(event=event), timeout=WAIT), Ok)
    assert not tool_future.done()
    pending.set_result(SessionToolOutcome.success("late"))
    assert tool_future.result(WAIT) == duplicate.result(WAIT) == SessionToolOutcome.success("late")
    assert len(runs) == 1


def test_host_actor_future_error_is_the_hosts(node: Node) -> None:
    """A host future failing with a BusError reaches the caller as that error."""
    app = RecordingHost(ScriptedProvider())
    failing: concurrent.futures.Future[Any] = concurrent.futures.Future()
    app.prepare = lambda r: failing
    node.spawn(HostActor, "host", host=app)
    from actors.runs.session import HostPrepareRound

    answer = node.request_future("n1/host", HostPrepareRound(round=1), timeout=WAIT)
    failing.set_exception(SessionHostError("no"))
    with pytest.raises(BusError) as err:
        answer.result(WAIT)
    assert isinstance(err.value, SessionHostError)


def test_the_loop_service_refuses_a_bad_loop_name_and_keeps_serving(node: Node) -> None:
    """SessionLoopService: a loop name outside ``session.*`` is a typed InvalidSessionRequest, and the
    service still answers the next request."""
    node.spawn(SessionLoopService, "sessions")
    bad = RunSession(request=request_of(), host="n1/host", router="n1/router", loop="router")
    with pytest.raises(InvalidSessionRequest):
        node.request("n1/sessions", bad, timeout=WAIT)
    assert isinstance(node.request("n1/sessions", Ping(nonce=1), timeout=WAIT), Pong)


def test_rt08_session_tool_outcome_constructors() -> None:
    """RT-08: success/failure set ok; capture is None and every flag False."""
    for made, ok in ((SessionToolOutcome.success("t"), True), (SessionToolOutcome.failure("t"), False)):
        assert made == SessionToolOutcome(
            text="t", ok=ok, capture=None, stop=False, finish_after_round=False, emitted_response=False
        )


def test_rs10_rs35_a_failing_record_that_came_with_a_tool_call_stops_the_call_from_running(
    topology: Topology, host: RecordingHost, provider: Any
) -> None:
    """RS-10, RS-35, EV-09: the model's input after the first tool result comes with the second call (one
    Router reply, one host request). Its record failing fails that request: the second tool never runs,
    and the run raises that error after recording the open turn's receipt once."""
    provider.add([tool("c1"), tool("c2"), {"text": "never"}])
    inputs = iter(range(10))

    def second_input_fails(event: Any) -> None:
        if isinstance(event, SessionEvent.ProviderInput) and next(inputs) == 1:
            raise SessionHostError("the second input's record failed")

    host.record_with = second_input_fails
    with pytest.raises(SessionHostError, match="second input"):
        run(topology)
    assert len([e for e in host.trace if e[0] == "execute_tool"]) == 1  # c1's only
    names = host.names()
    assert names[-2:] == ["ProviderInput", "ProviderReceipt"]
    assert len(host.events(SessionEvent.ProviderReceipt)) == 1
