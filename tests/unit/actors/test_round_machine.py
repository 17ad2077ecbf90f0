"""The round machine's transition table driven directly (actors/runs/machine.py): (state, message) -> (state,
effects), with no actor, node or socket. Each test feeds the answers a host, handle or Router would give and
checks the effects the machine asks for, in order. The same machine on the bus is covered by the ``topology``
fixture in test_session.py (one process and across processes) and by test_subagent.py."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from actors.inference.handle import (
    FinishUnavailable,
    InferenceError,
    InferenceEvents,
    InferenceStarted,
    PreparedRound,
    Respond,
    RespondAndRead,
    SessionInferenceEvent,
)
from actors.router.messages import CountTokens, ResolveModel, SubmitInput, TokenCount
from actors.runs import machine as m
from actors.runs.projection import INVALID_CALL
from actors.runs.session import (
    SESSION,
    HostCompleteRound,
    HostPrepareRound,
    HostRecord,
    HostRunTool,
    InvalidSessionRequest,
    ProviderResume,
    RoundPreparation,
    RunSession,
    SessionCancelled,
    SessionControl,
    SessionEvent,
    SessionResult,
    SessionRoundLimitError,
    SessionRunRequest,
    SessionToolOutcome,
    idempotency_key,
)
from actors.runs.subagent import (
    SUBAGENT,
    AuditEvent,
    ContextCapacityError,
    InvalidRunRequest,
    RunRequest,
    RunSubagent,
)
from actors.types import (
    AgentProvider,
    ModelContext,
    ResolvedAgentModel,
    TokenUsage,
    ToolCall,
    ToolCallError,
    ToolCallErrorKind,
    ToolResult,
    UsageReceipt,
)

OP = uuid.UUID(int=1)
CHILD = uuid.UUID(int=2)
MODEL = ResolvedAgentModel(
    requested="m",
    model="m",
    provider=AgentProvider.SCRIPTED,
    provider_model="m",
    context_window_tokens=10_000,
    max_input_tokens=8_000,
)


def receipt(rid: str = "r1") -> UsageReceipt:
    return UsageReceipt(
        receipt_id=rid,
        operation_id=CHILD,
        parent_operation_id=OP,
        user_id="u",
        provider=AgentProvider.SCRIPTED,
        provider_model="m",
        model="m",
        round=1,
        status="interrupted",  # type: ignore[arg-type]
        usage=None,
        issued_at_ms=0,
    )


def prepared() -> PreparedRound:
    return PreparedRound(
        input="abc",
        provider_input="abc",
        continuation=None,
        model="m",
        reasoning_effort="low",
        tool_description="",
        timeout=None,
    )


class Drive:
    """Holds a machine's state; ``feed`` steps it and returns the effects of that one transition."""

    def __init__(self, flavor: Any) -> None:
        self.flavor = flavor
        self.state: Any = m.Idle()
        self.asked: Any = None

    def feed(self, message: Any) -> tuple[Any, ...]:
        result = m.step(self.flavor, self.state, message)
        self.state = result.state
        asks = [e for e in result.effects if isinstance(e, m.Ask)]
        opens = [e for e in result.effects if isinstance(e, m.Open)]
        if asks:
            self.asked = asks[-1].message
        elif opens:
            from actors.inference.handle import AwaitStarted

            self.asked = AwaitStarted()
        return result.effects

    def answer(self, value: Any) -> tuple[Any, ...]:
        return self.feed(m.Answered(self.asked, value))

    def refuse(self, error: BaseException) -> tuple[Any, ...]:
        return self.feed(m.Failed(self.asked, error))


def asked(effects: tuple[Any, ...]) -> list[Any]:
    return [e.message for e in effects if isinstance(e, m.Ask)]


def session(*, rounds_used: int = 0, round_limit: int = 5) -> Drive:
    drive = Drive(SESSION)
    request = SessionRunRequest(
        user_id="u", operation_id=OP, rounds_used=rounds_used, round_limit=round_limit
    )
    effects = drive.feed(m.Begin(RunSession(request=request, host="n/host", router="n/router")))
    if rounds_used < round_limit:
        assert asked(effects) == [HostPrepareRound(round=rounds_used + 1)]  # RS-04
    return drive


def started_session() -> Drive:
    """A session in round 1 with its handle started, reading the stream."""
    drive = session()
    effects = drive.answer(RoundPreparation.Run(prepared=prepared()))
    (record,) = asked(effects)
    assert isinstance(record, HostRecord) and isinstance(record.event, SessionEvent.InferenceSubmitted)
    (opened,) = drive.answer(None)
    assert isinstance(opened, m.Open) and opened.request.round == 1
    assert asked(drive.answer(InferenceStarted(operation_id=CHILD, model=MODEL))) == [m.READ]
    return drive


CALL = SessionInferenceEvent.ToolCall(call_id="c1", call=ToolCall(name="t", arguments={}))


def test_single_use_a_second_begin_in_a_running_machine_is_refused_and_changes_nothing() -> None:
    """Single use is the machine's state: a Begin outside Idle gets the flavor's typed error."""
    drive = started_session()
    before = drive.state
    request = SessionRunRequest(user_id="u", operation_id=OP, rounds_used=0, round_limit=5)
    effects = drive.feed(m.Begin(RunSession(request=request, host="h", router="r")))
    assert [type(e) for e in effects] == [m.Refuse]
    assert isinstance(effects[0].error, InvalidSessionRequest)
    assert drive.state == before


def test_rs02_a_zero_limit_is_refused_before_any_call() -> None:
    drive = Drive(SESSION)
    request = SessionRunRequest(user_id="u", operation_id=OP, rounds_used=0, round_limit=0)
    effects = drive.feed(m.Begin(RunSession(request=request, host="h", router="r")))
    assert [type(e) for e in effects] == [m.Refuse] and isinstance(effects[0].error, InvalidSessionRequest)
    assert isinstance(drive.state, m.Idle)


def test_rs05_an_exhausted_limit_ends_the_run_without_prepare_round() -> None:
    drive = session(rounds_used=5, round_limit=5)
    assert isinstance(drive.state, m.Ended)
    assert not asked(())
    (abort,) = m.step(
        SESSION,
        m.Idle(),
        m.Begin(
            RunSession(
                request=SessionRunRequest(user_id="u", operation_id=OP, rounds_used=5, round_limit=5),
                host="h",
                router="r",
            )
        ),
    ).effects
    assert isinstance(abort, m.Abort) and isinstance(abort.error, SessionRoundLimitError)


def test_rs11_rs13_rs14_rs22_rs23_one_tool_round_as_effects() -> None:
    """One request runs the tool and gets the resume decision (keyed by operation, round and call); the
    amended outcome is the response; the Completed receipt is recorded before complete_round, which sees
    used_tool and the OR'd flags."""
    drive = started_session()
    (execute,) = asked(drive.answer(CALL))
    assert execute == HostRunTool(
        call_id="c1",
        call=CALL.call,
        operation_id=CHILD,
        idempotency_key=idempotency_key(OP, 1, "c1"),
    )
    amended = SessionToolOutcome(text="b", ok=False, finish_after_round=True)
    assert asked(drive.answer(ProviderResume.Continue(outcome=amended))) == [
        # RS-14: the amended one; RS-36: the next event is read after it, in the same ask
        RespondAndRead(call_id="c1", result=ToolResult(success=False, output="b"), batch=True)
    ]
    assert isinstance(drive.state, m.Reading)
    done = SessionInferenceEvent.Completed(answer="fin", usage=None, receipt=receipt())
    effects = drive.answer(done)
    assert isinstance(effects[0], m.Close)
    assert asked(effects) == [
        HostRecord(
            event=SessionEvent.ProviderReceipt(round=1, usage=None, receipt=receipt(), continuation=None)
        )
    ]  # RS-23: before complete_round
    (complete,) = asked(drive.answer(None))
    assert isinstance(complete, HostCompleteRound)
    assert (complete.completion.used_tool, complete.completion.finish_requested) == (True, True)
    assert complete.completion.emitted_response is False
    effects = drive.answer(SessionControl.Complete(answer="z"))
    assert effects == (m.Finish(SessionResult(answer="z")),) and isinstance(drive.state, m.Ended)


def test_rs24_a_stopping_respond_does_not_read_on() -> None:
    """RS-24: after a ``stop`` outcome's respond the run accounts and ends, so the handle must not read
    the turn's next event in the same exchange (it would read an event nobody asked for)."""
    drive = started_session()
    drive.answer(CALL)
    stopping = SessionToolOutcome(text="b", ok=True, stop=True)
    assert asked(drive.answer(ProviderResume.Continue(outcome=stopping))) == [
        Respond(call_id="c1", result=ToolResult(success=True, output="b"), read_on=False)
    ]
    assert asked(drive.answer(None)) == [FinishUnavailable()]


def test_rs12_a_failing_tool_accounts_for_the_turn_then_raises_that_error() -> None:
    drive = started_session()
    drive.answer(CALL)
    boom = RuntimeError("tool broke")
    assert asked(drive.refuse(boom)) == [FinishUnavailable()]
    effects = drive.answer(receipt())
    assert isinstance(effects[0], m.Close)
    (record,) = asked(effects)
    assert record.event == SessionEvent.ProviderReceipt(
        round=1, usage=None, receipt=receipt(), continuation=None
    )
    (abort,) = drive.answer(None)
    assert isinstance(abort, m.Abort) and abort.error is boom and abort.progressed


def test_rs34_a_failing_accounting_is_attached_to_the_original_error() -> None:
    drive = started_session()
    drive.answer(CALL)
    boom, accounting = RuntimeError("tool broke"), RuntimeError("no finish")
    drive.refuse(boom)
    effects = drive.refuse(accounting)
    abort = effects[-1]
    assert isinstance(abort, m.Abort) and abort.error is boom
    assert any("no finish" in note for note in getattr(boom, "__notes__", ()))
    assert not any(isinstance(e, m.Ask) for e in effects)  # RS-34: no further round


def test_rs16_restart_fresh_accounts_then_selects_the_next_round_with_fresh_facts() -> None:
    drive = started_session()
    drive.answer(CALL)
    assert asked(drive.answer(ProviderResume.RestartFresh())) == [FinishUnavailable()]
    drive.answer(receipt())
    assert asked(drive.answer(None)) == [HostPrepareRound(round=2)]
    assert drive.state.run.facts.capture is None and drive.state.run.facts.used_tool is False  # RS-37


def test_cancel_waits_for_the_running_tool_then_stops_before_the_next_host_call() -> None:
    """A cancel while a tool runs: its answer (the resume decision) is taken, but no response is sent; the
    turn is accounted for (its receipt recorded once) and the run fails with SessionCancelled."""
    drive = started_session()
    drive.answer(CALL)
    assert drive.feed(m.Cancel()) == ()
    assert isinstance(drive.state, m.Cancelling)
    outcome = SessionToolOutcome.success("a")
    assert asked(drive.answer(ProviderResume.Continue(outcome=outcome))) == [FinishUnavailable()]
    (record,) = asked(drive.answer(receipt()))
    assert isinstance(record.event, SessionEvent.ProviderReceipt)
    (abort,) = drive.answer(None)
    assert isinstance(abort, m.Abort) and isinstance(abort.error, SessionCancelled)


def test_cancel_during_a_read_interrupts_it_and_records_the_one_receipt_once() -> None:
    """EV-09 under a cancelled read: the read's Completed and the accounting's answer carry the same receipt;
    it is recorded once, then SessionCancelled."""
    drive = started_session()
    assert asked(drive.feed(m.Cancel())) == [FinishUnavailable()]
    assert isinstance(drive.state, m.Interrupting)
    done = SessionInferenceEvent.Completed(answer="x", usage=None, receipt=receipt())
    assert drive.feed(m.Answered(m.READ, done)) == ()
    effects = drive.feed(m.Answered(FinishUnavailable(), receipt()))
    records = asked(effects)
    assert len(records) == 1 and records[0].event.receipt == receipt()
    (abort,) = drive.answer(None)
    assert isinstance(abort, m.Abort) and isinstance(abort.error, SessionCancelled)


def test_rs33_a_failed_respond_and_read_accounts_then_raises_the_respond_error() -> None:
    """RS-33 over the fused ask: the respond's error (no receipt attached) is the answer; the loop calls
    finish_unavailable, records its receipt, and raises that error."""
    drive = started_session()
    drive.answer(CALL)
    outcome = SessionToolOutcome.success("a")
    (respond,) = asked(drive.answer(ProviderResume.Continue(outcome=outcome)))
    assert isinstance(respond, RespondAndRead)
    error = InferenceError("provider turn failed: respond refused")
    assert asked(drive.refuse(error)) == [FinishUnavailable()]
    (record,) = asked(drive.answer(receipt()))
    assert isinstance(record.event, SessionEvent.ProviderReceipt) and record.event.receipt == receipt()
    (abort,) = drive.answer(None)
    assert isinstance(abort, m.Abort) and abort.error is error


def test_a_cancel_during_respond_and_read_interrupts_it_as_a_read() -> None:
    """The fused ask is a read: a cancel during it accounts at once (Interrupting), as during NextEvent."""
    drive = started_session()
    drive.answer(CALL)
    drive.answer(ProviderResume.Continue(outcome=SessionToolOutcome.success("a")))
    assert asked(drive.feed(m.Cancel())) == [FinishUnavailable()]
    assert isinstance(drive.state, m.Interrupting)


def test_a_cancel_before_the_begin_ends_the_run_when_it_arrives() -> None:
    drive = Drive(SESSION)
    drive.feed(m.Cancel())
    assert isinstance(drive.state, m.IdleCancelled)
    request = SessionRunRequest(user_id="u", operation_id=OP, rounds_used=0, round_limit=5)
    (abort,) = drive.feed(m.Begin(RunSession(request=request, host="h", router="r")))
    assert isinstance(abort, m.Abort) and isinstance(abort.error, SessionCancelled)


# --------------------------------------------------------------------------------------------- subagent


def subagent(task: str = "do it", reserve: int = 10) -> Drive:
    drive = Drive(SUBAGENT)
    request = RunRequest(
        user_id="u", parent_operation_id=OP, model="m", reasoning_effort="low", context=("ctx",), task=task
    )
    effects = drive.feed(
        m.Begin(RunSubagent(request=request, host="h", router="r", protocol_reserve_tokens=reserve))
    )
    assert asked(effects) == [ResolveModel(requested="m")]  # SA-01
    (started,) = asked(drive.answer(MODEL))
    assert isinstance(started, HostRecord) and isinstance(started.event, AuditEvent.Started)  # EV-01
    return drive


def count_all(drive: Drive, effects: tuple[Any, ...], size: int = 1) -> tuple[Any, ...]:
    """Answer every CountTokens the machine asks with ``size`` per text."""
    while counts := [a for a in asked(effects) if isinstance(a, CountTokens)]:
        effects = drive.answer(TokenCount(counts=tuple(size for _ in counts[0].texts), exact=True))
    return effects


def test_sa_a_second_run_on_one_machine_is_refused() -> None:
    drive = subagent()
    request = RunRequest(
        user_id="u", parent_operation_id=OP, model="m", reasoning_effort="", context=(), task="t"
    )
    effects = drive.feed(m.Begin(RunSubagent(request=request, host="h", router="r")))
    assert [type(e) for e in effects] == [m.Refuse] and isinstance(effects[0].error, InvalidRunRequest)


def test_sa06_a_projection_over_the_maximum_fails_before_the_turn_starts() -> None:
    drive = subagent()
    effects = count_all(drive, drive.answer(None), size=MODEL.max_input_tokens)
    (abort,) = effects
    assert isinstance(abort, m.Abort) and isinstance(abort.error, ContextCapacityError)
    assert not abort.progressed


def test_sa25_ev03_an_invalid_call_is_answered_without_the_host_then_the_projection_resubmitted() -> None:
    drive = subagent()
    effects = count_all(drive, drive.answer(None))
    (submitted,) = asked(effects)
    assert isinstance(submitted.event, AuditEvent.InferenceSubmitted) and submitted.event.round == 1
    (opened,) = drive.answer(None)
    assert isinstance(opened, m.Open) and opened.request.prepared.continuation is None  # SA-02
    drive.answer(InferenceStarted(operation_id=CHILD, model=MODEL))
    error = ToolCallError(kind=ToolCallErrorKind.INVALID_JSON, detail="x")
    effects = count_all(drive, drive.answer(SessionInferenceEvent.ToolCall(call_id="c1", call=error)))
    (result,) = asked(effects)
    assert result.event == AuditEvent.ToolResult(
        parent_operation_id=OP, name="call_ktool", ok=False, projection_accepted=True, result=str(error)
    )
    (submitted,) = asked(drive.answer(None))
    assert submitted.event.round == 2  # EV-02
    (submit,) = asked(drive.answer(None))
    assert isinstance(submit, SubmitInput) and INVALID_CALL in submit.input
    assert asked(drive.answer(None)) == [
        RespondAndRead(call_id="c1", result=ToolResult(success=False, output=str(error)), batch=True)
    ]
    assert isinstance(drive.state, m.Reading)


def test_every_shared_state_is_a_frozen_dataclass() -> None:
    import dataclasses

    for cls in (
        m.Idle,
        m.IdleCancelled,
        m.Starting,
        m.Reading,
        m.Accounting,
        m.RecordingReceipt,
        m.Raising,
        m.Interrupting,
        m.RecordingReceipts,
        m.Cancelling,
        m.Ended,
        m.Run,
    ):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", [ProviderResume.Complete(answer="x")])
def test_rs15_complete_at_the_resume_boundary_sends_no_response(value: Any) -> None:
    drive = started_session()
    drive.answer(CALL)
    assert asked(drive.answer(value)) == [FinishUnavailable()]  # RS-25: stop overridden, no Respond
    drive.answer(receipt())
    assert drive.answer(None) == (m.Finish(SessionResult(answer="x")),)


CONTEXT = ModelContext(model="m", reasoning_effort=None, instructions=None, items=())
INPUT = SessionInferenceEvent.ProviderInput(context=CONTEXT)
USAGE = SessionInferenceEvent.UsageUpdated(usage=TokenUsage(input_tokens=2, output_tokens=1))


def test_rs10_events_in_hand_before_a_call_are_recorded_by_its_run_tool_request_first() -> None:
    """RS-10, RS-11: a batch (input, usage, call) is one host request: HostRunTool carrying the two records,
    in order and with the round, which the host makes before the tool runs."""
    drive = started_session()
    (execute,) = asked(drive.answer(InferenceEvents(events=(INPUT, USAGE, CALL))))
    assert execute == HostRunTool(
        call_id="c1",
        call=CALL.call,
        operation_id=CHILD,
        idempotency_key=idempotency_key(OP, 1, "c1"),
        records=(
            SessionEvent.ProviderInput(round=1, context=CONTEXT),
            SessionEvent.UsageUpdated(round=1, usage=USAGE.usage),
        ),
    )
    # the records went with that call: the next call's request carries none of them again
    (respond,) = asked(drive.answer(ProviderResume.Continue(outcome=SessionToolOutcome.success("ok"))))
    assert isinstance(respond, RespondAndRead) and respond.batch
    (again,) = asked(drive.answer(CALL))
    assert isinstance(again, HostRunTool) and again.records == ()


def test_rs10_events_in_hand_without_a_call_are_recorded_one_by_one_before_the_next_is_taken() -> None:
    """RS-10, RS-23: input then completion in hand: the input is recorded on its own and the completion
    is taken only once that record is answered; then its receipt, then complete_round."""
    drive = started_session()
    (record,) = asked(drive.answer(InferenceEvents(events=(INPUT, USAGE))))
    assert record == HostRecord(event=SessionEvent.ProviderInput(round=1, context=CONTEXT))
    (record,) = asked(drive.answer(None))
    assert record == HostRecord(event=SessionEvent.UsageUpdated(round=1, usage=USAGE.usage))
    assert asked(drive.answer(None)) == [m.READ]  # nothing left in hand: the handle is asked
    done = SessionInferenceEvent.Completed(answer="fin", usage=None, receipt=receipt())
    drive = started_session()
    (record,) = asked(drive.answer(InferenceEvents(events=(INPUT, done))))
    assert record == HostRecord(event=SessionEvent.ProviderInput(round=1, context=CONTEXT))
    effects = drive.answer(None)
    assert isinstance(effects[0], m.Close)
    (receipt_record,) = asked(effects)
    assert isinstance(receipt_record.event, SessionEvent.ProviderReceipt)
    (complete,) = asked(drive.answer(None))
    assert isinstance(complete, HostCompleteRound)


def test_rs35_a_run_tool_request_whose_record_fails_aborts_after_accounting() -> None:
    """RS-35, EV-09: the folded record failing fails the HostRunTool request; the run accounts for the open
    turn (finish_unavailable, its receipt recorded) and then raises that error."""
    drive = started_session()
    asked(drive.answer(InferenceEvents(events=(INPUT, CALL))))
    error = RuntimeError("record failed")
    assert asked(drive.refuse(error)) == [FinishUnavailable()]
    effects = drive.answer(receipt("r-int"))
    (record,) = asked(effects)
    assert (
        isinstance(record.event, SessionEvent.ProviderReceipt) and record.event.receipt.receipt_id == "r-int"
    )
    (abort,) = [e for e in drive.answer(None) if isinstance(e, m.Abort)]
    assert abort.error is error


def test_a_cancel_during_a_record_stops_before_the_call_in_hand() -> None:
    """A cancel while the input's own record is out (the batch held no call) ends the run at the next
    boundary: the completion in hand is still accounted for (its receipt recorded), complete_round never
    asked."""
    drive = started_session()
    done = SessionInferenceEvent.Completed(answer="fin", usage=None, receipt=receipt())
    asked(drive.answer(InferenceEvents(events=(INPUT, done))))
    assert drive.feed(m.Cancel()) == ()
    effects = drive.answer(None)
    (record,) = asked(effects)
    assert isinstance(record.event, SessionEvent.ProviderReceipt)
    ended = drive.answer(None)
    assert not any(isinstance(e, m.Ask) for e in ended)
    (abort,) = [e for e in ended if isinstance(e, m.Abort)]
    assert isinstance(abort.error, SessionCancelled)


def test_ev09_a_failing_record_with_the_completion_in_hand_records_that_receipt_then_raises() -> None:
    """RS-35, EV-09: the input's record fails while the completion is in hand (the handle ended with it):
    the run records the completion's receipt, once, without asking the ended handle, then raises the
    record's error; complete_round is never asked."""
    drive = started_session()
    done = SessionInferenceEvent.Completed(answer="fin", usage=None, receipt=receipt("r-done"))
    asked(drive.answer(InferenceEvents(events=(INPUT, done))))
    error = RuntimeError("record failed")
    effects = drive.refuse(error)
    assert isinstance(effects[0], m.Close)
    (record,) = asked(effects)
    assert (
        isinstance(record.event, SessionEvent.ProviderReceipt) and record.event.receipt.receipt_id == "r-done"
    )
    ended = drive.answer(None)
    assert asked(ended) == []
    (abort,) = [e for e in ended if isinstance(e, m.Abort)]
    assert abort.error is error
