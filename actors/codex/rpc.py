"""JSON-RPC with the child, without I/O: one parsed frame per stdout line, the encoding of a line the adapter
writes, and the adapter's own request ids with the continuation of each until its response arrives.

The app-server's wire (CODEX.md): one JSON object per line, no ``"jsonrpc"`` field; the server numbers its
own requests independently of ours, so a server request's id is only ever echoed back, never looked up.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeAlias

from transport.records import frozen

# A response's continuation: (result, error); error is None on success, else the JSON-RPC error object.
Then: TypeAlias = Callable[[Any, dict[str, Any] | None], None]


@frozen
class Response:
    id: Any
    result: Any
    error: dict[str, Any] | None


@frozen
class ServerRequest:
    id: Any
    method: str
    params: dict[str, Any]


@frozen
class Notification:
    method: str
    params: dict[str, Any]


@frozen
class Malformed:
    """A line that is no JSON-RPC message; ``why`` names it for the PROTOCOL error (AD-19)."""

    why: str


Frame: TypeAlias = Response | ServerRequest | Notification | Malformed


def parse(data: bytes) -> Frame | None:
    """One stdout line as a frame; ``None`` for a blank line. Non-object params read as ``{}``."""
    if not data.strip():
        return None
    try:
        frame = json.loads(data)
    except ValueError:
        return Malformed(f"child wrote a line that is not JSON: {data[:200]!r}")
    if not isinstance(frame, dict):
        return Malformed(f"child wrote a JSON {type(frame).__name__}, not an object: {data[:200]!r}")
    method = frame.get("method")
    if isinstance(method, str):
        params = frame.get("params")
        if not isinstance(params, dict):
            params = {}
        if "id" in frame:
            return ServerRequest(frame["id"], method, params)
        return Notification(method, params)
    if "result" in frame or "error" in frame:
        error = frame.get("error")
        if error is not None and not isinstance(error, dict):
            error = {"message": str(error)}
        return Response(frame.get("id"), frame.get("result"), error)
    return Malformed(f"child wrote a frame that is no JSON-RPC message: {data[:200]!r}")


def encode(frame: dict[str, Any]) -> bytes:
    """The line written to the child's stdin (compact, UTF-8, newline-terminated)."""
    return json.dumps(frame, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def error_text(error: dict[str, Any]) -> str:
    return f"{error.get('code')} {str(error.get('message'))[:500]}"


class Calls:
    """The adapter's requests in flight: ids from 1 up, one continuation each, run once."""

    __slots__ = ("_last", "_then")

    def __init__(self) -> None:
        self._last = 0
        self._then: dict[int, Then] = {}

    def add(self, then: Then) -> int:
        self._last += 1
        self._then[self._last] = then
        return self._last

    def settle(self, response: Response) -> bool:
        """Run the continuation of ``response``'s request; ``False`` if no request of ours has that id."""
        then = self._then.pop(response.id, None) if isinstance(response.id, int) else None
        if then is None:
            return False
        then(response.result, response.error)
        return True

    def clear(self) -> None:
        """The child is gone: no response will come, and none arriving late runs a continuation."""
        self._then.clear()
