"""The Codex adapter against ``scripted_codex_child`` for what the real binary cannot do: garbage output,
an exit during the handshake, JSON-RPC errors, chosen stderr bytes (RULES.md AD-04/05/14/15/16/19)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from peers.codex_support import PEERS, codex_children, weather_config

import actors.codex.child as codex_child
from actors.app.wiring import registry
from actors.codex.actor import CodexAdapterActor
from actors.codex.child import LaunchOptions
from actors.codex.facade import Adapter
from actors.codex.messages import AwaitOpen, Release
from actors.codex.types import AdapterError, Done, ErrorEvent, ErrorKind, TextDelta
from transport.errors import Expired

pytestmark = pytest.mark.integration
T = 20.0


def scripted(tmp_path: Path, mode: str) -> tuple[Path, Path]:
    """An executable that runs the scripted child in ``mode``; returns it and the child's frame log."""
    log = tmp_path / f"{mode}.jsonl"
    exe = tmp_path / f"codex-{mode}"
    exe.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" -P "{PEERS / "scripted_codex_child.py"}" {mode} "{log}" "$@"\n'
    )
    exe.chmod(0o700)
    return exe, log


def frames(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.parametrize(
    ("mode", "kind", "text"),
    [
        ("garbage-init", ErrorKind.PROTOCOL, "not JSON"),
        ("exit-handshake", ErrorKind.UNAVAILABLE, "exited"),
        ("init-error", ErrorKind.SERVER, "scripted refusal"),
    ],
)
def test_open_failures_raise_their_kind_and_leave_no_child(
    tmp_path: Path, mode: str, kind: ErrorKind, text: str
) -> None:
    """AD-05: each failure raises its kind and no child survives open."""
    exe, log = scripted(tmp_path, mode)
    with pytest.raises(AdapterError) as err:
        Adapter.open(weather_config(tmp_path, exe), timeout=T)
    assert err.value.kind is kind
    assert text in err.value.message
    if mode == "exit-handshake":
        assert b"E! scripted exit" in err.value.diagnostics
    assert [f["method"] for f in frames(log)][:1] == ["initialize"]
    assert codex_children() == []


def test_nonexistent_executable_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(AdapterError) as err:
        Adapter.open(weather_config(tmp_path, tmp_path / "no-such-codex"), timeout=T)
    assert err.value.kind is ErrorKind.UNAVAILABLE


def test_open_completes_the_handshake_first(tmp_path: Path) -> None:
    """AD-04: initialize (experimentalApi) and initialized are sent before open returns."""
    exe, log = scripted(tmp_path, "ok")
    with Adapter.open(weather_config(tmp_path, exe), timeout=T) as adapter:
        _drain(adapter.start_turn("k", "x", timeout=T))  # stdin is one FIFO: what open wrote comes first
    sent = frames(log)
    assert [f.get("method") for f in sent[:4]] == ["initialize", "initialized", "thread/start", "turn/start"]
    assert sent[0]["params"]["capabilities"] == {"experimentalApi": True}
    thread = sent[2]["params"]
    assert thread["baseInstructions"] == "You are the kbus test model."
    assert [t["name"] for t in thread["dynamicTools"]] == ["get_weather"]
    assert thread["model"] == "fake-model" and thread["cwd"] == str(tmp_path)


def test_garbage_mid_turn_ends_the_turn_with_protocol(tmp_path: Path) -> None:
    """AD-19: a non-JSON line during a turn ends it with Error(PROTOCOL), after the events before it."""
    exe, _ = scripted(tmp_path, "garbage-mid-turn")
    with Adapter.open(weather_config(tmp_path, exe), timeout=T) as adapter:
        turn = adapter.start_turn("k", "go", timeout=T)
        assert turn.next_event(timeout=T) == TextDelta("hi")
        event = turn.next_event(timeout=T)
        assert isinstance(event, ErrorEvent) and event.error.kind is ErrorKind.PROTOCOL
        assert turn.next_event(timeout=T) is None
        assert [type(e) for e in _drain(adapter.start_turn("k", "again", timeout=T))] == [TextDelta, Done]


def test_rejected_turn_start_is_server_and_leaves_the_key_free(tmp_path: Path) -> None:
    """AD-14: a JSON-RPC error to turn/start raises SERVER; the next start on the key is accepted."""
    exe, log = scripted(tmp_path, "turn-start-error")
    with Adapter.open(weather_config(tmp_path, exe), timeout=T) as adapter:
        with pytest.raises(AdapterError) as err:
            adapter.start_turn("k", "one", timeout=T)
        assert err.value.kind is ErrorKind.SERVER
        assert _drain(adapter.start_turn("k", "two", timeout=T)) == [TextDelta("hi"), Done()]
        starts = [f for f in frames(log) if f.get("method") == "turn/start"]
        assert [s["params"]["input"] for s in starts] == [
            [{"type": "text", "text": "one"}],
            [{"type": "text", "text": "two"}],
        ]
        assert starts[0]["params"]["model"] == "fake-model" and "effort" not in starts[0]["params"]


def test_effort_is_sent_when_configured(tmp_path: Path) -> None:
    """AD-13: turn/start carries the effort only when the config sets it."""
    import dataclasses

    exe, log = scripted(tmp_path, "ok")
    config = dataclasses.replace(weather_config(tmp_path, exe), reasoning_effort="low")
    with Adapter.open(config, timeout=T) as adapter:
        _drain(adapter.start_turn("k", "x", timeout=T))
    (start,) = [f for f in frames(log) if f.get("method") == "turn/start"]
    assert start["params"]["effort"] == "low"


def test_diagnostics_is_a_copy_of_the_raw_stderr(tmp_path: Path) -> None:
    """AD-15: the exact bytes, as a copy."""
    exe, _ = scripted(tmp_path, "stderr-bytes")
    with Adapter.open(weather_config(tmp_path, exe), timeout=T) as adapter:
        _drain(adapter.start_turn("k", "x", timeout=T))  # stderr was written before this turn's output
        diagnostics = adapter.diagnostics()
        assert diagnostics.endswith(b"warn\xff\n")
        assert adapter.diagnostics() == diagnostics


def test_child_exit_mid_turn_carries_its_stderr(tmp_path: Path) -> None:
    """AD-16, AD-18: the terminal Error(UNAVAILABLE) carries the child's last stderr."""
    exe, _ = scripted(tmp_path, "exit-mid-turn")
    with Adapter.open(weather_config(tmp_path, exe), timeout=T) as adapter:
        turn = adapter.start_turn("k", "go", timeout=T)
        events = _drain(turn)
        assert events[0] == TextDelta("hi")
        assert isinstance(events[-1], ErrorEvent) and events[-1].error.kind is ErrorKind.UNAVAILABLE
        assert b"E! scripted exit mid-turn" in events[-1].error.diagnostics
        with pytest.raises(AdapterError) as err:
            adapter.start_turn("k", "again", timeout=T)
        assert err.value.kind is ErrorKind.UNAVAILABLE


def test_a_child_that_stops_reading_stdin_cannot_block_the_actor(tmp_path: Path, make_node: Any) -> None:
    """MB-01, AD-18: a turn/start bigger than the pipe buffer to a child that no longer reads its stdin: the
    actor keeps answering, the start fails UNAVAILABLE once the write is stuck, the child is killed and a
    node stop completes."""
    exe, _ = scripted(tmp_path, "deaf")
    node = make_node("deaf", registry=registry())
    launch = LaunchOptions(write_timeout=0.5)
    adapter = Adapter.open(weather_config(tmp_path, exe), bus=node, launch=launch, timeout=T)
    (pid,) = codex_children()
    started = adapter.start_turn_future("k", "x" * (512 * 1024), timeout=T)
    assert adapter.diagnostics(timeout=T) == b""  # answered while the write is pending
    with pytest.raises(AdapterError) as err:
        started.result(T)
    assert err.value.kind is ErrorKind.UNAVAILABLE
    assert "stopped reading its stdin" in err.value.message
    assert adapter.diagnostics(timeout=T) == b""
    with pytest.raises(AdapterError) as again:
        adapter.start_turn("k", "more", timeout=T)
    assert again.value.kind is ErrorKind.UNAVAILABLE
    node.stop()
    assert not Path(f"/proc/{pid}").exists()


def test_node_stop_during_a_close_reaps_the_child_and_its_home(tmp_path: Path, make_node: Any) -> None:
    """AD-17: a child that ignores the EOF keeps a close pending; stopping the node then still kills and
    reaps it and removes its private CODEX_HOME."""
    exe, log = scripted(tmp_path, "ignore-eof")
    node = make_node("late", registry=registry())
    adapter = Adapter.open(weather_config(tmp_path, exe), bus=node, timeout=T)
    (pid,) = codex_children()
    home = Path(Path(f"{log}.home").read_text())
    assert home.name.startswith("kbus-codex-") and home.is_dir()
    with pytest.raises(Expired):
        adapter.close(timeout=0.5)
    node.stop()
    assert not Path(f"/proc/{pid}").exists()
    assert not home.exists()


def test_a_child_that_ignores_the_close_is_killed_after_the_reap_timeout(
    tmp_path: Path, make_node: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AD-17: close ends even when the child ignores the EOF on its stdin: it is killed REAP_TIMEOUT later."""
    monkeypatch.setattr(codex_child, "REAP_TIMEOUT", 0.3)
    exe, log = scripted(tmp_path, "ignore-eof")
    node = make_node("ignore", registry=registry())
    adapter = Adapter.open(weather_config(tmp_path, exe), bus=node, timeout=T)
    (pid,) = codex_children()
    home = Path(Path(f"{log}.home").read_text())
    adapter.close(timeout=T)
    assert not Path(f"/proc/{pid}").exists()
    assert not home.exists()


def test_the_last_terminal_event_after_the_child_exited_reaches_its_caller(tmp_path: Path) -> None:
    """TU-02, AD-17: the handle is closed while the turn runs and the child exits mid-turn; taking the turn's
    terminal event then closes the adapter and the caller still gets that event."""
    exe, _ = scripted(tmp_path, "exit-mid-turn")
    adapter = Adapter.open(weather_config(tmp_path, exe), timeout=T)
    turn = adapter.start_turn("k", "go", timeout=T)
    adapter.close(timeout=T)  # the live turn keeps the child
    assert turn.next_event(timeout=T) == TextDelta("hi")
    event = turn.next_event(timeout=T)
    assert isinstance(event, ErrorEvent) and event.error.kind is ErrorKind.UNAVAILABLE
    assert turn.next_event(timeout=T) is None


def test_the_last_release_during_the_handshake_fails_the_opener_and_reaps_the_child(
    tmp_path: Path, make_node: Any
) -> None:
    """AD-05, AD-17: the opener's handle released while ``initialize`` is unanswered (``mute``): the waiting
    opener gets UNAVAILABLE at once, not a timeout; the release is answered once the child is reaped."""
    exe, log = scripted(tmp_path, "mute")
    node = make_node("mute", registry=registry())
    node.spawn(CodexAdapterActor, "codex", config=weather_config(tmp_path, exe), handle="opener")
    address = f"{node.name}/codex"
    opened = node.request_future(address, AwaitOpen(), timeout=T)
    node.request(address, Release(handle="opener"), timeout=T)
    with pytest.raises(AdapterError) as err:
        opened.result(T)
    assert err.value.kind is ErrorKind.UNAVAILABLE
    assert "closed" in err.value.message
    assert [f.get("method") for f in frames(log)] == ["initialize"]
    assert codex_children() == []


def _drain(turn: Any) -> list[Any]:
    events = []
    while (event := turn.next_event(timeout=T)) is not None:
        events.append(event)
    return events
