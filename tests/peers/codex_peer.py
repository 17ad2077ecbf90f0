#!/usr/bin/env python3
"""A Codex-adapter actor in its own process: a node that opens ``Adapter`` (the real codex binary) as actor
``<name>/codex`` and serves it until SIGTERM or stdin closes; then it closes its handle and stops the node
(which reaps the child). Prints ``READY {"endpoints": [...], "address": ..., "child": PID}`` once open.
With ``--capture FILE`` the node records every envelope (for tests/replay/)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from actors.app.wiring import registry
from actors.codex.child import LaunchOptions
from actors.codex.facade import Adapter
from actors.codex.types import AdapterConfig, DynamicTool
from transport import Node
from transport.capture import CaptureWriter

WEATHER = DynamicTool(
    name="get_weather",
    description="The weather in a city.",
    input_schema={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--stdin-lifeline", action="store_true", help="stop when stdin closes (always on)")
    ap.add_argument("--codex", required=True, help="the codex binary")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--base-url", required=True, help="the model server (Responses API)")
    ap.add_argument("--capture", help="record this node's envelopes to FILE")
    args = ap.parse_args()
    reg = registry()
    capture = CaptureWriter(args.capture, node=args.name, schema=reg.schema_hash()) if args.capture else None
    node = Node(args.name, bind=[args.bind], registry=reg, **({"capture": capture} if capture else {}))
    node.start()
    config = AdapterConfig(
        executable=args.codex,
        working_directory=args.workdir,
        model="fake-model",
        reasoning_effort=None,
        base_instructions="You are the kbus test model.",
        tools=(WEATHER,),
    )
    adapter = Adapter.open(config, bus=node, name="codex", launch=LaunchOptions(model_base_url=args.base_url))
    child = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _ppid(pid) == os.getpid()]
    info = {"endpoints": list(node.endpoints), "address": adapter.address, "child": child}
    print("READY " + json.dumps(info), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait()
    adapter.close()
    node.stop()
    return 0


def _ppid(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rpartition(")")[2].split()[1])
    except OSError:
        return -1


if __name__ == "__main__":
    sys.exit(main())
