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

from actors.codex.actor import CodexAdapterActor
from actors.echo import EchoActor
from actors.inference import InferenceHandleActor
from actors.nodes import registry
from actors.session import SessionLoopActor
from actors.subagent import SubagentRunActor
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
    from actors.session import RoundPreparation
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
    from actors.subagent import ToolOutcome
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
