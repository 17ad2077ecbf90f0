"""Every committed capture under tests/replay/ replays with zero divergence (DESIGN.md §6).

A log is recorded from real processes by scripts/record-replays; each names the actor it replays and the
actor class that must reproduce it. A change to the wire or to an actor's behaviour shows here as the first
divergent record with a field diff; re-record only when the change is intended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.echo import EchoActor
from actors.nodes import registry
from transport.capture import read_log, verify
from transport.replay import Replay

HERE = Path(__file__).parent

# log file -> (actor address, actor class)
CAPTURES: dict[str, tuple[str, Any]] = {
    "echo_exchange.buslog": ("n1/echo", EchoActor),
}


def test_every_capture_in_the_folder_is_listed() -> None:
    assert sorted(p.name for p in HERE.glob("*.buslog")) == sorted(CAPTURES)


@pytest.mark.parametrize("name", sorted(CAPTURES))
def test_capture_replays_with_zero_divergence(name: str) -> None:
    path = HERE / name
    assert verify(path).ok, verify(path).problems
    address, actor_class = CAPTURES[name]
    log = read_log(path)
    result = Replay(log, address, registry()).run(actor_class)
    assert result.delivered > 0
    assert result.compared == sum(1 for r in log.records if r.at == "send" and r.actor == address)
