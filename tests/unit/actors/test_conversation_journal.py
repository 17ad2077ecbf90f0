"""The session JSONL (actors/conversation/journal.py): records flushed as written; a reader rebuilds the
transcript, starts over at a compaction boundary, and ignores a torn last line."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.conversation import (
    ChatTokenUsage,
    CompactionBoundary,
    FinishReason,
    Message,
    MessageAppended,
    TurnFinished,
    read_journal,
)
from actors.conversation.journal import Journal


def test_each_record_is_on_disk_when_write_returns(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    journal = Journal(path)
    journal.event(MessageAppended(message=Message.user("hi"), index=0))
    assert read_journal(path).transcript == (Message.user("hi"),)  # flushed, the file still open
    journal.event(TurnFinished(turn_index=0, finish_reason=FinishReason.STOP, usage=ChatTokenUsage()))
    assert read_journal(path).turn_index == 1
    journal.close()


def test_a_boundary_skips_what_was_compacted_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    journal = Journal(path)
    old = [Message.user("a"), Message.assistant("b"), Message.user("c"), Message.assistant("d")]
    for i, m in enumerate(old):
        journal.event(MessageAppended(message=m, index=i))
    journal.event(CompactionBoundary(trigger="manual", summarized_count=2, kept_count=2))
    summary = Message.system("Summary: a, b")
    for i, m in enumerate([summary, *old[2:]]):
        journal.event(MessageAppended(message=m, index=i))
    journal.event(MessageAppended(message=Message.user("e"), index=3))
    journal.truncated(4)
    journal.close()
    restored = read_journal(path)
    assert restored.transcript == (summary, *old[2:], Message.user("e"))
    assert restored.boundaries == 1


def test_set_transcript_and_truncate_records(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    journal = Journal(path)
    journal.replaced((Message.user("x"), Message.user("y"), Message.user("z")))
    journal.truncated(1)
    journal.close()
    assert read_journal(path).transcript == (Message.user("x"),)


def test_a_torn_last_line_is_ignored_and_a_bad_middle_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    journal = Journal(path)
    journal.event(MessageAppended(message=Message.user("kept"), index=0))
    journal.close()
    with path.open("a") as f:
        f.write('{"type": "message_appended", "ind')  # the writer died mid-line
    assert read_journal(path).transcript == (Message.user("kept"),)
    with path.open("a") as f:
        f.write("\n" + '{"type":"message_appended","index":1,"message":{"role":"user","content":"z"}}\n')
    with pytest.raises(ValueError, match="not a session record"):
        read_journal(path)


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ('{"type": "message_appended", "ind', ("kept", "after")),  # torn: cut off
        (
            '{"type":"message_appended","index":1,"message":{"role":"user","content":"whole"}}',
            ("kept", "whole", "after"),
        ),
    ],
    ids=["torn-record", "record-without-newline"],
)
def test_appending_after_a_crash_keeps_the_file_readable(
    tmp_path: Path, tail: str, expected: tuple[str, ...]
) -> None:
    """A resumed session appends to a file whose writer died mid-record: the next record must not be glued
    onto the unfinished line (that would make a later resume refuse the file), and a complete last record
    that only lacks its newline is kept."""
    path = tmp_path / "s.jsonl"
    journal = Journal(path)
    journal.event(MessageAppended(message=Message.user("kept"), index=0))
    journal.close()
    with path.open("a") as f:
        f.write(tail)  # the writer died before the newline
    resumed = Journal(path)
    index = len(read_journal(path).transcript)
    resumed.event(MessageAppended(message=Message.user("after"), index=index))
    resumed.event(MessageAppended(message=Message.user("more"), index=index + 1))
    resumed.close()
    assert tuple(m.content for m in read_journal(path).transcript) == (*expected, "more")


def test_resume_false_starts_a_fresh_file(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    first = Journal(path)
    first.replaced((Message.user("old"),))
    first.close()
    Journal(path, truncate=True).close()
    assert read_journal(path).transcript == ()


@pytest.mark.parametrize(
    ("sync", "expected"),
    [("effects", ["turn_started", "tool_call", "turn_finished"]), ("always", None), ("never", [])],
)
def test_the_sync_policy_fsyncs_the_records_that_precede_an_effect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: str, expected: list[str] | None
) -> None:
    """Sync.EFFECTS (the default) fsyncs the user message, each tool call and the turn's end, not a tool
    result (the tool host's effect store holds it durably too); ALWAYS fsyncs every record, NEVER none."""
    from actors.conversation.journal import PendingCall, Sync

    path = tmp_path / "s.jsonl"
    journal = Journal(path, sync=Sync(sync))
    synced: list[str] = []

    def fsync(fd: int) -> None:
        synced.append(path.read_text().splitlines()[-1].split('"type":"')[1].split('"')[0])

    monkeypatch.setattr("actors.conversation.journal.os.fsync", fsync)
    journal.turn_started(0, 0, Message.user("hi"))
    journal.tool_call(0, 1, PendingCall("k", "c1", "add", "{}"))
    journal.appended(1, Message.tool("c1", "2"))
    journal.finished(0, FinishReason.STOP, ChatTokenUsage())
    journal.close()
    kinds = ["turn_started", "tool_call", "message_appended", "turn_finished"]
    assert synced == (kinds if expected is None else expected)
