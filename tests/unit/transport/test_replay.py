"""Capture a real multi-message exchange, replay one actor from it (DESIGN.md §6, MB-07)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack
import pytest

from actors.app.echo import EchoActor
from actors.base import DEFER, BusActor, Context
from transport.capture import CaptureLog, CaptureWriter, Record, read_log, verify
from transport.codec import Registry, decode_header
from transport.messages import SYSTEM_MESSAGES, Echo, EchoStream, Hold
from transport.node import Node
from transport.pending import Reply
from transport.replay import Replay, ReplayDivergence

REGISTRY = Registry(SYSTEM_MESSAGES)


class RelayActor(BusActor):
    """Forwards each Echo to the echo actor and answers with the echo's reply, text upper-cased.

    Exercises continuations (a request the actor sends while its own caller waits), streams, timeouts
    and the clock, so the replay has more to reproduce than a plain echo.
    """

    def handle(self, message: Any, ctx: Context) -> Any:
        match message:
            case Echo(text=text, seq=seq):
                stamp = self.node.now(self.address)

                def then(reply: Reply) -> None:
                    if reply.error is not None:
                        ctx.fail(reply.error)
                    else:
                        ctx.reply(Echo(text=reply.message.text.upper(), seq=seq, data={"t": stamp > 0}))

                self.ask(f"{self.node.name}/echo", Echo(text=text, seq=seq), then, timeout=5)
                return DEFER
            case EchoStream(count=count):
                for i in range(count):
                    ctx.partial(Echo(seq=i))
                return Echo(seq=count)
            case Hold():

                def expired(reply: Reply) -> None:
                    ctx.fail(reply.error or RuntimeError("expected an error"))

                self.ask(f"{self.node.name}/echo", Hold(), expired, timeout=0.05)
                return DEFER
        raise TypeError(type(message).__name__)


def capture_exchange(path: Path) -> CaptureLog:
    writer = CaptureWriter(path, node="n1", schema=REGISTRY.schema_hash())
    node = Node("n1", registry=REGISTRY, capture=writer).start()
    try:
        node.spawn(EchoActor, "echo")
        node.spawn(RelayActor, "relay")
        for i in range(5):
            assert node.request("n1/relay", Echo(text=f"hi {i}", seq=i), timeout=5).text == f"HI {i}"
        assert [m.seq for m in node.stream("n1/relay", EchoStream(count=3), timeout=5)] == [0, 1, 2, 3]
        with pytest.raises(Exception, match="deadline"):
            node.request("n1/relay", Hold(), timeout=5)
    finally:
        node.stop()
    return read_log(path)


@pytest.fixture
def captured(tmp_path: Path) -> CaptureLog:
    return capture_exchange(tmp_path / "exchange.buslog")


def test_capture_records_sends_and_deliveries_and_verifies(captured: CaptureLog) -> None:
    kinds = {(r.at, r.actor) for r in captured.records}
    assert ("deliver", "n1/relay") in kinds
    assert ("send", "n1/relay") in kinds
    assert ("clock", "n1/relay") in kinds
    assert verify(captured.path).ok


def test_replay_reproduces_the_capture_with_zero_divergence(captured: CaptureLog) -> None:
    result = Replay(captured, "n1/relay", REGISTRY).run(RelayActor)
    # 5 requests + their 5 echo replies, 1 stream, 1 hold + its expiry.
    assert result.delivered == 13
    assert result.compared == len([r for r in captured.records if r.at == "send" and r.actor == "n1/relay"])


def _rewrite(log: CaptureLog, index: int, frames: tuple[bytes, ...]) -> CaptureLog:
    records = tuple(
        Record(r.n, r.at, r.actor, r.mono_ns, frames if r.n == index else r.frames, r.hash)
        for r in log.records
    )
    return CaptureLog(log.path, log.header, records, None)


def test_a_changed_reply_is_reported_as_the_first_divergence_with_a_field_diff(captured: CaptureLog) -> None:
    # Change what echo answered to the relay's third request: the relay's answer to its caller must differ.
    reply = next(
        r
        for r in captured.records
        if r.at == "deliver"
        and r.actor == "n1/relay"
        and (h := decode_header(r.frames[0])).is_reply
        and h.kind == "echo"
        and REGISTRY.decode("echo", r.frames[1]).text == "hi 2"
    )
    changed = _rewrite(captured, reply.n, (reply.frames[0], REGISTRY.encode(Echo(text="bye", seq=2))))
    with pytest.raises(ReplayDivergence) as err:
        Replay(changed, "n1/relay", REGISTRY).run(RelayActor)
    expected_send = next(
        r for r in captured.records if r.at == "send" and r.actor == "n1/relay" and r.n > reply.n
    )
    assert err.value.index == expected_send.n
    assert err.value.diff == ["body.text: expected 'HI 2', got 'BYE'"]


def test_a_missing_send_is_a_divergence(captured: CaptureLog) -> None:
    extra = next(r for r in captured.records if r.at == "send" and r.actor == "n1/relay")
    # Duplicate a recorded send: the actor will never send it twice.
    records = (*captured.records, Record(10_000, "send", "n1/relay", extra.mono_ns, extra.frames, extra.hash))
    with pytest.raises(ReplayDivergence, match="never sent"):
        Replay(CaptureLog(captured.path, captured.header, records, None), "n1/relay", REGISTRY).run(
            RelayActor
        )


def test_a_truncated_log_reports_its_torn_tail(captured: CaptureLog, tmp_path: Path) -> None:
    path = Path(captured.path)
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size - 7)
    log = read_log(path)
    assert log.torn is not None
    assert log.torn.after_record == captured.records[-2].n
    report = verify(path)
    assert not report.ok
    assert report.torn is not None
    with pytest.raises(ValueError, match="torn tail"):
        Replay(path, "n1/relay", REGISTRY)


def test_clock_reads_are_served_from_the_log(captured: CaptureLog) -> None:
    # Drop the clock records: the replayed actor reads the clock and must be told the log lacks it.
    records = tuple(r for r in captured.records if r.at != "clock")
    with pytest.raises(ReplayDivergence, match="clock"):
        Replay(CaptureLog(captured.path, captured.header, records, None), "n1/relay", REGISTRY).run(
            RelayActor
        )


def test_capture_file_is_msgpack_with_a_header_first(captured: CaptureLog) -> None:
    with open(captured.path, "rb") as f:
        first = msgpack.Unpacker(f, raw=False).unpack()
    assert first["format"] == "kbus-buslog"
    assert first["node"] == "n1"
    assert os.path.getsize(captured.path) > 0
