"""``kbus run --goal`` and the ``kbus chat`` commands ``/goal`` and ``/loop`` in their own processes (issue
12), on the scripted provider told what to say through a ``--config`` catalog. Every process is ended by its
PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

KBUS = [sys.executable, "-P", "-m", "actors.app.cli"]


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is only this kbus process
            proc.wait(timeout=10)


def kbus(
    procs: list[subprocess.Popen[str]], tmp_path: Path, scripts: str, *args: str, stdin: str = ""
) -> tuple[int, str, str]:
    config = tmp_path / "scripted.toml"
    config.write_text(f'[providers.scripted]\nkind = "scripted"\nscripts = [\n{scripts}\n]\n')
    common = ["--config", str(config), "--model", "scripted", "--data-dir", str(tmp_path / "data")]
    proc = subprocess.Popen(
        [*KBUS, *args, *common, "--workdir", str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    procs.append(proc)
    out, err = proc.communicate(stdin, timeout=120)
    return proc.returncode, out, err


VERDICT = (
    '[{{ call = {{ name = "goal_verdict", arguments = {{ achieved = {a}, reason = "{r}" }} }}, '
    'id = "{i}" }}],'
)


def test_kbus_run_goal_shows_each_verdict_and_ends_when_achieved(
    procs: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    scripts = "\n".join(
        [
            '[{ text = "I started." }],',
            VERDICT.format(a="false", r="the file is still empty", i="v1"),
            '[{ text = "Now it is written." }],',
            VERDICT.format(a="true", r="the file has text", i="v2"),
        ]
    )
    code, out, err = kbus(
        procs, tmp_path, scripts, "run", "write the file", "--goal", "the file has text", "--max-turns", "3"
    )
    assert code == 0, out + err
    lines = err.splitlines()  # status lines go to stderr, the answer alone to stdout
    assert "[goal] set: the file has text (at most 3 turns)" in lines
    assert "[goal] not yet after turn 1: the file is still empty" in lines
    assert "[goal] achieved after 2 turns: the file has text" in lines
    done = [line for line in lines if line.startswith("[loop done] ")]
    assert len(done) == 1 and done[0].startswith("[loop done] 2 turns")
    assert done[0].count("rcpt-") == 4  # two turns and two judge calls: one receipt each


def test_kbus_run_goal_stops_at_max_turns(procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    scripts = '[{ text = "one" }],\n' + VERDICT.format(a="false", r="no", i="v1") + '\n[{ text = "two" }],'
    code, out, err = kbus(procs, tmp_path, scripts, "run", "go", "--goal", "never", "--max-turns", "2")
    assert code == 0, out + err
    assert "[goal] ended: budget exceeded" in err.splitlines()


def test_kbus_run_goal_bad_input_is_one_line(procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    code, _, err = kbus(procs, tmp_path, "", "run", "go", "--goal", "c", "--max-turns", "0")
    assert code == 2 and err.strip() == "kbus run: --max-turns must be at least 1, not 0"
    code, _, err = kbus(procs, tmp_path, "", "run", "go", "--goal", " ")
    assert code == 2 and err.strip() == "kbus run: the --goal condition is empty"


def test_kbus_chat_goal_and_loop_commands(procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    scripts = "\n".join(
        [
            '[{ text = "working" }],',
            VERDICT.format(a="true", r="it is done", i="v1"),
            '[{ call = { name = "schedule_wakeup", arguments = { delay_seconds = 0, prompt = "check again" }'
            ' }, id = "w1" }, { text = "later" }],',
            '[{ text = "checked" }],',
        ]
    )
    commands = "/goal\n/goal it is done\n/goal\n/goal clear\n/loop watch it\n/quit\n"
    code, out, err = kbus(procs, tmp_path, scripts, "chat", "--max-turns", "3", stdin=commands)
    assert code == 0, out + err
    lines = [line.replace("you> ", "") for line in err.splitlines()]  # status lines go to stderr
    assert [line.replace("you> ", "") for line in out.splitlines()].count("no goal") == 2  # /goal's answer
    assert "[goal] set: it is done (at most 3 turns)" in lines
    assert "[goal] achieved after 1 turn: it is done" in lines
    assert "[goal] ended: cleared" in lines
    assert "[wakeup] scheduled in 0s: check again" in lines
    assert "[wakeup] woke up" in lines
    loops = [line for line in lines if line.startswith("[loop done] ")]
    assert [line.split(" · ")[0] for line in loops] == ["[loop done] 1 turn", "[loop done] 2 turns"]
