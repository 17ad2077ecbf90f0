"""The single-turn subagent run over the real Router (scripted provider) and a RunHostActor around a
RecordingHost (RULES.md SA-01..SA-28, EV-01..EV-06, C.4)."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.inference.handle import InferenceTimeout
from actors.router.actor import RouterActor
from actors.router.catalog import ModelCatalog, ModelEntry, ProviderEntry
from actors.router.providers.scripted import ScriptedProvider
from actors.runs.projection import (
    REMOVED_MARKER,
    RUN_TOOL_DESCRIPTION,
    UPDATED_MARKER,
    Projection,
    estimate_tokens,
    rejection_text,
)
from actors.runs.runtime import InferenceRuntime
from actors.runs.subagent import (
    AuditEvent,
    CaptureFailedError,
    ContextBudget,
    ContextCapacityError,
    EmptyAnswerError,
    EmptyCaptureError,
    RunHostActor,
    RunRequest,
    RunResult,
    StateUpdate,
    SubagentHostError,
    ToolOutcome,
)
from actors.types import ToolCall, UsageReceipt
from transport.node import Node

OP = uuid.UUID("00000000-0000-4000-8000-0000000000bb")
WAIT = 10.0
RESERVE = 100


def catalog(max_input_tokens: int = 30000) -> ModelCatalog:
    return ModelCatalog(
        (
            ModelEntry(
                model="sub",
                provider="scripted",
                provider_model="scripted-sub",
                aliases=("alias",),
                context_window=max(max_input_tokens, 32768),
                max_input_tokens=max_input_tokens,
            ),
        ),
        (ProviderEntry(name="scripted", kind="scripted"),),
    )


def call(call_id: str, name: str = "t", **arguments: Any) -> dict[str, Any]:
    return {"call": {"name": name, "arguments": arguments}, "id": call_id}


class RecordingHost:
    """The application's Host: every call in one ordered trace, scripted outcomes by tool name."""

    def __init__(self, provider: ScriptedProvider) -> None:
        self.provider = provider
        self.trace: list[tuple[Any, ...]] = []
        self.outcomes: dict[str, Callable[[ToolCall, ContextBudget], Any]] = {}
        self.capture_outcome: Callable[[str], Any] = lambda contents: ToolOutcome.success(f"saved {contents}")
        self.fail_on: str | None = None
        self.budgets: list[ContextBudget] = []

    def _check(self, name: str) -> None:
        if self.fail_on == name:
            raise SubagentHostError(f"{name} failed")

    def render_tool_call(self, call: ToolCall) -> str:
        self.trace.append(("render", call.name))
        self._check("render")
        return f"CALL {call.name} {call.arguments}"

    def execute_tool(self, call: ToolCall, operation_id: uuid.UUID, budget: ContextBudget) -> Any:
        # What the provider has been answered so far: respond(n) must come before execute_tool(n+1).
        self.trace.append(("execute_tool", call.name, operation_id, len(self.provider.results)))
        self.budgets.append(budget)
        self._check("execute_tool")
        make = self.outcomes.get(call.name, lambda c, b: ToolOutcome.success(f"{c.name} ok"))
        return make(call, budget)

    def complete_capture(self, capture: Any, contents: str, budget: ContextBudget) -> Any:
        self.trace.append(("complete_capture", capture, contents, budget))
        self._check("complete_capture")
        return self.capture_outcome(contents)

    def record(self, event: Any) -> None:
        self.trace.append(("record", event))
        self._check("record")
        if self.fail_on == type(event).__name__:
            raise SubagentHostError(f"record {type(event).__name__} failed")

    # ------------------------------------------------------------------------------ views
    def events(self, kind: type[Any] | None = None) -> list[Any]:
        return [e[1] for e in self.trace if e[0] == "record" and (kind is None or isinstance(e[1], kind))]

    def names(self) -> list[str]:
        return [e[0] if e[0] != "record" else type(e[1]).__name__ for e in self.trace]


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node("n1", registry=registry())


@pytest.fixture
def provider() -> ScriptedProvider:
    return ScriptedProvider()


@pytest.fixture
def max_input() -> int:
    return 30000


@pytest.fixture
def router(node: Node, provider: ScriptedProvider, tmp_path: Path, max_input: int) -> RouterActor:
    ref = node.spawn(
        RouterActor, "router", catalog=catalog(max_input), data_dir=tmp_path, providers={"scripted": provider}
    )
    return ref  # type: ignore[no-any-return]


@pytest.fixture
def runtime(node: Node, router: Any) -> InferenceRuntime:
    return InferenceRuntime(node, "n1/router", timeout=WAIT)


@pytest.fixture
def host(node: Node, provider: ScriptedProvider) -> RecordingHost:
    app = RecordingHost(provider)
    node.spawn(RunHostActor, "host", host=app)
    return app


def request(**fields: Any) -> RunRequest:
    values: dict[str, Any] = {
        "user_id": "u1",
        "parent_operation_id": OP,
        "model": "alias",
        "reasoning_effort": "low",
        "context": ("CTX-A tools: t(x)", "CTX-B"),
        "task": "TASK do it",
        "timeout": None,
        "start_metadata": {"who": "tester", "n": [1, 2]},
    }
    values.update(fields)
    return RunRequest(**values)


def go(runtime: InferenceRuntime, **fields: Any) -> RunResult:
    result: RunResult = runtime.run(
        request(**fields), "n1/host", timeout=WAIT, protocol_reserve_tokens=RESERVE
    )
    return result


def estimate(projection: str) -> int:
    """The independent computation: the scripted provider has no tokenizer, so every piece of P is counted
    with the conservative estimate (a piece is counted on its own, so sum over the pieces)."""
    return estimate_tokens(projection)


# ----------------------------------------------------------------------------------------------- basics


def test_sa01_sa23_ev01_ev05_ev06_a_plain_answer(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-01, SA-23, EV-01, EV-05, EV-06: one resolution; Started first with the resolved model's fields;
    Completed last with the answer; every event carries the parent operation."""
    provider.add([{"text": "the answer"}])
    result = go(runtime)
    assert result.answer == "the answer"
    assert result.model.model == "sub" and result.model.requested == "alias"
    events = host.events()
    started = events[0]
    assert isinstance(started, AuditEvent.Started)
    assert (started.model, started.provider_model, started.max_input_tokens) == ("sub", "scripted-sub", 30000)
    assert started.context_window_tokens == 32768 and started.provider == "scripted"
    assert started.context == ("CTX-A tools: t(x)", "CTX-B") and started.task == "TASK do it"
    assert started.host == {"who": "tester", "n": [1, 2]}
    assert [type(e).__name__ for e in events] == [
        "Started",
        "InferenceSubmitted",
        "ProviderReceipt",
        "Completed",
    ]
    assert events[-1] == AuditEvent.Completed(parent_operation_id=OP, model="sub", response="the answer")
    assert all(e.parent_operation_id == OP for e in events)


# -------------------------------------------------------------------------------------------- helpers

PIECE = r"(?=\n\n<history>\n|<call n=|<result n=|</history>|\n\n<state>\n|<value key=|</state>)"


def pieces_estimate(projection: str) -> int:
    """SA-07's independent computation: P split where C.4 puts its pieces, each estimated on its own."""
    import re

    return sum(estimate_tokens(p) for p in re.split(PIECE, projection) if p)


def state_section(projection: str) -> str:
    return projection.partition("\n\n<state>\n")[2]


def results_of(projection: str) -> list[str]:
    import re

    return re.findall(r'<result n="\d+" status="\w+">\n(.*?)\n</result>\n', projection, flags=re.S)


def updating(*updates: tuple[str, str | None], text: str = "", displayed: tuple[str, ...] = ()) -> Any:
    return lambda c, b: ToolOutcome(
        text=text,
        ok=True,
        state_updates=tuple(StateUpdate(key=k, text=v) for k, v in updates),
        displayed_state_keys=displayed,
    )


# ---------------------------------------------------------------------------------- turn and rendering


def test_sa02_sa19_sa27_one_fresh_ephemeral_turn_for_five_tools(
    tmp_path: Path, provider: ScriptedProvider, ipc_dir: Path
) -> None:
    """SA-02, SA-19, SA-27: five calls run inside one provider turn started fresh and ephemeral (the one
    StartTurn the Router received, read back from the node's capture), with the fixed tool description;
    execute_tool(n+1) starts only after call n was answered."""
    from transport.capture import CaptureWriter, read_log
    from transport.codec import decode_header

    reg = registry()
    path = tmp_path / "n.buslog"
    with Node("n1", registry=reg, capture=CaptureWriter(path, node="n1", schema=reg.schema_hash())) as node:
        node.spawn(
            RouterActor, "router", catalog=catalog(), data_dir=tmp_path, providers={"scripted": provider}
        )
        host = RecordingHost(provider)
        node.spawn(RunHostActor, "host", host=host)
        provider.add([*(call(f"c{i}", f"t{i}") for i in range(5)), {"text": "done"}])
        assert go(InferenceRuntime(node, "n1/router", timeout=WAIT)).answer == "done"
    assert len(provider.turns) == 1
    turn = provider.turns[0]
    assert [m.role for m in turn.messages] == ["user"]  # no continuation: the projection only
    assert turn.tool.name == "call_ktool" and turn.tool.description == RUN_TOOL_DESCRIPTION
    starts = [
        reg.decode("router.start_turn", r.frames[1])
        for r in read_log(path).records
        if r.at == "deliver" and decode_header(r.frames[0]).kind == "router.start_turn"
    ]
    assert len(starts) == 1 and starts[0].ephemeral and starts[0].continuation is None
    assert starts[0].model == "sub" and starts[0].tool_description == RUN_TOOL_DESCRIPTION
    answered_before = [e[3] for e in host.trace if e[0] == "execute_tool"]
    assert answered_before == [0, 1, 2, 3, 4]


def test_sa03_sa04_sa05_order_prefix_and_history(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-03: context, task, history, state in that order. SA-04: P1 and P3 share the verbatim prefix up to
    the end of the task. SA-05: each entry is render_tool_call's text, then the exact result."""
    host.outcomes["t1"] = updating(("k", "STATE-V"), text="RESULT-1")
    host.outcomes["t2"] = lambda c, b: ToolOutcome.success("RESULT-2")
    provider.add([call("c1", "t1"), call("c2", "t2"), {"text": "done"}])
    go(runtime)
    p1, p2, p3 = provider.inputs
    prefix = "CTX-A tools: t(x)\n\nCTX-B\n\n<task>\nTASK do it\n</task>"
    assert p1 == prefix
    assert p3.startswith(prefix) and p2.startswith(prefix)
    marks = ["CTX-A", "CTX-B", "TASK do it", "<history>", "CALL t1", "RESULT-1", "CALL t2", "RESULT-2"]
    positions = [p3.index(m) for m in [*marks, "<state>", "STATE-V"]]
    assert positions == sorted(positions)
    assert "CALL t1 {}\n</call>\n" in p3 and '<result n="1" status="ok">\nRESULT-1\n</result>' in p3
    assert [e[1] for e in host.trace if e[0] == "render"] == ["t1", "t2"]  # once per call


def test_sa06_initial_projection_too_big_fails_before_the_turn(
    node: Node, provider: ScriptedProvider, tmp_path: Path, host: RecordingHost
) -> None:
    """SA-06: max_input_tokens=300, reserve 100 and a 1000-character task → ContextCapacityError(estimated,
    maximum) with no provider turn."""
    node.spawn(
        RouterActor, "small", catalog=catalog(300), data_dir=tmp_path, providers={"scripted": provider}
    )
    runtime = InferenceRuntime(node, "n1/small", timeout=WAIT)
    with pytest.raises(ContextCapacityError) as err:
        runtime.run(request(task="y" * 1000), "n1/host", timeout=WAIT, protocol_reserve_tokens=RESERVE)
    assert err.value.maximum == 300
    expected = pieces_estimate("CTX-A tools: t(x)\n\nCTX-B\n\n<task>\n" + "y" * 1000 + "\n</task>")
    assert err.value.estimated == expected + RESERVE
    assert provider.turns == []
    assert [type(e).__name__ for e in host.events()] == ["Started"]


def test_sa06_cjk_is_not_undercounted_without_a_tokenizer(
    node: Node, provider: ScriptedProvider, tmp_path: Path, host: RecordingHost
) -> None:
    """SA-06 with non-ASCII text: 300 CJK characters are 900 bytes; counted at a token per byte (not 4
    characters per token, which would make it 75 tokens and let it through)."""
    node.spawn(
        RouterActor, "small", catalog=catalog(600), data_dir=tmp_path, providers={"scripted": provider}
    )
    runtime = InferenceRuntime(node, "n1/small", timeout=WAIT)
    task = "测试任务" * 75
    with pytest.raises(ContextCapacityError) as err:
        runtime.run(request(task=task, context=()), "n1/host", timeout=WAIT, protocol_reserve_tokens=RESERVE)
    assert err.value.estimated >= 900 + RESERVE
    assert provider.turns == []


def test_sa07_sa20_budget_snapshot_before_the_result(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-07, SA-20: the budget execute_tool receives is P (without this call's entry) estimated plus the
    reserve, with the model's maximum; it does not change afterwards; the operation id is the run's child
    operation, the same for every call."""
    host.outcomes["t1"] = updating(("k", "v" * 40), text="r1")
    provider.add([call("c1", "t1"), call("c2", "t2"), {"text": "done"}])
    go(runtime)
    b1, b2 = host.budgets
    p1, p2, _ = provider.inputs
    assert b1.estimated_tokens() == pieces_estimate(p1) + RESERVE
    assert b2.estimated_tokens() == pieces_estimate(p2) + RESERVE
    assert b1.max_input_tokens() == 30000 and b1.estimated_tokens() < b2.estimated_tokens()
    ops = {e[2] for e in host.trace if e[0] == "execute_tool"}
    (receipt,) = host.events(AuditEvent.ProviderReceipt)
    assert ops == {receipt.receipt.operation_id} and receipt.receipt.operation_id != OP


@pytest.mark.parametrize("max_input", [700])
def test_sa08_sa16_fits_state_agrees_with_acceptance_at_the_boundary(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-08: at the boundary fits_state(k, "x"*n) is True and "x"*(n+4) is False, and an outcome carrying
    only that update and an empty result is accepted exactly when fits_state said so (SA-16)."""
    found: dict[str, int] = {}

    def probe(size_extra: int) -> Any:
        def make(c: ToolCall, b: ContextBudget) -> Any:
            lo, hi = 0, 4000  # fits_state is monotonic in the value's size: the largest n that fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if b.fits_state("k", "x" * mid) else (lo, mid - 1)
            n = lo
            found["n"] = n
            assert b.fits_state("k", "x" * n) and not b.fits_state("k", "x" * (n + 4))
            return updating(("k", "x" * (n + size_extra)))(c, b)

        return make

    for extra, accepted in ((0, True), (4, False)):
        host.trace.clear()
        host.outcomes["t"] = probe(extra)
        provider.add([call("c1"), {"text": "done"}])
        go(runtime)
        (result,) = host.events(AuditEvent.ToolResult)
        assert result.projection_accepted is accepted
        assert ("x" * found["n"] in provider.inputs[-1]) is accepted
        assert found["n"] > 1000


def test_sa09_sa10_sa11_state_replaces_removes_and_keeps_first_set_order(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-09: (k,v1), (k,v2), (j,w), (j,None) → only k: v2. SA-10: [(m,a), (m,b)] in one outcome → m: b.
    SA-11: set a, b; update a; remove b; set b → order a, b, with a's latest value."""
    host.outcomes["t1"] = updating(("k", "v1"), ("a", "A1"), ("b", "B1"))
    host.outcomes["t2"] = updating(("k", "v2"), ("j", "w"), ("a", "A2"), ("m", "ma"), ("m", "mb"))
    host.outcomes["t3"] = updating(("j", None), ("b", None), ("b", "B2"))
    provider.add([call("c1", "t1"), call("c2", "t2"), call("c3", "t3"), {"text": "done"}])
    go(runtime)
    state = state_section(provider.inputs[-1])
    assert state == (
        '<value key="k">\nv2\n</value>\n<value key="a">\nA2\n</value>\n'
        '<value key="m">\nmb\n</value>\n<value key="b">\nB2\n</value>\n</state>'
    )
    assert "v1" not in provider.inputs[-1] and "w\n" not in state


def test_sa12_sa15_displayed_result_replaced_in_place_audit_exact(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-12: t1 returns "V1" displaying k and sets k=V1; t2 sets k=V2 → in P3 t1's result is the exact
    marker and V2 appears once. SA-15: t1's audited result is still "V1"."""
    host.outcomes["t1"] = updating(("k", "V1"), text="V1", displayed=("k",))
    host.outcomes["t2"] = updating(("k", "V2"), text="t2 done")
    provider.add([call("c1", "t1"), call("c2", "t2"), {"text": "done"}])
    go(runtime)
    p3 = provider.inputs[2]
    assert results_of(p3) == [UPDATED_MARKER, "t2 done"]
    assert UPDATED_MARKER == (
        "[Tool output was displayed here, but has since been updated "
        "and now appears elsewhere in the context]"
    )
    assert p3.count("V2") == 1 and "V1" not in p3
    assert state_section(p3) == '<value key="k">\nV2\n</value>\n</state>'
    assert [r.result for r in host.events(AuditEvent.ToolResult)] == ["V1", "t2 done"]


def test_sa13_removal_marker_is_truthful(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-13: as SA-12, but t2 removes k → t1's entry is the removal marker (which never says the value
    appears elsewhere) and the state section has no k."""
    host.outcomes["t1"] = updating(("k", "V1"), text="V1", displayed=("k",))
    host.outcomes["t2"] = updating(("k", None), text="removed")
    provider.add([call("c1", "t1"), call("c2", "t2"), {"text": "done"}])
    go(runtime)
    p3 = provider.inputs[2]
    assert results_of(p3) == [REMOVED_MARKER, "removed"]
    assert "appears elsewhere" not in REMOVED_MARKER and "removed" in REMOVED_MARKER
    assert "<state>" not in p3


def test_sa14_own_updates_never_replace_own_entry(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-14: t1 both displays and updates k → its entry keeps its exact text in P2 and later."""
    host.outcomes["t1"] = updating(("k", "V1"), text="SHOWN V1", displayed=("k",))
    provider.add([call("c1", "t1"), call("c2", "t2"), {"text": "done"}])
    go(runtime)
    assert results_of(provider.inputs[1]) == ["SHOWN V1"]
    assert results_of(provider.inputs[2])[0] == "SHOWN V1"


@pytest.mark.parametrize("max_input", [2000])
def test_sa16_oversized_success_is_rejected_state_unchanged(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-16: a 200,000-character success (with an update) under max_input_tokens=2000 → audited ok=True,
    projection_accepted=False with the exact text; the provider gets a failure; the state is unchanged."""
    big = "z" * 200_000
    host.outcomes["t1"] = updating(("k", "small"))
    host.outcomes["t2"] = updating(("k", "other"), text=big)
    provider.add([call("c1", "t1"), call("c2", "t2"), {"text": "done"}])
    go(runtime)
    first, second = host.events(AuditEvent.ToolResult)
    assert first.projection_accepted and first.ok
    assert (second.ok, second.projection_accepted, second.result) == (True, False, big)
    (_, sent) = provider.results[1]
    assert sent.success is False and sent.output.startswith("Tool result rejected:")
    assert sent.output == rejection_text(int(sent.output.split("~")[1].split(" ")[0]), 2000)
    p2, p3 = provider.inputs[1], provider.inputs[2]
    assert (
        state_section(p2)
        == state_section(p3)
        == '<value key="small">\nsmall\n</value>\n</state>'.replace('key="small"', 'key="k"')
    )
    assert big not in p3 and '<result n="2" status="failed">\nTool result rejected' in p3


def test_sa17_accepted_results_are_verbatim_in_every_later_request(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-17: a 7,999-character result that fits appears byte for byte in every later P."""
    text = "".join(chr(0x41 + i % 26) for i in range(7999))
    host.outcomes["t1"] = lambda c, b: ToolOutcome.success(text)
    provider.add([call("c1", "t1"), call("c2", "t2"), call("c3", "t3"), {"text": "done"}])
    go(runtime)
    assert all(text in p for p in provider.inputs[1:])


@pytest.mark.parametrize("max_input", [900])
def test_sa18_failures_ignore_updates_and_are_truncated_to_fit(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-18: a failure carrying updates, a capture and displayed keys leaves state and capture alone and
    is projected exactly; a failure too big to fit is truncated with "[truncated]" and audited
    projection_accepted=False."""
    host.outcomes["t1"] = lambda c, b: ToolOutcome(
        text="NOPE", ok=False, state_updates=(StateUpdate(key="k", text="v"),), capture={"f": 1}
    )
    host.outcomes["t2"] = lambda c, b: ToolOutcome.failure("E" * 20_000)
    provider.add([call("c1", "t1"), call("c2", "t2"), {"text": "done"}])
    assert go(runtime).answer == "done"  # no capture: the answer itself
    first, second = host.events(AuditEvent.ToolResult)
    assert (first.ok, first.projection_accepted, first.result) == (False, True, "NOPE")
    assert (second.ok, second.projection_accepted, second.result) == (False, False, "E" * 20_000)
    p3 = provider.inputs[2]
    assert "<state>" not in p3
    shown = results_of(p3)
    assert shown[0] == "NOPE" and shown[1].endswith("[truncated]") and shown[1].startswith("EEEE")
    assert pieces_estimate(p3) + RESERVE <= 900
    assert [r.success for _, r in provider.results] == [False, False]
    assert not [e for e in host.trace if e[0] == "complete_capture"]


@pytest.mark.parametrize("max_input", [900])
def test_sa18_a_call_that_cannot_fit_ends_the_run_after_accounting(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-18: when not even the rendered call fits, the run raises ContextCapacityError after accounting
    for the active turn (its receipt recorded once)."""
    host.render_tool_call = lambda c: "R" * 10_000  # type: ignore[method-assign]
    host.outcomes["t1"] = lambda c, b: ToolOutcome.failure("bad")
    provider.add([call("c1", "t1"), {"text": "never"}])
    with pytest.raises(ContextCapacityError):
        go(runtime)
    receipts = host.events(AuditEvent.ProviderReceipt)
    assert len(receipts) == 1 and receipts[0].receipt.status == "interrupted"
    assert not host.events(AuditEvent.Completed)


# --------------------------------------------------------------------------------------------- capture


def test_sa21_sa24_capture_takes_the_terminal_answer(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-21: t1 sets capture {"file": "a"} and the answer is "BODY" → complete_capture({"file": "a"},
    "BODY", budget) once. SA-24: the run's answer is complete_capture's outcome text."""
    host.outcomes["t1"] = lambda c, b: ToolOutcome(text="ok", ok=True, capture={"file": "a"})
    host.capture_outcome = lambda contents: ToolOutcome.success("saved 4 bytes")
    provider.add([call("c1", "t1"), {"text": "BODY"}])
    result = go(runtime)
    assert result.answer == "saved 4 bytes"
    captures = [e for e in host.trace if e[0] == "complete_capture"]
    assert [(c[1], c[2]) for c in captures] == [({"file": "a"}, "BODY")]
    assert captures[0][3].estimated_tokens() == pieces_estimate(provider.inputs[-1]) + RESERVE
    assert host.events()[-1] == AuditEvent.Completed(
        parent_operation_id=OP, model="sub", response="saved 4 bytes"
    )


def test_sa21_capture_only_from_accepted_successes_last_wins(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-21: of three captures (accepted, accepted, failed) the second one counts."""
    host.outcomes["t1"] = lambda c, b: ToolOutcome(text="1", ok=True, capture="first")
    host.outcomes["t2"] = lambda c, b: ToolOutcome(text="2", ok=True, capture="second")
    host.outcomes["t3"] = lambda c, b: ToolOutcome(text="3", ok=False, capture="failed")
    provider.add([call("c1", "t1"), call("c2", "t2"), call("c3", "t3"), {"text": "BODY"}])
    go(runtime)
    assert [e[1] for e in host.trace if e[0] == "complete_capture"] == ["second"]


def test_sa22_empty_capture_is_an_explicit_failure(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-22: a capture and the answer "  \\n" → EmptyCaptureError; complete_capture is never called."""
    host.outcomes["t1"] = lambda c, b: ToolOutcome(text="ok", ok=True, capture={"file": "a"})
    provider.add([call("c1", "t1"), {"text": "  \n"}])
    with pytest.raises(EmptyCaptureError):
        go(runtime)
    assert not [e for e in host.trace if e[0] == "complete_capture"]
    assert not host.events(AuditEvent.Completed)
    assert len(host.events(AuditEvent.ProviderReceipt)) == 1


def test_sa23_empty_answer_raises(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-23: the answer "" → EmptyAnswerError, no Completed; "ok" → RunResult("ok", M)."""
    provider.add([{"text": ""}])
    with pytest.raises(EmptyAnswerError):
        go(runtime)
    assert not host.events(AuditEvent.Completed)
    provider.add([{"text": "ok"}])
    result = go(runtime)
    assert result.answer == "ok" and result.model.model == "sub"


@pytest.mark.parametrize(
    ("outcome", "error"),
    [(ToolOutcome.failure("disk full"), CaptureFailedError), (ToolOutcome.success(" "), EmptyAnswerError)],
)
def test_sa24_capture_outcome_failure_or_empty(
    runtime: InferenceRuntime,
    host: RecordingHost,
    provider: ScriptedProvider,
    outcome: ToolOutcome,
    error: Any,
) -> None:
    """SA-24: complete_capture's failed outcome → CaptureFailedError(text); empty text → EmptyAnswerError."""
    host.outcomes["t1"] = lambda c, b: ToolOutcome(text="ok", ok=True, capture={"file": "a"})
    host.capture_outcome = lambda contents: outcome
    provider.add([call("c1", "t1"), {"text": "BODY"}])
    with pytest.raises(error) as err:
        go(runtime)
    if error is CaptureFailedError:
        assert str(err.value) == "disk full"
    assert not host.events(AuditEvent.Completed)


# ------------------------------------------------------------------------------------- invalid, router


def test_sa25_invalid_call_is_answered_without_the_host(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-25: a malformed call → no render/execute_tool, the provider gets success=False with the error
    text, history has "call_ktool(<invalid>)", the audit is ToolResult("call_ktool", ok=False,
    projection_accepted=True) and there is no ToolCall audit."""
    provider.add(
        [{"raw_call": {"name": "call_ktool", "arguments": "{not json"}, "id": "bad"}, {"text": "ok"}]
    )
    go(runtime)
    assert not [e for e in host.trace if e[0] in ("render", "execute_tool")]
    ((call_id, sent),) = provider.results
    assert call_id == "bad" and sent.success is False and sent.output.startswith("invalid tool call")
    assert not host.events(AuditEvent.ToolCall)
    (audited,) = host.events(AuditEvent.ToolResult)
    assert (audited.name, audited.ok, audited.projection_accepted, audited.result) == (
        "call_ktool",
        False,
        True,
        sent.output,
    )
    assert (
        f'<call n="1">\ncall_ktool(<invalid>)\n</call>\n<result n="1" status="failed">\n{sent.output}'
        in (provider.inputs[1])
    )


def test_sa26_effort_and_timeout_reach_the_router(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-26: reasoning_effort reaches the provider; a 0.2 s timeout against a hanging provider raises after
    recording the router's receipt once (EV-04)."""
    provider.add([{"hang": True}])
    with pytest.raises(InferenceTimeout):
        go(runtime, timeout=0.2, reasoning_effort="high")
    assert provider.turns[0].reasoning_effort == "high"
    receipts = host.events(AuditEvent.ProviderReceipt)
    assert len(receipts) == 1 and receipts[0].receipt.status == "timed_out"
    assert receipts[0].round == 1 and not host.events(AuditEvent.Completed)


@pytest.mark.parametrize("where", ["render", "execute_tool", "ToolCall", "ToolResult", "InferenceSubmitted"])
def test_sa28_host_failure_aborts_after_accounting(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider, where: str
) -> None:
    """SA-28, EV-09: a host method that raises ends the run with that error; the active turn is accounted
    for as interrupted and its receipt recorded exactly once (the failed record is not retried)."""
    host.fail_on = where
    provider.add([call("c1", "t1"), {"text": "never"}])
    with pytest.raises(SubagentHostError, match="failed"):
        go(runtime)
    receipts = host.events(AuditEvent.ProviderReceipt)
    if where == "InferenceSubmitted":  # the first submission failed: no turn was started
        assert receipts == [] and provider.turns == []
    else:
        assert len(receipts) == 1 and receipts[0].receipt.status == "interrupted"
    assert not host.events(AuditEvent.Completed)
    failed = [e for e in host.events() if type(e).__name__ == where]
    assert len(failed) <= 1


def test_sa28_complete_capture_failure_after_the_receipt(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-28: complete_capture raising ends the run with that error; the completed turn's receipt was
    recorded once, before it."""
    host.outcomes["t1"] = lambda c, b: ToolOutcome(text="ok", ok=True, capture={"file": "a"})
    host.fail_on = "complete_capture"
    provider.add([call("c1", "t1"), {"text": "BODY"}])
    with pytest.raises(SubagentHostError):
        go(runtime)
    receipts = host.events(AuditEvent.ProviderReceipt)
    assert len(receipts) == 1 and receipts[0].receipt.status == "completed"


# -------------------------------------------------------------------------------------------------- EV


def test_ev02_ev03_ev04_rounds_hashes_and_order(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """EV-02: two calls → rounds 1, 2, 3 with sha256 of the inputs the provider got and the budget estimate.
    EV-03: record(ToolCall) < execute_tool < record(ToolResult) < the response. EV-04: one receipt, carrying
    the last round and its hash."""
    provider.add([call("c1", "t1", x=1), call("c2", "t2"), {"text": "done"}])
    go(runtime)
    submitted = host.events(AuditEvent.InferenceSubmitted)
    assert [s.round for s in submitted] == [1, 2, 3]
    assert [s.manifest_hash for s in submitted] == [
        hashlib.sha256(p.encode("utf-8")).hexdigest() for p in provider.inputs
    ]
    assert [s.estimated_input_tokens for s in submitted] == [
        pieces_estimate(p) + RESERVE for p in provider.inputs
    ]
    names = host.names()
    assert names[names.index("ToolCall") : names.index("ToolCall") + 4] == [
        "ToolCall",
        "execute_tool",
        "ToolResult",
        "InferenceSubmitted",
    ]
    (tool_call, _) = host.events(AuditEvent.ToolCall)
    assert (tool_call.name, tool_call.arguments) == ("t1", {"x": 1})
    (receipt,) = host.events(AuditEvent.ProviderReceipt)
    assert (receipt.round, receipt.manifest_hash) == (3, submitted[-1].manifest_hash)
    assert isinstance(receipt.receipt, UsageReceipt) and receipt.receipt.status == "completed"
    assert names[-1] == "Completed"


def test_ev04_unknown_model_records_nothing(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """EV-04, SA-01: a resolution failure → no event at all, no provider turn."""
    from actors.router.catalog import UnknownModel

    with pytest.raises(UnknownModel):
        go(runtime, model="nope")
    assert host.trace == [] and provider.turns == []


def test_ev11_every_audit_event_and_budget_survive_the_wire(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """EV-11: every AuditEvent variant a run produced, and the budgets, decode to equal values."""
    host.outcomes["t1"] = updating(("k", "v"), text="r")
    provider.add([call("c1", "t1", deep={"a": [1, 2.5, None, "ü"]}), {"text": "done"}])
    go(runtime)
    reg = registry()
    values = [*host.events(), *host.budgets]
    kinds = {type(v).__name__ for v in values}
    assert kinds >= {
        "Started",
        "InferenceSubmitted",
        "ToolCall",
        "ToolResult",
        "ProviderReceipt",
        "Completed",
    }
    for value in values:
        assert reg.decode(reg.tag_of(value), reg.encode(value)) == value


def test_projection_pieces_join_to_the_rendering() -> None:
    """C.4: the pieces concatenate to the rendered projection; empty sections are omitted."""
    p = Projection(("a", "b"), "t")
    assert p.render() == "a\n\nb\n\n<task>\nt\n</task>"
    p.add("C", "R", True, ("k",))
    p.apply([StateUpdate(key='q"<', text="V")])
    assert "".join(p.pieces()) == p.render()
    assert p.render().endswith('<value key="q&quot;&lt;">\nV\n</value>\n</state>')
    assert Projection((), "t").render() == "<task>\nt\n</task>"


# ------------------------------------------------------------------------------- the Router's new ops


def test_router_counts_with_the_conservative_estimate_without_a_tokenizer(node: Node, router: Any) -> None:
    """CountTokens for a provider without a tokenizer: exact=False, four ASCII characters per token and
    a token per byte of anything else; an unknown model is UnknownModel."""
    from actors.router.catalog import UnknownModel
    from actors.router.messages import CountTokens

    counted = node.request(
        "n1/router", CountTokens(model="alias", texts=("abcd", "abcde", "日本", "")), timeout=5
    )
    assert counted.exact is False and counted.counts == (1, 2, 6, 0)
    with pytest.raises(UnknownModel):
        node.request("n1/router", CountTokens(model="nope", texts=("x",)), timeout=5)


def test_router_submit_input_replaces_the_next_request_and_checks_the_turn(
    node: Node, router: Any, provider: ScriptedProvider
) -> None:
    """SubmitInput: applies to the request that the next RespondCall resumes (the provider's input is
    replaced, not appended); an unknown operation is TurnNotFound, an ended one TurnTerminated."""
    from actors.router.client import RouterClient
    from actors.router.messages import StartTurn, SubmitInput, TurnNotFound, TurnTerminated
    from actors.types import ToolResult

    client = RouterClient(node, "n1/router")
    provider.add([call("c1"), {"text": "done"}])
    turn = client.start_turn(
        StartTurn(user_id="u", parent_operation_id=OP, model="alias", input="FIRST", tool_description="d")
    )
    events = client.events(turn.operation_id)
    assert type(next(events)).__name__ == "TurnInput"
    assert type(next(events)).__name__ == "TurnToolCall"
    node.request("n1/router", SubmitInput(operation_id=turn.operation_id, input="SECOND"), timeout=5)
    client.respond(turn.operation_id, "c1", ToolResult(success=True, output="r"))
    rest = list(events)
    (replaced,) = [e for e in rest if type(e).__name__ == "TurnInput"]
    assert [(i.role, i.text) for i in replaced.context.items] == [("user", "SECOND")]
    assert provider.inputs == ["FIRST", "SECOND"]
    with pytest.raises(TurnTerminated):
        node.request("n1/router", SubmitInput(operation_id=turn.operation_id, input="x"), timeout=5)
    with pytest.raises(TurnNotFound):
        node.request("n1/router", SubmitInput(operation_id=uuid.uuid4(), input="x"), timeout=5)


def test_ev10_recording_is_awaited(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider, node: Node
) -> None:
    """EV-10: while the host has not finished recording InferenceSubmitted (its record returns a future the
    test holds), the provider turn does not start; resolving it lets the run go on."""
    import concurrent.futures
    import threading

    held: concurrent.futures.Future[None] = concurrent.futures.Future()
    asked = threading.Event()
    plain = host.record

    def record(event: Any) -> Any:
        plain(event)
        if isinstance(event, AuditEvent.InferenceSubmitted):
            asked.set()
            return held
        return None

    host.record = record  # type: ignore[method-assign]
    provider.add([{"text": "after the record"}])
    future = runtime.run_future(request(), "n1/host", timeout=WAIT, protocol_reserve_tokens=RESERVE)
    assert asked.wait(WAIT)
    from actors.router.messages import ResolveModel

    node.request("n1/router", ResolveModel(requested="sub"), timeout=WAIT)  # the Router is idle meanwhile
    assert provider.turns == [] and not future.done()
    held.set_result(None)
    assert future.result(WAIT).answer == "after the record"
    assert len(provider.turns) == 1


def test_rt10_opaque_json_reaches_the_host_unchanged(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """RT-10: start_metadata, tool arguments and the capture token cross the bus unchanged: unicode, an
    integer above 2**53, -0.0, nesting and map key order."""
    import math

    opaque = {"z": 1, "a": [2**53 + 1, -0.0, "ü→✓"], "m": {"y": None, "b": True}}
    host.outcomes["t1"] = lambda c, b: ToolOutcome(text="ok", ok=True, capture=opaque)
    provider.add([call("c1", "t1", **opaque), {"text": "BODY"}])
    go(runtime, start_metadata=opaque)
    started = host.events(AuditEvent.Started)[0]
    (tool_call,) = host.events(AuditEvent.ToolCall)
    (capture,) = [e[1] for e in host.trace if e[0] == "complete_capture"]
    for seen in (started.host, tool_call.arguments, capture):
        assert seen == opaque and list(seen) == ["z", "a", "m"]
        assert math.copysign(1.0, seen["a"][1]) == -1.0


def test_a_host_answering_the_wrong_type_fails_the_run_and_the_actors_live_on(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """A host whose execute_tool returns something other than a ToolOutcome → SubagentHostError after
    accounting (one receipt); the host actor and the Router serve the next run."""
    from actors.runs.session import SessionToolOutcome

    host.outcomes["t1"] = lambda c, b: SessionToolOutcome.success("wrong type")
    provider.add([call("c1", "t1"), {"text": "never"}])
    with pytest.raises(SubagentHostError, match="SessionToolOutcome"):
        go(runtime)
    assert [r.receipt.status for r in host.events(AuditEvent.ProviderReceipt)] == ["interrupted"]
    provider.add([{"text": "fine"}])
    assert go(runtime).answer == "fine"


def test_a_negative_reserve_is_refused_before_anything_happens(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """A negative protocol reserve → InvalidRunRequest (also a ValueError); no event, no provider turn."""
    from actors.runs.subagent import InvalidRunRequest

    with pytest.raises(InvalidRunRequest) as err:
        runtime.run(request(), "n1/host", timeout=WAIT, protocol_reserve_tokens=-1)
    assert isinstance(err.value, ValueError)
    assert host.trace == [] and provider.turns == []


def test_sa20_each_tool_call_is_keyed_by_the_run_operation_and_its_call_id(
    node: Node, runtime: InferenceRuntime, provider: ScriptedProvider, tmp_path: Path
) -> None:
    """SA-20 and the effect store: every HostExecuteTool carries ``idempotency_key(operation_id, call_id)``,
    with the run's own operation id that execute_tool receives; the store holds one finished row per call."""
    import sqlite3

    from actors.effects import idempotency_key

    app = RecordingHost(provider)
    store = tmp_path / "effects.sqlite3"
    node.spawn(RunHostActor, "host", host=app, effects=store)
    provider.add([call("c1", "t1"), call("c2", "t2"), {"text": "done"}])
    assert go(runtime).answer == "done"
    (op,) = {e[2] for e in app.trace if e[0] == "execute_tool"}
    assert op != OP  # the run's child operation, not its parent
    db = sqlite3.connect(store)
    try:
        rows = db.execute("SELECT key, summary, tag FROM effects ORDER BY rowid").fetchall()
    finally:
        db.close()
    assert rows == [
        (idempotency_key(op, "c1"), "tool 't1'", ToolOutcome.TAG),
        (idempotency_key(op, "c2"), "tool 't2'", ToolOutcome.TAG),
    ]


class HeldTool:
    """A host tool whose outcome the test releases; records when the run's receipt has been recorded."""

    def __init__(self, host: RecordingHost) -> None:
        import concurrent.futures
        import threading

        self.outcome: concurrent.futures.Future[ToolOutcome] = concurrent.futures.Future()
        self.started = threading.Event()
        self.receipt_recorded = threading.Event()
        plain = host.record

        def record(event: Any) -> None:
            plain(event)
            if isinstance(event, AuditEvent.ProviderReceipt):
                self.receipt_recorded.set()

        host.record = record  # type: ignore[method-assign]
        host.outcomes["slow"] = self.execute

    def execute(self, call: ToolCall, budget: ContextBudget) -> Any:
        self.started.set()
        return self.outcome


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_a_run_the_caller_gave_up_on_stops_at_its_next_step(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider, how: str
) -> None:
    """SA-28 applied to the caller: cancelling run_future, or its timeout running out, sends the run a
    CancelRun; once the running tool's outcome is in, the run reads nothing more from the provider and runs
    no further tool: the open turn is accounted for as interrupted, its receipt recorded exactly once."""
    from transport.errors import Expired

    held = HeldTool(host)
    provider.add([call("c1", "slow"), call("c2", "slow"), {"text": "never"}])
    future = runtime.run_future(
        request(), "n1/host", timeout=WAIT if how == "cancel" else 0.5, protocol_reserve_tokens=RESERVE
    )
    assert held.started.wait(WAIT)
    if how == "cancel":
        assert future.cancel()
    else:
        with pytest.raises(Expired):
            future.result(WAIT)
    held.outcome.set_result(ToolOutcome.success("done"))
    assert held.receipt_recorded.wait(WAIT)
    (receipt,) = host.events(AuditEvent.ProviderReceipt)
    assert receipt.receipt.status == "interrupted"
    assert [e[1] for e in host.trace if e[0] == "execute_tool"] == ["slow"]  # c2 never ran
    assert not host.events(AuditEvent.Completed)


def test_rt07_tool_outcome_constructors() -> None:
    """RT-07: success/failure set ok and leave every other field empty."""
    assert ToolOutcome.success("fine") == ToolOutcome(
        text="fine", ok=True, state_updates=(), displayed_state_keys=(), capture=None
    )
    assert ToolOutcome.failure("no") == ToolOutcome(
        text="no", ok=False, state_updates=(), displayed_state_keys=(), capture=None
    )


def test_threads_do_not_grow_with_the_subagent_runs_in_flight(
    node: Node, provider: ScriptedProvider, runtime: InferenceRuntime, host: RecordingHost
) -> None:
    """Issue 15, item 5: N subagent runs held at their tool call, then 2N, are hosted on the node's run
    pool (``RUN_HOSTS``): the thread count is the same for both, within the pool's size of what it was
    before; released, every run answers."""
    import concurrent.futures
    import threading

    from actors.base import HostPool
    from actors.runs.machine import RUN_HOSTS

    hosts, n = 2, 15
    HostPool.configure(node, RUN_HOSTS, hosts)
    held: list[concurrent.futures.Future[Any]] = []
    lock = threading.Lock()
    reached = threading.Semaphore(0)

    def hold(call: ToolCall, budget: ContextBudget) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with lock:
            held.append(future)
        reached.release()
        return future

    host.outcomes["t"] = hold
    provider.add(*([call("c1", x=1), {"text": "answer"}] for _ in range(2 * n)))

    def start() -> list[concurrent.futures.Future[Any]]:
        futures = [runtime.run_future(request(), "n1/host", timeout=WAIT) for _ in range(n)]
        for _ in range(n):
            assert reached.acquire(timeout=WAIT), "a run never reached its tool call"
        return futures

    before = {t.name for t in threading.enumerate()}
    runs = start()
    with_n = {t.name for t in threading.enumerate()}
    runs += start()
    with_2n = {t.name for t in threading.enumerate()}
    with lock:
        for future in held:
            future.set_result(ToolOutcome.success("t ok"))
    assert [r.result(WAIT).answer for r in runs] == ["answer"] * (2 * n)
    assert with_2n == with_n, (before, with_n, with_2n)
    added = with_n - before - {"kbus-router-tick"}  # the Router's ticker starts with its first turn
    assert len(added) <= hosts and all(name.startswith("HostingActor") for name in added), added
