"""MB-06 for every message type kbus registers (issue 18 item 11: the round trips covered 54 of 154).

The cases are the registry itself (``actors.app.wiring.registry()``, the table a ``kbus node`` speaks), so a
type registered later is round-tripped with no change here. Its values come from the codec tests' generic
strategy (one row per field form the codec accepts); a type with a field form that strategy has no row for
fails here with "strategy_for has no row for ...", until it gets a row or an entry in ``STRATEGIES``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from unit.transport.test_codec import strategy_for

from actors.app.wiring import MESSAGES, registry
from transport.codec import _body_ext
from transport.errors import ProtocolError

REG = registry()
ALL = REG.classes

# Types whose valid values the generic strategy cannot draw (a __post_init__ check, say): their own
# strategy. None needs one today; listed here, a type is round-tripped with it instead.
STRATEGIES: dict[type[Any], st.SearchStrategy[Any]] = {}


def strategy_of(cls: type[Any]) -> st.SearchStrategy[Any]:
    return STRATEGIES.get(cls) or strategy_for(cls)


def assert_same(back: Any, sent: Any, path: str = "") -> None:
    """Equal, and of the same types all the way down: a str-valued enum member equals its plain string,
    so ``==`` alone would let a codec hand back the wrong type."""
    assert type(back) is type(sent), f"{path or 'message'}: {type(back).__name__} != {type(sent).__name__}"
    if dataclasses.is_dataclass(sent) and not isinstance(sent, type):
        for f in dataclasses.fields(sent):
            assert_same(getattr(back, f.name), getattr(sent, f.name), f"{path}.{f.name}")
    elif isinstance(sent, list | tuple):
        assert len(back) == len(sent), path
        for i, (b, s) in enumerate(zip(back, sent, strict=True)):
            assert_same(b, s, f"{path}[{i}]")
    elif isinstance(sent, dict):
        assert back.keys() == sent.keys(), path
        for k in sent:
            assert_same(back[k], sent[k], f"{path}[{k!r}]")
    else:
        assert back == sent, path


def test_the_cases_are_every_registered_type() -> None:
    assert len(ALL) == len(set(MESSAGES)) >= 154
    assert set(STRATEGIES) <= set(ALL), "a strategy for a type nobody registers"


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.TAG)
def test_mb06_every_registered_message_round_trips(cls: type[Any]) -> None:
    """MB-06: every registered message survives encode -> decode unchanged."""

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(strategy_of(cls))
    def round_trip(message: Any) -> None:
        assert REG.tag_of(message) == cls.TAG
        back = REG.decode(cls.TAG, REG.encode(message))
        assert back == message
        assert_same(back, message)

    round_trip()


# A value of each form a body field can hold, put in place of each field in turn (and the field dropped,
# and an unknown one added): every kind the codec tells apart on the fast path and off it.
_SUBSTITUTES: tuple[Any, ...] = (None, True, 7, 1.5, "s", b"b", [1, "x"], {"k": 1}, {"$t": "sys.ping"})
_GONE = object()


def _outcome(decode: Any, frame: bytes) -> Any:
    try:
        return ("value", decode(frame))
    except ProtocolError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.TAG)
def test_mb06_the_compiled_decoder_is_the_full_walk(cls: type[Any]) -> None:
    """MB-06 and the codec's refusals: ``Registry.decode``'s compiled function for a kind gives what the
    full walk of the unpacked body (``_decode_map``) gives, for the bodies senders send and for each field
    replaced by a value of every other form, dropped, renamed, or joined by an unknown one: the same
    message (same types all the way down), or a ProtocolError with the same words."""

    def walk(frame: bytes) -> Any:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=True, ext_hook=_body_ext)  # as decode does
        return REG._decode_map(cls, cls.TAG, raw)

    def compiled(frame: bytes) -> Any:
        return REG.decode(cls.TAG, frame)

    @settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(strategy_of(cls))
    def same(message: Any) -> None:
        body = msgpack.unpackb(REG.encode(message), raw=False)  # UUIDs stay ext values: packed back as such
        variants = [body, {**body, "unknown": 1}, [body]]
        for name in body:
            dropped = {k: v for k, v in body.items() if k != name}
            variants += [dropped, {**dropped, "unknown": body[name]}]  # gone, and renamed
            variants += [{**body, name: value} for value in _SUBSTITUTES]
        for variant in variants:
            frame = msgpack.packb(variant, use_bin_type=True)
            fast, slow = _outcome(compiled, frame), _outcome(walk, frame)
            assert fast[0] == slow[0], (variant, fast, slow)
            if fast[0] == "value":
                assert_same(fast[1], slow[1])
            else:
                assert fast[1] == slow[1]
        assert_same(compiled(REG.encode(message)), message)

    same()
