"""The session's JSONL journal: one JSON object per line, written before anything acts on what it records.

Write-ahead records of a turn, in the order they happen:

- ``turn_started`` {turn_index, index, message}: the user message, before the turn's first model request;
- ``tool_call`` {turn_index, step, call_id, name, arguments, text, key}: before the call is sent to the
  tool host (``key`` is its idempotency key; ``text`` the assistant text streamed before it);
- ``message_appended`` {index, message}: each message of the turn as it is complete (a tool call's
  assistant message and its result together, when the result arrives; the final answer);
- ``turn_finished`` {turn_index, finish_reason, usage}, or ``turn_failed`` {turn_index, error}: the end of
  the turn, before its caller hears of it. A failed turn keeps only its user message (CV-10).
  ``turn_closed`` {turn_index, reason} ends an interrupted turn that the conversation moved on from without
  continuing it (its unknown-outcome placeholders are journaled just before it).

Other records: ``session`` {conversation_id} (the first line of a new file: the conversation's identity,
part of every idempotency key), ``compaction_boundary`` {trigger, counts, tokens, transcript} (the whole
transcript after the compaction, in the same line, so a crash cannot split it; files written before that
field existed re-append the kept messages after the boundary: CP-06), ``transcript_replaced`` {messages} and
``transcript_truncated`` {length} (``set_transcript`` / ``truncate_transcript``, which emit no events, TR-06).

Goal, wakeup and loop records (loops.py), each fsync'd before anything acts on it: ``goal_set`` {condition,
max_turns, token_budget, loop, goal_id} (``loop`` True when a goal loop set it; each turn of that loop has
``goal: goal_id`` in its ``turn_started``, so a reader counts the loop's turns from the turns themselves: a
crash between a turn's end and its ``goal_turn`` cannot lose one, and a resumed loop never runs past
``max_turns``), ``goal_turn`` {turns, tokens_used} (a goal-loop turn ended: written before the judge is
asked), ``goal_verdict`` {turns, achieved, reason,
impossible}, ``goal_achieved`` {turns, reason}, ``goal_cleared`` {reason}; ``loop_started`` {slot,
initial_goal, jobs} and ``loop_ended`` {slot}; ``wakeup_scheduled`` {slot, due, delay_s, prompt, reason, key}
(``due`` the absolute time on the conversation's clock; ``key`` the idempotency key of the
``schedule_wakeup`` call that set it, or empty), ``wakeup_fired`` {slot, due} (written just before
the wakeup's turn starts: a wakeup counts as consumed only once a ``turn_started`` follows it, so a crash
between the two fires it again, once), ``wakeup_taken`` {slot} (discarded or read out) and
``wakeup_cancelled`` {slot, reason}; ``job_started`` {job_id, command}, ``job_finished`` {job} (the
completion, with its capped output) and ``job_delivered`` {job_id} (written just before the turn that
injects it).

People in the loop (people.py, permissions.py; all fsync'd): ``permission`` {key, decision} (a final
allow/deny for the call with that idempotency key, before the call is sent or its denial shown),
``permission_asked`` {key, request, reason} (an ``ask`` before anyone is asked), ``plan_mode`` {on},
``plan_proposed`` {plan_id, kind, plan} and ``plan_decided`` {plan_id, approved, reason}, ``todos``
{todos, version}. ``Restored.people`` holds what they say; a compaction or a transcript change leaves it.

A reader applies the records in order. A turn with a ``turn_started`` and no end record was interrupted (the
process died): ``Restored.interrupted`` describes it, and the rebuilt transcript holds its user message,
every call with its result, and for each call journaled without a result a tool message saying its outcome
is unknown, so the transcript rule holds (no call without a result). A torn last line (the writer was
killed mid-write) is ignored; a broken line elsewhere is an error.

Durability (``Sync``): every record is flushed to the OS before ``write`` returns. With ``Sync.EFFECTS``
(the default) the records that precede an effect or an answer (``turn_started``, ``tool_call``, the turn's
end, compaction and transcript changes) are also fsync'd, so they survive a machine crash; the others
(``message_appended`` of a tool result, which the tool host's effect store holds durably as well) ride on the
next fsync. ``Sync.ALWAYS`` fsyncs every record; ``Sync.NEVER`` only flushes (a process crash loses nothing,
a power loss may).

Group commit: inside ``with journal.group():`` records are written and flushed as they come, and the fsyncs
they call for are taken together, once, when the outermost group ends. A record written in a group is then
not durable when ``write`` returns: whatever would act on it or tell someone of it goes to
``when_durable(callback)``, which calls it at once outside a group and after the group's fsync inside one
(with the error instead, if that fsync failed). So many records share an fsync, and nothing acts on one, or
answers for it, before it is durable.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from actors.conversation.people import PeopleState
from actors.conversation.types import (
    ChatTokenUsage,
    CompactionBoundary,
    CompletedJob,
    FinishReason,
    GoalState,
    Message,
    MessageAppended,
    MessageToolCall,
    TurnFinished,
    Wakeup,
)
from transport.records import frozen

log = logging.getLogger(__name__)

__all__ = ["InterruptedTurn", "Journal", "PendingCall", "Restored", "Sync", "read_journal", "unknown_outcome"]

FORMAT = 2


class Sync(enum.StrEnum):
    EFFECTS = "effects"
    ALWAYS = "always"
    NEVER = "never"


def unknown_outcome(name: str) -> str:
    """The result the model is shown for a call whose outcome is unknown."""
    return (
        f"outcome unknown: the session stopped while {name} was running, so it may or may not have taken "
        "effect; check before repeating it"
    )


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


Durable = Callable[[BaseException | None], None]  # told None once the records before it are on disk


def _os_fsync(fd: int) -> None:
    os.fsync(fd)  # looked up at each call: a test may patch the module's os.fsync


class Journal:
    """Appends records to the session file (see the module docstring for what is durable when).

    ``fsync`` makes a file's records durable (``os.fsync`` when None; a test passes one it controls)."""

    def __init__(
        self,
        path: Path,
        *,
        truncate: bool = False,
        sync: Sync = Sync.EFFECTS,
        fsync: Callable[[int], None] | None = None,
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.sync = Sync(sync)
        self._fsync = fsync if fsync is not None else _os_fsync
        self._depth = 0  # groups open (nested ones join the outermost)
        self._owed = False  # a record in the open group asked for an fsync
        self._waiting: list[Durable] = []
        self.fsyncs = 0
        if not truncate:
            _mend_tail(path)
        self._file: IO[str] = path.open("w" if truncate else "a", encoding="utf-8")

    def write(self, record: dict[str, Any], *, durable: bool = False) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()
        if self.sync is Sync.ALWAYS or (durable and self.sync is Sync.EFFECTS):
            if self._depth:
                self._owed = True
            else:
                self._sync()

    def _sync(self) -> None:
        self._fsync(self._file.fileno())
        self.fsyncs += 1

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """The fsyncs of the records written inside are one, taken as the outermost group ends; then every
        ``when_durable`` callback queued in it runs (told the error instead if the fsync failed)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._end_group()

    def _end_group(self) -> None:
        waiting, owed = self._waiting, self._owed
        self._waiting, self._owed = [], False
        failure: BaseException | None = None
        try:
            if owed or (waiting and self.sync is not Sync.NEVER):
                self._sync()
        except BaseException as exc:
            failure = exc
            raise
        finally:
            for callback in waiting:
                callback(failure)

    def when_durable(self, callback: Durable) -> None:
        """``callback(None)`` once every record written so far is durable: at once outside a group, after
        the group's fsync inside one (``callback(error)`` if that fsync failed)."""
        if self._depth:
            self._waiting.append(callback)
        else:
            callback(None)

    @property
    def in_group(self) -> bool:
        return self._depth > 0

    def event(self, event: Any) -> None:
        record = record_of(event)
        if record is not None:
            self.write(record, durable=not isinstance(event, MessageAppended))

    # ------------------------------------------------------------------------------ named records
    def session(self, conversation_id: str) -> None:
        self.write({"type": "session", "format": FORMAT, "conversation_id": conversation_id}, durable=True)

    def turn_started(self, turn_index: int, index: int, message: Message, *, goal: str | None = None) -> None:
        """``goal``: the id of the goal loop this turn belongs to (its ``goal_set``): a resume counts it."""
        record: dict[str, Any] = {
            "type": "turn_started",
            "turn_index": turn_index,
            "index": index,
            "message": message.to_json(),
        }
        if goal is not None:
            record["goal"] = goal
        self.write(record, durable=True)

    def tool_call(self, turn_index: int, step: int, call: PendingCall) -> None:
        self.write(
            {
                "type": "tool_call",
                "turn_index": turn_index,
                "step": step,
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
                "text": call.text,
                "key": call.key,
            },
            durable=True,
        )

    def appended(self, index: int, message: Message, *, durable: bool = False) -> None:
        self.write(
            {"type": "message_appended", "index": index, "message": message.to_json()}, durable=durable
        )

    def finished(self, turn_index: int, reason: FinishReason, usage: ChatTokenUsage) -> None:
        self.event(TurnFinished(turn_index=turn_index, finish_reason=reason, usage=usage))

    def closed(self, turn_index: int, reason: str) -> None:
        """An interrupted turn the conversation moved on from: its messages stay as they are."""
        self.write({"type": "turn_closed", "turn_index": turn_index, "reason": reason}, durable=True)

    def failed(self, turn_index: int, error: str, kept: int | None = None) -> None:
        """``kept``: the transcript length the failed turn leaves (default: up to its user message)."""
        record: dict[str, Any] = {"type": "turn_failed", "turn_index": turn_index, "error": error}
        if kept is not None:
            record["kept"] = kept
        self.write(record, durable=True)

    def compacted(self, boundary: CompactionBoundary, transcript: list[Message]) -> None:
        record = record_of(boundary)
        assert record is not None
        record["transcript"] = [m.to_json() for m in transcript]
        self.write(record, durable=True)

    def replaced(self, messages: tuple[Message, ...]) -> None:
        self.write({"type": "transcript_replaced", "messages": [m.to_json() for m in messages]}, durable=True)

    def truncated(self, length: int) -> None:
        self.write({"type": "transcript_truncated", "length": length}, durable=True)

    def loop_record(self, kind: str, **fields: Any) -> None:
        """A goal, wakeup, loop or job record (see the module docstring): always durable."""
        self.write({"type": kind, **fields}, durable=True)

    def people(self, record_type: str, **fields: Any) -> None:
        """A permission, plan or todo record (see the module docstring), durable before it is acted on."""
        assert record_type in PeopleState.RECORDS, record_type
        self.write({"type": record_type, **fields}, durable=True)

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


@frozen
class PendingCall:
    """A tool call journaled before it was sent: enough to ask its host again by the same key."""

    key: str
    call_id: str
    name: str
    arguments: str  # the JSON text of the arguments, as the model gave them
    text: str = ""  # the assistant text streamed before the call


@frozen
class InterruptedTurn:
    """A turn that started and has no end record: the process stopped during it.

    ``user_at`` is its user message's index; ``steps`` the tool calls it had made; ``pending`` the calls
    journaled without a result (shown in ``Restored.transcript`` with an unknown-outcome result); ``length``
    the transcript length before those placeholders (what a continuation truncates back to)."""

    turn_index: int
    user_at: int
    steps: int
    pending: tuple[PendingCall, ...]
    length: int


@frozen
class Restored:
    transcript: tuple[Message, ...]
    turn_index: int  # turns started so far (the next turn's index; CV-05)
    records: int
    boundaries: int
    conversation_id: str | None = None
    interrupted: InterruptedTurn | None = None
    loops: LoopsRestored = field(default_factory=lambda: LoopsRestored())
    people: PeopleState = field(default_factory=PeopleState)  # permissions, plans, plan mode, todos


@frozen
class LoopsRestored:
    """The goal, wakeup and job state a session file describes.

    ``goal_loop``: the goal was set by a goal loop that has not ended (``goal_id`` its id); ``goal_phase``
    what that loop does next ("turn": a turn, with the auto-prompt of ``goal_reason`` when it has one;
    "evaluate": check the budget, then ask the judge about the turn it counted last). ``loop``: (slot,
    initial_goal, jobs) of a wakeup/event loop that has not ended; ``slots`` each slot's pending wakeup;
    ``jobs_running`` jobs started and not finished (job id -> runner address); ``undelivered`` the finished
    jobs no turn has injected yet, in completion order."""

    goal: GoalState | None = None
    goal_loop: bool = False
    goal_id: str | None = None
    goal_phase: str = "turn"
    goal_reason: str | None = None
    loop: tuple[str, str, str | None] | None = None
    slots: dict[str, Wakeup] = field(default_factory=dict)
    slot_keys: dict[str, str] = field(default_factory=dict)  # the key of the call that set each slot
    jobs_running: dict[str, str] = field(default_factory=dict)
    undelivered: tuple[CompletedJob, ...] = ()


def placeholders(pending: tuple[PendingCall, ...]) -> list[Message]:
    """The messages that stand for calls whose outcome is unknown: each call and an unknown result."""
    messages: list[Message] = []
    for call in pending:
        messages.append(
            Message.assistant(
                call.text, (MessageToolCall(id=call.call_id, name=call.name, arguments=call.arguments),)
            )
        )
        messages.append(Message.tool(call.call_id, unknown_outcome(call.name), is_error=True))
    return messages


@dataclass
class _Open:
    turn_index: int
    user_at: int
    steps: int = 0
    calls: dict[str, PendingCall] = field(default_factory=dict)  # call id -> journaled, no result yet


def read_journal(path: Path) -> Restored:
    """The transcript, turn count and interrupted turn a session file describes (see the module docstring)."""
    transcript: list[Message] = []
    turn_index = 0
    records = boundaries = 0
    conversation_id: str | None = None
    open_turn: _Open | None = None
    lp = _LoopsReader()
    people = PeopleState()
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
        try:
            if kind == "session":
                conversation_id = str(record["conversation_id"])
            elif kind == "turn_started":
                index = int(record["index"])
                del transcript[index:]
                transcript.append(Message.from_json(record["message"]))
                turn_index = int(record["turn_index"]) + 1
                open_turn = _Open(int(record["turn_index"]), index)
                lp.turn_started(int(record["turn_index"]), record.get("goal"))
            elif kind == "tool_call":
                if open_turn is not None:
                    open_turn.steps = max(open_turn.steps, int(record["step"]))
                    call = PendingCall(
                        key=str(record["key"]),
                        call_id=str(record["call_id"]),
                        name=str(record["name"]),
                        arguments=str(record["arguments"]),
                        text=str(record.get("text", "")),
                    )
                    open_turn.calls[call.call_id] = call
            elif kind == "message_appended":
                index = int(record["index"])
                del transcript[index:]
                message = Message.from_json(record["message"])
                transcript.append(message)
                if open_turn is not None and message.role == "tool" and message.tool_call_id is not None:
                    open_turn.calls.pop(message.tool_call_id, None)
            elif kind in ("turn_finished", "turn_failed", "turn_closed"):
                ended = int(record["turn_index"])
                lp.turn_ended(kind, ended, record)
                turn_index = max(turn_index, ended + 1)
                if kind == "turn_failed" and open_turn is not None and open_turn.turn_index == ended:
                    # CV-10: only the user message stays (and what a continuation had settled: "kept")
                    del transcript[max(open_turn.user_at + 1, int(record.get("kept", 0))) :]
                open_turn = None
            elif kind == "compaction_boundary":
                boundaries += 1
                open_turn = None
                transcript = [Message.from_json(m) for m in record.get("transcript", ())]
            elif kind == "transcript_replaced":
                open_turn = None
                transcript = [Message.from_json(m) for m in record["messages"]]
            elif kind == "transcript_truncated":
                del transcript[int(record["length"]) :]
            elif kind in _LOOP_KINDS:
                lp.apply(kind, record)
            elif kind in PeopleState.RECORDS:
                people.apply(record)
            else:
                log.warning("%s:%d: unknown record type %r skipped", path, n, kind)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{n}: a {kind} record is malformed: {exc}") from None
    interrupted = None
    if open_turn is not None:
        pending = tuple(open_turn.calls.values())
        interrupted = InterruptedTurn(
            open_turn.turn_index, open_turn.user_at, open_turn.steps, pending, len(transcript)
        )
        transcript.extend(placeholders(pending))
    return Restored(
        tuple(transcript),
        turn_index,
        records,
        boundaries,
        conversation_id,
        interrupted,
        lp.restored(),
        people,
    )


_LOOP_KINDS = frozenset(
    {
        "goal_set",
        "goal_turn",
        "goal_verdict",
        "goal_achieved",
        "goal_cleared",
        "loop_started",
        "loop_ended",
        "wakeup_scheduled",
        "wakeup_fired",
        "wakeup_taken",
        "wakeup_cancelled",
        "job_started",
        "job_finished",
        "job_delivered",
    }
)


def job_to_json(job: CompletedJob) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "command": job.command,
        "exit_code": job.exit_code,
        "output": job.output,
        "completed_at_ms": job.completed_at_ms,
        "output_size": job.output_size,
        "lost": job.lost,
    }


def job_from_json(row: dict[str, Any]) -> CompletedJob:
    code = row.get("exit_code")
    return CompletedJob(
        job_id=str(row["job_id"]),
        command=str(row["command"]),
        exit_code=None if code is None else int(code),
        output=str(row.get("output", "")),
        completed_at_ms=int(row.get("completed_at_ms", 0)),
        output_size=int(row.get("output_size", 0)),
        lost=bool(row.get("lost", False)),
    )


class _LoopsReader:
    def __init__(self) -> None:
        self.goal: GoalState | None = None
        self.goal_loop = False
        self.phase = "turn"
        self.reason: str | None = None
        self.loop: tuple[str, str, str | None] | None = None
        self.slots: dict[str, Wakeup] = {}
        self.slot_keys: dict[str, str] = {}
        self.firing: set[str] = set()
        self.running: dict[str, str] = {}
        self.finished: dict[str, CompletedJob] = {}
        self.goal_id: str | None = None
        self.goal_turn: int | None = None  # the goal loop's turn started last, until its verdict
        self.before_turn: tuple[str, str | None] = ("turn", None)  # the phase that turn started from

    def turn_started(self, turn_index: int, goal: object) -> None:
        for slot in self.firing:  # the wakeup's turn started: it is consumed
            self.slots.pop(slot, None)
        self.firing.clear()
        g = self.goal
        if g is not None and self.goal_loop and goal is not None and goal == self.goal_id:
            # a turn of the goal loop counts once started (also one the process died in), like CV-05
            self.goal = replace(g, turns=g.turns + 1)
            self.goal_turn, self.before_turn = turn_index, (self.phase, self.reason)
            self.phase = "evaluate"

    def turn_ended(self, kind: str, turn_index: int, r: dict[str, Any]) -> None:
        g = self.goal
        if g is None or self.goal_turn != turn_index:
            return
        if kind == "turn_failed":  # GL-14: a failed turn is not counted; the loop raised
            self.goal = replace(g, turns=g.turns - 1)
            self.phase, self.reason = self.before_turn
            self.goal_turn = None
        elif kind == "turn_finished":
            if r.get("finish_reason") == str(FinishReason.CANCELLED):  # GL-15 ends the loop
                self.goal, self.goal_loop, self.phase, self.reason = None, False, "turn", None
                self.goal_turn = None
                return
            usage = r.get("usage")
            total = int(usage.get("total_tokens", 0)) if isinstance(usage, dict) else 0
            self.goal = replace(g, tokens_used=g.tokens_used + total)

    def apply(self, kind: str, r: dict[str, Any]) -> None:
        g = self.goal
        if kind == "goal_set":
            budget = r.get("token_budget")
            self.goal = GoalState(
                condition=str(r["condition"]),
                max_turns=int(r["max_turns"]),
                token_budget=None if budget is None else int(budget),
            )
            self.goal_loop, self.phase, self.reason = bool(r.get("loop", False)), "turn", None
            goal_id = r.get("goal_id")
            self.goal_id, self.goal_turn = (None if goal_id is None else str(goal_id)), None
        elif kind == "goal_turn" and g is not None:
            # the loop's own count; a file written before turns were tagged has only this one
            self.goal = replace(
                g,
                turns=max(g.turns, int(r["turns"])),
                tokens_used=max(g.tokens_used, int(r.get("tokens_used", 0))),
            )
            self.phase = "evaluate"
        elif kind == "goal_verdict":
            self.phase, self.reason = "turn", str(r.get("reason", ""))
            self.goal_turn = None
        elif kind in ("goal_achieved", "goal_cleared"):
            self.goal, self.goal_loop, self.phase, self.reason = None, False, "turn", None
            self.goal_turn = None
        elif kind == "loop_started":
            jobs = r.get("jobs")
            self.loop = (str(r["slot"]), str(r["initial_goal"]), None if jobs is None else str(jobs))
        elif kind == "loop_ended":
            self.loop = None
        elif kind == "wakeup_scheduled":
            prompt = r.get("prompt")
            self.slots[str(r["slot"])] = Wakeup(
                delay_s=float(r["delay_s"]),
                prompt=None if prompt is None else str(prompt),
                reason=str(r.get("reason", "")),
                due=float(r["due"]),
            )
            self.firing.discard(str(r["slot"]))
            self.slot_keys[str(r["slot"])] = str(r.get("key", ""))
        elif kind == "wakeup_fired":
            self.firing.add(str(r["slot"]))
        elif kind in ("wakeup_taken", "wakeup_cancelled"):
            self.slots.pop(str(r["slot"]), None)
            self.firing.discard(str(r["slot"]))
        elif kind == "job_started":
            self.running[str(r["job_id"])] = str(r.get("runner", ""))  # asked again on resume
        elif kind == "job_finished":
            job = job_from_json(r["job"])
            self.running.pop(job.job_id, None)
            self.finished[job.job_id] = job
        elif kind == "job_delivered":
            self.finished.pop(str(r["job_id"]), None)

    def restored(self) -> LoopsRestored:
        return LoopsRestored(
            goal=self.goal,
            goal_loop=self.goal_loop and self.goal is not None,
            goal_id=self.goal_id if self.goal is not None else None,
            goal_phase=self.phase,
            goal_reason=self.reason,
            loop=self.loop,
            slots=dict(self.slots),
            slot_keys={s: k for s, k in self.slot_keys.items() if s in self.slots},
            jobs_running=dict(self.running),
            undelivered=tuple(self.finished.values()),
        )


def new_conversation_id() -> str:
    return str(uuid.uuid4())
