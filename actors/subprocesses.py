"""Child processes with every wait bounded: a deadline, capped output (the full size still counted) and the
whole process group killed on timeout, on cancellation, and when the leader exits leaving others behind.

``run_bounded`` starts the child in a new session (``start_new_session=True``), so the child and everything it
starts share one process group whose id is the child's pid; ``os.killpg`` ends them all. A process that
leaves the group itself (``setsid``) is out of reach; nothing here pretends otherwise.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from transport.records import frozen

__all__ = ["Finished", "kill_group", "run_bounded"]

_CHUNK = 65536
_POLL = 0.05  # seconds between looks at the cancel event while the child is silent
_REAP_WAIT = (
    5.0  # seconds to wait for a group to die after SIGKILL (the kernel is quick; a loaded one less so)
)


@frozen
class Finished:
    """What a bounded child did. ``returncode`` is None when it was killed (``timed_out`` or ``cancelled``).
    ``stdout``/``stderr`` hold at most the limit's bytes; ``*_size`` is what the child wrote in all."""

    pid: int
    returncode: int | None
    stdout: bytes
    stderr: bytes
    stdout_size: int
    stderr_size: int
    timed_out: bool = False
    cancelled: bool = False


def kill_group(pgid: int, *, wait: float = _REAP_WAIT) -> None:
    """SIGKILL every process of the group ``pgid`` (already gone is fine), then wait, at most ``wait``
    seconds, until none of them runs any more: the kernel delivers the signal when each is next scheduled,
    not inside ``killpg``, so without the wait a caller could still see a member alive. A member that is a
    zombie (dead, its new parent yet to reap it) counts as gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + wait
    pause = 0.0005
    while _group_runs(pgid) and time.monotonic() < deadline:
        time.sleep(pause)  # a bounded wait for the kernel, not for another thread
        pause = min(pause * 2, 0.02)


def _group_runs(pgid: int) -> bool:
    """Whether a process of the group ``pgid`` is still alive and not a zombie (Linux ``/proc``)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False  # no /proc to look in: the signal was sent, which is all that can be said
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def run_bounded(
    argv: Sequence[str],
    *,
    timeout: float,
    limit: int,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    stdin: bytes | None = None,
    cancel: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_start: Callable[[int], None] | None = None,
    keep_tail: bool = False,
) -> Finished:
    """Run ``argv`` to completion or until ``timeout`` seconds pass or ``cancel`` is set; keep the first
    ``limit`` bytes of each stream (the last ``limit`` with ``keep_tail``). Raises ``OSError`` only when the
    child cannot be started. ``on_start(pid)`` is called once the child runs (tests use it to watch the
    group)."""
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=dict(env) if env is not None else None,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )
    if on_start is not None:
        on_start(proc.pid)
    deadline = clock() + timeout
    kept: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
    sizes = {"out": 0, "err": 0}
    limit = -limit if keep_tail else limit  # a negative limit keeps the tail (_read_one)
    timed_out = cancelled = False
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    try:
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(proc.stderr, selectors.EVENT_READ, "err")
        pending = memoryview(stdin) if stdin is not None else None
        if proc.stdin is not None:
            if pending:
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
            else:
                proc.stdin.close()
        while len(sel.get_map()) > 0:
            if cancel is not None and cancel.is_set():
                cancelled = True
                break
            remaining = deadline - clock()
            if remaining <= 0:
                timed_out = True
                break
            if proc.poll() is not None and not any(k.data == "in" for k in sel.get_map().values()):
                # The leader is gone; whatever still holds its pipes is left over from it: drain what is
                # buffered without waiting, then end the group below.
                _drain_ready(sel, kept, sizes, limit)
                break
            for key, _ in sel.select(min(remaining, _POLL)):
                if key.data == "in":
                    assert pending is not None and proc.stdin is not None
                    try:
                        written = os.write(proc.stdin.fileno(), pending[:_CHUNK])
                    except BrokenPipeError:
                        written = len(pending)
                    pending = pending[written:]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                if not _read_one(sel, key, kept, sizes, limit):
                    continue
    finally:
        sel.close()
        kill_group(proc.pid)  # the leader may be gone already; its group's others are not left running
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL was sent; only a slow kernel waits
            proc.wait(timeout=_REAP_WAIT)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
    killed = timed_out or cancelled
    return Finished(
        pid=proc.pid,
        returncode=None if killed else proc.returncode,
        stdout=bytes(kept["out"]),
        stderr=bytes(kept["err"]),
        stdout_size=sizes["out"],
        stderr_size=sizes["err"],
        timed_out=timed_out,
        cancelled=cancelled,
    )


def _read_one(
    sel: selectors.BaseSelector,
    key: selectors.SelectorKey,
    kept: dict[str, bytearray],
    sizes: dict[str, int],
    limit: int,
) -> bool:
    """Read one chunk of ``key``'s pipe; unregister it at EOF. False at EOF."""
    fd = key.fd
    try:
        data = os.read(fd, _CHUNK)
    except (BlockingIOError, InterruptedError):
        return True
    if not data:
        sel.unregister(key.fileobj)
        return False
    name = str(key.data)
    sizes[name] += len(data)
    if limit < 0:  # keep the last -limit bytes
        kept[name] += data
        del kept[name][: max(0, len(kept[name]) + limit)]
        return True
    room = limit - len(kept[name])
    if room > 0:
        kept[name] += data[:room]
    return True


def _drain_ready(
    sel: selectors.BaseSelector, kept: dict[str, bytearray], sizes: dict[str, int], limit: int
) -> None:
    """Read what the pipes hold right now, without waiting for writers that may never close them."""
    while len(sel.get_map()) > 0:
        ready = sel.select(0)
        if not ready:
            return
        for key, _ in ready:
            _read_one(sel, key, kept, sizes, limit)
