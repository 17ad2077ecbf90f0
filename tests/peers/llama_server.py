"""A real ``llama_cpp.server`` on 127.0.0.1 serving the embedded SmolLM2 GGUF, for tests (started with -P,
ended by PID). Its API key is a test secret that must never show up in an error, a log line or a message.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from actors.router.providers.local import default_model_path

API_KEY = "sk-kbus-test-7f3a9c1e5b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- a real llama_cpp.server --------------------------------------------------------------------------


@dataclass
class LlamaServer:
    proc: subprocess.Popen[str]
    port: int
    output: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def start_llama_server(timeout: float = 90.0) -> LlamaServer:
    port = free_port()
    # -P: the child must not import modules from its working directory (STYLE.md 3.2).
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "llama_cpp.server",
        "--model",
        str(default_model_path()),
        "--chat_format",
        "chatml-function-calling",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "2048",
        "--api_key",
        API_KEY,
    ]
    # PASSIVE: llama.cpp's OpenMP threads must not spin against the other test worker (see local.py).
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    server = LlamaServer(proc, port)
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def pump() -> None:  # drains the pipe for the server's whole life, so its logging never blocks
        assert proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in proc.stdout:
                server.output.append(line)
                lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name=f"llama-server-{proc.pid}", daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"llama_cpp.server not up within {timeout}s") from None
            if line is None:
                raise AssertionError(f"llama_cpp.server exited {proc.wait(10)}: {''.join(server.output)}")
            if "Uvicorn running on" in line:
                break
        probe = urllib.request.Request(
            f"{server.base_url}/models", headers={"Authorization": f"Bearer {API_KEY}"}
        )
        with urllib.request.urlopen(probe, timeout=10) as reply:
            assert reply.status == 200
    except BaseException:
        server.kill()
        raise
    return server
