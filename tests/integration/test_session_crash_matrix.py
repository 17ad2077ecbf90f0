"""run_session with the Router, the session loop and the host each in its own process over ipc, and each of
the three SIGKILLed by PID at each of three points: mid-stream, during a tool, just after a tool result.

After the kill, the dead process is started again on the same data (the Router's ledger, the host's effect
store) and the run is repeated with the same operation (so the same idempotency keys), as a caller that
lost its run would do. Checked from the stores themselves: every tool ran at most once (the tools' own
append-only log), every provider turn has exactly one receipt and no intent row is left open (SQL on the
ledger), and every request ended (each wait bounded).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import PEERS, PeerProcess

from actors.app.wiring import registry
from actors.runs.session import SessionRunRequest, run_session_future
from transport import Node, Peer
from transport.errors import BusError

pytestmark = pytest.mark.integration

ROUND = [
    {"text": "thinking"},
    {"call": {"name": "fast", "arguments": {}}, "id": "call-1"},
    {"call": {"name": "slow", "arguments": {}}, "id": "call-2"},
    {"text": "both done"},
]
MID_STREAM = [{"text": "thinking"}, {"hang": True}]
RUN_TIMEOUT = 30.0
# A run whose host is killed mid-stream is waiting on the provider, not on the host: it ends at once if the
# host's answer to the record it was asked last was lost with it (the call fails), else at its deadline (the
# stream hangs). Both are a cut-off run; this deadline keeps the second way well inside the test's bounds.
MID_STREAM_TIMEOUT = 12.0


class Topology:
    def __init__(
        self,
        base: Path,
        spawn_peer: Callable[..., PeerProcess],
        make_node: Callable[..., Node],
        *,
        gate_resume: bool = False,
    ) -> None:
        self.base = base
        self.spawn_peer = spawn_peer
        self.gate = base / "gate.fifo"
        os.mkfifo(self.gate)
        self.log = base / "effects.log"
        self.endpoints = {name: f"ipc://{base}/{name}.sock" for name in ("brain", "app", "loop")}
        self.procs: dict[str, PeerProcess] = {}
        for name in ("brain", "app", "loop"):
            self.start(name, gate_resume=gate_resume)
        self.client = make_node(
            "client", registry=registry(), peers=[Peer(n, e) for n, e in self.endpoints.items()]
        )
        for peer in self.client.peers().values():
            self.client.connect(peer, wait=20)

    def start(self, name: str, *, gate_resume: bool = False) -> None:
        bind = ("--name", name, "--bind", self.endpoints[name])
        if name == "brain":
            args = (*bind, "--role", "router", "--data-dir", str(self.base / "data"))
            self.procs[name] = self.spawn_peer(*args, script=PEERS / "session_peer.py")
        elif name == "app":
            args = (*bind, "--app", "two-tools", "--effects", str(self.base / "effects.sqlite3"))
            args = (*args, "--effect-log", str(self.log), "--gate", str(self.gate))
            if gate_resume:  # its first resume on slow's result waits for the gate again
                args = (*args, "--gate-resume")
            self.procs[name] = self.spawn_peer(*args, script=PEERS / "host_peer.py")
        else:
            peers = [f"--peer={n}={self.endpoints[n]}" for n in ("brain", "app")]
            self.procs[name] = self.spawn_peer(
                *bind, "--role", "loop", *peers, script=PEERS / "session_peer.py"
            )

    def script(self, *scripts: list[dict[str, object]]) -> None:
        router = self.procs["brain"]
        assert router.proc.stdin is not None
        router.proc.stdin.write("ADD " + json.dumps(list(scripts)) + "\n")
        router.proc.stdin.flush()
        router.expect_line("ADDED")

    def restart(self, name: str) -> None:
        """Start ``name`` again; every process that talks to it waits for the new handshake."""
        self.start(name)
        self.client.connect(Peer(name, self.endpoints[name]), wait=20)
        loop = self.procs["loop"]
        if name != "loop" and loop.proc.poll() is None:
            assert loop.proc.stdin is not None
            loop.proc.stdin.write(f"CONNECT {name}={self.endpoints[name]}\n")
            loop.proc.stdin.flush()
            assert loop.expect_line("CONNECTED") == "CONNECTED"

    def open_gate(self) -> None:
        """Let a gated ``slow`` run finish (the host's thread is blocked opening the FIFO for reading)."""

        def write() -> None:
            with self.gate.open("w") as f:
                f.write("go\n")

        threading.Thread(target=write, daemon=True).start()

    def run(self, request: SessionRunRequest, timeout: float = RUN_TIMEOUT) -> object:
        future = run_session_future(
            self.client, "brain/router", request, "app/host", timeout=timeout, loop_at="loop/sessions"
        )
        try:
            return future.result(timeout + 5)
        except BusError as exc:
            return exc


def _ledger(path: Path, parent: uuid.UUID) -> tuple[list[str], int]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        statuses = [
            s
            for (s,) in db.execute(
                "SELECT status FROM receipts WHERE parent_operation_id = ?", (str(parent),)
            )
        ]
        (dupes,) = db.execute(
            "SELECT COUNT(*) FROM (SELECT operation_id FROM receipts"
            " GROUP BY operation_id HAVING COUNT(*) > 1)"
        ).fetchone()
    return statuses, int(dupes)


@pytest.mark.parametrize("point", ["mid_stream", "during_tool", "after_result"])
@pytest.mark.parametrize("victim", ["brain", "app", "loop"])
def test_a_run_killed_anywhere_reruns_with_no_effect_twice_and_one_receipt_per_turn(
    victim: str,
    point: str,
    ipc_dir: Path,
    spawn_peer: Callable[..., PeerProcess],
    make_node: Callable[..., Node],
) -> None:
    # "after_result": the host holds its resume decision on the result at the gate, so the kill lands after
    # the result and before the run can go on (not after the rest of the run, which takes milliseconds).
    top = Topology(ipc_dir, spawn_peer, make_node, gate_resume=point == "after_result")
    app = top.procs["app"]
    top.script(MID_STREAM if point == "mid_stream" else ROUND)
    request = SessionRunRequest(
        user_id="u1", operation_id=uuid.uuid4(), rounds_used=0, round_limit=5, call_timeout=RUN_TIMEOUT
    )
    outcome: list[object] = []
    first = MID_STREAM_TIMEOUT if point == "mid_stream" else RUN_TIMEOUT
    runner = threading.Thread(target=lambda: outcome.append(top.run(request, first)), daemon=True)
    runner.start()
    if point == "mid_stream":
        app.expect_line("CALL record ProviderInput")  # the provider turn streams, then hangs
    elif point == "during_tool":
        assert app.expect_line("EXECUTE") == "EXECUTE fast"
        assert app.expect_line("EXECUTE") == "EXECUTE slow"  # blocked on the gate
    else:
        assert app.expect_line("EXECUTE") == "EXECUTE fast"
        assert app.expect_line("EXECUTE") == "EXECUTE slow"
        top.open_gate()
        app.expect_line("CALL prepare_provider_resume slow done")
    top.procs[victim].kill()  # SIGKILL by PID
    if point != "mid_stream" and victim != "app":
        top.open_gate()  # the tool (during_tool) or the resume (after_result) finishes while the run is gone
    runner.join(RUN_TIMEOUT + 10)
    assert not runner.is_alive(), "the first run never ended"
    assert isinstance(outcome[0], BusError), outcome  # the run was cut off: a typed error, no answer

    top.restart(victim)
    top.script(ROUND)
    top.open_gate()  # a slow run in the rerun (if any: it may answer its stored outcome) may finish
    again = top.run(request)  # the same operation: the same idempotency keys
    # Every rerun completes: a finished tool answers its stored outcome, a cut-off one "outcome unknown".
    assert again == "six times seven is 42", again

    runs = top.log.read_text().split()
    assert sorted(runs) == ["fast", "slow"], runs  # each tool ran exactly once over both runs
    assert top.procs["brain"].proc.poll() is None
    top.procs["brain"].proc.terminate()  # a graceful stop settles what is still open
    top.procs["brain"].proc.wait(20)
    statuses, dupes = _ledger(ipc_dir / "data" / "receipts.sqlite3", request.operation_id)
    assert dupes == 0
    assert "open" not in statuses, statuses
    # The cut-off run's provider turn and the rerun's: one receipt each (the first may have completed at the
    # Router after its run was lost), the rerun's completed.
    assert len(statuses) == 2 and "completed" in statuses, statuses
