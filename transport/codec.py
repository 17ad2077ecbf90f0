"""msgpack <-> headers and message bodies. With capture.py, the only module that imports msgpack.

The header is a msgpack array of exactly 16 slots in ``envelope.Header`` field order, each slot of one
type (``_HEADER_SLOTS``); a body is a msgpack map of the message's field names (nested messages carry
``"$t"``: their tag). ``transport/WIRE.md`` describes both for writers of other clients.

Every inbound frame is hostile until proven otherwise: sizes are bounded before decoding, msgpack runs
with ``strict_map_key`` and ``raw=False``, only known ext types pass (none in a header), every header slot
and every body field is type-checked, unknown body fields are refused, nesting is bounded, and every
failure is a ``ProtocolError`` (never a crash of the receiving thread).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import math
import threading
import types
import typing
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, TypeAlias, Union, get_args, get_origin, get_type_hints

import msgpack

from transport.envelope import FLOWS, FORMAT_VERSION, Header, Route, TellBatch, is_address
from transport.errors import (
    BusError,
    ErrorRegistry,
    HandlerError,
    LimitExceeded,
    ProtocolError,
    RemoteError,
    cut_text,
)
from transport.messages import ErrorReply  # the bodies sit below the codec that encodes them
from transport.messages import JsonValue as JsonValue  # re-exported: where the layers above import it
from transport.records import direct_setters

MAX_HEADER_BYTES = 8192
MAX_BODY_BYTES = 1 << 20
MAX_DEPTH = 32
_SHOWN_NAMES = 5  # unknown field names an error lists
UUID_EXT = 1
TYPE_KEY = "$t"

Message: TypeAlias = Any  # a registered frozen dataclass; Registry checks membership at run time


class _Bad(Exception):
    """Internal: a field failed its check; becomes ProtocolError with the field's path."""


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"unknown msgpack ext type {code}")


def _body_ext(code: int, data: bytes) -> Any:
    if code == UUID_EXT and len(data) == 16:
        return uuid.UUID(bytes=data)
    raise ProtocolError(f"unknown msgpack ext type {code} ({len(data)} bytes)")


# ---------------------------------------------------------------------------------------------- header

_NONE = type(None)
# The header is a fixed msgpack array in ``Header`` field order (see envelope.py): no keys to repeat or
# invent, and decoding is one C call plus one type check per slot. The version is the last slot.
_HEADER_SLOTS: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("id", (bytes,)),
    ("kind", (str,)),
    ("src", (str,)),
    ("dst", (str,)),
    ("flow", (str,)),
    ("ts", (float, int)),
    ("seq", (int,)),
    ("corr", (bytes, _NONE)),
    ("cause", (bytes, _NONE)),
    ("conv", (str, _NONE)),
    ("turn", (str, _NONE)),
    ("idem", (str, _NONE)),
    ("attempt", (int,)),
    ("deadline", (float, int, _NONE)),
    ("auth", (str, _NONE)),
    ("v", (int,)),
)
_HEADER_LEN = len(_HEADER_SLOTS)
if tuple(name for name, _ in _HEADER_SLOTS) != Header._fields:  # pragma: no cover - a programming error
    raise ImportError("codec header slots and envelope.Header fields disagree")


# One Packer per thread: ``msgpack.packb`` builds (and allocates a buffer for) a new Packer on every call,
# which cost more than the packing itself. A Packer is not safe to share between threads (a ``default``
# hook runs Python code mid-pack); it resets its buffer after every pack, also after an error.
_packers = threading.local()


def encode_header(h: Header) -> bytes:
    # A NamedTuple packs as the array it is: no per-field work.
    try:
        pack = _packers.header
    except AttributeError:
        pack = _packers.header = msgpack.Packer(use_bin_type=True).pack
    return pack(h)  # type: ignore[no-any-return]


_new_tuple = tuple.__new__


def decode_header(frame: bytes, *, max_bytes: int = MAX_HEADER_BYTES) -> Header:
    """Decode one untrusted header frame; every failure is ProtocolError."""
    if len(frame) > max_bytes:
        raise ProtocolError(f"header of {len(frame)} bytes exceeds {max_bytes}")
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=False, ext_hook=_reject_ext)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises ValueError, TypeError, ExtraData, StackError, ...
        raise ProtocolError(f"undecodable header: {type(exc).__name__}: {exc}") from exc
    if type(raw) is not tuple or len(raw) != _HEADER_LEN:
        raise ProtocolError(f"header is not an array of {_HEADER_LEN} (got a {type(raw).__name__})")
    id_, kind, src, dst, flow, ts, seq, corr, cause, conv, turn, idem, attempt, deadline, auth, v = raw
    # The shape every node sends, checked in one expression (a subset of what _HEADER_SLOTS accepts);
    # anything else takes the slot-by-slot check, which names the bad slot and turns int times to floats.
    # `type(v) is`: a bool never passes as an int.
    if not (
        type(id_) is bytes
        and type(kind) is str
        and type(src) is str
        and type(dst) is str
        and type(flow) is str
        and type(ts) is float
        and type(seq) is int
        and (corr is None or type(corr) is bytes)
        and (cause is None or type(cause) is bytes)
        and (conv is None or type(conv) is str)
        and (turn is None or type(turn) is str)
        and (idem is None or type(idem) is str)
        and type(attempt) is int
        and (deadline is None or type(deadline) is float)
        and (auth is None or type(auth) is str)
        and type(v) is int
    ):
        for value, (name, accepted) in zip(raw, _HEADER_SLOTS, strict=True):
            if type(value) not in accepted:
                raise ProtocolError(f"header {name!r} is a {type(value).__name__}")
        # Times are floats in Header; an int is accepted.
        ts = float(ts)
        deadline = None if deadline is None else float(deadline)
        raw = (id_, kind, src, dst, flow, ts, seq, corr, cause, conv, turn, idem, attempt, deadline, auth, v)
    if v != FORMAT_VERSION:
        raise ProtocolError(f"unsupported header format version {v!r}")
    if flow not in FLOWS:
        raise ProtocolError(f"unknown flow {flow!r}")
    if len(id_) != 16 or (corr is not None and len(corr) != 16) or (cause is not None and len(cause) != 16):
        raise ProtocolError("message ids are 16 bytes")
    if not is_address(src) or not is_address(dst):
        raise ProtocolError(f"not an actor address: {src!r} -> {dst!r}")
    if not math.isfinite(ts) or (deadline is not None and not math.isfinite(deadline)):
        raise ProtocolError("header times must be finite")
    if seq < 0 or attempt < 1:
        raise ProtocolError("header seq/attempt out of range")
    if corr is None and (flow == "reply" or flow == "part"):
        raise ProtocolError("a reply needs 'corr'")
    header: Header = _new_tuple(Header, raw)
    return header


# ------------------------------------------------------------------------------------------------ batch

# A batch frame carries a burst of tells from one sender to one actor (WIRE.md section 7a): a header like
# any other with kind ``sys.batch``, and a body that is a msgpack array of 3 slots per tell, in order:
# id, kind, body. Every other header slot is the batch header's; the tells' ``seq`` numbers run on from the
# batch header's (0: not numbered). One frame, one send, one header check, for up to ``MAX_BATCH_ITEMS``.
BATCH_TAG = "sys.batch"
MAX_BATCH_ITEMS = 1024
BATCH_ITEM_OVERHEAD = 32  # msgpack bytes a tell costs in a batch besides its body and kind: a bound


def encode_batch_body(items: list[Any]) -> bytes:
    """The body of a batch frame from its flat ``[id, kind, body, id, kind, body, ...]`` list."""
    try:
        pack = _packers.batch
    except AttributeError:
        pack = _packers.batch = msgpack.Packer(use_bin_type=True).pack
    return pack(items)  # type: ignore[no-any-return]


def split_batch(
    header: Header, body: bytes, route: Route | None = None, *, max_body_bytes: int = MAX_BODY_BYTES
) -> TellBatch:
    """The tells of a batch frame whose ``header`` was admitted already, in order, as the ``TellBatch``
    an actor's mailbox takes (with ``route``; each tell's header is made as the actor takes it). The
    whole batch is checked here, so nothing of a bad one is delivered. Every failure is a
    ``ProtocolError`` (a malformed batch) or ``LimitExceeded`` (a body past ``max_body_bytes``, or more
    than ``MAX_BATCH_ITEMS`` tells): the whole batch is refused."""
    if header.flow != "tell":
        raise ProtocolError(f"a {BATCH_TAG} frame has flow tell, not {header.flow!r}")
    if len(body) > max_body_bytes:
        raise LimitExceeded(
            f"{BATCH_TAG} body of {len(body)} bytes exceeds {max_body_bytes}",
            field="body",
            limit=max_body_bytes,
        )
    try:
        raw = msgpack.unpackb(
            body,
            raw=False,
            use_list=False,
            ext_hook=_reject_ext,
            max_array_len=3 * MAX_BATCH_ITEMS,
            max_map_len=0,
        )
    except ProtocolError:
        raise
    except ValueError as exc:  # msgpack: past max_array_len (or a map), or not msgpack at all
        if "exceeds max_array_len" in str(exc):
            raise LimitExceeded(
                f"a {BATCH_TAG} holds at most {MAX_BATCH_ITEMS} tells",
                field="items",
                limit=MAX_BATCH_ITEMS,
            ) from None
        raise ProtocolError(f"undecodable {BATCH_TAG} body: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - msgpack raises ExtraData, StackError, TypeError, ...
        raise ProtocolError(f"undecodable {BATCH_TAG} body: {type(exc).__name__}: {exc}") from None
    if type(raw) is not tuple or not raw or len(raw) % 3:
        raise ProtocolError(f"a {BATCH_TAG} body is a non-empty array of id, kind, body triples")
    ids, kinds, bodies = raw[0::3], raw[1::3], raw[2::3]
    # Whole-column checks (C loops); the slow walk below only names the first bad item.
    if (
        set(map(type, ids)) != _BYTES
        or set(map(len, ids)) != _SIXTEEN
        or set(map(type, kinds)) != _STR
        or set(map(type, bodies)) != _BYTES
        or BATCH_TAG in kinds
    ):
        for i, (id_, kind, item) in enumerate(zip(ids, kinds, bodies, strict=True)):
            if type(id_) is not bytes or len(id_) != 16 or type(kind) is not str or type(item) is not bytes:
                raise ProtocolError(f"{BATCH_TAG} item {i}: id (bin 16), kind (str), body (bin) expected")
            if kind == BATCH_TAG:
                raise ProtocolError(f"{BATCH_TAG} item {i}: a batch inside a batch")
    return TellBatch(header, ids, kinds, bodies, route)


_BYTES = frozenset((bytes,))
_STR = frozenset((str,))
_SIXTEEN = frozenset((16,))


# ------------------------------------------------------------------------------------------------ body

Converter = Callable[[Any, int], Any]


_SCALARS: frozenset[type[Any]] = frozenset((int, float, bool, type(None), uuid.UUID))


def _share_budget(value: Any, fields: dict[type[Any], tuple[str, ...]], budget: int, depth: int) -> int:
    """``Registry.shareable``'s walk: what is left of ``budget`` (bytes the body could take at most) after
    ``value``, or -1 when a mutable container is inside it or the bound is passed."""
    cls = type(value)
    budget -= 16  # a bound on msgpack's own bytes for one value (and its map key)
    if cls is str:
        return budget - 4 * len(value)  # UTF-8: at most 4 bytes a character
    if cls is bytes:
        return budget - len(value)
    if cls is int:  # msgpack carries 64 bits: a bigger one is encoded, and fails as it would remotely
        return budget if -(1 << 63) <= value < (1 << 64) else -1
    if cls in _SCALARS or isinstance(value, enum.Enum):
        return budget
    if depth > 32 or budget < 0:
        return -1
    names = fields.get(cls)
    if names is not None:
        for name in names:
            budget = _share_budget(getattr(value, name), fields, budget - 4 * len(name), depth + 1)
            if budget < 0:
                return -1
        return budget
    if cls is tuple or cls is frozenset:
        for item in value:
            budget = _share_budget(item, fields, budget, depth + 1)
            if budget < 0:
                return -1
        return budget
    return -1


def _json_copy(value: Any, budget: int, depth: int) -> tuple[int, Any]:
    """A JSON value's copy for ``_copied``: what is left of ``budget`` (-1 past it, or for anything that is
    not JSON: a tuple, bytes, a message, a non-string key, an int past 64 bits) and the value with its lists
    and dicts built again. Anything refused is encoded instead, and arrives as it would remotely."""
    cls = type(value)
    budget -= 16
    if cls is str:
        return budget - 4 * len(value), value
    if cls is int:
        return (budget if -(1 << 63) <= value < (1 << 64) else -1), value
    if cls is float or cls is bool or value is None:
        return budget, value
    if depth > 32 or budget < 0:
        return -1, value
    # A string member is counted in place (what the call for it would count): most are strings.
    if cls is dict:
        copy: dict[str, Any] = {}
        for key, item in value.items():
            if type(key) is not str:  # the wire's maps have string keys
                return -1, value
            if type(item) is str:
                budget -= 32 + 4 * (len(key) + len(item))
                copy[key] = item
            else:
                budget, copy[key] = _json_copy(item, budget - 16 - 4 * len(key), depth + 1)
            if budget < 0:
                return -1, value
        return budget, copy
    if cls is list:
        items: list[Any] = []
        for item in value:
            if type(item) is str:
                budget -= 16 + 4 * len(item)
            else:
                budget, item = _json_copy(item, budget, depth + 1)
            if budget < 0:
                return -1, value
            items.append(item)
        return budget, items
    return -1, value


class _Copiers(dict[type[Any], Callable[[Any, "_Copiers", int, int], tuple[int, Any]]]):
    """A registry's compiled ``_copied`` step per message class, made on first use (``_copier``); ``fields``
    is the registry's table of each class's field names."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[type[Any], tuple[str, ...]]) -> None:
        super().__init__()
        self.fields = fields


def _copier(cls: type[Any], names: tuple[str, ...]) -> Callable[[Any, _Copiers, int, int], tuple[int, Any]]:
    """``_copied``'s step for one message class, written out field by field (as dataclasses writes an
    ``__init__``): the same arithmetic as the walk over ``names``, with each field's constant part (its
    name, its map entry) summed once. A string, bytes, None, bool, float, in-range int or UUID field is
    counted in place; a message goes to its own class's step, any other value through ``_copied``; a field
    whose value was copied makes the class build a new message, as decoding builds it."""
    const = 16 + sum(16 + 4 * len(name) for name in names)
    lines = [
        "def copy(_value_, _copiers_, _budget_, _depth_):",
        f"    _budget_ -= {const}",
        "    if _depth_ > 32 or _budget_ < 0:",
        "        return -1, _value_",
        "    _changed_ = False",
    ]
    for i, name in enumerate(names):
        v = f"_f{i}_"
        lines += [
            f"    {v} = _value_.{name}",
            f"    _t_ = type({v})",
            "    if _t_ is _str_:",
            f"        _budget_ -= 4 * len({v})",
            f"    elif {v} is None or _t_ is _bool_ or _t_ is _float_ or _t_ is _uuid_:",
            "        pass",
            "    elif _t_ is _int_:",
            f"        if not -9223372036854775808 <= {v} < 18446744073709551616:",
            "            return -1, _value_",
            "    elif _t_ is _bytes_:",
            f"        _budget_ -= len({v})",
            "    else:",
            "        _step_ = _copiers_.get(_t_)  # a message: its own step, past _copied's dispatch",
            "        if _step_ is not None:",
            f"            _budget_, _new_ = _step_({v}, _copiers_, _budget_ + 16, _depth_ + 1)",
            "        else:",
            f"            _budget_, _new_ = _copied_({v}, _copiers_, _budget_ + 16, _depth_ + 1)",
            "        if _budget_ < 0:",
            "            return -1, _value_",
            f"        if _new_ is not {v}:",
            f"            {v} = _new_",
            "            _changed_ = True",
        ]
    args = ", ".join(f"{name}=_f{i}_" for i, name in enumerate(names))
    lines += [
        "    if _budget_ < 0:",
        "        return -1, _value_",
        "    if not _changed_:",
        "        return _budget_, _value_",
        f"    return _budget_, _cls_({args})",
    ]
    scope: dict[str, Any] = {
        "_cls_": cls,
        "_copied_": _copied,
        "_str_": str,
        "_bool_": bool,
        "_float_": float,
        "_int_": int,
        "_uuid_": uuid.UUID,
        "_bytes_": bytes,
    }
    exec("\n".join(lines), scope)  # the source is made of the class's own field names only
    return scope["copy"]  # type: ignore[no-any-return]


def _copied(value: Any, copiers: _Copiers, budget: int, depth: int) -> tuple[int, Any]:
    """``Registry.local_copy``'s walk, the bound of ``_share_budget`` and the copy in one pass: what is left
    of ``budget`` (negative past it, or for a value the wire cannot carry as it is) and ``value`` with every
    JSON value in it copied (``_json_copy``). The immutable rest is shared; a message holding a copy is
    built anew through its class, as decoding builds it. A message is walked by its class's compiled step
    (``_copier``); the arithmetic is ``_share_budget``'s."""
    cls = type(value)
    step = copiers.get(cls)
    if step is not None:
        return step(value, copiers, budget, depth)
    if cls is dict or cls is list:
        return _json_copy(value, budget, depth)
    if cls is tuple:
        budget -= 16
        if depth > 32 or budget < 0:
            return -1, value
        members: list[Any] | None = None
        for index, item in enumerate(value):
            item_type = type(item)
            if item_type is str:  # what _share_budget counts for one, without the two calls
                budget -= 16 + 4 * len(item)
                new = item
            else:
                step = copiers.get(item_type)
                budget, new = (
                    _copied(item, copiers, budget, depth + 1)
                    if step is None
                    else step(item, copiers, budget, depth + 1)
                )
            if budget < 0:
                return -1, value
            if new is not item and members is None:
                members = list(value[:index])
            if members is not None:
                members.append(new)
        return budget, value if members is None else tuple(members)
    names = copiers.fields.get(cls)
    if names is not None:
        step = copiers[cls] = _copier(cls, names)
        return step(value, copiers, budget, depth)
    return _share_budget(value, copiers.fields, budget, depth), value  # scalars, frozensets: nothing to copy


class Registry:
    """The explicit table of message classes (tag -> class) and error classes a node speaks.

    Built from tuples the layers list by hand; nothing registers itself at import time. Each class's
    fields are compiled once into converters, so decoding is a table walk, not reflection per frame; on
    its first decode, each kind's walk is written out as a function of its own (``_decoder_of``).
    """

    def __init__(
        self,
        types_: Iterable[type[Any]],
        errors: ErrorRegistry | None = None,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.errors = errors or ErrorRegistry()
        self.max_body_bytes = max_body_bytes
        self._by_tag: dict[str, type[Any]] = {}
        self._fields: dict[type[Any], tuple[str, ...]] = {}
        self._copiers = _Copiers(self._fields)  # local_copy's compiled step per class, made on first use
        self._convert: dict[type[Any], tuple[tuple[str, Converter, bool], ...]] = {}
        # Per class: (name, the exact types a value of it passes unchanged, its converter) for each field
        # (see _build).
        self._plans: dict[type[Any], tuple[tuple[str, frozenset[type[Any]], Converter], ...]] = {}
        self._packers = threading.local()  # see encode_header
        self._bodies: dict[type[Any], Callable[[Any], dict[str, Any]]] = {}  # encode's, made on first use
        self._decoders: dict[str, Callable[[bytes], Any]] = {}  # decode's, per kind, made on first use
        for cls in types_:
            self._add(cls)
        for cls in self._by_tag.values():
            self._compile(cls)

    def _add(self, cls: type[Any]) -> None:
        tag = cls.__dict__.get("TAG")
        if not isinstance(tag, str) or not tag:
            raise TypeError(f"{cls.__name__} has no written-out TAG")
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        if not params.frozen:
            raise TypeError(f"{cls.__name__} must be frozen: pykka does not copy messages")
        known = self._by_tag.get(tag)
        if known is not None and known is not cls:
            raise ValueError(f"tag {tag!r} used by {known.__name__} and {cls.__name__}")
        self._by_tag[tag] = cls

    def extended(self, types_: Iterable[type[Any]], errors: Iterable[type[BusError]] = ()) -> Registry:
        return Registry(
            (*self._by_tag.values(), *types_),
            self.errors.extended(errors),
            max_body_bytes=self.max_body_bytes,
        )

    # -- introspection
    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(self._by_tag)

    @property
    def classes(self) -> tuple[type[Any], ...]:
        return tuple(self._by_tag.values())

    def schema_hash(self) -> str:
        """Changes whenever a tag, field name or field type changes: stamped into capture logs."""
        h = hashlib.sha256()
        for tag in sorted(self._by_tag):
            cls = self._by_tag[tag]
            hints = get_type_hints(cls, include_extras=True)
            h.update(tag.encode())
            for f in dataclasses.fields(cls):
                h.update(f"|{f.name}:{hints[f.name]!r}".encode())
        for name in self.errors.names():
            h.update(f"!{name}".encode())
        return h.hexdigest()[:16]

    def tag_of(self, message: Any) -> str:
        cls = type(message)
        if self._by_tag.get(getattr(cls, "TAG", "")) is not cls:
            raise TypeError(f"{cls.__name__} is not a registered message")
        return cls.TAG  # type: ignore[no-any-return]

    def cls_for(self, tag: str) -> type[Any] | None:
        return self._by_tag.get(tag)

    # -- encoding
    def _default(self, obj: Any) -> Any:
        cls = type(obj)
        if cls in self._fields:
            out = {TYPE_KEY: cls.TAG}
            for name in self._fields[cls]:
                out[name] = getattr(obj, name)
            return out
        if isinstance(obj, uuid.UUID):
            return msgpack.ExtType(UUID_EXT, obj.bytes)
        if isinstance(obj, enum.Enum):
            return obj.value
        if isinstance(obj, frozenset | set):
            return sorted(obj)
        raise TypeError(f"cannot put a {cls.__name__} on the wire")

    def encode(self, message: Any) -> bytes:
        """The body frame of ``message`` (its fields as a map; the tag travels in the header's kind)."""
        try:
            encode: Callable[[Any], bytes] = self._packers.encode
        except AttributeError:
            encode = self._packers.encode = self.encoder()
        return encode(message)

    def encoder(self) -> Callable[[Any], bytes]:
        """``encode`` for one thread to keep, with a packer of its own bound in rather than looked up per
        call (``encode`` keeps one per thread; a plain thread's lanes keep it, ``Node._hold``). Not for
        sharing between threads."""
        pack = msgpack.Packer(use_bin_type=True, default=self._default).pack
        bodies, body_of_new = self._bodies, self._body_of

        def encode(message: Any) -> bytes:
            cls = type(message)
            body_of = bodies.get(cls)
            if body_of is None:
                body_of = body_of_new(cls)
            frame: bytes = pack(body_of(message))
            if len(frame) > self.max_body_bytes:
                raise ProtocolError(f"{cls.TAG} body of {len(frame)} bytes exceeds {self.max_body_bytes}")
            return frame

        return encode

    def _body_of(self, cls: type[Any]) -> Callable[[Any], dict[str, Any]]:
        """``encode``'s map of one message class's fields, written out field by field (compiled on its first
        encode, as ``_copier`` is); a TypeError for a class that is not registered."""
        names = self._fields.get(cls)
        if names is None or self._by_tag.get(cls.TAG) is not cls:
            raise TypeError(f"{cls.__name__} is not a registered message")
        items = ", ".join(f"{name!r}: _m_.{name}" for name in names)
        scope: dict[str, Any] = {}
        exec(f"def body(_m_):\n    return {{{items}}}", scope)  # made of the class's own field names only
        body_of: Callable[[Any], dict[str, Any]] = scope["body"]
        self._bodies[cls] = body_of
        return body_of

    def shareable(self, message: Any) -> bool:
        """True when ``message`` may be handed to another thread of this process as it is, instead of as a
        body frame: a registered (so frozen) message whose every field value is immutable all the way down
        (scalars, bytes, UUIDs, enums, tuples and frozensets of such, registered messages of such). A dict
        or a list anywhere means no: the receiver would share a value the sender can still change. So does a
        message that might encode past ``max_body_bytes``: it is encoded, so it fails as it would remotely."""
        fields = self._fields
        return type(message) in fields and _share_budget(message, fields, self.max_body_bytes, 0) >= 0

    def local_copy(self, message: Any, *, moved: bool = False) -> Any:
        """What a receiver in this process may be handed instead of ``message``'s body frame, or None when
        it must be encoded: ``message`` itself when it is ``shareable``; when its only mutable parts are
        JSON values (lists, string-keyed dicts: a tool call's arguments), a copy sharing everything else,
        so neither side sees the other's changes, as if it had travelled; None past ``max_body_bytes`` or
        for any other mutable value, so it fails as it would remotely. Cheaper than an encode and a decode:
        nothing is packed, and only the JSON containers are built again.

        ``moved``: the sender will not read or change ``message``'s mutable values again and nobody else
        holds them, and they are as the wire carries them (they reached the sender copied or decoded, or it
        built them so): the receiver is the only one to use them from now on, so ``message`` itself is
        handed over, unwalked and so not bounded here (``Context.reply``, ``BusActor.ask``)."""
        if type(message) not in self._fields:
            return None
        if moved:
            return message
        left, copy = _copied(message, self._copiers, self.max_body_bytes, 0)
        return copy if left >= 0 else None

    # -- decoding
    def decode(self, kind: str, frame: bytes) -> Any:
        """Decode one untrusted body frame for header kind ``kind``; every failure is ProtocolError."""
        if len(frame) > self.max_body_bytes:
            raise ProtocolError(f"body of {len(frame)} bytes exceeds {self.max_body_bytes}")
        decoder = self._decoders.get(kind)
        if decoder is None:
            decoder = self._decoder_of(kind)
        return decoder(frame)

    def _decode_map(self, cls: type[Any], kind: str, raw: Any) -> Any:
        """``decode``'s full walk of an unpacked body: any shape, every check, every error message."""
        if not isinstance(raw, dict):
            raise ProtocolError(f"{kind} body is a {type(raw).__name__}, not a map")
        try:
            return self._build(cls, raw, 0)
        except _Bad as exc:
            raise ProtocolError(f"bad {kind} body: {exc}") from None

    def _decoder_of(self, kind: str) -> Callable[[bytes], Any]:
        """``decode``'s function for one kind, written out field by field (compiled on its first decode, as
        ``_body_of`` is): the body unpacked, and when it is a map of exactly the class's fields (what every
        kbus sender sends), each value checked by an exact-type test, converted only when that fails, and
        the message built from them; any other shape takes ``_decode_map``'s walk. Errors are ``_build``'s,
        word for word."""
        cls = self._by_tag.get(kind)
        if cls is None:
            raise ProtocolError(f"unknown message kind {kind!r}")
        plan = self._plans[cls]
        scope: dict[str, Any] = {
            "_unpackb_": msgpack.unpackb,
            "_ext_": _body_ext,
            "_PE_": ProtocolError,
            "_Bad_": _Bad,
            "_kind_": kind,
            "_slow_": functools.partial(self._decode_map, cls, kind),
            "_cls_": cls,
            "_new_": object.__new__,
        }
        names = [name for name, _, _ in plan]
        values = [f"_v{i}_" for i in range(len(plan))]
        lines = [
            "def decode(_f_):",
            "    try:",
            "        _r_ = _unpackb_(_f_, raw=False, strict_map_key=True, ext_hook=_ext_)",
            "    except _PE_:",
            "        raise",
            "    except Exception as _e_:  # msgpack documents non-UnpackException failures too",
            "        raise _PE_(f'undecodable {_kind_} body: {type(_e_).__name__}: {_e_}') from _e_",
            f"    if type(_r_) is not dict or len(_r_) != {len(plan)}:",
            "        return _slow_(_r_)",
        ]
        if values:  # as many keys as fields: all of them there, or a KeyError (subscripts: no calls)
            lines.append("    try:")
            lines += [f"        {v} = _r_[{name!r}]" for v, name in zip(values, names, strict=True)]
            lines += ["    except KeyError:", "        return _slow_(_r_)"]
        for i, (name, fast, conv) in enumerate(plan):
            scope[f"_c{i}_"] = conv
            scope[f"_t{i}_"] = next(iter(fast)) if len(fast) == 1 else fast
            convert = [
                "try:",
                f"    _v{i}_ = _c{i}_(_v{i}_, 1)",
                "except _Bad_ as _e_:",
                f"    raise _PE_(f'bad {{_kind_}} body: {name}: {{_e_}}') from None",
            ]
            if fast:  # a value of an exact type the converter returns unchanged skips the call
                lines.append(f"    if type(_v{i}_) {'is not' if len(fast) == 1 else 'not in'} _t{i}_:")
                lines += [f"        {line}" for line in convert]
            else:
                lines += [f"    {line}" for line in convert]
        slot_setters = direct_setters(cls)
        if slot_setters is not None:  # what the class's own __init__ would do with every field given
            lines.append("    _o_ = _new_(_cls_)")
            for i, setter in enumerate(slot_setters):
                scope[f"_s{i}_"] = setter
                lines.append(f"    _s{i}_(_o_, _v{i}_)")
            lines.append("    return _o_")
        else:
            arguments = ", ".join(f"{name}={v}" for name, v in zip(names, values, strict=True))
            lines += [
                "    try:",
                f"        return _cls_({arguments})",
                "    except (TypeError, ValueError) as _e_:  # __post_init__ validation of the class itself",
                "        raise _PE_(f'bad {_kind_} body: {_e_}') from None",
            ]
        exec("\n".join(lines), scope)  # made of the class's own field names only
        decoder: Callable[[bytes], Any] = scope["decode"]
        self._decoders[kind] = decoder
        return decoder

    def _build(self, cls: type[Any], raw: dict[str, Any], depth: int) -> Any:
        plan = self._plans.get(cls)
        if plan is not None and len(raw) == len(plan):
            # Every field present and no other (the shape every kbus sender sends): a value of an exact
            # type its converter returns unchanged skips the call, and the map itself is the arguments
            # (the decoder's own dict: converted values replace their raw ones). Else the full walk.
            for name, fast, conv in plan:
                value = raw.get(name, _ABSENT)
                if type(value) in fast:
                    continue
                if value is _ABSENT:
                    break
                try:
                    raw[name] = conv(value, depth + 1)
                except _Bad as exc:
                    raise _Bad(f"{name}: {exc}") from None
            else:
                try:
                    return cls(**raw)
                except (TypeError, ValueError) as exc:  # __post_init__ validation of the class itself
                    raise _Bad(str(exc)) from None
        kwargs: dict[str, Any] = {}
        seen = 0
        for name, conv, required in self._convert[cls]:
            if name in raw:
                seen += 1
                try:
                    kwargs[name] = conv(raw[name], depth + 1)
                except _Bad as exc:
                    raise _Bad(f"{name}: {exc}") from None
            elif required:
                raise _Bad(f"missing field {name!r}")
        if seen != len(raw) - (TYPE_KEY in raw):
            extra = sorted(str(k) for k in raw.keys() - set(self._fields[cls]) - {TYPE_KEY})
            # Named, but bounded: a body of many unknown names must not make an error larger than itself.
            shown = ", ".join(repr(cut_text(k, 40)) for k in extra[:_SHOWN_NAMES])
            more = f" and {len(extra) - _SHOWN_NAMES} more" if len(extra) > _SHOWN_NAMES else ""
            raise _Bad(f"unknown fields [{shown}]{more}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:  # __post_init__ validation of the class itself
            raise _Bad(str(exc)) from None

    def _compile(self, cls: type[Any]) -> None:
        hints = get_type_hints(cls, include_extras=True)
        fields = tuple(f for f in dataclasses.fields(cls) if f.init)
        self._fields[cls] = tuple(f.name for f in fields)
        self._convert[cls] = tuple(
            (
                f.name,
                self._converter(hints[f.name]),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in fields
        )
        self._plans[cls] = tuple(
            (f.name, self._fast_types(hints[f.name]), conv)
            for f, (_, conv, _) in zip(fields, self._convert[cls], strict=True)
        )

    def _fast_types(self, hint: Any) -> frozenset[type[Any]]:
        """The exact types whose values the converter for ``hint`` returns as they are (possibly none)."""
        origin = get_origin(hint)
        if origin is Annotated:
            return _ANY_FAST if "kbus.json" in hint.__metadata__ else self._fast_types(get_args(hint)[0])
        if hint is Any or hint is object:
            return _ANY_FAST
        if hint is type(None) or hint in (str, bytes, bool, int, float, uuid.UUID):
            return frozenset((hint,))
        if origin in (Union, types.UnionType):
            options = [self._fast_types(a) for a in get_args(hint)]
            if not all(options):  # an option that converts (an enum, a nested message): always convert
                return frozenset()
            fast = frozenset().union(*options)
            return fast - {int} if float in fast else fast  # `float | int` turns an int into a float
        return frozenset()

    def _converter(self, hint: Any) -> Converter:
        origin = get_origin(hint)
        if origin is Annotated:
            if "kbus.json" in hint.__metadata__:
                return self._any_value
            return self._converter(get_args(hint)[0])
        if hint is Any or hint is object:
            return self._any_value
        if hint is type(None):
            return _expect_none
        if hint in (str, bytes, bool):
            return _exact(hint)
        if hint is int:
            return _int
        if hint is float:
            return _float
        if hint is uuid.UUID:
            return _exact(uuid.UUID)
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum(hint)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            return self._nested(hint)
        if origin in (Union, types.UnionType):
            return _union(tuple(self._converter(a) for a in get_args(hint)))
        if origin is typing.Literal:
            return _literal(frozenset(get_args(hint)))
        if origin is tuple:
            args = get_args(hint)
            if len(args) == 2 and args[1] is Ellipsis:
                return _tuple_of(self._converter(args[0]))
            return _fixed_tuple(tuple(self._converter(a) for a in args))
        if origin in (dict, Mapping):
            key, value = get_args(hint) or (str, Any)
            if key is not str:
                raise TypeError(f"only str-keyed maps travel: {hint!r}")
            return _dict_of(self._converter(value))
        if origin is list:
            (item,) = get_args(hint) or (Any,)
            return _list_of(self._converter(item))
        raise TypeError(f"no wire form for field type {hint!r}")

    def _nested(self, cls: type[Any]) -> Converter:
        tag = getattr(cls, "TAG", None)

        def convert(value: Any, depth: int) -> Any:
            if depth > MAX_DEPTH:
                raise _Bad("nested too deep")
            if isinstance(value, cls):  # already built (an Any-typed parent decoded it)
                return value
            if not isinstance(value, dict) or value.get(TYPE_KEY) != tag or cls not in self._convert:
                raise _Bad(f"expected a {cls.__name__}")
            return self._build(cls, value, depth)

        return convert

    def _any_value(self, value: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _Bad("nested too deep")
        if value is None or isinstance(value, str | bytes | bool | int | uuid.UUID):
            return value
        if isinstance(value, float):
            return value
        if isinstance(value, list | tuple):
            return [self._any_value(v, depth + 1) for v in value]
        if isinstance(value, dict):
            tag = value.get(TYPE_KEY)
            if isinstance(tag, str) and tag in self._by_tag:
                try:
                    return self._build(self._by_tag[tag], value, depth + 1)
                except _Bad:
                    pass  # plain JSON that happens to carry a "$t" key: kept as the map it is
            if not all(type(k) is str for k in value):  # JsonValue maps are str-keyed
                raise _Bad("map keys must be str")
            return {k: self._any_value(v, depth + 1) for k, v in value.items()}
        raise _Bad(f"unexpected {type(value).__name__}")

    # -- errors on the wire
    def error_reply(self, exc: BaseException, *, depth: int = 0) -> Any:
        """An ``ErrorReply`` body for ``exc``, with its cause chain (bounded: 5 levels, each message cut to
        ``MAX_ERROR_TEXT`` characters with its original size noted)."""
        cause_exc = exc.__cause__
        cause = self.error_reply(cause_exc, depth=depth + 1) if cause_exc is not None and depth < 4 else None
        if isinstance(exc, BusError):
            wire = exc.WIRE if type(exc) in self.errors else RemoteError.WIRE
            fields = exc.wire_fields()
            if wire == RemoteError.WIRE and type(exc) is not RemoteError:
                fields = {**fields, "wire_name": exc.WIRE}
            return ErrorReply(error=wire, message=cut_text(exc.message), fields=fields, cause=cause)
        return ErrorReply(
            error=HandlerError.WIRE,
            message=cut_text(f"{type(exc).__name__}: {exc}"),
            fields={"exc_type": type(exc).__name__},
            cause=cause,
            exc_type=type(exc).__name__,
        )

    def encode_error(self, exc: BaseException) -> bytes:
        """The encoded ``ErrorReply`` body for ``exc``; never raises.

        An error whose fields cannot travel (too large, or not encodable) goes without them and without its
        cause, its message saying so; failing that, a bare ``ProtocolError`` naming the error's class.
        """
        try:
            return self.encode(self.error_reply(exc))
        except Exception as first:  # noqa: BLE001 - any failure here falls back to a smaller error
            reason = cut_text(f"{type(first).__name__}: {first}", 200)
        try:
            full = self.error_reply(exc)
            slim = ErrorReply(
                error=full.error,
                message=cut_text(f"{full.message} [error fields dropped: {reason}]"),
                exc_type=full.exc_type,
            )
            return self.encode(slim)
        except Exception:  # noqa: BLE001 - the last resort below cannot fail
            bare = ErrorReply(
                error=ProtocolError.WIRE, message=f"a {type(exc).__name__} could not be encoded"
            )
            return self.encode(bare)

    def rebuild_error(self, reply: Any) -> BusError:
        """The exception an ``ErrorReply`` describes, as the same class, with ``__cause__`` restored."""
        cls = self.errors.lookup(reply.error)
        err: BusError
        try:
            if cls is None:
                # The wire name wins over a "wire_name" field; a field named "message" is malformed.
                err = RemoteError(reply.message, **{**reply.fields, "wire_name": reply.error})
            else:
                err = cls.from_wire(reply.message, reply.fields)
        except (TypeError, ValueError, KeyError) as exc:
            err = ProtocolError(f"malformed {reply.error} error: {exc}")
        if reply.cause is not None:
            err.__cause__ = self.rebuild_error(reply.cause)
        return err


_ABSENT = object()
_ANY_FAST: frozenset[type[Any]] = frozenset((type(None), str, bytes, bool, int, float))


def _exact(kind: type) -> Converter:
    def convert(value: Any, depth: int) -> Any:
        if type(value) is not kind:
            raise _Bad(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return convert


def _int(value: Any, depth: int) -> Any:
    if type(value) is not int:
        raise _Bad(f"expected int, got {type(value).__name__}")
    return value


def _float(value: Any, depth: int) -> Any:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise _Bad(f"expected float, got {type(value).__name__}")


def _expect_none(value: Any, depth: int) -> Any:
    if value is not None:
        raise _Bad(f"expected nil, got {type(value).__name__}")
    return None


def _enum(cls: type[enum.Enum]) -> Converter:
    # Exact wire types of the members' values: True or 1.0 must not pass for a member whose value is 1.
    value_types = frozenset(type(m.value) for m in cls)

    def convert(value: Any, depth: int) -> Any:
        if type(value) not in value_types:
            raise _Bad(f"{value!r} is not a {cls.__name__}")
        try:
            return cls(value)
        except ValueError:
            raise _Bad(f"{value!r} is not a {cls.__name__}") from None

    return convert


def _literal(allowed: frozenset[Any]) -> Converter:
    def convert(value: Any, depth: int) -> Any:
        try:
            known = value in allowed
        except TypeError:  # an array or map off the wire is unhashable: not one of the literals
            known = False
        if not known or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed):
            raise _Bad(f"{value!r} is not one of {sorted(map(repr, allowed))}")
        return value

    return convert


def _union(options: tuple[Converter, ...]) -> Converter:
    def convert(value: Any, depth: int) -> Any:
        reasons = []
        for option in options:
            try:
                return option(value, depth)
            except _Bad as exc:
                reasons.append(str(exc))
        raise _Bad(" / ".join(reasons))

    return convert


def _tuple_of(item: Converter) -> Converter:
    def convert(value: Any, depth: int) -> Any:
        if not isinstance(value, list | tuple):
            raise _Bad(f"expected an array, got {type(value).__name__}")
        if depth > MAX_DEPTH:
            raise _Bad("nested too deep")
        return tuple(item(v, depth + 1) for v in value)

    return convert


def _list_of(item: Converter) -> Converter:
    def convert(value: Any, depth: int) -> Any:
        return list(_tuple_of(item)(value, depth))

    return convert


def _fixed_tuple(items: tuple[Converter, ...]) -> Converter:
    def convert(value: Any, depth: int) -> Any:
        if not isinstance(value, list | tuple) or len(value) != len(items):
            raise _Bad(f"expected an array of {len(items)}")
        return tuple(c(v, depth + 1) for c, v in zip(items, value, strict=True))

    return convert


def _dict_of(item: Converter) -> Converter:
    def convert(value: Any, depth: int) -> Any:
        if not isinstance(value, dict):
            raise _Bad(f"expected a map, got {type(value).__name__}")
        if depth > MAX_DEPTH:
            raise _Bad("nested too deep")
        if not all(type(k) is str for k in value):  # strict_map_key still lets bytes keys through
            raise _Bad("map keys must be str")
        return {k: item(v, depth + 1) for k, v in value.items()}

    return convert


def decode_for_display(frame: bytes, *, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """Any msgpack frame as plain data, for people reading logs: bounded, never executes anything."""
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {max_bytes}")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=False, ext_hook=_body_ext)
    except Exception as exc:
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc
