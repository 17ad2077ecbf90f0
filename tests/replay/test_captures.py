"""Every committed capture under tests/replay/ replays with zero divergence (DESIGN.md §6).

A log is recorded from real processes by scripts/record-replays; each names the actor it replays and the
actor class that must reproduce it. A change to the wire or to an actor's behaviour shows here as the first
divergent record with a field diff; re-record only when the change is intended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.codex.actor import CodexAdapterActor
from actors.echo import EchoActor
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


# log file -> (actor address, or the kind of the request that starts it; actor class)
CAPTURES: dict[str, tuple[str, Any]] = {
    "echo_exchange.buslog": ("n1/echo", EchoActor),
    # The session loop's address is made per run: find it as the receiver of the run request.
    "session_tool_round.buslog": ("kind:rs.run", SessionLoopActor),
    "session_restart_fresh.buslog": ("kind:rs.run", SessionLoopActor),
    "session_round_limit.buslog": ("kind:rs.run", SessionLoopActor),
    "subagent_run.buslog": ("kind:sa.run", SubagentRunActor),
    "codex_tool_turn.buslog": ("cx/codex", CodexReplay),
}


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


@pytest.mark.parametrize("name", sorted(CAPTURES))
def test_capture_replays_with_zero_divergence(name: str) -> None:
    path = HERE / name
    assert verify(path).ok, verify(path).problems
    spec, actor_class = CAPTURES[name]
    log = read_log(path)
    address = actor_of(log, spec)
    result = Replay(log, address, registry()).run(actor_class)
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
