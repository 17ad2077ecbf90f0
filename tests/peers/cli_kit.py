"""Running the ``kbus`` command in tests: the command line, a pseudo-terminal's controlling side, and
``finish`` for a process started with pipes (the ``kbus_process`` fixture is in tests/conftest.py)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Callable

KBUS = [sys.executable, "-P", "-m", "actors.app.cli"]

Start = Callable[..., subprocess.Popen[str]]


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


class Pty:
    """The controlling side of a pseudo-terminal: what the child printed so far, and keystrokes for it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.seen = ""
        self.mark = 0  # expect() looks only after this offset

    def expect(self, text: str, timeout: float = 30.0) -> str:
        """Wait until ``text`` appears after the mark; move the mark past it; return what came before."""
        deadline = time.monotonic() + timeout
        while text not in self.seen[self.mark :]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {text!r} within {timeout}s; the terminal shows:\n{self.seen}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk:
                raise AssertionError(f"the terminal closed before {text!r}:\n{self.seen}")
            self.seen += chunk.decode("utf-8", errors="replace")
        at = self.seen.index(text, self.mark)
        before, self.mark = self.seen[self.mark : at], at + len(text)
        return before

    def send(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())
