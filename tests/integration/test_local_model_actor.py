"""The local model is owned by one actor (issue 15 item 5): its mailbox is the queue of turns, a cancel is a
message it handles between chunks of generation, on the real embedded SmolLM2 model (RT-12: cancelling the
parent at the Router ends the child turn)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from integration.test_provider_local import request, run_bounded
from peers.turn_io import RecordingTurnIO

from actors.app.wiring import registry
from actors.router.actor import RouterActor
from actors.router.client import RouterClient
from actors.router.messages import StartTurn, TurnCancelled, TurnCompleted, TurnTextDelta
from actors.router.providers.base import ProviderEvent, ProviderOutcome, TextDelta
from actors.router.providers.local import LocalProvider
from actors.router.stepping import GetWorkerStats, WorkerStats
from transport import Node

pytestmark = pytest.mark.integration

STORY = "Write a very long story about a lighthouse keeper."


@pytest.fixture
def provider() -> Iterator[LocalProvider]:
    local = LocalProvider(tool_choice="none", temperature=0.0, seed=7)  # always an answer: text to cancel
    yield local
    local.close()


def worker_stats(provider: LocalProvider) -> WorkerStats:
    stats: WorkerStats = provider.turn_host().ask(GetWorkerStats(), timeout=30)
    return stats


def test_a_cancel_reaches_a_turn_mid_generation_through_the_models_mailbox(
    make_node: Callable[..., Node], tmp_path: Path, provider: LocalProvider
) -> None:
    """RT-12 on the embedded model: the Router's cancel is a message the model's actor handles between two
    chunks; the turn has ended there (the actor hosts nothing) before the actor answers anything after it,
    and the next turn gets the model."""
    node = make_node("n1", registry=registry())
    node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"local": provider})
    router = RouterClient(node, "n1/router", timeout=120)
    parent = uuid.uuid4()
    spec = StartTurn(
        user_id="u1",
        parent_operation_id=parent,
        model="smollm2",
        input=STORY,
        instructions="You are a storyteller.",
        tool_description="no tools",
        max_output_tokens=400,
    )
    op = router.start_turn(spec).operation_id
    deltas = 0
    while deltas < 3:
        if isinstance(router.next_event(op), TurnTextDelta):
            deltas += 1
    assert router.cancel(parent) == (op,)
    # The Router told the model's actor the cancel before it answered; this request comes after it.
    assert worker_stats(provider).hosted == 0
    with pytest.raises(TurnCancelled) as caught:
        while True:
            router.next_event(op)
    assert caught.value.receipt is not None and caught.value.receipt.status == "interrupted"
    again = router.start_turn(
        StartTurn(
            user_id="u1",
            parent_operation_id=uuid.uuid4(),
            model="smollm2",
            input="Say hello.",
            tool_description="no tools",
            max_output_tokens=8,
        )
    ).operation_id
    while not isinstance(router.next_event(again), TurnCompleted):
        pass


def test_queued_turns_are_served_in_order_one_generation_at_a_time(provider: LocalProvider) -> None:
    """Turn 0 generates; turns 1 and 2 arrive meanwhile and wait in the model actor's queue: every event of
    turn 1 comes after turn 0's last, and every event of turn 2 after turn 1's last (no interleaving, no
    overtaking)."""
    log: list[tuple[int, ProviderEvent]] = []
    first_delta = threading.Event()

    def recording(i: int) -> Callable[[RecordingTurnIO, ProviderEvent], None]:
        def on_emit(io: RecordingTurnIO, event: ProviderEvent) -> None:
            log.append((i, event))  # on the model's actor thread, in the order it steps
            if i == 0 and isinstance(event, TextDelta):
                first_delta.set()

        return on_emit

    outcomes: dict[int, Any] = {}

    def run(i: int, max_tokens: int) -> None:
        req = request("Tell me about the sea.", system="You are brief.", tool_choice="none",
                      max_output_tokens=max_tokens)  # fmt: skip
        outcomes[i] = run_bounded(provider, req, RecordingTurnIO(on_emit=recording(i)))

    threads = [threading.Thread(target=run, args=(0, 60), name="turn-0")]
    threads[0].start()
    assert first_delta.wait(120)  # turn 0 holds the model now
    for i in (1, 2):
        threads.append(threading.Thread(target=run, args=(i, 8), name=f"turn-{i}"))
        threads[i].start()
        while worker_stats(provider).queued < i:  # each bounded by the ask's timeout
            pass
    for thread in threads:
        thread.join(180)
    assert all(isinstance(outcomes[i], ProviderOutcome) for i in range(3)), outcomes
    order = [i for i, _ in log]
    assert order == sorted(order), order
