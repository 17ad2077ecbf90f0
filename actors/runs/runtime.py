"""``InferenceRuntime``: the seed's router-backed ``AgentRuntime`` (seed 000; RULES.md RT-02, RT-03, SI-01).

It resolves models, starts one inference handle per ``start_session_inference``, and fronts the two runs built
on the handle: the primary-session loop (``session.py``) and the subagent run (``subagent.py``). It sits above
both, so neither imports it.
"""

from __future__ import annotations

import concurrent.futures
import uuid
from typing import Any

from actors.inference.facade import SessionInference, typed_handle_error
from actors.inference.handle import (
    AwaitStarted,
    InferenceError,
    InferenceHandleActor,
    InferenceStarted,
    SessionInferenceRequest,
)
from actors.router.messages import ResolveModel
from actors.runs.session import run_session, run_session_future
from actors.runs.subagent import PROTOCOL_RESERVE_TOKENS, run, run_future
from actors.types import ResolvedAgentModel
from transport.errors import TRANSPORT_ERRORS, BusError
from transport.node import Node
from transport.pending import chained, forbid_blocking

__all__ = ["InferenceRuntime"]


def _resolve_error(requested: str, error: BusError) -> BusError:
    """RT-03: a Router error becomes an InferenceError caused by it; transport outcomes stay as they are."""
    if type(error) in TRANSPORT_ERRORS:
        return error
    wrapped = InferenceError(f"resolving model {requested[:80]!r} failed: {error.message}")
    wrapped.__cause__ = error
    return wrapped


class InferenceRuntime:
    """The seed's router-backed ``AgentRuntime``: cheap to clone; clones share one Router (RT-02).

    ``router_address`` is the Router actor (any node); handle actors are spawned on ``handles_on``
    (default: ``node``), which must be able to reach the Router.
    """

    def __init__(
        self,
        node: Node,
        router_address: str,
        *,
        handles_on: Node | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.node = node
        self.router_address = router_address
        self.handles_on = handles_on or node
        self.timeout = timeout

    def _t(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def clone(self) -> InferenceRuntime:
        return InferenceRuntime(
            self.node, self.router_address, handles_on=self.handles_on, timeout=self.timeout
        )

    def resolve_model(self, requested: str, *, timeout: float | None = None) -> ResolvedAgentModel:
        try:
            return self.node.request(  # type: ignore[no-any-return]
                self.router_address, ResolveModel(requested=requested), timeout=self._t(timeout)
            )
        except BusError as exc:
            error = _resolve_error(requested, exc)
            if error is exc:
                raise
            raise error  # noqa: B904 - its __cause__ is the Router's error already (RT-03)

    def resolve_model_future(
        self, requested: str, *, timeout: float | None = None
    ) -> concurrent.futures.Future[Any]:
        inner = self.node.request_future(
            self.router_address, ResolveModel(requested=requested), timeout=self._t(timeout)
        )
        return chained(inner, error=lambda e: _resolve_error(requested, e) if isinstance(e, BusError) else e)

    def start_session_inference(
        self, request: SessionInferenceRequest, *, timeout: float | None = None
    ) -> SessionInference:
        forbid_blocking("InferenceRuntime.start_session_inference")
        future = self.start_session_inference_future(request, timeout=timeout)
        return future.result(self._t(timeout) + 1.0)  # type: ignore[no-any-return]

    def start_session_inference_future(
        self, request: SessionInferenceRequest, *, timeout: float | None = None
    ) -> concurrent.futures.Future[Any]:
        """SI-01: one handle actor, one StartTurn; resolves once the Router answered it."""
        node = self.handles_on
        t = self._t(timeout)
        name = f"inference.{uuid.uuid4().hex}"
        ref = node.spawn(
            InferenceHandleActor, name, router=self.router_address, request=request, start_timeout=t
        )
        address = f"{node.name}/{name}"
        inner = node.request_future(address, AwaitStarted(), timeout=t)
        outer: concurrent.futures.Future[Any] = concurrent.futures.Future()
        handle_timeout = self.timeout

        def done(fut: concurrent.futures.Future[Any]) -> None:
            error = fut.exception()
            if error is not None:
                ref.stop(block=False)
                outer.set_exception(typed_handle_error(error, address))
                return
            started: InferenceStarted = fut.result()
            outer.set_result(
                SessionInference(node, address, started.operation_id, started.model, timeout=handle_timeout)
            )

        inner.add_done_callback(done)
        return outer

    def run_session_future(
        self, request: Any, host: str, *, timeout: float | None = None, loop_at: str | None = None
    ) -> concurrent.futures.Future[Any]:
        """The primary-session loop (``session.py``) against the host actor at ``host``; the loop runs
        on this node, or in the process of the ``SessionLoopService`` at ``loop_at``. Cancelling the future
        ends the run at its next step boundary (the open turn accounted for, its receipt recorded once)."""

        return run_session_future(
            self.node, self.router_address, request, host, timeout=timeout, loop_at=loop_at
        )

    def run_session(
        self, request: Any, host: str, *, timeout: float | None = None, loop_at: str | None = None
    ) -> str | None:

        return run_session(self.node, self.router_address, request, host, timeout=timeout, loop_at=loop_at)

    def run_future(
        self,
        request: Any,
        host: str,
        *,
        timeout: float | None = None,
        protocol_reserve_tokens: int | None = None,
    ) -> concurrent.futures.Future[Any]:
        """The single-turn subagent run (``subagent.py``) against the ``Host`` actor at ``host``."""

        reserve = PROTOCOL_RESERVE_TOKENS if protocol_reserve_tokens is None else protocol_reserve_tokens
        return run_future(
            self.node, self.router_address, request, host, timeout=timeout, protocol_reserve_tokens=reserve
        )

    def run(
        self,
        request: Any,
        host: str,
        *,
        timeout: float | None = None,
        protocol_reserve_tokens: int | None = None,
    ) -> Any:

        reserve = PROTOCOL_RESERVE_TOKENS if protocol_reserve_tokens is None else protocol_reserve_tokens
        return run(
            self.node, self.router_address, request, host, timeout=timeout, protocol_reserve_tokens=reserve
        )
