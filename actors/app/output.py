"""What a turn shows (``actors.app.chat``): the spinner (``Progress``, a terminal only), the tool lines and
the answer as it streams (``TurnPrinter``; ``--json``: one object per event), and the loops' event lines."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, TextIO


# --------------------------------------------------------------------------------------------- progress
class Progress:
    """A spinner on stderr while the model loads or thinks; nothing when stderr is not a terminal."""

    FRAMES = "|/-\\"

    def __init__(self, stream: TextIO, *, quiet: bool = False) -> None:
        self.stream = stream
        self.quiet = quiet
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, label: str) -> None:
        self.stop()
        self._stop = threading.Event()
        if self.quiet or not self.stream.isatty():  # a script reading stderr gets no progress noise
            return
        stop, stream, started = self._stop, self.stream, time.monotonic()

        def spin() -> None:
            i = 0
            while not stop.wait(0.1):
                stream.write(f"\r{self.FRAMES[i % 4]} {label} ({time.monotonic() - started:.0f} s)")
                stream.flush()
                i += 1
            stream.write("\r\033[K")
            stream.flush()

        self._thread = threading.Thread(target=spin, name="kbus-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(2.0)


# ----------------------------------------------------------------------------------------------- events
def use_colour(stream: TextIO, env: Mapping[str, str] = os.environ) -> bool:
    """Colour only on a terminal, and never with ``NO_COLOR`` set (https://no-color.org) or TERM=dumb."""
    return stream.isatty() and not env.get("NO_COLOR") and env.get("TERM") != "dumb"


class TurnPrinter:
    """The conversation's event sink: streams text, shows tool calls and results, notes the turn's end.

    ``mode``: ``"text"`` (the answer on ``out``, tool lines on ``err``), ``"quiet"`` (the answer alone) or
    ``"json"`` (one JSON object per event on ``out``: ``text``, ``tool_call``, ``tool_result``, ``done``).

    ``emit`` runs on the sink actor's thread; the main thread reads what it recorded only after
    ``TurnFinished`` (``finished`` is set), so the two never write at the same time.
    """

    SHOWN_LINES = 12
    SHOWN_CHARS = 600

    def __init__(
        self,
        out: TextIO,
        progress: Progress,
        *,
        err: TextIO | None = None,
        mode: str = "text",
        colour: bool = False,
    ) -> None:
        self.out = out
        self.err = out if err is None else err
        self.progress = progress
        self.mode = mode
        self.colour = colour
        self.finished = threading.Event()
        self.streamed = False
        self.at_line_start = True
        self.tool_calls = 0

    def begin(self) -> None:
        self.finished = threading.Event()
        self.streamed = False
        self.at_line_start = True
        self.tool_calls = 0

    def _write(self, text: str) -> None:
        self.progress.stop()
        if text:
            self.out.write(text)
            self.out.flush()
            self.at_line_start = text.endswith("\n")

    def json_line(self, obj: Mapping[str, Any]) -> None:
        self.progress.stop()
        self.out.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.out.flush()

    def note(self, line: str, style: str = "2") -> None:
        """A line on ``err`` (tool lines, the done line), dim or coloured on a terminal; none when quiet."""
        if self.mode != "text":
            return
        self.progress.stop()
        if self.err is self.out:
            self.newline()
        if self.colour:
            line = f"\033[{style}m{line}\033[0m"
        self.err.write(line + "\n")
        self.err.flush()

    def answer(self, text: str) -> None:
        """Answer text (streamed, or the whole answer when nothing was streamed)."""
        if self.mode == "json":
            self.json_line({"type": "text", "text": text})
        else:
            self._write(text)

    def newline(self) -> None:
        if not self.at_line_start and self.mode != "json":
            self._write("\n")

    def emit(self, event: Any) -> None:
        from actors.conversation import TextDelta, ToolCallFinished, ToolCallStarted, TurnFinished

        match event:
            case TextDelta(text=text):
                self.streamed = True
                self.answer(text)
            case ToolCallStarted(call_id=call_id, name=name, arguments=arguments):
                self.tool_calls += 1
                if self.mode == "json":
                    self.json_line(
                        {"type": "tool_call", "call_id": call_id, "name": name, "arguments": arguments}
                    )
                else:
                    self.newline()
                    self.note(f"[tool call] {name} {arguments}", "36")
            case ToolCallFinished(call_id=call_id, name=name, ok=ok, text=text):
                if self.mode == "json":
                    self.json_line(
                        {"type": "tool_result", "call_id": call_id, "name": name, "ok": ok, "text": text}
                    )
                else:
                    kind = "result" if ok else "error"
                    self.note(f"[tool {kind}] {name}: {self._clip(text)}", "2" if ok else "31")
                self.streamed = False  # the answer is the text after the last tool call
            case TurnFinished():
                self.finished.set()
            case _:
                line = loop_event_line(event)
                if line is not None:  # goal, wakeup and job events: status lines, on stderr
                    self.newline()
                    self.note(line, "35")
                else:
                    self.other(event)  # plans, permission asks, todos (people_cli.py)

    def other(self, event: Any) -> None:
        pass

    def _clip(self, text: str) -> str:
        if len(text) > self.SHOWN_CHARS:
            text = text[: self.SHOWN_CHARS] + " ..."
        lines = text.splitlines() or [""]
        if len(lines) > self.SHOWN_LINES:
            lines = [*lines[: self.SHOWN_LINES], f"... ({len(lines) - self.SHOWN_LINES} more lines)"]
        return "\n    ".join(lines)


def loop_event_line(event: Any) -> str | None:
    """One line for a goal, wakeup or job event (issue 12), or None for any other event."""
    from actors.conversation import types as t

    match event:
        case t.GoalSet(condition=condition, max_turns=n):
            return f"[goal] set: {condition} (at most {max(n, 1)} turn{'s' if max(n, 1) != 1 else ''})"
        case t.GoalContinuing(reason=reason, turns=n):
            return f"[goal] not yet after turn {n}: {reason}"
        case t.GoalAchieved(turns=n, reason=reason):
            return f"[goal] achieved after {n} turn{'s' if n != 1 else ''}: {reason}"
        case t.GoalCleared(reason=reason):
            return f"[goal] ended: {reason.replace('_', ' ')}"
        case t.WakeupScheduled(delay_s=delay, prompt=prompt):
            return f"[wakeup] scheduled in {delay:g}s" + (f": {prompt}" if prompt else "")
        case t.WakeupWaiting(due=due):
            return f"[wakeup] sleeping until {time.strftime('%H:%M:%S', time.localtime(due))}"
        case t.WakeupFired():
            return "[wakeup] woke up"
        case t.WakeupCancelled(reason=reason):
            return f"[wakeup] cancelled ({reason})"
        case t.JobStarted(job_id=job_id, command=command):
            return f"[job] started {job_id}: {command}"
        case t.JobFinished(job_id=job_id, exit_code=code, lost=lost):
            status = "lost (outcome unknown)" if lost else ("stopped" if code is None else f"exit {code}")
            return f"[job] finished {job_id}: {status}"
    return None
