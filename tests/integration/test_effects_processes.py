"""Each tool host in its own process, SIGKILLed by PID while a tool runs, restarted on the same effect store:
the same idempotency key again answers "outcome unknown", and the tool's own append-only file shows it ran
exactly once (the conversation's ToolHostActor, run_session's HostActor, the subagent's RunHostActor)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import PEERS, PeerProcess

from actors.app.wiring import registry
from actors.conversation import ToolExecution
from actors.conversation.messages import ExecuteTool
from actors.effects import idempotency_key
from actors.runs.projection import ContextBudget, ToolOutcome
from actors.runs.session import HostExecuteTool, SessionToolOutcome
from actors.runs.subagent import HostExecuteTool as SubagentExecuteTool
from actors.types import ToolCall
from transport import Node, Peer
from transport.errors import Unavailable

pytestmark = pytest.mark.integration

OP = uuid.UUID("00000000-0000-4000-8000-00000000e55e")
WAIT = 30.0


@dataclass(frozen=True)
class HostProcess:
    """How to start one kind of host peer and what to ask it."""

    name: str
    script: str
    address: str
    app: tuple[str, ...]  # the peer's own arguments
    hold: tuple[str, ...]  # the arguments that make its tool block forever
    entered: str  # the line the peer prints once the tool has appended its line
    message: Callable[[str], Any]
    outcome: type[Any]


def _budget() -> ContextBudget:
    return ContextBudget(estimated=10, maximum=1000, reserve=5, exact=False, base=5)


HOSTS = [
    HostProcess(
        "conversation",
        "tool_host_peer.py",
        "app/tools",
        (),
        ("--hold",),
        "TOOL_ENTERED k1",
        lambda key: ExecuteTool(name="append", arguments={"key": "k1"}, idempotency_key=key),
        ToolExecution,
    ),
    HostProcess(
        "session",
        "host_peer.py",
        "app/host",
        ("--app", "two-tools"),
        ("--hang",),
        "EXECUTE slow",
        lambda key: HostExecuteTool(
            call_id="c1", call=ToolCall(name="slow"), operation_id=OP, idempotency_key=key
        ),
        SessionToolOutcome,
    ),
    HostProcess(
        "subagent",
        "subagent_host_peer.py",
        "app/host",
        (),
        ("--hold",),
        "TOOL_ENTERED k1",
        lambda key: SubagentExecuteTool(
            call=ToolCall(name="hold", arguments={"key": "k1"}),
            operation_id=OP,
            budget=_budget(),
            idempotency_key=key,
        ),
        ToolOutcome,
    ),
]


@pytest.mark.parametrize("host", HOSTS, ids=lambda h: h.name)
def test_a_host_killed_mid_tool_answers_unknown_after_restart_and_never_reruns(
    ipc_dir: Path,
    spawn_peer: Callable[..., PeerProcess],
    make_node: Callable[..., Node],
    host: HostProcess,
) -> None:
    """SIGKILL while the tool runs (synchronised on the line the tool printed after appending to its file):
    the caller hears Unavailable; a new host process on the same store answers the same key with
    ``unknown=True`` and runs nothing, so the file has exactly one line."""
    log = ipc_dir / "effects.log"
    args = (
        "--name",
        "app",
        "--bind",
        f"ipc://{ipc_dir}/app.sock",
        "--effects",
        str(ipc_dir / "effects.sqlite3"),
        "--effect-log",
        str(log),
        *host.app,
    )
    script = PEERS / host.script
    peer = spawn_peer(*args, *host.hold, script=script)
    client = make_node("client", registry=registry(), peers=[Peer("app", f"ipc://{ipc_dir}/app.sock")])
    client.connect(Peer("app", f"ipc://{ipc_dir}/app.sock"), wait=20)
    key = idempotency_key(OP, 1, "c1")
    running = client.request_future(host.address, host.message(key), timeout=WAIT)
    assert peer.expect_line(host.entered.split()[0], timeout=WAIT) == host.entered
    peer.kill()  # SIGKILL by PID, mid-tool
    with pytest.raises(Unavailable):
        running.result(WAIT)

    spawn_peer(*args, script=script)  # the same store, the tool no longer blocks
    client.connect(Peer("app", f"ipc://{ipc_dir}/app.sock"), wait=20)
    for _ in range(2):
        answer = client.request(host.address, host.message(key), timeout=WAIT)
        assert isinstance(answer, host.outcome)
        assert (answer.ok, answer.unknown) == (False, True)
        assert answer.text.startswith("outcome unknown:")
    assert len(log.read_text().splitlines()) == 1

    # A new key runs on the restarted host: the store was kept, not wedged.
    fresh = client.request(host.address, host.message(idempotency_key(OP, 1, "c2")), timeout=WAIT)
    assert isinstance(fresh, host.outcome) and not fresh.unknown
    assert len(log.read_text().splitlines()) == 2
