"""People in the loop at the terminal (issue 13), end to end: ``kbus chat`` in a pseudo-terminal shows a
proposed plan and asks approve / reject, enforces ``--plan``, prompts for an ``--ask`` tool and prints todo
updates as a checklist; ``kbus run`` without a terminal denies an ``ask`` with a reason. The scripted
provider says what to call (a ``--config`` catalog); every process is ended by its PID in a finaliser."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

KBUS = [sys.executable, "-P", "-m", "actors.cli"]
Start = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def kbus_process() -> Iterator[Start]:
    """Start ``kbus ARGS...`` in its own session; each one still running at the end is ended by its PID
    (as in test_agent_cli.py)."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, **popen: object) -> subprocess.Popen[str]:
        options: dict[str, object] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
        proc = subprocess.Popen([*KBUS, *args], text=True, start_new_session=True, **options)  # type: ignore[call-overload]
        started.append(proc)
        return proc  # type: ignore[no-any-return]

    yield start
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


class Pty:
    """The controlling side of a pseudo-terminal (as in test_agent_cli.py)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.seen = ""
        self.mark = 0

    def expect(self, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.seen[self.mark :]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {text!r} within {timeout}s; the terminal shows:\n{self.seen}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                raise AssertionError(f"the terminal closed before {text!r}:\n{self.seen}")
            self.seen += chunk.decode("utf-8", errors="replace")
        at = self.seen.index(text, self.mark)
        before, self.mark = self.seen[self.mark : at], at + len(text)
        return before

    def send(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())


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
