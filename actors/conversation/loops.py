"""The conversation's multi-turn loops (RULES.md 9.6-9.8): the goal loop with its judge, and the wakeup loop.

Both are commands of the conversation actor built as continuation state machines: each turn is
``_start_turn(text, answer)``, and ``answer`` decides the next step, so the mailbox stays free for queries
and controls (``current_goal``, ``clear_goal``, ``cancel``) while a loop runs.

**Goal loop** (``RunGoalLoop``, GL-05): set the goal, then per iteration run a turn, count it, stop at the
budget (``max_turns``, or the optional token budget), ask the evaluator, stop when achieved or impossible,
otherwise continue with ``AUTO_PROMPT``. The default evaluator is a *judge run*: one kernel run of mode
"judge" on the Router (the session's model unless configured), without the conversation's tools, given the
condition and ``transcript_tail(goal_judge_tail)``; it must answer ``{achieved, reason, impossible}`` by
calling its one tool ``goal_verdict`` (the ``local`` provider generates the arguments under a JSON grammar)
or as a JSON text. An answer that does not parse, or a judge past ``judge_timeout`` (the run is cancelled),
is "not achieved" with a reason that says so. Each judge call is a Router provider turn with its own receipt.
Every change is journaled before it is acted on: a runtime resumed from its session file knows its goal and
its turn count, and ``run_goal_loop`` on the same condition continues the crashed loop.

**Wakeup loop** (``RunLoop``, WK): the first turn runs ``initial_goal``; after each turn the loop takes its
slot's wakeup and sleeps until the wakeup's absolute due time on the injected clock (``Timers``), then runs
the wakeup's prompt. The slot lives in this actor; ``schedule_wakeup`` is a tool this actor runs itself
(``RegisterWakeupTool``), so it writes the wakeup durably (``wakeup_scheduled`` with its due time) before the
model hears "scheduled". A loop resumed after a crash fires a past-due wakeup once and waits for one ahead.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from actors.base import Context
from actors.conversation.journal import Journal, LoopsRestored
from actors.conversation.kernel import KernelRun, LocalResult, line_of
from actors.conversation.messages import (
    ConversationError,
    GoalReply,
    LoopResult,
    RegisterWakeupTool,
    RunGoalLoop,
    RunLoop,
    SetGoal,
    SlotReply,
    SlotSchedule,
    SlotTake,
)
from actors.conversation.tools import ToolExecution, ToolSpec
from actors.conversation.types import (
    FinishReason,
    GoalAchieved,
    GoalCleared,
    GoalClearReason,
    GoalContinuing,
    GoalSet,
    GoalState,
    GoalVerdict,
    Message,
    RuntimeOutcome,
    Wakeup,
    WakeupCancelled,
    WakeupFired,
    WakeupScheduled,
    WakeupWaiting,
)
from actors.session import CancelSession

log = logging.getLogger(__name__)

__all__ = [
    "AUTO_PROMPT",
    "GOAL_JUDGE_TAIL",
    "GoalEvaluator",
    "LoopsMixin",
    "RealTimers",
    "Timers",
    "judge_prompt",
    "parse_verdict",
]

GOAL_JUDGE_TAIL = 20  # GL-09
AUTO_PROMPT = "Continue working toward the goal: {condition}\nEvaluator feedback: {reason}"  # GL-10
JUDGE_TIMEOUT = 120.0
MAX_WAKEUP_DELAY = 7 * 24 * 3600.0
WAKEUP_TOOL = "schedule_wakeup"
JUDGE_TOOL_DESCRIPTION = (
    'Record your verdict. Call with {"name": "goal_verdict", "arguments": {"achieved": <true or false>, '
    '"reason": "<one sentence: why>", "impossible": <true or false>}}.\n'
    "Available tools:\n- goal_verdict(achieved: boolean, reason: string, impossible: boolean): the verdict"
)


class GoalEvaluator(Protocol):
    """Judges a goal after a turn; may return the verdict or a future of it (it runs off the actor thread)."""

    def evaluate(
        self, condition: str, transcript_tail: Sequence[Message]
    ) -> GoalVerdict | concurrent.futures.Future[GoalVerdict]: ...


class Timers(Protocol):
    """The clock and timer source of the loops: ``now()`` in seconds (absolute: due times are journaled),
    ``call_later(delay, fn)`` runs ``fn`` once after ``delay`` seconds and returns a cancel function."""

    def now(self) -> float: ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]: ...


class RealTimers:
    """Wall-clock time and ``threading.Timer``s (daemon threads)."""

    def now(self) -> float:
        return time.time()

    def call_later(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]:
        timer = threading.Timer(max(0.0, delay), fn)
        timer.daemon = True
        timer.start()
        return timer.cancel


def judge_prompt(condition: str, tail: Sequence[Message]) -> str:
    """The judge's input: the condition (as data, in tags) and the transcript's tail."""
    conversation = "\n".join(line_of(m) for m in tail) or "(no messages)"
    return (
        "You judge whether a goal has been reached. Read the condition and the conversation, then give your "
        "verdict.\n\n"
        f"<condition>\n{condition}\n</condition>\n\n"
        f"<conversation>\n{conversation}\n</conversation>\n\n"
        'Answer with the verdict as JSON: {"achieved": true or false, "reason": "why", "impossible": true '
        "or false} (impossible: the condition can never be met). Call call_ktool with "
        '{"name": "goal_verdict", "arguments": {...the verdict...}}, or answer with the JSON object alone.'
    )


def parse_verdict(arguments: dict[str, Any] | None, text: str | None) -> GoalVerdict:
    """A strict verdict from a ``goal_verdict`` call's arguments or a JSON answer; anything else is "not
    achieved" with a reason that says the verdict did not parse."""
    candidate: Any = arguments
    if candidate is None and text:
        found = re.search(r"\{.*\}", text, re.DOTALL)
        try:
            candidate = json.loads(found.group(0)) if found else None
        except ValueError:
            candidate = None
    if isinstance(candidate, dict) and isinstance(candidate.get("arguments"), dict):
        candidate = candidate["arguments"]  # the whole call_ktool object given as text
    if (
        isinstance(candidate, dict)
        and isinstance(candidate.get("achieved"), bool)
        and isinstance(candidate.get("reason"), str)
        and isinstance(candidate.get("impossible", False), bool)
    ):
        return GoalVerdict(
            achieved=candidate["achieved"],
            reason=candidate["reason"][:2000],
            impossible=bool(candidate.get("impossible", False)),
        )
    shown = json.dumps(arguments)[:200] if arguments is not None else repr((text or "")[:200])
    return GoalVerdict(achieved=False, reason=f"the judge's verdict did not parse: {shown}")


# ------------------------------------------------------------------------------------------ states


@dataclass(frozen=True)
class _TimerFired:
    seq: int


@dataclass(frozen=True)
class _Judged:
    seq: int
    verdict: GoalVerdict | BaseException


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


class LoopsMixin:
    """The loops' state and handlers; mixed into ``ConversationActor`` (which provides the helpers used)."""

    # provided by ConversationActor / KernelHost
    config: Any
    _journal: Journal | None
    _transcript: list[Message]
    _model: str
    _run: KernelRun | None
    address: str
    actor_ref: Any

    if TYPE_CHECKING:

        def _emit(self, event: Any) -> None: ...
        def _write(self, what: str, write: Callable[[Journal], None]) -> None: ...
        def _done(self, ctx: Context, result: Any) -> None: ...
        def _start_turn(self, text: str, answer: Callable[[Any], None]) -> None: ...
        def _cancel_requested(self) -> bool: ...
        def _kernel(self, run: KernelRun, then: Callable[[BaseException | None], None]) -> None: ...
        def tell_to(self, dst: str, message: Any, **fields: Any) -> bytes: ...
        def _job_specs(self) -> tuple[ToolSpec, ...]: ...
        def _job_tool(self, name: str, arguments: dict[str, Any], key: str) -> LocalResult: ...

    def _init_loops(self, restored: LoopsRestored | None) -> None:
        r = restored or LoopsRestored()
        self._goal: GoalState | None = r.goal
        self._goal_gen = 0
        self._goal_resume: tuple[str, str | None] | None = (
            (r.goal_phase, r.goal_reason) if r.goal_loop else None
        )
        self._slots: dict[str, Wakeup] = dict(r.slots)
        self._loop_resume = r.loop
        self._wakeup_tool: tuple[str, float] | None = None
        self._wake: _WakeLoop | None = None
        self._seq = 0
        self._judging: dict[int, Callable[[GoalVerdict | BaseException], None]] = {}
        self._timers: Timers = self.config.timers or RealTimers()
        self._judge_timer: tuple[int, KernelRun] | None = None

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------------- controls, queries
    def _loop_control(self, message: Any) -> Any:
        """The loops' queries and controls, answered at once (GL-01, GL-04)."""
        match message:
            case SetGoal(condition=condition, max_turns=max_turns, token_budget=budget):
                self._set_goal(condition, max_turns, budget, loop=False)
                return None
            case RegisterWakeupTool(slot=slot, max_delay_s=max_delay):
                if not max_delay > 0:
                    raise ConversationError(f"the maximum wakeup delay must be > 0, not {max_delay}")
                self._wakeup_tool = (slot, max_delay)
                return None
            case SlotSchedule(slot=slot, delay_s=delay, prompt=prompt, reason=reason):
                if not delay >= 0:
                    raise ConversationError(f"a wakeup delay must be >= 0, not {delay}")
                self._schedule(slot, delay, prompt, reason)
                return None
            case SlotTake(slot=slot, clear=clear):
                wakeup = self._slots.get(slot)
                if clear and wakeup is not None:
                    self._write("a wakeup taken", lambda j: j.loop_record("wakeup_taken", slot=slot))
                    del self._slots[slot]
                return SlotReply(wakeup=wakeup)
        return GoalReply(goal=self._goal)  # GL-01: a frozen value, a copy by construction

    def _set_goal(self, condition: str, max_turns: int, budget: int | None, *, loop: bool) -> None:
        if max_turns < 0:
            raise ConversationError(f"max_turns must be >= 0, not {max_turns}")
        if budget is not None and budget <= 0:
            raise ConversationError(f"a token budget must be > 0, not {budget}")
        self._write(
            "the goal",
            lambda j: j.loop_record(
                "goal_set", condition=condition, max_turns=max_turns, token_budget=budget, loop=loop
            ),
        )
        self._goal = GoalState(condition=condition, max_turns=max_turns, token_budget=budget)  # GL-02
        self._goal_gen += 1
        self._goal_resume = None
        self._emit(GoalSet(condition=condition, max_turns=max_turns))

    def _clear_goal(self, reason: GoalClearReason) -> None:
        """GL-03 (also when no goal is set) and every end of a goal loop but "achieved" (GL-12)."""
        self._write("the goal's end", lambda j: j.loop_record("goal_cleared", reason=reason))
        self._goal = None
        self._goal_gen += 1
        self._goal_resume = None
        self._emit(GoalCleared(reason=reason))

    # -------------------------------------------------------------------------------- goal loop
    def _goal_loop(self, m: RunGoalLoop, ctx: Context) -> None:
        outcomes: list[RuntimeOutcome] = []

        def finish(result: Any) -> None:
            self._done(
                ctx, result if isinstance(result, BaseException) else LoopResult(outcomes=tuple(outcomes))
            )

        goal = self._goal
        resume = self._goal_resume
        if resume is not None and goal is not None and goal.condition == m.condition:
            phase, reason = resume  # a crashed loop on this condition: go on where it stopped
            self._goal_resume = None
            log.info("%s: resuming the goal loop at turn %d (%s)", self.address, goal.turns, phase)
        else:
            self._set_goal(m.condition, m.max_turns, m.token_budget, loop=True)  # GL-05
            phase, reason = "turn", None
        gen = self._goal_gen

        def alive() -> bool:
            return self._goal is not None and self._goal_gen == gen

        def turned(result: Any) -> None:
            if isinstance(result, BaseException):  # GL-14: the goal stays as it is
                finish(result)
                return
            outcomes.append(result)  # GL-07
            if not alive():  # GL-08: cleared (or replaced) from outside during the turn
                finish(None)
                return
            if result.finish_reason is FinishReason.CANCELLED:  # GL-15
                self._clear_goal("cancelled")
                finish(None)
                return
            g = self._goal
            assert g is not None
            counted = replace(g, turns=g.turns + 1, tokens_used=g.tokens_used + result.usage.total_tokens)
            self._write(
                "the goal's turn count",
                lambda j: j.loop_record("goal_turn", turns=counted.turns, tokens_used=counted.tokens_used),
            )
            self._goal = counted  # GL-11
            if counted.turns >= max(counted.max_turns, 1):  # GL-06, GL-13: before the judge
                self._clear_goal("budget_exceeded")
                finish(None)
                return
            if counted.token_budget is not None and counted.tokens_used >= counted.token_budget:
                self._clear_goal("token_budget_exceeded")
                finish(None)
                return
            evaluate()

        def evaluate() -> None:
            g = self._goal
            assert g is not None
            tail = (
                tuple(self._transcript[-self.config.goal_judge_tail :]) if self.config.goal_judge_tail else ()
            )
            self._evaluate(g.condition, tail, judged)  # GL-09

        def judged(verdict: GoalVerdict | BaseException) -> None:
            if not alive():  # cleared while the judge ran: no further turn
                finish(None)
                return
            if isinstance(verdict, BaseException):  # GL-14
                finish(verdict)
                return
            g = self._goal
            assert g is not None
            self._write(
                "the verdict",
                lambda j: j.loop_record(
                    "goal_verdict",
                    turns=g.turns,
                    achieved=verdict.achieved,
                    reason=verdict.reason,
                    impossible=verdict.impossible,
                ),
            )
            if verdict.achieved:
                self._write(
                    "the goal achieved",
                    lambda j: j.loop_record("goal_achieved", turns=g.turns, reason=verdict.reason),
                )
                self._goal = None  # GL-12
                self._goal_gen += 1
                self._emit(GoalAchieved(condition=g.condition, turns=g.turns, reason=verdict.reason))
                finish(None)
                return
            if verdict.impossible:
                self._clear_goal("impossible")
                finish(None)
                return
            self._emit(GoalContinuing(reason=verdict.reason, turns=g.turns))  # GL-10
            self._start_turn(AUTO_PROMPT.format(condition=g.condition, reason=verdict.reason), turned)

        if phase == "evaluate":
            evaluate()
        elif reason is not None and goal is not None:
            self._start_turn(AUTO_PROMPT.format(condition=goal.condition, reason=reason), turned)
        else:
            self._start_turn(m.prompt, turned)

    def _evaluate(
        self, condition: str, tail: tuple[Message, ...], then: Callable[[GoalVerdict | BaseException], None]
    ) -> None:
        evaluator: GoalEvaluator | None = self.config.goal_evaluator
        if evaluator is None:
            self._judge(condition, tail, then)
            return
        seq = self._next_seq()
        self._judging[seq] = then
        ref, timeout = self.actor_ref, self.config.judge_timeout

        def work() -> None:  # off the actor thread: a slow evaluator never blocks the mailbox
            result: Any
            try:
                value = evaluator.evaluate(condition, tail)
                result = value.result(timeout) if isinstance(value, concurrent.futures.Future) else value
                if not isinstance(result, GoalVerdict):
                    result = ConversationError(f"the goal evaluator returned {type(result).__name__}")
            except BaseException as exc:  # noqa: BLE001 - handed to the loop (GL-14)
                result = exc
            ref.tell(_Judged(seq, result))

        threading.Thread(target=work, name=f"{self.address}-evaluator", daemon=True).start()

    def _judge(
        self, condition: str, tail: tuple[Message, ...], then: Callable[[GoalVerdict | BaseException], None]
    ) -> None:
        """The default evaluator: one judge run on the Router (one provider turn, one receipt)."""
        model = self.config.judge_model or self._model
        run = KernelRun("judge", "", model, judge_prompt(condition, tail), JUDGE_TOOL_DESCRIPTION)
        seq = self._next_seq()
        ref = self.actor_ref
        timeout = self.config.judge_timeout
        cancel = self._timers.call_later(timeout, lambda: ref.tell(_TimerFired(seq)))
        self._judge_timer = (seq, run)

        def ended(error: BaseException | None) -> None:
            cancel()
            self._judge_timer = None
            if run.timed_out:
                verdict = GoalVerdict(achieved=False, reason=f"the judge did not answer within {timeout:g}s")
            elif error is not None:
                verdict = GoalVerdict(achieved=False, reason=f"the judge call failed: {error}"[:500])
            else:
                verdict = parse_verdict(run.verdict, run.final)
            log.info("%s: judge verdict %s: %s", self.address, verdict.achieved, verdict.reason)
            then(verdict)

        self._kernel(run, ended)

    # ------------------------------------------------------------------------------- wakeups
    def _schedule(self, slot: str, delay: float, prompt: str | None, reason: str) -> Wakeup:
        due = self._timers.now() + delay
        wakeup = Wakeup(delay_s=delay, prompt=prompt, reason=reason, due=due)
        self._write(
            "the wakeup",
            lambda j: j.loop_record(
                "wakeup_scheduled", slot=slot, due=due, delay_s=delay, prompt=prompt, reason=reason
            ),
        )
        self._slots[slot] = wakeup  # last write wins
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
        if name != WAKEUP_TOOL or self._wakeup_tool is None:
            return self._job_tool(name, arguments, key)
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
            wakeup = self._schedule(slot, float(delay), prompt, "")
        except ConversationError as exc:
            return ToolExecution(ok=False, text=f"schedule_wakeup: not scheduled: {exc}")
        return ToolExecution(ok=True, text=f"wakeup scheduled in {float(delay):g}s (due at {wakeup.due:.3f})")

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
        loop.cancel_timer = self._timers.call_later(delay, lambda: ref.tell(_TimerFired(seq)))

    def _timer_fired(self, seq: int) -> None:
        judge = self._judge_timer
        if judge is not None and judge[0] == seq:  # the judge ran past its timeout: cancel its run
            run: KernelRun = judge[1]
            if self._run is run and not run.timed_out:
                run.timed_out = True
                self.tell_to(run.loop, CancelSession())
            return
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

    def _loop_local(self, message: Any) -> bool:
        if isinstance(message, _TimerFired):
            self._timer_fired(message.seq)
            return True
        if isinstance(message, _Judged):
            then = self._judging.pop(message.seq, None)
            if then is not None:
                then(message.verdict)
            return True
        return False
