"""One ``codex app-server`` child: its command line and model catalog, the process and its private
CODEX_HOME, and the three stdio threads (stdout and stderr readers, stdin writer).

The threads never touch the adapter actor's state: every line, stderr chunk, the exit and a stuck write
become a ``ChildOutput`` handed to ``post``, which puts it into the actor's mailbox. Every other method is
called from the actor's thread only, and none of them waits on the child except ``reap`` (bounded).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import shutil
import subprocess
import threading
from collections.abc import Callable
from typing import IO, Any

from actors.codex.homes import make_home, sweep_once
from actors.codex.messages import ChildOutput
from actors.codex.types import AdapterConfig
from transport.records import frozen

MAX_LINE = 512 * 1024  # a longer stdout line is a protocol error (it could not travel as one message)
REAP_TIMEOUT = 3.0

# CODEX.md: no network besides the model server, no shell snapshot, no analytics, and a model server that
# is down fails the turn at once instead of reconnecting forever.
HERMETIC_ARGS = (
    "--disable",
    "plugins",
    "--disable",
    "shell_snapshot",
    "--disable",
    "unbounded_connection_retries",
    "-c",
    "analytics.enabled=false",
)


@frozen(kw_only=True)
class LaunchOptions:
    """How the child is launched, beyond the seed's ``AdapterConfig``.

    ``model_base_url``: a Responses-API server (``.../v1``); codex then uses it as provider ``kbus`` with no
    credentials and no retries. ``codex_home``: ``None`` makes a fresh private directory per child, removed
    when the child is reaped (and, if its owner was killed first, by the next process that starts a child:
    ``actors.codex.homes``). ``extra_args`` are appended to the app-server command line.
    """

    model_base_url: str | None = None
    codex_home: str | None = None
    stream_idle_timeout_ms: int = 30_000
    context_window: int = 100_000
    # A write to the child's stdin that makes no progress for this long means the child stopped reading:
    # it is killed and its turns end UNAVAILABLE.
    write_timeout: float = 30.0
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def child_argv(config: AdapterConfig, launch: LaunchOptions, catalog: str | None) -> list[str]:
    args = [config.executable, "app-server", *HERMETIC_ARGS]
    if launch.model_base_url is not None:
        provider = (
            '{ name = "kbus", base_url = ' + json.dumps(launch.model_base_url) + ', wire_api = "responses", '
            "requires_openai_auth = false, supports_websockets = false, request_max_retries = 0, "
            f"stream_max_retries = 0, stream_idle_timeout_ms = {int(launch.stream_idle_timeout_ms)} }}"
        )
        args += ["-c", 'model_provider="kbus"', "-c", f"model_providers.kbus={provider}"]
    args += ["-c", f"model={json.dumps(config.model)}"]
    if catalog is not None:
        args += ["-c", f"model_catalog_json={json.dumps(catalog)}"]
    return [*args, *launch.extra_args]


def model_catalog(config: AdapterConfig, launch: LaunchOptions) -> dict[str, Any]:
    """One catalog entry for the configured model: its instructions are the config's base_instructions."""
    return {
        "models": [
            {
                "slug": config.model,
                "display_name": config.model,
                "base_instructions": config.base_instructions,
                "supported_reasoning_levels": [],
                "shell_type": "default",
                "visibility": "list",
                "supported_in_api": True,
                "priority": 0,
                "support_verbosity": False,
                "truncation_policy": {"mode": "bytes", "limit": 10000},
                "experimental_supported_tools": [],
                "context_window": launch.context_window,
            }
        ]
    }


class Child:
    """The process, its home and its stdio threads. Made with no process; ``spawn`` starts one (at most
    once: the adapter actor calls it from ``on_start`` only), ``reap`` ends it and may run more than once."""

    def __init__(
        self, config: AdapterConfig, launch: LaunchOptions, post: Callable[[ChildOutput], None]
    ) -> None:
        self.config = config
        self.launch = launch
        self._post = post
        self._proc: subprocess.Popen[bytes] | None = None
        self._home: str | None = None  # a CODEX_HOME made here (removed when the child is reaped)
        self._threads: list[threading.Thread] = []
        # Lines for the writer thread, in order; None closes the child's stdin (its clean shutdown).
        self._writes: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._reap_timer: threading.Timer | None = None  # kills a child that outlives its close

    def spawn(self) -> bytes:
        """``b"ok"``, or why the child could not start (the adapter's ``spawn`` effect outcome)."""
        launch = self.launch
        try:
            home = launch.codex_home
            if home is None:
                sweep_once()  # folders SIGKILLed owners left behind
                home = self._home = make_home()
            catalog = os.path.join(home, "kbus_model_catalog.json")
            with open(catalog, "w", encoding="utf-8") as file:
                json.dump(model_catalog(self.config, launch), file)
            env = {**os.environ, "CODEX_HOME": home, "NO_PROXY": "127.0.0.1,localhost", **dict(launch.env)}
            self._proc = subprocess.Popen(
                child_argv(self.config, launch, catalog),
                cwd=self.config.working_directory,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            self._remove_home()
            return f"cannot start {self.config.executable!r}: {exc}".encode()
        proc = self._proc
        assert proc.stdout is not None and proc.stderr is not None
        err = threading.Thread(target=self._read_stderr, args=(proc.stderr,), daemon=True)
        out = threading.Thread(target=self._read_stdout, args=(proc, err), daemon=True)
        writer = threading.Thread(target=self._write_loop, args=(proc,), daemon=True)
        self._threads = [err, out, writer]
        for thread in self._threads:
            thread.start()
        return b"ok"

    def write(self, line: bytes) -> bytes:
        """Queued for the writer thread (the actor never blocks on the child's stdin): the ``stdin`` effect's
        outcome, ``b""``, or ``b"no child"``."""
        if self._proc is None:
            return b"no child"
        self._writes.put(line)
        return b""

    def close_stdin(self, on_due: Callable[[], None]) -> None:
        """The app-server's clean shutdown, after the lines queued before. ``on_due`` runs on a timer thread
        REAP_TIMEOUT later unless ``reap`` ran first (the actor then kills a child that ignored the close)."""
        self._writes.put(None)
        if self._proc is not None:
            timer = self._reap_timer = threading.Timer(REAP_TIMEOUT, on_due)
            timer.daemon = True
            timer.start()

    def kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()

    def reap(self) -> None:
        """Close stdin, wait a bounded time, then kill; the process is waited for, its threads joined (each
        bounded) and its home removed."""
        timer = self._reap_timer
        if timer is not None:
            timer.cancel()
        proc = self._proc
        if proc is None:
            self._remove_home()
            return
        self._writes.put(None)  # the writer thread closes stdin after what was queued before
        try:
            proc.wait(REAP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for thread in self._threads:
            thread.join(REAP_TIMEOUT)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._remove_home()

    def _remove_home(self) -> None:
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None

    # ----------------------------------------------------------------- the stdio threads (not the actor)
    def _read_stderr(self, pipe: IO[bytes]) -> None:
        fd = pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            self._post(ChildOutput(stream="stderr", data=chunk))

    def _read_stdout(self, proc: subprocess.Popen[bytes], stderr_reader: threading.Thread) -> None:
        pipe = proc.stdout
        assert pipe is not None
        while True:
            try:
                line = pipe.readline(MAX_LINE + 1)
            except (OSError, ValueError):
                break
            if not line:
                break
            if len(line) > MAX_LINE and not line.endswith(b"\n"):
                self._post(ChildOutput(stream="stdout", data=line[:256] + b"...<line too long>"))
                while line and not line.endswith(b"\n"):  # skip the rest of the oversized line
                    line = pipe.readline(MAX_LINE)
                continue
            self._post(ChildOutput(stream="stdout", data=line))
        stderr_reader.join(REAP_TIMEOUT)
        try:
            code = proc.wait(REAP_TIMEOUT)
        except subprocess.TimeoutExpired:  # stdout closed but the process lingers: end it
            proc.kill()
            code = proc.wait()
        self._post(ChildOutput(stream="exit", code=code))

    def _write_loop(self, proc: subprocess.Popen[bytes]) -> None:
        """The queued lines in order, each write bounded. A write that makes no progress for
        ``write_timeout`` is reported (``stuck``) and the thread ends; a failed write (the child is gone: its
        exit arrives from the stdout reader) ends it too. It owns stdin and closes it at its end."""
        pipe = proc.stdin
        assert pipe is not None
        try:
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            limit_ms = max(1, int(self.launch.write_timeout * 1000))
            while (line := self._writes.get()) is not None:
                view = memoryview(line)
                while view:
                    with contextlib.suppress(BlockingIOError):
                        view = view[os.write(fd, view) :]
                    if view and not poller.poll(limit_ms):
                        self._post(ChildOutput(stream="stuck", data=line[:200]))
                        return
        except (OSError, ValueError):
            return
        finally:
            with contextlib.suppress(OSError, ValueError):
                pipe.close()
