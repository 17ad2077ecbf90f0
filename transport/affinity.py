"""Where a process's bus threads wait: all on one CPU, the *home*, so a hand-off between two of them wakes
a thread on the CPU its waker runs on.

Under CPython's GIL the threads of one process run Python one at a time anyway; what a hand-off between
them costs is the wake-up. A thread asleep on another CPU is woken by an interrupt to that CPU, and on a
small VM an idle virtual CPU is halted by the hypervisor: waking it costs far more than the message (a
two-thread round trip after 100 µs of work, on a 2-vCPU VM: about 165 µs when the threads sleep on
different CPUs, 13 µs when both wait on one). A thread only *waits* on its home: it takes the process's
CPU mask back as it wakes (``unpark``), before any handler runs, so what it runs, and what it starts (a
thread, a child process: they inherit the mask of the thread that starts them), is not confined to one
CPU; under load the scheduler moves it as it would any thread.

Only threads the bus owns park (actor mailboxes, direct actors' sockets, the node's I/O thread); an
application's own threads are never touched. It is process-wide: ``colocate(False)`` (``[node]
colocate_waits = false``) turns it off, and the last call decides. On one CPU, or where the kernel refuses
(a cpuset changed under the process), there is nothing to do and the threads wait wherever they are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
from collections.abc import Mapping
from typing import Any

import zmq

log = logging.getLogger(__name__)

# The CPU waits park on ({home}) and the mask a woken thread takes back (the process's, when colocate ran);
# None: off. Read without a lock: one assignment swaps both, and a thread that read the old pair parks and
# unparks by it once more.
_masks: tuple[set[int], set[int]] | None = None
_chosen = False  # colocate ran: Node.start's default does not override an explicit choice
_TRUE = frozenset(("1", "true", "yes", "on"))  # the config's words (config/settings.py)
_FALSE = frozenset(("0", "false", "no", "off"))


def colocate(on: bool = True) -> int | None:
    """Park the bus threads' waits of this process on one CPU (the lowest its mask allows), or stop doing so
    (``on=False``). Returns the home CPU, or None when off (asked to be, or fewer than two CPUs allowed)."""
    global _masks, _chosen
    _chosen = True
    if not on or not hasattr(os, "sched_setaffinity"):
        _masks = None
        return None
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        _masks = None
        return None
    home = min(allowed)
    _masks = ({home}, set(allowed))
    return home


def colocate_by_default(env: Mapping[str, str] = os.environ) -> None:
    """``colocate()`` unless this process has already chosen (Node.start). ``KBUS_NODE_COLOCATE_WAITS``
    decides as it does over a config file (true/false, 1/0, yes/no, on/off), for a node built without one
    too; any other word is a ValueError."""
    if _chosen:
        return
    text = env.get("KBUS_NODE_COLOCATE_WAITS")
    word = "true" if text is None else text.strip().lower()
    if word not in _TRUE and word not in _FALSE:
        raise ValueError(f"KBUS_NODE_COLOCATE_WAITS: expected true or false, got {text!r}")
    colocate(word in _TRUE)


def home() -> int | None:
    """The CPU waits park on, or None when off."""
    masks = _masks
    return None if masks is None else min(masks[0])


def park() -> tuple[set[int], set[int]] | None:
    """Before a wait that will block: move the calling thread onto the home CPU. Returns what ``unpark``
    takes (None: nothing was done)."""
    masks = _masks
    if masks is None:
        return None
    try:
        os.sched_setaffinity(0, masks[0])
    except OSError as exc:
        _give_up(exc)
        return None
    return masks


def unpark(masks: tuple[set[int], set[int]] | None) -> None:
    """After the wait: give the calling thread its mask back."""
    if masks is not None:
        try:
            os.sched_setaffinity(0, masks[1])
        except OSError as exc:
            _give_up(exc)


def _give_up(exc: OSError) -> None:
    global _masks
    if _masks is not None:
        _masks = None
        log.warning("bus threads wait on any CPU from now on: the kernel refused a CPU mask (%s)", exc)


def pin_io_threads(context: Any) -> None:
    """Start a ZeroMQ context's I/O threads on the home CPU too (libzmq carries every socket's bytes on
    them; it reads the option when the context starts them, at its first socket: later, it changes
    nothing)."""
    cpu = home()
    if cpu is not None:
        with contextlib.suppress(AttributeError, zmq.ZMQError):
            context.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)


class HomeQueue(queue.SimpleQueue):  # type: ignore[type-arg]
    """An actor's mailbox: ``queue.SimpleQueue`` whose blocking ``get`` waits on the home CPU."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if _masks is None or not block or not self.empty():
            return super().get(block, timeout)
        masks = park()
        try:
            return super().get(block, timeout)
        finally:
            unpark(masks)
