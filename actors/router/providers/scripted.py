"""A deterministic scripted model: replies, tool calls, usage, delays and failures from a script.

For tests, replays and benchmarks. Each turn takes the next script (a list of steps); a tool-call step
emits the call and waits for its result like a real provider. Step forms (plain dicts, so a config file can
hold them)::

    {"text": "Hello", "chunks": 2}          stream text (split into `chunks` deltas)
    {"call": {"name": "x", "arguments": {...}}, "id": "c1"}   call_ktool with JSON-object arguments
    {"raw_call": {"name": "fn", "arguments": "{not json"}, "id": "c2"}   a native call sent verbatim
    {"usage": {"input_tokens": 10, "output_tokens": 3}}         cumulative usage
    {"delay": 0.01}                          wait (the host's timer; an injected ``sleep`` is called instead)
    {"fail": "unavailable" | "failed", "message": "...", "after_output": true}
    {"hang": true}                           wait until cancelled (timeouts, cancellation)
    {"close": true}                          end the stream without a final answer (ProviderError "closed")
    {"finish": "length"}                     end as a reply cut at the output-token limit would

A turn is a stepped generator that never blocks (``placement = "inline"``: the Router runs it on its own
thread); a tool call, a delay and a hang are yields. The answer is the concatenated text after the last tool
call. ``ScriptedProvider.turns`` records every
request it received, ``inputs`` every complete input submitted (the first request's and each re-rendered
one, Router ``SubmitInput``), and ``results`` every tool result it waited for, for assertions.
"""

from __future__ import annotations

import contextlib
import json
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from actors.router.providers.base import (
    CLOSED,
    AwaitCancel,
    AwaitResult,
    ChatMessage,
    NativeToolCall,
    ProviderError,
    ProviderOutcome,
    Sleep,
    Submitted,
    TextDelta,
    ToolCallRequested,
    TurnCancelled,
    TurnIO,
    TurnRequest,
    TurnSteps,
    UsageUpdate,
    drive,
    model_context,
    replaced_input,
)
from actors.types import CALL_KTOOL, TokenUsage, ToolResult

Step = Mapping[str, Any]


class ScriptedProvider:
    """Runs scripts, each turn a generator the Router steps on its own thread (no thread per turn).
    ``run_turn`` drives one to its end on the calling thread (for direct callers)."""

    name = "scripted"
    placement = "inline"

    def __init__(
        self,
        scripts: Iterable[Sequence[Step]] = (),
        *,
        default: Sequence[Step] | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self._scripts: deque[Sequence[Step]] = deque(scripts)
        self._default = default if default is not None else [{"text": "ok"}]
        self._sleep = sleep
        self.turns: list[TurnRequest] = []
        self.inputs: list[str] = []
        self.results: list[tuple[str, ToolResult]] = []

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ScriptedProvider:
        return cls(options.get("scripts", ()), default=options.get("default"))

    def add(self, *scripts: Sequence[Step]) -> None:
        self._scripts.extend(scripts)

    def close(self) -> None:
        pass

    def run_turn(self, request: TurnRequest, io: TurnIO) -> ProviderOutcome:
        return drive(self.steps(request, io), io)

    def steps(self, request: TurnRequest, io: TurnIO) -> TurnSteps:
        # deque.popleft and list.append are atomic: direct callers on several threads each take a script.
        self.turns.append(request)
        try:
            script = self._scripts.popleft()
        except IndexError:
            script = self._default
        self.inputs.append(request.messages[-1].content if request.messages else "")
        io.emit(Submitted(model_context(request)))
        text: list[str] = []
        usage: TokenUsage | None = None
        produced = False
        finish = "stop"
        for step in script:
            if io.cancelled.is_set():
                raise ProviderError("cancelled", "turn cancelled", started=produced)
            if "text" in step:
                chunks = max(1, int(step.get("chunks", 1)))
                body = str(step["text"])
                size = max(1, -(-len(body) // chunks))
                for i in range(0, len(body), size):
                    io.emit(TextDelta(body[i : i + size]))
                text.append(body)
                produced = True
            elif "call" in step or "raw_call" in step:
                call = self._call(step)
                io.emit(ToolCallRequested(call))
                produced = True
                try:
                    result = yield AwaitResult(call.call_id)
                except TurnCancelled:
                    raise ProviderError("cancelled", "turn cancelled", started=True) from None
                assert result is not None
                self.results.append((call.call_id, result))
                text.clear()  # the answer is what follows the last tool call
                replaced = replaced_input(io)
                if replaced is None:
                    io.emit(Submitted(model_context(request, continued=True)))
                else:
                    self.inputs.append(replaced)
                    io.emit(Submitted(model_context(request, [ChatMessage("user", replaced)])))
            elif "usage" in step:
                usage = TokenUsage(**dict(step["usage"]))
                io.emit(UsageUpdate(usage))
            elif "delay" in step:
                if self._sleep is not None:
                    self._sleep(float(step["delay"]))
                else:
                    try:
                        yield Sleep(float(step["delay"]))
                    except TurnCancelled:
                        raise ProviderError("cancelled", "turn cancelled", started=produced) from None
            elif "fail" in step:
                raise ProviderError(
                    str(step["fail"]),
                    str(step.get("message", "scripted failure")),
                    started=produced or bool(step.get("after_output")),
                ) from ConnectionResetError(str(step.get("message", "scripted failure")))
            elif step.get("hang"):
                with contextlib.suppress(TurnCancelled):
                    yield AwaitCancel()
                raise ProviderError("cancelled", "turn cancelled", started=produced)
            elif step.get("close"):
                raise ProviderError(CLOSED, "the stream ended without a final answer", started=produced)
            elif "finish" in step:
                finish = "length" if step["finish"] == "length" else "stop"
            else:
                raise ValueError(f"unknown script step {dict(step)!r}")
        return ProviderOutcome("".join(text), usage, finish_reason=finish)

    @staticmethod
    def _call(step: Step) -> NativeToolCall:
        if "raw_call" in step:
            raw = step["raw_call"]
            return NativeToolCall(str(step.get("id", "call-1")), str(raw["name"]), str(raw["arguments"]))
        call = step["call"]
        arguments = json.dumps({"name": call["name"], "arguments": call.get("arguments", {})})
        return NativeToolCall(str(step.get("id", "call-1")), CALL_KTOOL, arguments)
