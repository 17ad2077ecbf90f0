"""The main job end to end: ``kbus run`` and ``kbus chat`` in their own processes.

One test runs the real embedded model (``kbus run`` with the README's demo prompt); the others use the
scripted provider, told what to say through a ``--config`` catalog, so they are fast and deterministic:
``kbus chat`` driven through a pseudo-terminal, ``--connect`` to a ``kbus node`` process running the Router,
and the bad-input exits. Every process is ended by its PID in a finaliser.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest
from conftest import KbusNode

from actors.agent_cli import DEMO_PROMPT

pytestmark = pytest.mark.integration

KBUS = [sys.executable, "-P", "-m", "actors.cli"]

Start = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def kbus_process() -> Iterator[Start]:
    """Start ``kbus ARGS...`` (own session, pipes unless given); every one still running at the end is
    ended by its PID (SIGTERM, then SIGKILL)."""
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


SCRIPTED = """
[providers.scripted]
kind = "scripted"
scripts = [
  [{ call = { name = "calculate", arguments = { expression = "6 * 7" } }, id = "c1" },
   { text = "The answer is 42.", chunks = 3 }],
  [{ text = "You are welcome." }],
  [{ text = "Sure." }],
  [{ text = "Summary: 6 * 7 is 42." }],
]
"""


def test_kbus_run_on_the_embedded_model_calls_the_calculator_and_answers(
    kbus_process: Start, tmp_path: Path
) -> None:
    """The README's main job: the 135M model calls a built-in tool through the bus and answers."""
    proc = kbus_process("run", DEMO_PROMPT, "--data-dir", str(tmp_path / "data"), "--workdir", str(tmp_path))
    code, out, err = finish(proc, timeout=280)
    assert code == 0, out + err
    assert "Traceback" not in err
    lines = out.splitlines()
    calls = [i for i, line in enumerate(lines) if line.startswith("[tool call] calculate ")]
    assert calls, out
    results = [i for i, line in enumerate(lines) if line.startswith("[tool result] calculate: ")]
    assert results and results[0] > calls[0], out
    assert "= 7006652" in lines[results[0]]  # the tool really ran on the model's arguments
    done = [i for i, line in enumerate(lines) if line.startswith("[done] ")]
    assert len(done) == 1, out
    answer = "\n".join(lines[results[-1] + 1 : done[0]]).strip()
    assert answer, f"no answer after the tool result:\n{out}"
    assert "1 tool call" in lines[done[0]]
    assert re.search(r"receipts: rcpt-[0-9a-f-]+", lines[done[0]]), lines[done[0]]
    assert "loading smollm2" in err  # the progress line (stderr is not a tty here)


class Pty:
    """The controlling side of a pseudo-terminal: what the child printed so far, and keystrokes for it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.seen = ""
        self.mark = 0  # expect() looks only after this offset

    def expect(self, text: str, timeout: float = 30.0) -> str:
        """Wait until ``text`` appears after the mark; move the mark past it; return what came before."""
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
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk:
                raise AssertionError(f"the terminal closed before {text!r}:\n{self.seen}")
            self.seen += chunk.decode("utf-8", errors="replace")
        at = self.seen.index(text, self.mark)
        before, self.mark = self.seen[self.mark : at], at + len(text)
        return before

    def send(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())


def test_kbus_chat_in_a_terminal_turns_model_switch_compact_and_quit(
    kbus_process: Start, tmp_path: Path
) -> None:
    config = tmp_path / "scripted.toml"
    config.write_text(SCRIPTED)
    session = tmp_path / "chat.jsonl"
    args = ["--config", str(config), "--model", "scripted", "--data-dir", str(tmp_path / "data")]
    controller, terminal = os.openpty()
    try:
        proc = kbus_process(
            "chat", *args, "--session", str(session), stdin=terminal, stdout=terminal, stderr=terminal
        )
    finally:
        os.close(terminal)
    pty = Pty(controller)
    try:
        pty.expect("kbus chat: model scripted")
        pty.expect("you> ")
        pty.send("what is 6 * 7?")
        turn = pty.expect("[done]")
        assert "[tool call] calculate" in turn
        assert "[tool result] calculate: 6 * 7 = 42" in turn
        assert "The answer is 42." in turn.split("[tool result]")[1]  # streamed after the result
        assert "receipts: rcpt-" in pty.expect("you> ")

        pty.send("/model nope")
        assert "unknown model 'nope'" in pty.expect("you> ")  # reported; the chat goes on
        pty.send("thanks")
        assert "You are welcome." in pty.expect("[done]")
        pty.expect("you> ")
        pty.send("one more")
        assert "Sure." in pty.expect("[done]")
        pty.expect("you> ")
        pty.send("/compact")  # the first turn (a tool-call pair) is summarised, the last four kept
        assert re.search(r"compacted: 8 messages -> 5", pty.expect("you> ")), pty.seen
        pty.send("/quit")
        assert proc.wait(timeout=30) == 0, pty.seen
    finally:
        os.close(controller)
    assert "Traceback" not in pty.seen

    # The session file resumes: a later run starts from the compacted transcript.
    again = kbus_process("run", "and now?", *args, "--session", str(session))
    code, out, err = finish(again)
    assert code == 0, out + err
    assert re.search(r"resumed \d+ messages from", err), err


WAIT_TOOL = '''
def wait_for_release() -> str:
    """Wait until the test says so."""
    with open({fifo!r}) as gate:
        return gate.readline().strip() or "released"
'''


def test_ctrl_c_interrupts_the_turn_and_a_second_one_quits_without_a_traceback(
    kbus_process: Start, tmp_path: Path
) -> None:
    """IT-06: the first Ctrl-C stops a model that is still generating at once (the turn ends cancelled and
    the prompt comes back); during a tool that is still running (IT-02: it runs to completion) a second
    Ctrl-C quits with 130 and no traceback, without waiting for that tool (it is never released)."""
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    gate = os.open(fifo, os.O_RDWR)  # holds both ends: the tool's open never blocks, its read does
    tool = tmp_path / "waiting.py"
    tool.write_text(WAIT_TOOL.format(fifo=str(fifo)))
    config = tmp_path / "hang.toml"
    config.write_text(
        '[providers.scripted]\nkind = "scripted"\nscripts = [[{ text = "thinking" }, { hang = true }],'
        ' [{ call = { name = "wait_for_release", arguments = {} }, id = "w1" }, { text = "unreached" }]]\n'
    )
    args = ["--config", str(config), "--model", "scripted", "--data-dir", str(tmp_path / "data")]
    args += ["--tools", f"{tool}:wait_for_release"]
    controller, terminal = os.openpty()
    try:
        proc = kbus_process("chat", *args, stdin=terminal, stdout=terminal, stderr=terminal)
    finally:
        os.close(terminal)
    pty = Pty(controller)
    try:
        pty.expect("you> ")
        pty.send("take your time")
        pty.expect("thinking")  # the turn runs: the provider hangs until cancelled
        os.kill(proc.pid, signal.SIGINT)
        pty.expect("interrupting the turn (Ctrl-C again to quit)")
        pty.expect("[done] cancelled")  # the first Ctrl-C stopped the hung model
        pty.expect("you> ")
        pty.send("wait for it")
        pty.expect("[tool call] wait_for_release")  # the tool runs until released
        os.kill(proc.pid, signal.SIGINT)
        pty.expect("interrupting the turn (Ctrl-C again to quit)")
        os.kill(proc.pid, signal.SIGINT)
        pty.expect("kbus: quitting")
        assert proc.wait(timeout=30) == 130, pty.seen  # the tool is never released: quitting does not wait
        pty.expect("kbus chat: bye")
    finally:
        os.write(gate, b"released\n")
        os.close(gate)
        os.close(controller)
    assert "Traceback" not in pty.seen, pty.seen


TOOL_MODULE = '''
def shout(text: str) -> str:
    """Return the text in capitals.

    Args:
        text: what to shout.
    """
    return text.upper()
'''


def test_kbus_run_connects_to_a_node_running_the_router(
    kbus_process: Start, kbus_node: Callable[..., KbusNode], ipc_dir: Path, tmp_path: Path
) -> None:
    """--connect: the Router (scripted model) runs in the node's process; the conversation and its tools,
    including one added with --tools FILE.py:FUNCTION, run in the kbus run process."""
    (tmp_path / "mytools.py").write_text(TOOL_MODULE)
    config = ipc_dir / "n1.toml"
    config.write_text(
        """
[node]
name = "n1"
bind = ["ipc://n1.sock"]
data_dir = "data"
[actors.router]
type = "router"
[providers.scripted]
kind = "scripted"
scripts = [[{ call = { name = "shout", arguments = { text = "hello" } }, id = "c1" }, { text = "Done." }]]
"""
    )
    node = kbus_node(config)
    proc = kbus_process(
        "run",
        "shout hello",
        "--connect",
        f"ipc://{ipc_dir}/n1.sock",
        "--node",
        "n1",
        "--model",
        "scripted",
        "--tools",
        f"{tmp_path / 'mytools.py'}:shout",
    )
    code, out, err = finish(proc)
    assert code == 0, out + err
    assert '[tool call] shout {"text": "hello"}' in out
    assert "[tool result] shout: HELLO" in out
    assert "Done." in out
    shown = re.findall(r"receipts: (rcpt-[0-9a-f-]+)$", out, re.MULTILINE)
    assert len(shown) == 1, out
    assert node.stop() == 0
    # The node's Router served the turn and filed the receipt this process showed.
    with closing(sqlite3.connect(ipc_dir / "data" / "receipts.sqlite3")) as db:
        assert db.execute("SELECT receipt_id FROM receipts").fetchall() == [(shown[0],)]


def test_kbus_run_connects_over_tcp_with_curve(
    kbus_process: Start, kbus_node: Callable[..., KbusNode], ipc_dir: Path
) -> None:
    keys = ipc_dir / "keys"
    for name in ("n1", "cli"):
        code, out, err = finish(kbus_process("keys", name, "--dir", str(keys)))
        assert code == 0, out + err
    cli_public = next(
        line.split('"')[1] for line in (keys / "cli.key").read_text().splitlines() if "public-key" in line
    )
    config = ipc_dir / "n1.toml"
    config.write_text(
        f"""
[node]
name = "n1"
bind = ["tcp://127.0.0.1:0"]
data_dir = "data"
[security]
secret_key_file = "keys/n1.key_secret"
allow = [{{ node = "cli", public_key = "{cli_public}" }}]
[actors.router]
type = "router"
"""
    )
    port = kbus_node(config).port
    proc = kbus_process(
        "run",
        "hi",
        "--connect",
        f"tcp://127.0.0.1:{port}",
        "--node",
        "n1",
        "--model",
        "scripted",
        "--server-key",
        str(keys / "n1.key"),
        "--key",
        str(keys / "cli.key_secret"),  # speaks as "cli", the name the node's allowlist gives this key
    )
    code, out, err = finish(proc)
    assert code == 0, out + err
    assert out.startswith("ok\n[done] stop"), out  # the scripted model's default answer


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--model", "nope"], 2, "unknown model 'nope'; known:"),
        (["--tools", "no-colon"], 2, "expected MODULE:FUNCTION"),
        (["--tools", "no_such_module_kbus:f"], 2, "cannot import no_such_module_kbus"),
        (["--tools", "os.path:no_such_function"], 2, "has no 'no_such_function'"),
        (["--tools", "os:sep"], 2, "is not a function"),
        (["--config", "/nonexistent/kbus.toml"], 2, "--config /nonexistent/kbus.toml"),
        (["--connect", "ipc:///tmp/kb-none/none.sock"], 2, "--connect needs --node"),
        (["--connect", "http://x", "--node", "n1"], 2, "expected ipc://PATH or tcp://HOST:PORT"),
        (["--max-steps", "0"], 2, "--max-steps must be at least 1"),
        (["--workdir", "/nonexistent/kbus"], 2, "--workdir"),
        (["--", " "], 2, "the prompt is empty"),
    ],
)
def test_bad_input_exits_with_one_clear_line(
    kbus_process: Start, tmp_path: Path, args: list[str], code: int, message: str
) -> None:
    prompt = [] if "--" in args else ["hi"]
    proc = kbus_process("run", *prompt, "--model", "scripted", "--data-dir", str(tmp_path), *args)
    got, out, err = finish(proc)
    assert got == code, out + err
    assert err.strip().count("\n") == 0, err  # one line, no traceback
    assert err.startswith("kbus run: ") and message in err, err


def test_an_unreachable_endpoint_exits_with_one_clear_line(kbus_process: Start, ipc_dir: Path) -> None:
    proc = kbus_process("run", "hi", "--connect", f"ipc://{ipc_dir}/nobody.sock", "--node", "n1")
    code, out, err = finish(proc)
    assert code == 3, out + err
    assert err.strip().count("\n") == 0, err
    assert "cannot reach" in err and "nobody.sock" in err, err


def test_kbus_chat_continues_a_turn_the_session_file_shows_interrupted(
    kbus_process: Start, tmp_path: Path
) -> None:
    """A session file whose last turn has a tool call journaled and no result (what a SIGKILL during the
    tool leaves): ``kbus chat --session`` settles the call through the tool host by its idempotency key,
    lets the model go on, and the file then records the turn's end."""
    from actors.conversation import read_journal
    from actors.conversation.journal import Journal, PendingCall
    from actors.conversation.types import Message

    session = tmp_path / "chat.jsonl"
    journal = Journal(session)
    journal.session("c0")
    journal.turn_started(0, 0, Message.user("what is 6 * 7?"))
    journal.tool_call(0, 1, PendingCall("c0:0:1:c1", "c1", "calculate", '{"expression": "6 * 7"}'))
    journal.close()
    config = tmp_path / "scripted.toml"
    config.write_text('[providers.scripted]\nkind = "scripted"\nscripts = [[{ text = "It is 42." }]]\n')
    args = ["--config", str(config), "--model", "scripted", "--data-dir", str(tmp_path / "data")]
    proc = kbus_process("chat", *args, "--session", str(session), stdin=subprocess.PIPE)
    out, err = proc.communicate("/quit\n", timeout=60)
    assert proc.returncode == 0, out + err
    assert "continuing turn 0" in err, err
    assert "It is 42." in out
    restored = read_journal(session)
    assert restored.interrupted is None
    assert [m.content for m in restored.transcript][-2:] == ["6 * 7 = 42", "It is 42."]
