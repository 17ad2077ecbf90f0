"""Checkpoints from the command line, each ``kbus`` in its own process (ended by its PID in a finaliser):
``kbus run --edit --checkpoints`` with a scripted model that writes through ``run_command`` and saves, then
``kbus checkpoints list | diff | restore`` on the same working tree, and ``kbus chat``'s ``/restore``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

KBUS = [sys.executable, "-P", "-m", "actors.app.cli"]
Run = Callable[..., tuple[int, str, str]]

SCRIPT = """
[providers.scripted]
kind = "scripted"
scripts = [
  [{ call = { name = "checkpoint_save", arguments = { message = "before the command" } }, id = "c1" },
   { call = { name = "run_command", arguments = { command = "COMMAND" } }, id = "c2" },
   { call = { name = "checkpoint_save", arguments = { message = "after the command" } }, id = "c3" },
   { text = "Done." }],
  [{ text = "I see the restore." }],
]
""".replace("COMMAND", "echo made > made.txt; rm old.txt")


@pytest.fixture
def kbus() -> Iterator[Run]:
    """``kbus(*args)`` runs one kbus command to its end (bounded); a process still running when the test
    ends is killed by its PID."""
    started: list[subprocess.Popen[str]] = []

    def run(*args: str, stdin: str | None = None, timeout: float = 120) -> tuple[int, str, str]:
        proc = subprocess.Popen(
            [*KBUS, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(proc)
        out, err = proc.communicate(stdin, timeout=timeout)
        return proc.returncode, out, err

    yield run
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_kbus_run_saves_checkpoints_and_kbus_checkpoints_lists_diffs_and_restores(
    kbus: Run, tmp_path: Path
) -> None:
    work, data = tmp_path / "work", tmp_path / "data"
    work.mkdir()
    (work / "old.txt").write_text("old\n")
    config = tmp_path / "scripted.toml"
    config.write_text(SCRIPT)
    common = ["--workdir", str(work), "--data-dir", str(data)]
    code, out, err = kbus(
        "run", "make a file", "--config", str(config), "--model", "scripted", "--edit", "--checkpoints",
        "--checkpoint-session", "cli1", "--max-steps", "8", *common,
    )  # fmt: skip
    assert code == 0, out + err
    assert "checkpoints on (session cli1)" in err
    assert "[tool result] run_command: exit code 0" in err  # tool lines: stderr
    assert (work / "made.txt").read_text() == "made\n" and not (work / "old.txt").exists()

    code, out, err = kbus("checkpoints", "list", *common)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "session cli1: 2 checkpoint(s)"
    assert "after the command" in lines[1] and "before the command" in lines[2]
    before = lines[2].split()[0]

    code, out, err = kbus("checkpoints", "diff", before, *common)
    assert code == 0, err
    assert "+++ b/made.txt" in out and "--- a/old.txt" in out

    (work / "later.txt").write_text("created after both\n")
    code, out, err = kbus("checkpoints", "restore", before, *common)
    assert code == 0, err
    assert "Written back (1): old.txt." in out
    assert "Removed, created after the checkpoint (2): later.txt, made.txt." in out
    assert sorted(os.listdir(work)) == ["old.txt"]
    log = next(data.glob("checkpoints/*/cli1.jsonl")).read_text().splitlines()
    assert [json.loads(line)["event"] for line in log] == ["save", "save", "restore"]

    code, out, err = kbus("checkpoints", "restore", "ffff", *common)
    assert code == 1 and err.strip().count("\n") == 0 and "no checkpoint ffff" in err, err
    elsewhere = tmp_path / "never-checkpointed"
    elsewhere.mkdir()
    code, out, err = kbus("checkpoints", "list", "--workdir", str(elsewhere), "--data-dir", str(data))
    assert code == 2 and err.startswith("kbus checkpoints: no checkpoints of"), err


def test_kbus_chat_restore_tells_the_model(kbus: Run, tmp_path: Path) -> None:
    work, data = tmp_path / "work", tmp_path / "data"
    work.mkdir()
    (work / "old.txt").write_text("old\n")
    config = tmp_path / "scripted.toml"
    config.write_text(SCRIPT)
    session = tmp_path / "chat.jsonl"
    first_turn = "make a file\n"
    # the first chat lists the checkpoints; a second one on the same session file restores one
    code, out, err = kbus(
        "chat", "--config", str(config), "--model", "scripted", "--edit", "--checkpoints", "--max-steps", "8",
        "--workdir", str(work), "--data-dir", str(data), "--session", str(session),
        stdin=first_turn + "/checkpoints\n/quit\n",
    )  # fmt: skip
    assert code == 0, out + err
    [listed] = [line for line in out.splitlines() if "before the command" in line and " UTC " in line]
    found = re.search(r"\b([0-9a-f]{12})\b", listed)
    assert found, out
    checkpoint = found.group(1)

    code, out, err = kbus(
        "chat", "--config", str(config), "--model", "scripted", "--edit", "--checkpoints",
        "--workdir", str(work), "--data-dir", str(data), "--session", str(session),
        stdin=f"/restore {checkpoint}\n/quit\n",
    )  # fmt: skip
    assert code == 0, out + err
    assert "Restored checkpoint" in out and "Removed, created after the checkpoint (1): made.txt." in out
    assert sorted(os.listdir(work)) == ["old.txt"]
    records = [json.loads(line) for line in session.read_text().splitlines()]
    told = [r for r in records if "Restored checkpoint" in json.dumps(r)]
    assert told, "the restore message is in the session file: the model sees it on the next turn"
