"""How many bus messages a tool round costs, in one process (issue 15, item 6: "a round makes no more bus
calls than its rules need").

A tool round of ``run_session`` is three exchanges its rules ask for: the loop asks the host to run the
call and decide the resume (RS-11, RS-13: one request), the loop asks its handle to respond and read on
(RS-36: one request), and the handle asks the Router to take the result and read on (one request, whose
one reply is the events up to the next call: the turn steps at once, so no separate ``Ok``). Six messages.
A conversation adds its tool host (the tool runs off the loop's thread): eight.

The count is the marginal one, so what a run costs once (its start, its end) drops out: the messages of a
run with ``MORE`` tool rounds minus those of a run with ``FEWER``, over the difference. A counting probe on
the node's local delivery (named so) sees every message, request and reply, that the node routes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.conversation import ConversationRuntime, ToolRegistry
from actors.inference.handle import PreparedRound
from actors.router.actor import RouterActor
from actors.router.providers.scripted import ScriptedProvider
from actors.runs import InferenceRuntime
from actors.runs.session import (
    HostActor,
    ProviderResume,
    RoundPreparation,
    SessionControl,
    SessionRunRequest,
    SessionToolOutcome,
)
from transport.node import Node

WAIT = 10.0
FEWER, MORE = 2, 6


def script(calls: int) -> list[dict[str, Any]]:
    return [{"call": {"name": "t", "arguments": {}}, "id": f"c{i}"} for i in range(calls)] + [
        {"text": "done"}
    ]


class ToolHost:
    """A SessionHost whose every tool call succeeds at once."""

    def prepare_round(self, round: int) -> Any:
        return RoundPreparation.Run(
            prepared=PreparedRound(
                input="go",
                provider_input="go",
                continuation=None,
                model="scripted",
                reasoning_effort="",
                tool_description="t()",
                timeout=None,
            )
        )

    def record(self, event: Any) -> None:
        return None

    def execute_tool(self, call: Any, provider_operation_id: Any) -> SessionToolOutcome:
        return SessionToolOutcome.success("ok")

    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any:
        return ProviderResume.Continue(outcome=outcome)

    def complete_capture(self, capture: Any, contents: str) -> Any:
        return SessionControl.Complete(answer=contents)

    def complete_round(self, completion: Any) -> Any:
        return SessionControl.Complete(answer=completion.answer)


class DeliveryProbe:
    """Counts what ``node`` routes to its own actors (a test probe: it forwards every call unchanged)."""

    def __init__(self, node: Node) -> None:
        self.count = 0
        deliver = node.deliver_local

        def counted(*args: Any, **kwargs: Any) -> None:
            self.count += 1
            deliver(*args, **kwargs)

        node.deliver_local = counted  # type: ignore[method-assign]


@pytest.fixture
def node() -> Iterator[Node]:
    node = Node("n1", registry=registry(), request_timeout=WAIT).start()
    yield node
    node.stop()


def marginal(run: Any, probe: DeliveryProbe) -> float:
    counts = {}
    for calls in (FEWER, MORE):
        run(calls)  # once to warm (models resolved, pools started), then counted
        before = probe.count
        run(calls)
        counts[calls] = probe.count - before
    return (counts[MORE] - counts[FEWER]) / (MORE - FEWER)


def test_a_run_session_tool_round_in_one_process_is_six_messages(node: Node) -> None:
    provider = ScriptedProvider()
    node.spawn(RouterActor, "router", providers={"scripted": provider})
    node.spawn(HostActor, "host", host=ToolHost())
    runtime = InferenceRuntime(node, "n1/router", timeout=WAIT)
    probe = DeliveryProbe(node)

    def run(calls: int) -> None:
        provider.add(script(calls))
        request = SessionRunRequest(user_id="u", operation_id=uuid.uuid4(), rounds_used=0, round_limit=1)
        assert runtime.run_session(request, "n1/host", timeout=WAIT) == "done"

    assert marginal(run, probe) == 6


def test_a_conversation_tool_round_in_one_process_is_eight_messages(node: Node) -> None:
    provider = ScriptedProvider()
    node.spawn(RouterActor, "router", providers={"scripted": provider})

    def t() -> str:
        """A tool that answers at once."""
        return "ok"

    tools = ToolRegistry()
    tools.register(t)
    rt = ConversationRuntime.builder().node(node).llm("scripted").tools(tools).timeout(WAIT).build()
    probe = DeliveryProbe(node)

    def run(calls: int) -> None:
        provider.add(script(calls))
        rt.set_transcript(())
        assert rt.run("go").final_text == "done"

    try:
        assert marginal(run, probe) == 8
    finally:
        rt.stop()
