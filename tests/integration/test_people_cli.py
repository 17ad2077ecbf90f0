"""People in the loop at the terminal (issue 13), end to end: ``kbus chat`` in a pseudo-terminal shows a
proposed plan and asks approve / reject, enforces ``--plan``, prompts for an ``--ask`` tool and prints todo
updates as a checklist; ``kbus run`` without a terminal denies an ``ask`` with a reason. The scripted
provider says what to call (a ``--config`` catalog); every process is ended by its PID in a finaliser."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from peers.cli_kit import Pty, Start, finish

pytestmark = pytest.mark.integration

CHAT = """
[providers.scripted]
kind = "scripted"
scripts = [
  [{ call = { name = "exit_plan_mode", arguments = { plan = "1. write notes.txt" } }, id = "p1" },
   { text = "Waiting for a better plan." }],
  [{ call = { name = "write_file", arguments = { path = "notes.txt", content = "hi" } }, id = "w1" },
   { text = "Could not write." }],
  [{ call = { name = "todo_write", arguments = { todos = [
       { content = "read", status = "completed", active_form = "reading" },
       { content = "write", status = "in_progress", active_form = "writing" }] } }, id = "t1" },
   { call = { name = "calculate", arguments = { expression = "2 + 2" } }, id = "c1" },
   { text = "Listed and calculated." }],
]
"""

RUN = """
[providers.scripted]
kind = "scripted"
scripts = [
  [{ call = { name = "calculate", arguments = { expression = "6 * 7" } }, id = "c1" },
   { text = "No answer." }],
]
"""


@pytest.fixture
def pty_chat(kbus_process: Start, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Pty]]:
    config = tmp_path / "scripted.toml"
    config.write_text(CHAT)
    args = ["--config", str(config), "--model", "scripted", "--data-dir", str(tmp_path / "data")]
    controller, terminal = os.openpty()
    try:
        proc = kbus_process(
            "chat", *args, "--workdir", str(tmp_path), "--edit", "--plan", "--ask", "calculate",
            stdin=terminal, stdout=terminal, stderr=terminal,
        )  # fmt: skip
    finally:
        os.close(terminal)
    try:
        yield proc, Pty(controller)
    finally:
        os.close(controller)


def test_kbus_chat_plans_asks_and_todos_in_the_terminal(
    pty_chat: tuple[subprocess.Popen[str], Pty], tmp_path: Path
) -> None:
    """A proposed plan is shown and rejected with a reason (plan mode stays on, so write_file is then
    denied and the file never written); todo_write prints a checklist; ``--ask calculate`` prompts and the
    person's allow runs it."""
    proc, pty = pty_chat
    pty.expect("you> ")
    pty.send("make a plan")
    assert "1. write notes.txt" in pty.expect("approve / reject")
    pty.send("reject too big")
    assert "[plan rejected] too big" in pty.expect("[done]")
    pty.expect("you> ")
    pty.send("write it anyway")
    turn = pty.expect("[done]")
    assert "plan mode is on: write_file" in turn
    assert not (tmp_path / "notes.txt").exists()
    pty.expect("you> ")
    pty.send("list and calculate")
    listed = pty.expect("allow calculate?")
    assert "[todos v1]" in listed and "[x] read" in listed and "[~] writing" in listed
    pty.send("allow")
    assert "2 + 2 = 4" in pty.expect("[done]")
    pty.expect("you> ")
    pty.send("/todos")
    assert "[~] writing" in pty.expect("you> ")
    pty.send("/quit")
    assert proc.wait(timeout=30) == 0, pty.seen
    assert "Traceback" not in pty.seen


def test_kbus_run_without_a_terminal_denies_an_ask_with_a_reason(kbus_process: Start, tmp_path: Path) -> None:
    config = tmp_path / "scripted.toml"
    config.write_text(RUN)
    proc = kbus_process(
        "run", "what is 6 * 7?", "--config", str(config), "--model", "scripted",
        "--data-dir", str(tmp_path / "data"), "--ask", "calculate", stdin=subprocess.DEVNULL,
    )  # fmt: skip
    code, out, err = finish(proc)
    assert code == 0, out + err
    # the tool lines go to stderr, with every status line (the answer alone on stdout)
    assert "[tool error] calculate: Permission denied: no one could be asked: kbus run has no terminal" in err
    assert "6 * 7 = 42" not in out
