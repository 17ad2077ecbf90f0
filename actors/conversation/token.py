"""``CancellationToken``: interrupts the current (or next) turn of a conversation (RULES.md 9.13).

A token is an id plus a local flag. ``set_interrupt_token`` installs it on a conversation actor and binds it
there; ``cancel`` sets the flag and tells every conversation it is bound to, from any thread or process, as
a control (answered at once, never queued behind the running turn: IT-06). A process that only knows the id
cancels with ``CancellationToken.bound(node, address, token_id).cancel()``.
"""

from __future__ import annotations

import logging
import threading
import uuid

from transport.errors import BusError
from transport.node import Node

log = logging.getLogger(__name__)

__all__ = ["CancellationToken"]

CANCEL_TIMEOUT = 10.0


class CancellationToken:
    def __init__(self, token_id: str | None = None) -> None:
        self.token_id = token_id or uuid.uuid4().hex
        self._event = threading.Event()
        self._bound: list[tuple[Node, str]] = []

    @classmethod
    def bound(cls, node: Node, address: str, token_id: str) -> CancellationToken:
        """A handle on a token installed on the conversation at ``address`` by someone else."""
        token = cls(token_id)
        token.bind(node, address)
        return token

    def bind(self, node: Node, address: str) -> None:
        if (node, address) not in self._bound:
            self._bound.append((node, address))  # list.append is atomic: no lock (MB-01)

    def cancel(self) -> None:
        """Cancel: the bound conversations end their running turn, a model still generating at once and a
        running tool once it has returned (IT-01/IT-02)."""
        from actors.conversation.messages import CancelToken

        self._event.set()
        for node, address in list(self._bound):
            try:
                node.request(address, CancelToken(token_id=self.token_id), timeout=CANCEL_TIMEOUT)
            except BusError as exc:
                log.warning("cancelling token %s at %s failed: %r", self.token_id, address, exc)

    def is_cancelled(self) -> bool:
        return self._event.is_set()

    def __repr__(self) -> str:
        state = "cancelled" if self.is_cancelled() else "live"
        return f"CancellationToken({self.token_id[:8]}, {state})"
