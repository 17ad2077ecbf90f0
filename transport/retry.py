"""Named retry policies (tenacity): bounded, injectable sleep, and only for failures that are safe to retry.

- ``delivery_policy`` retries ``NotDelivered`` only: the message is known never to have reached a handler,
  so resending cannot run an effect twice.
- ``idempotent_policy`` also retries ``Unavailable`` and ``Expired`` (outcome unknown), and is only for
  requests that carry an idempotency key: the receiver returns the stored outcome for a repeated ``idem``.

Neither ever retries a cancellation (``concurrent.futures.CancelledError``, ``asyncio.CancelledError``) or
an application error, and both stop after a fixed number of attempts *and* a total delay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from transport.errors import BusError, Expired, NotDelivered, Unavailable

log = logging.getLogger(__name__)

DELIVERY_RETRYABLE: tuple[type[BusError], ...] = (NotDelivered,)
IDEMPOTENT_RETRYABLE: tuple[type[BusError], ...] = (NotDelivered, Unavailable, Expired)


def _policy(
    retryable: tuple[type[BusError], ...],
    *,
    attempts: int,
    max_delay: float,
    sleep: Callable[[float], None],
    initial: float,
    max_wait: float,
) -> Retrying:
    if attempts < 1 or max_delay <= 0:
        raise ValueError("a retry policy needs attempts >= 1 and max_delay > 0: retries are always bounded")

    def retry_this(exc: BaseException) -> bool:
        return isinstance(exc, retryable)

    return Retrying(
        retry=retry_if_exception(retry_this),
        stop=stop_after_attempt(attempts) | stop_after_delay(max_delay),
        wait=wait_exponential_jitter(multiplier=initial, max=max_wait, jitter=initial),
        before_sleep=before_sleep_log(log, logging.INFO),
        reraise=True,
        sleep=sleep,
    )


def delivery_policy(
    *,
    attempts: int = 5,
    max_delay: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
    initial: float = 0.05,
    max_wait: float = 2.0,
) -> Retrying:
    """Retry only ``NotDelivered`` (nothing ran); give up after ``attempts`` tries or ``max_delay`` s."""
    return _policy(
        DELIVERY_RETRYABLE,
        attempts=attempts,
        max_delay=max_delay,
        sleep=sleep,
        initial=initial,
        max_wait=max_wait,
    )


def idempotent_policy(
    *,
    attempts: int = 5,
    max_delay: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
    initial: float = 0.1,
    max_wait: float = 5.0,
) -> Retrying:
    """Retry ``NotDelivered``, ``Unavailable`` and ``Expired``: for requests carrying an ``idem`` key."""
    return _policy(
        IDEMPOTENT_RETRYABLE,
        attempts=attempts,
        max_delay=max_delay,
        sleep=sleep,
        initial=initial,
        max_wait=max_wait,
    )


def request_with_retry(
    node: Any,
    dst: str,
    message: Any,
    *,
    policy: Retrying | None = None,
    timeout: float | None = None,
    idem: str | None = None,
) -> Any:
    """``node.request`` under a policy; each try carries the same ``idem`` and the next ``attempt``.

    Without ``idem`` only the delivery policy is allowed: an unknown outcome must not be resent blind.
    """
    if policy is None:
        policy = delivery_policy() if idem is None else idempotent_policy()
    elif idem is None and _retries_unknown_outcomes(policy):
        raise ValueError("retrying Unavailable/Expired needs an idempotency key (idem=...)")
    for attempt in policy:
        with attempt:
            fields: dict[str, Any] = {"attempt": attempt.retry_state.attempt_number}
            if idem is not None:
                fields["idem"] = idem
            return node.request(dst, message, timeout=timeout, **fields)
    raise AssertionError("unreachable: tenacity reraises the last error")  # pragma: no cover


def _retries_unknown_outcomes(policy: Retrying) -> bool:
    predicate = policy.retry
    probe = getattr(predicate, "predicate", None)
    return bool(probe is not None and (probe(Unavailable("probe")) or probe(Expired("probe"))))
