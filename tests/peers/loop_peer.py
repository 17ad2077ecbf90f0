"""A conversation with its loops in its own process: a node with a Router (scripted provider), a tool host
and a ConversationActor at ``<name>/chat`` over a session file, with ``schedule_wakeup`` registered on the
slot ``s1`` (wall clock) and, optionally, a goal evaluator that prints ``JUDGING <turns>`` and either blocks
(``--hold-judge``: the test SIGKILLs it there) or answers the ``--verdicts`` in order.
``--fake-crash-after-turn-finished N`` is a fault hook (a fake: no real peer stops at a chosen line): once
the N-th ``turn_finished`` record is on disk the conversation's thread prints ``CRASH_POINT turn_finished N``
and blocks there, so the test's SIGKILL lands exactly between a turn's end and anything after it.

Every goal, wakeup and job event is printed as ``EVENT <name> <json>``. Prints ``READY {"endpoints": [...],
"address": ...}`` once bound; serves until SIGTERM or stdin closes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actors.app.wiring import registry
from actors.conversation import CallbackSink, ConversationRuntime, Message, ToolRegistry
from actors.conversation.journal import Journal
from actors.conversation.runtime import WakeupSlot
from actors.conversation.types import LOOP_EVENTS, GoalVerdict
from actors.router.actor import RouterActor
from actors.router.providers.scripted import ScriptedProvider
from transport import Node


class PeerEvaluator:
    def __init__(self, verdicts: list[dict[str, Any]], hold: bool) -> None:
        self.verdicts = verdicts
        self.hold = hold
        self.calls = 0

    def evaluate(self, condition: str, transcript_tail: Sequence[Message]) -> GoalVerdict:
        self.calls += 1
        print("JUDGING", self.calls, flush=True)
        if self.hold:
            threading.Event().wait(120)  # the test SIGKILLs this process here
        v = self.verdicts.pop(0) if self.verdicts else {"achieved": False, "reason": "no verdict left"}
        return GoalVerdict(achieved=bool(v["achieved"]), reason=str(v["reason"]))


def fake_crash_after_turn_finished(nth: int) -> None:
    """The fault hook (see the module docstring): wraps ``Journal.finished`` in this process only."""
    original = Journal.finished
    seen = [0]

    def finished(self: Journal, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        seen[0] += 1
        if seen[0] == nth:
            print("CRASH_POINT turn_finished", nth, flush=True)
            threading.Event().wait(120)  # the test SIGKILLs this process here

    Journal.finished = finished  # type: ignore[method-assign]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--stdin-lifeline", action="store_true", help="stop when stdin closes (always on)")
    ap.add_argument("--session-file", required=True)
    ap.add_argument("--scripts", default="[]", help="the scripted provider's scripts (JSON list)")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--verdicts", help="a JSON list of {achieved, reason}: use the peer evaluator")
    ap.add_argument("--hold-judge", action="store_true", help="the peer evaluator blocks")
    ap.add_argument("--fake-crash-after-turn-finished", type=int, default=0, help="the fault hook")
    args = ap.parse_args()
    if args.fake_crash_after_turn_finished:
        fake_crash_after_turn_finished(args.fake_crash_after_turn_finished)
    node = Node(args.name, bind=[args.bind], registry=registry())
    node.start()
    provider = ScriptedProvider(json.loads(args.scripts))
    node.spawn(RouterActor, "router", data_dir=args.data_dir, providers={"scripted": provider})

    def show(event: Any) -> None:
        if isinstance(event, LOOP_EVENTS):
            print("EVENT", type(event).__name__, json.dumps(dataclasses.asdict(event)), flush=True)

    builder = ConversationRuntime.builder().node(node).llm("scripted").tools(ToolRegistry()).name("chat")
    builder.session_file(Path(args.session_file)).event_sink(CallbackSink(show))
    if args.verdicts is not None or args.hold_judge:
        builder.goal_evaluator(PeerEvaluator(json.loads(args.verdicts or "[]"), args.hold_judge))
    rt = builder.build()
    rt.register_wakeup_tool(WakeupSlot("s1"), max_delay_s=3600)
    print("READY " + json.dumps({"endpoints": list(node.endpoints), "address": rt.address}), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())

    def lifeline() -> None:
        for _ in sys.stdin:
            pass
        done.set()

    threading.Thread(target=lifeline, daemon=True).start()
    done.wait()
    rt.stop()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
