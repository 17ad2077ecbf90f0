"""Record an agent run once, replay it offline in later test runs: the ``kbus_replay`` pytest fixture.

Registered as a pytest plugin (``pytest11`` entry point ``kbus`` in setup.cfg), so any project with kbus
installed has it. A test makes its nodes with ``kbus_replay.node(name, **node_options)`` instead of
``Node(name, ...)`` and runs its agent as usual:

- **recording**, the node captures everything to ``<test folder>/replays/<module>/<test>/<node>.buslog`` (the
  *cassette*), against whatever model the test uses;
- **replaying**, the node is a ``TapeNode``: a real node with real actors, sockets and tools, whose ids and
  wall-clock readings (the determinism seams of transport/replay.py) and whose Router's provider events and
  token counts come from the cassette, so no model is loaded or called. Its Router's ticker runs live and
  reads the live monotonic clock, so a replay slower or faster than its recording times its own waits.
  Its own capture goes to a temporary file, and at the end of the test it is compared with the cassette
  (``first_divergence``): the first difference fails the test with the cassette's record index, the actor
  and a field diff; heartbeats (``transport.replay.LIVENESS_KINDS``), which a loaded machine sends more
  of, are not compared.

Record modes, as VCR's (``--kbus-record-mode``, default ``once``): ``once`` replays a cassette that exists
and records one that does not; ``none`` only replays (no cassette: the test fails); ``new_episodes`` replays
the nodes the cassette has and records those it lacks; ``all`` records every time.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from actors.router.providers.base import (
    AwaitResult,
    Pause,
    ProviderError,
    ProviderOutcome,
    ToolCallRequested,
    TurnSteps,
    drive,
)
from actors.router.turns import Counted, Emitted, Finished, StepMark, WorkerIO, decode_local
from transport.capture import CaptureLog, CaptureWriter, read_log
from transport.codec import Registry
from transport.node import Node
from transport.replay import MAILBOX, MONOTONIC, first_divergence

RECORD_MODES: Final = ("none", "once", "new_episodes", "all")


class Tape:
    """What a cassette serves to a live replay: each actor's effects by key, in order, and each Router's
    recorded provider events per operation, in the steps they came in (``StepMark``: what one step of an
    inline turn produced reached its reader together; an event recorded outside a step came alone), and
    token counts in order."""

    def __init__(self, log: CaptureLog, registry: Registry) -> None:
        self.effects: dict[tuple[str, bytes], collections.deque[bytes]] = collections.defaultdict(
            collections.deque
        )
        self.turns: dict[tuple[str, Any], list[list[Any]]] = collections.defaultdict(list)
        stepping: dict[str, dict[Any, list[Any]] | None] = {}  # per Router: the open step's events by turn
        self.counted: dict[str, collections.deque[tuple[int, ...]]] = collections.defaultdict(
            collections.deque
        )
        open_requests: dict[bytes, Any] = collections.defaultdict(lambda: None)
        for record in log.records:
            if record.at != "effect":
                continue
            key, value = record.frames[0], record.frames[1]
            if key != MAILBOX:
                self.effects[(record.actor, key)].append(value)
                continue
            try:
                message = decode_local(registry, value, open_requests)
            except ValueError:  # another actor's own mailbox record (a conversation's timer, a job's end)
                continue
            if isinstance(message, StepMark):
                step = stepping.get(record.actor)
                if message.end and step is not None:
                    for op, events in step.items():
                        self.turns[(record.actor, op)].append(events)
                stepping[record.actor] = None if message.end else {}
            elif isinstance(message, Emitted | Finished):
                step = stepping.get(record.actor)
                if step is None:
                    self.turns[(record.actor, message.operation_id)].append([message])
                else:
                    step.setdefault(message.operation_id, []).append(message)
            elif isinstance(message, Counted) and message.counts is not None:
                self.counted[record.actor].append(message.counts)

    def effect(self, actor: str, key: bytes) -> bytes | None:
        served = self.effects.get((actor, key))
        return served.popleft() if served else None

    def provider(self, router: str) -> TapeProvider:
        return TapeProvider(self, router)

    def counts(self, router: str) -> tuple[int, ...] | None:
        served = self.counted.get(router)
        return served.popleft() if served else None


class TapeProvider:
    """A provider that plays one Router operation's recorded events (waiting for each tool result, as the
    real provider did) and ends as the recorded turn ended. The Router steps it (``steps``): one recorded
    step (or one event recorded outside a step) per step here, so its events reach the reader grouped as
    they did in the recording."""

    name = "tape"
    placement = "inline"  # stepped by the Router itself, as the recorded inline turns were

    def __init__(self, tape: Tape, router: str) -> None:
        self._tape = tape
        self._router = router

    def run_turn(self, request: Any, io: WorkerIO) -> ProviderOutcome:
        return drive(self.steps(request, io), io)

    def steps(self, request: Any, io: WorkerIO) -> TurnSteps:
        steps = self._tape.turns.get((self._router, io.operation_id))
        if not steps:
            raise ProviderError("unavailable", f"the recording has no provider turn {io.operation_id}")
        for events in steps:
            awaits: str | None = None
            for message in events:
                if isinstance(message, Emitted):
                    io.emit(message.event)
                    if isinstance(message.event, ToolCallRequested):
                        awaits = message.event.call.call_id
                elif message.outcome is not None:
                    outcome: ProviderOutcome = message.outcome
                    return outcome
                else:
                    raise message.error or ProviderError("failed", "the recorded turn failed")
            if awaits is not None:
                yield AwaitResult(awaits)  # the step ends where the recorded one did: at the call
            else:
                yield Pause()
        raise ProviderError("unavailable", f"the recording of turn {io.operation_id} has no end")

    def close(self) -> None:
        return None


class TapeNode(Node):
    """A real node whose actors' recorded effects (ids, wall-clock readings) and Router provider turns are
    served from a cassette (``Tape``); an effect the cassette lacks is produced live, and so is a monotonic
    clock reading (``transport.replay.MONOTONIC``): the Router's ticker runs live here."""

    def __init__(self, name: str, *, tape: Tape, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.provider_tape = tape

    def effect(self, actor: str, key: bytes, produce: Callable[[], bytes]) -> bytes:
        # A monotonic reading times the actor's own waits, driven here by a live ticker: the live clock
        # (transport/replay.py MONOTONIC), never a recorded reading of another read.
        served = None if key == MONOTONIC else self.provider_tape.effect(actor, key)
        value = produce() if served is None else served
        if self.capture is not None:
            self.capture.record("effect", actor, [key, value])
        return value


class KbusReplay:
    """The ``kbus_replay`` fixture's value: ``node(name, **options)`` makes a recording or replaying node."""

    def __init__(self, folder: Path, mode: str, scratch: Path) -> None:
        self.folder = folder
        self.mode = mode
        self._scratch = scratch
        self._replayed: list[tuple[Path, Path, Registry]] = []
        self._nodes: list[Node] = []

    def recording(self, name: str) -> bool:
        """Whether ``node(name)`` records (else it replays the cassette)."""
        cassette = self.folder / f"{name}.buslog"
        if self.mode == "all":
            return True
        if self.mode == "none":
            return False
        if self.mode == "new_episodes":
            return not cassette.exists()
        return not self.folder.exists()  # once: a cassette folder is replayed, whichever nodes it has

    def node(self, name: str, **options: Any) -> Node:
        from actors.app.wiring import registry as default_registry

        registry = options.pop("registry", None) or default_registry()
        cassette = self.folder / f"{name}.buslog"
        if self.recording(name):
            self.folder.mkdir(parents=True, exist_ok=True)
            cassette.unlink(missing_ok=True)
            writer = CaptureWriter(cassette, node=name, schema=registry.schema_hash())
            node: Node = Node(name, registry=registry, capture=writer, **options)
        else:
            if not cassette.exists():
                pytest.fail(
                    f"kbus replay: no recording {cassette} (record mode {self.mode!r}); run once with "
                    "--kbus-record-mode=once to record it",
                    pytrace=False,
                )
            actual = self._scratch / f"{name}.buslog"
            writer = CaptureWriter(actual, node=name, schema=registry.schema_hash())
            tape = Tape(read_log(cassette), registry)
            node = TapeNode(name, tape=tape, registry=registry, capture=writer, **options)
            self._replayed.append((cassette, actual, registry))
        self._nodes.append(node)
        return node

    def finish(self) -> None:
        for node in self._nodes:
            node.stop()  # idempotent: a node the test stopped itself is closed already
        for cassette, actual, registry in self._replayed:
            divergence = first_divergence(read_log(cassette), read_log(actual), registry)
            if divergence is not None:
                pytest.fail(f"kbus replay of {cassette.name}: {divergence}", pytrace=False)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kbus")
    group.addoption(
        "--kbus-record-mode",
        choices=RECORD_MODES,
        default="once",
        help="kbus_replay cassettes: once (record if missing, else replay), none (replay only), "
        "new_episodes (record nodes the cassette lacks), all (always record)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kbus_replay: the test records/replays its kbus agent run")


@pytest.fixture
def kbus_replay(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KbusReplay]:
    """Record this test's kbus nodes the first time, replay them offline later (see the module docstring)."""
    mode = request.config.getoption("--kbus-record-mode")
    test_file = Path(str(request.node.path))
    folder = test_file.parent / "replays" / test_file.stem / _safe(request.node.name)
    session = KbusReplay(folder, str(mode), tmp_path)
    yield session
    session.finish()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


__all__ = ["RECORD_MODES", "KbusReplay", "Tape", "TapeNode", "TapeProvider", "kbus_replay"]
