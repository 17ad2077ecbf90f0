"""The node's loop pool (actors/base.py ``LOOP_HOSTS``, ``BusActor.PLACED_ON``): ``Node.spawn`` places the
Router on the thread its runs and conversations are hosted on, so a round's messages between them need no
thread hand-off; a Router that serves peers on its own socket, or a node configured with no pool, keeps a
thread of its own (issue 15, items 5 and 6)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.app.wiring import registry
from actors.base import DEFAULT_HOSTS, LOOP_HOSTS, BusActor, Context, HostPool
from actors.inference.handle import PreparedRound
from actors.router.actor import RouterActor
from actors.router.client import RouterClient
from actors.router.messages import StartTurn, TurnCompleted
from actors.router.providers.base import TurnIO, TurnRequest, TurnSteps
from actors.router.providers.scripted import ScriptedProvider
from actors.runs.session import (
    HostActor,
    ProviderResume,
    RoundPreparation,
    SessionControl,
    SessionRunRequest,
    SessionToolOutcome,
    run_session,
)
from transport.messages import Echo
from transport.node import Node

WAIT = 20.0


class WhereScripted(ScriptedProvider):
    """The scripted model (stepped on the Router's thread), noting the thread each turn runs on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def steps(self, request: TurnRequest, io: TurnIO) -> TurnSteps:
        self.threads.append(threading.get_ident())
        return (yield from super().steps(request, io))


class Where(BusActor):
    """Answers any Echo with the ident of the thread it runs on."""

    def handle(self, message: Any, ctx: Context) -> Any:
        return Echo(data={"thread": threading.get_ident()})


def turn_thread(node: Node, provider: WhereScripted) -> int:
    """Run one scripted turn to its end and return the thread the provider ran on."""
    router = RouterClient(node, f"{node.name}/router", timeout=WAIT)
    start = StartTurn(
        user_id="u", parent_operation_id=uuid.uuid4(), model="scripted", input="hi", tool_description="none"
    )
    started = router.start_turn(start)
    while not isinstance(router.next_event(started.operation_id), TurnCompleted):
        pass  # each read is bounded by the client's timeout
    (thread,) = provider.threads
    return thread


def loop_thread(node: Node) -> int:
    HostPool.of(node, LOOP_HOSTS).spawn(Where, "where")
    reply = node.request(f"{node.name}/where", Echo(), timeout=WAIT)
    return int(reply.data["thread"])


def test_the_loop_pool_has_one_host_unless_configured() -> None:
    assert DEFAULT_HOSTS == 1


def test_node_spawn_places_the_router_on_the_loop_pool_beside_the_runs(
    make_node: Callable[..., Node],
) -> None:
    node = make_node("n1", registry=registry())
    provider = WhereScripted()
    before = {t.ident for t in threading.enumerate()}
    node.spawn(RouterActor, "router", providers={"scripted": provider})
    assert turn_thread(node, provider) == loop_thread(node)
    # The pool's one host is the only thread the Router brought (its ticker aside): none of its own.
    started = [t for t in threading.enumerate() if t.ident not in before]
    assert [t.name for t in started if t.name.startswith("RouterActor")] == []


def test_with_no_loop_pool_the_router_has_a_thread_of_its_own(make_node: Callable[..., Node]) -> None:
    node = make_node("n1", registry=registry())
    HostPool.configure(node, LOOP_HOSTS, 0)  # [node] hosts = 0
    provider = WhereScripted()
    before = {t.ident for t in threading.enumerate()}
    node.spawn(RouterActor, "router", providers={"scripted": provider})
    thread = turn_thread(node, provider)
    assert thread not in before
    assert thread != loop_thread(node)


def test_a_router_on_a_node_with_endpoints_keeps_its_thread_and_socket(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    node = make_node("n1", registry=registry(), bind=[f"ipc://{tmp_path}/n1"])
    provider = WhereScripted()
    node.spawn(RouterActor, "router", providers={"scripted": provider})
    assert turn_thread(node, provider) != loop_thread(node)
    assert node.direct_endpoints("router")  # it serves peers on its own socket, from its own thread


class WhereHost:
    """A session host that never blocks, noting the thread of each callback: one tool round, then done."""

    def __init__(self) -> None:
        self.threads: set[int] = set()

    def _here(self) -> None:
        self.threads.add(threading.get_ident())

    def prepare_round(self, round: int) -> Any:
        self._here()
        prepared = PreparedRound(
            input="go",
            provider_input="go",
            continuation=None,
            model="scripted",
            reasoning_effort="",
            tool_description="t(x)",
            timeout=None,
        )
        return RoundPreparation.Run(prepared=prepared)

    def record(self, event: Any) -> None:
        self._here()

    def execute_tool(self, call: Any, provider_operation_id: uuid.UUID) -> Any:
        self._here()
        return SessionToolOutcome.success("ok")

    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any:
        self._here()
        return ProviderResume.Continue(outcome=outcome)

    def complete_capture(self, capture: Any, contents: Any) -> Any:
        return SessionControl.Complete(answer=contents)

    def complete_round(self, completion: Any) -> Any:
        self._here()
        return SessionControl.Complete(answer=completion.answer)


def tool_round_with_host_on_the_loop(node: Node) -> tuple[WhereHost, WhereScripted]:
    """One ``run_session`` tool round on ``node``, its ``HostActor`` placed on the loop pool (README); the
    host and the provider, with the threads they ran on."""
    provider = WhereScripted()
    provider.add([{"call": {"name": "t", "arguments": {"x": 1}}}, {"text": "done"}])
    node.spawn(RouterActor, "router", providers={"scripted": provider})
    host = WhereHost()
    HostPool.of(node, LOOP_HOSTS).spawn(HostActor, "host", host=host)
    request = SessionRunRequest(user_id="u", operation_id=uuid.uuid4(), rounds_used=0, round_limit=1)
    assert run_session(node, f"{node.name}/router", request, f"{node.name}/host", timeout=WAIT) == "done"
    return host, provider


def test_a_host_that_never_blocks_may_share_the_loop_thread_with_its_runs(
    make_node: Callable[..., Node],
) -> None:
    """Placed on the loop pool (README), a ``HostActor``'s callbacks run on the thread of the run and the
    Router: a whole tool round, host calls included, hands nothing to another thread."""
    node = make_node("n1", registry=registry())
    host, provider = tool_round_with_host_on_the_loop(node)
    assert host.threads == {loop_thread(node)} == set(provider.threads)


def test_on_a_node_with_endpoints_a_host_placed_on_the_loop_keeps_its_thread_and_socket(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """README: a ``HostActor`` is direct; on a node with endpoints the pool gives it a thread of its own,
    where it serves remote runs on its own socket."""
    node = make_node("n1", registry=registry(), bind=[f"ipc://{tmp_path}/n1"])
    host, _ = tool_round_with_host_on_the_loop(node)
    assert loop_thread(node) not in host.threads and len(host.threads) == 1
    assert node.direct_endpoints("host")
