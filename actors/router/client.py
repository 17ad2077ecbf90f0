"""``RouterClient``: the Router's facade for any thread in any process on the bus.

Every method blocks the calling thread until the Router's answer (bounded by ``timeout``) and has a
``*_future`` twin returning a ``concurrent.futures.Future``. Actors do not use this facade (they must not
block): they send the same messages with ``BusActor.ask`` and a continuation.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from actors.router.messages import (
    CancelOperation,
    FinishUnavailable,
    GetReceipt,
    GetReceiptsFor,
    GetRouterStats,
    NextTurnEvent,
    ResolveModel,
    RespondCall,
    RouterStats,
    StartTurn,
    StreamTurnEvents,
    TurnEvent,
    TurnEventBatch,
    TurnStarted,
)
from actors.types import ResolvedAgentModel, ToolResult, UsageReceipt
from transport.node import Node
from transport.pending import BusFuture


class RouterClient:
    """Thin and stateless: every call is one request to the Router actor at ``address``."""

    def __init__(self, node: Node, address: str, *, timeout: float = 30.0) -> None:
        self.node = node
        self.address = address
        self.timeout = timeout

    def _t(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def resolve_model(self, requested: str, *, timeout: float | None = None) -> ResolvedAgentModel:
        return self.node.request(self.address, ResolveModel(requested=requested), timeout=self._t(timeout))  # type: ignore[no-any-return]

    def resolve_model_future(self, requested: str, *, timeout: float | None = None) -> BusFuture:
        return self.node.request_future(
            self.address, ResolveModel(requested=requested), timeout=self._t(timeout)
        )

    def start_turn(self, spec: StartTurn, *, timeout: float | None = None) -> TurnStarted:
        return self.node.request(self.address, spec, timeout=self._t(timeout))  # type: ignore[no-any-return]

    def start_turn_future(self, spec: StartTurn, *, timeout: float | None = None) -> BusFuture:
        return self.node.request_future(self.address, spec, timeout=self._t(timeout))

    def next_event(self, operation_id: uuid.UUID, *, timeout: float | None = None) -> TurnEvent:
        return self.node.request(  # type: ignore[no-any-return]
            self.address, NextTurnEvent(operation_id=operation_id), timeout=self._t(timeout)
        )

    def next_event_future(self, operation_id: uuid.UUID, *, timeout: float | None = None) -> BusFuture:
        return self.node.request_future(
            self.address, NextTurnEvent(operation_id=operation_id), timeout=self._t(timeout)
        )

    def events(self, operation_id: uuid.UUID, *, timeout: float | None = None) -> Iterator[TurnEvent]:
        """Every remaining event of the turn as it happens, ending with its terminal event (one request)."""
        for part in self.node.stream(
            self.address, StreamTurnEvents(operation_id=operation_id), timeout=self._t(timeout)
        ):
            if isinstance(part, TurnEventBatch):
                yield from part.events
            else:
                yield part

    def respond(
        self, operation_id: uuid.UUID, call_id: str, result: ToolResult, *, timeout: float | None = None
    ) -> None:
        self.node.request(
            self.address,
            RespondCall(operation_id=operation_id, call_id=call_id, result=result),
            timeout=self._t(timeout),
        )

    def respond_future(
        self, operation_id: uuid.UUID, call_id: str, result: ToolResult, *, timeout: float | None = None
    ) -> BusFuture:
        return self.node.request_future(
            self.address,
            RespondCall(operation_id=operation_id, call_id=call_id, result=result),
            timeout=self._t(timeout),
        )

    def finish_unavailable(self, operation_id: uuid.UUID, *, timeout: float | None = None) -> UsageReceipt:
        return self.node.request(  # type: ignore[no-any-return]
            self.address, FinishUnavailable(operation_id=operation_id), timeout=self._t(timeout)
        )

    def finish_unavailable_future(
        self, operation_id: uuid.UUID, *, timeout: float | None = None
    ) -> BusFuture:
        return self.node.request_future(
            self.address, FinishUnavailable(operation_id=operation_id), timeout=self._t(timeout)
        )

    def cancel(self, operation_id: uuid.UUID, *, timeout: float | None = None) -> tuple[uuid.UUID, ...]:
        reply: Any = self.node.request(
            self.address, CancelOperation(operation_id=operation_id), timeout=self._t(timeout)
        )
        return tuple(reply.operation_ids)

    def cancel_future(self, operation_id: uuid.UUID, *, timeout: float | None = None) -> BusFuture:
        return self.node.request_future(
            self.address, CancelOperation(operation_id=operation_id), timeout=self._t(timeout)
        )

    def receipt(self, operation_id: uuid.UUID, *, timeout: float | None = None) -> UsageReceipt:
        return self.node.request(  # type: ignore[no-any-return]
            self.address, GetReceipt(operation_id=operation_id), timeout=self._t(timeout)
        )

    def receipts_for(
        self, parent_operation_id: uuid.UUID, *, timeout: float | None = None
    ) -> tuple[UsageReceipt, ...]:
        """The receipts of the provider turns started under ``parent_operation_id``, oldest first."""
        reply: Any = self.node.request(
            self.address, GetReceiptsFor(parent_operation_id=parent_operation_id), timeout=self._t(timeout)
        )
        return tuple(reply.receipts)

    def stats(self, *, timeout: float | None = None) -> RouterStats:
        """How much per-turn state the Router holds now (turns in memory, lineage links, recent receipts)."""
        return self.node.request(self.address, GetRouterStats(), timeout=self._t(timeout))  # type: ignore[no-any-return]
