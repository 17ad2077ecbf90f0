"""The conversation's multi-turn loops (RULES.md 9.6-9.8): the goal loop with its judge, and the wakeup loop.

Both are commands of the conversation actor built as continuation state machines: each turn is
``_start_turn(text, answer)``, and ``answer`` decides the next step, so the mailbox stays free for queries
and controls (``current_goal``, ``clear_goal``, ``cancel``) while a loop runs.

**Goal loop** (``RunGoalLoop``, GL-05): set the goal, then per iteration run a turn, count it, stop at the
budget (``max_turns``, or the optional token budget), ask the evaluator, stop when achieved or impossible,
otherwise continue with ``AUTO_PROMPT``. The default evaluator is a *judge run*: one kernel run of mode
"judge" on the Router (the session's model unless configured), without the conversation's tools, given the
condition and ``transcript_tail(goal_judge_tail)``; it must answer ``{achieved, reason, impossible}`` by
calling its one tool ``goal_verdict`` or as a JSON text; the turn carries ``VERDICT_SCHEMA`` as its response
schema, so a provider that can constrain its output (``local``: a grammar; ``openai``: ``response_format``)
answers a verdict that parses, and one that cannot ignores it. An answer that does not parse, or a judge
past ``judge_timeout`` (the run is cancelled), is "not achieved" with a reason that says so. Each judge call
is a Router provider turn with its own receipt.
Every change is journaled before it is acted on: a runtime resumed from its session file knows its goal and
its turn count, and ``run_goal_loop`` on the same condition continues the crashed loop. The count is derived
from the turns themselves (each loop turn's ``turn_started`` carries the loop's ``goal_id``; a turn counts
once started, also one the process died in), and a resumed loop checks the budget before it asks the judge,
so a crash at any point never lets the loop run past ``max_turns``.

The wakeup loop is in wakeups.py, background jobs in jobs.py; their state is set up here.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from actors.base import Context
from actors.conversation.journal import Journal, LoopsRestored
from actors.conversation.kernel import KernelRun, line_of
from actors.conversation.messages import (
    ConversationError,
    GoalReply,
    LoopResult,
    RegisterWakeupTool,
    RunGoalLoop,
    SetGoal,
    SlotReply,
    SlotSchedule,
    SlotTake,
)
from actors.conversation.timers import Judged, RealTimers, RecordedTimers, TimerFired, Timers
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
)
from actors.runs.session import CancelSession
from transport.replay import replaying

log = logging.getLogger(__name__)

__all__ = [
    "AUTO_PROMPT",
    "GOAL_JUDGE_TAIL",
    "VERDICT_SCHEMA",
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
# The verdict's JSON schema, sent with the judge's turn: a provider that can constrain its output to a schema
# (local: a llama.cpp grammar; openai: response_format json_schema) can only answer a verdict that parses.
VERDICT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "achieved": {"type": "boolean"},
        "reason": {"type": "string"},
        "impossible": {"type": "boolean"},
    },
    "required": ["achieved", "reason", "impossible"],
    "additionalProperties": False,
}
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
    node: Any

    if TYPE_CHECKING:

        def _new_operation_id(self) -> uuid.UUID: ...
        def _emit(self, event: Any) -> None: ...
        def _write(self, what: str, write: Callable[[Journal], None]) -> None: ...
        def _done(self, ctx: Context, result: Any) -> None: ...
        def _start_turn(
            self, text: str, answer: Callable[[Any], None], *, goal: str | None = ...
        ) -> None: ...
        def _cancel_requested(self) -> bool: ...
        def _kernel(self, run: KernelRun, then: Callable[[BaseException | None], None]) -> None: ...
        def tell_to(self, dst: str, message: Any, **fields: Any) -> bytes: ...
        def _wakeup_timer(self, seq: int) -> None: ...
        def _schedule(
            self, slot: str, delay: float, prompt: str | None, reason: str, key: str = ...
        ) -> Wakeup: ...

    def _init_loops(self, restored: LoopsRestored | None) -> None:
        r = restored or LoopsRestored()
        self._goal: GoalState | None = r.goal
        self._goal_id: str | None = r.goal_id  # the running (or crashed) goal loop's id: its turns are tagged
        self._goal_gen = 0
        self._goal_resume: tuple[str, str | None] | None = (
            (r.goal_phase, r.goal_reason) if r.goal_loop else None
        )
        self._slots: dict[str, Wakeup] = dict(r.slots)
        self._loop_resume = r.loop
        self._wakeup_tool: tuple[str, float] | None = None
        self._wake: Any = None  # the running wakeup/event loop (wakeups.py)
        self._seq = 0
        self._judging: dict[int, Callable[[GoalVerdict | BaseException], None]] = {}
        self._timers: Timers = self.config.timers or RecordedTimers(self.node, self.address)
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
        goal_id = self._new_operation_id().hex if loop else None
        self._write(
            "the goal",
            lambda j: j.loop_record(
                "goal_set",
                condition=condition,
                max_turns=max_turns,
                token_budget=budget,
                loop=loop,
                goal_id=goal_id,
            ),
        )
        self._goal = GoalState(condition=condition, max_turns=max_turns, token_budget=budget)  # GL-02
        self._goal_id = goal_id
        self._goal_gen += 1
        self._goal_resume = None
        self._emit(GoalSet(condition=condition, max_turns=max_turns))

    def _clear_goal(self, reason: GoalClearReason) -> None:
        """GL-03 (also when no goal is set) and every end of a goal loop but "achieved" (GL-12)."""
        self._write("the goal's end", lambda j: j.loop_record("goal_cleared", reason=reason))
        self._goal = None
        self._goal_id = None
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
        goal_id = self._goal_id

        def run_turn(text: str) -> None:  # tagged: a resume counts the turn even if its goal_turn is lost
            self._start_turn(text, turned, goal=goal_id)

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
            checked()

        def checked() -> None:
            g = self._goal
            assert g is not None
            if g.turns >= max(g.max_turns, 1):  # GL-06, GL-13: before the judge
                self._clear_goal("budget_exceeded")
                finish(None)
                return
            if g.token_budget is not None and g.tokens_used >= g.token_budget:
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
                self._goal_id = None
                self._goal_gen += 1
                self._emit(GoalAchieved(condition=g.condition, turns=g.turns, reason=verdict.reason))
                finish(None)
                return
            if verdict.impossible:
                self._clear_goal("impossible")
                finish(None)
                return
            self._emit(GoalContinuing(reason=verdict.reason, turns=g.turns))  # GL-10
            run_turn(AUTO_PROMPT.format(condition=g.condition, reason=verdict.reason))

        if phase == "evaluate":  # the last turn is counted: the budget first, as after any turn
            checked()
        elif reason is not None and goal is not None:
            run_turn(AUTO_PROMPT.format(condition=goal.condition, reason=reason))
        else:
            run_turn(m.prompt)

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
            ref.tell(Judged(seq, result))

        if replaying(self.node):  # the verdict is served from the log (timers.py conversation_mailbox)
            return
        threading.Thread(target=work, name=f"{self.address}-evaluator", daemon=True).start()

    def _judge(
        self, condition: str, tail: tuple[Message, ...], then: Callable[[GoalVerdict | BaseException], None]
    ) -> None:
        """The default evaluator: one judge run on the Router (one provider turn, one receipt)."""
        model = self.config.judge_model or self._model
        run = KernelRun(
            "judge",
            "",
            model,
            judge_prompt(condition, tail),
            JUDGE_TOOL_DESCRIPTION,
            response_schema=VERDICT_SCHEMA,
        )
        seq = self._next_seq()
        ref = self.actor_ref
        timeout = self.config.judge_timeout
        cancel = self._timers.call_later(timeout, lambda: ref.tell(TimerFired(seq)))
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

    def _timer_fired(self, seq: int) -> None:
        judge = self._judge_timer
        if judge is not None and judge[0] == seq:  # the judge ran past its timeout: cancel its run
            run: KernelRun = judge[1]
            if self._run is run and not run.timed_out:
                run.timed_out = True
                self.tell_to(run.loop, CancelSession())
            return
        self._wakeup_timer(seq)

    def _loop_local(self, message: Any) -> bool:
        if isinstance(message, TimerFired):
            self._timer_fired(message.seq)
            return True
        if isinstance(message, Judged):
            then = self._judging.pop(message.seq, None)
            if then is not None:
                then(message.verdict)
            return True
        return False
