"""``actors.types.evolve``: ``dataclasses.replace`` for the frozen states the handle and the run machines
replace on every message, made once per class. It must make the object replace makes, leave the old one
alone, run a class's checks where it has them, and refuse what replace refuses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from actors.types import evolve


@dataclass(frozen=True, slots=True)
class Plain:
    a: int
    b: tuple[int, ...] = ()
    c: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Checked:
    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n must not be negative")


@dataclass(frozen=True)
class Derived:
    x: int
    twice: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "twice", 2 * self.x)


def test_evolve_makes_what_replace_makes_and_leaves_the_old_one() -> None:
    old = Plain(1, (2,), "c")
    for changes in ({}, {"a": 5}, {"b": (), "c": None}, {"a": 0, "b": (9,), "c": "x"}):
        new = evolve(old, **changes)
        assert new == dataclasses.replace(old, **changes) and new is not old
        assert type(new) is Plain
    assert old == Plain(1, (2,), "c")


def test_a_class_with_checks_still_runs_them() -> None:
    assert evolve(Checked(n=1), n=2) == Checked(n=2)
    with pytest.raises(ValueError, match="negative"):
        evolve(Checked(n=1), n=-1)
    assert evolve(Derived(3), x=4).twice == 8  # an init=False field is derived again, as replace does


def test_an_unknown_or_positional_change_is_refused() -> None:
    with pytest.raises(TypeError):
        evolve(Plain(1), d=1)
    with pytest.raises(TypeError):
        evolve(Plain(1), 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        evolve(Derived(3), twice=1)  # not an init field: replace refuses it too
