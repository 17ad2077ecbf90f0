"""The one effect store (actors/effects.py) behind all three tool hosts: the conversation's ToolHostActor,
run_session's HostActor and the subagent's RunHostActor, each over a real SQLite file.

The tool under test appends one line to its own log each time it really runs (the count of executions) and
reads its own row from the store as it starts. "A host that died while the tool ran" is made two ways:
here, by the rows a dead host leaves (``leave_intent_as_a_dead_host``, a stand-in for a crash at that
point); in tests/integration/test_effects_processes.py, by SIGKILL of a real host process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import resource
import signal
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.conversation import ToolExecution, ToolHostActor, ToolRegistry
from actors.conversation.messages import ExecuteTool
from actors.effects import (
    EFFECT_ERRORS,
    Done,
    EffectStore,
    EffectStoreError,
    Run,
    Unknown,
    idempotency_key,
)
from actors.runs.projection import ContextBudget, ToolOutcome
from actors.runs.session import HostActor, HostExecuteTool, SessionHostError, SessionToolOutcome
from actors.runs.subagent import HostExecuteTool as SubagentExecuteTool
from actors.runs.subagent import RunHostActor
from actors.types import ToolCall
from transport.errors import BusError
from transport.messages import ErrorReply
from transport.node import Node

WAIT = 10.0
OP = uuid.UUID("00000000-0000-4000-8000-0000000000ef")
KEY = idempotency_key(OP, 1, "c1")


# ----------------------------------------------------------------------------------------- helpers


def store_row(store: Path, key: str) -> dict[str, Any] | None:
    """The key's row, read with a connection of our own: only what the host has committed."""
    db = sqlite3.connect(store)
    try:
        db.row_factory = sqlite3.Row
        row = db.execute("SELECT * FROM effects WHERE key = ?", (key,)).fetchone()
        return None if row is None else dict(row)
    finally:
        db.close()


def leave_intent_as_a_dead_host(store: Path, key: str) -> None:
    """The rows a host leaves when it dies while the tool runs: an intent and no outcome (a stand-in for
    a crash at exactly that point; the process tests kill a real host there)."""
    dead = EffectStore(store, incarnation="dead-host", clock=lambda: 1_700_000_000.0)
    try:
        assert dead.claim(key, "tool 'effect'") == Run()
    finally:
        dead.close()


@contextlib.contextmanager
def disk_full(store: Path) -> Iterator[None]:
    """The store's files cannot grow, as on a full disk: no file of this process may grow past the size
    of the store's journal now (RLIMIT_FSIZE, with SIGXFSZ ignored, so such a write fails with EFBIG,
    which SQLite reports as "disk I/O error")."""
    wal = store.with_name(store.name + "-wal")
    limit = wal.stat().st_size if wal.exists() else 0
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


class Probe:
    """The effect: one line in ``runs.log`` per real run; the store's row for ``KEY`` as the run starts;
    with ``hold``, the run does not finish until ``release()``."""

    def __init__(self, folder: Path) -> None:
        self.log = folder / "runs.log"
        self.store = folder / "effects.sqlite3"
        self.hold = False
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.seen: list[dict[str, Any] | None] = []
        self._on_release: list[Callable[[], None]] = []

    def start(self) -> str:
        with self.log.open("a") as f:
            f.write("run\n")
        self.seen.append(store_row(self.store, KEY) if self.store.exists() else None)
        return f"run {self.runs()}"

    def runs(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log.exists() else 0

    def later(self, resolve: Callable[[], None]) -> None:
        self._on_release.append(resolve)

    def release(self) -> None:
        self.gate.set()
        for resolve in self._on_release:
            resolve()


class ConversationHost:
    """ToolHostActor over a ToolRegistry with one tool, ``effect``."""

    name = "conversation"

    def spawn(self, node: Node, probe: Probe, *, effects: Path | None, rerun_safe: bool = False) -> Any:
        def effect() -> str:
            """The effect under test."""
            text = probe.start()
            probe.entered.set()
            if probe.hold:
                assert probe.gate.wait(WAIT)
            return text

        tools = ToolRegistry()
        tools.register(effect, rerun_safe=rerun_safe)
        return node.spawn(ToolHostActor, "host", registry=tools, effects=effects)

    def message(self, key: str) -> Any:
        return ExecuteTool(name="effect", arguments={}, idempotency_key=key)

    def view(self, reply: Any) -> tuple[bool, str, bool]:
        assert isinstance(reply, ToolExecution)
        return reply.ok, reply.text, reply.unknown


class SessionApp:
    """A SessionHost whose one tool is the probe (returned as a future while the probe holds)."""

    def __init__(self, probe: Probe, fail: bool = False) -> None:
        self.probe = probe
        self.fail = fail

    def execute_tool(self, call: Any, provider_operation_id: uuid.UUID) -> Any:
        text = self.probe.start()
        if self.fail:
            raise SessionHostError(f"the host gave up after {text}")
        return held(self.probe, SessionToolOutcome.success(text))

    def prepare_round(self, round: int) -> Any:
        raise NotImplementedError

    def record(self, event: Any) -> Any:
        return None

    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any:
        raise NotImplementedError

    def complete_capture(self, capture: Any, contents: str) -> Any:
        raise NotImplementedError

    def complete_round(self, completion: Any) -> Any:
        raise NotImplementedError


def held(probe: Probe, outcome: Any) -> Any:
    """``outcome``, or while the probe holds a future of it that ``probe.release()`` resolves."""
    if not probe.hold:
        probe.entered.set()
        return outcome
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    probe.later(lambda: future.set_result(outcome))
    probe.entered.set()
    return future


class SessionHost:
    """run_session's HostActor around SessionApp."""

    name = "session"

    def spawn(self, node: Node, probe: Probe, *, effects: Path | None, rerun_safe: bool = False) -> Any:
        safe = {"effect"} if rerun_safe else set()
        return node.spawn(HostActor, "host", host=SessionApp(probe), effects=effects, rerun_safe=safe)

    def message(self, key: str) -> Any:
        call = ToolCall(name="effect", arguments={})
        return HostExecuteTool(call_id="c1", call=call, operation_id=OP, idempotency_key=key)

    def view(self, reply: Any) -> tuple[bool, str, bool]:
        assert isinstance(reply, SessionToolOutcome)
        return reply.ok, reply.text, reply.unknown


class NotesApp:
    """A subagent Host whose one tool is the probe."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def render_tool_call(self, call: ToolCall) -> str:
        return call.name

    def execute_tool(self, call: ToolCall, operation_id: uuid.UUID, budget: ContextBudget) -> Any:
        return held(self.probe, ToolOutcome.success(self.probe.start()))

    def complete_capture(self, capture: Any, contents: str, budget: ContextBudget) -> Any:
        raise NotImplementedError

    def record(self, event: Any) -> Any:
        return None


class SubagentHost:
    """The subagent's RunHostActor around NotesApp."""

    name = "subagent"

    def spawn(self, node: Node, probe: Probe, *, effects: Path | None, rerun_safe: bool = False) -> Any:
        def safe(call: ToolCall) -> bool:
            return rerun_safe and call.name == "effect"

        return node.spawn(RunHostActor, "host", host=NotesApp(probe), effects=effects, rerun_safe=safe)

    def message(self, key: str) -> Any:
        budget = ContextBudget(estimated=10, maximum=1000, reserve=5, exact=False, base=5)
        call = ToolCall(name="effect", arguments={})
        return SubagentExecuteTool(call=call, operation_id=OP, budget=budget, idempotency_key=key)

    def view(self, reply: Any) -> tuple[bool, str, bool]:
        assert isinstance(reply, ToolOutcome)
        return reply.ok, reply.text, reply.unknown


HOSTS = [ConversationHost(), SessionHost(), SubagentHost()]
Host = ConversationHost | SessionHost | SubagentHost


@pytest.fixture(params=HOSTS, ids=lambda h: h.name)
def kind(request: pytest.FixtureRequest) -> Host:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node("n1", registry=registry())


@pytest.fixture
def probe(tmp_path: Path) -> Probe:
    return Probe(tmp_path)


def ask(node: Node, kind: Host, key: str = KEY) -> tuple[bool, str, bool]:
    return kind.view(node.request("n1/host", kind.message(key), timeout=WAIT))


# ------------------------------------------------------------------------------------------ per host


def test_the_intent_is_committed_before_the_tool_runs(node: Node, kind: Host, probe: Probe) -> None:
    """The tool, reading the store through its own connection, finds its own intent (key, summary, start,
    this host's incarnation) and no outcome; once answered, the row holds the outcome."""
    kind.spawn(node, probe, effects=probe.store)
    assert ask(node, kind) == (True, "run 1", False)
    (seen,) = probe.seen
    assert seen is not None
    assert seen["key"] == KEY and seen["summary"] == "tool 'effect'" and seen["runs"] == 1
    assert seen["incarnation"] and seen["started_at"] > 0
    assert seen["tag"] is None and seen["outcome"] is None
    after = store_row(probe.store, KEY)
    assert after is not None and after["tag"] is not None and after["finished_at"] is not None


def test_a_repeated_key_answers_the_stored_outcome_without_running_again(
    node: Node, kind: Host, probe: Probe
) -> None:
    """The same key again, and again after the host restarted on the same store: the first outcome, and
    the tool ran once. Another key runs."""
    ref = kind.spawn(node, probe, effects=probe.store)
    first = ask(node, kind)
    assert ask(node, kind) == first == (True, "run 1", False)
    ref.stop(block=True, timeout=WAIT)
    kind.spawn(node, probe, effects=probe.store)
    assert ask(node, kind) == first
    assert probe.runs() == 1
    assert ask(node, kind, idempotency_key(OP, 1, "c2")) == (True, "run 2", False)


def test_an_intent_without_an_outcome_is_unknown_and_never_rerun(
    node: Node, kind: Host, probe: Probe
) -> None:
    """A key whose host died while it ran: "outcome unknown" in the host's own type (ok False, unknown
    True), the tool does not run, and asking again says the same."""
    leave_intent_as_a_dead_host(probe.store, KEY)
    kind.spawn(node, probe, effects=probe.store)
    ok, text, unknown = ask(node, kind)
    assert (ok, unknown) == (False, True)
    assert text.startswith("outcome unknown: tool 'effect' started at 2023-11-14T22:13:20Z")
    assert "not run again" in text
    assert ask(node, kind) == (ok, text, unknown)
    assert probe.runs() == 0


def test_a_rerun_safe_tool_runs_again_after_an_unknown_outcome(node: Node, kind: Host, probe: Probe) -> None:
    """Registered (or named) rerun-safe: the cut-off key runs once more under a renewed intent, then its
    outcome is stored like any other."""
    leave_intent_as_a_dead_host(probe.store, KEY)
    kind.spawn(node, probe, effects=probe.store, rerun_safe=True)
    assert ask(node, kind) == (True, "run 1", False)
    (seen,) = probe.seen
    assert seen is not None and seen["runs"] == 2 and seen["incarnation"] != "dead-host"
    assert ask(node, kind) == (True, "run 1", False)
    assert probe.runs() == 1


def test_duplicates_during_a_run_wait_for_the_one_run(node: Node, kind: Host, probe: Probe) -> None:
    """Two more requests with the key arrive while the tool runs: all three get its one outcome."""
    probe.hold = True
    kind.spawn(node, probe, effects=probe.store)
    first = node.request_future("n1/host", kind.message(KEY), timeout=WAIT)
    assert probe.entered.wait(WAIT)
    duplicates = [node.request_future("n1/host", kind.message(KEY), timeout=WAIT) for _ in range(2)]
    assert not first.done()
    probe.release()
    answers = {kind.view(f.result(WAIT)) for f in (first, *duplicates)}
    assert answers == {(True, "run 1", False)}
    assert probe.runs() == 1


def test_a_store_that_cannot_be_written_runs_nothing(node: Node, kind: Host, probe: Probe) -> None:
    """Disk full: the intent cannot be committed, so the call answers EffectStoreError (saying why) and the
    tool does not run; once there is room, the same key runs (nothing was recorded for it)."""
    kind.spawn(node, probe, effects=probe.store)
    assert ask(node, kind, "warm-up")[0]
    with disk_full(probe.store), pytest.raises(EffectStoreError) as err:
        ask(node, kind)
    assert "cannot record the intent of tool 'effect': disk I/O error" in str(err.value)
    assert probe.runs() == 1  # the warm-up only
    assert store_row(probe.store, KEY) is None
    assert ask(node, kind) == (True, "run 2", False)


def test_a_store_that_cannot_be_opened_runs_nothing(
    node: Node, kind: Host, probe: Probe, tmp_path: Path
) -> None:
    """The store's folder cannot be created (a file is in the way): EffectStoreError, nothing runs, and the
    host stays alive."""
    (tmp_path / "blocked").write_text("a file, not a folder")
    kind.spawn(node, probe, effects=tmp_path / "blocked" / "effects.sqlite3")
    for _ in range(2):
        with pytest.raises(EffectStoreError):
            ask(node, kind)
    assert probe.runs() == 0


def test_an_outcome_that_cannot_be_stored_is_never_heard_and_stays_unknown(
    node: Node, kind: Host, probe: Probe
) -> None:
    """The disk fills while the tool runs: its outcome cannot be committed, so nobody hears it; the caller
    and every later repeat get "outcome unknown" (what the store says about the key), and it never reruns."""
    probe.hold = True
    kind.spawn(node, probe, effects=probe.store)
    answer = node.request_future("n1/host", kind.message(KEY), timeout=WAIT)
    assert probe.entered.wait(WAIT)
    with disk_full(probe.store):
        probe.release()
        ok, text, unknown = kind.view(answer.result(WAIT))
    assert (ok, unknown) == (False, True)
    assert text.startswith("outcome unknown: tool 'effect' ran, but its outcome could not be stored")
    assert "run 1" not in text
    probe.hold = False
    again = ask(node, kind)
    assert again[0] is False and again[2] is True
    assert probe.runs() == 1


def test_without_a_file_keys_are_remembered_in_memory(node: Node, kind: Host, probe: Probe) -> None:
    """effects=None: a repeated key still answers the stored outcome (nothing is written to disk)."""
    kind.spawn(node, probe, effects=None)
    assert ask(node, kind) == ask(node, kind) == (True, "run 1", False)
    assert probe.runs() == 1
    assert not probe.store.exists()


def test_an_empty_key_is_unprotected(node: Node, kind: Host, probe: Probe) -> None:
    """No idempotency key: every request runs the tool, and the store keeps no row for it."""
    kind.spawn(node, probe, effects=probe.store)
    assert [ask(node, kind, "")[1] for _ in range(2)] == ["run 1", "run 2"]
    assert not probe.store.exists()


# --------------------------------------------------------------------------------------- one host


def test_a_host_error_is_the_stored_outcome(node: Node, probe: Probe) -> None:
    """A SessionHost whose execute_tool raises (RS-35: the run aborts with that error): the error is the
    key's outcome, raised again for a repeat, and the tool ran once."""
    node.spawn(HostActor, "host", host=SessionApp(probe, fail=True), effects=probe.store)
    message = SessionHost().message(KEY)
    for _ in range(2):
        with pytest.raises(SessionHostError, match="the host gave up after run 1"):
            node.request("n1/host", message, timeout=WAIT)
    assert probe.runs() == 1
    row = store_row(probe.store, KEY)
    assert row is not None and row["tag"] == ErrorReply.TAG


def test_a_host_stopped_mid_run_leaves_an_unknown_outcome(node: Node, probe: Probe) -> None:
    """The real thing in one process: the host actor stops while the tool's future is pending; the caller
    hears Unavailable; a new host on the same store answers "outcome unknown" and runs nothing."""
    from transport.errors import Unavailable

    probe.hold = True
    ref = SessionHost().spawn(node, probe, effects=probe.store)
    answer = node.request_future("n1/host", SessionHost().message(KEY), timeout=WAIT)
    assert probe.entered.wait(WAIT)
    ref.stop(block=True, timeout=WAIT)
    with pytest.raises(Unavailable):
        answer.result(WAIT)
    probe.hold = False
    SessionHost().spawn(node, probe, effects=probe.store)
    ok, text, unknown = ask(node, SessionHost())
    assert (ok, unknown) == (False, True) and text.startswith("outcome unknown")
    assert probe.runs() == 1


# ------------------------------------------------------------------------------------------- store


@pytest.mark.parametrize("in_file", [True, False], ids=["file", "memory"])
def test_the_store_claims_once_and_settles_once(tmp_path: Path, in_file: bool) -> None:
    """claim: Run for a new key, Unknown while unsettled, Run(rerun) when rerun-safe, Done once settled
    (the first outcome stays): the same rules with a file (SQLite) and without (a dict)."""
    store = EffectStore(tmp_path / "e.sqlite3" if in_file else None, incarnation="i1", clock=lambda: 5.0)
    try:
        assert store.claim("k", "tool 'a'") == Run()
        unknown = store.claim("k", "tool 'a'")
        assert isinstance(unknown, Unknown) and unknown.record.incarnation == "i1"
        assert unknown.record.summary == "tool 'a'" and unknown.record.started_at == 5.0
        assert store.claim("k", "tool 'a' again", rerun_safe=True) == Run(rerun=True)
        store.settle("k", "sys.ok", b"\x80")
        store.settle("k", "sys.ok", b"\x81")
        done = store.claim("k", "tool 'a'", rerun_safe=True)
        assert isinstance(done, Done) and done.record.outcome == b"\x80" and done.record.runs == 2
        assert done.record.summary == "tool 'a' again" and done.record.finished_at == 5.0
        assert store.lookup("k") == done.record
        store.settle("never-claimed", "sys.ok", b"\x80")  # nothing to settle: no row appears
        assert store.lookup("missing") is None and store.lookup("never-claimed") is None
    finally:
        store.close()


def test_an_in_memory_store_stays_bounded() -> None:
    """Without a file, only the newest ``memory_keys`` finished keys are kept (memory stays flat)."""
    store = EffectStore(None, memory_keys=10)
    try:
        for i in range(100):
            assert store.claim(f"k{i}", "t") == Run()
            store.settle(f"k{i}", "sys.ok", b"\x80")
        kept = [i for i in range(100) if store.lookup(f"k{i}") is not None]
        assert len(kept) <= 11 and kept[-1] == 99
        assert store.claim("k0", "t") == Run()  # forgotten: runs again
    finally:
        store.close()


def test_the_key_format_is_one_function_and_never_ambiguous() -> None:
    """The parts are joined with ':'; a ':' inside a part is escaped, so different parts never collide."""
    assert idempotency_key(OP, 3, "call-1") == f"{OP}:3:call-1"
    assert idempotency_key("a:b", "c") != idempotency_key("a", "b:c")
    assert idempotency_key("a\\", ":b") != idempotency_key("a\\:", "b")


def test_mb06_the_store_error_crosses_the_bus_as_itself() -> None:
    """MB-06: EffectStoreError survives the wire as the same class with its message."""
    reg = registry()
    assert EffectStoreError in EFFECT_ERRORS
    error = EffectStoreError("the effect store x cannot record the intent of tool 'a': disk full")
    rebuilt = reg.rebuild_error(reg.decode(ErrorReply.TAG, reg.encode(reg.error_reply(error))))
    assert type(rebuilt) is EffectStoreError and rebuilt == error
    assert isinstance(rebuilt, BusError)


def test_mb06_unknown_outcomes_survive_the_wire() -> None:
    """MB-06: each host's "unknown" outcome type keeps ``unknown`` across msgpack."""
    reg = registry()
    for value in (
        ToolExecution(ok=False, text="t", unknown=True),
        SessionToolOutcome(text="t", ok=False, unknown=True),
        ToolOutcome(text="t", ok=False, unknown=True),
        SubagentHost().message("k"),
        ConversationHost().message("k"),
    ):
        assert reg.decode(reg.tag_of(value), reg.encode(value)) == value
