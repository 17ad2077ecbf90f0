"""Bare runs on the node's host pool (actors/runs/machine.py ``spawn_run``): a ``run_session`` or a subagent
``run`` is a state machine a hosting actor hosts, so threads grow with the pool's configured size, not with
the number of runs in flight (issue 15, item 5)."""

from __future__ import annotations

import concurrent.futures
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.app.wiring import registry
from actors.base import HostPool
from actors.inference.handle import PreparedRound
from actors.router.actor import RouterActor
from actors.router.providers.scripted import ScriptedProvider
from actors.runs.machine import RUN_HOSTS
from actors.runs.session import (
    HostActor,
    ProviderResume,
    RoundPreparation,
    SessionControl,
    SessionEvent,
    SessionRunRequest,
    SessionToolOutcome,
    run_session_future,
)
from transport.node import Node

WAIT = 60.0
HOSTS = 2
N = 20  # then 2N runs in flight at once


class HeldHost:
    """A session host whose first record of each run (its ``InferenceSubmitted``) is a Future the test
    resolves: until then every run waits, in flight, holding whatever threads it holds."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the test's own bookkeeping, read from the test's thread
        self.held: list[concurrent.futures.Future[Any]] = []
        self.reached = threading.Semaphore(0)  # released once per run held

    def prepare_round(self, round: int) -> Any:
        return RoundPreparation.Run(
            prepared=PreparedRound(
                input="go",
                provider_input="go",
                continuation=None,
                model="scripted",
                reasoning_effort="",
                tool_description="t(x)",
                timeout=None,
            )
        )

    def record(self, event: Any) -> Any:
        if isinstance(event, SessionEvent.InferenceSubmitted):
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            with self.lock:
                self.held.append(future)
            self.reached.release()
            return future
        return None

    def execute_tool(self, call: Any, provider_operation_id: uuid.UUID) -> Any:
        return SessionToolOutcome.success("ok")

    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any:
        return ProviderResume.Continue(outcome=outcome)

    def complete_capture(self, capture: Any, contents: Any) -> Any:
        return SessionControl.Complete(answer=contents)

    def complete_round(self, completion: Any) -> Any:
        return SessionControl.Complete(answer=completion.answer)

    def wait_held(self, count: int) -> None:
        """Bounded: until ``count`` more runs are held at their first record."""
        for _ in range(count):
            assert self.reached.acquire(timeout=WAIT), "a run never reached its first record"

    def release(self) -> None:
        with self.lock:
            held, self.held = self.held, []
        for future in held:
            future.set_result(None)


def test_threads_do_not_grow_with_the_session_runs_in_flight(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """N bare ``run_session`` runs held in flight, then 2N: the node's thread count is the same for both and
    within the run pool's size of what it was before any; released, every run answers."""
    node = make_node("n1", registry=registry())
    HostPool.configure(node, RUN_HOSTS, HOSTS)
    provider = ScriptedProvider(default=[{"call": {"name": "t", "arguments": {"x": 1}}}, {"text": "done"}])
    node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider})
    host = HeldHost()
    node.spawn(HostActor, "host", host=host)
    before = {t.name for t in threading.enumerate()}

    def start(n: int) -> list[concurrent.futures.Future[Any]]:
        return [
            run_session_future(
                node,
                "n1/router",
                SessionRunRequest(user_id="u", operation_id=uuid.uuid4(), rounds_used=0, round_limit=1),
                "n1/host",
                timeout=WAIT,
            )
            for _ in range(n)
        ]

    runs = start(N)
    host.wait_held(N)
    with_n = {t.name for t in threading.enumerate()}
    runs += start(N)
    host.wait_held(N)
    with_2n = {t.name for t in threading.enumerate()}
    host.release()
    assert [run.result(WAIT) for run in runs] == ["done"] * (2 * N)
    assert with_2n == with_n, (before, with_n, with_2n)
    added = with_n - before - {"kbus-router-tick"}  # the Router's ticker starts with its first turn
    assert len(added) <= HOSTS and all(name.startswith("HostingActor") for name in added), added
