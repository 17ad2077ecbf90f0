"""A session host in its own process: a node with a ``HostActor`` wrapping a small scripted application.

The application runs one tool round: round 1 prepares a turn, its tool call is executed (the calculator
answers 42), the round completes; round 2 completes the session with the final answer. Every call is
printed as ``CALL <name> <detail>`` so a test can follow the host's side of the protocol.
Prints ``READY {"endpoints": [...]}`` once bound; serves until SIGTERM or stdin closes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from actors.app.wiring import registry
from actors.inference.handle import PreparedRound
from actors.router.actor import RouterActor
from actors.router.providers.scripted import ScriptedProvider
from actors.runs.session import (
    HostActor,
    ProviderResume,
    RoundCompletion,
    RoundPreparation,
    SessionControl,
    SessionToolOutcome,
)
from actors.types import ToolCall
from transport import KeyPair, Node, Security


def say(*parts: Any) -> None:
    print("CALL", *parts, flush=True)


class CalculatorApp:
    """The application object (a SessionHost): one tool, a fixed plan."""

    def __init__(self) -> None:
        self.runs = 0

    def prepare_round(self, round: int) -> Any:
        say("prepare_round", round)
        if round > 1:
            return RoundPreparation.Complete(answer="six times seven is 42")
        return RoundPreparation.Run(
            prepared=PreparedRound(
                input="What is 6*7?",
                provider_input="What is 6*7?",
                continuation=None,
                model="scripted",
                reasoning_effort="low",
                tool_description="calc(expression)",
                timeout=None,
            )
        )

    def record(self, event: Any) -> None:
        say("record", type(event).__name__)

    def execute_tool(self, call: Any, provider_operation_id: uuid.UUID) -> Any:
        self.runs += 1
        say("execute_tool", call.name if isinstance(call, ToolCall) else "invalid", self.runs)
        return SessionToolOutcome.success("42")

    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any:
        say("prepare_provider_resume", outcome.text)
        return ProviderResume.Continue(outcome=outcome)

    def complete_capture(self, capture: Any, contents: str) -> Any:
        say("complete_capture")
        return SessionControl.Continue()

    def complete_round(self, completion: RoundCompletion) -> Any:
        say("complete_round", json.dumps(completion.answer))
        return SessionControl.Continue()


class TwoToolsApp(CalculatorApp):
    """Two tools per round: ``fast`` answers at once; ``slow`` never finishes when ``hang`` is set (the
    process is then killed mid-tool). Each time a tool really runs it appends its name to ``effect_log``
    (when given), then prints ``EXECUTE <tool>``. With ``gate_resume``, the first resume decision on the
    slow tool's result is answered only once ``gate`` is written to again (a test kills a process there:
    just after the result, before the run can go on)."""

    def __init__(
        self, hang: bool, effect_log: Path | None = None, gate: Path | None = None, gate_resume: bool = False
    ) -> None:
        super().__init__()
        self.hang = hang
        self.effect_log = effect_log
        self.gate = gate
        self.gate_resume = gate_resume
        self.pending: list[concurrent.futures.Future[Any]] = []

    def _after_gate(self, value: Any) -> concurrent.futures.Future[Any]:
        """``value``, once the test opens the FIFO ``gate`` for writing (the host's thread is not held)."""
        gated: concurrent.futures.Future[Any] = concurrent.futures.Future()
        gate = self.gate
        assert gate is not None

        def wait() -> None:
            with gate.open() as f:
                f.read()
            gated.set_result(value)

        threading.Thread(target=wait, daemon=True).start()
        return gated

    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any:
        decided = super().prepare_provider_resume(outcome)
        if self.gate_resume and outcome.text == "slow done":
            self.gate_resume = False
            return self._after_gate(decided)
        return decided

    def execute_tool(self, call: Any, provider_operation_id: uuid.UUID) -> Any:
        name = call.name if isinstance(call, ToolCall) else "invalid"
        if self.effect_log is not None:
            with self.effect_log.open("a") as f:
                f.write(name + "\n")
                f.flush()
                os.fsync(f.fileno())
        print("EXECUTE", name, flush=True)
        if name == "slow" and self.hang:
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self.pending.append(future)  # never resolved: the effect is still running when we die
            return future
        if name == "slow" and self.gate is not None:  # it finishes when the test writes to the FIFO
            return self._after_gate(SessionToolOutcome.success(f"{name} done"))
        return SessionToolOutcome.success(f"{name} done")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--stdin-lifeline", action="store_true", help="stop when stdin closes (always on)")
    ap.add_argument("--app", choices=("calculator", "two-tools"), default="calculator")
    ap.add_argument("--hang", action="store_true", help="two-tools: the slow tool never finishes")
    ap.add_argument("--effects", help="the effect store (SQLite file): tool outcomes by idempotency key")
    ap.add_argument("--effect-log", help="two-tools: append-only file, one line per real tool run")
    ap.add_argument("--gate", help="two-tools: the slow tool finishes once this FIFO is written to")
    ap.add_argument(
        "--gate-resume",
        action="store_true",
        help="two-tools: the first resume on slow's result waits for --gate too",
    )
    ap.add_argument("--secret-key-file", help="this node's CURVE secret key (tcp)")
    ap.add_argument("--allow", action="append", default=[], help="NODE=Z85KEY allowed to connect")
    ap.add_argument("--router-script", help="also run a Router here, its scripted provider's script (JSON)")
    args = ap.parse_args()
    keys = KeyPair.load(args.secret_key_file) if args.secret_key_file else None
    allow = {key: name for name, key in (a.split("=", 1) for a in args.allow)}
    node = Node(args.name, bind=[args.bind], registry=registry(), security=Security(keys=keys, allow=allow))
    node.start()
    log = Path(args.effect_log) if args.effect_log else None
    app = (
        CalculatorApp()
        if args.app == "calculator"
        else TwoToolsApp(args.hang, log, Path(args.gate) if args.gate else None, args.gate_resume)
    )
    node.spawn(HostActor, "host", host=app, effects=args.effects)
    if args.router_script:
        provider = ScriptedProvider([json.loads(args.router_script)])
        node.spawn(RouterActor, "router", providers={"scripted": provider})
    print("READY " + json.dumps({"endpoints": list(node.endpoints)}), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
