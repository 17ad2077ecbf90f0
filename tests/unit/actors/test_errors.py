"""The actor-side error tree (issue 15): the drawing in ``actors/errors.py`` is checked against the classes,
so it cannot drift, and every error kbus puts on the wire sits in it under its real base, with one cause at
most."""

from __future__ import annotations

import re

import pytest

import actors.errors as errors
from actors.app.wiring import ERRORS
from transport.errors import TRANSPORT_ERRORS, BusError

CAUSES = (
    errors.Closed,
    errors.Cancelled,
    errors.TimedOut,
    errors.Broken,
    errors.Busy,
    errors.Exhausted,
    errors.Invalid,
)
FAMILIES = "the families"
ACTOR_ERRORS = tuple(cls for cls in ERRORS if cls not in TRANSPORT_ERRORS)


def drawn() -> dict[str, str]:
    """name -> parent name, read from the tree in the module docstring (the families line is no class: its
    children hang from ``KbusError``)."""
    doc = errors.__doc__ or ""
    block = doc.split("::", 1)[1].split("\n\n", 2)[1]
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        match = re.match(r"^(\s*(?:[│ ]\s*)*)(?:[├└]─ )?(\S.*?)(?:\s{2,}.*)?$", line)
        assert match, line
        depth = match.start(2)
        name = FAMILIES if match.group(2).startswith(FAMILIES) else match.group(2).split()[0]
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            parent = stack[-1][1]
            parents[name] = "KbusError" if parent == FAMILIES else parent
        stack.append((depth, name))
    return parents


def classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {"BusError": BusError}
    found |= {cls.__name__: cls for cls in (errors.KbusError, *CAUSES)}
    todo = list(ACTOR_ERRORS)
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(c for c in cls.__mro__[1:] if issubclass(c, BusError) and c.__name__ not in found)
        todo.extend(c for c in cls.__subclasses__() if c.__name__ not in found)
    return found


def test_the_drawing_is_read() -> None:
    tree = drawn()
    assert tree["KbusError"] == "BusError"
    assert tree["HandleTerminated"] == "Closed"
    assert tree["TurnInterrupted"] == "TurnTerminated"
    assert tree["RouterError"] == "ReceiptError"
    assert tree["ReceiptError"] == "KbusError"


@pytest.mark.parametrize("name", sorted(set(drawn()) - {FAMILIES}))
def test_each_drawn_class_derives_from_the_class_drawn_above_it(name: str) -> None:
    known = classes()
    parent = drawn()[name]
    assert name in known, f"{name} is drawn in actors/errors.py but is not an error kbus knows"
    assert issubclass(known[name], known[parent]), f"{name} is drawn under {parent}, but is not one"


@pytest.mark.parametrize("cls", ACTOR_ERRORS, ids=lambda c: c.__name__)
def test_every_actor_error_on_the_wire_is_drawn_with_one_cause_at_most(cls: type[BusError]) -> None:
    assert cls.__name__ in drawn(), (
        f"{cls.__name__} is registered for the wire but not drawn in actors/errors.py"
    )
    assert issubclass(cls, errors.KbusError)
    causes = [c.__name__ for c in CAUSES if issubclass(cls, c)]
    assert len(causes) <= 1, f"{cls.__name__} has more than one cause: {causes}"


def test_the_causes_are_not_on_the_wire_themselves() -> None:
    """A cause is for ``isinstance``; only the concrete classes travel (their own ``WIRE`` names)."""
    registered = {cls.WIRE for cls in ACTOR_ERRORS}
    assert all(c not in ACTOR_ERRORS for c in (errors.KbusError, *CAUSES))
    assert len(registered) == len(ACTOR_ERRORS)
