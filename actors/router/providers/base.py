"""The provider seam: what a provider implements to run one streaming turn for the Router.

A provider turn is a generator, ``Provider.steps(request, io)`` (``TurnSteps``): it ``emit``s events through
``TurnIO`` as they happen and *yields* what it waits for next (``Wait``): ``AwaitResult`` (the result of a
tool call it emitted is sent back into it), ``AwaitFuture`` (a ``concurrent.futures.Future``, such as a bus
request's: its result is sent back into it, or its exception thrown), ``Pause`` (more to do: let the
hosting actor handle its other messages first), ``Sleep`` or ``AwaitCancel``. It returns a
``ProviderOutcome`` or raises ``ProviderError`` (with the original exception as ``__cause__``). Cancelling a
turn throws ``TurnCancelled`` into it at the yield where it waits. No turn has a thread of its own: an actor
hosts its generator (``actors/router/stepping.py``), and ``Provider.placement`` says which one: ``"inline"``
on the Router's own thread (a turn that never blocks: the scripted model, and codex, whose every wait is a
request to its adapter actor), ``"owner"`` on an actor the provider owns
(``Provider.turn_host``; the local model, one generation at a time), or ``"pool"`` on one of the Router's
configured worker actors (a turn that blocks on the network between its yields). A provider that has only
the older blocking ``run_turn(request, io)`` runs on the pool, waiting with ``TurnIO.wait_result``.

The Router owns everything else: operation ids, the one ``call_ktool`` definition, strict parsing of tool
calls, receipts, timeouts and cancellation.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Generator, Mapping, Sequence
from dataclasses import field
from typing import Any, Final, Literal, Protocol

# The one TurnCancelled (a RouterError on the wire): what a cancel throws into a turn, re-exported here.
from actors.router.messages import TurnCancelled as TurnCancelled
from actors.types import ContextItem, ModelContext, OfferedTool, ResolvedAgentModel, TokenUsage, ToolResult
from transport.records import frozen


@frozen
class ChatMessage:
    """One message of a chat-style conversation, in the provider-neutral form the Router keeps."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[NativeToolCall, ...] = ()  # assistant only
    tool_call_id: str | None = None  # tool only


@frozen
class NativeToolCall:
    """A tool call exactly as the provider produced it (the Router parses ``arguments`` strictly)."""

    call_id: str
    name: str
    arguments: str  # raw JSON text, possibly invalid


@frozen
class ToolSpec:
    """The one native tool offered to the provider (``call_ktool``) in OpenAI function form."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def as_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@frozen
class TurnRequest:
    """Everything a provider needs for one turn; ``messages`` is the whole conversation so far."""

    model: ResolvedAgentModel
    messages: tuple[ChatMessage, ...]
    tool: ToolSpec
    reasoning_effort: str | None = None
    max_output_tokens: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)  # provider settings from the catalog
    # StartTurn.response_schema: a JSON schema for the answer (local: a grammar; openai: response_format)
    response_schema: Mapping[str, Any] | None = None
    # StartTurn.tools: the application tools ``tool`` (call_ktool) runs, as data (local: the call's grammar)
    tools: tuple[OfferedTool, ...] = ()


# Events a provider emits (in provider order).
@frozen
class Submitted:
    context: ModelContext


@frozen
class TextDelta:
    text: str


@frozen
class UsageUpdate:
    usage: TokenUsage  # cumulative for the turn


@frozen
class ToolCallRequested:
    call: NativeToolCall


ProviderEvent = Submitted | TextDelta | UsageUpdate | ToolCallRequested


@frozen
class ProviderOutcome:
    answer: str
    usage: TokenUsage | None
    # Native state to continue from (e.g. a response id); None: the Router keeps the messages itself.
    continuation: bytes | None = None
    # Why the model stopped: "stop" (it ended its answer) or "length" (cut at the output-token limit).
    finish_reason: str = "stop"


class ProviderError(Exception):
    """A provider failure. ``kind`` says how the turn ends; ``__cause__`` is the original exception.

    kinds: "unavailable" (the provider could not be reached or went away: connection refused, reset,
    killed server), "failed" (it answered with an error), "cancelled", "timed_out", "closed" (the stream
    ended without a final answer: the Router reports ``TurnClosed`` and ``FinishUnavailable`` accounts it).
    """

    def __init__(self, kind: str, message: str, *, started: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.started = started  # whether any output had arrived before the failure


CLOSED: Final = "closed"  # ProviderError.kind of a stream that ended without a final answer


# What a stepped turn yields (``TurnSteps``): what it waits for before its next step.
@frozen
class AwaitResult:
    """The result of the tool call ``call_id`` (emitted before): the host sends the ``ToolResult`` back."""

    call_id: str


@frozen
class Pause:
    """More to do at once; the host handles its other messages (a cancel, a result) before the next step.
    A turn that paused keeps its host (``"owner"``: the model) until it yields anything else."""


@frozen
class Sleep:
    """Resume after ``seconds`` (a scripted delay), without holding the host."""

    seconds: float


@frozen
class AwaitCancel:
    """Nothing more until the turn is cancelled (a scripted hang)."""


@frozen
class AwaitFuture:
    """The outcome of ``future`` (e.g. a bus request's, the codex facade's ``*_future``): the host sends its
    result back, or throws its exception in, on the host's own thread, and holds nothing meanwhile. What
    bounds the wait is the future's own (a bus request's timeout); a cancel throws ``TurnCancelled`` in, and
    the future's later outcome is dropped (the turn's to clean up after, if it must)."""

    future: concurrent.futures.Future[Any]


Wait = AwaitResult | AwaitFuture | Pause | Sleep | AwaitCancel
# What a step is sent: a ToolResult (AwaitResult), an AwaitFuture's result, or None.
TurnSteps = Generator[Wait, Any, ProviderOutcome]
Placement = Literal["inline", "owner", "pool"]
PAUSE: Final = Pause()


class TurnIO(Protocol):
    """The provider's only view of the Router; safe to use from whichever thread hosts the turn.

    ``cancelled`` is set when the Router cancels the turn (a turn may check it inside a long blocking
    step); ``wait_result`` is for a blocking ``run_turn`` only (a stepped turn yields ``AwaitResult``) and
    raises ``TurnCancelled``."""

    cancelled: threading.Event

    def emit(self, event: ProviderEvent) -> None: ...

    def wait_result(self, call_id: str) -> ToolResult:
        """Block until the Router delivers the result for ``call_id``; raises TurnCancelled."""
        ...


def model_context(
    request: TurnRequest,
    messages: Sequence[ChatMessage] | None = None,
    *,
    reasoning_effort: str | bool | None = True,
    continued: bool = False,
) -> ModelContext:
    """The normalized form of what one provider request submits (system text becomes the instructions).

    ``messages`` defaults to the request's own; ``reasoning_effort=None`` for a model that has no such
    setting (nothing was sent), otherwise the request's is reported.
    """
    messages = request.messages if messages is None else messages
    items: list[ContextItem] = []
    for m in messages:
        if m.role == "system":
            continue
        if m.content or not m.tool_calls:
            items.append(ContextItem(role=m.role, text=m.content, call_id=m.tool_call_id))
        items.extend(ContextItem(role="assistant", text=c.arguments, call_id=c.call_id) for c in m.tool_calls)
    system = [m.content for m in messages if m.role == "system"]
    return ModelContext(
        model=request.model.provider_model,
        reasoning_effort=request.reasoning_effort if reasoning_effort is True else None,
        instructions="\n\n".join(system) if system else None,
        items=tuple(items),
        tools=(request.tool.name,),
        continued=continued,
    )


class Provider(Protocol):
    """A provider client (one per provider entry in the config; shared by all its turns).

    A stepped provider also has ``placement`` and ``steps(request, io) -> TurnSteps`` (and, placed
    ``"owner"``, ``turn_host()``: the actor ref its turns run on); see the module docstring."""

    name: str

    def run_turn(self, request: TurnRequest, io: TurnIO) -> ProviderOutcome:
        """Run one turn on the calling thread until a final answer; emit events on the way."""
        ...

    def close(self) -> None: ...


_POLL: Final = 0.05  # how often ``drive`` looks at ``io.cancelled`` while it waits for a future


def drive(steps: TurnSteps, io: TurnIO) -> ProviderOutcome:
    """Run a stepped turn to its end on the calling thread (a direct caller's ``run_turn``, never an
    actor's): an ``AwaitResult`` waits in ``io.wait_result`` (its ``TurnCancelled`` is thrown into the
    turn), an ``AwaitFuture`` blocks on its future until it settles or ``io.cancelled`` is set (then
    ``TurnCancelled`` is thrown in), a ``Sleep`` or ``AwaitCancel`` waits on ``io.cancelled``."""
    send: Any = None
    throw: BaseException | None = None
    try:
        while True:
            try:
                wait = steps.send(send) if throw is None else steps.throw(throw)
            except StopIteration as stop:
                outcome: ProviderOutcome = stop.value
                return outcome
            send, throw = None, None
            match wait:
                case AwaitResult(call_id=call_id):
                    try:
                        send = io.wait_result(call_id)
                    except TurnCancelled as exc:
                        return _cancelled(steps, exc, started=True)
                case AwaitFuture(future=future):
                    if not _settled(future, io.cancelled):
                        return _cancelled(steps, TurnCancelled("turn cancelled"), started=False)
                    if future.cancelled():
                        throw = concurrent.futures.CancelledError()
                    else:
                        throw = future.exception()
                        if throw is None:
                            send = future.result()
                case Sleep(seconds=seconds):
                    io.cancelled.wait(max(0.0, seconds))
                case AwaitCancel():
                    io.cancelled.wait()
                    return _cancelled(steps, TurnCancelled("turn cancelled"), started=False)
                case Pause():
                    pass
    finally:
        steps.close()


def _settled(future: concurrent.futures.Future[Any], cancelled: threading.Event) -> bool:
    """Block until ``future`` settles (True) or ``cancelled`` is set first (False)."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    while not done.wait(_POLL):
        if cancelled.is_set():
            return False
    return True


def _cancelled(steps: TurnSteps, cancel: TurnCancelled, *, started: bool) -> ProviderOutcome:
    """Throw the cancel into the turn: how it ends (it may still return an outcome)."""
    try:
        steps.throw(cancel)
    except StopIteration as stop:
        done: ProviderOutcome = stop.value
        return done
    raise ProviderError("cancelled", "turn cancelled", started=started) from cancel


def estimate_tokens(text: str) -> int:
    """A conservative token count for a provider without a tokenizer: four ASCII characters per token,
    and every byte of a non-ASCII character its own token (a byte-level BPE never needs more than one
    token per byte, while CJK text runs at one to three tokens per character, far above 4 characters
    per token)."""
    ascii_chars = sum(1 for c in text if c < "\x80")
    return -(-ascii_chars // 4) + len(text.encode("utf-8")) - ascii_chars


def replaced_input(io: object) -> str | None:
    """The complete input the caller submitted for the turn's next request (Router ``SubmitInput``), if
    any; taken once. A provider then sends that input instead of appending the call and its result."""
    take = getattr(io, "take_input", None)
    text = take() if callable(take) else None
    return text if isinstance(text, str) else None


def resumed(
    io: object, messages: Sequence[ChatMessage], appended: Sequence[ChatMessage]
) -> list[ChatMessage]:
    """The conversation of the next request after tool results: ``appended`` added natively, or the
    system messages and the re-rendered input when the caller replaced it."""
    replaced = replaced_input(io)
    if replaced is None:
        return [*messages, *appended]
    return [*(m for m in messages if m.role == "system"), ChatMessage("user", replaced)]
