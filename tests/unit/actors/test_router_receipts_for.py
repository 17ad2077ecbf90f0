"""GetReceiptsFor: the receipts of every provider turn under one parent operation, from the Router.

``kbus run``/``kbus chat`` show them after each turn, in-process and on a ``--connect``-ed node alike.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from actors.app.wiring import registry
from actors.router.actor import RouterActor
from actors.router.client import RouterClient
from actors.router.messages import StartTurn, TurnCompleted
from actors.router.providers.scripted import ScriptedProvider
from transport import Node


def _turn(router: RouterClient, parent: uuid.UUID) -> TurnCompleted:
    started = router.start_turn(
        StartTurn(user_id="u1", parent_operation_id=parent, model="scripted", input="hi", tool_description="")
    )
    *_, last = router.events(started.operation_id)
    assert isinstance(last, TurnCompleted)
    return last


@pytest.mark.parametrize("ledger", [True, False])
def test_receipts_for_a_parent_operation_oldest_first(
    make_node: Callable[..., Node], tmp_path: Path, ledger: bool
) -> None:
    node = make_node("n1", registry=registry())
    clock = iter(range(1000, 2000, 10))
    node.spawn(
        RouterActor,
        "router",
        data_dir=tmp_path if ledger else None,
        providers={"scripted": ScriptedProvider()},
        clock_ms=lambda: next(clock),
    )
    router = RouterClient(node, "n1/router", timeout=10)
    parent, other = uuid.uuid4(), uuid.uuid4()
    first, _, second = _turn(router, parent), _turn(router, other), _turn(router, parent)
    receipts = router.receipts_for(parent)
    assert [r.receipt_id for r in receipts] == [first.receipt.receipt_id, second.receipt.receipt_id]
    assert all(r.parent_operation_id == parent and r.status == "completed" for r in receipts)
    assert router.receipts_for(uuid.uuid4()) == ()


def test_receipts_for_reads_the_ledger_after_a_restart(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    node = make_node("n1", registry=registry())
    ref = node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": ScriptedProvider()})
    parent = uuid.uuid4()
    done = _turn(RouterClient(node, "n1/router", timeout=10), parent)
    ref.stop(block=True, timeout=10)
    node.spawn(RouterActor, "router2", data_dir=tmp_path, providers={"scripted": ScriptedProvider()})
    assert RouterClient(node, "n1/router2", timeout=10).receipts_for(parent) == (done.receipt,)
