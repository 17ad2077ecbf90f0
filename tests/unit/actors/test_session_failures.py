"""run_session failure paths (RS-17, RS-18, RS-20, RS-29, RS-30, RS-33, RS-34) and EV-09 under each fault.

``FakeSessionRouter`` (a tiny actor speaking the Router protocol, one scripted turn per ``StartTurn``)
stands in for the real Router only because the real one cannot be made to fail in a chosen way: a start
error carrying a receipt, a stream error with or without one, a failing respond, a failing accounting.
It records every receipt it issued, so each test can check EV-09: issued == recorded, each exactly once.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.app.wiring import registry
from actors.base import DEFER, BusActor, Context
from actors.inference.handle import InferenceError, PreparedRound
from actors.router.messages import (
    CancelOperation,
    FinishUnavailable,
    NextTurnEvent,
    OperationsCancelled,
    ProviderFailed,
    ProviderUnavailable,
    ResolveModel,
    RespondCall,
    RouterError,
    StartTurn,
    TurnCompleted,
    TurnStarted,
    TurnToolCall,
    TurnUsage,
)
from actors.runs.runtime import InferenceRuntime
from actors.runs.session import (
    HostActor,
    ProviderResume,
    RoundCompletion,
    RoundPreparation,
    SessionControl,
    SessionEvent,
    SessionHostError,
    SessionRoundLimitError,
    SessionRunRequest,
    SessionToolOutcome,
)
from actors.types import AgentProvider, ResolvedAgentModel, TokenUsage, ToolCall, ToolCallError, UsageReceipt
from transport.errors import BusError
from transport.node import Node

OP = uuid.UUID("00000000-0000-4000-8000-0000000000bb")
WAIT = 10.0

MODEL = ResolvedAgentModel(
    requested="fake",
    model="fake",
    provider=AgentProvider.OTHER,
    provider_model="fake-v1",
    context_window_tokens=1000,
    max_input_tokens=900,
)

# A scripted Router step: a Router message/error, or a callable building one from (plan, operation id)
# so that a receipt is issued only when the step actually runs.
Step = Any


# ------------------------------------------------------------------------------------- FakeSessionRouter


class FakeSessionRouter:
    """The plan a ``FakeSessionRouterActor`` follows (one event script per started turn) and its record."""

    def __init__(
        self,
        *,
        turns: list[list[Step]] | None = None,
        start_errors: list[Step | None] | None = None,
        respond_errors: list[Step | None] | None = None,
        finish_errors: list[Step | None] | None = None,
    ) -> None:
        self.turns = [list(t) for t in turns or []]
        self.start_errors = list(start_errors or [])
        self.respond_errors = list(respond_errors or [])
        self.finish_errors = list(finish_errors or [])
        self.events: dict[uuid.UUID, list[Step]] = {}
        self.calls: list[Any] = []
        self.responses: list[RespondCall] = []
        self.issued: list[UsageReceipt] = []

    def receipt(self, op: uuid.UUID, status: Any = "interrupted") -> UsageReceipt:
        receipt = UsageReceipt(
            receipt_id=f"fake-{len(self.issued)}",
            operation_id=op,
            parent_operation_id=OP,
            user_id="u1",
            provider=AgentProvider.OTHER,
            provider_model="fake-v1",
            model="fake",
            round=1,
            status=status,
            usage=None,
            issued_at_ms=1,
        )
        self.issued.append(receipt)
        return receipt

    def step(self, step: Step, op: uuid.UUID) -> Any:
        value = step(self, op) if callable(step) else step
        if isinstance(value, BaseException):
            raise value
        return value

    def starts(self) -> int:
        return sum(isinstance(c, StartTurn) for c in self.calls)


class FakeSessionRouterActor(BusActor):
    """Speaks the Router protocol from a ``FakeSessionRouter`` plan, on its own thread like the real one."""

    def __init__(self, node: Node, address: str, *, plan: FakeSessionRouter) -> None:
        super().__init__(node, address)
        self.plan = plan

    def handle(self, message: Any, ctx: Context) -> Any:
        plan = self.plan
        plan.calls.append(message)
        match message:
            case ResolveModel():
                return MODEL
            case StartTurn():
                op = uuid.uuid4()
                error = plan.start_errors.pop(0) if plan.start_errors else None
                if error is not None:
                    plan.step(error, op)
                plan.events[op] = plan.turns.pop(0) if plan.turns else []
                return TurnStarted(operation_id=op, model=MODEL)
            case NextTurnEvent(operation_id=op):
                queue = plan.events[op]
                if not queue:
                    return DEFER  # hangs until the test ends
                return plan.step(queue.pop(0), op)
            case RespondCall(operation_id=op):
                plan.responses.append(message)
                error = plan.respond_errors.pop(0) if plan.respond_errors else None
                if error is not None:
                    plan.step(error, op)
                return None
            case FinishUnavailable(operation_id=op):
                error = plan.finish_errors.pop(0) if plan.finish_errors else None
                if error is not None:
                    plan.step(error, op)
                return plan.receipt(op)
            case CancelOperation(operation_id=op):
                return OperationsCancelled(operation_ids=(op,))
        raise TypeError(type(message).__name__)


def ktool(call_id: str) -> TurnToolCall:
    return TurnToolCall(call_id=call_id, name="call_ktool", arguments={"name": "t", "arguments": {}})


def completed(answer: str) -> Step:
    return lambda plan, op: TurnCompleted(answer=answer, usage=None, receipt=plan.receipt(op, "completed"))


def with_receipt(cls: type[RouterError], message: str) -> Step:
    """A Router error carrying a receipt the Router issues at the moment it raises it."""
    return lambda plan, op: cls(message, receipt=plan.receipt(op, "failed"))


# ------------------------------------------------------------------------------------------------ host


def prepared() -> PreparedRound:
    return PreparedRound(
        input="FULL",
        provider_input="DELTA",
        continuation=None,
        model="fake",
        reasoning_effort="low",
        tool_description="run an application tool",
        timeout=None,
    )


class RecordingHost:
    """The application object: every call in one ordered trace, scripted answers, optional faults."""

    def __init__(self) -> None:
        self.trace: list[tuple[Any, ...]] = []
        self.tool: Callable[[Any], Any] = lambda call: SessionToolOutcome.success("tool ok")
        self.resume: Callable[[SessionToolOutcome], Any] = lambda o: ProviderResume.Continue(outcome=o)
        self.control: Callable[[], Any] = lambda: SessionControl.Complete(answer="final")
        self.fail_tool = False
        self.fail_record: Callable[[Any], bool] = lambda event: False

    def prepare_round(self, round: int) -> Any:
        self.trace.append(("prepare_round", round))
        return RoundPreparation.Run(prepared=prepared())

    def record(self, event: Any) -> None:
        self.trace.append(("record", event))
        if self.fail_record(event):
            raise SessionHostError("record failed")

    def execute_tool(self, call: ToolCall | ToolCallError, provider_operation_id: uuid.UUID) -> Any:
        self.trace.append(("execute_tool", call))
        if self.fail_tool:
            raise SessionHostError("execute_tool failed")
        return self.tool(call)

    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any:
        self.trace.append(("resume", outcome))
        return self.resume(outcome)

    def complete_capture(self, capture: Any, contents: str) -> Any:
        self.trace.append(("complete_capture", capture, contents))
        return self.control()

    def complete_round(self, completion: RoundCompletion) -> Any:
        self.trace.append(("complete_round", completion))
        return self.control()

    # ------------------------------------------------------------------------------ views
    def names(self) -> list[str]:
        return [entry[0] if entry[0] != "record" else type(entry[1]).__name__ for entry in self.trace]

    def receipts(self) -> list[SessionEvent.ProviderReceipt]:
        kind = SessionEvent.ProviderReceipt
        return [e[1] for e in self.trace if e[0] == "record" and isinstance(e[1], kind)]

    def rounds(self) -> list[int]:
        return [e[1] for e in self.trace if e[0] == "prepare_round"]


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node("n1", registry=registry())


@pytest.fixture
def host(node: Node) -> RecordingHost:
    app = RecordingHost()
    node.spawn(HostActor, "host", host=app)
    return app


@pytest.fixture
def fake(node: Node) -> Callable[..., FakeSessionRouter]:
    def make(**plan: Any) -> FakeSessionRouter:
        router = FakeSessionRouter(**plan)
        node.spawn(FakeSessionRouterActor, "fake", plan=router)
        return router

    return make


def run(node: Node, *, round_limit: int = 5) -> str | None:
    request = SessionRunRequest(user_id="u1", operation_id=OP, rounds_used=0, round_limit=round_limit)
    return InferenceRuntime(node, "n1/fake", timeout=WAIT).run_session(request, "n1/host", timeout=WAIT)


def assert_ev09(router: FakeSessionRouter, host: RecordingHost) -> None:
    """EV-09: the recorded receipts are exactly the issued ones, each once (attempted records included)."""
    recorded = Counter(r.receipt.receipt_id for r in host.receipts())
    issued = Counter(r.receipt_id for r in router.issued)
    assert recorded == issued
    assert all(n == 1 for n in recorded.values())
    for event in host.receipts():
        assert event.receipt in router.issued


def notes(error: BaseException) -> str:
    return "\n".join(getattr(error, "__notes__", []))


# ------------------------------------------------------------------------------- RS-17 / RS-18


def test_rs17_restart_fresh_accounting_failure_selects_no_round(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-17, EV-09: finish_unavailable fails after RestartFresh → that failure is raised and
    prepare_round(r+1) is never called; no receipt was issued, none recorded."""
    router = fake(turns=[[ktool("c1")]], finish_errors=[RouterError("the ledger is busy")])
    host.resume = lambda o: ProviderResume.RestartFresh()
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, RouterError) and "ledger is busy" in str(err.value.__cause__)
    assert host.rounds() == [1]
    assert router.responses == [] and router.starts() == 1
    assert "complete_round" not in host.names()
    assert_ev09(router, host)
    assert router.issued == []


def test_rs17_restart_fresh_accounting_error_with_receipt(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-17, EV-09: the failing accounting carries a receipt → it is recorded once, the failure raised,
    no further round."""
    router = fake(turns=[[ktool("c1")]], finish_errors=[with_receipt(ProviderFailed, "gone")])
    host.resume = lambda o: ProviderResume.RestartFresh()
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, ProviderFailed)
    assert host.rounds() == [1]
    assert len(router.issued) == 1
    assert_ev09(router, host)


def test_rs17_restart_fresh_receipt_record_failure_selects_no_round(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-17, EV-09: recording the interrupted receipt fails → that failure is raised, no prepare_round(2);
    the receipt was handed to record exactly once (not retried, not lost silently)."""
    router = fake(turns=[[ktool("c1")], [completed("second")]])
    host.resume = lambda o: ProviderResume.RestartFresh()
    host.fail_record = lambda event: isinstance(event, SessionEvent.ProviderReceipt)
    with pytest.raises(SessionHostError, match="record failed"):
        run(node)
    assert host.rounds() == [1]
    assert router.starts() == 1
    assert_ev09(router, host)


def test_rs18_complete_accounting_failure_is_raised_not_the_answer(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-18, EV-09: Complete(answer) at the resume boundary and finish_unavailable fails → the failure is
    raised, the answer is not returned; no respond, no further round."""
    router = fake(turns=[[ktool("c1")]], finish_errors=[RouterError("the ledger is busy")])
    host.resume = lambda o: ProviderResume.Complete(answer="early")
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, RouterError)
    assert host.rounds() == [1] and router.responses == []
    assert_ev09(router, host)


def test_rs18_complete_receipt_record_failure_is_raised(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-18, EV-09: Complete(answer) and recording the interrupted receipt fails → raised, not answered."""
    router = fake(turns=[[ktool("c1")]])
    host.resume = lambda o: ProviderResume.Complete(answer="early")
    host.fail_record = lambda event: isinstance(event, SessionEvent.ProviderReceipt)
    with pytest.raises(SessionHostError, match="record failed"):
        run(node)
    assert len(router.issued) == 1
    assert_ev09(router, host)


# ----------------------------------------------------------------------------------------------- RS-20


def test_rs20_restart_fresh_after_a_failed_tool(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-20 (as RS-16), EV-09: RestartFresh is accepted after o.ok=False: no respond, the interrupted call
    accounted once, round 2 prepared, the outcome not kept in round 2's completion."""
    router = fake(turns=[[ktool("c1")], [completed("second")]])
    host.tool = lambda call: SessionToolOutcome(text="broke", ok=False, capture={"t": 1}, stop=True)
    host.resume = lambda o: ProviderResume.RestartFresh()
    assert run(node) == "final"
    assert router.responses == []
    assert host.rounds() == [1, 2]
    assert [r.round for r in host.receipts()] == [1, 2]
    names = host.names()
    at = names.index("resume")
    assert names[at + 1 : at + 3] == ["ProviderReceipt", "prepare_round"]
    completions = [e[1] for e in host.trace if e[0] == "complete_round"]
    assert completions == [
        RoundCompletion(answer="second", used_tool=False, finish_requested=False, emitted_response=False)
    ]
    assert "complete_capture" not in names
    assert_ev09(router, host)


# ----------------------------------------------------------------------------------------------- RS-29


def test_rs29_start_error_with_receipt_is_recorded_once(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-29, EV-09: the provider start fails with receipt R → ProviderReceipt(R, usage=None,
    continuation=None) once, then the original error; no further round."""
    router = fake(start_errors=[with_receipt(ProviderUnavailable, "the provider is down")])
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, ProviderUnavailable)
    (event,) = host.receipts()
    assert event.receipt == router.issued[0] == err.value.receipt
    assert event.round == 1 and event.usage is None and event.continuation is None
    assert host.rounds() == [1]
    assert_ev09(router, host)


def test_rs29_start_error_without_receipt_records_none(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-29, EV-09: the provider start fails without a receipt → no ProviderReceipt, the error raised."""
    router = fake(start_errors=[ProviderUnavailable("the provider is down")])
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, ProviderUnavailable)
    assert host.receipts() == [] and router.issued == []
    assert_ev09(router, host)


def test_rs29_rs34_start_receipt_record_failure_keeps_the_start_error(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-29, RS-34, EV-09: recording the start error's receipt fails → the original start error is raised
    with the record failure attached as a note."""
    router = fake(start_errors=[with_receipt(ProviderUnavailable, "the provider is down")])
    host.fail_record = lambda event: isinstance(event, SessionEvent.ProviderReceipt)
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, ProviderUnavailable)
    assert "record failed" in notes(err.value)
    assert_ev09(router, host)


# ----------------------------------------------------------------------------------------------- RS-30


def test_rs30_stream_error_with_receipt_records_the_attached_one(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-30, EV-09: a stream error carrying a receipt → that receipt recorded once, no finish_unavailable,
    the raised error has the Router error as __cause__."""
    router = fake(turns=[[with_receipt(ProviderFailed, "boom")]])
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, ProviderFailed)
    (event,) = host.receipts()
    assert event.receipt == router.issued[0] and event.receipt.status == "failed"
    assert not any(isinstance(c, FinishUnavailable) for c in router.calls)
    assert_ev09(router, host)


def test_rs30_stream_error_without_receipt_accounts_via_finish_unavailable(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-30, EV-09: a stream error without a receipt → finish_unavailable, its receipt recorded once, the
    original error (Router error as __cause__) raised."""
    router = fake(turns=[[RouterError("a glitch")]])
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, RouterError) and "a glitch" in str(err.value.__cause__)
    assert sum(isinstance(c, FinishUnavailable) for c in router.calls) == 1
    (event,) = host.receipts()
    assert event.receipt == router.issued[0] and event.receipt.status == "interrupted"
    assert event.usage is None and event.continuation is None
    assert_ev09(router, host)


def test_rs30_rs34_stream_receipt_record_failure_keeps_the_stream_error(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-30, RS-34, EV-09: recording the stream error's attached receipt fails → the stream error is
    raised with the record failure as a note; the receipt was handed to record once."""
    router = fake(turns=[[with_receipt(ProviderFailed, "boom")]])
    host.fail_record = lambda event: isinstance(event, SessionEvent.ProviderReceipt)
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, ProviderFailed)
    assert "record failed" in notes(err.value)
    assert_ev09(router, host)


# ----------------------------------------------------------------------------------------------- RS-33


def test_rs33_respond_failure_accounts_once_and_raises_it(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-33, EV-09: the native response fails (no receipt) → finish_unavailable, 1 receipt, the respond
    error raised; no completion callback, no further round."""
    router = fake(turns=[[ktool("c1")]], respond_errors=[ProviderFailed("the connection dropped")])
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, ProviderFailed)
    assert len(router.responses) == 1
    assert sum(isinstance(c, FinishUnavailable) for c in router.calls) == 1
    (event,) = host.receipts()
    assert event.round == 1 and event.usage is None and event.continuation is None
    assert host.rounds() == [1] and "complete_round" not in host.names()
    assert_ev09(router, host)


def test_rs33_respond_failure_with_receipt_records_it_once(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-33, EV-09: the native response fails with a receipt attached (the turn ended at the Router) →
    that receipt is recorded once and the respond error raised."""
    router = fake(turns=[[ktool("c1")]], respond_errors=[with_receipt(ProviderFailed, "gone")])
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, ProviderFailed)
    assert len(router.issued) == 1
    assert_ev09(router, host)


# ----------------------------------------------------------------------------------------------- RS-34


def test_rs34_tool_error_survives_an_accounting_failure(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-34, RS-12, EV-09: execute_tool raises X and finish_unavailable raises Y → X is raised with Y
    attached as a note (``__context__`` does not cross the bus); no prepare_round(r+1)."""
    router = fake(turns=[[ktool("c1")]], finish_errors=[RouterError("the ledger is busy")])
    host.fail_tool = True
    with pytest.raises(SessionHostError, match="execute_tool failed") as err:
        run(node)
    assert "ledger is busy" in notes(err.value)
    assert host.rounds() == [1]
    assert_ev09(router, host)


def test_rs34_respond_error_survives_a_receipt_record_failure(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-34, RS-33, EV-09: respond fails and recording the interrupted receipt fails too → the respond
    error is raised with the record failure as a note."""
    router = fake(turns=[[ktool("c1")]], respond_errors=[ProviderFailed("the connection dropped")])
    host.fail_record = lambda event: isinstance(event, SessionEvent.ProviderReceipt)
    with pytest.raises(InferenceError) as err:
        run(node)
    assert isinstance(err.value.__cause__, ProviderFailed)
    assert "record failed" in notes(err.value)
    assert host.rounds() == [1]
    assert_ev09(router, host)


def test_rs34_stream_error_survives_an_accounting_failure(
    node: Node, host: RecordingHost, fake: Callable[..., FakeSessionRouter]
) -> None:
    """RS-34, RS-30, EV-09: a stream error without a receipt and finish_unavailable failing → the stream
    error is raised with the accounting failure attached; nothing issued, nothing recorded."""
    router = fake(turns=[[RouterError("a glitch")]], finish_errors=[RouterError("the ledger is busy")])
    with pytest.raises(InferenceError) as err:
        run(node)
    assert "a glitch" in str(err.value.__cause__)
    assert "ledger is busy" in notes(err.value)
    assert host.rounds() == [1]
    assert_ev09(router, host)


# ------------------------------------------------------------------------- EV-09: a fault at every step


class Faults:
    """One shared step counter over every host call and every Router call of a run; ``at`` is the step
    that fails (None: none). ``steps`` names each step as it runs."""

    def __init__(self, at: int | None, with_receipt: bool) -> None:
        self.at = at
        self.with_receipt = with_receipt
        self.steps: list[str] = []

    def marker(self) -> str:
        return f"fault@{self.at}"

    def host_step(self, name: str) -> None:
        self.steps.append(name)
        if len(self.steps) - 1 == self.at:
            raise SessionHostError(f"{name} failed: {self.marker()}")

    def router_step(self, name: str, plan: FakeSessionRouter, op: uuid.UUID) -> None:
        self.steps.append(name)
        if len(self.steps) - 1 == self.at:
            receipt = plan.receipt(op, "failed") if self.with_receipt else None
            raise ProviderFailed(f"{name} failed: {self.marker()}", receipt=receipt)


class FaultyHost(RecordingHost):
    def __init__(self, faults: Faults) -> None:
        super().__init__()
        self.faults = faults

    def prepare_round(self, round: int) -> Any:
        self.trace.append(("prepare_round", round))
        self.faults.host_step("prepare_round")
        return RoundPreparation.Run(prepared=prepared())

    def record(self, event: Any) -> None:
        self.trace.append(("record", event))
        self.faults.host_step(f"record {type(event).__name__}")

    def execute_tool(self, call: ToolCall | ToolCallError, provider_operation_id: uuid.UUID) -> Any:
        self.trace.append(("execute_tool", call))
        self.faults.host_step("execute_tool")
        return self.tool(call)

    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any:
        self.trace.append(("resume", outcome))
        self.faults.host_step("resume")
        return self.resume(outcome)

    def complete_capture(self, capture: Any, contents: str) -> Any:
        self.trace.append(("complete_capture", capture, contents))
        self.faults.host_step("complete_capture")
        return self.control()

    def complete_round(self, completion: RoundCompletion) -> Any:
        self.trace.append(("complete_round", completion))
        self.faults.host_step("complete_round")
        return self.control()


class FaultyRouterActor(FakeSessionRouterActor):
    """The fake Router, failing the step ``faults.at`` when it is one of its own (start, read, respond,
    account), with or without a receipt attached."""

    def __init__(self, node: Node, address: str, *, plan: FakeSessionRouter, faults: Faults) -> None:
        super().__init__(node, address, plan=plan)
        self.faults = faults

    def handle(self, message: Any, ctx: Context) -> Any:
        op = getattr(message, "operation_id", None) or uuid.uuid4()
        match message:
            case StartTurn():
                self.faults.router_step("router start", self.plan, op)
            case NextTurnEvent():
                if not self.plan.events[op]:
                    return DEFER
                self.faults.router_step("router read", self.plan, op)
            case RespondCall():
                self.faults.router_step("router respond", self.plan, op)
            case FinishUnavailable():
                self.faults.router_step("router account", self.plan, op)
        return super().handle(message, ctx)


SCENARIO = st.lists(
    st.tuples(
        st.lists(st.sampled_from(["continue", "restart", "complete", "stop", "capture"]), max_size=2),
        st.sampled_from(["continue", "complete"]),
    ),
    min_size=1,
    max_size=3,
)


def error_text(error: BaseException) -> str:
    parts = [str(error), str(error.__cause__), *getattr(error, "__notes__", [])]
    return "\n".join(parts)


def test_ev09_a_fault_at_every_step_records_each_receipt_once_and_returns_the_failure(node: Node) -> None:
    """EV-09 (RS-12, RS-17, RS-18, RS-29..RS-35): for random sessions (tools, resume choices, controls), run
    once cleanly to learn its steps (every host call and every Router call), then once per step with a
    fault injected there (Router faults with or without a receipt). Every faulted run raises the injected
    failure (itself, as the cause, or attached to it), and the receipts handed to record are exactly the
    ones the Router issued, each once."""
    runs = iter(range(10_000))

    def run_once(
        rounds: list[tuple[list[str], str]], at: int | None, with_receipt: bool
    ) -> tuple[Faults, FakeSessionRouter, FaultyHost, BaseException | None]:
        i = next(runs)
        faults = Faults(at, with_receipt)
        turns: list[list[Step]] = []
        for n, (resumes, _) in enumerate(rounds):
            script: list[Step] = [TurnUsage(usage=TokenUsage(input_tokens=n + 1))]
            script += [ktool(f"c{k}") for k in range(len(resumes))]
            turns.append([*script, completed(f"answer {n}")])
        # Every RestartFresh starts one more turn, and the controls may run rounds up to the limit (4): with
        # too few, a run waits for a turn the fake never starts (a scenario's flaw, not the loop's).
        restarts = sum(resumes.count("restart") for resumes, _ in rounds)
        plan = FakeSessionRouter(turns=turns * (restarts + 4))
        host = FaultyHost(faults)
        resumes = iter([r for rs, _ in rounds for r in rs] + ["continue"] * 20)
        controls = iter([c for _, c in rounds] + ["complete"] * 20)

        def resume(outcome: SessionToolOutcome) -> Any:
            match next(resumes):
                case "restart":
                    return ProviderResume.RestartFresh()
                case "complete":
                    return ProviderResume.Complete(answer="early")
                case "stop":
                    return ProviderResume.Continue(outcome=SessionToolOutcome(text="s", ok=True, stop=True))
                case "capture":
                    return ProviderResume.Continue(outcome=SessionToolOutcome(text="c", ok=True, capture=[1]))
            return ProviderResume.Continue(outcome=outcome)

        host.resume = resume
        host.control = lambda: (
            SessionControl.Continue()
            if next(controls) == "continue"
            else SessionControl.Complete(answer="end")
        )
        node.spawn(HostActor, f"host{i}", host=host)
        node.spawn(FaultyRouterActor, f"fake{i}", plan=plan, faults=faults)
        request = SessionRunRequest(user_id="u1", operation_id=OP, rounds_used=0, round_limit=4)
        runtime = InferenceRuntime(node, f"n1/fake{i}", timeout=WAIT)
        try:
            runtime.run_session(request, f"n1/host{i}", timeout=WAIT)
        except BusError as exc:
            return faults, plan, host, exc
        return faults, plan, host, None

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(SCENARIO, st.booleans())
    def property(rounds: list[tuple[list[str], str]], with_receipt: bool) -> None:
        clean, plan, host, error = run_once(rounds, None, with_receipt)
        assert error is None or isinstance(error, SessionRoundLimitError), error
        assert_ev09(plan, host)
        for at in range(len(clean.steps)):
            faults, plan, host, error = run_once(rounds, at, with_receipt)
            assert faults.steps[:at] == clean.steps[:at]
            assert error is not None, f"a fault at {clean.steps[at]} (step {at}) was not returned"
            assert faults.marker() in error_text(error), (clean.steps[at], error)
            assert_ev09(plan, host)

    property()
