"""The workspace tools (app/builtin_tools.py): write_file, edit_file, run_command on real folders and real
child processes; run_command's process group checked by PID (a pidfd says when each process is gone)."""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from actors.app.builtin_tools import (
    WORKSPACE_TOOLS,
    ToolRefused,
    command_environment,
    register_workspace_tools,
    workspace_tools,
)
from actors.conversation.checkpoints import TouchedFiles
from actors.conversation.tools import ToolRegistry

WAIT = 10.0


def tools(root: Path, **options: object) -> dict[str, Callable[..., str]]:
    return {fn.__name__: fn for fn in workspace_tools(root, **options)}  # type: ignore[arg-type]


def gone(pid: int, timeout: float = WAIT) -> bool:
    """True once process ``pid`` has exited (a zombie counts: it runs no more); waits at most ``timeout``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


# -------------------------------------------------------------------------------------- write_file


def test_write_file_creates_and_replaces_inside_the_folder_and_records_the_path(root: Path) -> None:
    touched = TouchedFiles()
    t = tools(root, touched=touched)
    assert t["write_file"]("src/pkg/mod.py", "x = 1\n") == "wrote 6 bytes to src/pkg/mod.py (created)"
    (root / "run.sh").write_text("old")
    os.chmod(root / "run.sh", 0o750)
    assert t["write_file"]("run.sh", "#!/bin/sh\n").endswith("(replaced)")
    assert (root / "src" / "pkg" / "mod.py").read_text() == "x = 1\n"
    assert os.stat(root / "run.sh").st_mode & 0o777 == 0o750  # the mode is kept
    assert touched.snapshot() == {"src/pkg/mod.py", "run.sh"}
    assert sorted(os.listdir(root)) == ["run.sh", "src"]  # no temporary file left behind


def test_write_file_refuses_paths_out_of_the_folder(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "out").symlink_to(outside)
    (root / "dangling").symlink_to(outside / "new.txt")
    t = tools(root)
    for path in ("../escape.txt", str(outside / "x.txt"), "out/x.txt", "dangling", "sub/../../x"):
        with pytest.raises(ToolRefused, match="outside the working directory"):
            t["write_file"](path, "no")
    with pytest.raises(ToolRefused, match="the working directory itself"):
        t["write_file"](".", "no")
    assert os.listdir(outside) == []


def test_write_file_refuses_a_folder_and_oversized_content(root: Path) -> None:
    (root / "d").mkdir()
    t = tools(root)
    with pytest.raises(ToolRefused, match="not a regular file"):
        t["write_file"]("d", "x")
    with pytest.raises(ToolRefused, match="writes at most"):
        t["write_file"]("big.txt", "x" * (4 * 1024 * 1024 + 1))


# --------------------------------------------------------------------------------------- edit_file


def test_edit_file_replaces_the_one_exact_occurrence(root: Path) -> None:
    touched = TouchedFiles()
    (root / "a.py").write_text("def f():\n    return 1\n")
    t = tools(root, touched=touched)
    assert t["edit_file"]("a.py", "return 1", "return 2") == "replaced 1 occurrence in a.py (22 -> 22 bytes)"
    assert (root / "a.py").read_text() == "def f():\n    return 2\n"
    assert "a.py" in touched


def test_edit_file_with_no_or_several_matches_says_how_many(root: Path) -> None:
    (root / "a.txt").write_text("x x x\n")
    t = tools(root)
    with pytest.raises(ToolRefused, match=r"does not occur in a.txt; it must occur exactly once \(found 0"):
        t["edit_file"]("a.txt", "y", "z")
    with pytest.raises(ToolRefused, match=r"occurs 3 times in a.txt; .*found 3 matches"):
        t["edit_file"]("a.txt", "x", "z")
    assert (root / "a.txt").read_text() == "x x x\n"
    with pytest.raises(ToolRefused, match="outside the working directory"):
        t["edit_file"]("../a.txt", "x", "z")


def test_workspace_tools_are_registered_as_mutating(root: Path) -> None:
    registry = ToolRegistry()
    register_workspace_tools(registry, root)
    assert sorted(registry.names()) == sorted(WORKSPACE_TOOLS)
    assert all(registry.is_mutating(name) for name in WORKSPACE_TOOLS)
    assert [n for n in WORKSPACE_TOOLS if registry.is_rerun_safe(n)] == ["write_file"]
    result = registry.execute("edit_file", {"path": "missing.txt", "old_text": "a", "new_text": "b"})
    assert not result.ok and "no such file" in result.text


# ------------------------------------------------------------------------------------- run_command


def test_run_command_runs_in_the_folder_and_reports_exit_code_and_output(root: Path) -> None:
    touched = TouchedFiles()
    t = tools(root, touched=touched)
    text = t["run_command"]("pwd; echo oops >&2; exit 3")
    assert text == f"exit code 3\nstdout ({len(str(root)) + 1} bytes):\n{root}\n\nstderr (5 bytes):\noops\n"
    assert touched.everything  # it may have written anything


def test_run_command_environment_holds_no_credentials(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-1")
    monkeypatch.setenv("GH_TOKEN", "t")
    monkeypatch.setenv("my_password", "p")
    monkeypatch.setenv("LAB_PROVIDER_CRED", "named by the catalog")
    monkeypatch.setenv("HARMLESS", "kept")
    t = tools(root, secret_env=["LAB_PROVIDER_CRED"])
    listed = t["run_command"]("env")
    for name in ("OPENAI_API_KEY", "GH_TOKEN", "my_password", "LAB_PROVIDER_CRED"):
        assert f"{name}=" not in listed
    assert "HARMLESS=kept" in listed
    assert set(command_environment(["HARMLESS"], {"HARMLESS": "1", "PATH": "/bin"})) == {"PATH"}


def test_run_command_output_cap_holds_and_notes_the_full_size(root: Path) -> None:
    t = tools(root, max_output=1000)
    text = t["run_command"]("head -c 100000 /dev/zero | tr '\\0' 'a'")
    assert "stdout (the first 1000 of 100000 bytes):\n" + "a" * 1000 + "\n[stdout truncated]" in text
    assert len(text) < 1200


def test_run_command_past_its_timeout_kills_its_whole_process_group(root: Path) -> None:
    """The shell and a child it put in the background are both gone, each checked by its PID."""
    leaders: list[int] = []
    t = tools(root, on_command_start=leaders.append)
    with pytest.raises(ToolRefused, match="ran past 1 s and was killed with its process group") as refused:
        t["run_command"]("sleep 300 & echo $! > bg.pid; echo started; wait", timeout_seconds=1)
    assert "stdout (8 bytes):\nstarted" in str(refused.value)
    background = int((root / "bg.pid").read_text())
    assert gone(leaders[0]) and gone(background)
    assert os.getpgid(os.getpid()) != leaders[0]  # the group was the command's own, never ours


def test_run_command_cancelled_kills_its_process_group(root: Path) -> None:
    cancel = threading.Event()
    started = threading.Event()
    leaders: list[int] = []

    def on_start(pid: int) -> None:
        leaders.append(pid)
        started.set()

    t = tools(root, cancel=cancel, on_command_start=on_start)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            t["run_command"]("sleep 300", timeout_seconds=300)
        except ToolRefused as exc:
            outcome.append(exc)

    runner = threading.Thread(target=call)
    runner.start()
    assert started.wait(WAIT)
    cancel.set()
    runner.join(WAIT)
    assert not runner.is_alive()
    assert "cancelled and killed with its process group" in str(outcome[0])
    assert gone(leaders[0])


def test_run_command_leaves_no_background_process_behind(root: Path) -> None:
    t = tools(root)
    text = t["run_command"]("sleep 300 > /dev/null 2>&1 & echo $!")
    pid = int(text.split("\n")[2])
    assert text.startswith("exit code 0")
    assert gone(pid)


def test_run_command_refuses_bad_arguments(root: Path) -> None:
    t = tools(root, max_command_timeout=60)
    with pytest.raises(ToolRefused, match="empty"):
        t["run_command"]("  ")
    with pytest.raises(ToolRefused, match="at most 60"):
        t["run_command"]("true", timeout_seconds=61)


def test_the_cli_hides_every_api_key_env_its_catalog_names(tmp_path: Path) -> None:
    """``kbus run/chat --edit``: run_command's environment lacks each variable a catalog provider names."""
    import argparse

    from actors.app.options import credential_names

    config = tmp_path / "c.toml"
    config.write_text(
        '[providers.lab]\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\napi_key_env = "LAB_CRED"\n'
    )
    assert "LAB_CRED" in credential_names(argparse.Namespace(config=str(config)))
    assert credential_names(argparse.Namespace(config=str(tmp_path / "missing.toml"))) == ()
