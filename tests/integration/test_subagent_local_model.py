"""The subagent run on the real embedded model (SmolLM2 through llama.cpp): token counts from the model's own
tokenizer (CJK is not under-counted), the capacity check against them, and a run whose tool updates state."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from llama_cpp import Llama

from actors.app.wiring import registry
from actors.router.actor import RouterActor
from actors.router.catalog import ModelCatalog
from actors.router.messages import CountTokens, TokenCount
from actors.router.providers.local import default_model_path
from actors.runs.projection import Projection, StateUpdate, ToolOutcome, manifest_hash
from actors.runs.subagent import (
    AuditEvent,
    ContextBudget,
    ContextCapacityError,
    RunHostActor,
    RunRequest,
    run,
)
from actors.types import ToolCall
from transport import Node
from transport.capture import CaptureWriter, read_log
from transport.codec import decode_header

pytestmark = pytest.mark.integration

OP = uuid.UUID("00000000-0000-4000-8000-0000000000cc")
RESERVE = 600  # the chat template, the function declaration and the format instructions take ~250

# The 135M model is steered, not trusted: the first request must call the tool (grammar-forced), the one
# after the result must answer in text.
CATALOG: dict[str, Any] = {
    "providers": {
        "smol": {
            "kind": "local",
            "tool_choice": "required",
            "tool_choice_after_call": "none",
            "temperature": 0.0,
            "seed": 7,
            "max_output_tokens": 40,
        }
    },
    "models": {
        "smol-run": {
            "provider": "smol",
            "provider_model": "SmolLM2-135M-Instruct",
            "context_window": 4096,
            "max_input_tokens": 3500,
        },
    },
}
CJK_TASK = (
    "请阅读下面的说明然后用一句话总结今天的天气情况。北京晴二十一度。上海小雨十八度。广州多云二十六度。"
)


def catalog(max_input_tokens: int = 3500) -> ModelCatalog:
    raw = {**CATALOG, "models": {"smol-run": {**CATALOG["models"]["smol-run"]}}}
    raw["models"]["smol-run"]["max_input_tokens"] = max_input_tokens
    return ModelCatalog.from_mapping(raw)


@pytest.fixture(scope="module")
def tokenizer() -> Llama:
    return Llama(model_path=str(default_model_path()), vocab_only=True, verbose=False)


def real_count(tokenizer: Llama, text: str) -> int:
    return len(tokenizer.tokenize(text.encode("utf-8"), add_bos=False, special=False))


class StateApp:
    """A Host whose every tool call stores its arguments as replaceable state under the key "note"."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.calls: list[tuple[ToolCall, ContextBudget]] = []

    def render_tool_call(self, call: ToolCall) -> str:
        return f"{call.name}({call.arguments})"

    def execute_tool(self, call: ToolCall, operation_id: uuid.UUID, budget: ContextBudget) -> Any:
        self.calls.append((call, budget))
        value = f"note saved: {call.arguments}"
        assert budget.fits_state("note", value)
        return ToolOutcome(
            text="saved",
            ok=True,
            state_updates=(StateUpdate(key="note", text=value),),
            displayed_state_keys=(),
        )

    def complete_capture(self, capture: Any, contents: str, budget: ContextBudget) -> Any:
        raise AssertionError("no capture in this run")

    def record(self, event: Any) -> None:
        self.events.append(event)

    def of(self, kind: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture
def node(make_node: Callable[..., Node], tmp_path: Path) -> Node:
    return make_node("n1", registry=registry())


def test_cjk_counts_come_from_the_model_tokenizer_and_are_never_under(
    node: Node, tmp_path: Path, tokenizer: Llama
) -> None:
    """The Router counts with the local model's own tokenizer (exact), and a CJK task the 4-characters-per-
    token guess would under-count by half is counted at its real size: the run's estimate of P is never
    below the tokenizer's count of the whole P, so a model whose capacity is one token short refuses it
    (ContextCapacityError) before any provider turn."""
    node.spawn(RouterActor, "router", catalog=catalog(), data_dir=tmp_path)
    texts = (CJK_TASK, "hello world", "1234567890", "")
    counted: TokenCount = node.request("n1/router", CountTokens(model="smol-run", texts=texts), timeout=60)
    assert counted.exact
    assert counted.counts == tuple(real_count(tokenizer, t) for t in texts)
    guess = math.ceil(len(CJK_TASK) / 4)
    assert counted.counts[0] > 2 * guess  # a 4-characters-per-token guess under-counts CJK

    projection = Projection(("上下文只用中文。",), CJK_TASK).render()
    whole = real_count(tokenizer, projection)
    app = StateApp()
    node.spawn(RunHostActor, "host", host=app)
    # A model whose maximum is one token below (its real count plus the reserve) must refuse the run.
    node.spawn(RouterActor, "tight", catalog=catalog(whole + RESERVE - 1), data_dir=tmp_path / "t")
    request = RunRequest(
        user_id="u1",
        parent_operation_id=OP,
        model="smol-run",
        reasoning_effort="",
        context=("上下文只用中文。",),
        task=CJK_TASK,
        timeout=120.0,
    )
    with pytest.raises(ContextCapacityError) as err:
        run(node, "n1/tight", request, "n1/host", timeout=120, protocol_reserve_tokens=RESERVE)
    assert err.value.estimated >= whole + RESERVE and err.value.maximum == whole + RESERVE - 1
    assert [type(e).__name__ for e in app.events] == ["Started"]  # no InferenceSubmitted: no turn


def test_a_run_on_the_local_model_updates_state_and_answers(
    make_node: Callable[..., Node], tmp_path: Path, tokenizer: Llama
) -> None:
    """One run on SmolLM2: the grammar-forced call reaches the host, whose state update is accepted and
    projected; the second request is the whole projection re-rendered (history and state) and answers; the
    audit trail is complete and every submitted estimate covers the real tokenizer's count of that
    projection."""
    reg = registry()
    log = tmp_path / "run.buslog"
    node = make_node("n2", registry=reg, capture=CaptureWriter(log, node="n2", schema=reg.schema_hash()))
    node.spawn(RouterActor, "router", catalog=catalog(), data_dir=tmp_path)
    app = StateApp()
    node.spawn(RunHostActor, "host", host=app)
    context = (
        "Tools: `remember(text)` stores a note. Call call_ktool with "
        '{"name": "remember", "arguments": {"text": "buy milk"}}.',
    )
    request = RunRequest(
        user_id="u1",
        parent_operation_id=OP,
        model="smol-run",
        reasoning_effort="",
        context=context,
        task="Remember that I must buy milk, then say that it is done.",
        timeout=240.0,
        start_metadata={"test": "local"},
    )
    result = run(node, "n2/router", request, "n2/host", timeout=240, protocol_reserve_tokens=RESERVE)

    assert result.answer.strip() and result.model.model == "smol-run"
    ((call, budget),) = app.calls
    (tool_result,) = app.of(AuditEvent.ToolResult)
    assert (tool_result.ok, tool_result.projection_accepted, tool_result.result) == (True, True, "saved")
    submitted = app.of(AuditEvent.InferenceSubmitted)
    assert [s.round for s in submitted] == [1, 2]
    # The second request is the projection with the call, its result and the new state, re-rendered.
    first = Projection(context, request.task).render()
    second = Projection(context, request.task)
    second.add(f"{call.name}({call.arguments})", "saved", True)
    second.apply([StateUpdate(key="note", text=f"note saved: {call.arguments}")])
    renderings = (first, second.render())
    assert [s.manifest_hash for s in submitted] == [manifest_hash(p) for p in renderings]
    for s, p in zip(submitted, renderings, strict=True):
        assert s.estimated_input_tokens - RESERVE >= real_count(tokenizer, p)
    assert budget.estimated_tokens() == submitted[0].estimated_input_tokens
    # What llama.cpp was given for each request (the Router's TurnInput events, from the node's capture):
    # the whole projection as the one user message, never the call and its result appended natively.
    inputs = [
        reg.decode("router.ev.input", r.frames[1]).context
        for r in read_log(log).records
        if r.at == "deliver" and decode_header(r.frames[0]).kind == "router.ev.input"
    ]
    assert [[(i.role, i.text) for i in c.items] for c in inputs] == [[("user", p)] for p in renderings]
    names = [type(e).__name__ for e in app.events]
    assert names == [
        "Started",
        "InferenceSubmitted",
        "ToolCall",
        "ToolResult",
        "InferenceSubmitted",
        "ProviderReceipt",
        "Completed",
    ]
    (receipt,) = app.of(AuditEvent.ProviderReceipt)
    assert receipt.round == 2 and receipt.receipt.status == "completed"
    # The provider's real prompts (template and tool declaration included) fit within estimate + reserve.
    assert receipt.usage is not None
    assert 0 < receipt.usage.input_tokens <= sum(s.estimated_input_tokens for s in submitted)
    assert app.events[-1].response == result.answer
