"""Every committed capture under tests/replay/ replays with zero divergence (DESIGN.md §6, issue 17).

A log is recorded from real runs by scripts/record-replays; each names the actors it replays and the actor
class (or factory) that must reproduce each. Ids, clock readings and the Router's provider events come from
the log (transport/replay.py's seams), so no model and no factory of ids is needed. A change to the wire or
to an actor's behaviour shows here as the first divergent record with a field diff; re-record only when the
change is intended. Each actor type also has a negative control: an edited record is caught.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from peers import replay_scenarios as sc

from actors.app.echo import EchoActor
from actors.app.wiring import registry
from actors.codex.actor import CodexAdapterActor
from actors.conversation.jobs import JobRunnerActor
from actors.inference.handle import InferenceHandleActor
from actors.runs.session import SessionLoopActor
from actors.runs.subagent import SubagentRunActor
from transport.capture import CaptureLog, read_log, verify
from transport.codec import decode_header
from transport.replay import Replay

HERE = Path(__file__).parent


class CodexReplay:
    """The Codex-adapter actor with the config scripts/record-replays recorded it with (no child is started
    in a replay: the spawn and every write to the child are served from the log's effect records)."""

    @staticmethod
    def start(node: Any, address: str) -> Any:
        from peers.codex_support import weather_config

        config = weather_config(Path("/tmp/kbus-codex-replay"), "codex")
        return CodexAdapterActor.start(node, address, config=config)


# The inference handle of a run's first round: the receiver of the first AwaitStarted.
HANDLE = ("kind:si.await_started", InferenceHandleActor.replayed())
# log file -> [(actor address, or the kind of the request that starts it; actor class)]
CAPTURES: dict[str, list[tuple[str, Any]]] = {
    "echo_exchange.buslog": [("n1/echo", EchoActor)],
    # The session loop's address is made per run: find it as the receiver of the run request.
    "session_tool_round.buslog": [("kind:rs.run", SessionLoopActor), ("n1/router", sc.router()), HANDLE],
    "session_restart_fresh.buslog": [("kind:rs.run", SessionLoopActor), ("n1/router", sc.router()), HANDLE],
    "session_round_limit.buslog": [("kind:rs.run", SessionLoopActor), ("n1/router", sc.router()), HANDLE],
    # RS-24: a tool outcome with stop=True
    "session_stop.buslog": [("kind:rs.run", SessionLoopActor), ("n1/router", sc.router()), HANDLE],
    "subagent_run.buslog": [("kind:sa.run", SubagentRunActor), ("n1/router", sc.router()), HANDLE],
    "codex_tool_turn.buslog": [("cx/codex", CodexReplay)],
    # The real embedded model calls a tool; the real llama_cpp.server answers (the replays need neither).
    "conversation_tool_turn.buslog": [
        ("n1/agent", sc.conversation("smollm2")),
        ("n1/agent.host", sc.tool_host()),
        ("n1/agent.loop.0", SessionLoopActor),
        ("n1/agent.loop.0.inference.0", InferenceHandleActor.replayed()),
        ("n1/router", sc.router()),
    ],
    "router_llama_server_turn.buslog": [
        ("n1/agent", sc.conversation("smol")),
        ("n1/agent.loop.0", SessionLoopActor),
        ("n1/agent.loop.0.inference.0", InferenceHandleActor.replayed()),
        ("n1/router", sc.router(sc.lab_catalog("http://127.0.0.1:9/v1"))),
    ],
    # issue 17's seed-002 loops and gates, on the scripted model: a goal loop with its judge runs, a wakeup
    # loop whose timer fired (the firing and the clock served from the log: the replay does not wait), and
    # a plan approved through the gate actor, after which the mutating tool ran.
    "goal_loop.buslog": [
        ("n1/agent", sc.conversation("m1", judge_timeout=sc.JUDGE_TIMEOUT)),
        ("n1/agent.host", sc.tool_host()),
        *((f"n1/agent.loop.{i}", SessionLoopActor) for i in range(4)),
        *((f"n1/agent.loop.{i}.inference.0", InferenceHandleActor.replayed()) for i in range(4)),
        ("n1/router", sc.router(sc.SCRIPTED)),
    ],
    "wakeup_loop.buslog": [
        ("n1/agent", sc.conversation("m1")),
        ("n1/agent.host", sc.tool_host()),
        *((f"n1/agent.loop.{i}", SessionLoopActor) for i in range(2)),
        *((f"n1/agent.loop.{i}.inference.0", InferenceHandleActor.replayed()) for i in range(2)),
        ("n1/router", sc.router(sc.SCRIPTED)),
    ],
    "approved_plan.buslog": [
        ("n1/agent", sc.conversation("m1", plan_mode=True)),
        ("n1/agent.host", sc.tool_host(sc.plan_tools())),
        ("n1/agent.plan_gate", sc.gate()),
        ("n1/agent.loop.0", SessionLoopActor),
        ("n1/agent.loop.0.inference.0", InferenceHandleActor.replayed()),
        ("n1/router", sc.router(sc.SCRIPTED)),
    ],
    # A real shell command's end reaches the job runner as its own mailbox message: a replay runs no process.
    "background_job.buslog": [("n1/jobs", JobRunnerActor)],
}
REPLAYS = [(name, spec, cls) for name, actors in sorted(CAPTURES.items()) for spec, cls in actors]


def actor_of(log: CaptureLog, spec: str) -> str:
    if not spec.startswith("kind:"):
        return spec
    kind = spec[len("kind:") :]
    for record in log.records:
        if record.at == "deliver" and decode_header(record.frames[0]).kind == kind:
            return record.actor
    raise AssertionError(f"{log.path}: no actor received {kind}")


def test_every_capture_in_the_folder_is_listed() -> None:
    assert sorted(p.name for p in HERE.glob("*.buslog")) == sorted(CAPTURES)


@pytest.mark.parametrize(("name", "spec", "actor_class"), REPLAYS, ids=[f"{n}:{s}" for n, s, _ in REPLAYS])
def test_capture_replays_with_zero_divergence(name: str, spec: str, actor_class: Any) -> None:
    path = HERE / name
    assert verify(path).ok, verify(path).problems
    log = read_log(path)
    address = actor_of(log, spec)
    result = Replay(log, address, registry()).run(actor_class)
    assert sc.turn_workers() == []  # a replayed Router takes its provider events from the log, runs none
    assert result.delivered > 0
    assert result.compared == sum(1 for r in log.records if r.at == "send" and r.actor == address)


def test_a_different_host_answer_diverges_where_the_loop_acts_on_it() -> None:
    """The session loop really is compared: had the host completed at round 2 instead of running it, the
    loop would have answered its caller where the log has it recording the next round's submission."""
    from actors.runs.session import RoundPreparation
    from transport.capture import Record
    from transport.codec import encode_header
    from transport.replay import ReplayDivergence

    reg = registry()
    log = read_log(HERE / "session_round_limit.buslog")
    address = actor_of(log, "kind:rs.run")
    prepared = [
        r
        for r in log.records
        if r.actor == address and r.at == "deliver" and decode_header(r.frames[0]).kind == "rs.prep.run"
    ]
    target = prepared[1]
    instead = RoundPreparation.Complete(answer="stop early")
    header = decode_header(target.frames[0])._replace(kind=instead.TAG)
    records = tuple(
        Record(r.n, r.at, r.actor, r.mono_ns, (encode_header(header), reg.encode(instead)), r.hash)
        if r.n == target.n
        else r
        for r in log.records
    )
    with pytest.raises(ReplayDivergence) as err:
        Replay(CaptureLog(log.path, log.header, records, None), address, reg).run(SessionLoopActor)
    assert err.value.index is not None and err.value.index > target.n
    assert "header.kind: expected 'rs.host.record', got 'rs.result'" in err.value.diff


def test_a_different_tool_outcome_diverges_in_the_subagent_run() -> None:
    """The subagent run really is compared: had the first tool answered "MILK", the run's next message (the
    count of the candidate projection's new pieces) would carry that result, right after that answer."""
    from actors.runs.subagent import ToolOutcome
    from transport.capture import Record
    from transport.replay import ReplayDivergence

    reg = registry()
    log = read_log(HERE / "subagent_run.buslog")
    address = actor_of(log, "kind:sa.run")
    outcomes = [
        r
        for r in log.records
        if r.actor == address and r.at == "deliver" and decode_header(r.frames[0]).kind == ToolOutcome.TAG
    ]
    target = outcomes[0]
    original = reg.decode(ToolOutcome.TAG, target.frames[1])
    assert original.text == "milk"
    instead = ToolOutcome(text="MILK", ok=True, state_updates=original.state_updates)
    records = tuple(
        Record(r.n, r.at, r.actor, r.mono_ns, (target.frames[0], reg.encode(instead)), r.hash)
        if r.n == target.n
        else r
        for r in log.records
    )
    with pytest.raises(ReplayDivergence) as err:
        Replay(CaptureLog(log.path, log.header, records, None), address, reg).run(SubagentRunActor)
    assert err.value.index is not None and err.value.index > target.n
    assert "router.count_tokens" in err.value.what
    assert any("MILK" in d and "body.texts" in d for d in err.value.diff), err.value.diff


def test_a_different_child_line_diverges_where_the_adapter_reports_it() -> None:
    """The Codex adapter's replay is compared too: had the child streamed another delta, the adapter's
    reply to the caller's next_event would differ from the recorded one."""
    from actors.codex.messages import ChildOutput
    from transport.capture import Record
    from transport.replay import ReplayDivergence

    reg = registry()
    log = read_log(HERE / "codex_tool_turn.buslog")
    records = []
    changed = False
    for r in log.records:
        if r.at == "deliver" and r.actor == "cx/codex" and decode_header(r.frames[0]).kind == ChildOutput.TAG:
            body = reg.decode(ChildOutput.TAG, r.frames[1])
            if b'"delta":"Paris"' in body.data:
                body = ChildOutput(stream="stdout", data=body.data.replace(b'"Paris"', b'"Lyon"'))
                r = Record(r.n, r.at, r.actor, r.mono_ns, (r.frames[0], reg.encode(body)), r.hash)
                changed = True
        records.append(r)
    assert changed
    with pytest.raises(ReplayDivergence) as err:
        Replay(CaptureLog(log.path, log.header, tuple(records), None), "cx/codex", reg).run(CodexReplay)
    assert "body.text: expected 'Paris', got 'Lyon'" in err.value.diff


# ---------------------------------------------------------- negative controls: the conversation captures
def _edit(log: CaptureLog, target: Any, frames: tuple[bytes, ...]) -> CaptureLog:
    from transport.capture import Record

    records = tuple(
        Record(r.n, r.at, r.actor, r.mono_ns, frames, r.hash) if r.n == target.n else r for r in log.records
    )
    return CaptureLog(log.path, log.header, records, None)


def _first(log: CaptureLog, at: str, actor: str, kind: str) -> Any:
    return next(
        r for r in log.records if r.at == at and r.actor == actor and decode_header(r.frames[0]).kind == kind
    )


def test_a_different_tool_result_diverges_in_the_conversation() -> None:
    """The conversation really is compared: had the tool host answered 7006653, the conversation's tool
    outcome to its session loop would carry it."""
    from transport.replay import ReplayDivergence

    reg = registry()
    log = read_log(HERE / "conversation_tool_turn.buslog")
    target = _first(log, "deliver", "n1/agent", "conv.tool_execution")
    original = reg.decode("conv.tool_execution", target.frames[1])
    assert original.text == "7006652"
    changed = _edit(
        log,
        target,
        (target.frames[0], reg.encode(dataclasses.replace(original, text="7006653"))),
    )
    with pytest.raises(ReplayDivergence) as err:
        Replay(changed, "n1/agent", reg).run(sc.conversation("smollm2"))
    assert err.value.index is not None and err.value.index > target.n
    assert any("7006653" in d for d in err.value.diff), err.value.diff


def test_different_arguments_diverge_in_the_tool_host() -> None:
    """The tool host really runs the tool on a replay: other arguments give another recorded answer."""
    from transport.replay import ReplayDivergence

    reg = registry()
    log = read_log(HERE / "conversation_tool_turn.buslog")
    target = _first(log, "deliver", "n1/agent.host", "conv.host.execute")
    original = reg.decode("conv.host.execute", target.frames[1])
    arguments = {**original.arguments, "b": 5679}
    changed = _edit(
        log,
        target,
        (target.frames[0], reg.encode(dataclasses.replace(original, arguments=arguments))),
    )
    with pytest.raises(ReplayDivergence) as err:
        Replay(changed, "n1/agent.host", reg).run(sc.tool_host())
    assert "body.text: expected '7006652', got '7007886'" in err.value.diff


def test_an_edited_provider_event_diverges_in_the_router() -> None:
    """The Router's provider events are served from the log (no model runs): an edited text delta is what the
    Router then hands on."""
    from actors.router.providers.base import TextDelta
    from actors.router.turns import Emitted, decode_local, encode_local
    from transport.replay import MAILBOX, ReplayDivergence

    reg = registry()
    log = read_log(HERE / "conversation_tool_turn.buslog")
    target = next(
        r
        for r in log.records
        if r.at == "effect"
        and r.actor == "n1/router"
        and r.frames[0] == MAILBOX
        and isinstance(e := decode_local(reg, r.frames[1], {}), Emitted)
        and isinstance(e.event, TextDelta)
    )
    event = decode_local(reg, target.frames[1], {})
    payload = encode_local(reg, Emitted(event.operation_id, TextDelta(text="EDITED")))
    assert payload is not None
    with pytest.raises(ReplayDivergence) as err:
        Replay(_edit(log, target, (MAILBOX, payload)), "n1/router", reg).run(sc.router())
    assert err.value.index is not None and err.value.index > target.n
    assert any("EDITED" in d for d in err.value.diff), err.value.diff


def test_an_edited_recorded_id_diverges_in_the_router() -> None:
    """The Router's operation id is served from the log: an edited id record is the id it then reports."""
    import uuid

    from transport.replay import ReplayDivergence

    reg = registry()
    log = read_log(HERE / "conversation_tool_turn.buslog")
    target = next(
        r for r in log.records if r.at == "effect" and r.actor == "n1/router" and r.frames[0] == b"uuid"
    )
    edited = uuid.UUID(int=1)
    with pytest.raises(ReplayDivergence) as err:
        Replay(_edit(log, target, (b"uuid", edited.bytes)), "n1/router", reg).run(sc.router())
    assert any(f"got {edited!r}" in d for d in err.value.diff), err.value.diff


def test_an_edited_router_event_diverges_in_the_inference_handle() -> None:
    """The inference handle is compared too: a text delta the Router had sent otherwise is what the handle
    then hands its session loop."""
    from transport.replay import ReplayDivergence

    reg = registry()
    log = read_log(HERE / "conversation_tool_turn.buslog")
    handle = "n1/agent.loop.0.inference.0"
    target = _first(log, "deliver", handle, "router.ev.text")
    changed = _edit(log, target, (target.frames[0], reg.encode(dataclasses.replace(
        reg.decode("router.ev.text", target.frames[1]), text="EDITED"))))  # fmt: skip
    with pytest.raises(ReplayDivergence) as err:
        Replay(changed, handle, reg).run(InferenceHandleActor.replayed())
    assert err.value.index is not None and err.value.index > target.n
    assert any("EDITED" in d for d in err.value.diff), err.value.diff


# ------------------------------------------------- negative controls: the seed-002 loops and gates
def _edited_bytes(log: CaptureLog, target: Any, old: bytes, new: bytes) -> CaptureLog:
    assert len(old) == len(new) and old in target.frames[1]  # same length: the msgpack stays well formed
    return _edit(log, target, (target.frames[0], target.frames[1].replace(old, new)))


def _mailbox_records(log: CaptureLog, actor: str) -> list[Any]:
    from transport.replay import MAILBOX

    return [r for r in log.records if r.at == "effect" and r.actor == actor and r.frames[0] == MAILBOX]


def test_the_wakeup_timer_firing_is_served_from_the_log() -> None:
    """The wakeup loop's timer firing is a recorded mailbox message (no live timer runs on a replay): had
    another timer fired (an edited sequence number), the loop would not have woken: where the log has the
    woken turn's first message (the tool list asked of the host), the replay sends something else."""
    from transport.capture import pack_payload, unpack_payload
    from transport.replay import MAILBOX, ReplayDivergence

    reg = registry()
    log = read_log(HERE / "wakeup_loop.buslog")
    [fired] = _mailbox_records(log, "n1/agent")
    assert unpack_payload(fired.frames[1]) == ["conv.timer", 1]
    edited = _edit(log, fired, (MAILBOX, pack_payload(["conv.timer", 99])))
    with pytest.raises(ReplayDivergence) as err:
        Replay(edited, "n1/agent", reg).run(sc.conversation("m1"))
    assert err.value.index is not None and err.value.index > fired.n
    assert any("expected 'conv.host.list'" in d for d in err.value.diff), err.value.diff


def test_the_wakeup_due_time_comes_from_the_recorded_clock() -> None:
    """The conversation's clock is served from the log: an edited reading is the due time the schedule_wakeup
    tool then reports to the model."""
    import struct

    from transport.replay import ReplayDivergence

    reg = registry()
    log = read_log(HERE / "wakeup_loop.buslog")
    reading = next(
        r for r in log.records if r.at == "effect" and r.actor == "n1/agent" and r.frames[0] == b"time"
    )
    edited = _edit(log, reading, (b"time", struct.pack(">d", 1_000_000.0)))
    with pytest.raises(ReplayDivergence) as err:
        Replay(edited, "n1/agent", reg).run(sc.conversation("m1"))
    assert any("1000000.200" in d for d in err.value.diff), err.value.diff


def test_a_different_verdict_reason_diverges_in_the_goal_loop() -> None:
    """GL-10 through a replay: the judge's reason is the next turn's feedback, so an edited verdict (the
    judge run's goal_verdict call as the conversation took it) changes the prompt of the loop's next turn."""
    from transport.replay import ReplayDivergence

    reg = registry()
    log = read_log(HERE / "goal_loop.buslog")
    target = next(
        r
        for r in log.records
        if r.at == "deliver" and r.actor == "n1/agent" and b"the file is empty" in r.frames[1]
    )
    edited = _edited_bytes(log, target, b"the file is empty", b"the file is EMPTY")
    with pytest.raises(ReplayDivergence) as err:
        Replay(edited, "n1/agent", reg).run(sc.conversation("m1", judge_timeout=sc.JUDGE_TIMEOUT))
    assert err.value.index is not None and err.value.index > target.n
    assert any("EMPTY" in d for d in err.value.diff), err.value.diff


def test_a_rejection_instead_of_the_approval_diverges_in_the_gate_and_the_conversation() -> None:
    """PG-03 through a replay: the gate actor relays the person's decision, and the conversation answers the
    waiting exit_plan_mode call with it; a recorded approval edited into a rejection shows in both."""
    from actors.conversation.people import GateDecide
    from transport.replay import ReplayDivergence

    reg = registry()
    log = read_log(HERE / "approved_plan.buslog")
    for actor, factory, what in [
        ("n1/agent.plan_gate", sc.gate(), "body.approved: expected True, got False"),
        ("n1/agent", sc.conversation("m1", plan_mode=True), '"approved": false'),
    ]:
        target = _first(log, "deliver", actor, GateDecide.TAG)
        decision = reg.decode(GateDecide.TAG, target.frames[1])
        assert decision.approved is True
        rejected = dataclasses.replace(decision, approved=False, reason="no")
        edited = _edit(log, target, (target.frames[0], reg.encode(rejected)))
        with pytest.raises(ReplayDivergence) as err:
            Replay(edited, actor, reg).run(factory)
        assert err.value.index is not None and err.value.index > target.n
        assert any(what in d for d in err.value.diff), (actor, err.value.diff)


def test_the_job_end_is_served_from_the_log() -> None:
    """The job runner's replay runs no process: the job's end is its recorded mailbox message, so an edited
    output is what the runner then tells the job's owner."""
    from transport.capture import pack_payload, unpack_payload
    from transport.replay import MAILBOX, ReplayDivergence

    reg = registry()
    log = read_log(HERE / "background_job.buslog")
    [ended] = _mailbox_records(log, "n1/jobs")
    row = unpack_payload(ended.frames[1])
    assert row[0] == "job.exited" and row[3] == "hello\n"
    edited = _edit(log, ended, (MAILBOX, pack_payload([*row[:3], "EDITED\n", row[4]])))
    with pytest.raises(ReplayDivergence) as err:
        Replay(edited, "n1/jobs", reg).run(JobRunnerActor)
    assert "body.job.output: expected 'hello\\n', got 'EDITED\\n'" in err.value.diff, err.value.diff


def test_a_fallback_tool_call_id_reaches_the_replay_only_from_the_log() -> None:
    """Issue 17 item 3: the local provider makes its tool call ids itself (``call_<uuid4>``); they reach the
    Router only inside its recorded provider events (the Router's mailbox), so the conversation capture
    replays (above) with the recorded id and no seam in the provider is needed."""
    from actors.router.providers.base import ToolCallRequested
    from actors.router.turns import Emitted, decode_local

    reg = registry()
    log = read_log(HERE / "conversation_tool_turn.buslog")
    calls = [
        e.event.call.call_id
        for r in _mailbox_records(log, "n1/router")
        if isinstance(e := decode_local(reg, r.frames[1], {}), Emitted)
        and isinstance(e.event, ToolCallRequested)
    ]
    assert len(calls) == 1 and calls[0].startswith("call_")
    assert any(
        calls[0].encode() in r.frames[1] for r in log.records if r.at == "deliver" and r.actor == "n1/agent"
    )


@pytest.mark.parametrize(
    ("name", "actor", "factory"),
    [
        ("wakeup_loop.buslog", "n1/agent", sc.conversation("m1")),
        ("goal_loop.buslog", "n1/agent", sc.conversation("m1", judge_timeout=sc.JUDGE_TIMEOUT)),
        ("background_job.buslog", "n1/jobs", JobRunnerActor),
    ],
)
def test_a_replay_starts_no_timer_and_runs_no_process(
    name: str, actor: str, factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversation's timers (the wakeup's, the judge's timeout) and the runner's job processes are
    inputs served from the log: a replay starts neither (guards, named so, in place of threading.Timer and
    run_bounded record any call)."""
    import actors.conversation.jobs as jobs
    import actors.conversation.timers as timers

    started: list[str] = []

    def guard_timer(*args: Any, **kwargs: Any) -> Any:
        started.append("timer")
        raise AssertionError("a replay started a timer")

    def guard_process(*args: Any, **kwargs: Any) -> Any:
        started.append("process")
        raise AssertionError("a replay ran a process")

    monkeypatch.setattr(timers.threading, "Timer", guard_timer)
    monkeypatch.setattr(jobs, "run_bounded", guard_process)
    log = read_log(HERE / name)
    Replay(log, actor, registry()).run(factory)
    assert started == []
