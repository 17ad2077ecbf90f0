"""Retry policies: only known-not-delivered failures (or unknown outcomes with an idem key), bounded."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest

from transport.errors import Expired, HandlerError, NotDelivered, ProtocolError, Unavailable
from transport.retry import delivery_policy, idempotent_policy, request_with_retry


class ScriptedNode:
    """A fake node (only ``request``): raises the scripted errors in order, then answers."""

    def __init__(self, *outcomes: BaseException | str) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[dict[str, Any]] = []

    def request(self, dst: str, message: Any, *, timeout: float | None = None, **fields: Any) -> Any:
        self.calls.append(fields)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def no_sleep(_: float) -> None:
    pass


def test_not_delivered_is_retried_until_it_goes_through() -> None:
    node = ScriptedNode(NotDelivered("down"), NotDelivered("down"), "ok")
    assert request_with_retry(node, "n/a", object(), policy=delivery_policy(sleep=no_sleep)) == "ok"
    assert [c["attempt"] for c in node.calls] == [1, 2, 3]


@pytest.mark.parametrize(
    "error", [Unavailable("gone"), Expired("late"), HandlerError("bug"), ProtocolError("bad")]
)
def test_delivery_policy_never_resends_what_may_have_run(error: Exception) -> None:
    node = ScriptedNode(error, "ok")
    with pytest.raises(type(error)):
        request_with_retry(node, "n/a", object(), policy=delivery_policy(sleep=no_sleep))
    assert len(node.calls) == 1


@pytest.mark.parametrize("error", [concurrent.futures.CancelledError(), asyncio.CancelledError()])
def test_cancellation_is_never_retried(error: BaseException) -> None:
    for policy in (delivery_policy(sleep=no_sleep), idempotent_policy(sleep=no_sleep)):
        node = ScriptedNode(error, "ok")
        with pytest.raises(type(error)):
            request_with_retry(node, "n/a", object(), policy=policy, idem="k1")
        assert len(node.calls) == 1


def test_retries_are_bounded_by_attempts() -> None:
    node = ScriptedNode(*[NotDelivered("down")] * 10)
    with pytest.raises(NotDelivered):
        request_with_retry(node, "n/a", object(), policy=delivery_policy(attempts=3, sleep=no_sleep))
    assert len(node.calls) == 3


def test_retries_are_bounded_by_total_delay() -> None:
    slept: list[float] = []
    node = ScriptedNode(*[NotDelivered("down")] * 50)
    with pytest.raises(NotDelivered):
        # Each sleep is recorded but does not pass real time; stop_after_delay reads the real clock, so
        # bound by attempts as well and check the waits grow and stay capped.
        request_with_retry(
            node,
            "n/a",
            object(),
            policy=delivery_policy(attempts=8, max_delay=10.0, sleep=slept.append, initial=0.1, max_wait=0.4),
        )
    assert len(node.calls) == 8
    assert all(0 < s <= 0.4 + 0.1 for s in slept)


def test_unbounded_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="bounded"):
        delivery_policy(attempts=0)
    with pytest.raises(ValueError, match="bounded"):
        idempotent_policy(max_delay=0)


def test_unknown_outcomes_are_retried_only_with_an_idempotency_key() -> None:
    node = ScriptedNode(Unavailable("gone"), Expired("late"), "ok")
    assert (
        request_with_retry(node, "n/a", object(), policy=idempotent_policy(sleep=no_sleep), idem="op-1:r1:c1")
        == "ok"
    )
    # The same idem on every attempt; the attempt number travels separately and never inside idem.
    assert [c["idem"] for c in node.calls] == ["op-1:r1:c1"] * 3
    assert [c["attempt"] for c in node.calls] == [1, 2, 3]
    with pytest.raises(ValueError, match="idempotency key"):
        request_with_retry(ScriptedNode("ok"), "n/a", object(), policy=idempotent_policy(sleep=no_sleep))
