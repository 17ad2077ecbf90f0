"""Issue 18's fuzz test: seeded hostile frames against one real node running every actor type.

The node (``tests/peers/fuzz_node.py``) runs echo, the Router, a conversation with its tool host and gates,
the session-loop service, a subagent host and the Codex adapter over the real codex binary, in its own
process. ``tests/peers/fuzz.py`` sends a few thousand frames per actor over a real ipc socket, in batches;
after each batch a well-behaved client checks that every actor answers ``Ping`` with its own address and
that echo, a stream, the Router's stats and ``sys.stats`` answer right. ``scripts/fuzz`` runs the same for
long runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from peers.codex_support import find_codex
from peers.fuzz import CLASSES, Fuzzer, fuzzing

pytestmark = pytest.mark.integration

EVERY_TYPE = {"echo", "router", "chat", "chat.host", "sessions", "host", "codex"}
FRAMES_PER_ACTOR = 1500  # per batch; two batches
SEED = 18


@pytest.fixture
def fuzzer(ipc_dir: Path) -> Iterator[Fuzzer]:
    with fuzzing(ipc_dir, SEED, str(find_codex())) as fz:  # both processes ended by PID on exit
        yield fz


def test_no_frame_stops_an_actor_of_any_type_and_well_behaved_requests_keep_their_answers(
    fuzzer: Fuzzer, ipc_dir: Path
) -> None:
    assert set(fuzzer.actors) >= EVERY_TYPE
    rss_before = fuzzer.topology.rss_kib()
    for _ in range(2):
        fuzzer.batch(FRAMES_PER_ACTOR)
        report = fuzzer.report
        assert not report.crashed, "the node process died"
        assert report.dead == [], report.dead
        assert report.wrong == [], report.wrong
    report = fuzzer.report
    assert all(report.frames[c] > 0 for c in CLASSES), report.frames
    assert min(report.per_actor[a] for a in fuzzer.actors) == 2 * FRAMES_PER_ACTOR
    # Hostile input is counted, never a failure past the error replies.
    assert report.stats["malformed"] > 0 and report.stats["expired_on_arrival"] > 0
    assert report.stats["actor_input_failures"] == 0 and report.stats["answer_send_failures"] == 0
    # No handler took fuzzed input for a bug: the only handler error logged is the one echo.fail asks for.
    log = (ipc_dir / "node.log").read_text()
    raised = set(re.findall(r"handler for (\S+) raised (\w+)", log))
    assert raised <= {("echo.fail", "RuntimeError")}, raised
    assert fuzzer.topology.rss_kib() < rss_before + 200 * 1024, "the node grew by more than 200 MiB"
