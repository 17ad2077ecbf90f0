"""The runtime's checkpoint API (RULES.md 9.9 CK-01..07, CV-04) over the real Router (scripted provider), a
real ToolHostActor and the real git binary: ``enable_checkpoints``, ``checkpoints_enabled``, the tools the
model calls, and ``restore_checkpoint`` telling the model what was restored."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from peers.conversation_kit import WAIT, call, text

from actors.app.builtin_tools import register_workspace_tools
from actors.app.wiring import registry
from actors.conversation import ConversationError, ConversationRuntime, Message, ToolRegistry, read_journal
from actors.conversation.checkpoints import CHECKPOINT_TOOLS, RESTORE_TOOL, TouchedFiles
from actors.conversation.shadow import ShadowRepo
from actors.router.actor import RouterActor
from actors.router.catalog import ModelCatalog
from actors.router.providers.scripted import ScriptedProvider
from transport.node import Node

CATALOG = ModelCatalog.from_mapping(
    {
        "providers": {"p1": {"kind": "scripted"}},
        "models": {
            "m1": {
                "provider": "p1",
                "provider_model": "p1",
                "context_window": 32768,
                "max_input_tokens": 30000,
            }
        },
    }
)


class Env:
    def __init__(self, node: Node, tmp: Path) -> None:
        self.node = node
        self.tmp = tmp
        self.provider = ScriptedProvider()
        node.spawn(
            RouterActor, "router", catalog=CATALOG, data_dir=tmp / "router", providers={"p1": self.provider}
        )
        self.work = tmp / "work"
        self.work.mkdir()
        self.shadow = ShadowRepo(self.work, tmp / "data" / "shadow.git")
        self.touched = TouchedFiles()
        self.tools = ToolRegistry()
        register_workspace_tools(self.tools, self.work, touched=self.touched)
        self.built: list[ConversationRuntime] = []

    def build(self, tools: ToolRegistry | None = None, **options: Any) -> ConversationRuntime:
        b = (
            ConversationRuntime.builder()
            .node(self.node)
            .llm("m1")
            .tools(tools if tools is not None else self.tools)
            .timeout(WAIT)
        )
        for key, value in options.items():
            getattr(b, key)(value)
        rt = b.build()
        self.built.append(rt)
        return rt

    def script(self, *steps: dict[str, Any]) -> None:
        self.provider.add(list(steps))

    def commits(self, session: str) -> int:
        if not (self.shadow.git_dir / "config").is_file():
            return 0
        return len(self.shadow.list(session))


@pytest.fixture
def env(make_node: Callable[..., Node], tmp_path: Path) -> Iterator[Env]:
    e = Env(make_node("n1", registry=registry()), tmp_path)
    yield e
    for rt in e.built:
        rt.stop()


def test_ck01_checkpoints_enabled_is_false_until_enable_succeeds(env: Env) -> None:
    rt = env.build()
    assert rt.checkpoints_enabled() is False
    rt.enable_checkpoints(env.shadow, "s1", env.tmp / "s1.jsonl")
    assert rt.checkpoints_enabled() is True


def test_ck02_enable_registers_exactly_the_three_tools(env: Env) -> None:
    before = set(env.tools.names())
    rt = env.build()
    rt.enable_checkpoints(env.shadow, "s1", env.tmp / "s1.jsonl")
    assert set(env.tools.names()) - before == set(CHECKPOINT_TOOLS)
    assert before <= set(env.tools.names())


def test_ck02_the_restore_tool_comes_only_when_asked_and_is_mutating(env: Env) -> None:
    rt = env.build()
    rt.enable_checkpoints(env.shadow, "s1", env.tmp / "s1.jsonl", restore_tool=True)
    assert RESTORE_TOOL in env.tools.names() and env.tools.is_mutating(RESTORE_TOOL)


def test_ck03_cv04_turns_never_checkpoint_only_checkpoint_save_does(env: Env) -> None:
    """CK-03/CV-04: three turns (one writing a file) make no checkpoint and checkpoint_id stays None; a turn
    that calls checkpoint_save makes exactly one, on the session's chain."""
    rt = env.build()
    rt.enable_checkpoints(env.shadow, "s1", env.tmp / "s1.jsonl")
    env.script(call("write_file", "c1", path="a.txt", content="A\n"), text("wrote it"))
    outcomes = [rt.run("write a.txt"), rt.run("hello"), rt.run("again")]
    assert all(o.checkpoint_id is None for o in outcomes)
    assert env.commits("s1") == 0
    env.script(call("checkpoint_save", "c2", message="after a.txt"), text("saved"))
    outcome = rt.run("save a checkpoint")
    assert outcome.checkpoint_id is None
    [checkpoint] = env.shadow.list("s1")
    assert checkpoint.session_id == "s1" and checkpoint.label == "after a.txt"
    assert checkpoint.files == ("a.txt",)  # the TouchedFiles was not given: the whole tree


def test_ck04_two_runtimes_on_one_shadow_see_only_their_own_session(env: Env) -> None:
    r1, r2 = ToolRegistry(), ToolRegistry()
    rt1, rt2 = env.build(r1), env.build(r2)
    rt1.enable_checkpoints(env.shadow, "s1", env.tmp / "s1.jsonl")
    rt2.enable_checkpoints(env.shadow, "s2", env.tmp / "s2.jsonl")
    env.script(call("checkpoint_save", "c1", message="one of s1"), text("ok"))
    rt1.run("save")
    env.script(call("checkpoint_save", "c2", message="one of s2"), text("ok"))
    rt2.run("save")
    env.script(call("checkpoint_list", "c3"), text("listed"))
    rt1.run("list")
    listing = rt1.transcript()[-2].content
    assert "one of s1" in listing and "one of s2" not in listing


def test_ck05_a_failed_enable_registers_nothing_and_leaves_the_flag_false(env: Env) -> None:
    blocker = env.tmp / "not-a-folder"
    blocker.write_text("a file where the log's folder should be")
    before = sorted(env.tools.names())
    rt = env.build()
    with pytest.raises(ConversationError, match="cannot append to the checkpoint log"):
        rt.enable_checkpoints(env.shadow, "s1", blocker / "s1.jsonl")
    assert sorted(env.tools.names()) == before
    assert rt.checkpoints_enabled() is False
    with pytest.raises(ConversationError, match="session id"):
        rt.enable_checkpoints(env.shadow, "no spaces allowed", env.tmp / "s1.jsonl")
    assert sorted(env.tools.names()) == before and rt.checkpoints_enabled() is False


def test_ck06_enabling_again_replaces_the_binding(env: Env) -> None:
    rt = env.build()
    rt.enable_checkpoints(env.shadow, "first", env.tmp / "first.jsonl", restore_tool=True)
    rt.enable_checkpoints(env.shadow, "second", env.tmp / "second.jsonl")
    names = env.tools.names()
    assert all(names.count(n) == 1 for n in CHECKPOINT_TOOLS) and RESTORE_TOOL not in names
    env.script(call("checkpoint_save", "c1", message="where"), text("ok"))
    rt.run("save")
    assert env.commits("second") == 1 and env.commits("first") == 0
    assert not (env.tmp / "first.jsonl").read_text()
    assert len((env.tmp / "second.jsonl").read_text().splitlines()) == 1


def test_ck07_with_touched_files_a_save_covers_what_the_tools_wrote(env: Env) -> None:
    (env.work / "other.txt").write_text("written by someone else\n")
    rt = env.build()
    rt.enable_checkpoints(env.shadow, "s1", env.tmp / "s1.jsonl", env.touched)
    env.script(
        call("write_file", "c1", path="a.py", content="a = 1\n"),
        call("checkpoint_save", "c2", message="a only"),
        text("done"),
    )
    rt.run("write and save", timeout=WAIT)
    [checkpoint] = env.shadow.list("s1")
    assert checkpoint.files == ("a.py",)
    record = json.loads((env.tmp / "s1.jsonl").read_text())
    assert record["files"] == ["a.py"] and record["scope"] == "touched files"
    assert len(env.touched) == 0


def test_a_touched_set_from_another_process_is_refused(env: Env) -> None:
    rt = env.build()
    stranger = TouchedFiles()
    slot = stranger.slot_id
    del stranger  # gone from this process's table: the host cannot find it
    fake = TouchedFiles()
    fake.slot_id = slot
    with pytest.raises(ConversationError, match="not in the tool host's process"):
        rt.enable_checkpoints(env.shadow, "s1", env.tmp / "s1.jsonl", fake)
    assert rt.checkpoints_enabled() is False


def test_restore_checkpoint_tells_the_model_exactly_what_was_restored(env: Env) -> None:
    """The runtime method restores, and the transcript (and the session file) gets a system message naming
    what changed; the model sees it in its next request."""
    session_file = env.tmp / "chat.jsonl"
    rt = env.build(session_file=session_file)
    rt.enable_checkpoints(env.shadow, "s1", env.tmp / "s1.jsonl")
    (env.work / "keep.txt").write_text("good\n")
    env.script(call("checkpoint_save", "c1", message="good"), text("saved"))
    rt.run("save")
    checkpoint = env.shadow.list("s1")[0].checkpoint_id
    env.script(call("run_command", "c2", command="echo bad > keep.txt; echo new > new.txt"), text("broke it"))
    rt.run("break it")
    report = rt.restore_checkpoint(checkpoint[:12])
    assert report.written == ("keep.txt",) and report.removed == ("new.txt",)
    assert (env.work / "keep.txt").read_text() == "good\n" and not (env.work / "new.txt").exists()
    told = rt.transcript()[-1]
    assert told == Message.system(report.text)
    assert "Written back (1): keep.txt." in told.content and "(1): new.txt." in told.content
    env.script(text("noted"))
    rt.run("what happened?")
    assert report.text in env.provider.turns[-1].messages[-1].content
    assert Message.system(report.text) in read_journal(session_file).transcript


def test_restore_without_checkpoints_enabled_is_a_clear_error(env: Env) -> None:
    rt = env.build()
    with pytest.raises(ConversationError, match="checkpoints are not enabled"):
        rt.restore_checkpoint("abcd")
    assert rt.transcript() == ()


def test_the_users_git_status_is_unchanged_by_a_session_with_checkpoints(env: Env) -> None:
    """Across the bus too: a turn that saves in a real repository leaves its status as it was."""
    git = ["git", "--no-optional-locks", "-c", "user.name=u", "-c", "user.email=u@example.invalid"]
    subprocess.run([*git, "init", "-q"], cwd=env.work, check=True, timeout=60)
    (env.work / "f.txt").write_text("f\n")
    status = subprocess.run(
        [*git, "status", "--porcelain"], cwd=env.work, capture_output=True, timeout=60
    ).stdout
    rt = env.build()
    rt.enable_checkpoints(env.shadow, "s1", env.tmp / "s1.jsonl")
    env.script(call("checkpoint_save", "c1", message="x"), text("ok"))
    rt.run("save")
    after = subprocess.run(
        [*git, "status", "--porcelain"], cwd=env.work, capture_output=True, timeout=60
    ).stdout
    assert after == status and env.commits("s1") == 1
