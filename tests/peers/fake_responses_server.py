#!/usr/bin/env python3
"""FakeResponsesServer: a scripted OpenAI Responses-API model server on 127.0.0.1, for the real Codex
app-server in tests (stdlib only; started by the tests as its own process and ended by its PID).

Every ``POST /v1/responses`` takes the next step of the script (JSON, ``--script``); when the script runs
out, the last step repeats (``--cycle``: the whole script; ``{n}`` in a call id is the request number).
Each request is appended to ``--log`` (one JSON line: path, headers, body)
*before* it is answered, so a test reads an exact count. Steps (SSE shapes as CODEX.md measured them):

- ``{"text": ["Hel", "lo"]}``                       an assistant message streamed as deltas
- ``{"tool_calls": [{"call_id", "name", "arguments": {...}}]}``   function calls (one response)
- ``{"status": 500}``                               an HTTP error
- ``{"text": [...], "then": "hang"}``               the deltas, then silence until killed (prints STREAMING;
                                                    then DISCONNECTED once the client closed the connection)
- ``{"text": [...], "then": "drop"}``               the deltas, then the socket is closed mid-stream
- ``{"echo": true}``                                answers "echo: " + the last user message's text
- ``{"delay": 0.5, ...}``                           waits before answering (a slow model)

Prints ``READY {"port": P, "base_url": "http://127.0.0.1:P/v1"}`` once listening; exits when stdin closes
(``--stdin-lifeline``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Script:
    def __init__(self, steps: list[dict[str, Any]], log_path: str | None, cycle: bool = False) -> None:
        self.steps = steps or [{"text": ["ok"]}]
        self.cycle = cycle
        self.log_path = log_path
        self.lock = threading.Lock()
        self.n = 0

    def take(self, record: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            index = self.n
            self.n += 1
            if self.log_path:
                with open(self.log_path, "a", encoding="utf-8") as log:
                    log.write(json.dumps({"n": index, **record}) + "\n")
            if self.cycle:
                return index, self.steps[index % len(self.steps)]
            return index, self.steps[min(index, len(self.steps) - 1)]


SCRIPT: Script
_ids = itertools.count(1)


def usage() -> dict[str, Any]:
    return {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 15,
    }


def last_user_text(body: Any) -> str:
    """The text of the last user message in a Responses request (for ``{"echo": true}`` steps)."""
    for item in reversed(body.get("input", []) if isinstance(body, dict) else []):
        if isinstance(item, dict) and item.get("role") == "user":
            parts = [c.get("text", "") for c in item.get("content", []) if isinstance(c, dict)]
            return "".join(parts)
    return ""


class Handler(BaseHTTPRequestHandler):
    body: Any = None

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the log file is the record
        pass

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw or b"null")
        except ValueError:
            body = {"undecodable": raw[:200].decode("latin-1")}
        record = {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
        self.body = body
        index, step = SCRIPT.take(record)
        if step.get("delay"):
            time.sleep(float(step["delay"]))
        if self.path.rstrip("/") != "/v1/responses" or "status" in step:
            self.send_response(int(step.get("status", 404)))
            message = json.dumps({"error": {"message": "scripted failure", "type": "server_error"}}).encode()
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(message)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(message)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.stream(index, step)

    def event(self, kind: str, data: dict[str, Any]) -> None:
        payload = f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()
        self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
        self.wfile.flush()

    def stream(self, index: int, step: dict[str, Any]) -> None:
        rid = f"resp_{index}"
        self.event("response.created", {"response": {"id": rid}})
        out = 0
        for call in step.get("tool_calls", []):
            fid = f"fc_{index}_{out}"
            arguments = json.dumps(call.get("arguments", {}))
            call_id = str(call["call_id"]).replace("{n}", str(index))
            item = {"type": "function_call", "id": fid, "call_id": call_id, "name": call["name"]}
            self.event("response.output_item.added", {"output_index": out, "item": {**item, "arguments": ""}})
            self.event(
                "response.function_call_arguments.delta",
                {"item_id": fid, "output_index": out, "delta": arguments},
            )
            self.event(
                "response.output_item.done", {"output_index": out, "item": {**item, "arguments": arguments}}
            )
            out += 1
        deltas = step.get("text")
        if step.get("echo"):
            deltas = ["echo: ", last_user_text(self.body)]
        if deltas is not None:
            mid = f"msg_{index}"
            message = {"type": "message", "role": "assistant", "id": mid}
            self.event(
                "response.output_item.added", {"output_index": out, "item": {**message, "content": []}}
            )
            self.event(
                "response.content_part.added",
                {
                    "item_id": mid,
                    "output_index": out,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": ""},
                },
            )
            for delta in deltas:
                self.event(
                    "response.output_text.delta",
                    {"item_id": mid, "output_index": out, "content_index": 0, "delta": delta},
                )
            then = step.get("then")
            if then == "hang":
                print("STREAMING", index, flush=True)
                # The client sends nothing more on this request: a read returns only at its close.
                try:
                    closed = self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:  # reset
                    closed = True
                if closed:
                    print("DISCONNECTED", index, flush=True)
                threading.Event().wait()
            if then == "drop":
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            text = "".join(deltas)
            self.event(
                "response.output_text.done",
                {"item_id": mid, "output_index": out, "content_index": 0, "text": text},
            )
            self.event(
                "response.output_item.done",
                {
                    "output_index": out,
                    "item": {**message, "content": [{"type": "output_text", "text": text}]},
                },
            )
        self.event("response.completed", {"response": {"id": rid, "usage": usage()}})
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main() -> None:
    global SCRIPT
    parser = argparse.ArgumentParser()
    parser.add_argument("--script", default="[]")
    parser.add_argument("--log")
    parser.add_argument("--cycle", action="store_true", help="repeat the whole script, not its last step")
    parser.add_argument("--stdin-lifeline", action="store_true")
    args = parser.parse_args()
    SCRIPT = Script(json.loads(args.script), args.log, args.cycle)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("READY " + json.dumps({"port": port, "base_url": f"http://127.0.0.1:{port}/v1"}), flush=True)
    if args.stdin_lifeline:
        sys.stdin.read()
        os._exit(0)
    threading.Event().wait()


if __name__ == "__main__":
    main()
