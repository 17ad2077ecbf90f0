"""Node settings: frozen dataclasses read from TOML, then from KBUS_* environment variables."""

import dataclasses
import difflib
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path, PurePath
from types import MappingProxyType, NoneType, UnionType
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    Literal,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")

DEFAULT_CONFIG = Path(__file__).with_name("default.toml")


class ConfigError(ValueError):
    """A bad setting.

    `source` is a file path, '<env>', '<mapping>' or '<python>' (a dataclass built directly);
    `key` is dotted ('node.bind[1]', 'peers[0].endpoint') or a variable name (KBUS_NODE_NAME);
    `expected` is short text ('a list of strings'); `got` is what was found: a value's repr cut
    to 80 characters, or a short phrase such as 'nothing (the key is required)'.
    """

    def __init__(self, source: str, key: str, expected: str, got: str) -> None:
        self.source = source
        self.key = key
        self.expected = expected
        self.got = got
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: expected {expected}, got {got}")

    def __reduce__(self) -> tuple[type["ConfigError"], tuple[str, str, str, str]]:
        # The default would call __init__ with the message alone.
        return (type(self), (self.source, self.key, self.expected, self.got))


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True, slots=True)
class _At:
    """Where a value is: the error location, and the directory relative paths resolve against."""

    source: str
    key: str = ""
    base: Path | None = None  # None: relative paths stay as written

    def child(self, name: str) -> "_At":
        part = name if _BARE_KEY.fullmatch(name) else '"' + name.replace('"', '\\"') + '"'
        return _At(self.source, f"{self.key}.{part}" if self.key else part, self.base)

    def item(self, index: int) -> "_At":
        return _At(self.source, f"{self.key}[{index}]", self.base)

    def error(self, expected: str, got: str) -> ConfigError:
        return ConfigError(self.source, self.key, expected, got)

    def bad(self, expected: str, value: object) -> ConfigError:
        return self.error(expected, _show(value))


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True, slots=True)
class Rule:
    """A constraint on an already-converted value, attached as `Annotated[T, rule]`.

    `expected` is what an error says was wanted. `rebase`, if set, rewrites a value that is
    relative to the directory a setting was read from (as Path values are).
    """

    expected: str
    ok: Callable[[Any], bool]
    rebase: Callable[[Any, Path], Any] | None = None
    # Check the value as written (before a relative path is joined to the file's folder).
    as_written: bool = False


_NAME = r"[A-Za-z0-9_.-]+"
_NODE_NAME = re.compile(_NAME)
_ACTOR_NAME = re.compile(rf"{_NAME}(?:/{_NAME})?")
_SCHEMES = ("inproc://", "ipc://", "tcp://")
_Z85_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85 = {c: i for i, c in enumerate(_Z85_ALPHABET)}


def _is_name(text: str, pattern: re.Pattern[str]) -> bool:
    # '.' and '..' match the pattern but would read as directories wherever a name meets a path.
    return pattern.fullmatch(text) is not None and all(p.strip(".") for p in text.split("/"))


def _is_z85_key(text: str) -> bool:
    if len(text) != 40 or any(c not in _Z85 for c in text):
        return False
    # Each 5 characters encode 32 bits; larger groups are not a key any peer could hold.
    for start in range(0, 40, 5):
        group = 0
        for c in text[start : start + 5]:
            group = group * 85 + _Z85[c]
        if group >= 1 << 32:
            return False
    return True


def _rebase_ipc(endpoint: str, base: Path) -> str:
    # zmq reads a relative ipc path against the process's cwd; a file's endpoints must not
    # depend on where the node was started. '@' is Linux's abstract namespace, '*' a fresh name.
    path = endpoint.removeprefix("ipc://")
    if path == endpoint or path.startswith(("/", "@")) or path == "*":
        return endpoint
    return f"ipc://{base / path}"


NODE_NAME = Rule("a node name of letters, digits, '_', '.' and '-'", lambda v: _is_name(v, _NODE_NAME))
ACTOR_NAME = Rule(
    "an actor name of letters, digits, '_', '.', '-', with at most one '/'",
    lambda v: _is_name(v, _ACTOR_NAME),
)


def _no_parent_step(path: object) -> bool:
    # A relative path stays inside the folder it is read against; an absolute one names its place outright.
    return ".." not in PurePath(str(path)).parts


ENDPOINT = Rule(
    "an endpoint starting with inproc://, ipc:// or tcp://",
    lambda v: any(v.startswith(s) and len(v) > len(s) for s in _SCHEMES),
    rebase=_rebase_ipc,
)
# Checked before ENDPOINT (which describes the field): an ipc path names a folder, like any path.
IPC_NO_PARENT = Rule(
    "an ipc path without '..'", lambda v: not v.startswith("ipc://") or _no_parent_step(v[6:])
)
NO_PARENT = Rule("a path without '..'", _no_parent_step, as_written=True)
Z85_KEY = Rule("a Z85 public key (40 characters)", _is_z85_key)
NON_EMPTY = Rule("a non-empty string", lambda v: v != "")
POSITIVE = Rule("an integer > 0", lambda v: v > 0)
NON_NEGATIVE = Rule("an integer >= 0", lambda v: v >= 0)
HOST_COUNT = Rule("an integer from 0 to 256 (0: an own thread per actor)", lambda v: 0 <= v <= 256)
SECONDS = Rule("a finite number of seconds > 0", lambda v: math.isfinite(v) and v > 0)


def _read_public_key(path: Path, at: _At) -> str:
    """The key in a zmq.auth certificate's `public-key = "..."` line (zmq is not imported here)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        raise at.error("a readable zmq public key file", f"{str(path)!r} ({exc})") from exc
    for line in text.splitlines():
        name, eq, value = line.partition("=")
        if eq and name.strip() == "public-key":
            return value.strip().strip("\"'")
    raise at.error('a zmq key file with a line public-key = "..."', _show(str(path)))


@dataclass(frozen=True, slots=True)
class _Toml:
    """How a field is written in TOML, where that is more than `name = value`."""

    file_key: str = ""  # the value may instead be read from the file this key names
    read: Callable[[Path, _At], str] | None = None
    keyed_by: str = ""  # a table of tables; each table's own name fills this field
    rest: Literal["", "any", "tables"] = ""  # takes the keys no other field claims
    in_file: bool = True  # False: never read from TOML (Settings.source)


_TOML = "kbus.toml"  # the dataclasses.field metadata key
_NONE: Mapping[str, Any] = MappingProxyType({})
_PLAIN = _Toml()
_PUBLIC_KEY = {_TOML: _Toml(file_key="public_key_file", read=_read_public_key)}


# --- the converter: one function over type hints, so a section is just a dataclass ---


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


_WORDS: dict[object, tuple[str, str]] = {
    str: ("a string", "strings"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    bool: ("true or false", "booleans"),
    Path: ("a path", "paths"),
}


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, UnionType)


def _optional_inner(tp: Any) -> Any:
    args = [a for a in get_args(tp) if a is not NoneType]
    if len(args) != 1 or len(get_args(tp)) != 2:
        raise TypeError(f"config supports only `X | None` unions, not {tp!r}")
    return args[0]


def _tuple_item(tp: Any) -> Any:
    args = get_args(tp)
    if len(args) != 2 or args[1] is not Ellipsis:
        raise TypeError(f"config supports only `tuple[X, ...]`, not {tp!r}")
    return args[0]


def _bare(tp: Any) -> Any:
    """`tp` without Annotated and `| None` wrappers."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
        elif _is_union(tp):
            tp = _optional_inner(tp)
        else:
            return tp


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Annotated:
        rules = [m for m in get_args(tp)[1:] if isinstance(m, Rule)]
        return rules[-1].expected if rules else _describe(get_args(tp)[0])
    if _is_union(tp):
        return _describe(_optional_inner(tp))
    if origin is tuple:
        item = _bare(_tuple_item(tp))
        plural = "tables" if _is_dataclass_type(item) else _WORDS.get(item, ("", "values"))[1]
        return f"a list of {plural}"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is Mapping or _is_dataclass_type(tp):
        return "a table"
    return _WORDS[tp][0]


def _convert(tp: Any, value: object, at: _At, expected: str = "") -> object:
    """`value` as the type hint `tp` says, checked; ConfigError at `at` if it is not."""
    want = expected or _describe(tp)
    origin = get_origin(tp)
    if origin is Annotated:
        inner, *meta = get_args(tp)
        rules = [m for m in meta if isinstance(m, Rule)]
        out = _convert(inner, value, at, rules[-1].expected if rules else expected)
        for rule in rules:
            if not rule.ok(value if rule.as_written else out):
                raise at.bad(rule.expected, value)
            if rule.rebase is not None and at.base is not None:
                out = rule.rebase(out, at.base)
        return out
    if _is_union(tp):
        inner = _optional_inner(tp)
        # TOML has no null, so `false` switches an optional setting off.
        if value is None or (value is False and _bare(inner) is not bool):
            return None
        return _convert(inner, value, at, expected)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise at.bad(want, value)
        item = _tuple_item(tp)
        return tuple(_convert(item, v, at.item(i)) for i, v in enumerate(value))
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in get_args(tp)):
            return value
        raise at.bad(want, value)
    if origin is Mapping:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise at.bad(want, value)
        return dict(value)
    if _is_dataclass_type(tp):
        return _build(tp, value, at)
    if tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is Path:
        if isinstance(value, PurePath) or (isinstance(value, str) and value):
            try:
                # '~/x' would otherwise become a directory named '~' next to the file.
                path = Path(value).expanduser()
            except RuntimeError as exc:  # no home directory to expand '~' to
                raise at.bad("a path whose '~' names a known home directory", value) from exc
            return at.base / path if at.base is not None and not path.is_absolute() else path
    else:
        raise TypeError(f"config cannot convert to {tp!r}")  # a bad dataclass declaration
    raise at.bad(want, value)


def _build(cls: type[_D], table: object, at: _At, preset: Mapping[str, object] = _NONE) -> _D:
    """A `cls` from a TOML table; `preset` fills fields the table may not name."""
    if isinstance(table, cls):
        return table
    if not isinstance(table, Mapping) or not all(isinstance(k, str) for k in table):
        raise at.bad("a table", table)
    hints = _hints(cls)
    kwargs: dict[str, object] = {}
    claimed: list[str] = []
    rest: tuple[str, _Toml] | None = None
    for f in dataclasses.fields(cls):
        toml: _Toml = f.metadata.get(_TOML, _PLAIN)
        hint, here = hints[f.name], at.child(f.name)
        if f.name in preset:
            kwargs[f.name] = _convert(hint, preset[f.name], at)
            continue
        if not toml.in_file:
            continue
        if toml.rest:
            rest = (f.name, toml)
            continue
        claimed += [f.name, toml.file_key] if toml.file_key else [f.name]
        if toml.file_key in table and toml.read is not None:
            there = at.child(toml.file_key)
            if f.name in table:
                raise here.error(f"{f.name} or {toml.file_key}, not both", "both")
            path = _convert(Path, table[toml.file_key], there)
            assert isinstance(path, Path)
            kwargs[f.name] = _convert(hint, toml.read(path, there), there)
        elif f.name in table:
            value = table[f.name]
            if toml.keyed_by:
                kwargs[f.name] = _keyed(hint, value, here, toml.keyed_by)
            else:
                kwargs[f.name] = _convert(hint, value, here)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            also = f" (as {f.name} or {toml.file_key})" if toml.file_key else ""
            raise here.error(_describe(hint) + also, "nothing (the key is required)")
        elif isinstance(f.default, PurePath) and at.base is not None:
            # A default path lives next to the file, as any path written in it would.
            kwargs[f.name] = _convert(hint, f.default, here)
    unknown = [k for k in table if k not in claimed]
    if rest is not None:
        kwargs[rest[0]] = _rest(table, unknown, claimed, at, tables_only=rest[1].rest == "tables")
    elif unknown:
        close = difflib.get_close_matches(unknown[0], claimed, n=1)
        hint_text = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(sorted(claimed))
        raise at.child(unknown[0]).error(
            f"a known key of {at.key or 'the top level'} ({known}{hint_text})", "an unknown key"
        )
    return cls(**kwargs)


def _keyed(tp: Any, value: object, at: _At, key_field: str) -> tuple[object, ...]:
    """A table of tables as a tuple, each table's own name filling `key_field`."""
    if not isinstance(value, Mapping):
        raise at.bad("a table of tables", value)
    item, out = _tuple_item(tp), []
    for name, table in value.items():
        here = at.child(str(name))
        if isinstance(table, Mapping) and key_field in table:
            raise here.child(key_field).bad(
                f"no {key_field!r} key: the table's own name is its {key_field}", table[key_field]
            )
        out.append(_build(item, table, here, preset={key_field: name}))
    return tuple(out)


def _rest(
    table: Mapping[Any, object],
    unknown: list[str],
    claimed: list[str],
    at: _At,
    *,
    tables_only: bool,
) -> dict[str, object]:
    if not tables_only:
        return {k: table[k] for k in unknown}
    for k in unknown:
        # Unknown sections are kept for later versions, but a misspelt known one must not be.
        close = difflib.get_close_matches(k, claimed, n=1, cutoff=0.8)
        if close:
            raise at.child(k).error(f"a known section (did you mean {close[0]!r}?)", "an unknown section")
        value = table[k]
        if not isinstance(value, Mapping) and not (
            isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value)
        ):
            raise at.child(k).bad("a table (an unknown top-level key must be a section)", value)
    return {k: table[k] for k in unknown}


def _normalise(obj: "DataclassInstance") -> None:
    """Check an instance as a loaded one is checked, and settle its types (list -> tuple, ...).

    Instances made by the loader pass at once; this keeps the invariants for direct callers too.
    """
    at = _At("<python>", type(obj).__name__)
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        settled = _convert(hints[f.name], getattr(obj, f.name), at.child(f.name))
        # Frozen: __post_init__ is the one place a field may still be set.
        object.__setattr__(obj, f.name, settled)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSettings:
    """One process's bus endpoint.

    Invariants: `name` matches [A-Za-z0-9_.-]+; every `bind` endpoint starts with inproc://,
    ipc:// or tcp://; no '..' in an ipc path, `data_dir` or `capture` (a relative path stays in the
    config file's folder); sizes are > 0, heartbeats and high-water marks >= 0 (0 = off/unlimited);
    `request_timeout` is finite and > 0; `hosts` and `tool_hosts` are 0..256.
    """

    name: Annotated[str, NODE_NAME]
    bind: tuple[Annotated[str, IPC_NO_PARENT, ENDPOINT], ...] = ()
    data_dir: Annotated[Path, NO_PARENT] = Path(".kbus")
    capture: Annotated[Path, NO_PARENT] | None = None  # the .buslog every envelope is recorded to; None = off
    # Unset in a file: large enough for its models' largest context window (from_mapping, frame_bytes_for).
    max_frame_bytes: Annotated[int, POSITIVE] = 1 << 20
    max_header_bytes: Annotated[int, POSITIVE] = 8192
    request_timeout: Annotated[float, SECONDS] = 30.0
    heartbeat_ivl_ms: Annotated[int, NON_NEGATIVE] = 1000  # ZMTP heartbeats on tcp; 0 = off
    heartbeat_timeout_ms: Annotated[int, NON_NEGATIVE] = 5000
    sndhwm: Annotated[int, NON_NEGATIVE] = 1000
    rcvhwm: Annotated[int, NON_NEGATIVE] = 1000
    # Hosting actors (threads) the node's conversations, its bare session and subagent runs and its Router
    # are placed on (one: they never block, and more threads only add hand-offs between them), and the
    # conversations' tool hosts on; 0 = a thread for each, as before pools.
    hosts: Annotated[int, HOST_COUNT] = 1
    tool_hosts: Annotated[int, HOST_COUNT] = 4
    # The process's bus threads wait for their next message on one CPU, and its ZeroMQ I/O threads run there
    # (transport/affinity.py): a hand-off between them wakes no other CPU. Process-wide.
    colocate_waits: bool = True

    def __post_init__(self) -> None:
        _normalise(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class AllowedClient:
    """A client key this node accepts, and the node name that key may speak as.

    Invariant: `public_key` is a valid 40-character Z85 key. TOML gives it as `public_key`
    or as `public_key_file`, a zmq.auth certificate.
    """

    node: Annotated[str, NODE_NAME]
    public_key: Annotated[str, Z85_KEY] = field(metadata=_PUBLIC_KEY)

    def __post_init__(self) -> None:
        _normalise(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class SecuritySettings:
    """How tcp:// is secured. Under "curve" a tcp bind or tcp peer needs `secret_key_file`
    (checked on Settings: fail closed); "plain-insecure-for-benchmarks" turns CURVE off, and only
    the config file can say so (KBUS_SECURITY_MODE may only turn CURVE on)."""

    mode: Literal["curve", "plain-insecure-for-benchmarks"] = "curve"
    secret_key_file: Path | None = None  # zmq.auth secret certificate of this node
    allow: tuple[AllowedClient, ...] = ()

    def __post_init__(self) -> None:
        _normalise(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSettings:
    """Another node this one sends to. Invariants: `name` is a node name, `endpoint` has a
    known scheme, `public_key` (the server's, for tcp) is None or a valid Z85 key."""

    name: Annotated[str, NODE_NAME]
    endpoint: Annotated[str, ENDPOINT]
    public_key: Annotated[str, Z85_KEY] | None = field(default=None, metadata=_PUBLIC_KEY)

    def __post_init__(self) -> None:
        _normalise(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class ActorSpec:
    """An actor the node starts at `<node>/<name>`.

    Invariants: `name` is one or two name parts joined by '/'; `type` is non-empty. In TOML it is
    the table [actors.<name>]; every key but `type` lands in `options`, unconverted.
    """

    name: Annotated[str, ACTOR_NAME]
    type: Annotated[str, NON_EMPTY]
    options: Mapping[str, object] = field(default_factory=dict, metadata={_TOML: _Toml(rest="any")})

    def __post_init__(self) -> None:
        _normalise(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Everything a node reads at start-up.

    Invariants: peer and actor names are unique; under CURVE a tcp bind or tcp peer has a
    `security.secret_key_file` and every tcp peer a public key. `extra` keeps top-level tables
    this version does not know (later sections), untouched. A new section is a new field here.
    """

    node: NodeSettings
    security: SecuritySettings = SecuritySettings()
    peers: tuple[PeerSettings, ...] = ()
    actors: tuple[ActorSpec, ...] = field(default=(), metadata={_TOML: _Toml(keyed_by="name")})
    source: str = field(default="<mapping>", metadata={_TOML: _Toml(in_file=False)})
    extra: Mapping[str, object] = field(default_factory=dict, metadata={_TOML: _Toml(rest="tables")})

    def __post_init__(self) -> None:
        _normalise(self)
        _fail_closed(self)


def _fail_closed(settings: Settings) -> None:
    source = settings.source
    for section, names in (
        ("peers", [p.name for p in settings.peers]),
        ("actors", [a.name for a in settings.actors]),
    ):
        for i, name in enumerate(names):
            if name in names[:i]:
                expected = f"a name no other entry of {section} uses"
                raise ConfigError(source, f"{section}[{i}].name", expected, _show(name))
    if settings.security.mode != "curve":
        return
    tcp_bind = any(b.startswith("tcp://") for b in settings.node.bind)
    tcp_peers = [(i, p) for i, p in enumerate(settings.peers) if p.endpoint.startswith("tcp://")]
    if settings.security.secret_key_file is None and (tcp_bind or tcp_peers):
        which = "bind" if tcp_bind else "peer"
        expected = f"a path (a tcp {which} with CURVE needs security.secret_key_file)"
        raise ConfigError(source, "security.secret_key_file", expected, "nothing")
    for i, peer in tcp_peers:
        if peer.public_key is None:
            expected = "the server's key as public_key or public_key_file (a tcp peer with CURVE)"
            raise ConfigError(source, f"peers[{i}].public_key", expected, "nothing")


# --- environment: KBUS_<SECTION>_<KEY> for the scalar and list fields of each section ---

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _from_text(tp: Any, text: str) -> object:
    """An environment string as TOML would have given it; text that does not parse is left
    as it is, for _convert to reject with the field's own expectation."""
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if _is_union(tp):
        # The environment's `false`: an empty value or the word itself.
        if text.strip().lower() in ("", "false") and _bare(tp) is not bool:
            return None
        return _from_text(_optional_inner(tp), text)
    if get_origin(tp) is tuple:
        item = _tuple_item(tp)
        return [_from_text(item, part.strip()) for part in text.split(",") if part.strip()]
    try:
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        return text
    if tp is bool and text.strip().lower() in _TRUE | _FALSE:
        return text.strip().lower() in _TRUE
    return text


def _env_settable(tp: Any) -> bool:
    tp = _bare(tp)
    if get_origin(tp) is tuple:
        tp = _bare(_tuple_item(tp))
    return tp in _WORDS or get_origin(tp) is Literal


@cache
def _env_sections() -> dict[str, dict[str, Any]]:
    """{section: {field: type hint}} for the fields an environment variable may set."""
    sections: dict[str, dict[str, Any]] = {}
    for name, hint in _hints(Settings).items():
        if _is_dataclass_type(hint):
            sections[name] = {
                f.name: _hints(hint)[f.name]
                for f in dataclasses.fields(hint)
                if f.metadata.get(_TOML, _PLAIN) == _PLAIN and _env_settable(_hints(hint)[f.name])
            }
    return sections


def _env_overrides(env: Mapping[str, str]) -> dict[str, dict[str, object]]:
    """Typed values from KBUS_<SECTION>_<KEY> variables, by section and key."""
    out: dict[str, dict[str, object]] = {}
    for var in sorted(v for v in env if v.startswith("KBUS_")):
        for section, settable in _env_sections().items():
            prefix = f"KBUS_{section.upper()}_"
            if not var.startswith(prefix):
                continue
            # Paths and ipc endpoints in the environment are relative to the working directory.
            at = _At("<env>", var, Path.cwd())
            key = var.removeprefix(prefix).lower()
            if key not in settable:
                known = ", ".join(prefix + k.upper() for k in settable)
                raise at.error(f"one of {known}", "an unknown variable")
            out.setdefault(section, {})[key] = _convert(
                settable[key], _from_text(settable[key], env[var]), at
            )
    return out


# --- the public entry points ---


def load(path: str | os.PathLike[str], env: Mapping[str, str] = os.environ) -> Settings:
    """Read a node's TOML file, then let KBUS_* variables in `env` override it."""
    source, file = os.fspath(path), Path(path)
    try:
        with file.open("rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(source, "", "a readable TOML file", exc.strerror or repr(exc)) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", "valid TOML", str(exc)) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(source, "", "UTF-8 text", str(exc)) from exc
    return from_mapping(raw, source=source, base_dir=file.parent, env=env)


MIN_FRAME_BYTES = 1 << 20
# The largest message of a turn carries its transcript twice (a round's input and its provider input), and a
# model's context window of N tokens holds at most 4N bytes of text (the Router's estimate counts four ASCII
# characters, or one byte of other text, per token); a quarter more for the rest of the message.
FRAME_BYTES_PER_TOKEN = 10
FRAME_SLACK_BYTES = 64 << 10


def frame_bytes_for(context_window: int) -> int:
    """The ``node.max_frame_bytes`` a model with this context window needs: 10 bytes a token plus 64 KiB,
    at least 1 MiB, rounded up to 64 KiB."""
    need = FRAME_BYTES_PER_TOKEN * max(0, context_window) + FRAME_SLACK_BYTES
    return max(MIN_FRAME_BYTES, -(-need // FRAME_SLACK_BYTES) * FRAME_SLACK_BYTES)


def default_frame_bytes(raw: Mapping[str, object]) -> int:
    """``node.max_frame_bytes`` when the file and the environment do not set it: large enough for the
    largest ``context_window`` of the file's ``[models.*]`` tables (``frame_bytes_for``), else 1 MiB.
    Values that are not integers are left to the catalog's own check."""
    models = raw.get("models")
    windows = [
        m.get("context_window")
        for m in (models.values() if isinstance(models, Mapping) else ())
        if isinstance(m, Mapping)
    ]
    sizes = [w for w in windows if isinstance(w, int) and not isinstance(w, bool)]
    return frame_bytes_for(max(sizes, default=0))


def from_mapping(
    raw: Mapping[str, object],
    *,
    source: str = "<mapping>",
    base_dir: Path | None = None,
    env: Mapping[str, str] = _NONE,
) -> Settings:
    """Settings from an already-parsed TOML document; relative paths resolve against
    `base_dir` (None: kept as written). `env` wins over `raw`."""
    at = _At(source, "", _folder(base_dir) if base_dir is not None else None)
    if not isinstance(raw, Mapping):
        raise at.bad("a table", raw)
    merged = dict(raw)
    overrides = _env_overrides(env)
    _curve_off_only_in_the_file(raw, overrides.get("security", {}))
    for section, values in overrides.items():
        table = raw.get(section, {})
        if not isinstance(table, Mapping):
            raise at.child(section).bad("a table", table)
        merged[section] = {**table, **values}
    node = merged.get("node")
    if isinstance(node, Mapping) and "max_frame_bytes" not in node:
        merged["node"] = {**node, "max_frame_bytes": default_frame_bytes(merged)}
    return _build(Settings, merged, at, preset={"source": source})


def _curve_off_only_in_the_file(raw: Mapping[str, object], env_security: Mapping[str, object]) -> None:
    """KBUS_SECURITY_MODE may turn CURVE on, or repeat what the file says, but never turn it off: an
    environment variable is too easy to inherit unnoticed (DESIGN.md §5: plain tcp only behind an explicit,
    loudly named setting)."""
    wanted = env_security.get("mode")
    if wanted is None or wanted == "curve":
        return
    table = raw.get("security")
    in_file = table.get("mode", "curve") if isinstance(table, Mapping) else "curve"
    if in_file != wanted:
        raise ConfigError(
            "<env>",
            "KBUS_SECURITY_MODE",
            "'curve' (CURVE can be turned off only by security.mode in the config file)",
            _show(wanted),
        )


def settings_for_node(name: str, **node_fields: object) -> Settings:
    """Settings for node `name` with these [node] fields and defaults elsewhere, checked as a
    file would be."""
    return from_mapping({"node": {"name": name, **node_fields}})


def build(
    cls: type[_D],
    table: Mapping[str, object],
    *,
    source: str = "<mapping>",
    key: str = "",
    base_dir: Path | None = None,
) -> _D:
    """A settings dataclass from one TOML table, checked as load() checks each section; e.g. an
    actor's typed options from `ActorSpec.options`, with `key` = 'actors.<name>'."""
    return _build(cls, table, _At(source, key, _folder(base_dir) if base_dir else None))


def _folder(path: Path) -> Path:
    """``path`` made absolute with its '..' steps taken out (symlinks kept): a config file reached as
    ``../conf/n1.toml`` has its relative paths in ``conf``, and they pass the no-'..' rule."""
    return Path(os.path.abspath(path))
