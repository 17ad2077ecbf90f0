"""ShadowRepo and the checkpoint tools with the real ``git`` binary on real folders (RULES.md 9.9, CK-04,
CK-07); the runtime's side of CK-01..07 and CV-04 is in test_conversation_checkpoints.py."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from actors.app.builtin_tools import workspace_tools
from actors.conversation.checkpoints import CHECKPOINT_TOOLS, RESTORE_TOOL, TouchedFiles, bind_checkpoints
from actors.conversation.shadow import CheckpointError, ShadowRepo
from actors.conversation.tools import ToolRegistry

GIT_ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "user",
    "GIT_AUTHOR_EMAIL": "user@example.invalid",
    "GIT_COMMITTER_NAME": "user",
    "GIT_COMMITTER_EMAIL": "user@example.invalid",
}


def git(cwd: Path, *args: str) -> str:
    """The user's git, reading nothing but the repository (no optional locks: status never writes)."""
    done = subprocess.run(
        ["git", "--no-optional-locks", *args],
        cwd=cwd,
        env=GIT_ENV,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def tree_bytes(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file and folder under ``root``: mode and content (a symlink's target), by relative path."""
    found: dict[str, tuple[int, bytes]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            st = os.lstat(path)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = (st.st_mode, os.readlink(path).encode())
            elif path.is_file():
                found[rel] = (st.st_mode, path.read_bytes())
            else:
                found[rel] = (st.st_mode, b"")
    return found


def shadow_files(shadow: ShadowRepo, checkpoint_id: str) -> set[str]:
    """The paths a checkpoint's tree holds, read with git straight from the shadow repository."""
    out = subprocess.run(
        ["git", f"--git-dir={shadow.git_dir}", "ls-tree", "-r", "-z", "--name-only", checkpoint_id],
        env=GIT_ENV,
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout
    return {p for p in out.decode().split("\0") if p}


def shadow_blob(shadow: ShadowRepo, checkpoint_id: str, path: str) -> bytes:
    return subprocess.run(
        ["git", f"--git-dir={shadow.git_dir}", "cat-file", "blob", f"{checkpoint_id}:{path}"],
        env=GIT_ENV,
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "work"
    root.mkdir()
    return root


@pytest.fixture
def make_shadow(tmp_path: Path, tree: Path) -> Callable[..., ShadowRepo]:
    def make(**options: object) -> ShadowRepo:
        return ShadowRepo(tree, tmp_path / "data" / "shadow.git", clock=Clock(), **options)  # type: ignore[arg-type]

    return make


@pytest.fixture
def registry() -> Iterator[ToolRegistry]:
    yield ToolRegistry()


def run(reg: ToolRegistry, name: str, **arguments: object) -> str:
    result = reg.execute(name, arguments)
    assert result.ok, result.text
    return result.text


def fail(reg: ToolRegistry, name: str, **arguments: object) -> str:
    result = reg.execute(name, arguments)
    assert not result.ok, result.text
    return result.text


# ------------------------------------------------------------------------- the user's repository


def test_a_real_git_repository_as_the_working_tree_is_left_byte_for_byte_alone(
    tree: Path, make_shadow: Callable[..., ShadowRepo], tmp_path: Path, registry: ToolRegistry
) -> None:
    """Saves, diffs, run_command and a restore in a real repository: its .git is byte for byte what it was,
    and git status in it says the same; the shadow's ref is not in it."""
    git(tree, "init", "-q")
    (tree / ".gitignore").write_text("*.log\nbuild/\n")
    (tree / "tracked.txt").write_text("one\n")
    (tree / "src").mkdir()
    (tree / "src" / "main.py").write_text("print('hi')\n")
    git(tree, "add", ".")
    git(tree, "commit", "-q", "-m", "init")
    (tree / "tracked.txt").write_text("one, modified\n")  # a modified tracked file
    (tree / "notes.md").write_text("untracked\n")  # an untracked one
    (tree / "debug.log").write_text("ignored\n")
    status = git(tree, "status", "--porcelain=v1", "-uall", "--ignored")
    before = tree_bytes(tree / ".git")

    shadow = make_shadow()
    bind_checkpoints(registry, shadow, "s1", tmp_path / "log.jsonl", restore_tool=True)
    for fn in workspace_tools(tree):
        registry.register(fn, mutating=True)
    saved = run(registry, "checkpoint_save", message="start")
    checkpoint = shadow.list("s1")[0].checkpoint_id
    assert saved.startswith(f"Saved checkpoint {checkpoint[:12]}")
    assert shadow_files(shadow, checkpoint) == {".gitignore", "tracked.txt", "src/main.py", "notes.md"}

    run(registry, "run_command", command="echo made > made.txt && rm notes.md && echo more >> tracked.txt")
    run(registry, "write_file", path="src/new.py", content="x = 1\n")
    run(registry, "checkpoint_save", message="after")
    diff = run(registry, "checkpoint_diff", a=checkpoint, b="")
    assert "+made" in diff and "-untracked" in diff and "+more" in diff
    restored = run(registry, "checkpoint_restore", checkpoint_id=checkpoint)
    assert "Removed, created after the checkpoint (2): made.txt, src/new.py." in restored

    assert tree_bytes(tree / ".git") == before
    assert git(tree, "status", "--porcelain=v1", "-uall", "--ignored") == status
    assert "kbus" not in git(tree, "for-each-ref")
    assert (tree / "notes.md").read_text() == "untracked\n" and not (tree / "made.txt").exists()
    assert (tree / "debug.log").read_text() == "ignored\n"  # an ignored file is never touched


def test_a_folder_that_is_not_a_shadow_repository_is_refused(tree: Path) -> None:
    """Pointing the shadow at the user's own .git never adopts it."""
    git(tree, "init", "-q")
    before = tree_bytes(tree / ".git")
    with pytest.raises(CheckpointError, match="outside the working tree"):
        ShadowRepo(tree, tree / ".git")
    other = tree.parent / "other.git"
    subprocess.run(["git", "init", "-q", "--bare", str(other)], env=GIT_ENV, check=True, timeout=60)
    with pytest.raises(CheckpointError, match="not a kbus shadow repository"):
        ShadowRepo(tree, other).snapshot("s1", "x")
    assert tree_bytes(tree / ".git") == before


# ---------------------------------------------------------------------------------- saves


def test_a_file_written_by_run_command_is_in_the_next_checkpoint(
    tree: Path, make_shadow: Callable[..., ShadowRepo], tmp_path: Path, registry: ToolRegistry
) -> None:
    """With a TouchedFiles too: run_command marks it "everything", so the save covers the whole tree."""
    touched = TouchedFiles()
    shadow = make_shadow()
    bind_checkpoints(registry, shadow, "s1", tmp_path / "log.jsonl", touched)
    for fn in workspace_tools(tree, touched=touched):
        registry.register(fn, mutating=True)
    run(registry, "run_command", command="mkdir -p out && printf 'from the shell' > out/made.txt")
    assert touched.everything
    run(registry, "checkpoint_save", message="after the command")
    checkpoint = shadow.list("s1")[0]
    assert "out/made.txt" in checkpoint.files
    assert shadow_blob(shadow, checkpoint.checkpoint_id, "out/made.txt") == b"from the shell"
    assert touched.take() == ((), False)  # the save cleared it


def test_ck07_touched_files_scope_the_save_and_are_cleared(
    tree: Path, make_shadow: Callable[..., ShadowRepo], tmp_path: Path, registry: ToolRegistry
) -> None:
    """CK-07: touched={a.py} → the snapshot covers {a.py} (b.py, changed too, keeps its earlier content);
    log_path gains one line; the set is empty after."""
    (tree / "a.py").write_text("a = 1\n")
    (tree / "b.py").write_text("b = 1\n")
    shadow = make_shadow()
    log = tmp_path / "logs" / "s1.jsonl"
    touched = TouchedFiles()
    bind_checkpoints(registry, shadow, "s1", log, touched)
    touched.update(["a.py", "b.py"])
    run(registry, "checkpoint_save", message="base")
    (tree / "a.py").write_text("a = 2\n")
    (tree / "b.py").write_text("b = 2\n")
    touched.add("a.py")
    lines_before = log.read_text().splitlines()
    run(registry, "checkpoint_save", message="only a")
    lines = log.read_text().splitlines()
    assert len(lines) == len(lines_before) + 1
    record = json.loads(lines[-1])
    assert record["event"] == "save" and record["files"] == ["a.py"] and record["scope"] == "touched files"
    latest = shadow.list("s1")[0]
    assert latest.files == ("a.py",)
    assert shadow_blob(shadow, latest.checkpoint_id, "a.py") == b"a = 2\n"
    assert shadow_blob(shadow, latest.checkpoint_id, "b.py") == b"b = 1\n"  # not touched: not saved again
    assert len(touched) == 0


def test_ck07_without_touched_files_a_save_covers_the_whole_tree(
    tree: Path, make_shadow: Callable[..., ShadowRepo], tmp_path: Path, registry: ToolRegistry
) -> None:
    (tree / "a.py").write_text("a\n")
    shadow = make_shadow()
    log = tmp_path / "s1.jsonl"
    bind_checkpoints(registry, shadow, "s1", log)
    run(registry, "checkpoint_save", message="one")
    (tree / "deep" / "er").mkdir(parents=True)
    (tree / "deep" / "er" / "c.txt").write_text("c\n")
    run(registry, "checkpoint_save", message="two")
    latest = shadow.list("s1")[0]
    assert latest.files == ("deep/er/c.txt",)  # what changed since the previous checkpoint
    assert shadow_files(shadow, latest.checkpoint_id) == {"a.py", "deep/er/c.txt"}
    assert [json.loads(line)["label"] for line in log.read_text().splitlines()] == ["one", "two"]


def test_a_file_over_the_cap_is_skipped_and_listed(
    tree: Path, make_shadow: Callable[..., ShadowRepo], tmp_path: Path, registry: ToolRegistry
) -> None:
    (tree / "small.txt").write_bytes(b"x" * 100)
    (tree / "big.bin").write_bytes(b"x" * 101)
    shadow = make_shadow(max_file_bytes=100)
    log = tmp_path / "s1.jsonl"
    bind_checkpoints(registry, shadow, "s1", log)
    text = run(registry, "checkpoint_save", message="capped")
    assert "Skipped, not saved (1): big.bin (larger than 100 bytes (101))" in text
    info = shadow.list("s1")[0]
    assert shadow_files(shadow, info.checkpoint_id) == {"small.txt"}
    assert [(s.path, s.reason) for s in info.skipped] == [("big.bin", "larger than 100 bytes (101)")]
    assert json.loads(log.read_text())["skipped"] == [
        {"path": "big.bin", "reason": "larger than 100 bytes (101)"}
    ]
    # a file that grows past the cap later leaves the next checkpoint (and is listed), never stays stale
    (tree / "small.txt").write_bytes(b"y" * 200)
    shadow.snapshot("s1", "grown")
    grown = shadow.list("s1")[0]
    assert shadow_files(shadow, grown.checkpoint_id) == set()
    assert {s.path for s in grown.skipped} == {"big.bin", "small.txt"}


def test_a_symlink_out_of_the_tree_is_not_followed(
    tree: Path, make_shadow: Callable[..., ShadowRepo], tmp_path: Path
) -> None:
    """A symlink (to a file or a folder outside) is skipped and listed; the outside content never enters
    the shadow, and a restore does not write through a symlink that now stands where a folder was."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret\n")
    (tree / "to-file").symlink_to(outside / "secret.txt")
    (tree / "to-dir").symlink_to(outside)
    (tree / "d").mkdir()
    (tree / "d" / "x.txt").write_text("inside\n")
    shadow = make_shadow()
    info = shadow.snapshot("s1", "links")
    assert shadow_files(shadow, info.checkpoint_id) == {"d/x.txt"}
    assert {(s.path, s.reason) for s in info.skipped} == {
        ("to-file", "symbolic link"),
        ("to-dir", "symbolic link"),
    }
    # d becomes a symlink to the outside folder: restoring d/x.txt would write outside; it is left alone
    (tree / "d" / "x.txt").unlink()
    (tree / "d").rmdir()
    (tree / "d").symlink_to(outside)
    outside_before = tree_bytes(outside)
    report = shadow.restore("s1", info.checkpoint_id)
    assert tree_bytes(outside) == outside_before
    assert "d" in {s.path for s in report.left_alone} and report.written == ()
    assert "d (symbolic link)" in report.text


def test_restore_never_writes_through_an_ignored_symlink(
    tree: Path, make_shadow: Callable[..., ShadowRepo], tmp_path: Path
) -> None:
    """A folder of the checkpoint that is now an ignored symlink out of the tree (so no save lists it): the
    restore leaves it alone and names it instead of writing through it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (tree / "d").mkdir()
    (tree / "d" / "x.txt").write_text("inside\n")
    shadow = make_shadow()
    info = shadow.snapshot("s1", "real folder")
    (tree / "d" / "x.txt").unlink()
    (tree / "d").rmdir()
    (tree / "d").symlink_to(outside)
    (tree / ".gitignore").write_text("d\n")
    report = shadow.restore("s1", info.checkpoint_id)
    assert os.listdir(outside) == []
    assert (tree / "d").is_symlink()
    assert ("d/x.txt", "d is in the way") in {(s.path, s.reason) for s in report.left_alone}


def test_a_fifo_is_skipped_and_listed(tree: Path, make_shadow: Callable[..., ShadowRepo]) -> None:
    (tree / "plain.txt").write_text("p\n")
    os.mkfifo(tree / "pipe")
    info = make_shadow().snapshot("s1", "special")
    assert [(s.path, s.reason) for s in info.skipped] == [("pipe", "not a regular file")]
    assert info.files == ("plain.txt",)


def test_a_nested_git_repository_is_skipped_and_listed(
    tree: Path, make_shadow: Callable[..., ShadowRepo]
) -> None:
    (tree / "top.txt").write_text("top\n")
    nested = tree / "vendor" / "lib"
    nested.mkdir(parents=True)
    git(nested, "init", "-q")
    (nested / "lib.c").write_text("int x;\n")
    git(nested, "add", ".")
    git(nested, "commit", "-q", "-m", "lib")
    info = make_shadow().snapshot("s1", "with nested")
    assert [(s.path, s.reason) for s in info.skipped] == [("vendor/lib", "nested git repository")]
    assert info.files == ("top.txt",)


def test_a_later_save_keeps_the_index(tree: Path, make_shadow: Callable[..., ShadowRepo]) -> None:
    """The session's index is kept between saves: the second save finds only the changed file (its
    stat data for the others is still there)."""
    for i in range(20):
        (tree / f"f{i}.txt").write_text(f"{i}\n")
    shadow = make_shadow()
    shadow.snapshot("s1", "one")
    index = next((shadow.git_dir / "kbus-index").iterdir())
    assert index.is_file()
    (tree / "f3.txt").write_text("changed\n")
    second = shadow.snapshot("s1", "two")
    assert second.files == ("f3.txt",) and second.files_total == 1


# ----------------------------------------------------------------------------------- sessions


def test_ck04_two_sessions_on_one_shadow_repository_see_only_their_own(
    tree: Path, make_shadow: Callable[..., ShadowRepo], tmp_path: Path
) -> None:
    """CK-04: s1's tools list, diff and restore only s1's checkpoints; s2's id is not one of them."""
    (tree / "f.txt").write_text("1\n")
    shadow = make_shadow()
    r1, r2 = ToolRegistry(), ToolRegistry()
    bind_checkpoints(r1, shadow, "s1", tmp_path / "s1.jsonl", restore_tool=True)
    bind_checkpoints(r2, ShadowRepo.from_spec(shadow.spec), "s2", tmp_path / "s2.jsonl", restore_tool=True)
    run(r1, "checkpoint_save", message="s1 first")
    (tree / "f.txt").write_text("2\n")
    run(r2, "checkpoint_save", message="s2 first")
    s1 = shadow.list("s1")
    s2 = shadow.list("s2")
    assert [c.label for c in s1] == ["s1 first"] and [c.label for c in s2] == ["s2 first"]
    listing = run(r1, "checkpoint_list")
    assert "s1 first" in listing and "s2 first" not in listing
    other = s2[0].checkpoint_id
    assert f"no checkpoint {other} in session s1" in fail(r1, "checkpoint_diff", a=other)
    assert f"no checkpoint {other[:8]} in session s1" in fail(
        r1, "checkpoint_restore", checkpoint_id=other[:8]
    )
    assert (tree / "f.txt").read_text() == "2\n"
    assert shadow.sessions() == ["s1", "s2"]


# ------------------------------------------------------------------------------------- restore


def test_restore_removes_a_file_created_since_and_brings_back_one_deleted(
    tree: Path, make_shadow: Callable[..., ShadowRepo], tmp_path: Path, registry: ToolRegistry
) -> None:
    (tree / "keep.txt").write_text("keep\n")
    (tree / "lib").mkdir()
    (tree / "lib" / "gone.py").write_text("gone = True\n")
    (tree / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(tree / "run.sh", 0o755)
    shadow = make_shadow(max_file_bytes=1000)
    bind_checkpoints(registry, shadow, "s1", tmp_path / "s1.jsonl", restore_tool=True)
    run(registry, "checkpoint_save", message="good state")
    checkpoint = shadow.list("s1")[0].checkpoint_id
    (tree / "lib" / "gone.py").unlink()
    (tree / "lib").rmdir()
    (tree / "keep.txt").write_text("broken\n")
    (tree / "new" / "deep").mkdir(parents=True)
    (tree / "new" / "deep" / "created.txt").write_text("created later\n")
    (tree / "huge.bin").write_bytes(b"h" * 2000)  # over the cap now: left alone, named
    text = run(registry, "checkpoint_restore", checkpoint_id=checkpoint[:10])

    assert (tree / "lib" / "gone.py").read_text() == "gone = True\n"
    assert (tree / "keep.txt").read_text() == "keep\n"
    assert not (tree / "new").exists()  # the file and the folders it alone needed
    assert (tree / "huge.bin").exists()
    assert os.stat(tree / "run.sh").st_mode & 0o111
    assert "Written back (2): keep.txt, lib/gone.py." in text
    assert "Removed, created after the checkpoint (1): new/deep/created.txt." in text
    assert "Left alone, not held by the checkpoint (1): huge.bin (larger than 1000 bytes (2000))." in text
    restore_line = json.loads((tmp_path / "s1.jsonl").read_text().splitlines()[-1])
    assert restore_line["event"] == "restore" and restore_line["removed"] == ["new/deep/created.txt"]
    assert shadow.diff("s1", checkpoint) == "(no differences)"


def test_restore_is_registered_as_mutating_and_only_on_request(tmp_path: Path, tree: Path) -> None:
    shadow = ShadowRepo(tree, tmp_path / "shadow.git")
    plain, full = ToolRegistry(), ToolRegistry()
    bind_checkpoints(plain, shadow, "s1", tmp_path / "log.jsonl")
    bind_checkpoints(full, shadow, "s1", tmp_path / "log.jsonl", restore_tool=True)
    assert sorted(plain.names()) == sorted(CHECKPOINT_TOOLS)
    assert full.is_mutating(RESTORE_TOOL)
    assert not any(full.is_mutating(name) for name in CHECKPOINT_TOOLS)
    rerun_safe = {n for n in (*CHECKPOINT_TOOLS, RESTORE_TOOL) if full.is_rerun_safe(n)}
    assert rerun_safe == {"checkpoint_list", "checkpoint_diff", RESTORE_TOOL}  # a save twice makes two


def test_diff_is_bounded_and_either_side_may_be_the_working_tree(
    tree: Path, make_shadow: Callable[..., ShadowRepo]
) -> None:
    (tree / "a.txt").write_text("".join(f"line {i}\n" for i in range(2000)))
    shadow = make_shadow()
    first = shadow.snapshot("s1", "one").checkpoint_id
    (tree / "a.txt").write_text("".join(f"LINE {i}\n" for i in range(2000)))
    bounded = shadow.diff("s1", first, "worktree", max_bytes=500)
    assert bounded.startswith("diff --git a/a.txt b/a.txt")
    kept, _, note = bounded.rpartition("\n[diff truncated: the first 500 of ")
    assert len(kept.encode()) == 500 and note.endswith(" bytes]")
    backwards = shadow.diff("s1", "worktree", first)
    assert "\n-LINE 0\n-LINE 1\n" in backwards and "\n+line 0\n" in backwards


# -------------------------------------------------------------------------------------- failures


def test_a_git_failure_is_a_typed_error_result_not_a_traceback(tmp_path: Path, tree: Path) -> None:
    registry = ToolRegistry()
    bind_checkpoints(registry, ShadowRepo(tree, tmp_path / "shadow.git"), "s1", tmp_path / "l.jsonl")
    broken = ShadowRepo(tree, tmp_path / "shadow.git", git=str(tmp_path / "no-such-git"))
    with pytest.raises(CheckpointError, match="cannot run"):
        broken.snapshot("s1", "x")
    text = fail(registry, "checkpoint_diff", a="zz")
    assert text == "CheckpointError: 'zz' is not a checkpoint id (4 to 40 hex digits)"
    assert "Traceback" not in fail(registry, "checkpoint_restore", checkpoint_id="abcd")  # not registered


def test_a_git_that_hangs_is_ended_at_its_timeout(tmp_path: Path, tree: Path) -> None:
    """A fake git (a script that sleeps: no real git can be made to hang at will) past ``git_timeout``."""
    fake = tmp_path / "hanging-git"
    fake.write_text("#!/bin/sh\nexec sleep 600\n")
    fake.chmod(0o755)
    real = ShadowRepo(tree, tmp_path / "shadow.git")
    real.open()  # the repository exists; only the next git call hangs
    hanging = ShadowRepo(tree, tmp_path / "shadow.git", git=str(fake), git_timeout=0.5)
    with pytest.raises(CheckpointError, match=r"did not finish within 0\.5 s"):
        hanging.snapshot("s1", "x")


def test_bad_session_ids_and_paths_are_refused(tmp_path: Path, tree: Path) -> None:
    shadow = ShadowRepo(tree, tmp_path / "shadow.git")
    for bad in ("", "../x", "a b", "x.lock", "a..b"):
        with pytest.raises(CheckpointError, match="session id"):
            shadow.snapshot(bad, "x")
    with pytest.raises(CheckpointError, match="inside the working tree"):
        shadow.snapshot("s1", "x", files=["../etc/passwd"])
    registry = ToolRegistry()
    with pytest.raises(CheckpointError):
        bind_checkpoints(registry, shadow, "bad id", tmp_path / "l.jsonl")
    assert len(registry) == 0


def test_default_folder_is_one_per_working_tree(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    data = tmp_path / "data"
    assert ShadowRepo.default_folder(a, data) != ShadowRepo.default_folder(b, data)
    assert ShadowRepo.for_work_tree(a, data).git_dir == ShadowRepo.default_folder(a, data) / "shadow.git"
    digest = hashlib.sha256(os.fsencode(a.resolve())).hexdigest()[:16]
    assert ShadowRepo.default_folder(a, data).name == f"a-{digest}"
