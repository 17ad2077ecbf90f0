"""The session's JSONL file: one JSON object per line, written and flushed as each event happens.

Records: ``message_appended`` {index, message}, ``turn_finished`` {turn_index, finish_reason, usage},
``compaction_boundary`` {trigger, counts, tokens} and, for ``set_transcript`` / ``truncate_transcript`` (which
emit no events, TR-06), ``transcript_replaced`` {messages} and ``transcript_truncated`` {length}; a turn that
raised leaves ``turn_failed`` {turn_index, error} (it counts as a turn, CV-05).

A reader rebuilds the transcript by applying the records in order; at a ``compaction_boundary`` it starts
over (what follows re-appends the summary and every kept message: CP-06). A torn last line (the writer was
killed mid-write) is ignored.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from actors.conversation.types import (
    CompactionBoundary,
    Message,
    MessageAppended,
    TurnFinished,
)

log = logging.getLogger(__name__)

__all__ = ["Journal", "Restored", "read_journal"]


def record_of(event: Any) -> dict[str, Any] | None:
    match event:
        case MessageAppended(message=message, index=index):
            return {"type": "message_appended", "index": index, "message": message.to_json()}
        case TurnFinished(turn_index=turn_index, finish_reason=reason, usage=usage):
            return {
                "type": "turn_finished",
                "turn_index": turn_index,
                "finish_reason": str(reason),
                "usage": usage.to_json(),
            }
        case CompactionBoundary():
            return {
                "type": "compaction_boundary",
                "trigger": event.trigger,
                "summarized_count": event.summarized_count,
                "kept_count": event.kept_count,
                "prompt_tokens": event.prompt_tokens,
                "cache_hit_tokens": event.cache_hit_tokens,
                "cache_miss_tokens": event.cache_miss_tokens,
            }
    return None


class Journal:
    """Appends records to the session file; every record is flushed before ``write`` returns."""

    def __init__(self, path: Path, *, truncate: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if not truncate:
            _mend_tail(path)
        self._file: IO[str] = path.open("w" if truncate else "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()

    def event(self, event: Any) -> None:
        record = record_of(event)
        if record is not None:
            self.write(record)

    def replaced(self, messages: tuple[Message, ...]) -> None:
        self.write({"type": "transcript_replaced", "messages": [m.to_json() for m in messages]})

    def failed(self, turn_index: int, error: str) -> None:
        self.write({"type": "turn_failed", "turn_index": turn_index, "error": error})

    def truncated(self, length: int) -> None:
        self.write({"type": "transcript_truncated", "length": length})

    def close(self) -> None:
        self._file.close()


def _mend_tail(path: Path) -> None:
    """Before appending: a last line without its newline (the writer was killed mid-write) would have the next
    record glued onto it, turning a torn last line, which a reader skips, into a broken middle line, which it
    refuses. A complete record gets its newline; a torn one is cut off (a reader ignores it anyway)."""
    try:
        with path.open("rb+") as f:
            data = f.read()
            if not data or data.endswith(b"\n"):
                return
            cut = data.rfind(b"\n") + 1
            try:
                json.loads(data[cut:])["type"]
            except (ValueError, KeyError, TypeError):
                log.warning("%s: cutting off a torn last line before appending", path)
                f.truncate(cut)
            else:
                f.write(b"\n")
    except FileNotFoundError:
        return


@dataclass(frozen=True, slots=True)
class Restored:
    transcript: tuple[Message, ...]
    turn_index: int  # turns finished so far (the next turn's index)
    records: int
    boundaries: int


def read_journal(path: Path) -> Restored:
    """The transcript and turn count a session file describes (see the module docstring)."""
    transcript: list[Message] = []
    turn_index = 0
    records = boundaries = 0
    lines = path.read_text(encoding="utf-8").split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            kind = record["type"]
        except (ValueError, KeyError, TypeError):
            if n >= len(lines) - 1:
                log.warning("%s: ignoring a torn last line", path)
                break
            raise ValueError(f"{path}:{n}: not a session record") from None
        records += 1
        if kind == "message_appended":
            index = int(record["index"])
            del transcript[index:]
            transcript.append(Message.from_json(record["message"]))
        elif kind in ("turn_finished", "turn_failed"):
            turn_index = int(record["turn_index"]) + 1
        elif kind == "compaction_boundary":
            boundaries += 1
            transcript.clear()
        elif kind == "transcript_replaced":
            transcript = [Message.from_json(m) for m in record["messages"]]
        elif kind == "transcript_truncated":
            del transcript[int(record["length"]) :]
        else:
            log.warning("%s:%d: unknown record type %r skipped", path, n, kind)
    return Restored(tuple(transcript), turn_index, records, boundaries)
