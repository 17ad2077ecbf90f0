"""The seeded fault simulation (tests/peers/faultsim.py): a conversation across three real processes over
ipc, one fault per seed (SIGKILL of the Router, the tool host or the conversation process; a dropped,
delayed or duplicated message), then restart and resume. Per seed, from the stores themselves: every
effect ran at most once, every provider turn has exactly one receipt and no intent is left open, every
request ended, and the session file keeps the transcript rule. ``scripts/faultsim --seeds N`` runs any
number and prints the first failing seed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from peers import faultsim

pytestmark = pytest.mark.integration

SEEDS = 200
CHUNK = 20  # seeds per test, so two workers share the run


def test_without_a_fault_every_turn_runs_its_tools_once(tmp_path: Path) -> None:
    report = faultsim.run_seed(None, tmp_path)
    assert report.problems == []
    assert report.effects == {f"t{n}.c{i}": 1 for n in range(faultsim.TURNS) for i in range(faultsim.CALLS)}
    assert report.receipts == report.provider_turns == faultsim.TURNS


@pytest.mark.parametrize("first", range(0, SEEDS, CHUNK), ids=lambda s: f"seeds-{s}-{s + CHUNK - 1}")
def test_every_invariant_holds_for_every_seed(first: int, tmp_path: Path) -> None:
    failing = faultsim.first_failing(range(first, first + CHUNK), tmp_path)
    assert failing is None, f"seed {failing.plan.seed if failing and failing.plan else '?'}: {failing}"
