"""OpenAIProvider: any OpenAI-compatible Chat Completions endpoint (OpenAI, vLLM, Ollama, llama.cpp servers).

Through the official ``openai`` SDK, streaming, with the one ``call_ktool`` tool:

- text: one ``TextDelta`` per content delta; the answer is the text of the turn's last request;
- tool calls: assembled from their deltas by ``index`` (the id from the delta that carries one, the name
  once: llama.cpp's server repeats the whole name in every delta, so a fragment equal to the name so far is
  a repeat, anything else continues it, and the argument fragments concatenated); each becomes a
  ``ToolCallRequested``, its result is awaited, and the conversation goes back with the assistant's call
  and the ``tool`` results, until a request ends without calls;
- usage: from the final chunk (``stream_options.include_usage``), cumulative over the turn's requests.
  A server that sends none (llama.cpp's does not) leaves the outcome's usage ``None``: none is invented.

Cancellation is checked before each request, during a retry back-off and between chunks; closing the
stream then drops the connection, which stops the server generating. (A server that stalls mid-stream
holds the turn until the read ``timeout``, unless the Router's own timeout ends it first.)

Retries (tenacity, bounded in attempts and total delay, injectable sleep): only while opening a request,
before any of its stream has arrived, and only for a refused connection (nothing was sent), HTTP 429 and
5xx. Once the stream has started nothing is retried: a dropped stream ends the turn.

Requests that offer the tool (any ``tool_choice`` but ``"none"``) are not streamed when the server cannot
stream a tool choice. ``stream_tools`` says how that is known: ``"auto"`` (the default) streams them until a
server answers one with an empty stream (no chunk, no finish: llama.cpp's ``chatml-function-calling`` does
this for ``"auto"``, ``"required"`` and a named tool it has not got, and prints the reason only to its own
log), then makes that same request again without streaming and remembers, for this provider, to send every
later one so; ``"never"`` never streams them; ``"always"`` always does (an empty stream is then an error).
A request made without streaming emits the same events: its text as one ``TextDelta``, its calls, its usage.

Errors are ``ProviderError`` with the SDK's exception as ``__cause__``; the message of an HTTP error is the
server's own, with its status (``the server answered HTTP 500: Tool with name 'x' not found in tools``).
``unavailable`` for a connection that failed or dropped (refused, reset, server killed, timeout) and for
502/503/504; ``failed`` for every other HTTP error (4xx, 500) or an error event in the stream. The API key
never appears in a message, a repr or a log line: messages are built from the SDK's text with the key masked.

A turn with a ``response_schema`` sends it with every request as ``response_format: {"type": "json_schema",
"json_schema": {"name": "response", "schema": ..., "strict": true}}``; the tool stays offered (a server that
honours the format constrains the final answer, one that does not ignores it).

Options (constructor defaults, overridden per request by ``TurnRequest.options``): ``tool_choice`` (the first
request's, default ``"auto"``), ``tool_choice_after_call`` (after a call was made in the turn, default
``"auto"``; OpenAI's agents SDK resets it the same way so that a forced call cannot loop), ``stream_tools``
(above), ``max_output_tokens`` (the limit of a request whose turn sets none), ``temperature``, ``top_p``,
``seed``, ``max_tokens_param`` (``"max_tokens"`` or ``"max_completion_tokens"``, the name
``max_output_tokens`` is sent under) and ``extra_body`` (a JSON object merged into the request).
"""

from __future__ import annotations

import logging
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_usage import CompletionUsage
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from actors.router.providers.base import (
    ChatMessage,
    NativeToolCall,
    ProviderError,
    ProviderOutcome,
    Submitted,
    TextDelta,
    ToolCallRequested,
    TurnCancelled,
    TurnIO,
    TurnRequest,
    UsageUpdate,
    model_context,
    resumed,
)
from actors.types import TokenUsage

log = logging.getLogger(__name__)

_REQUEST_KEYS = ("temperature", "top_p", "seed")
_UNAVAILABLE_STATUS = frozenset({502, 503, 504})
STREAM_TOOLS = ("auto", "always", "never")


def is_retryable(exc: BaseException) -> bool:
    """A failure to open a request that is safe and useful to retry: refused, 429, 5xx."""
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code == 429 or exc.status_code >= 500
    if isinstance(exc, openai.APIConnectionError) and not isinstance(exc, openai.APITimeoutError):
        # Only a refused connection: the request was never sent. A reset or a timeout may have reached
        # the server, which would then run (and bill) it twice.
        return any(isinstance(e, ConnectionRefusedError) for e in _chain(exc))
    return False


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def to_wire(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Provider-neutral messages as Chat Completions messages."""
    wire: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            wire.append({"role": "tool", "tool_call_id": m.tool_call_id or "", "content": m.content})
        elif m.role == "assistant" and m.tool_calls:
            wire.append(
                {
                    "role": "assistant",
                    "content": m.content,  # a string: llama.cpp's server rejects null here
                    "tool_calls": [
                        {
                            "id": c.call_id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }
                        for c in m.tool_calls
                    ],
                }
            )
        else:
            wire.append({"role": m.role, "content": m.content})
    return wire


def usage_of(usage: CompletionUsage) -> TokenUsage:
    prompt = usage.prompt_tokens or 0
    completion = usage.completion_tokens or 0
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
    reasoning = usage.completion_tokens_details.reasoning_tokens if usage.completion_tokens_details else None
    return TokenUsage(
        input_tokens=prompt,
        cached_input_tokens=cached or 0,
        output_tokens=completion,
        reasoning_output_tokens=reasoning or 0,
        total_tokens=usage.total_tokens or prompt + completion,
    )


def _add(a: TokenUsage, b: TokenUsage) -> TokenUsage:
    return replace(
        a,
        input_tokens=a.input_tokens + b.input_tokens,
        cached_input_tokens=a.cached_input_tokens + b.cached_input_tokens,
        output_tokens=a.output_tokens + b.output_tokens,
        reasoning_output_tokens=a.reasoning_output_tokens + b.reasoning_output_tokens,
        total_tokens=a.total_tokens + b.total_tokens,
    )


@dataclass(slots=True)
class _PendingCall:
    call_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)

    def add_name(self, fragment: str) -> None:
        if fragment != self.name:  # llama.cpp's server repeats the whole name in every delta
            self.name += fragment


def _finish(reason: str | None) -> str:
    """The provider-neutral finish reason: "length" when the server cut the reply at its token limit."""
    return "length" if reason == "length" else "stop"


@dataclass(slots=True)
class _Reply:
    text: str
    calls: tuple[NativeToolCall, ...]
    usage: TokenUsage | None
    finish_reason: str = "stop"  # "length": the server cut the reply at its token limit


@dataclass(slots=True)
class _Turn:
    io: TurnIO
    usage: TokenUsage | None = None
    started: bool = False

    def check_cancelled(self) -> None:
        if self.io.cancelled.is_set():
            raise ProviderError("cancelled", "turn cancelled", started=self.started)


def response_format(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The Chat Completions ``response_format`` for a turn's response schema (strict structured output)."""
    return {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": dict(schema), "strict": True},
    }


class OpenAIProvider:
    """A client for one OpenAI-compatible endpoint, shared by all its turns (the SDK client is thread-safe).

    Invariant: the API key lives only inside the SDK client and ``_mask``; it is in no repr and no message.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 120.0,
        connect_timeout: float = 10.0,
        max_attempts: int = 4,
        max_retry_delay: float = 20.0,
        initial_wait: float = 0.25,
        max_wait: float = 4.0,
        sleep: Callable[[float], None] | None = None,
        tool_choice: object = "auto",
        tool_choice_after_call: object = "auto",
        max_tokens_param: str = "max_tokens",
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        stream_tools: str = "auto",
        max_output_tokens: int | None = None,
    ) -> None:
        if max_attempts < 1 or max_retry_delay <= 0:
            raise ValueError("retries must be bounded: max_attempts >= 1 and max_retry_delay > 0")
        if stream_tools not in STREAM_TOOLS:
            raise ValueError(f"stream_tools must be one of {', '.join(STREAM_TOOLS)}, not {stream_tools!r}")
        if max_output_tokens is not None and max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be at least 1, not {max_output_tokens}")
        self._max_output_tokens = max_output_tokens
        self._stream_tools = stream_tools
        # Set once a server answered a streamed tool request with an empty stream ("auto"); only ever goes
        # from True to False (a plain attribute: the turns' worker threads may all read it).
        self._streams_tools = stream_tools != "never"
        # Until a streamed tool request has had an answer ("auto"), such a request asks for its own
        # connection: a server that gives up on the stream closes the connection just after the empty
        # response, and the request made again at once must not be sent down that closing connection.
        self._tools_probed = stream_tools != "auto"
        self._base_url = base_url
        self._secret = api_key
        self._client = openai.OpenAI(
            base_url=base_url,
            api_key=api_key,
            max_retries=0,  # retries are ours: bounded, and never once a stream has started
            timeout=openai.Timeout(timeout, connect=connect_timeout),
        )
        self._max_attempts = max_attempts
        self._max_retry_delay = max_retry_delay
        self._initial_wait = initial_wait
        self._max_wait = max_wait
        self._sleep = sleep
        self._defaults: dict[str, Any] = {
            "tool_choice": tool_choice,
            "tool_choice_after_call": tool_choice_after_call,
            "max_tokens_param": max_tokens_param,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "extra_body": dict(extra_body) if extra_body else None,
        }

    def __repr__(self) -> str:
        return f"OpenAIProvider(base_url={_public_url(self._base_url)!r})"

    def close(self) -> None:
        self._client.close()

    def run_turn(self, request: TurnRequest, io: TurnIO) -> ProviderOutcome:
        settings = {**self._defaults, **request.options}
        choice = _tool_choice(settings["tool_choice"])
        turn = _Turn(io)
        messages = list(request.messages)
        while True:
            turn.check_cancelled()
            io.emit(Submitted(model_context(request, messages)))
            reply = self._request(turn, request, messages, choice, settings)
            if reply.usage is not None:
                turn.usage = reply.usage if turn.usage is None else _add(turn.usage, reply.usage)
                io.emit(UsageUpdate(turn.usage))
            if not reply.calls:
                return ProviderOutcome(reply.text, turn.usage, finish_reason=reply.finish_reason)
            for call in reply.calls:
                io.emit(ToolCallRequested(call))
            results = []
            for call in reply.calls:
                try:
                    results.append(io.wait_result(call.call_id))
                except TurnCancelled as exc:
                    raise ProviderError("cancelled", "turn cancelled", started=True) from exc
            messages = resumed(
                io,
                messages,
                (
                    ChatMessage("assistant", reply.text, tool_calls=reply.calls),
                    *(
                        ChatMessage("tool", result.output, tool_call_id=call.call_id)
                        for call, result in zip(reply.calls, results, strict=True)
                    ),
                ),
            )
            choice = _tool_choice(settings["tool_choice_after_call"])

    def _request(
        self,
        turn: _Turn,
        request: TurnRequest,
        messages: Sequence[ChatMessage],
        choice: object,
        settings: Mapping[str, Any],
    ) -> _Reply:
        params: dict[str, Any] = {
            "model": request.model.provider_model,
            "messages": to_wire(messages),
            "tools": [request.tool.as_openai()],
            "tool_choice": choice,
        }
        params.update({k: settings[k] for k in _REQUEST_KEYS if settings.get(k) is not None})
        limit = request.max_output_tokens or self._max_output_tokens
        if limit is not None:
            params[str(settings["max_tokens_param"])] = limit
        if request.reasoning_effort is not None:
            params["reasoning_effort"] = request.reasoning_effort
        if request.response_schema is not None:
            params["response_format"] = response_format(request.response_schema)
        if settings.get("extra_body"):
            params["extra_body"] = dict(settings["extra_body"])
        offers_tool = choice != "none"
        if offers_tool and not self._streams_tools:
            return self._whole(turn, params)
        probing = offers_tool and not self._tools_probed
        streamed = {**params, "stream": True, "stream_options": {"include_usage": True}}
        if probing:
            streamed["extra_headers"] = {"Connection": "close"}
        stream = self._open(turn, streamed)
        try:
            reply = self._read(turn, stream, fallback=offers_tool and self._stream_tools == "auto")
        finally:
            stream.close()  # also on cancellation: closing the connection stops the server generating
        if reply is not None:
            if probing and reply.calls:  # a streamed call: this server streams tool choices
                self._tools_probed = True
            return reply
        log.info(
            "%s answered a streamed tool request with an empty stream: tool requests are sent "
            "without streaming from now on",
            _public_url(self._base_url),
        )
        self._streams_tools = False
        return self._whole(turn, params)

    def _whole(self, turn: _Turn, params: Mapping[str, Any]) -> _Reply:
        """One request without streaming, reported with the events a streamed one emits."""
        completion = self._open(turn, {**params, "stream": False})
        assert isinstance(completion, ChatCompletion)
        turn.check_cancelled()
        if not completion.choices:
            raise ProviderError("failed", "the server answered with no choice", started=turn.started)
        message = completion.choices[0].message
        text = message.content or ""
        if text:
            turn.started = True
            turn.io.emit(TextDelta(text))
        calls = tuple(
            NativeToolCall(c.id or f"call_{uuid.uuid4().hex}", c.function.name, c.function.arguments or "")
            for c in message.tool_calls or ()
            if c.type == "function"
        )
        turn.started = turn.started or bool(calls)
        usage = usage_of(completion.usage) if completion.usage is not None else None
        return _Reply(text, calls, usage, _finish(completion.choices[0].finish_reason))

    def _open(self, turn: _Turn, params: Mapping[str, Any]) -> Any:
        """Send one request; retried only here, before any of its stream has arrived."""

        def sleep(seconds: float) -> None:
            if self._sleep is not None:
                self._sleep(seconds)
            else:
                turn.io.cancelled.wait(seconds)  # a cancellation cuts the back-off short
            turn.check_cancelled()

        def before_sleep(state: Any) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            log.info(
                "retrying %s in %.2fs after attempt %d: %s",
                _public_url(self._base_url),
                state.upcoming_sleep,
                state.attempt_number,
                self._describe(exc),
            )

        retrying = Retrying(
            retry=retry_if_exception(is_retryable),
            stop=stop_after_attempt(self._max_attempts) | stop_after_delay(self._max_retry_delay),
            wait=wait_exponential_jitter(
                multiplier=self._initial_wait, max=self._max_wait, jitter=self._initial_wait
            ),
            before_sleep=before_sleep,
            sleep=sleep,
            reraise=True,
        )
        try:
            answer = retrying(self._client.chat.completions.create, **params)
        except openai.APIStatusError as exc:
            kind = "unavailable" if exc.status_code in _UNAVAILABLE_STATUS else "failed"
            raise ProviderError(kind, self._describe(exc), started=turn.started) from exc
        except openai.APIConnectionError as exc:
            raise ProviderError("unavailable", self._describe(exc), started=turn.started) from exc
        except openai.OpenAIError as exc:
            raise ProviderError("failed", self._describe(exc), started=turn.started) from exc
        return answer

    def _read(
        self, turn: _Turn, stream: openai.Stream[ChatCompletionChunk], *, fallback: bool = False
    ) -> _Reply | None:
        """The streamed reply; None for an empty stream when ``fallback`` (the caller asks again whole)."""
        text: list[str] = []
        pending: dict[int, _PendingCall] = {}
        usage: TokenUsage | None = None
        finished = False
        reason = "stop"
        chunks = 0
        try:
            for chunk in stream:
                chunks += 1
                turn.check_cancelled()
                if chunk.usage is not None:
                    usage = usage_of(chunk.usage)
                for choice in chunk.choices:
                    delta = choice.delta
                    if delta.content:
                        turn.started = True
                        text.append(delta.content)
                        turn.io.emit(TextDelta(delta.content))
                    for tc in delta.tool_calls or ():
                        turn.started = True
                        call = pending.setdefault(tc.index, _PendingCall())
                        if tc.id and not call.call_id:
                            call.call_id = tc.id
                        if tc.function is not None:
                            if tc.function.name:
                                call.add_name(tc.function.name)
                            if tc.function.arguments:
                                call.arguments.append(tc.function.arguments)
                    if choice.finish_reason is not None:
                        finished = True
                        reason = _finish(choice.finish_reason)
        except openai.APIConnectionError as exc:  # the SDK wraps a reset or truncated stream in this
            raise ProviderError("unavailable", self._describe(exc), started=turn.started) from exc
        except openai.OpenAIError as exc:  # an error event inside the stream
            raise ProviderError("failed", self._describe(exc), started=turn.started) from exc
        turn.check_cancelled()
        if chunks == 0 and fallback:
            return None
        if not finished:
            raise ProviderError(
                "unavailable", "the stream ended before the model finished its reply", started=turn.started
            )
        calls = tuple(
            NativeToolCall(
                # A server that sends no id still gets an exact one: the Router keys results by it.
                p.call_id or f"call_{uuid.uuid4().hex}",
                p.name,
                "".join(p.arguments),
            )
            for _, p in sorted(pending.items())
        )
        return _Reply("".join(text), calls, usage, reason)

    def _describe(self, exc: BaseException | None) -> str:
        """The SDK's text for ``exc`` with the API key masked (a server may echo what it was sent)."""
        if exc is None:
            return "unknown error"
        if isinstance(exc, openai.APIStatusError):
            said = _server_message(exc.body)
            message = f"the server answered HTTP {exc.status_code}: {said or '(no message)'}"
        else:
            message = f"{type(exc).__name__}: {exc}"
        if self._secret:
            message = message.replace(self._secret, "***")
        return message[:1000]


def _server_message(body: object) -> str:
    """The message in an error body: OpenAI's ``{"error": {"message": ...}}``, ``{"message": ...}``,
    ``{"detail": ...}`` (FastAPI), or the body's text."""
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping):
            for key in ("message", "detail"):
                if isinstance(inner.get(key), str) and inner[key]:
                    return str(inner[key])
        elif isinstance(inner, str):
            return inner
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
        return ""
    return body.strip() if isinstance(body, str) else ""


def _tool_choice(choice: object) -> object:
    """OpenAI's forms as they are; any other string names the function to force (a config shorthand)."""
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice


def _public_url(url: str) -> str:
    """``url`` without user information, query or fragment (where a credential could hide)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


__all__ = ["OpenAIProvider", "is_retryable", "model_context", "to_wire", "usage_of"]
