"""Helpers for the Codex-adapter tests: the fake model server as a process, its request log, the config
of a dynamic-tool adapter, and the codex children of this process (found through /proc, never by name)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.codex.binary import find_codex
from actors.codex.types import AdapterConfig, DynamicTool

PEERS = Path(__file__).resolve().parent
WEATHER = DynamicTool(
    name="get_weather",
    description="The weather in a city.",
    input_schema={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


@dataclass
class ModelServer:
    peer: Any  # conftest.PeerProcess
    log: Path

    @property
    def base_url(self) -> str:
        return str(self.peer.info["base_url"])

    def requests(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


def start_model_server(
    spawn_peer: Callable[..., Any], folder: Path, script: list[dict[str, Any]]
) -> ModelServer:
    log = folder / f"model-{len(list(folder.glob('model-*.jsonl')))}.jsonl"
    peer = spawn_peer(
        "--script", json.dumps(script), "--log", str(log), script=PEERS / "fake_responses_server.py"
    )
    return ModelServer(peer, log)


def weather_config(workdir: Path, executable: str | os.PathLike[str] | None = None) -> AdapterConfig:
    return AdapterConfig(
        executable=str(executable) if executable is not None else str(find_codex()),
        working_directory=str(workdir),
        model="fake-model",
        reasoning_effort=None,
        base_instructions="You are the kbus test model.",
        tools=(WEATHER,),
    )


def codex_children() -> list[int]:
    """PIDs of this process's children running ``app-server`` (the adapter's child)."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == me and b"app-server" in cmdline:
            found.append(int(entry))
    return found


def function_outputs(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        i
        for i in request["body"].get("input", [])
        if isinstance(i, dict) and i.get("type") == "function_call_output"
    ]
