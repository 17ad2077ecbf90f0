"""The OpenAI-compatible provider against real servers on 127.0.0.1.

Most tests talk to a real ``llama_cpp.server`` serving the same SmolLM2 GGUF the local provider uses (the
``openai`` SDK, real HTTP, real SSE). llama.cpp's server cannot produce some things a test needs (it sends
no usage in a stream and cannot be told to answer 429/503), so those tests use ``ScriptedServer``: a
standard-library HTTP server that replays canned OpenAI-shaped responses and records the requests.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from peers.llama_server import API_KEY, LlamaServer, free_port, start_llama_server
from peers.turn_io import RecordingTurnIO

from actors.router.providers.base import (
    ChatMessage,
    ProviderError,
    ProviderEvent,
    ProviderOutcome,
    Submitted,
    TextDelta,
    ToolCallRequested,
    ToolSpec,
    TurnRequest,
    UsageUpdate,
)
from actors.router.providers.openai_compat import OpenAIProvider
from actors.types import CALL_KTOOL, AgentProvider, ResolvedAgentModel, TokenUsage, ToolResult

pytestmark = pytest.mark.integration

MODEL = ResolvedAgentModel(
    requested="lab",
    model="smollm2-135m",
    provider=AgentProvider.OPENAI,
    provider_model="smollm2",
    context_window_tokens=2048,
    max_input_tokens=1536,
)
TOOL = ToolSpec(
    CALL_KTOOL,
    "Run one application tool: name is the tool, arguments its JSON-object arguments.",
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "arguments": {"type": "object"}},
        "required": ["name", "arguments"],
    },
)
FORCE_TOOL = {"type": "function", "function": {"name": CALL_KTOOL}}
GREEDY = {"temperature": 0.0, "seed": 7}


def request(
    user: str, *, system: str = "You are helpful.", max_output_tokens: int = 48, **options: Any
) -> TurnRequest:
    return TurnRequest(
        model=MODEL,
        messages=(ChatMessage("system", system), ChatMessage("user", user)),
        tool=TOOL,
        max_output_tokens=max_output_tokens,
        options={**GREEDY, **options},
    )


def run(provider: OpenAIProvider, req: TurnRequest, io: RecordingTurnIO) -> ProviderOutcome | ProviderError:
    try:
        return provider.run_turn(req, io)
    except ProviderError as exc:
        return exc


@pytest.fixture(scope="module")
def llama_server() -> Iterator[LlamaServer]:
    server = start_llama_server()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def own_llama_server() -> Iterator[Callable[[], LlamaServer]]:
    """Servers a test may kill itself; whatever is left is ended by PID at the end."""
    started: list[LlamaServer] = []

    def start() -> LlamaServer:
        started.append(start_llama_server())
        return started[-1]

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def sleeps() -> list[float]:
    return []


def provider_for(base_url: str, sleeps: list[float], **kwargs: Any) -> OpenAIProvider:
    return OpenAIProvider(base_url, API_KEY, sleep=sleeps.append, timeout=60.0, **kwargs)


# --- a scripted OpenAI-shaped server ------------------------------------------------------------------


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # JSON body: for an error status, or a whole (not streamed) 200 answer
    chunks: list[dict[str, Any]] = field(default_factory=list)  # SSE data events for 200


class ScriptedServer:
    """Answers each POST with the next scripted ``Reply`` and records the request bodies."""

    def __init__(self) -> None:
        self.replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                outer.requests.append(json.loads(self.rfile.read(length)))
                outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                reply = outer.replies.get(timeout=5)
                if reply.status != 200 or reply.body is not None:
                    data = json.dumps(reply.body).encode()
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
                for chunk in reply.chunks:
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, args=(0.05,), name="scripted-openai", daemon=True
        )
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def scripted() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    yield server
    server.close()


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, usage: Any = None
) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": choices,
        "usage": usage,
    }


def usage_json(prompt: int, completion: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def text_reply(*pieces: str, usage: Any = None) -> Reply:
    return Reply(
        chunks=[
            chunk({"role": "assistant", "content": ""}),
            *(chunk({"content": p}) for p in pieces),
            chunk({}, finish="stop"),
            *([chunk(usage=usage)] if usage is not None else []),
        ]
    )


# --- against llama_cpp.server -------------------------------------------------------------------------


def test_text_is_streamed_in_deltas(llama_server: LlamaServer, sleeps: list[float]) -> None:
    provider = provider_for(llama_server.base_url, sleeps)
    io = RecordingTurnIO()
    started = time.perf_counter()
    outcome = run(provider, request("Write two sentences about the sea.", tool_choice="none"), io)
    print(f"openai streamed text: {time.perf_counter() - started:.2f}s")

    assert isinstance(outcome, ProviderOutcome), outcome
    deltas = [e.text for e in io.of(TextDelta)]
    assert len(deltas) >= 2
    assert outcome.answer == "".join(deltas)
    assert isinstance(io.events[0], Submitted)
    assert not io.of(ToolCallRequested)
    # llama.cpp's server sends no usage in a stream: none is reported rather than one made up.
    assert outcome.usage is None and not io.of(UsageUpdate)


def test_an_answer_cut_at_the_token_limit_finishes_length(
    llama_server: LlamaServer, sleeps: list[float]
) -> None:
    """Issue 16: the server's finish_reason "length" (max_tokens reached) reaches the outcome; an answer
    that ends by itself is "stop"."""
    provider = provider_for(llama_server.base_url, sleeps)
    story = request("Tell me a long story about a cat.", tool_choice="none", max_output_tokens=4)
    cut = run(provider, story, RecordingTurnIO())
    assert isinstance(cut, ProviderOutcome) and cut.finish_reason == "length", cut
    short = run(provider, request("Say yes.", system="You are brief.", tool_choice="none"), RecordingTurnIO())
    assert isinstance(short, ProviderOutcome) and short.finish_reason == "stop", short


def test_tool_call_then_final_answer(llama_server: LlamaServer, sleeps: list[float]) -> None:
    provider = provider_for(llama_server.base_url, sleeps)
    io = RecordingTurnIO()
    system = (
        "You are an assistant with one tool, call_ktool. To look up the weather, call call_ktool with "
        'exactly {"name": "weather", "arguments": {"city": "<the city>"}}.'
    )
    started = time.perf_counter()
    # llama.cpp's chatml-function-calling cannot stream an "auto" choice, so the call is forced and the
    # request after it answers in text.
    outcome = run(
        provider,
        request(
            "What is the weather in Paris?",
            system=system,
            tool_choice=FORCE_TOOL,
            tool_choice_after_call="none",
        ),
        io,
    )
    print(f"openai tool call + answer: {time.perf_counter() - started:.2f}s")

    assert isinstance(outcome, ProviderOutcome), outcome
    (call,) = [e.call for e in io.of(ToolCallRequested)]
    assert call.call_id and call.name == CALL_KTOOL
    assert isinstance(json.loads(call.arguments), dict)
    assert io.waited == [call.call_id]
    submitted = io.of(Submitted)
    assert len(submitted) == 2
    assert [i.call_id for i in submitted[1].context.items if i.role == "tool"] == [call.call_id]
    after_call = io.events[io.events.index(submitted[1]) :]
    assert outcome.answer == "".join(e.text for e in after_call if isinstance(e, TextDelta))
    assert outcome.answer.strip()
    assert sleeps == []


def test_default_tool_choice_against_llama_cpp_is_sent_whole_and_remembered(
    llama_server: LlamaServer, sleeps: list[float]
) -> None:
    """llama.cpp cannot stream an "auto" tool choice (its stream is empty): the provider asks again without
    streaming, emits the usual events, and sends the next turn's tool requests whole from the start."""
    provider = provider_for(llama_server.base_url, sleeps)
    system = (
        "You are an assistant with one tool, call_ktool. To look up the weather, call call_ktool with "
        'exactly {"name": "weather", "arguments": {"city": "<the city>"}}.'
    )
    for _ in range(2):
        io = RecordingTurnIO()
        outcome = run(
            provider,
            request("What is the weather in Paris?", system=system, tool_choice_after_call="none"),
            io,
        )
        assert isinstance(outcome, ProviderOutcome), outcome
        (call,) = [e.call for e in io.of(ToolCallRequested)]
        assert call.call_id and call.name == CALL_KTOOL
        assert isinstance(json.loads(call.arguments), dict)
        assert io.waited == [call.call_id]
        # The request made whole reports the usage a llama.cpp stream never sends.
        assert io.of(UsageUpdate)
        assert outcome.answer.strip() and outcome.answer == "".join(e.text for e in io.of(TextDelta))
    assert provider._streams_tools is False
    assert sleeps == []


def test_server_errors_carry_the_servers_message_and_status(
    llama_server: LlamaServer, sleeps: list[float]
) -> None:
    provider = provider_for(llama_server.base_url, sleeps)
    outcome = run(provider, request("hi", tool_choice="no_such_tool"), RecordingTurnIO())

    assert isinstance(outcome, ProviderError), outcome
    assert outcome.kind == "failed"
    assert outcome.message == (
        "the server answered HTTP 500: Tool with name 'no_such_tool' not found in tools"
    )


def test_server_killed_mid_stream_is_unavailable_and_not_retried(
    own_llama_server: Callable[[], LlamaServer], sleeps: list[float]
) -> None:
    server = own_llama_server()

    def kill_on_first_delta(io: RecordingTurnIO, event: ProviderEvent) -> None:
        if isinstance(event, TextDelta) and len(io.of(TextDelta)) == 1:
            os.kill(server.proc.pid, signal.SIGKILL)

    provider = provider_for(server.base_url, sleeps)
    io = RecordingTurnIO(on_emit=kill_on_first_delta)
    outcome = run(
        provider,
        request(
            "Write a very long story about a lighthouse keeper.",
            tool_choice="none",
            max_output_tokens=1500,
            extra_body={"min_tokens": 1000},  # llama.cpp: no early end of turn, the stream is long
        ),
        io,
    )

    assert isinstance(outcome, ProviderError), outcome
    assert outcome.kind == "unavailable" and outcome.started
    assert isinstance(outcome.__cause__, openai.APIConnectionError)
    assert len(io.of(TextDelta)) >= 1
    assert sleeps == []  # a token had arrived: never retried
    assert server.proc.wait(timeout=10) == -signal.SIGKILL


def test_connection_refused_is_retried_a_bounded_number_of_times(sleeps: list[float]) -> None:
    provider = provider_for(f"http://127.0.0.1:{free_port()}/v1", sleeps, max_attempts=3)
    io = RecordingTurnIO()
    outcome = run(provider, request("hi"), io)

    assert isinstance(outcome, ProviderError), outcome
    assert outcome.kind == "unavailable" and not outcome.started
    assert isinstance(outcome.__cause__, openai.APIConnectionError)
    assert len(sleeps) == 2  # three attempts
    assert all(0 < s <= 4.0 + 0.25 for s in sleeps)
    assert [type(e) for e in io.events] == [Submitted]


def test_wrong_key_is_failed_without_retry_and_without_the_key(
    llama_server: LlamaServer, sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "sk-wrong-key-0d5e11"
    provider = OpenAIProvider(llama_server.base_url, wrong, sleep=sleeps.append)
    caplog.set_level(logging.DEBUG)
    outcome = run(provider, request("hi"), RecordingTurnIO())

    assert isinstance(outcome, ProviderError), outcome
    assert outcome.kind == "failed" and "401" in outcome.message
    assert isinstance(outcome.__cause__, openai.AuthenticationError)
    assert sleeps == []
    for text in (str(outcome), outcome.message, repr(outcome), repr(provider), str(provider), caplog.text):
        assert wrong not in text


# --- against the scripted server ----------------------------------------------------------------------


def test_usage_from_the_final_chunk_accumulates_over_the_turn(
    scripted: ScriptedServer, sleeps: list[float]
) -> None:
    # The OpenAI stream shape: the id and name in the first tool-call delta, the arguments in fragments.
    scripted.replies.put(
        Reply(
            chunks=[
                chunk(
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_A1",
                                "type": "function",
                                "function": {"name": CALL_KTOOL, "arguments": ""},
                            }
                        ],
                    }
                ),
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"name": "weather", '}}]}),
                chunk(
                    {
                        "tool_calls": [
                            {"index": 0, "function": {"arguments": '"arguments": {"city": "Oslo"}}'}}
                        ]
                    }
                ),
                chunk({}, finish="tool_calls"),
                chunk(usage=usage_json(100, 20, 64, 5)),
            ]
        )
    )
    scripted.replies.put(text_reply("Cold ", "and clear.", usage=usage_json(140, 6, 96, 0)))
    io = RecordingTurnIO(results=lambda call_id: ToolResult(success=True, output="-3 C, clear"))
    provider = provider_for(scripted.base_url, sleeps)

    outcome = run(provider, request("Weather in Oslo?", max_output_tokens=64), io)

    assert isinstance(outcome, ProviderOutcome), outcome
    first = TokenUsage(
        input_tokens=100,
        cached_input_tokens=64,
        output_tokens=20,
        reasoning_output_tokens=5,
        total_tokens=120,
    )
    both = TokenUsage(
        input_tokens=240,
        cached_input_tokens=160,
        output_tokens=26,
        reasoning_output_tokens=5,
        total_tokens=266,
    )
    assert [e.usage for e in io.of(UsageUpdate)] == [first, both]
    assert outcome.usage == both and outcome.answer == "Cold and clear."
    (call,) = [e.call for e in io.of(ToolCallRequested)]
    assert call.call_id == "call_A1" and call.name == CALL_KTOOL
    assert json.loads(call.arguments) == {"name": "weather", "arguments": {"city": "Oslo"}}
    # What went over the wire: streaming with usage, the one tool, the limit, then the call and its result.
    sent, follow_up = scripted.requests
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert [t["function"]["name"] for t in sent["tools"]] == [CALL_KTOOL]
    assert sent["max_tokens"] == 64 and sent["tool_choice"] == "auto"
    assert follow_up["messages"][-2]["tool_calls"][0]["id"] == "call_A1"
    assert follow_up["messages"][-1] == {"role": "tool", "tool_call_id": "call_A1", "content": "-3 C, clear"}
    assert scripted.headers[0]["authorization"] == f"Bearer {API_KEY}"


def whole_reply(text: str | None, *calls: tuple[str, str], usage: Any = None) -> Reply:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": CALL_KTOOL, "arguments": args}}
            for cid, args in calls
        ]
    return Reply(
        body={
            "id": "chatcmpl-2",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if calls else "stop",
                }
            ],
            "usage": usage,
        }
    )


CALL_ARGS = '{"name": "weather", "arguments": {"city": "Oslo"}}'


def test_an_empty_stream_for_a_tool_request_is_asked_again_whole_and_remembered(
    scripted: ScriptedServer, sleeps: list[float]
) -> None:
    scripted.replies.put(Reply(chunks=[]))  # what llama.cpp sends when it cannot stream the choice
    scripted.replies.put(whole_reply(None, ("call_W1", CALL_ARGS), usage=usage_json(50, 9, 0, 0)))
    scripted.replies.put(whole_reply("Cold.", usage=usage_json(70, 2, 0, 0)))
    scripted.replies.put(whole_reply("Again cold."))  # the next turn: whole from the start
    io = RecordingTurnIO(results=lambda call_id: ToolResult(success=True, output="-3 C"))
    provider = provider_for(scripted.base_url, sleeps)

    outcome = run(provider, request("Weather in Oslo?"), io)

    assert isinstance(outcome, ProviderOutcome), outcome
    assert outcome.answer == "Cold."
    assert [e.call.call_id for e in io.of(ToolCallRequested)] == ["call_W1"]
    assert [e.text for e in io.of(TextDelta)] == ["Cold."]
    assert outcome.usage is not None and outcome.usage.input_tokens == 120
    assert [type(e) for e in io.events] == [
        Submitted,
        UsageUpdate,
        ToolCallRequested,
        Submitted,
        TextDelta,
        UsageUpdate,
    ]
    second = run(provider, request("And now?"), RecordingTurnIO())
    assert isinstance(second, ProviderOutcome) and second.answer == "Again cold."
    assert [r.get("stream") for r in scripted.requests] == [True, False, False, False]
    assert scripted.headers[0]["connection"] == "close"  # the probe's connection is not reused
    # The request made again is the same request, only not streamed.
    first, again = scripted.requests[:2]
    assert {k: v for k, v in first.items() if k != "stream_options"} == {**again, "stream": True}
    assert sleeps == []


def test_a_text_request_is_still_streamed_once_tool_requests_are_not(
    scripted: ScriptedServer, sleeps: list[float]
) -> None:
    scripted.replies.put(whole_reply(None, ("call_W1", CALL_ARGS)))
    scripted.replies.put(text_reply("Cold", "."))
    io = RecordingTurnIO(results=lambda call_id: ToolResult(success=True, output="-3 C"))
    provider = provider_for(scripted.base_url, sleeps, stream_tools="never")

    outcome = run(provider, request("Weather?", tool_choice_after_call="none"), io)

    assert isinstance(outcome, ProviderOutcome) and outcome.answer == "Cold.", outcome
    assert [r.get("stream") for r in scripted.requests] == [False, True]
    assert [e.text for e in io.of(TextDelta)] == ["Cold", "."]


def test_stream_tools_always_reports_an_empty_stream(scripted: ScriptedServer, sleeps: list[float]) -> None:
    scripted.replies.put(Reply(chunks=[]))
    provider = provider_for(scripted.base_url, sleeps, stream_tools="always")

    outcome = run(provider, request("hi"), RecordingTurnIO())

    assert isinstance(outcome, ProviderError), outcome
    assert outcome.kind == "unavailable" and "stream ended" in outcome.message
    assert len(scripted.requests) == 1


def test_stream_tools_must_be_a_known_value() -> None:
    with pytest.raises(ValueError, match="stream_tools must be one of auto, always, never"):
        OpenAIProvider("http://127.0.0.1:1/v1", "k", stream_tools="sometimes")


def test_429_and_5xx_are_retried_before_the_stream_starts(
    scripted: ScriptedServer, sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    echoed = {"error": {"message": f"overloaded (you sent Bearer {API_KEY})", "type": "server_error"}}
    scripted.replies.put(Reply(status=503, body=echoed))
    scripted.replies.put(Reply(status=429, body={"error": {"message": "slow down"}}))
    scripted.replies.put(Reply(status=500, body={"error": {"message": "oops"}}))
    scripted.replies.put(text_reply("fine", " now"))
    caplog.set_level(logging.DEBUG)

    outcome = run(provider_for(scripted.base_url, sleeps, max_attempts=4), request("hi"), RecordingTurnIO())

    assert isinstance(outcome, ProviderOutcome), outcome
    assert outcome.answer == "fine now" and outcome.usage is None
    assert len(sleeps) == 3 and len(scripted.requests) == 4
    assert "retrying" in caplog.text and API_KEY not in caplog.text


def test_retries_end_and_the_error_keeps_its_kind(scripted: ScriptedServer, sleeps: list[float]) -> None:
    for _ in range(2):
        scripted.replies.put(Reply(status=503, body={"error": {"message": f"down, key {API_KEY}"}}))

    outcome = run(provider_for(scripted.base_url, sleeps, max_attempts=2), request("hi"), RecordingTurnIO())

    assert isinstance(outcome, ProviderError), outcome
    assert outcome.kind == "unavailable" and not outcome.started
    assert isinstance(outcome.__cause__, openai.InternalServerError)
    assert len(sleeps) == 1 and len(scripted.requests) == 2
    assert API_KEY not in outcome.message and "***" in outcome.message


def test_4xx_is_failed_at_once(scripted: ScriptedServer, sleeps: list[float]) -> None:
    scripted.replies.put(Reply(status=400, body={"error": {"message": "bad tool_choice"}}))

    outcome = run(provider_for(scripted.base_url, sleeps), request("hi"), RecordingTurnIO())

    assert isinstance(outcome, ProviderError), outcome
    assert outcome.kind == "failed" and "bad tool_choice" in outcome.message
    assert isinstance(outcome.__cause__, openai.BadRequestError)
    assert sleeps == [] and len(scripted.requests) == 1


def test_a_stream_cut_before_its_end_is_unavailable(scripted: ScriptedServer, sleeps: list[float]) -> None:
    reply = text_reply("half an ans")
    reply.chunks = reply.chunks[:2]  # no finish_reason: the server went away between events
    scripted.replies.put(reply)

    outcome = run(provider_for(scripted.base_url, sleeps), request("hi"), RecordingTurnIO())

    assert isinstance(outcome, ProviderError), outcome
    assert outcome.kind == "unavailable" and outcome.started and sleeps == []


def test_repr_names_the_endpoint_but_never_the_key() -> None:
    provider = OpenAIProvider(f"https://user:pw@llm.example:8443/v1?token={API_KEY}", API_KEY)
    try:
        assert repr(provider) == "OpenAIProvider(base_url='https://llm.example:8443/v1')"
        assert API_KEY not in repr(provider) and API_KEY not in str(provider)
    finally:
        provider.close()


def test_a_response_schema_is_sent_as_a_strict_json_schema_response_format(
    scripted: ScriptedServer, sleeps: list[float]
) -> None:
    """A turn's ``response_schema`` (the goal judge's verdict schema) goes with the request as
    ``response_format: json_schema`` (strict); a turn without one sends no response_format."""
    schema = {
        "type": "object",
        "properties": {"achieved": {"type": "boolean"}},
        "required": ["achieved"],
        "additionalProperties": False,
    }
    answer = '{"achieved": true}'
    for _ in range(2):
        scripted.replies.put(Reply(chunks=[chunk({"content": answer}), chunk({}, finish="stop")]))
    provider = provider_for(scripted.base_url, sleeps)
    req = request("judge it")
    outcome = run(provider, dataclasses.replace(req, response_schema=schema), RecordingTurnIO())
    assert isinstance(outcome, ProviderOutcome) and outcome.answer == answer
    assert scripted.requests[0]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": schema, "strict": True},
    }
    run(provider, req, RecordingTurnIO())
    assert "response_format" not in scripted.requests[1]
