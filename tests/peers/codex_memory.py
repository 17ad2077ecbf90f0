#!/usr/bin/env python3
"""Measure what Router turns on the codex provider cost the codex children: RSS and open descriptors.

    .venv/bin/python -P tests/peers/codex_memory.py --turns 200 --recycle 0     # children never recycled
    .venv/bin/python -P tests/peers/codex_memory.py --turns 200 --recycle 50

Runs ``CodexProvider.run_turn`` ``--turns`` times (the real codex binary, the fake Responses server as its
own process, ended by its PID) and prints, every ``--every`` turns, the summed RSS and descriptor count of
this process's codex children, then one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peers.codex_support import PEERS, codex_children
from peers.turn_io import RecordingTurnIO

from actors.router.actor import CALL_KTOOL_PARAMETERS
from actors.router.providers.base import ChatMessage, ToolSpec, TurnRequest
from actors.router.providers.codex import CodexProvider
from actors.types import CALL_KTOOL, AgentProvider, ResolvedAgentModel


def usage() -> tuple[int, int, int]:
    """(children, summed RSS KiB, summed open descriptors) of this process's codex children."""
    rss = fds = 0
    children = codex_children()
    for pid in children:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1])
        fds += len(os.listdir(f"/proc/{pid}/fd"))
    return len(children), rss, fds


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--recycle", type=int, default=100, help="recycle_after_turns (0: never)")
    ap.add_argument("--every", type=int, default=50)
    args = ap.parse_args()
    server = subprocess.Popen(
        [sys.executable, "-P", str(PEERS / "fake_responses_server.py"), "--stdin-lifeline",
         "--script", json.dumps([{"text": ["ok"]}])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        base_url = json.loads(line.partition("READY ")[2])["base_url"]
        with tempfile.TemporaryDirectory() as workdir:
            provider = CodexProvider(
                model_base_url=base_url, working_directory=workdir, recycle_after_turns=args.recycle
            )
            model = ResolvedAgentModel(
                requested="codex-fake",
                model="codex-fake",
                provider=AgentProvider.CODEX,
                provider_model="fake-model",
                context_window_tokens=100_000,
                max_input_tokens=100_000,
            )
            request = TurnRequest(
                model=model,
                messages=(ChatMessage("user", "Go"),),
                tool=ToolSpec(CALL_KTOOL, "Run an application tool by name.", CALL_KTOOL_PARAMETERS),
            )
            rows = []
            try:
                for turn in range(args.turns + 1):
                    if turn % args.every == 0:
                        children, rss, fds = usage()
                        rows.append({"turn": turn, "children": children, "rss_kib": rss, "fds": fds})
                        print(f"turn {turn}: {children} child(ren), RSS {rss} KiB, {fds} fds", flush=True)
                    if turn < args.turns:
                        assert provider.run_turn(request, RecordingTurnIO()).answer == "ok"
            finally:
                provider.close()
        print("RESULT " + json.dumps({"recycle": args.recycle, "rows": rows}), flush=True)
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGTERM)
            server.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
