#!/usr/bin/env python3
"""A scripted stand-in for ``codex app-server``, only for what the real binary cannot be made to do:
garbage on stdout, an exit during the handshake, a JSON-RPC error to ``initialize`` or ``turn/start``,
chosen stderr bytes, a child that stops reading its stdin after ``thread/start`` (``deaf``), a child that
ignores the EOF on its stdin and keeps running (``ignore-eof``), one that never answers ``initialize``
(``mute``). It writes its CODEX_HOME to ``LOG.home``.
Usage: ``scripted_codex_child.py MODE LOG app-server [flags...]``; every frame it reads is appended to LOG
(one JSON line each). Otherwise it speaks the Appendix B subset: a turn streams the delta "hi" and completes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> None:
    mode, log_path = sys.argv[1], sys.argv[2]
    out = sys.stdout

    def send(frame: dict[str, Any]) -> None:
        out.write(json.dumps(frame) + "\n")
        out.flush()

    def die(code: int, stderr: bytes) -> None:
        os.write(2, stderr)
        os._exit(code)

    with open(log_path + ".home", "w", encoding="utf-8") as home:
        home.write(os.environ.get("CODEX_HOME", ""))
    turns = 0
    for line in sys.stdin:
        frame = json.loads(line)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(json.dumps(frame) + "\n")
        method, rid = frame.get("method"), frame.get("id")
        if method == "initialize":
            if mode == "mute":
                continue
            if mode == "garbage-init":
                out.write("not json\n")
                out.flush()
            elif mode == "exit-handshake":
                die(3, b"E! scripted exit during the handshake\n")
            elif mode == "init-error":
                send({"id": rid, "error": {"code": -32600, "message": "scripted refusal"}})
            else:
                send({"id": rid, "result": {"userAgent": "scripted/0"}})
                if mode == "stderr-bytes":
                    os.write(2, b"warn\xff\n")
        elif method == "thread/start":
            send({"id": rid, "result": {"thread": {"id": "th-1"}}})
            if mode == "deaf":
                time.sleep(3600)  # never reads stdin again (killed by the adapter)
        elif method == "turn/start":
            turns += 1
            if mode == "turn-start-error" and turns == 1:
                send({"id": rid, "error": {"code": -32600, "message": "scripted turn refusal"}})
                continue
            tid = f"tu-{turns}"
            send({"id": rid, "result": {"turn": {"id": tid, "status": "inProgress"}}})
            params = {"threadId": "th-1", "turnId": tid}
            send({"method": "item/agentMessage/delta", "params": {**params, "itemId": "m", "delta": "hi"}})
            if mode == "garbage-mid-turn" and turns == 1:
                out.write("not json\n")
                out.flush()
                continue
            if mode == "exit-mid-turn":
                die(9, b"E! scripted exit mid-turn\n")
            send(
                {
                    "method": "turn/completed",
                    "params": {"threadId": "th-1", "turn": {"id": tid, "status": "completed"}},
                }
            )
        elif method == "turn/interrupt":
            send({"id": rid, "result": {}})
            turn = {"id": frame["params"]["turnId"], "status": "interrupted"}
            send({"method": "turn/completed", "params": {"threadId": "th-1", "turn": turn}})
    if mode == "ignore-eof":
        time.sleep(3600)  # stdin closed: keeps running until killed


if __name__ == "__main__":
    main()
