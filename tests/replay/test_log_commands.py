"""``kbus log replay`` / ``kbus log diff`` and capturing a run with one switch (``--capture DIR``,
``KBUS_CAPTURE=DIR``), through the real ``kbus`` command in its own process (issue 17)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
from peers.cli_kit import Start, finish

from actors.app.wiring import registry
from transport.capture import CaptureWriter, read_log, verify
from transport.codec import decode_header

HERE = Path(__file__).parent
CONVERSATION = HERE / "conversation_tool_turn.buslog"


def _copy_editing(src: Path, dst: Path, edit: object) -> None:
    """``src``'s records as a new log ``dst`` (a fresh hash chain), ``edit(record)`` giving the frames."""
    log = read_log(src)
    with CaptureWriter(dst, node=log.header.node, schema=log.header.schema, created=log.header.created) as w:
        for r in log.records:
            w.record(r.at, r.actor, edit(r), r.mono_ns)  # type: ignore[operator]


def _tool_answer_changed(r: object) -> tuple[bytes, ...]:
    reg = registry()
    frames = r.frames  # type: ignore[attr-defined]
    if r.at in ("send", "deliver") and decode_header(frames[0]).kind == "conv.tool_execution":  # type: ignore[attr-defined]
        body = reg.decode("conv.tool_execution", frames[1])
        return (frames[0], reg.encode(dataclasses.replace(body, text="7006653")))
    return tuple(frames)


def test_log_replay_of_a_committed_capture_reports_zero_divergence(kbus_process: Start) -> None:
    code, out, err = finish(kbus_process("log", "replay", str(CONVERSATION), "--actor", "n1/router"))
    assert (code, err) == (0, "")
    assert "n1/router replayed:" in out and "zero divergence" in out


def test_log_replay_of_an_edited_log_names_the_first_divergence(kbus_process: Start, tmp_path: Path) -> None:
    edited = tmp_path / "edited.buslog"
    _copy_editing(CONVERSATION, edited, _tool_answer_changed)
    assert verify(edited).ok  # a well-formed log that tells another story
    factory = "peers.replay_scenarios:CONVERSATION"
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    code, out, _ = finish(
        kbus_process("log", "replay", str(edited), "--actor", "n1/agent", "--class", factory, env=env)
    )
    assert code == 1, out
    assert "first divergence at record" in out and "7006653" in out


def test_log_diff_of_a_log_and_its_edited_copy(kbus_process: Start, tmp_path: Path) -> None:
    same = tmp_path / "same.buslog"
    shutil.copyfile(CONVERSATION, same)
    code, out, _ = finish(kbus_process("log", "diff", str(CONVERSATION), str(same)))
    assert code == 0 and "no divergence" in out
    edited = tmp_path / "edited.buslog"
    _copy_editing(CONVERSATION, edited, _tool_answer_changed)
    answer = next(
        r
        for r in read_log(CONVERSATION).records
        if r.at == "send"
        and r.actor == "n1/agent.host"
        and decode_header(r.frames[0]).kind == "conv.tool_execution"
    )
    code, out, _ = finish(kbus_process("log", "diff", str(CONVERSATION), str(edited)))
    assert code == 1
    assert f"first divergence at record {answer.n} (n1/agent.host): conv.tool_execution differs" in out
    assert "body.text: expected '7006652', got '7006653'" in out


@pytest.mark.parametrize(
    "args",
    [
        ("log", "replay", "missing.buslog", "--actor", "n1/router"),
        ("log", "replay", str(CONVERSATION), "--actor", "n1/nobody"),
        ("log", "replay", str(CONVERSATION), "--actor", "n1/agent"),  # a conversation needs --class
        ("log", "replay", str(CONVERSATION), "--actor", "n1/agent", "--class", "nomodule"),
        ("log", "diff", str(CONVERSATION), "missing.buslog"),
    ],
)
def test_log_command_failures_are_one_line(
    kbus_process: Start, args: tuple[str, ...], tmp_path: Path
) -> None:
    code, out, err = finish(kbus_process(*args, cwd=tmp_path))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("kbus log"), err


@pytest.mark.parametrize("switch", ["--capture", "KBUS_CAPTURE"])
def test_one_switch_captures_a_run_that_replays(kbus_process: Start, tmp_path: Path, switch: str) -> None:
    caps = tmp_path / "caps"
    env = {**os.environ, "KBUS_CAPTURE": str(caps)} if switch == "KBUS_CAPTURE" else dict(os.environ)
    extra = ["--capture", str(caps)] if switch == "--capture" else []
    run = kbus_process(
        "run", "-m", "scripted", "--data-dir", str(tmp_path / "data"), *extra, "hello", cwd=tmp_path, env=env
    )
    code, out, err = finish(run)
    assert code == 0, err
    logs = sorted(caps.glob("*.buslog"))
    assert len(logs) == 1 and verify(logs[0]).ok
    node = read_log(logs[0]).header.node
    code, out, err = finish(kbus_process("log", "replay", str(logs[0]), "--actor", f"{node}/router"))
    assert code == 0 and "zero divergence" in out, out + err
