"""The wakeup loop (RULES.md 9.7, WK-01..WK-07) and the slot it sleeps on; ``run_event_loop`` (9.8) is this
loop with background-job deliveries (jobs.py) checked first after each turn.

The first turn runs ``initial_goal``; after each turn the loop takes its slot's wakeup and sleeps until the
wakeup's absolute due time on the injected clock (``loops.Timers``), then runs the wakeup's prompt (or the
goal). The slot lives in the conversation actor; ``schedule_wakeup`` is a tool this actor runs itself
(``RegisterWakeupTool``), so the wakeup is journaled (``wakeup_scheduled`` with its due time) before the model
hears "scheduled", and a call outside a running loop is an error result. A loop resumed after a crash fires a
past-due wakeup once and waits for one still ahead. Cancelling the loop (the interrupt token, also during the
sleep), a cancelled turn, its end, and closing the conversation cancel its pending wakeup (a ``close`` that
arrives while the loop sleeps ends the loop at once, then runs).

The loops' own tools (``schedule_wakeup`` and the job tools, jobs.py) run here, in the conversation actor, and
like every other tool each call runs at most once per idempotency key: ``_local_tool`` claims the call's key
in the conversation's own effect store (actors/effects.py; ``<session file>.loops.sqlite3``, in memory
without a session file) before it runs and stores its result before the model hears it, so a call repeated
by key (``continue_turn`` after a crash) answers the stored result instead of scheduling or starting again.
A call whose run was cut off (intent, no outcome) is answered from what is known: ``schedule_wakeup`` whose
wakeup is journaled and still in its slot says so; ``start_job`` whose job its runner knows says it started;
anything else is "outcome unknown" and is not run again, except the rerun-safe ``job_status`` and
``stop_job`` (reading, and stopping an ended job, change nothing). Plan mode denies the mutating ones,
``start_job`` and ``stop_job`` (their ``ToolSpec.mutating``, set in jobs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.base import Context
from actors.conversation.journal import Journal, LoopsRestored
from actors.conversation.kernel import LocalResult
from actors.conversation.messages import ConversationError, LoopResult, RunLoop
from actors.conversation.timers import TimerFired, Timers
from actors.conversation.tools import ToolExecution, ToolSpec
from actors.conversation.types import (
    FinishReason,
    RuntimeOutcome,
    Wakeup,
    WakeupCancelled,
    WakeupFired,
    WakeupScheduled,
    WakeupWaiting,
)
from actors.effects import Done, EffectRecord, EffectStore, EffectStoreError, Run, lost_text, unknown_text

log = logging.getLogger(__name__)

__all__ = ["LOOP_TOOLS_RERUN_SAFE", "MAX_WAKEUP_DELAY", "WAKEUP_TOOL", "WakeupsMixin"]

MAX_WAKEUP_DELAY = 7 * 24 * 3600.0
WAKEUP_TOOL = "schedule_wakeup"
# Plan mode denies these: they start or end processes. schedule_wakeup only changes the conversation's own
# slot (no file, no process, nothing outside), and job_status only reads.
LOOP_TOOLS_RERUN_SAFE = frozenset({"job_status", "stop_job"})


@dataclass
class _WakeLoop:
    slot: str
    initial_goal: str
    jobs: str | None
    ctx: Context
    outcomes: list[RuntimeOutcome] = field(default_factory=list)
    sleeping: Wakeup | None = None
    timer_seq: int = -1
    cancel_timer: Callable[[], None] | None = None


class WakeupsMixin:
    """The slots, the ``schedule_wakeup`` tool and the wakeup loop; mixed into ``ConversationActor``."""

    address: str
    actor_ref: Any
    _slots: dict[str, Wakeup]
    _wakeup_tool: tuple[str, float] | None
    _wake: _WakeLoop | None
    _loop_resume: tuple[str, str, str | None] | None
    _timers: Timers
    config: Any
    node: Any

    if TYPE_CHECKING:

        def _emit(self, event: Any) -> None: ...
        def _write(self, what: str, write: Callable[[Journal], None]) -> None: ...
        def _done(self, ctx: Context, result: Any) -> None: ...
        def _start_turn(
            self, text: str, answer: Callable[[Any], None], *, goal: str | None = ...
        ) -> None: ...
        def _cancel_requested(self) -> bool: ...
        def _next_seq(self) -> int: ...
        def _job_specs(self) -> tuple[ToolSpec, ...]: ...
        def _job_tool(
            self, name: str, arguments: dict[str, Any], key: str, *, probe: bool = ...
        ) -> LocalResult: ...
        def _job_unknown(
            self, key: str, record: EffectRecord, finished: Callable[[ToolExecution], None]
        ) -> None: ...

    def _init_wakeups(self, restored: LoopsRestored | None) -> None:
        self._slot_keys: dict[str, str] = dict((restored or LoopsRestored()).slot_keys)
        path = self.config.session_file
        where = path.with_name(path.name + ".loops.sqlite3") if path is not None else None
        self._loop_effects = EffectStore(where)

    def _close_wakeups(self) -> None:
        self._loop_effects.close()

    def _schedule(self, slot: str, delay: float, prompt: str | None, reason: str, key: str = "") -> Wakeup:
        due = self._timers.now() + delay
        wakeup = Wakeup(delay_s=delay, prompt=prompt, reason=reason, due=due)
        self._write(
            "the wakeup",
            lambda j: j.loop_record(
                "wakeup_scheduled", slot=slot, due=due, delay_s=delay, prompt=prompt, reason=reason, key=key
            ),
        )
        self._slots[slot] = wakeup  # last write wins
        self._slot_keys[slot] = key
        self._emit(WakeupScheduled(slot=slot, due=due, delay_s=delay, prompt=prompt))
        return wakeup

    def _local_specs(self) -> tuple[ToolSpec, ...]:
        jobs = self._job_specs()
        if self._wakeup_tool is None:
            return jobs
        return (
            *jobs,
            ToolSpec(
                name=WAKEUP_TOOL,
                description=(
                    "Ask to be woken up after delay_seconds (only inside a wakeup loop); the next turn then "
                    "starts with prompt, or with the loop's goal."
                ),
                parameters={
                    "type": "object",
                    "properties": {"delay_seconds": {"type": "number"}, "prompt": {"type": "string"}},
                    "required": ["delay_seconds"],
                },
            ),
        )

    def _local_tool(self, name: str, arguments: dict[str, Any], key: str) -> LocalResult:
        """A loop tool's call, run at most once per ``key`` through the effect store (module docstring);
        None: not one of the loops' tools."""
        if self._loop_tool(name, {}, "", probe=True) is None:
            return None
        store = self._loop_effects
        registry = self.node.registry
        summary = f"tool {name!r}"

        def start(finished: Callable[[ToolExecution], None]) -> None:
            try:
                claim = store.claim(key, summary, rerun_safe=name in LOOP_TOOLS_RERUN_SAFE)
            except EffectStoreError as exc:
                finished(ToolExecution(ok=False, text=f"not run: {exc}"))
                return
            if isinstance(claim, Done):
                assert claim.record.tag is not None and claim.record.outcome is not None
                finished(registry.decode(claim.record.tag, claim.record.outcome))
                return

            def settle(result: ToolExecution) -> None:
                try:
                    store.settle(key, registry.tag_of(result), registry.encode(result))
                except EffectStoreError as exc:
                    log.error("%s: %s ran but its outcome is lost: %s", self.address, summary, exc)
                    result = ToolExecution(ok=False, unknown=True, text=lost_text(summary, exc))
                finished(result)

            if not isinstance(claim, Run):
                self._answer_unknown(name, key, claim.record, settle)
                return
            result = self._loop_tool(name, arguments, key)
            if isinstance(result, ToolExecution):
                settle(result)
            elif result is not None:
                result(settle)
            else:  # cannot happen: probed above
                settle(ToolExecution(ok=False, text=f"{name}: not available"))

        return start

    def _answer_unknown(
        self, name: str, key: str, record: EffectRecord, finished: Callable[[ToolExecution], None]
    ) -> None:
        """A call whose earlier run was cut off: what is known about it, never a second run."""
        if name == WAKEUP_TOOL:
            for slot, slot_key in self._slot_keys.items():
                wakeup = self._slots.get(slot)
                if slot_key == key and wakeup is not None:  # journaled, and still waiting
                    finished(ToolExecution(ok=True, text=_scheduled_text(wakeup)))
                    return
        elif name == "start_job":
            self._job_unknown(key, record, finished)
            return
        finished(ToolExecution(ok=False, unknown=True, text=unknown_text(record)))

    def _loop_tool(
        self, name: str, arguments: dict[str, Any], key: str, *, probe: bool = False
    ) -> LocalResult:
        """The loop tool itself (``probe``: only whether ``name`` is one, run nothing)."""
        if name != WAKEUP_TOOL or self._wakeup_tool is None:
            if probe:
                return ToolExecution(ok=True, text="") if self._job_tool(name, {}, "", probe=True) else None
            return self._job_tool(name, arguments, key)
        if probe:
            return ToolExecution(ok=True, text="")
        slot, max_delay = self._wakeup_tool
        if self._wake is None:
            return ToolExecution(
                ok=False,
                text=(
                    "schedule_wakeup failed: no wakeup loop is running in this conversation, so nothing "
                    "would wake you up; nothing was scheduled"
                ),
            )
        delay, prompt = arguments.get("delay_seconds"), arguments.get("prompt")
        extra = sorted(set(arguments) - {"delay_seconds", "prompt"})
        if extra:
            return ToolExecution(ok=False, text=f"schedule_wakeup: unknown argument(s) {', '.join(extra)}")
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay <= max_delay:
            return ToolExecution(
                ok=False,
                text=f"schedule_wakeup: delay_seconds must be a number from 0 to {max_delay:g}, "
                f"not {delay!r}",
            )
        if prompt is not None and not isinstance(prompt, str):
            return ToolExecution(ok=False, text="schedule_wakeup: prompt must be a string")
        try:
            wakeup = self._schedule(slot, float(delay), prompt, "", key)
        except ConversationError as exc:
            return ToolExecution(ok=False, text=f"schedule_wakeup: not scheduled: {exc}")
        return ToolExecution(ok=True, text=_scheduled_text(wakeup))

    # ----------------------------------------------------------------------------- wakeup loop
    def _wake_loop(self, m: RunLoop, ctx: Context) -> None:
        loop = _WakeLoop(m.slot, m.initial_goal, m.jobs, ctx)
        resumed = self._loop_resume is not None and self._loop_resume[0] == m.slot
        self._loop_resume = None
        if not resumed:
            if m.slot in self._slots:  # WK-03: a wakeup from before the loop is discarded
                self._write("a stale wakeup", lambda j: j.loop_record("wakeup_taken", slot=m.slot))
                del self._slots[m.slot]
            self._write(
                "the loop",
                lambda j: j.loop_record(
                    "loop_started", slot=m.slot, initial_goal=m.initial_goal, jobs=m.jobs
                ),
            )
        self._wake = loop
        pending = self._slots.pop(m.slot, None) if resumed else None
        if pending is not None:
            log.info("%s: resuming the wakeup loop: wakeup due at %.3f", self.address, pending.due)
            self._sleep(loop, pending)
        else:
            self._start_turn(m.initial_goal, lambda r: self._loop_turned(loop, r))  # WK-01

    def _loop_turned(self, loop: _WakeLoop, result: Any) -> None:
        if isinstance(result, BaseException):  # WK-07: errors propagate
            self._end_loop(loop, result, "the turn failed")
            return
        loop.outcomes.append(result)
        if result.finish_reason is FinishReason.CANCELLED:  # WK-07
            self._end_loop(loop, None, "cancelled")
            return
        self._loop_next(loop)

    def _loop_next(self, loop: _WakeLoop) -> None:
        """After a turn (BG-01): a completed job first (BG-05), else the slot's wakeup, else the end."""
        if loop.jobs is not None and self._deliver_job(loop):
            return
        wakeup = self._slots.pop(loop.slot, None)  # WK-03: taking empties the slot
        if wakeup is None:  # WK-02, BG-04
            self._end_loop(loop, None, "")
            return
        self._sleep(loop, wakeup)

    def _deliver_job(self, loop: _WakeLoop) -> bool:
        return False  # background jobs (jobs.py) override this

    def _sleep(self, loop: _WakeLoop, wakeup: Wakeup) -> None:
        if self._cancel_requested():  # WK-06
            self._slots[loop.slot] = wakeup
            self._end_loop(loop, None, "cancelled")
            return
        loop.sleeping = wakeup
        loop.timer_seq = seq = self._next_seq()
        ref = self.actor_ref
        delay = max(0.0, wakeup.due - self._timers.now())
        self._emit(WakeupWaiting(slot=loop.slot, due=wakeup.due))
        loop.cancel_timer = self._timers.call_later(delay, lambda: ref.tell(TimerFired(seq)))

    def _wakeup_timer(self, seq: int) -> None:
        loop = self._wake
        if loop is None or loop.sleeping is None or loop.timer_seq != seq:
            return  # a timer cancelled as it fired
        wakeup, loop.sleeping, loop.cancel_timer = loop.sleeping, None, None
        self._write(
            "the wakeup's firing", lambda j: j.loop_record("wakeup_fired", slot=loop.slot, due=wakeup.due)
        )
        self._emit(WakeupFired(slot=loop.slot, due=wakeup.due))
        self._start_turn(wakeup.prompt or loop.initial_goal, lambda r: self._loop_turned(loop, r))  # WK-04

    def _wake_interrupted(self) -> None:
        """The interrupt token was cancelled: a loop asleep ends now, with no further turn (WK-06)."""
        loop = self._wake
        if loop is not None and loop.sleeping is not None:
            self._slots[loop.slot] = loop.sleeping
            loop.sleeping = None
            self._end_loop(loop, None, "cancelled")

    def _wake_closing(self) -> None:
        """``close`` arrived while the loop sleeps: the session is over, so the loop ends now (its wakeup
        cancelled, reason "closed") and the close, a command queued behind it (CL-05), runs next."""
        loop = self._wake
        if loop is not None and loop.sleeping is not None:
            self._slots[loop.slot] = loop.sleeping
            loop.sleeping = None
            self._end_loop(loop, None, "closed")

    def _end_loop(self, loop: _WakeLoop, error: BaseException | None, why: str) -> None:
        if loop.cancel_timer is not None:
            loop.cancel_timer()
            loop.cancel_timer = None
        loop.sleeping = None
        if loop.slot in self._slots:  # stopping the loop cancels its pending wakeup
            reason = why or "the loop ended"
            self._write(
                "the wakeup's cancel",
                lambda j: j.loop_record("wakeup_cancelled", slot=loop.slot, reason=reason),
            )
            del self._slots[loop.slot]
            self._emit(WakeupCancelled(slot=loop.slot, reason=reason))
        self._write("the loop's end", lambda j: j.loop_record("loop_ended", slot=loop.slot))
        self._wake = None
        self._loop_ended(loop, why)
        self._done(loop.ctx, error if error is not None else LoopResult(outcomes=tuple(loop.outcomes)))

    def _loop_ended(self, loop: _WakeLoop, why: str) -> None:
        """Hook for background jobs: a cancelled loop stops its jobs."""


def _scheduled_text(wakeup: Wakeup) -> str:
    return f"wakeup scheduled in {wakeup.delay_s:g}s (due at {wakeup.due:.3f})"
