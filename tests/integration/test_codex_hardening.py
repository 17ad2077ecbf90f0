"""Issue 18 item 9 and what the fuzzer found in the Codex adapter, on the real codex binary where it runs.

- Tool names codex would refuse are refused at ``validate_config`` (AD-06), before anything is spawned.
- A peer holding no handle cannot release the child (AD-17: the *last handle's* release reaps it).
- The Router's codex provider retires a child after ``recycle_after_turns`` turns, between turns, no turn
  lost (each turn is a codex thread the app-server never frees).
- A ``CODEX_HOME`` folder left by a SIGKILLed owner is removed when the next child starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from peers.codex_support import PEERS, codex_children, start_model_server, weather_config
from peers.turn_io import RecordingTurnIO

from actors.app.wiring import registry
from actors.codex import homes
from actors.codex.binary import find_codex
from actors.codex.facade import Adapter
from actors.codex.messages import Release
from actors.codex.types import AdapterError, DynamicTool, ErrorKind, validate_config
from actors.router.actor import CALL_KTOOL_PARAMETERS
from actors.router.providers.base import ChatMessage, ToolSpec, TurnRequest
from actors.router.providers.codex import CodexProvider
from actors.types import CALL_KTOOL, AgentProvider, ResolvedAgentModel
from transport import Peer

T = 30.0  # every wait is bounded


# ------------------------------------------------------------------------------------------ tool names
@pytest.mark.parametrize("name", ["fs.read", "get weather", "a/b", "é", "x:y"])
def test_ad06_a_tool_name_codex_refuses_is_refused_at_validate_config(tmp_path: Path, name: str) -> None:
    """AD-06: UNAVAILABLE naming the field; codex refused such a thread, then failed every turn (SERVER)."""
    tool = DynamicTool(name=name, description="d", input_schema={"type": "object"})
    config = weather_config(tmp_path, executable="codex")
    with pytest.raises(AdapterError) as err:
        validate_config(dataclasses.replace(config, tools=(tool,)))
    assert err.value.kind is ErrorKind.UNAVAILABLE
    assert "tools[0].name" in err.value.message


@pytest.mark.parametrize("name", ["get_weather", "call_ktool", "a-b_9", "X"])
def test_tool_names_of_letters_digits_underscore_and_dash_pass(tmp_path: Path, name: str) -> None:
    tool = DynamicTool(name=name, description="d", input_schema={"type": "object"})
    config = weather_config(tmp_path, executable="codex")
    validate_config(dataclasses.replace(config, tools=(tool,)))


# ------------------------------------------------------------------------------------- handle release
@pytest.mark.integration
def test_ad17_a_peer_holding_no_handle_cannot_release_the_child(
    spawn_peer: Callable[..., Any], make_node: Any, tmp_path: Path, ipc_dir: Path
) -> None:
    """AD-17: the child is reaped on the last *handle's* release. A bare ``codex.release`` from a peer (what
    the fuzzer sent) used to count as one and closed the adapter under its opener."""
    server = start_model_server(spawn_peer, tmp_path, [{"text": ["still here"]}])
    (tmp_path / "ws").mkdir()
    peer = spawn_peer(
        "--name", "cx", "--bind", f"ipc://{ipc_dir}/cx.sock", "--codex", str(find_codex()),
        "--workdir", str(tmp_path / "ws"), "--base-url", server.base_url,
        script=PEERS / "codex_peer.py",
    )  # fmt: skip
    node = make_node("client", registry=registry(), peers=[Peer("cx", peer.endpoint)])
    (child,) = peer.info["child"]
    for forged in (Release(), Release(handle="0" * 32), Release(handle="")):
        with pytest.raises(AdapterError) as err:
            node.request(peer.info["address"], forged, timeout=T)
        assert err.value.kind is ErrorKind.PROTOCOL
    assert Path(f"/proc/{child}").exists()
    adapter = Adapter.attach(node, peer.info["address"], timeout=T)
    try:
        turn = adapter.start_turn("k", "hello", timeout=T)
        events = [turn.next_event(timeout=T) for _ in range(2)]
        assert [type(e).__name__ for e in events] == ["TextDelta", "Done"]
    finally:
        adapter.close()  # its own handle: released, and the peer's handle keeps the child
    assert Path(f"/proc/{child}").exists()


# ------------------------------------------------------------------------------------ recycling children
def ktool_request() -> TurnRequest:
    model = ResolvedAgentModel(
        requested="codex-fake",
        model="codex-fake",
        provider=AgentProvider.CODEX,
        provider_model="fake-model",
        context_window_tokens=100_000,
        max_input_tokens=100_000,
    )
    return TurnRequest(
        model=model,
        messages=(ChatMessage("user", "Go"),),
        tool=ToolSpec(CALL_KTOOL, "Run an application tool by name.", CALL_KTOOL_PARAMETERS),
    )


@pytest.mark.integration
def test_the_codex_provider_retires_a_child_after_recycle_after_turns(
    spawn_peer: Callable[..., Any], tmp_path: Path
) -> None:
    """Two turns per child: turns 1-2 on one child, 3-4 on a second, 5 on a third; each retired child is
    reaped when its last turn ends, so at most one child is alive between turns."""
    server = start_model_server(spawn_peer, tmp_path, [{"text": ["ok"]}])
    provider = CodexProvider(
        model_base_url=server.base_url, working_directory=str(tmp_path), recycle_after_turns=2
    )
    before = set(codex_children())
    seen: list[set[int]] = []
    try:
        for _ in range(5):
            assert provider.run_turn(ktool_request(), RecordingTurnIO()).answer == "ok"
            seen.append(set(codex_children()) - before)
    finally:
        provider.close()
    assert all(len(alive) <= 1 for alive in seen), seen
    assert len(seen[0]) == 1  # turn 1 opened a child; it serves turn 2 and is then retired
    assert seen[1] == set() and seen[3] == set()  # reaped once its second turn ended
    assert seen[2] and seen[2].isdisjoint(seen[0]) and seen[4].isdisjoint(seen[2] | seen[0])
    assert len(server.requests()) == 5


@pytest.mark.integration
def test_no_turn_is_lost_when_its_child_is_retired_while_it_runs(
    spawn_peer: Callable[..., Any], tmp_path: Path
) -> None:
    """``recycle_after_turns=1``: every child is retired as its turn starts. Four turns at once all end
    with their answer; the retired children are reaped after their turns, not during them."""
    server = start_model_server(spawn_peer, tmp_path, [{"text": ["ok"], "delay": 0.2}])
    provider = CodexProvider(
        model_base_url=server.base_url, working_directory=str(tmp_path), recycle_after_turns=1
    )
    before = set(codex_children())
    answers: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            answers.append(provider.run_turn(ktool_request(), RecordingTurnIO()).answer)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(t.is_alive() for t in threads)
    finally:
        provider.close()
    assert errors == [] and answers == ["ok"] * 4
    assert set(codex_children()) - before == set()


# ------------------------------------------------------------------------------------------ CODEX_HOME
def dead_owner_home(root: Path) -> Path:
    """A folder as a SIGKILLed owner leaves it: its OWNER names a real process that is gone now."""
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        started = homes.start_time(proc.pid)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=T)
        assert proc.stdin is not None
        proc.stdin.close()
    home = Path(tempfile.mkdtemp(prefix=f"{homes.PREFIX}{proc.pid}-", dir=root))
    (home / homes.OWNER).write_text(json.dumps({"pid": proc.pid, "start": started}))
    (home / "sessions").mkdir()
    return home


def test_a_home_of_a_dead_owner_is_removed_and_every_other_one_is_kept(tmp_path: Path) -> None:
    dead = dead_owner_home(tmp_path)
    mine = Path(homes.make_home(str(tmp_path)))  # this process: alive
    reused = Path(tempfile.mkdtemp(prefix=f"{homes.PREFIX}{os.getpid()}-", dir=tmp_path))
    (reused / homes.OWNER).write_text(json.dumps({"pid": os.getpid(), "start": "1"}))  # a reused pid
    unowned = Path(tempfile.mkdtemp(prefix=homes.PREFIX, dir=tmp_path))  # no OWNER: being made, or foreign
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / homes.OWNER).write_text((dead / homes.OWNER).read_text())
    (tmp_path / f"{homes.PREFIX}link").symlink_to(target)  # a symlink is never followed
    other = tmp_path / "not-kbus"
    other.mkdir()
    removed = homes.remove_stale_homes(str(tmp_path))
    assert sorted(removed) == sorted([str(dead), str(reused)])
    assert not dead.exists() and not reused.exists()
    assert mine.exists() and unowned.exists() and target.exists() and other.exists()


@pytest.mark.integration
def test_opening_an_adapter_removes_the_home_a_killed_owner_left(
    spawn_peer: Callable[..., Any], tmp_path: Path
) -> None:
    """The first child a process starts sweeps the temporary folder (in a child process here, so the
    once-per-process sweep is this test's own)."""
    stale = dead_owner_home(Path(tempfile.gettempdir()))
    try:
        server = start_model_server(spawn_peer, tmp_path, [{"text": ["ok"]}])
        script = (
            "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
            "from peers.codex_support import weather_config;"
            "from actors.codex.facade import Adapter; from actors.codex.child import LaunchOptions;"
            "a = Adapter.open(weather_config(Path(sys.argv[2])),"
            " launch=LaunchOptions(model_base_url=sys.argv[3]), timeout=30); a.close()"
        )
        done = subprocess.run(
            [sys.executable, "-P", "-c", script, str(PEERS.parent), str(tmp_path), server.base_url],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert not stale.exists()
    finally:
        if stale.exists():
            import shutil

            shutil.rmtree(stale)
