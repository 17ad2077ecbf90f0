"""The model catalog: model names and aliases -> the exact provider model and the provider entry to use.

Read from the ``[providers.<name>]`` and ``[models.<id>]`` tables of a node's config (``Settings.extra``)::

    [providers.lab]
    kind = "openai"                      # local, openai, scripted or codex
    base_url = "http://127.0.0.1:8000/v1"
    api_key_env = "LAB_API_KEY"          # the NAME of an environment variable, never the key itself

    [models.smollm2]
    provider = "local"
    provider_model = "SmolLM2-135M-Instruct"
    aliases = ["local", "default"]
    context_window = 2048
    max_input_tokens = 1536

The built-in providers ``local`` and ``scripted`` always exist unless a config table of the same name replaces
them; a config without ``[models]`` gets the built-in models of ``DEFAULT_CATALOG``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import field
from functools import cache
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, Literal

from actors.errors import Invalid
from actors.types import AgentProvider, ResolvedAgentModel, TokenUsage
from config.settings import NON_EMPTY, POSITIVE, ConfigError, Rule, build
from transport.records import frozen

if TYPE_CHECKING:
    from config.settings import Settings

ProviderKind = Literal["local", "openai", "scripted", "codex"]

_AGENT_PROVIDER: Mapping[str, AgentProvider] = MappingProxyType(
    {
        "local": AgentProvider.LOCAL,
        "openai": AgentProvider.OPENAI,
        "scripted": AgentProvider.SCRIPTED,
        "codex": AgentProvider.CODEX,
    }
)

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")  # as config.settings writes a dotted key
_PROVIDER_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
# Option names that would hold a credential itself. Only the Router may hold one, and only from the
# environment (MB-09): a key in a config file ends up in backups, captures and bug reports.
_SECRET_KEY = re.compile(
    r"(?:key|.*api[_-]?key|.*secret|(?:.*[_-])?token|.*passw(?:or)?d|.*credentials?|authorization|bearer)",
    re.IGNORECASE,
)
_SECRET_VALUE = re.compile(r"(?:sk-|Bearer\s)\S")

MODEL_NAME = Rule(
    "a model name without spaces",
    lambda v: v != "" and v.isprintable() and not any(c.isspace() for c in v),
)
USD_PER_MTOK = Rule(
    "a finite number >= 0 (US dollars per million tokens)", lambda v: math.isfinite(v) and v >= 0
)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _child(key: str, name: str) -> str:
    part = name if _BARE_KEY.fullmatch(name) else '"' + name.replace('"', '\\"') + '"'
    return f"{key}.{part}" if key else part


class UnknownModel(Invalid):
    """A name that is neither a model id nor an alias in the Router's catalog; ``known`` lists its names."""

    WIRE = "unknown_model"
    SHOWN = 20  # names listed in the message; ``known`` holds them all

    def __init__(self, requested: str, known: Iterable[str] = ()) -> None:
        self.requested = requested
        self.known = tuple(known)
        shown = ", ".join(self.known[: self.SHOWN]) + (", ..." if len(self.known) > self.SHOWN else "")
        super().__init__(f"unknown model {_show(requested)}; known: {shown or '(none)'}")

    def wire_fields(self) -> dict[str, Any]:
        return {"requested": self.requested, "known": list(self.known)}

    @classmethod
    def from_wire(cls, message: str, fields: Mapping[str, Any]) -> UnknownModel:
        requested, known = fields["requested"], fields["known"]
        if not isinstance(requested, str) or not isinstance(known, list | tuple):
            raise TypeError("unknown_model needs 'requested' (a str) and 'known' (a list of str)")
        if not all(isinstance(name, str) for name in known):
            raise TypeError("unknown_model 'known' must hold only str")
        return cls(requested, known)

    def __reduce__(self) -> tuple[type[UnknownModel], tuple[str, tuple[str, ...]]]:
        return (type(self), (self.requested, self.known))


@frozen(kw_only=True)
class Prices:
    """US dollars per million tokens. Cached input is part of input; reasoning output is part of output."""

    input_usd_per_mtok: float
    output_usd_per_mtok: float
    cached_input_usd_per_mtok: float

    def cost_usd(self, usage: TokenUsage) -> float:
        cached = min(usage.cached_input_tokens, usage.input_tokens)
        return (
            (usage.input_tokens - cached) * self.input_usd_per_mtok
            + cached * self.cached_input_usd_per_mtok
            + usage.output_tokens * self.output_usd_per_mtok
        ) / 1_000_000


FREE = Prices(input_usd_per_mtok=0.0, output_usd_per_mtok=0.0, cached_input_usd_per_mtok=0.0)


@frozen(kw_only=True)
class ProviderEntry:
    """A named provider: its kind and the rest of its table, unconverted (the provider's own settings).

    Invariant (checked when read from config): ``options`` holds no credential; ``api_key_env``, if present,
    is an environment variable name.
    """

    name: str
    kind: ProviderKind
    options: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def agent_provider(self) -> AgentProvider:
        return _AGENT_PROVIDER[self.kind]


@frozen(kw_only=True)
class ModelEntry:
    """One catalog model. ``prices`` is None when the config gives none (receipts then carry no cost)."""

    model: str
    provider: str  # a ProviderEntry name
    provider_model: str
    aliases: tuple[str, ...] = ()
    context_window: int
    max_input_tokens: int
    reasoning_efforts: tuple[str, ...] = ()
    prices: Prices | None = None


@frozen(kw_only=True)
class _ProviderTable:
    kind: ProviderKind


@frozen(kw_only=True)
class _ModelTable:
    """``[models.<id>]`` as written; becomes a ModelEntry."""

    provider: Annotated[str, NON_EMPTY]
    provider_model: Annotated[str, NON_EMPTY]
    aliases: tuple[Annotated[str, MODEL_NAME], ...] = ()
    context_window: Annotated[int, POSITIVE]
    max_input_tokens: Annotated[int, POSITIVE]
    reasoning_efforts: tuple[Annotated[str, NON_EMPTY], ...] = ()
    input_usd_per_mtok: Annotated[float, USD_PER_MTOK] | None = None
    output_usd_per_mtok: Annotated[float, USD_PER_MTOK] | None = None
    cached_input_usd_per_mtok: Annotated[float, USD_PER_MTOK] | None = None


def _check_no_secrets(options: Mapping[str, object], source: str, key: str) -> None:
    """Reject credentials written into config; never echo the value (it may be the secret)."""
    for name, value in options.items():
        here = _child(key, str(name))
        if name == "api_key_env":
            if not isinstance(value, str) or not _ENV_NAME.fullmatch(value):
                raise ConfigError(
                    source,
                    here,
                    "the name of an environment variable ([A-Z_][A-Z0-9_]*) that holds the key",
                    "something else (not shown: it may be the key itself)",
                )
        elif _SECRET_KEY.fullmatch(str(name)):
            raise ConfigError(
                source,
                here,
                "no credential in the config: put the key in an environment variable "
                "and name that variable with api_key_env",
                "a credential (not shown)",
            )
        elif isinstance(value, str) and _SECRET_VALUE.match(value):
            raise ConfigError(
                source,
                here,
                "no credential in the config: use api_key_env to name an environment variable",
                "a value that looks like a credential (not shown)",
            )
        elif isinstance(value, Mapping):
            _check_no_secrets(value, source, here)
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                if isinstance(item, Mapping):
                    _check_no_secrets(item, source, f"{here}[{i}]")


# Where each kind's client is; its constructor's keyword parameters are the options a [providers.*] table
# may set (minus what the Router itself passes), so the list can never drift from the code.
_PROVIDER_CLASSES: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "local": ("actors.router.providers.local", "LocalProvider"),
        "openai": ("actors.router.providers.openai_compat", "OpenAIProvider"),
        "codex": ("actors.router.providers.codex", "CodexProvider"),
    }
)
_NOT_OPTIONS = frozenset({"self", "api_key", "sleep"})  # given by the Router, never by a config file


@frozen
class ProviderOption:
    """One option of a provider kind: its name and its default as Python writes it ('' if required)."""

    name: str
    default: str


@cache
def provider_options(kind: str) -> tuple[ProviderOption, ...]:
    """Every option a ``[providers.*]`` table of ``kind`` may set (besides ``kind``), from the client's own
    constructor; ``api_key_env`` for openai (the Router reads the key from that variable)."""
    if kind == "scripted":
        return (ProviderOption("scripts", "()"), ProviderOption("default", "None"))
    if kind not in _PROVIDER_CLASSES:
        return ()
    module, name = _PROVIDER_CLASSES[kind]
    cls = getattr(importlib.import_module(module), name)
    found = [
        ProviderOption(p.name, "" if p.default is inspect.Parameter.empty else repr(p.default))
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name not in _NOT_OPTIONS and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if kind == "openai":
        found.append(ProviderOption("api_key_env", "None"))
    return tuple(found)


def model_options() -> tuple[ProviderOption, ...]:
    """Every key a ``[models.*]`` table may set, with its default ('' if required)."""
    import dataclasses

    out = []
    for f in dataclasses.fields(_ModelTable):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = ""
        out.append(ProviderOption(f.name, default))
    return tuple(out)


def _check_options(kind: str, options: Mapping[str, object], source: str, key: str) -> None:
    known = [o.name for o in provider_options(kind)]
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                source,
                _child(key, str(name)),
                f"an option of a provider of kind {kind} ({', '.join(sorted(known))}{hint})",
                "an unknown option",
            )


def _provider_from_table(name: str, table: object, source: str) -> ProviderEntry:
    key = _child("providers", name)
    if not _PROVIDER_NAME.fullmatch(name):
        raise ConfigError(source, key, "a provider name of letters, digits, '_', '.' and '-'", _show(name))
    if not isinstance(table, Mapping):
        raise ConfigError(source, key, "a table", _show(table))
    options = {k: v for k, v in table.items() if k != "kind"}
    _check_no_secrets(options, source, key)
    kind = build(_ProviderTable, {k: v for k, v in table.items() if k == "kind"}, source=source, key=key).kind
    _check_options(kind, options, source, key)
    return ProviderEntry(name=name, kind=kind, options=MappingProxyType(options))


def _model_from_table(name: str, table: object, source: str) -> ModelEntry:
    key = _child("models", name)
    if not MODEL_NAME.ok(name):
        raise ConfigError(source, key, MODEL_NAME.expected, _show(name))
    if not isinstance(table, Mapping):
        raise ConfigError(source, key, "a table", _show(table))
    if "model" in table:
        raise ConfigError(
            source, _child(key, "model"), "no 'model' key: the table's own name is the model id", "a value"
        )
    t = build(_ModelTable, table, source=source, key=key)
    prices: Prices | None = None
    given = (t.input_usd_per_mtok, t.output_usd_per_mtok, t.cached_input_usd_per_mtok)
    if any(p is not None for p in given):
        for price_key, value in (
            ("input_usd_per_mtok", t.input_usd_per_mtok),
            ("output_usd_per_mtok", t.output_usd_per_mtok),
        ):
            if value is None:
                raise ConfigError(
                    source,
                    _child(key, price_key),
                    f"{USD_PER_MTOK.expected}, since the model has a price",
                    "nothing",
                )
        assert t.input_usd_per_mtok is not None and t.output_usd_per_mtok is not None
        cached = t.cached_input_usd_per_mtok
        prices = Prices(
            input_usd_per_mtok=t.input_usd_per_mtok,
            output_usd_per_mtok=t.output_usd_per_mtok,
            # No cache discount unless the config names one.
            cached_input_usd_per_mtok=t.input_usd_per_mtok if cached is None else cached,
        )
    return ModelEntry(
        model=name,
        provider=t.provider,
        provider_model=t.provider_model,
        aliases=t.aliases,
        context_window=t.context_window,
        max_input_tokens=t.max_input_tokens,
        reasoning_efforts=t.reasoning_efforts,
        prices=prices,
    )


def _tables(raw: Mapping[str, object], section: str, source: str) -> Mapping[str, object] | None:
    value = raw.get(section)
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(source, section, f"a table of tables ([{section}.<name>])", _show(value))
    return value


class ModelCatalog:
    """Every model the Router serves, by id and alias.

    Invariants (ConfigError naming the key otherwise): there is at least one model; ids and aliases are
    distinct across the whole catalog; every model names an existing provider entry; sizes are > 0 and
    ``max_input_tokens <= context_window``. Names are case-sensitive.
    """

    __slots__ = ("_by_name", "_models", "_providers")

    def __init__(
        self, models: Iterable[ModelEntry], providers: Iterable[ProviderEntry], *, source: str = "<python>"
    ) -> None:
        self._providers: dict[str, ProviderEntry] = {}
        for p in providers:
            if p.name in self._providers:
                raise ConfigError(source, _child("providers", p.name), "a provider name used once", "twice")
            if p.kind not in _AGENT_PROVIDER:
                expected = "one of " + ", ".join(repr(k) for k in _AGENT_PROVIDER)
                key = _child(_child("providers", p.name), "kind")
                raise ConfigError(source, key, expected, _show(p.kind))
            self._providers[p.name] = p
        self._models = tuple(models)
        if not self._models:
            raise ConfigError(source, "models", "at least one [models.<id>] table", "none")
        self._by_name: dict[str, ModelEntry] = {}
        for m in self._models:
            key = _child("models", m.model)
            if not MODEL_NAME.ok(m.model):
                raise ConfigError(source, key, MODEL_NAME.expected, _show(m.model))
            if m.model in self._by_name:
                raise ConfigError(source, key, "a model id used once", "twice")
            self._by_name[m.model] = m
        for m in self._models:
            self._check(m, source)
            for i, alias in enumerate(m.aliases):
                here = f"{_child(_child('models', m.model), 'aliases')}[{i}]"
                if not MODEL_NAME.ok(alias):
                    raise ConfigError(source, here, MODEL_NAME.expected, _show(alias))
                other = self._by_name.get(alias)
                if other is not None:
                    taken = "the id" if other.model == alias else "an alias"
                    raise ConfigError(
                        source,
                        here,
                        "an alias no model id or other alias uses",
                        f"{_show(alias)}, already {taken} of model {_show(other.model)}",
                    )
                self._by_name[alias] = m

    def _check(self, m: ModelEntry, source: str) -> None:
        key = _child("models", m.model)
        sizes = (("context_window", m.context_window), ("max_input_tokens", m.max_input_tokens))
        for size_key, size in sizes:
            if type(size) is not int or size <= 0:
                raise ConfigError(source, _child(key, size_key), POSITIVE.expected, _show(size))
        if m.max_input_tokens > m.context_window:
            raise ConfigError(
                source,
                _child(key, "max_input_tokens"),
                f"at most context_window ({m.context_window})",
                _show(m.max_input_tokens),
            )
        if m.provider not in self._providers:
            known = ", ".join(sorted(self._providers)) or "none"
            raise ConfigError(
                source, _child(key, "provider"), f"a [providers.<name>] entry ({known})", _show(m.provider)
            )

    @classmethod
    def from_mapping(cls, raw: Mapping[str, object], *, source: str = "<mapping>") -> ModelCatalog:
        """The catalog of a parsed config document (its ``providers`` and ``models`` tables)."""
        providers = {p.name: p for p in DEFAULT_CATALOG.providers}
        provider_tables = _tables(raw, "providers", source)
        for name, table in (provider_tables or {}).items():
            providers[name] = _provider_from_table(name, table, source)
        model_tables = _tables(raw, "models", source)
        if model_tables is None:
            models = DEFAULT_CATALOG.models
        else:
            models = tuple(_model_from_table(name, table, source) for name, table in model_tables.items())
        return cls(models, providers.values(), source=source)

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelCatalog:
        return cls.from_mapping(settings.extra, source=settings.source)

    @property
    def models(self) -> tuple[ModelEntry, ...]:
        return self._models

    @property
    def providers(self) -> tuple[ProviderEntry, ...]:
        return tuple(self._providers.values())

    def names(self) -> tuple[str, ...]:
        """Every name that resolves: ids and aliases, sorted."""
        return tuple(sorted(self._by_name))

    def resolve(self, requested: str) -> tuple[ResolvedAgentModel, ModelEntry, ProviderEntry]:
        """The model ``requested`` names (an id or an alias, exactly); UnknownModel if none."""
        entry = self._by_name.get(requested)
        if entry is None:
            raise UnknownModel(requested, self.names())
        provider = self._providers[entry.provider]
        resolved = ResolvedAgentModel(
            requested=requested,
            model=entry.model,
            provider=provider.agent_provider,
            provider_model=entry.provider_model,
            context_window_tokens=entry.context_window,
            max_input_tokens=entry.max_input_tokens,
            reasoning_efforts=entry.reasoning_efforts,
        )
        return resolved, entry, provider

    def __repr__(self) -> str:
        return f"ModelCatalog(models={[m.model for m in self._models]}, providers={list(self._providers)})"


# The embedded 135M model as an agent can use it: it may decide to call a tool on its first request, must
# answer in text after a tool result (with "auto" it calls again until its context is full), and samples
# deterministically. Its context is the local provider's n_ctx (4096).
_LOCAL_AGENT_OPTIONS: Mapping[str, object] = MappingProxyType(
    {
        "tool_choice": "auto",
        "tool_choice_after_call": "none",
        "temperature": 0.0,
        "seed": 7,
        "max_output_tokens": 160,
    }
)

DEFAULT_CATALOG = ModelCatalog(
    (
        ModelEntry(
            model="smollm2",
            provider="local",
            provider_model="SmolLM2-135M-Instruct",
            aliases=("local", "default"),
            context_window=4096,
            max_input_tokens=3500,
            prices=FREE,
        ),
        ModelEntry(
            model="scripted",
            provider="scripted",
            provider_model="scripted",
            context_window=32768,
            max_input_tokens=30000,
            prices=FREE,
        ),
    ),
    (
        ProviderEntry(name="local", kind="local", options=_LOCAL_AGENT_OPTIONS),
        ProviderEntry(name="scripted", kind="scripted"),
    ),
    source="<built-in>",
)
