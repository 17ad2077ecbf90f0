"""A kbus_replay recording made under load replays like one made on an idle machine (MB-07).

A live replay (``TapeNode``) runs real actors with a real ticker, so everything that depends on how much
wall time passed differs between the recording and the replay: how often the Router's housekeeping tick
ran, whether it sent a turn's owner a heartbeat, and in which order the tick's clock readings came. These
tests make that difference on purpose, with no sleep: the Router's monotonic clock is advanced by the
test (``SkewedClock``, a tool that "took 11 s") and its ticks are fired by the test (``ManualTicker``), in
the recording or in the replay only, as a loaded machine would.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import actors.router.actor as router_module
from actors.app.replay_plugin import KbusReplay
from actors.app.wiring import registry as default_registry
from actors.conversation import ConversationRuntime, ToolRegistry
from actors.router.actor import RouterActor
from actors.router.providers.scripted import ScriptedProvider
from transport.capture import CaptureWriter, read_log
from transport.codec import decode_header, encode_header
from transport.envelope import Header
from transport.messages import Hello, Ping, Pong, Resolve
from transport.replay import first_divergence

SCRIPT = [{"call": {"name": "shout", "arguments": {"text": "hi"}}, "id": "c1"}, {"text": "HI"}]


class SkewedClock:
    """Stands in for the ``time`` module the Router reads its monotonic clock from: the real clock plus
    ``offset`` seconds, which a test moves forward (a thread that was slowed down) or starts far off (a
    recording made on another machine, whose monotonic clock counts from another boot)."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def time(self) -> float:
        return time.time()


class ManualTicker:
    """A ``Ticker`` whose ticks the test fires: ``tick()`` tells every Router that took it a Tick."""

    def __init__(self) -> None:
        self._fns: list[Callable[[], None]] = []

    def __call__(self, interval_s: float, fn: Callable[[], None]) -> Callable[[], None]:
        self._fns.append(fn)
        return lambda: self._fns.remove(fn) if fn in self._fns else None

    def tick(self, times: int = 1) -> None:
        for _ in range(times):
            for fn in list(self._fns):
                fn()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SkewedClock:
    skewed = SkewedClock()
    monkeypatch.setattr(router_module, "time", skewed)
    return skewed


def run_agent(
    session: KbusReplay, ticker: ManualTicker, during_tool: Callable[[], None], answer: str = "HI"
) -> None:
    """The agent of test_plugin.py's scripted example: one tool call, then the answer. ``during_tool``
    runs inside the tool, while the Router's turn waits on its owner for the tool's result."""

    def shout(text: str) -> str:
        """Upper-case a text."""
        during_tool()
        return text.upper() if answer == "HI" else answer

    tools = ToolRegistry()
    tools.register(shout)
    with session.node("n1") as node:
        node.spawn(RouterActor, "router", providers={"scripted": ScriptedProvider([SCRIPT])}, ticker=ticker)
        agent = ConversationRuntime.builder().node(node).llm("scripted").tools(tools).name("agent").build()
        try:
            assert agent.run("shout hi", timeout=30).final_text == "HI"  # the script's answer
        finally:
            agent.stop()


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "replays" / "test_agent" / "test_it"


def record(folder: Path, scratch: Path, ticker: ManualTicker, during_tool: Callable[[], None]) -> Path:
    session = KbusReplay(folder, "once", scratch)
    assert session.recording("n1")
    run_agent(session, ticker, during_tool)
    session.finish()
    return folder / "n1.buslog"


def replay(
    folder: Path, scratch: Path, ticker: ManualTicker, during_tool: Callable[[], None], **kw: Any
) -> None:
    session = KbusReplay(folder, "none", scratch)
    assert not session.recording("n1")
    run_agent(session, ticker, during_tool, **kw)
    session.finish()  # compares the replay's capture with the recording: fails the test on a divergence


def sends(log_path: Path, kind: str) -> list[str]:
    return [
        r.actor
        for r in read_log(log_path).records
        if r.at == "send" and decode_header(r.frames[0]).kind == kind
    ]


def test_mb07_a_heartbeat_sent_while_recording_under_load_is_not_a_divergence(
    tmp_path: Path, folder: Path, clock: SkewedClock
) -> None:
    """MB-07: the issue's flake. While recording, the tool "takes 11 s" (the machine is loaded) and the
    Router's tick finds its turn idle on its owner for longer than owner_ping_interval_s, so it pings the
    turn's owner (the conversation's inference handle), which pongs. The replay is quick and sends
    neither: a transport-level heartbeat (answered by the mailbox, never by the actor's handler) is not the
    actor's behaviour, and the replay passes."""
    ticker = ManualTicker()

    def slow_tool() -> None:
        clock.offset += 11.0  # the tool ran for 11 s of the Router's clock
        ticker.tick()  # the live ticker fired meanwhile

    cassette = record(folder, tmp_path / "rec", ticker, slow_tool)
    assert sends(cassette, "sys.ping") == ["n1/router"]  # the reproduction: the recording holds a heartbeat
    assert sends(cassette, "sys.pong") == ["n1/agent.loop.0.inference.0"]  # the turn's owner answers

    replay(folder, tmp_path / "rep", ManualTicker(), lambda: None)


def test_mb07_a_heartbeat_in_the_recording_does_not_hide_a_changed_tool_result(
    tmp_path: Path, folder: Path, clock: SkewedClock
) -> None:
    """MB-07, the negative control of the one above: with the heartbeat left out of the comparison, a tool
    that answers something else is still the first divergence, at the tool host's answer."""
    ticker = ManualTicker()

    def slow_tool() -> None:
        clock.offset += 11.0
        ticker.tick()

    record(folder, tmp_path / "rec", ticker, slow_tool)
    with pytest.raises(
        pytest.fail.Exception,
        match=r"(?s)\(n1/agent\.host\): conv\.tool_execution differs.*"
        r"body\.text: expected 'HI', got 'HO'",
    ):
        replay(folder, tmp_path / "rep", ManualTicker(), lambda: None, answer="HO")


def test_mb07_a_replay_slower_than_its_recording_reads_a_clock_of_its_own(
    tmp_path: Path, folder: Path, clock: SkewedClock
) -> None:
    """MB-07: the recording was made on a machine whose monotonic clock is two hours behind this one's (it
    booted later); the replay runs slower than the recording did, so its live ticker fires twenty times
    while the tool runs, where the recording's fired none. Those ticks must not be served the recording's
    clock readings (they belong to other reads, and run out): mixing the two clocks makes a turn look idle
    for two hours and the Router interrupts it. The replay passes."""
    clock.offset = -7200.0
    record(folder, tmp_path / "rec", ManualTicker(), lambda: None)

    clock.offset = 0.0
    ticker = ManualTicker()
    replay(folder, tmp_path / "rep", ticker, lambda: ticker.tick(20))


def write_log(path: Path, sends: list[tuple[str, Any]]) -> Path:
    """A capture of ``sends`` ((sender, message) pairs, each an ask to another node) made with the real
    writer and codec, as a node records them."""
    reg = default_registry()
    with CaptureWriter(path, node="n1", schema=reg.schema_hash()) as writer:
        for i, (src, message) in enumerate(sends):
            header = Header(bytes([i]) * 16, reg.tag_of(message), src, "n2/node", "ask", ts=float(i))
            writer.record("send", src, [encode_header(header), reg.encode(message)])
    return path


def test_mb07_liveness_traffic_is_left_out_of_comparing_two_runs_and_nothing_else(tmp_path: Path) -> None:
    """MB-07: ``first_divergence`` compares two runs without their heartbeats and directory lookups
    (LIVENESS_KINDS: a Router's ``sys.resolve`` heartbeat of a plain client's node, a ``sys.ping``, a
    mailbox's ``sys.pong``), which a slower run sends more of; the message after them is still compared."""
    reg = default_registry()
    hello = Hello(node="n1")
    recorded = write_log(
        tmp_path / "a.buslog",
        [
            ("n1/router", Resolve(actor="client.7.1")),
            ("n1/router", Ping()),
            ("n1/agent", Pong()),
            ("n1/router", hello),
        ],
    )
    quick = write_log(tmp_path / "b.buslog", [("n1/router", hello)])
    assert first_divergence(read_log(recorded), read_log(quick), reg) is None

    changed = write_log(tmp_path / "c.buslog", [("n1/router", Hello(node="n9"))])
    divergence = first_divergence(read_log(recorded), read_log(changed), reg)
    assert divergence is not None and divergence.index == 3 and divergence.actor == "n1/router"
    assert divergence.diff == ("body.node: expected 'n1', got 'n9'",)
