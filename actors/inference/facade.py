"""``SessionInference``: the blocking and future facade of one inference handle, usable from any thread in
any process (seed 000; RULES.md SI-*, MB-10). The handle itself is an actor (``handle.py``); this object only
sends it requests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from actors.inference.handle import Close, Event, FinishUnavailable, NextEvent, Respond, RespondAndRead
from actors.types import ResolvedAgentModel, ToolResult, UsageReceipt
from transport.errors import NotDelivered, Unavailable
from transport.messages import Ok
from transport.node import Node
from transport.pending import chained, forbid_blocking

__all__ = ["SessionInference", "typed_handle_error"]


def typed_handle_error(error: BaseException, address: str) -> BaseException:
    """MB-10: a handle that is gone is ``Unavailable`` (ActorUnavailable), whichever way it showed."""
    if isinstance(error, NotDelivered):
        gone = Unavailable(f"inference handle {address} is gone: {error.message}")
        gone.__cause__ = error
        return gone
    return error


def _event_or_none(reply: Any) -> Event | None:
    return None if isinstance(reply, Ok) else reply


def _none(reply: Any) -> None:
    return None


def _same(reply: Any) -> Any:
    return reply


class SessionInference:
    """One primary provider turn (seed ``SessionInference``), usable from any thread in any process.

    ``operation_id`` is the provider child operation (RT-12); with it the Router can account for the turn
    even if this handle's actor is gone (MB-10). ``close()`` (or leaving a ``with`` block) is the drop.
    """

    def __init__(
        self,
        node: Node,
        address: str,
        operation_id: uuid.UUID,
        model: ResolvedAgentModel | None = None,
        *,
        timeout: float = 30.0,
    ) -> None:
        self.node = node
        self.address = address
        self.operation_id = operation_id
        self.model = model
        self.timeout = timeout
        self._closed = False

    def _t(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _call(self, message: Any, timeout: float | None) -> Any:
        forbid_blocking("SessionInference")
        try:
            return self.node.request(self.address, message, timeout=self._t(timeout))
        except NotDelivered as exc:
            raise typed_handle_error(exc, self.address) from exc.__cause__

    def _future(
        self, message: Any, timeout: float | None, convert: Callable[[Any], Any]
    ) -> concurrent.futures.Future[Any]:
        inner = self.node.request_future(self.address, message, timeout=self._t(timeout))
        return chained(inner, convert, lambda error: typed_handle_error(error, self.address))

    def next_event(self, *, timeout: float | None = None) -> Event | None:
        return _event_or_none(self._call(NextEvent(), timeout))

    def next_event_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        return self._future(NextEvent(), timeout, _event_or_none)

    def respond(
        self, call_id: str, result: ToolResult, *, timeout: float | None = None, read_on: bool = False
    ) -> None:
        """Answer a surfaced call. ``read_on``: you call ``next_event`` right after, so the handle may read
        that event in the same exchange with the Router (``Respond.read_on``)."""
        self._call(Respond(call_id=call_id, result=result, read_on=read_on), timeout)

    def respond_future(
        self, call_id: str, result: ToolResult, *, timeout: float | None = None, read_on: bool = False
    ) -> concurrent.futures.Future[Any]:
        return self._future(Respond(call_id=call_id, result=result, read_on=read_on), timeout, _none)

    def respond_and_read(
        self, call_id: str, result: ToolResult, *, timeout: float | None = None
    ) -> Event | None:
        """``respond``, then ``next_event``, in one exchange with the handle (``RespondAndRead``): the next
        event, or None when the stream closed without completion. A respond error is raised as ``respond``
        raises it, and the call is answerable again (SI-11); a read error as ``next_event`` raises it."""
        return _event_or_none(self._call(RespondAndRead(call_id=call_id, result=result), timeout))

    def respond_and_read_future(
        self, call_id: str, result: ToolResult, *, timeout: float | None = None
    ) -> concurrent.futures.Future[Any]:
        return self._future(RespondAndRead(call_id=call_id, result=result), timeout, _event_or_none)

    def finish_unavailable(self, *, timeout: float | None = None) -> UsageReceipt:
        return self._call(FinishUnavailable(), timeout)  # type: ignore[no-any-return]

    def finish_unavailable_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        return self._future(FinishUnavailable(), timeout, _same)

    def close(self, *, timeout: float | None = None) -> None:
        """Cancel an active turn at the Router and release the handle; no receipt, no event (SI-17)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Unavailable):  # the handle is gone already: nothing left to release
            self._call(Close(), timeout)

    def close_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        self._closed = True
        return self._future(Close(), timeout, _none)

    def __enter__(self) -> SessionInference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropping is not evidence the provider had no effect: no accounting here, only a warning.
        if not getattr(self, "_closed", True):
            warnings.warn(
                f"SessionInference {getattr(self, 'operation_id', '?')} was not closed",
                ResourceWarning,
                stacklevel=1,
            )
