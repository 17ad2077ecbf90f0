"""The Router's durability with real processes over ipc, SIGKILLed by PID (issue 11, items 4 and 5).

- A Router process (``kbus node``) killed mid-stream and restarted on the same data dir: exactly one
  receipt per started turn, read with SQL from the ledger file itself.
- The owner of a turn (another process: an inference handle actor, or a plain client thread) killed while
  the Router waits for its tool result: the Router accounts the turn ``interrupted`` within its configured
  bound (small here) and forgets it.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import PEERS, KbusNode, PeerProcess

from actors.app.wiring import registry
from actors.router.actor import RouterActor
from actors.router.client import RouterClient
from actors.router.messages import (
    StartTurn,
    TurnCompleted,
    TurnInterrupted,
    TurnTextDelta,
    TurnToolCall,
)
from actors.router.providers.scripted import ScriptedProvider
from actors.types import ToolResult
from transport import Node, Peer

pytestmark = pytest.mark.integration

# Turn 1 completes; turn 2 is killed mid-stream (it sleeps, for real, in the Router process, after its
# tool result); turn 3 is started and never read. Each script's usage comes before its tool call, so it
# is on the open row by the time the call is reported.
SCRIPTS = """
[providers.scripted]
kind = "scripted"
scripts = [
  [ { text = "first", chunks = 2 }, { usage = { input_tokens = 3, output_tokens = 2, total_tokens = 5 } } ],
  [ { usage = { input_tokens = 11, output_tokens = 4, total_tokens = 15 } },
    { call = { name = "calc", arguments = { expression = "6*7" } }, id = "call-1" },
    { text = "The answer" }, { delay = 120 }, { text = " is 42." } ],
  [ { text = "unread" }, { delay = 120 } ],
]
[models.scripted]
provider = "scripted"
provider_model = "scripted-v1"
context_window = 4096
max_input_tokens = 4000
"""


def start(client: RouterClient, parent: uuid.UUID) -> uuid.UUID:
    spec = StartTurn(
        user_id="u1", parent_operation_id=parent, model="scripted", input="hi", tool_description="t"
    )
    return client.start_turn(spec).operation_id


def read_until(client: RouterClient, op: uuid.UUID, kind: type[Any]) -> Any:
    while True:
        event = client.next_event(op)
        if isinstance(event, kind):
            return event


def ledger_rows(path: Path) -> dict[str, tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT operation_id, status, total_tokens, receipt_id FROM receipts").fetchall()
    finally:
        conn.close()
    by_op = {str(r[0]): tuple(r[1:]) for r in rows}
    assert len(by_op) == len(rows)
    return by_op


def sigkill(node: KbusNode) -> None:
    os.kill(node.proc.pid, signal.SIGKILL)
    node.proc.wait(timeout=20)


def test_a_router_killed_mid_stream_accounts_every_started_turn_once_after_its_restart(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode], make_node: Callable[..., Node]
) -> None:
    config = ipc_dir / "router.toml"
    config.write_text(
        '[node]\nname = "brain"\nbind = ["ipc://brain.sock"]\ndata_dir = "data"\n'
        '[actors.router]\ntype = "router"\n' + SCRIPTS
    )
    ledger = ipc_dir / "data" / "receipts.sqlite3"
    router = kbus_node(config)
    app = make_node("app", registry=registry(), peers=[Peer("brain", f"ipc://{ipc_dir}/brain.sock")])
    client = RouterClient(app, "brain/router", timeout=20)
    parent = uuid.uuid4()
    first = start(client, parent)
    completed = read_until(client, first, TurnCompleted)
    killed = start(client, parent)
    call = read_until(client, killed, TurnToolCall)
    client.respond(killed, call.call_id, ToolResult(success=True, output="42"))
    assert read_until(client, killed, TurnTextDelta).text == "The answer"  # now it sleeps mid-stream
    unread = start(client, parent)
    assert {op: row[0] for op, row in ledger_rows(ledger).items()} == {
        str(first): "completed",
        str(killed): "open",
        str(unread): "open",
    }
    sigkill(router)

    restarted = kbus_node(config)
    try:
        client = RouterClient(app, "brain/router", timeout=20)
        assert client.stats().recovered == 2
        rows = ledger_rows(ledger)
        assert rows == {
            str(first): ("completed", 5, completed.receipt.receipt_id),
            str(killed): ("interrupted", 15, rows[str(killed)][2]),  # the usage streamed before the kill
            str(unread): ("interrupted", None, rows[str(unread)][2]),
        }
        receipt = client.receipt(killed)
        assert (receipt.status, receipt.receipt_id) == ("interrupted", rows[str(killed)][2])
        with pytest.raises(TurnInterrupted) as caught:
            client.next_event(killed)
        assert caught.value.receipt == receipt
        assert {r.operation_id for r in client.receipts_for(parent)} == {first, killed, unread}
    finally:
        restarted.stop()
    assert len(ledger_rows(ledger)) == 3  # a clean stop adds nothing


OWNED = [[{"call": {"name": "slow", "arguments": {}}, "id": "c1"}, {"text": "never"}]]
BOUNDS = {"tick_s": 0.05, "owner_ping_interval_s": 0.1, "owner_lost_after_s": 0.3}


@pytest.mark.parametrize("owner", ["handle", "client"])
def test_an_owner_process_killed_during_a_tool_gets_its_turn_interrupted_within_the_bound(
    owner: str,
    ipc_dir: Path,
    tmp_path: Path,
    make_node: Callable[..., Node],
    spawn_peer: Callable[..., PeerProcess],
) -> None:
    endpoint = f"ipc://{ipc_dir}/brain.sock"
    brain = make_node("brain", registry=registry(), bind=[endpoint])
    brain.spawn(
        RouterActor, "router", data_dir=tmp_path, providers={"scripted": ScriptedProvider(OWNED)}, **BOUNDS
    )
    router = RouterClient(brain, "brain/router", timeout=20)
    peer = spawn_peer(
        "--name", "app", "--router", f"brain={endpoint}", "--owner", owner, script=PEERS / "turn_owner.py"
    )
    op = uuid.UUID(json.loads(peer.expect_line("TOOL_CALL ")[len("TOOL_CALL ") :])["operation_id"])
    reader = router.next_event_future(op, timeout=20)  # a read of the test's own: not the owner's
    assert router.stats().turns == 1
    peer.kill()  # SIGKILL by PID while the Router waits for the tool result
    with pytest.raises(TurnInterrupted) as caught:
        reader.result(timeout=20)  # bounded: far above owner_lost_after_s + 2 * interval + tick
    receipt = caught.value.receipt
    assert (
        receipt is not None
        and receipt.status == "interrupted"
        and "stopped answering" in (receipt.error or "")
    )
    stats = router.stats()
    assert (stats.turns, stats.links) == (0, 0)
    assert router.receipt(op) == receipt
    conn = sqlite3.connect(tmp_path / "receipts.sqlite3")
    try:
        assert conn.execute("SELECT status FROM receipts").fetchall() == [("interrupted",)]
    finally:
        conn.close()
