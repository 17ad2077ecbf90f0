"""The Shim actor against a ``FakeAdapterActor`` (SH-01..SH-24, C.1/C.3).

The real adapter over the real ``codex`` binary is in tests/integration/test_shim_codex.py; this file uses a
fake adapter only for what that cannot do on demand: hold a start or an event until the test says so, fail
a ``next_event`` or ``respond`` with a chosen error, reject a start with ``BUSY`` at a chosen moment, and
record one ordered trace shared with the codec and the launcher.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pykka
import pytest

from actors.app.wiring import registry
from actors.base import DEFER, BusActor, Context
from actors.codex.messages import Abandon, NextEvent, Respond, StartTurn, TurnStarted
from actors.codex.shim import (
    ACKNOWLEDGEMENT,
    LaunchRejected,
    Shim,
    ShimBox,
    ShimOutput,
    ShimText,
    turn_input,
)
from actors.codex.types import (
    ASYNC_TOOL_ACKNOWLEDGEMENT,
    AdapterError,
    CodexToolCall,
    Done,
    ErrorEvent,
    ErrorKind,
    TextDelta,
    ToolCallEvent,
)
from transport.errors import Expired
from transport.messages import Ok
from transport.node import Node

WAIT = 10.0  # every blocking wait in this file is bounded by this

SEED_ACK = (
    "The tool was launched asynchronously. Its result will not be available during this turn. Do not wait "
    "for or poll this call; continue the turn without its result. The result will be provided in the next "
    "user turn."
)

HOLD = object()  # a script step: answer nothing until the test calls ``release()``


def call(call_id: str, name: str = "t", **arguments: Any) -> ToolCallEvent:
    return ToolCallEvent(CodexToolCall(call_id=call_id, name=name, arguments=arguments))


def failed(kind: ErrorKind = ErrorKind.SERVER, message: str = "model failed") -> ErrorEvent:
    return ErrorEvent(AdapterError(kind, message))


# ------------------------------------------------------------------------------------------ FakeAdapter


class Trace(list[tuple[Any, ...]]):
    """One ordered record shared by the fake, the codec and the launcher; ``wait_for`` blocks (bounded)
    until a condition on it holds, woken by every append."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = threading.Condition()

    def append(self, entry: tuple[Any, ...]) -> None:
        with self._changed:
            super().append(entry)
            self._changed.notify_all()

    def wait_for(self, what: Callable[[], bool]) -> None:
        with self._changed:
            assert self._changed.wait_for(what, timeout=WAIT), "condition not reached"


@dataclass
class FakeAdapter:
    """The plan a ``FakeAdapterActor`` follows, and its record.

    ``turns`` holds one script per accepted start (events, an ``AdapterError`` to fail that ``next_event``,
    or ``HOLD``). ``starts`` holds what each ``StartTurn`` gets: ``None`` to accept, an ``AdapterError`` to
    reject, or ``HOLD``. ``trace`` is shared with the codec and the launcher.
    """

    trace: Trace
    turns: deque[list[Any]] = field(default_factory=deque)
    starts: deque[Any] = field(default_factory=deque)
    respond_errors: dict[str, AdapterError] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [entry for entry in self.trace if entry[0] == kind]


@dataclass(frozen=True)
class _Release:
    pass


@dataclass(frozen=True)
class _Noop:
    """Answered once the fake's mailbox got to it: everything sent to the fake before it was handled."""


class FakeAdapterActor(BusActor):
    """Speaks the Codex-adapter protocol (StartTurn, NextEvent, Respond, Abandon) from a ``FakeAdapter``."""

    def __init__(self, node: Node, address: str, *, plan: FakeAdapter) -> None:
        super().__init__(node, address)
        self.plan = plan
        self.turn_no = 0
        self.script: list[Any] = []
        self.turn_id: str | None = None
        self.surfaced: set[str] = set()
        self.held: tuple[Any, Context] | None = None

    def handle(self, message: Any, ctx: Context) -> Any:
        plan = self.plan
        match message:
            case StartTurn(conversation_key=key, input=text):
                plan.trace.append(("start", key, text))
                plan.inputs.append(text)
                if self.turn_id is not None:
                    raise AdapterError(ErrorKind.BUSY, f"key {key} has an active turn")
                outcome = plan.starts.popleft() if plan.starts else None
                if outcome is HOLD:
                    self.held = (message, ctx)
                    return DEFER
                return self._start(outcome)
            case NextEvent(turn_id=turn_id):
                plan.trace.append(("next", turn_id, frozenset(self.surfaced)))
                assert turn_id == self.turn_id, f"next_event for {turn_id}, active {self.turn_id}"
                return self._event(message, ctx)
            case Respond(turn_id=turn_id, call_id=call_id, result=result):
                plan.trace.append(("respond", call_id, result.success, result.output))
                if call_id not in self.surfaced:
                    raise AdapterError(ErrorKind.INVALID_TOOL_RESULT, f"{call_id} is not pending")
                self.surfaced.discard(call_id)
                if call_id in plan.respond_errors:
                    raise plan.respond_errors.pop(call_id)
                return None
            case Abandon(turn_id=turn_id):
                plan.trace.append(("abandon", turn_id))
                if turn_id == self.turn_id:
                    self.turn_id = None
                    if self.held is not None and isinstance(self.held[0], NextEvent):
                        self.held[1].reply(Ok())
                        self.held = None
                return None
        raise TypeError(type(message).__name__)

    def on_local(self, message: Any) -> Any:
        if isinstance(message, _Noop):
            return None
        if isinstance(message, _Release):
            assert self.held is not None, "nothing held"
            held, ctx = self.held
            self.held = None
            if isinstance(held, StartTurn):
                ctx.reply(self._start(None))
            else:
                ctx.reply(self._event(held, ctx, released=True))
            return None
        return super().on_local(message)

    def _start(self, outcome: Any) -> Any:
        if isinstance(outcome, AdapterError):
            raise outcome
        self.turn_no += 1
        self.turn_id = f"turn-{self.turn_no}"
        self.script = self.plan.turns.popleft() if self.plan.turns else [Done()]
        return TurnStarted(turn_id=self.turn_id)

    def _event(self, message: Any, ctx: Context, released: bool = False) -> Any:
        if not self.script:
            return Ok()
        step = self.script.pop(0)
        if step is HOLD and not released:
            self.held = (message, ctx)
            return DEFER
        if step is HOLD:
            step = self.script.pop(0)
        if isinstance(step, AdapterError):
            self.turn_id = None
            raise step
        if isinstance(step, ToolCallEvent):
            self.surfaced.add(step.call.call_id)
        if isinstance(step, Done | ErrorEvent):
            self.turn_id = None
        self.plan.trace.append(("event", step))
        return step


# ------------------------------------------------------------------------------- codec and launcher


@dataclass(frozen=True)
class Box:
    name: str
    text: str


class CountingCodec:
    def __init__(self, trace: list[tuple[Any, ...]]) -> None:
        self.trace = trace

    def tool_call_box(self, call: CodexToolCall) -> Box:
        self.trace.append(("convert", call.call_id))
        return Box(call.call_id, f"<box {call.call_id}>")

    def box_text(self, box: Box) -> str:
        return box.text


class RecordingLauncher:
    """Launches by recording. ``behaviour[call_id]``: an exception to raise, ``"future"`` to return a future
    the test resolves (kept in ``futures``), or absent to return ``None`` at once."""

    def __init__(self, trace: list[tuple[Any, ...]], behaviour: dict[str, Any] | None = None) -> None:
        self.trace = trace
        self.behaviour = behaviour or {}
        self.boxes: list[Box] = []
        self.futures: dict[str, concurrent.futures.Future[None]] = {}
        self.future_made = threading.Event()

    def launch(self, box: Box) -> concurrent.futures.Future[None] | pykka.Future[None] | None:
        self.trace.append(("launch", box.name))
        self.boxes.append(box)
        what = self.behaviour.get(box.name)
        if isinstance(what, BaseException):
            raise what
        if what == "future":
            future: concurrent.futures.Future[None] = concurrent.futures.Future()
            self.futures[box.name] = future
            self.future_made.set()
            return future
        if what == "pykka":
            pf: pykka.Future[None] = pykka.ThreadingFuture()
            pf.set(None)
            return pf
        return None


# --------------------------------------------------------------------------------------------- fixtures


class _Handle:
    """The adapter handle a ``Shim`` takes: the FakeAdapter's address; ``close`` counts releases."""

    def __init__(self, node: Node, address: str) -> None:
        self.node = node
        self.address = address
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


@dataclass
class Rig:
    plan: FakeAdapter
    fake: Any  # the FakeAdapterActor's ref
    codec: CountingCodec
    launcher: RecordingLauncher
    handle: _Handle
    shims: list[Shim[Box]]

    @property
    def trace(self) -> Trace:
        return self.plan.trace

    def shim(self, key: str = "k") -> Shim[Box]:
        shim: Shim[Box] = Shim(self.handle, key, self.codec, self.launcher, timeout=WAIT)
        self.shims.append(shim)
        return shim

    def release(self) -> None:
        self.fake.ask(_Release(), timeout=WAIT)

    def wait_for(self, what: Callable[[], bool]) -> None:
        self.plan.trace.wait_for(what)


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node("n1", registry=registry())


@pytest.fixture
def rig(node: Node) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(**behaviour: Any) -> Rig:
        trace = Trace()
        plan = FakeAdapter(trace)
        ref = node.spawn(FakeAdapterActor, f"fake{len(made)}", plan=plan)
        r = Rig(
            plan,
            ref,
            CountingCodec(trace),
            RecordingLauncher(trace, behaviour),
            _Handle(node, f"n1/fake{len(made)}"),
            [],
        )
        made.append(r)
        return r

    yield make
    for r in made:
        for shim in r.shims:
            shim.close()


# ----------------------------------------------------------------------------------------------- tests


def test_sh01_acknowledgement_is_the_seed_string_byte_for_byte() -> None:
    assert ASYNC_TOOL_ACKNOWLEDGEMENT.encode("utf-8") == SEED_ACK.encode("utf-8")
    assert ACKNOWLEDGEMENT.success is True and ACKNOWLEDGEMENT.output == SEED_ACK


def test_sh02_to_sh05_three_calls_convert_launch_acknowledge_in_provider_order(
    rig: Callable[..., Rig],
) -> None:
    r = rig()
    r.plan.turns.append([TextDelta("a"), call("c1"), call("c2"), TextDelta("b"), call("c3"), Done()])
    out = r.shim().infer("go", timeout=WAIT)
    steps = [e for e in r.trace if e[0] in ("convert", "launch", "respond", "next")]
    names = [(e[0], e[1]) if e[0] != "next" else ("next",) for e in steps]
    expected: list[tuple[Any, ...]] = [("next",), ("next",)]
    for c in ("c1", "c2"):
        expected += [("convert", c), ("launch", c), ("respond", c), ("next",)]
    expected += [("next",), ("convert", "c3"), ("launch", "c3"), ("respond", "c3"), ("next",)]
    assert names == expected
    # SH-04: each call answered once, with exactly the acknowledgement, success=True.
    assert r.plan.of("respond") == [("respond", c, True, SEED_ACK) for c in ("c1", "c2", "c3")]
    # SH-05: the shim never read on while a call it was given was still unanswered.
    assert all(not surfaced for _, _, surfaced in r.plan.of("next"))
    # SH-03: the box launched is the object the codec returned, and it is the one in the output.
    assert [b.name for b in r.launcher.boxes] == ["c1", "c2", "c3"]
    boxes = [item.box for item in out.items if isinstance(item, ShimBox)]
    assert all(a is b for a, b in zip(boxes, r.launcher.boxes, strict=True))
    assert len(r.plan.of("start")) == 1  # SH-09: one native turn


def test_sh05_a_launch_future_is_awaited_without_blocking_the_mailbox(rig: Callable[..., Rig]) -> None:
    r = rig(c1="future")
    r.plan.turns.append([call("c1"), call("c2"), Done()])
    shim = r.shim()
    future = shim.infer_future("go")
    assert r.launcher.future_made.wait(WAIT)
    # The mailbox answers while the launch is outstanding, and nothing moved on at the adapter.
    shim.record_box(Box("x", "X"))
    assert shim.pending_box_count() == 1
    assert r.plan.of("respond") == [] and r.plan.of("launch") == [("launch", "c1")]
    assert not future.done()
    r.launcher.futures["c1"].set_result(None)
    out = future.result(WAIT)
    assert [e[1] for e in r.plan.of("launch")] == ["c1", "c2"]
    assert [e[1] for e in r.plan.of("respond")] == ["c1", "c2"]
    assert out == ShimOutput((ShimBox(Box("c1", "<box c1>")), ShimBox(Box("c2", "<box c2>"))))


def test_sh05_a_pykka_future_from_the_launcher_is_awaited_too(rig: Callable[..., Rig]) -> None:
    r = rig(c1="pykka")
    r.plan.turns.append([call("c1"), Done()])
    r.shim().infer("go", timeout=WAIT)
    assert [e[1] for e in r.plan.of("respond")] == ["c1"]


def test_sh06_five_hundred_calls_get_five_hundred_acknowledgements_in_one_turn(
    rig: Callable[..., Rig],
) -> None:
    r = rig()
    r.plan.turns.append([call(f"c{i}") for i in range(500)] + [Done()])
    out = r.shim().infer("go", timeout=WAIT)
    assert len(r.plan.of("start")) == 1
    assert [e[1] for e in r.plan.of("launch")] == [f"c{i}" for i in range(500)]
    assert [e[1:] for e in r.plan.of("respond")] == [(f"c{i}", True, SEED_ACK) for i in range(500)]
    assert len(out.items) == 500


def test_sh07_a_rejected_launch_raises_launch_rejected_and_poisons(rig: Callable[..., Rig]) -> None:
    r = rig(c2=LaunchRejected("queue full"))
    r.plan.turns.append([call("c1"), call("c2"), call("c3"), Done()])
    shim = r.shim()
    with pytest.raises(AdapterError) as err:
        shim.infer("go", timeout=WAIT)
    assert err.value.kind is ErrorKind.LAUNCH_REJECTED and err.value.message == "queue full"
    r.wait_for(lambda: r.plan.of("abandon") != [])
    assert [e[1] for e in r.plan.of("respond")] == ["c1"]  # c2 never answered
    assert [e[1] for e in r.plan.of("launch")] == ["c1", "c2"]  # c3 never launched
    assert r.plan.of("abandon") == [("abandon", "turn-1")]  # the native turn is abandoned
    _assert_poisoned(r, shim, "launch_rejected: queue full")


def test_sh07_a_launch_future_failing_with_launch_rejected_is_a_rejection(rig: Callable[..., Rig]) -> None:
    r = rig(c1="future")
    r.plan.turns.append([call("c1"), Done()])
    shim = r.shim()
    future = shim.infer_future("go")
    assert r.launcher.future_made.wait(WAIT)
    r.launcher.futures["c1"].set_exception(LaunchRejected("no room"))
    with pytest.raises(AdapterError) as err:
        future.result(WAIT)
    assert (err.value.kind, err.value.message) == (ErrorKind.LAUNCH_REJECTED, "no room")
    assert r.plan.of("respond") == []


def test_sh08_a_successful_launch_is_never_repeated_when_the_turn_fails(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append([call("c1"), failed()])
    shim = r.shim()
    with pytest.raises(AdapterError):
        shim.infer("go", timeout=WAIT)
    with pytest.raises(AdapterError):
        shim.infer("again", timeout=WAIT)
    assert r.plan.of("launch") == [("launch", "c1")]
    assert not hasattr(r.launcher, "undo") and not hasattr(Shim, "retry")


def test_sh09_each_infer_is_one_turn_drained_through_done(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.extend([[TextDelta("x"), HOLD, Done()], [Done()]])
    shim = r.shim()
    future = shim.infer_future("one")
    r.wait_for(lambda: len(r.plan.of("next")) == 2)
    assert not future.done()  # returns only after Done
    r.release()
    assert future.result(WAIT) == ShimOutput((ShimText("x"),))
    shim.infer("two", timeout=WAIT)
    assert [e[2] for e in r.plan.of("start")] == ["one", "two"]


def test_sh10_streamed_text_then_failure_exposes_no_partial_output(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append([TextDelta("partial "), TextDelta("answer"), failed(message="boom")])
    with pytest.raises(AdapterError) as err:
        r.shim().infer("go", timeout=WAIT)
    assert not hasattr(err.value, "items") and "partial" not in str(err.value)


def test_sh11_text_and_boxes_keep_event_order_and_adjacent_text_merges(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append(
        [TextDelta("a"), TextDelta(""), TextDelta("b"), call("c1"), call("c2"), TextDelta("c"), Done()]
    )
    r.plan.turns.append([Done()])
    shim = r.shim()
    out = shim.infer("go", timeout=WAIT)
    assert out.items == (
        ShimText("ab"),
        ShimBox(Box("c1", "<box c1>")),
        ShimBox(Box("c2", "<box c2>")),
        ShimText("c"),
    )
    assert shim.infer("empty", timeout=WAIT).items == ()


def test_sh12_an_error_event_is_raised_unchanged(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append([failed(ErrorKind.SERVER, "status failed")])
    with pytest.raises(AdapterError) as err:
        r.shim().infer("go", timeout=WAIT)
    assert err.value == AdapterError(ErrorKind.SERVER, "status failed")
    assert r.plan.of("abandon") == []  # the turn had ended already


def _assert_poisoned(r: Rig, shim: Shim[Box], why: str) -> None:
    """SH-14: infer raises at once without contacting the adapter; the box ops keep working."""
    seen = len(r.trace)
    with pytest.raises(AdapterError) as err:
        shim.infer("again", timeout=WAIT)
    assert err.value.kind is ErrorKind.UNAVAILABLE
    assert err.value.message == f"shim poisoned: {why}"
    r.fake.ask(_Noop(), timeout=WAIT)
    assert [e for e in r.trace[seen:] if e[0] in ("start", "next", "respond", "abandon")] == []
    before = shim.pending_box_count()
    shim.record_box(Box("p", "P"))
    shim.record_boxes([Box("q", "Q")])
    assert shim.pending_box_count() == before + 2


def test_sh13_sh14_an_error_event_poisons_the_shim(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append([failed(ErrorKind.SERVER, "nope")])
    shim = r.shim()
    with pytest.raises(AdapterError):
        shim.infer("go", timeout=WAIT)
    _assert_poisoned(r, shim, "server: nope")


def test_sh13_a_failed_next_event_poisons_and_abandons(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append([TextDelta("x"), AdapterError(ErrorKind.PROTOCOL, "garbage line")])
    shim = r.shim()
    with pytest.raises(AdapterError) as err:
        shim.infer("go", timeout=WAIT)
    assert err.value == AdapterError(ErrorKind.PROTOCOL, "garbage line")
    r.wait_for(lambda: r.plan.of("abandon") != [])
    assert len(r.plan.of("abandon")) == 1
    _assert_poisoned(r, shim, "protocol: garbage line")


def test_sh13_a_failed_respond_poisons(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append([call("c1"), Done()])
    r.plan.respond_errors["c1"] = AdapterError(ErrorKind.UNAVAILABLE, "child died")
    shim = r.shim()
    with pytest.raises(AdapterError) as err:
        shim.infer("go", timeout=WAIT)
    assert err.value == AdapterError(ErrorKind.UNAVAILABLE, "child died")
    r.wait_for(lambda: r.plan.of("abandon") != [])
    _assert_poisoned(r, shim, "unavailable: child died")


def test_sh15_sh19_a_busy_start_leaves_the_shim_ready_with_its_boxes(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.starts.append(AdapterError(ErrorKind.BUSY, "key k has an active turn"))
    shim = r.shim()
    shim.record_boxes([Box("a", "A"), Box("b", "B")])
    with pytest.raises(AdapterError) as err:
        shim.infer("X", timeout=WAIT)
    assert err.value.kind is ErrorKind.BUSY
    assert shim.pending_box_count() == 2  # kept: the start was rejected
    r.plan.turns.append([TextDelta("ok"), Done()])
    assert shim.infer("X", timeout=WAIT).items == (ShimText("ok"),)
    assert r.plan.inputs == ["A\n\nB\n\nX", "A\n\nB\n\nX"]
    assert shim.pending_box_count() == 0


def test_sh15_an_unreachable_adapter_is_a_start_rejection(node: Node) -> None:
    trace = Trace()
    shim: Shim[Box] = Shim(_Handle(node, "n1/nobody"), "k", CountingCodec(trace), RecordingLauncher(trace))
    try:
        shim.record_box(Box("a", "A"))
        with pytest.raises(AdapterError) as err:
            shim.infer("X", timeout=WAIT)
        assert err.value.kind is ErrorKind.UNAVAILABLE
        assert shim.pending_box_count() == 1
    finally:
        shim.close()


def test_sh16_cancel_during_the_first_delta_abandons_and_poisons(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append([TextDelta("a"), HOLD, Done()])
    shim = r.shim()
    future = shim.infer_future("go")
    r.wait_for(lambda: len(r.plan.of("next")) == 2)
    assert future.cancel()
    r.wait_for(lambda: r.plan.of("abandon") != [])
    assert r.plan.of("abandon") == [("abandon", "turn-1")]
    _assert_poisoned(r, shim, "interrupted: infer was cancelled")


def test_sh16_cancel_before_acceptance_abandons_after_the_reply_and_stays_ready(
    rig: Callable[..., Rig],
) -> None:
    r = rig()
    r.plan.starts.append(HOLD)
    r.plan.turns.extend([[TextDelta("never read"), Done()], [TextDelta("second"), Done()]])
    shim = r.shim()
    future = shim.infer_future("go")
    r.wait_for(lambda: r.plan.of("start") != [])
    assert future.cancel()
    r.release()
    r.wait_for(lambda: r.plan.of("abandon") != [])
    assert r.plan.of("next") == []  # the cancelled turn was never read
    assert shim.infer("again", timeout=WAIT).items == (ShimText("second"),)  # ready, not poisoned


def test_sh16_cancel_while_queued_starts_nothing(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.extend([[HOLD, Done()], [TextDelta("third"), Done()]])
    shim = r.shim()
    first = shim.infer_future("1")
    second = shim.infer_future("2")
    third = shim.infer_future("3")
    r.wait_for(lambda: len(r.plan.of("next")) == 1)
    assert second.cancel()
    r.release()
    assert first.result(WAIT).items == ()
    assert third.result(WAIT).items == (ShimText("third"),)
    assert [e[2] for e in r.plan.of("start")] == ["1", "3"]


def test_sh16_an_infer_timeout_cancels_it(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append([HOLD, Done()])
    shim = r.shim()
    with pytest.raises(Expired):
        shim.infer("go", timeout=0.2)
    r.wait_for(lambda: r.plan.of("abandon") != [])
    _assert_poisoned(r, shim, "interrupted: infer was cancelled")


def test_sh17_sh18_sh21_pending_boxes_prefix_the_next_turn_as_their_text(rig: Callable[..., Rig]) -> None:
    r = rig()
    shim = r.shim()
    shim.record_box(Box("a", "A"))
    shim.record_boxes([Box("b", "B"), Box("c", "C")])
    assert shim.pending_box_count() == 3
    shim.infer("X", timeout=WAIT)
    assert shim.pending_box_count() == 0
    shim.infer("Y", timeout=WAIT)
    shim.record_box(Box("d", "D"))
    shim.infer("", timeout=WAIT)
    assert r.plan.inputs == ["A\n\nB\n\nC\n\nX", "Y", "D"]
    assert turn_input([], "") == ""


def test_sh19_an_accepted_start_clears_the_boxes_even_if_the_turn_fails(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append([failed()])
    shim = r.shim()
    shim.record_box(Box("a", "A"))
    with pytest.raises(AdapterError):
        shim.infer("X", timeout=WAIT)
    assert shim.pending_box_count() == 0


def test_sh19_a_box_recorded_while_the_start_is_pending_stays_for_the_next_turn(
    rig: Callable[..., Rig],
) -> None:
    r = rig()
    r.plan.starts.append(HOLD)
    shim = r.shim()
    shim.record_box(Box("a", "A"))
    future = shim.infer_future("X")
    r.wait_for(lambda: r.plan.of("start") != [])
    shim.record_box(Box("b", "B"))
    r.release()
    future.result(WAIT)
    assert shim.pending_box_count() == 1
    shim.infer("Y", timeout=WAIT)
    assert r.plan.inputs == ["A\n\nX", "B\n\nY"]


def test_sh20_dynamic_call_boxes_are_output_only(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append([call("c1"), Done()])
    shim = r.shim()
    out = shim.infer("X", timeout=WAIT)
    assert out.items == (ShimBox(Box("c1", "<box c1>")),)
    assert shim.pending_box_count() == 0
    shim.infer("Y", timeout=WAIT)
    assert r.plan.inputs == ["X", "Y"]


def test_sh22_concurrent_infers_on_one_shim_queue_in_arrival_order(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.extend([[TextDelta(str(i)), Done()] for i in range(5)])
    shim = r.shim()
    futures = [shim.infer_future(f"in{i}") for i in range(5)]
    outs = [f.result(WAIT) for f in futures]
    assert [o.items for o in outs] == [(ShimText(str(i)),) for i in range(5)]
    assert [e[2] for e in r.plan.of("start")] == [f"in{i}" for i in range(5)]
    assert not any(isinstance(e[1], AdapterError) for e in r.trace if e[0] == "event")


def test_sh22_two_shims_on_one_adapter_each_use_their_own_key(rig: Callable[..., Rig]) -> None:
    """Each shim serves one conversation key (concurrency across keys: tests/integration)."""
    r = rig()
    r.plan.turns.extend([[TextDelta("one"), Done()], [TextDelta("two"), Done()]])
    a = r.shim("k1")
    b = r.shim("k2")
    assert a.infer("x", timeout=WAIT).items == (ShimText("one"),)
    assert b.infer("y", timeout=WAIT).items == (ShimText("two"),)
    assert [e[1] for e in r.plan.of("start")] == ["k1", "k2"]


def test_sh24_another_launcher_exception_is_raised_unchanged_and_poisons(rig: Callable[..., Rig]) -> None:
    boom = RuntimeError("launcher bug")
    r = rig(c1=boom)
    r.plan.turns.append([call("c1"), Done()])
    shim = r.shim()
    with pytest.raises(RuntimeError) as err:
        shim.infer("go", timeout=WAIT)
    assert err.value is boom
    r.wait_for(lambda: r.plan.of("abandon") != [])
    assert r.plan.of("respond") == []  # no ACK: possibly launched, never answered
    assert len(r.plan.of("abandon")) == 1
    _assert_poisoned(r, shim, "RuntimeError: launcher bug")


def test_close_releases_the_adapter_handle_once_and_fails_a_running_infer(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.plan.turns.append([HOLD, Done()])
    shim = r.shim()
    future = shim.infer_future("go")
    r.wait_for(lambda: len(r.plan.of("next")) == 1)
    shim.close()
    assert r.plan.of("abandon") == [("abandon", "turn-1")]  # confirmed before close returned
    shim.close()
    assert r.handle.closed == 1
    with pytest.raises(AdapterError) as err:
        future.result(WAIT)
    assert err.value.kind is ErrorKind.UNAVAILABLE
    with pytest.raises(AdapterError):
        shim.pending_box_count()


def test_close_during_a_start_waits_for_it_and_abandons_the_turn(rig: Callable[..., Rig]) -> None:
    """No turn is left running on the key: a start accepted after close() was called is abandoned."""
    r = rig()
    r.plan.starts.append(HOLD)
    shim = r.shim()
    future = shim.infer_future("go")
    r.wait_for(lambda: r.plan.of("start") != [])
    closer = threading.Thread(target=shim.close)
    closer.start()
    r.fake.ask(_Noop(), timeout=WAIT)
    assert r.handle.closed == 0  # still waiting for the start's reply
    r.release()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert r.plan.of("abandon") == [("abandon", "turn-1")] and r.plan.of("next") == []
    assert r.handle.closed == 1
    with pytest.raises(AdapterError):
        future.result(WAIT)
