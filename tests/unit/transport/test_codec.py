"""Tests for transport.codec: hostile frames, round trips of every registered message, registry rules.

DESIGN.md §3: every inbound frame is hostile; every decoding failure is a ``ProtocolError`` and nothing
else. MB-06: every public message type survives a msgpack round trip unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import types
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport.codec import (
    MAX_BODY_BYTES,
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    Registry,
    decode_header,
    encode_header,
)
from transport.envelope import FORMAT_VERSION, Header
from transport.errors import ProtocolError
from transport.messages import SYSTEM_MESSAGES, Echo, ErrorReply, Hello, Ok, Ping

REG = Registry(SYSTEM_MESSAGES)
ID = bytes(range(16))
ID2 = bytes(range(16, 32))


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


# The header on the wire: a msgpack array of exactly these 16 slots, in this order (envelope.Header field
# order), each with the msgpack types it may carry. Written out here independently of codec._HEADER_SLOTS;
# test_slot_table_is_the_header_field_order pins the order to Header.
HEADER_SLOTS: tuple[tuple[str, frozenset[str]], ...] = (
    ("id", frozenset({"bytes"})),
    ("kind", frozenset({"str"})),
    ("src", frozenset({"str"})),
    ("dst", frozenset({"str"})),
    ("flow", frozenset({"str"})),
    ("ts", frozenset({"float", "int"})),
    ("seq", frozenset({"int"})),
    ("corr", frozenset({"bytes", "nil"})),
    ("cause", frozenset({"bytes", "nil"})),
    ("conv", frozenset({"str", "nil"})),
    ("turn", frozenset({"str", "nil"})),
    ("idem", frozenset({"str", "nil"})),
    ("attempt", frozenset({"int"})),
    ("deadline", frozenset({"float", "int", "nil"})),
    ("auth", frozenset({"str", "nil"})),
    ("v", frozenset({"int"})),
)
SLOT_NAMES = tuple(name for name, _ in HEADER_SLOTS)
SLOT_INDEX = {name: i for i, name in enumerate(SLOT_NAMES)}
N_SLOTS = len(HEADER_SLOTS)

# The valid base header every hostile case starts from: a plain ask, optional slots nil.
BASE: dict[str, Any] = {
    "id": ID,
    "kind": "echo",
    "src": "n1/client.1",
    "dst": "n2/echo",
    "flow": "ask",
    "ts": 1700000000.25,
    "seq": 0,
    "corr": None,
    "cause": None,
    "conv": None,
    "turn": None,
    "idem": None,
    "attempt": 1,
    "deadline": None,
    "auth": None,
    "v": FORMAT_VERSION,
}
# The same with every optional slot set (a reply in a conversation, with a deadline).
FULL: dict[str, Any] = {
    **BASE,
    "flow": "reply",
    "seq": 3,
    "corr": ID2,
    "cause": ID,
    "conv": "conv-1",
    "turn": "turn-2",
    "idem": "idem-3",
    "attempt": 2,
    "deadline": 1700000030.5,
    "auth": "n1",
}


def header_slots(base: Mapping[str, Any] = BASE, **overrides: Any) -> list[Any]:
    """A header as the wire carries it: a list in slot order, with named slots replaced."""
    unknown = overrides.keys() - SLOT_INDEX.keys()
    assert not unknown, f"not header slots: {sorted(unknown)}"
    merged = {**base, **overrides}
    return [merged[name] for name in SLOT_NAMES]


def header_frame(**overrides: Any) -> bytes:
    return pack(header_slots(**overrides))


def array_by_hand(items: list[bytes], *, width: int = 16) -> bytes:
    """A msgpack array from already-encoded items, with an array16 (or array32) prefix by hand."""
    if width == 32:
        return b"\xdd" + len(items).to_bytes(4, "big") + b"".join(items)
    return b"\xdc" + len(items).to_bytes(2, "big") + b"".join(items)


def header_with_raw_slot(name: str, raw: bytes) -> bytes:
    """The base header frame with one slot's encoded bytes replaced by ``raw`` (which need not be valid
    msgpack): the only way to put invalid UTF-8, malformed ext data or very deep nesting in one slot."""
    items = [pack(v) for v in header_slots()]
    items[SLOT_INDEX[name]] = raw
    return array_by_hand(items)


def old_header_map(**extra: Any) -> dict[str, Any]:
    """A header as the old (map) format carried it: required keys, optional ones only when set."""
    return {
        "v": FORMAT_VERSION,
        "id": ID,
        "kind": "echo",
        "src": "n1/client.1",
        "dst": "n2/echo",
        "flow": "ask",
        "ts": 1700000000.25,
        **extra,
    }


def map_by_hand(pairs: list[tuple[Any, Any]], *, map16: bool = False) -> bytes:
    """A msgpack map written pair by pair, so keys may repeat (``packb`` of a dict cannot do that)."""
    prefix = b"\xde" + len(pairs).to_bytes(2, "big") if map16 else bytes([0x80 | len(pairs)])
    return prefix + b"".join(pack(k) + pack(v) for k, v in pairs)


def ext(code: int, data: bytes) -> bytes:
    return pack(msgpack.ExtType(code, data))


def nested_maps(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


def nested_lists(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def nested_causes(depth: int) -> dict[str, Any]:
    cause: Any = None
    for i in range(depth):
        cause = {"$t": ErrorReply.TAG, "error": "expired", "message": f"level {i}", "cause": cause}
    assert cause is not None
    return cause


# ------------------------------------------------------------------------------------ sanity of the base


def test_slot_table_is_the_header_field_order() -> None:
    """The wire order is Header's field order: this table and the hostile cases depend on it."""
    assert Header._fields == SLOT_NAMES
    assert N_SLOTS == 16


def test_the_base_header_frame_is_valid() -> None:
    """The hostile cases below each break one thing in this frame, so it must decode cleanly itself."""
    h = decode_header(header_frame())
    assert h == Header(id=ID, kind="echo", src="n1/client.1", dst="n2/echo", flow="ask", ts=1700000000.25)
    assert h == Header(*header_slots())


def test_the_full_header_frame_is_valid() -> None:
    """Every optional slot set: the bases for the corr/cause/deadline cases."""
    assert decode_header(pack(header_slots(FULL))) == Header(*header_slots(FULL))


def test_encode_header_writes_the_slots_in_order() -> None:
    """The encoder's output is exactly the array this file builds by hand (array16, slot order)."""
    h = Header(*header_slots(FULL))
    frame = encode_header(h)
    assert frame == pack(header_slots(FULL))
    assert frame[:3] == b"\xdc\x00\x10"
    assert msgpack.unpackb(frame, raw=False) == header_slots(FULL)


def test_hand_built_arrays_decode_like_packed_ones() -> None:
    """Any msgpack array encoding of the same 16 slots is the same header (array16 or array32)."""
    items = [pack(v) for v in header_slots()]
    assert header_with_raw_slot("kind", pack("echo")) == header_frame()
    assert decode_header(array_by_hand(items)) == decode_header(header_frame())
    assert decode_header(array_by_hand(items, width=32)) == decode_header(header_frame())


# ----------------------------------------------------------------------------- hostile header frames

# A wrong value per msgpack type: (wire type, value, the Python type name decode_header reports).
# Chosen so only the type is wrong: the str is 16 characters (a length check alone would take it for an
# id), the bytes are a valid address, True == 1 == FORMAT_VERSION == the default attempt.
WRONG_VALUES: dict[str, tuple[str, Any, str]] = {
    "bool": ("bool", True, "bool"),
    "int": ("int", 7, "int"),
    "float": ("float", 1.5, "float"),
    "str": ("str", "0123456789abcdef", "str"),
    "bytes": ("bytes", b"n2/echo", "bytes"),
    "nil": ("nil", None, "NoneType"),
    "array": ("array", ["n2", "echo"], "tuple"),  # decode_header unpacks arrays as tuples
    "map": ("map", {"k": 1}, "dict"),
}
# Near misses that equal a valid value: a naive `isinstance`/`==` check would let them through.
NEAR_MISSES: tuple[tuple[str, str, Any, str], ...] = (
    ("seq", "false", False, "bool"),
    ("seq", "float-0.0", 0.0, "float"),
    ("attempt", "float-1.0", 1.0, "float"),
    ("v", "float-1.0", float(FORMAT_VERSION), "float"),
    ("flow", "bytes-ask", b"ask", "bytes"),
    ("src", "bytes-address", b"n1/client.1", "bytes"),
    ("id", "str-of-the-id", ID.decode("latin-1"), "str"),
    ("corr", "false", False, "bool"),
    ("deadline", "false", False, "bool"),
)


def _wrong_type_case(slot: str, label: str, value: Any, type_name: str) -> Any:
    match = rf"^header '{slot}' is a {type_name}$"
    return pytest.param(header_frame(**{slot: value}), match, id=f"{slot}-is-{label}")


def _wrong_type_cases() -> list[Any]:
    """Every slot with every msgpack type it does not accept (incl. nil in every required slot)."""
    cases = []
    for slot, accepted in HEADER_SLOTS:
        for label, (wire_type, value, type_name) in WRONG_VALUES.items():
            if wire_type not in accepted:
                cases.append(_wrong_type_case(slot, label, value, type_name))
    cases += [_wrong_type_case(*near) for near in NEAR_MISSES]
    return cases


def _shape_cases() -> list[Any]:
    """Frames that are not one msgpack array of 16: bytes-level damage, wrong top level, wrong length."""
    valid = header_frame()
    slots = header_slots()
    p = pytest.param
    not_16 = r"^header is not an array of 16 \(got a "
    return [
        p(b"", "incomplete input", id="empty"),
        p(valid[:-1], "incomplete input", id="truncated-last-byte"),
        p(valid[: len(valid) // 2], "incomplete input", id="truncated-half"),
        p(valid[:3], "exceeds max_array_len", id="truncated-to-array-prefix"),
        p(valid[:1], "incomplete input", id="truncated-to-first-byte"),
        p(valid + b"\xc0", "extra data", id="trailing-nil"),
        p(valid + b"\x00", "extra data", id="trailing-zero-byte"),
        p(valid + valid, "extra data", id="two-headers"),
        p(b"\xc1", "FormatError", id="never-used-byte"),
        p(b"\xdd\xff\xff\xff\xff", "exceeds max_array_len", id="array32-claims-4g-items"),
        p(header_frame(kind="k" * (MAX_HEADER_BYTES + 1)), "exceeds 8192", id="oversized"),
        p(b"\x91" * (MAX_HEADER_BYTES + 1), "exceeds 8192", id="oversized-before-decoding"),
        # Not an array at the top level.
        p(pack(7), not_16 + r"int\)", id="top-level-int"),
        p(pack("v"), not_16 + r"str\)", id="top-level-str"),
        p(pack(None), not_16 + r"NoneType\)", id="top-level-nil"),
        p(pack(True), not_16 + r"bool\)", id="top-level-bool"),
        p(pack(1.5), not_16 + r"float\)", id="top-level-float"),
        p(pack(valid), not_16 + r"bytes\)", id="top-level-bin-holding-a-header"),
        p(pack(msgpack.Timestamp(1, 0)), not_16 + r"Timestamp\)", id="top-level-timestamp"),
        p(pack(msgpack.ExtType(42, b"x")), "ext type 42", id="top-level-unknown-ext"),
        # Too few / too many slots.
        p(pack([]), not_16 + r"tuple\)", id="zero-slots"),
        p(pack(slots[:1]), not_16 + r"tuple\)", id="one-slot"),
        p(pack(slots[:-1]), not_16 + r"tuple\)", id="15-slots-no-version"),
        p(pack(slots[1:]), not_16 + r"tuple\)", id="15-slots-no-id"),
        p(pack([*slots, None]), not_16 + r"tuple\)", id="17-slots-extra-nil"),
        p(pack([*slots, FORMAT_VERSION]), not_16 + r"tuple\)", id="17-slots-version-twice"),
        p(pack(slots + slots), not_16 + r"tuple\)", id="32-slots"),
        p(pack([slots]), not_16 + r"tuple\)", id="header-wrapped-in-an-array"),
        # The old format (a map) and maps that look like it: all rejected, whatever their keys.
        p(pack(old_header_map()), not_16 + r"dict\)", id="old-map-header"),
        p(pack(old_header_map(seq=2, corr=ID2)), not_16 + r"dict\)", id="old-map-header-with-optionals"),
        p(pack(Header(*slots)._asdict()), not_16 + r"dict\)", id="map-with-all-16-keys"),
        p(
            map_by_hand([*old_header_map().items(), ("kind", "echo")]),
            not_16 + r"dict\)",
            id="old-map-duplicate-key-same-value",
        ),
        p(
            map_by_hand([*old_header_map().items(), ("dst", "n2/other")]),
            not_16 + r"dict\)",
            id="old-map-duplicate-key-new-value",
        ),
        p(
            map_by_hand([*old_header_map().items(), ("v", FORMAT_VERSION)], map16=True),
            not_16 + r"dict\)",
            id="old-map16-duplicate-key",
        ),
        p(pack(dict(enumerate(slots))), "int is not allowed for map key", id="map-with-int-keys-0-to-15"),
        p(
            map_by_hand([(1, 1), *old_header_map().items()]),
            "int is not allowed for map key",
            id="old-map-with-an-int-key",
        ),
        p(
            map_by_hand([(None, 1), *old_header_map().items()]),
            "NoneType is not allowed for map key",
            id="old-map-with-a-nil-key",
        ),
        p(
            map_by_hand([(k.encode(), v) for k, v in old_header_map().items()]),
            not_16 + r"dict\)",
            id="old-map-with-bytes-keys",
        ),
        p(pack({}), not_16 + r"dict\)", id="empty-map"),
        p(pack(old_header_map(kind=msgpack.ExtType(42, b"x"))), "ext type 42", id="old-map-with-unknown-ext"),
        p(pack(slots[::-1]), r"^header 'id' is a int$", id="slots-reversed"),
        p(
            pack([FORMAT_VERSION, *slots[:-1]]),
            r"^header 'id' is a int$",
            id="version-first-like-the-old-map",
        ),
    ]


def _slot_content_cases() -> list[Any]:
    """Bytes-level hostility inside one slot of an otherwise valid array."""
    p = pytest.param
    raw = header_with_raw_slot
    ext = "unknown msgpack ext type"
    return [
        p(raw("kind", b"\x91" * 3000 + b"\xc0"), "StackError", id="kind-3000-nested-arrays"),
        p(raw("conv", b"\x81\xa1a" * 2000 + b"\xc0"), "StackError", id="conv-2000-nested-maps"),
        p(
            header_frame(kind=nested_lists(MAX_DEPTH + 5)),
            r"^header 'kind' is a tuple$",
            id="kind-nested-arrays-within-stack",
        ),
        p(raw("kind", b"\xa2\xff\xfe"), "UnicodeDecodeError", id="kind-invalid-utf8"),
        p(raw("src", b"\xa3\xed\xa0\x80"), "UnicodeDecodeError", id="src-utf8-surrogate"),
        p(raw("auth", b"\xa2\xc0\xaf"), "UnicodeDecodeError", id="auth-overlong-utf8"),
        p(header_frame(kind=msgpack.ExtType(42, b"x")), f"{ext} 42$", id="kind-unknown-ext-42"),
        p(header_frame(id=msgpack.ExtType(1, ID)), f"{ext} 1$", id="id-uuid-ext-not-allowed"),
        p(header_frame(idem=msgpack.ExtType(127, b"")), f"{ext} 127$", id="idem-ext-127"),
        p(raw("corr", b"\xd4\xfb\x00"), f"{ext} -5$", id="corr-negative-ext"),
        p(header_frame(ts=msgpack.Timestamp(1, 0)), r"^header 'ts' is a Timestamp$", id="ts-timestamp-ext"),
        p(
            header_frame(deadline=msgpack.Timestamp(1, 0)),
            r"^header 'deadline' is a Timestamp$",
            id="deadline-timestamp-ext",
        ),
        p(raw("ts", b"\xd5\xff\x00\x00"), "invalid timestamp data", id="ts-malformed-timestamp"),
    ]


def _value_cases() -> list[Any]:
    """Well-typed slots with values outside the contract."""
    p = pytest.param
    version = "unsupported header format version"
    ids = "^message ids are 16 bytes$"
    address = "not an actor address"
    finite = "^header times must be finite$"
    out_of_range = r"^header seq/attempt out of range$"
    corr = r"^a reply needs 'corr'$"
    return [
        p(header_frame(v=FORMAT_VERSION + 1), version, id="version-next"),
        p(header_frame(v=0), version, id="version-zero"),
        p(header_frame(v=-1), version, id="version-negative"),
        p(header_frame(v=2**64 - 1), version, id="version-uint64-max"),
        p(header_frame(flow="publish"), "unknown flow 'publish'", id="flow-unknown"),
        p(header_frame(flow="ASK"), "unknown flow 'ASK'", id="flow-case"),
        p(header_frame(flow="ask "), "unknown flow 'ask '", id="flow-trailing-space"),
        p(header_frame(flow=""), "unknown flow ''", id="flow-empty"),
        p(header_frame(id=b"x" * 15), ids, id="id-15-bytes"),
        p(header_frame(id=b"x" * 17), ids, id="id-17-bytes"),
        p(header_frame(id=b""), ids, id="id-empty"),
        p(header_frame(corr=b"x" * 8), ids, id="corr-8-bytes"),
        p(header_frame(corr=b""), ids, id="corr-empty"),
        p(header_frame(flow="reply", corr=b"x" * 17), ids, id="reply-corr-17-bytes"),
        p(header_frame(cause=b"x" * 32), ids, id="cause-32-bytes"),
        p(header_frame(cause=b"x" * 15), ids, id="cause-15-bytes"),
        p(header_frame(src="n1"), address, id="src-no-slash"),
        p(header_frame(dst="echo"), address, id="dst-no-slash"),
        p(header_frame(dst="n2/echo/1/x"), address, id="dst-node-actor-instance-and-more"),
        p(header_frame(dst="n2/a/b/c"), address, id="dst-three-actor-parts"),
        p(header_frame(dst="n2//echo"), address, id="dst-empty-actor"),
        p(header_frame(dst="n2/echo/"), address, id="dst-empty-instance"),
        p(header_frame(dst="n2/"), address, id="dst-empty-after-slash"),
        p(header_frame(src="/echo"), address, id="src-empty-node"),
        p(header_frame(src=""), address, id="src-empty"),
        p(header_frame(dst="/"), address, id="dst-just-a-slash"),
        p(header_frame(dst="n 2/echo"), address, id="dst-space-in-node"),
        p(header_frame(dst="n2/ec ho"), address, id="dst-space-in-actor"),
        p(header_frame(dst="n2/ec*ho"), address, id="dst-star"),
        p(header_frame(dst="n2\\echo"), address, id="dst-backslash"),
        p(header_frame(src="n:1/echo"), address, id="src-colon-in-node"),
        p(header_frame(src="n1/\u00e9cho"), address, id="src-non-ascii"),
        p(header_frame(src="n1/echo\x00"), address, id="src-nul"),
        p(header_frame(dst="n2/echo\n"), address, id="dst-trailing-newline"),
        p(header_frame(src="n" * 65 + "/echo"), address, id="src-node-65-chars"),
        p(header_frame(dst="n2/" + "a" * 129), address, id="dst-actor-129-chars"),
        p(header_frame(ts=float("nan")), finite, id="ts-nan"),
        p(header_frame(ts=float("inf")), finite, id="ts-inf"),
        p(header_frame(ts=float("-inf")), finite, id="ts-minus-inf"),
        p(header_frame(deadline=float("nan")), finite, id="deadline-nan"),
        p(header_frame(deadline=float("inf")), finite, id="deadline-inf"),
        p(header_frame(deadline=float("-inf")), finite, id="deadline-minus-inf"),
        p(header_frame(seq=-1), out_of_range, id="seq-negative"),
        p(header_frame(seq=-(2**63)), out_of_range, id="seq-int64-min"),
        p(header_frame(attempt=0), out_of_range, id="attempt-zero"),
        p(header_frame(attempt=-3), out_of_range, id="attempt-negative"),
        p(header_frame(flow="reply"), corr, id="reply-without-corr"),
        p(header_frame(flow="part"), corr, id="part-without-corr"),
        p(header_frame(flow="reply", cause=ID2), corr, id="reply-with-cause-but-no-corr"),
    ]


def _hostile_headers() -> list[Any]:
    return [*_wrong_type_cases(), *_shape_cases(), *_slot_content_cases(), *_value_cases()]


@pytest.mark.parametrize(("frame", "match"), _hostile_headers())
def test_hostile_header_frame_raises_protocol_error(frame: bytes, match: str) -> None:
    """DESIGN.md §3: decoding treats every header frame as hostile; every failure is a ProtocolError.
    Each case breaks one thing in the base frame, and ``match`` names that thing."""
    with pytest.raises(ProtocolError, match=match):
        decode_header(frame)


@pytest.mark.parametrize(
    "slots",
    [
        pytest.param(header_slots(), id="base"),
        pytest.param(header_slots(FULL), id="full"),
        pytest.param(header_slots(flow="part", corr=ID2), id="part-with-corr"),
        pytest.param(header_slots(flow="tell", corr=ID2), id="tell-with-corr"),
        pytest.param(header_slots(dst="n2/echo/inst-1"), id="address-with-instance"),
        pytest.param(header_slots(src=f"{'n' * 64}/{'a' * 128}/{'b' * 128}"), id="address-at-max-lengths"),
        pytest.param(header_slots(dst="n-2.x_y/a:b@c+d/e.f"), id="address-all-allowed-chars"),
        pytest.param(header_slots(kind=""), id="empty-kind"),
        pytest.param(header_slots(conv="", turn="", idem="", auth=""), id="empty-optional-strs"),
        pytest.param(header_slots(ts=1700000000, deadline=1700000001), id="int-ts-and-deadline"),
        pytest.param(header_slots(ts=0.0, deadline=-1.0), id="zero-ts-negative-deadline"),
        pytest.param(header_slots(seq=2**64 - 1, attempt=2**64 - 1), id="uint64-max-seq-and-attempt"),
        pytest.param(header_slots(kind="k" * (MAX_HEADER_BYTES - 100)), id="just-under-the-size-limit"),
    ],
)
def test_valid_edge_headers_decode_and_round_trip(slots: list[Any]) -> None:
    """The near misses of the hostile corpus: the limits themselves are inside the contract."""
    h = decode_header(pack(slots))
    assert list(h) == slots
    assert decode_header(encode_header(h)) == h


def test_header_size_limit_is_configurable() -> None:
    frame = header_frame()
    assert decode_header(frame, max_bytes=len(frame)).id == ID
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_header(frame, max_bytes=len(frame) - 1)


def test_header_accepts_an_int_ts_and_deadline_as_floats() -> None:
    """An int ts/deadline is accepted and becomes the float a Header holds (times are floats everywhere)."""
    frame = header_frame(ts=1700000000, deadline=1700000001)
    h = decode_header(frame)
    assert (h.ts, type(h.ts)) == (1700000000.0, float)
    assert (h.deadline, type(h.deadline)) == (1700000001.0, float)


def test_json_that_only_looks_like_a_tagged_message_stays_a_map() -> None:
    """A JsonValue map with a "$t" key that does not build the tagged message is plain JSON, kept as is."""
    message = REG.decode("echo", pack({"data": {"$t": "sys.hello"}}))
    assert message.data == {"$t": "sys.hello"}


# ------------------------------------------------------------------------------- hostile body frames


def _hostile_bodies() -> list[Any]:
    p = pytest.param
    echo = pack({"text": "hi", "seq": 1})
    return [
        p("echo", b"", "undecodable", id="empty"),
        p("echo", echo[:-1], "undecodable", id="truncated"),
        p("echo", echo + b"\x00", "undecodable", id="trailing-bytes"),
        p("echo", echo + echo, "undecodable", id="two-bodies"),
        p("echo", b"\xc1", "undecodable", id="never-used-byte"),
        p("echo", pack({"payload": b"x" * MAX_BODY_BYTES}), "exceeds", id="oversized"),
        p("echo", b"\x91" * 3000 + b"\xc0", "undecodable", id="deep-arrays-3000"),
        p("echo", pack({"data": nested_maps(MAX_DEPTH + 5)}), "too deep", id="jsonvalue-maps-too-deep"),
        p("echo", pack({"data": nested_lists(MAX_DEPTH + 5)}), "too deep", id="jsonvalue-lists-too-deep"),
        # Past msgpack's own stack limit (and past what packb would even write): built by hand.
        p("echo", b"\x81\xa4data" + b"\x81\xa1a" * 2000 + b"\x01", "undecodable", id="jsonvalue-maps-2000"),
        p(
            "sys.error",
            pack({"error": "x", "message": "m", "cause": nested_causes(MAX_DEPTH + 5)}),
            "too deep",
            id="error-cause-chain-past-max-depth",
        ),
        p(
            "sys.error",
            pack({"error": "x", "message": "m", "fields": nested_maps(MAX_DEPTH + 5)}),
            "too deep",
            id="error-fields-past-max-depth",
        ),
        p("echo", pack({1: 2}), "map key", id="int-map-key"),
        p("echo", pack({"data": {1: 2}}), "map key", id="int-map-key-nested"),
        p("echo", pack({"data": {None: 2}}), "map key", id="nil-map-key-nested"),
        p("echo", map_by_hand([(b"text", "x")]), "unknown fields", id="bytes-key-top-level"),
        p("echo", pack({"data": {b"k": 1}}), "str", id="bytes-key-in-jsonvalue"),
        p(
            "sys.error",
            pack({"error": "x", "message": "m", "fields": {b"k": 1}}),
            "str",
            id="bytes-key-in-dict-field",
        ),
        p("echo", b"\x81\xa4text\xa2\xff\xfe", "undecodable", id="invalid-utf8-value"),
        p("echo", b"\x81\xa2\xff\xfe\x01", "undecodable", id="invalid-utf8-key"),
        p("echo", pack({"data": msgpack.ExtType(42, b"xyz")}), "ext", id="unknown-ext-42"),
        p("echo", b"\x81\xa4data\xd4\xfb\x00", "ext type -5", id="unknown-negative-ext"),  # fixext1, code -5
        p("echo", pack({"data": msgpack.ExtType(1, b"short")}), "ext", id="uuid-ext-wrong-length"),
        p("echo", pack({"data": msgpack.Timestamp(1, 0)}), "Timestamp", id="timestamp-ext"),
        p("echo", pack({"text": msgpack.ExtType(1, ID)}), "expected str", id="uuid-where-str"),
        p("echo", pack([1, 2]), "not a map", id="array-not-map"),
        p("echo", pack("text"), "not a map", id="str-not-map"),
        p("echo", pack(None), "not a map", id="nil-not-map"),
        p("echo", pack(3), "not a map", id="int-not-map"),
        p("echo.nope", pack({}), "unknown message kind", id="unknown-kind"),
        p("", pack({}), "unknown message kind", id="empty-kind"),
        p("Echo", pack({}), "unknown message kind", id="kind-case"),
        p("echo", pack({"bogus": 1}), "unknown fields", id="unknown-field"),
        # As many keys as the class has fields, one of them not a field: past the fast path's subscripts.
        p(
            "echo",
            pack({"payload": b"", "text": "", "seq": 0, "bogus": 1}),
            "unknown fields",
            id="field-count-kept",
        ),
        p("echo", pack({"text": "x", "TEXT": "y"}), "unknown fields", id="unknown-field-case"),
        p("sys.ok", pack({"x": None}), "unknown fields", id="field-on-empty-message"),
        p("echo.stream", pack({}), "missing field", id="missing-required-field"),
        p("sys.hello", pack({}), "missing field", id="missing-hello-node"),
        p("sys.error", pack({"error": "x"}), "missing field", id="missing-error-message"),
        p("echo", pack({"payload": "text"}), "expected bytes", id="str-where-bytes"),
        p("echo", pack({"text": b"bin"}), "expected str", id="bytes-where-str"),
        p("echo", pack({"seq": True}), "expected int", id="bool-where-int"),
        p("echo", pack({"seq": 1.0}), "expected int", id="float-where-int"),
        p("echo", pack({"seq": "1"}), "expected int", id="str-where-int"),
        p("echo", pack({"seq": None}), "expected int", id="nil-where-int"),
        p("sys.ping", pack({"nonce": False}), "expected int", id="bool-where-int-ping"),
        p("sys.hello", pack({"node": 5}), "expected str", id="int-where-str"),
        p("echo.stream", pack({"count": [3]}), "expected int", id="array-where-int"),
        p("sys.error", pack({"error": "x", "message": "m", "fields": [1]}), "map", id="array-where-map"),
        p("sys.error", pack({"error": "x", "message": "m", "cause": "c"}), "cause", id="str-where-nested"),
        p(
            "sys.error",
            pack({"error": "x", "message": "m", "cause": {"error": "x", "message": "m"}}),
            "cause",
            id="nested-without-tag",
        ),
        p(
            "sys.error",
            pack({"error": "x", "message": "m", "cause": {"$t": "sys.ok"}}),
            "cause",
            id="nested-with-wrong-tag",
        ),
        p(
            "sys.error",
            pack({"error": "x", "message": "m", "cause": {"$t": "sys.error", "error": 1}}),
            "cause: error",
            id="nested-with-bad-field",
        ),
        p(
            "sys.error",
            pack({"error": "x", "message": "m", "exc_type": 3}),
            "exc_type",
            id="int-where-optional-str",
        ),
    ]


@pytest.mark.parametrize(("kind", "frame", "match"), _hostile_bodies())
def test_hostile_body_frame_raises_protocol_error(kind: str, frame: bytes, match: str) -> None:
    """DESIGN.md §3: every body field is type-checked; every failure is a ProtocolError, nothing else."""
    with pytest.raises(ProtocolError, match=match):
        REG.decode(kind, frame)


def test_body_size_limit_is_the_registry_limit() -> None:
    small = Registry(SYSTEM_MESSAGES, max_body_bytes=64)
    assert small.decode("echo", pack({"payload": b"x" * 50})) == Echo(payload=b"x" * 50)
    with pytest.raises(ProtocolError, match="exceeds"):
        small.decode("echo", pack({"payload": b"x" * 64}))


def test_valid_edge_bodies_decode() -> None:
    """The near misses of the hostile corpus: the limits themselves are inside the contract."""
    assert REG.decode("echo", pack({"data": nested_maps(MAX_DEPTH - 2)})).data == nested_maps(MAX_DEPTH - 2)
    u = uuid.uuid4()
    assert REG.decode("echo", pack({"data": msgpack.ExtType(1, u.bytes)})).data == u
    assert REG.decode("sys.ok", pack({})) == Ok()
    assert REG.decode("sys.ok", pack({"$t": "sys.ok"})) == Ok()
    assert REG.decode("sys.ping", pack({})) == Ping()


# --------------------------------------------------------------- the same contract for other field types


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, slots=True, kw_only=True)
class Typed:
    """A test-only message that uses the field forms SYSTEM_MESSAGES do not (other layers will)."""

    TAG: ClassVar[str] = "test.typed"
    mode: Literal["a", "b"] = "a"
    colour: Colour = Colour.RED
    ident: uuid.UUID | None = None
    pair: tuple[int, str] = (0, "")
    items: list[int] = field(default_factory=list)
    names: tuple[str, ...] = ()
    scores: dict[str, float] = field(default_factory=dict)
    inner: Ping | None = None


TYPED = Registry((*SYSTEM_MESSAGES, Typed))


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"mode": "c"}, id="literal-unknown"),
        pytest.param({"mode": ["a"]}, id="literal-array"),
        pytest.param({"mode": {"a": 1}}, id="literal-map"),
        pytest.param({"colour": "green"}, id="enum-unknown"),
        pytest.param({"colour": ["red"]}, id="enum-array"),
        pytest.param({"ident": "not-a-uuid"}, id="uuid-str"),
        pytest.param({"ident": ID}, id="uuid-as-bytes"),
        pytest.param({"pair": [1]}, id="fixed-tuple-short"),
        pytest.param({"pair": [1, "a", 2]}, id="fixed-tuple-long"),
        pytest.param({"pair": ["a", 1]}, id="fixed-tuple-swapped"),
        pytest.param({"items": [1, "2"]}, id="list-item-type"),
        pytest.param({"items": {"a": 1}}, id="list-is-map"),
        pytest.param({"names": "abc"}, id="tuple-is-str"),
        pytest.param({"scores": {"a": "high"}}, id="dict-value-type"),
        pytest.param({"scores": {b"a": 1.0}}, id="dict-bytes-key"),
        pytest.param({"inner": {"$t": "sys.ping", "nonce": "x"}}, id="nested-bad-field"),
        pytest.param({"inner": {"$t": "sys.pong"}}, id="nested-wrong-tag"),
    ],
)
def test_hostile_typed_fields_raise_protocol_error(body: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        TYPED.decode(Typed.TAG, pack(body))


def test_typed_fields_round_trip() -> None:
    m = Typed(
        mode="b",
        colour=Colour.BLUE,
        ident=uuid.uuid4(),
        pair=(3, "x"),
        items=[1, 2],
        names=("p", "q"),
        scores={"a": 1.5, "b": 2.0},
        inner=Ping(nonce=4),
    )
    assert TYPED.decode(Typed.TAG, TYPED.encode(m)) == m


# ----------------------------------------------------------------------- round trips (MB-06), hypothesis

MSGPACK_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)
# "$t" is the wire's tag key for messages nested in a JsonValue (codec.TYPE_KEY); plain data never uses it.
JSON_KEY = st.text(max_size=12).filter(lambda k: k != "$t")
JSON_LEAF = (
    st.none()
    | st.booleans()
    | MSGPACK_INT
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.uuids()
)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(JSON_KEY, children, max_size=4),
    max_leaves=16,
)


def strategy_for_hint(hint: Any, budget: int) -> st.SearchStrategy[Any]:
    """A strategy for values of one field type; ``budget`` bounds how deep registered messages nest."""
    origin = get_origin(hint)
    if origin is Annotated:
        if "kbus.json" in hint.__metadata__:
            return JSON_VALUE
        return strategy_for_hint(get_args(hint)[0], budget)
    if hint is Any or hint is object:
        return JSON_VALUE
    if hint is type(None):
        return st.none()
    if hint is str:
        return st.text(max_size=30)
    if hint is bytes:
        return st.binary(max_size=30)
    if hint is bool:
        return st.booleans()
    if hint is int:
        return MSGPACK_INT
    if hint is float:
        return st.floats(allow_nan=False)
    if hint is uuid.UUID:
        return st.uuids()
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return st.sampled_from(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return strategy_for(hint, budget - 1) if budget > 0 else st.nothing()
    if origin in (Union, types.UnionType):
        return st.one_of(*(strategy_for_hint(a, budget) for a in get_args(hint)))
    if origin is Literal:
        return st.sampled_from(get_args(hint))
    if origin is tuple:
        args = get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for_hint(args[0], budget), max_size=5).map(tuple)
        return st.tuples(*(strategy_for_hint(a, budget) for a in args))
    if origin is list:
        return st.lists(strategy_for_hint(get_args(hint)[0], budget), max_size=5)
    if origin in (dict, Mapping):
        key, value = get_args(hint)
        assert key is str, hint
        return st.dictionaries(JSON_KEY, strategy_for_hint(value, budget), max_size=5)
    raise AssertionError(f"strategy_for has no row for {hint!r}: add one")


def strategy_for(cls: type[Any], budget: int = 3) -> st.SearchStrategy[Any]:
    """Instances of a registered message class, every init field drawn from its type hint."""
    hints = get_type_hints(cls, include_extras=True)
    fields = {f.name: strategy_for_hint(hints[f.name], budget) for f in dataclasses.fields(cls) if f.init}
    return st.builds(cls, **fields)


@pytest.mark.parametrize("cls", SYSTEM_MESSAGES, ids=lambda c: c.TAG)
def test_every_system_message_round_trips(cls: type[Any]) -> None:
    """MB-06: every registered message survives encode -> decode unchanged."""

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy_for(cls))
    def round_trip(message: Any) -> None:
        tag = REG.tag_of(message)
        assert tag == cls.TAG
        assert REG.decode(tag, REG.encode(message)) == message

    round_trip()


def test_strategy_covers_every_field_form_of_typed() -> None:
    """The generic strategy also handles the forms SYSTEM_MESSAGES lacks (so new messages can reuse it)."""

    @settings(max_examples=100, deadline=None)
    @given(strategy_for(Typed))
    def round_trip(message: Typed) -> None:
        assert TYPED.decode(Typed.TAG, TYPED.encode(message)) == message

    round_trip()


def test_error_reply_cause_chain_round_trips() -> None:
    """MB-06: errors travel as a body with their cause; a nested ErrorReply comes back as one."""
    inner = ErrorReply(error="expired", message="slow", fields={"peer": "n2"})
    outer = ErrorReply(error="handler", message="wrapped", cause=inner, exc_type="OSError")
    back = REG.decode(ErrorReply.TAG, REG.encode(outer))
    assert back == outer
    assert type(back.cause) is ErrorReply


def test_uuid_travels_as_ext_type_1_and_bytes_as_bin() -> None:
    """MB-06: UUIDs travel as ext type 1, bytes as bin."""
    u = uuid.UUID(int=5)
    raw = msgpack.unpackb(REG.encode(Echo(payload=b"\x00\x01", data=u)), raw=False)
    assert raw["data"] == msgpack.ExtType(1, u.bytes)
    assert raw["payload"] == b"\x00\x01"


ADDRESS = st.from_regex(
    r"[A-Za-z0-9_.-]{1,16}/[A-Za-z0-9_.:@+-]{1,24}(/[A-Za-z0-9_.:@+-]{1,24})?", fullmatch=True
)
IDS = st.binary(min_size=16, max_size=16)
FINITE = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def headers(draw: st.DrawFn) -> Header:
    flow = draw(st.sampled_from(["tell", "ask", "stream", "reply", "part"]))
    maybe_text = st.none() | st.text(max_size=20)
    return Header(
        id=draw(IDS),
        kind=draw(st.text(max_size=30)),
        src=draw(ADDRESS),
        dst=draw(ADDRESS),
        flow=flow,
        ts=draw(FINITE),
        seq=draw(st.integers(0, 2**64 - 1)),
        corr=draw(IDS if flow in ("reply", "part") else st.none() | IDS),
        cause=draw(st.none() | IDS),
        conv=draw(maybe_text),
        turn=draw(maybe_text),
        idem=draw(maybe_text),
        attempt=draw(st.integers(1, 2**32)),
        deadline=draw(st.none() | FINITE),
        auth=draw(maybe_text),
    )


@settings(max_examples=300, deadline=None)
@given(headers())
def test_header_round_trips(h: Header) -> None:
    """MB-06 for the envelope: decode_header(encode_header(h)) == h for every valid header."""
    frame = encode_header(h)
    assert len(frame) <= MAX_HEADER_BYTES
    assert decode_header(frame) == h


# ------------------------------------------------------------------------------------ registry rules


@dataclass(frozen=True, slots=True, kw_only=True)
class Tagged:
    TAG: ClassVar[str] = "test.tagged"
    n: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SameTag:
    TAG: ClassVar[str] = "test.tagged"
    n: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class NoTag:
    n: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class InheritsTag(Tagged):
    """A subclass must write its own tag: an inherited one would route to the parent's handler."""


@dataclass(slots=True, kw_only=True)
class Mutable:
    TAG: ClassVar[str] = "test.mutable"
    n: int = 0


class PlainClass:
    TAG: ClassVar[str] = "test.plain"


def test_registry_rejects_a_duplicate_tag() -> None:
    with pytest.raises(ValueError, match=r"test\.tagged"):
        Registry((Tagged, SameTag))


def test_registry_accepts_the_same_class_twice() -> None:
    assert Registry((Tagged, Tagged)).classes == (Tagged,)


def test_extended_registry_rejects_a_tag_already_taken() -> None:
    with pytest.raises(ValueError, match="echo"):
        REG.extended([dataclasses.make_dataclass("Other", [], namespace={"TAG": "echo"}, frozen=True)])


@pytest.mark.parametrize("cls", [NoTag, InheritsTag], ids=["no-tag", "inherited-tag"])
def test_registry_rejects_a_class_without_its_own_tag(cls: type[Any]) -> None:
    with pytest.raises(TypeError, match="TAG"):
        Registry((cls,))


def test_registry_rejects_a_mutable_dataclass() -> None:
    with pytest.raises(TypeError, match="frozen"):
        Registry((Mutable,))


def test_registry_rejects_a_class_that_is_not_a_dataclass() -> None:
    with pytest.raises(TypeError, match="dataclass"):
        Registry((PlainClass,))


def test_encode_of_an_unregistered_class_raises_type_error() -> None:
    with pytest.raises(TypeError, match="not a registered message"):
        REG.encode(Tagged(n=1))
    with pytest.raises(TypeError, match="not a registered message"):
        REG.tag_of(Tagged(n=1))


def test_encode_of_a_same_tag_impostor_raises_type_error() -> None:
    """Registration is by class identity, not by tag string."""
    reg = Registry((Tagged,))
    with pytest.raises(TypeError):
        reg.encode(SameTag(n=1))


def test_encode_of_an_unencodable_field_value_raises_type_error() -> None:
    with pytest.raises(TypeError, match="wire"):
        REG.encode(Echo(data=object()))


def test_oversized_encode_raises_protocol_error() -> None:
    small = Registry(SYSTEM_MESSAGES, max_body_bytes=100)
    assert small.encode(Echo(payload=b"x" * 50))
    with pytest.raises(ProtocolError, match="exceeds"):
        small.encode(Echo(payload=b"x" * 100))


def test_decode_returns_the_registered_class() -> None:
    assert REG.cls_for("sys.hello") is Hello
    assert REG.decode("sys.hello", REG.encode(Hello(node="n1"))) == Hello(node="n1")
    assert set(REG.tags) == {c.TAG for c in SYSTEM_MESSAGES}


def _one_field(name: str, hint: Any) -> type[Any]:
    cls = dataclasses.make_dataclass(
        "Versioned",
        [("value", hint, dataclasses.field(default=None))],
        namespace={"TAG": name},
        frozen=True,
        kw_only=True,
    )
    return cls


def test_schema_hash_changes_when_a_field_type_changes() -> None:
    as_int = Registry((_one_field("test.versioned", int),))
    as_int_again = Registry((_one_field("test.versioned", int),))
    as_str = Registry((_one_field("test.versioned", str),))
    assert as_int.schema_hash() == as_int_again.schema_hash()
    assert as_int.schema_hash() != as_str.schema_hash()


def test_schema_hash_changes_with_tags_and_fields() -> None:
    base = Registry(SYSTEM_MESSAGES).schema_hash()
    assert Registry((*SYSTEM_MESSAGES, Tagged)).schema_hash() != base
    assert Registry((*SYSTEM_MESSAGES, _one_field("test.versioned", int))).schema_hash() != base
    assert Registry(SYSTEM_MESSAGES).schema_hash() == base


# --------------------------------------------------------------------------------- fuzz (hypothesis)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_header_bytes_raise_only_protocol_error(frame: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_header(frame)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(REG.tags), st.binary(max_size=512))
def test_fuzz_body_bytes_raise_only_protocol_error(kind: str, frame: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        REG.decode(kind, frame)


# Values msgpack can carry, including the awkward ones: ext types, timestamps, bytes, deep-ish nesting.
WIRE_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | MSGPACK_INT
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=20)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1), st.integers(0, 999_999_999)),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.binary(max_size=4), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(SLOT_NAMES), WIRE_VALUE, max_size=4),
    st.sampled_from(["base", "full", "drop-last", "drop-first", "append"]),
    WIRE_VALUE,
)
def test_fuzz_header_arrays_raise_only_protocol_error(
    changes: dict[str, Any], shape: str, extra: Any
) -> None:
    """Structured fuzz: well-formed msgpack arrays near a valid header (slots replaced by arbitrary values,
    sometimes one slot too few or too many). Whatever decodes re-encodes to the same header."""
    slots = header_slots(FULL if shape == "full" else BASE, **changes)
    if shape == "drop-last":
        slots = slots[:-1]
    elif shape == "drop-first":
        slots = slots[1:]
    elif shape == "append":
        slots = [*slots, extra]
    try:
        h = decode_header(pack(slots))
    except ProtocolError:
        return
    assert len(slots) == N_SLOTS
    assert decode_header(encode_header(h)) == h


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.sampled_from(SLOT_NAMES) | st.text(max_size=4), WIRE_VALUE, max_size=4), st.booleans()
)
def test_fuzz_header_maps_are_always_rejected(changes: dict[str, Any], from_valid: bool) -> None:
    """No map decodes as a header any more, however close to a valid old-format header it is."""
    raw = {**old_header_map(), **changes} if from_valid else changes
    with pytest.raises(ProtocolError):
        decode_header(pack(raw))


def _field_names(cls: type[Any]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_body_maps_raise_only_protocol_error(data: st.DataObject) -> None:
    """Structured fuzz: maps with the message's own field names and arbitrary values. Whatever decodes
    is an instance of the class and re-encodes to the same message."""
    reg = TYPED
    cls = data.draw(st.sampled_from(reg.classes))
    names = [*_field_names(cls), "$t", "x"]
    body = data.draw(st.dictionaries(st.sampled_from(names), WIRE_VALUE, max_size=len(names)))
    try:
        message = reg.decode(cls.TAG, pack(body))
    except ProtocolError:
        return
    assert type(message) is cls
    # Bytes, not ==: a NaN off the wire is legal in a float or JsonValue field and never equals itself.
    frame = reg.encode(message)
    assert reg.encode(reg.decode(cls.TAG, frame)) == frame


def test_a_batch_splits_into_each_tells_own_header_and_the_batchs_other_slots() -> None:
    """MB-05 at the frame: tell i of a batch gets its own id, kind and seq (the batch's seq + i), every other
    header slot from the batch header, its own body, and the route it came by."""
    from transport.codec import BATCH_TAG, encode_batch_body, split_batch
    from transport.envelope import Inbound

    ids = [bytes([i]) * 16 for i in range(1, 4)]
    kinds = ["sys.echo", "sys.ping", "sys.echo"]
    bodies = [b"\x80", b"\x81\xa1a\x01", b"\x80"]
    body = encode_batch_body([x for triple in zip(ids, kinds, bodies, strict=True) for x in triple])
    batch = Header(b"B" * 16, BATCH_TAG, "n1/client.1", "n2/sink", "tell", 7.5, 40, None, None, "conv",
                   "turn", None, 1, None, "auth", FORMAT_VERSION)  # fmt: skip
    route = ("peer", b"identity")
    tells = split_batch(batch, body, route)
    got = list(tells)
    want = [
        Inbound(batch._replace(id=i, kind=k, seq=40 + n), b, route, None)
        for n, (i, k, b) in enumerate(zip(ids, kinds, bodies, strict=True))
    ]
    assert got == want
    assert all(type(x) is Inbound and type(x.header) is Header for x in got)
    assert list(tells) == got  # made again on each iteration, the same
    unsequenced = list(split_batch(batch._replace(seq=0), body, route))
    assert [x.header.seq for x in unsequenced] == [0, 0, 0]
