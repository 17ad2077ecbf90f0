"""``actors.subprocesses.kill_group``: when it returns, no process of the group still runs. SIGKILL is
delivered as each process is next scheduled, not inside ``killpg``, so a look straight after the signal
could find a member alive (2 in 40 here, before the wait); the conversation's job runner promises "no
child left" on close on the strength of it. Real shells and real ``sleep`` children."""

from __future__ import annotations

import subprocess
from pathlib import Path

from actors.subprocesses import kill_group

WAIT = 10.0
TRIES = 40


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed child not yet reaped by its new parent is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_no_member_of_the_group_runs_once_kill_group_returns() -> None:
    for _ in range(TRIES):
        leader = subprocess.Popen(
            ["sh", "-c", "sleep 300 & sleep 300 & sleep 300 & echo $!; wait"],
            stdout=subprocess.PIPE,
            start_new_session=True,
            text=True,
        )
        try:
            assert leader.stdout is not None
            grandchild = int(leader.stdout.readline())
            kill_group(leader.pid)
            assert not running(grandchild)
            assert leader.wait(WAIT) is not None
        finally:
            kill_group(leader.pid)
            leader.wait(WAIT)
            if leader.stdout is not None:
                leader.stdout.close()


def test_a_group_already_gone_returns_at_once() -> None:
    leader = subprocess.Popen(["true"], start_new_session=True)
    leader.wait(WAIT)
    kill_group(leader.pid)  # no such group: nothing to signal, nothing to wait for
