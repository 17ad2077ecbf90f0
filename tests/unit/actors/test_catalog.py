"""Tests for actors.router.catalog: lookup by id and alias, validation, prices, UnknownModel on the wire."""

from __future__ import annotations

import copy
import inspect
import pickle
from typing import Any

import pytest

from actors.router.catalog import (
    DEFAULT_CATALOG,
    ModelCatalog,
    ModelEntry,
    Prices,
    ProviderEntry,
    UnknownModel,
    provider_options,
)
from actors.types import AGENT_TYPES, AgentProvider, ResolvedAgentModel, TokenUsage
from config.settings import ConfigError, from_mapping
from transport.codec import Registry
from transport.errors import ErrorRegistry, ProtocolError
from transport.messages import SYSTEM_MESSAGES, ErrorReply

SOURCE = "node.toml"


def config() -> dict[str, Any]:
    """A fresh config document (tests mutate it)."""
    return {
        "providers": {
            "local": {"kind": "local"},
            "lab": {"kind": "openai", "base_url": "http://127.0.0.1:8000/v1", "api_key_env": "LAB_API_KEY"},
            "cx": {"kind": "codex"},
        },
        "models": {
            "smollm2": {
                "provider": "local",
                "provider_model": "SmolLM2-135M-Instruct",
                "aliases": ["local", "default"],
                "context_window": 2048,
                "max_input_tokens": 1536,
                "reasoning_efforts": [],
                "input_usd_per_mtok": 0.0,
                "output_usd_per_mtok": 0.0,
                "cached_input_usd_per_mtok": 0.0,
            },
            "gpt-4.1": {
                "provider": "lab",
                "provider_model": "gpt-4.1-2025-04-14",
                "aliases": ["big"],
                "context_window": 1_000_000,
                "max_input_tokens": 900_000,
                "reasoning_efforts": ["low", "high"],
                "input_usd_per_mtok": 2.0,
                "output_usd_per_mtok": 8.0,
                "cached_input_usd_per_mtok": 0.5,
            },
            "coder": {
                "provider": "cx",
                "provider_model": "gpt-5-codex",
                "context_window": 400_000,
                "max_input_tokens": 272_000,
            },
        },
    }


def catalog(raw: dict[str, Any] | None = None) -> ModelCatalog:
    return ModelCatalog.from_mapping(config() if raw is None else raw, source=SOURCE)


def config_error(raw: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        catalog(raw)
    assert info.value.source == SOURCE
    return info.value


# --------------------------------------------------------------------------------------- resolution


def test_resolves_by_id_with_every_field() -> None:
    resolved, entry, provider = catalog().resolve("gpt-4.1")
    assert resolved == ResolvedAgentModel(
        requested="gpt-4.1",
        model="gpt-4.1",
        provider=AgentProvider.OPENAI,
        provider_model="gpt-4.1-2025-04-14",
        context_window_tokens=1_000_000,
        max_input_tokens=900_000,
        reasoning_efforts=("low", "high"),
    )
    assert entry.model == "gpt-4.1" and entry.provider == "lab" and entry.aliases == ("big",)
    assert provider == ProviderEntry(
        name="lab",
        kind="openai",
        options={"base_url": "http://127.0.0.1:8000/v1", "api_key_env": "LAB_API_KEY"},
    )


@pytest.mark.parametrize("alias", ["local", "default"])
def test_an_alias_resolves_to_the_canonical_id_and_keeps_the_requested_name(alias: str) -> None:
    resolved, entry, provider = catalog().resolve(alias)
    assert resolved.requested == alias
    assert resolved.model == entry.model == "smollm2"
    assert resolved.provider is AgentProvider.LOCAL
    assert provider.name == "local"


@pytest.mark.parametrize(
    ("name", "provider"),
    [("smollm2", AgentProvider.LOCAL), ("big", AgentProvider.OPENAI), ("coder", AgentProvider.CODEX)],
)
def test_each_provider_kind_maps_to_its_agent_provider(name: str, provider: AgentProvider) -> None:
    assert catalog().resolve(name)[0].provider is provider


def test_the_built_in_scripted_provider_maps_to_scripted() -> None:
    raw = config()
    raw["models"]["fake"] = {
        "provider": "scripted",
        "provider_model": "script",
        "context_window": 100,
        "max_input_tokens": 100,
    }
    assert catalog(raw).resolve("fake")[0].provider is AgentProvider.SCRIPTED


def test_names_lists_ids_and_aliases_sorted() -> None:
    assert catalog().names() == ("big", "coder", "default", "gpt-4.1", "local", "smollm2")


@pytest.mark.parametrize("name", ["gpt-9", "Default", "SMOLLM2", " local", ""])
def test_an_unknown_name_raises_unknown_model_listing_the_known_names(name: str) -> None:
    with pytest.raises(UnknownModel) as info:
        catalog().resolve(name)
    err = info.value
    assert err.requested == name
    assert err.known == catalog().names()
    assert err.message == (f"unknown model {name!r}; known: big, coder, default, gpt-4.1, local, smollm2")


def test_unknown_model_message_is_bounded() -> None:
    err = UnknownModel("x" * 10_000, [f"m{i}" for i in range(100)])
    assert len(err.message) < 400 and err.message.endswith(", ...")
    assert len(err.known) == 100 and len(err.requested) == 10_000


def _registry() -> Registry:
    errors = ErrorRegistry().extended([UnknownModel])
    return Registry(SYSTEM_MESSAGES + AGENT_TYPES, errors)


def test_unknown_model_round_trips_over_the_bus_as_the_same_class() -> None:
    reg = _registry()
    with pytest.raises(UnknownModel) as info:
        DEFAULT_CATALOG.resolve("gpt-9")
    sent = info.value
    reply = reg.decode(ErrorReply.TAG, reg.encode(reg.error_reply(sent)))
    assert reply.error == "unknown_model"
    back = reg.rebuild_error(reply)
    assert type(back) is UnknownModel
    assert back == sent
    assert back.requested == "gpt-9"
    assert back.known == ("default", "local", "scripted", "smollm2")
    assert str(back) == "unknown model 'gpt-9'; known: default, local, scripted, smollm2"


def test_unknown_model_with_malformed_fields_becomes_a_protocol_error() -> None:
    reg = _registry()
    reply = ErrorReply(error="unknown_model", message="x", fields={"requested": "a", "known": [1]})
    assert type(reg.rebuild_error(reply)) is ProtocolError
    reply = ErrorReply(error="unknown_model", message="x", fields={"requested": "a"})
    assert type(reg.rebuild_error(reply)) is ProtocolError


def test_unknown_model_survives_copy_and_pickle() -> None:
    err = UnknownModel("gpt-9", ("a", "b"))
    assert copy.copy(err) == err
    assert pickle.loads(pickle.dumps(err)) == err


# ------------------------------------------------------------------------------------- where it comes from


def test_from_settings_reads_the_extra_tables() -> None:
    settings = from_mapping({"node": {"name": "n1"}, **config()}, source=SOURCE)
    cat = ModelCatalog.from_settings(settings)
    assert cat.names() == catalog().names()
    assert cat.resolve("big")[0].provider_model == "gpt-4.1-2025-04-14"


def test_from_settings_names_the_settings_source_in_errors() -> None:
    raw = config()
    raw["models"]["coder"]["provider"] = "nowhere"
    settings = from_mapping({"node": {"name": "n1"}, **raw}, source="/etc/kbus/node.toml")
    with pytest.raises(ConfigError) as info:
        ModelCatalog.from_settings(settings)
    assert info.value.source == "/etc/kbus/node.toml"
    assert info.value.key == "models.coder.provider"


def test_default_catalog_resolves_default() -> None:
    resolved, entry, provider = DEFAULT_CATALOG.resolve("default")
    assert resolved == ResolvedAgentModel(
        requested="default",
        model="smollm2",
        provider=AgentProvider.LOCAL,
        provider_model="SmolLM2-135M-Instruct",
        context_window_tokens=4096,
        max_input_tokens=3500,
    )
    assert (provider.name, provider.kind) == ("local", "local")
    # the agent settings the embedded model needs: it answers in text after a tool result
    assert dict(provider.options) == {
        "tool_choice": "auto",
        "tool_choice_after_call": "none",
        "temperature": 0.0,
        "seed": 7,
        "max_output_tokens": 160,
    }
    assert entry.prices is not None
    assert entry.prices.cost_usd(TokenUsage(input_tokens=9, output_tokens=9)) == 0
    scripted, _, scripted_provider = DEFAULT_CATALOG.resolve("scripted")
    assert scripted.provider is AgentProvider.SCRIPTED and scripted_provider.kind == "scripted"
    assert (scripted.context_window_tokens, scripted.max_input_tokens) == (32768, 30000)


def test_a_config_without_models_gets_the_default_catalog() -> None:
    assert ModelCatalog.from_mapping({}).names() == DEFAULT_CATALOG.names()
    settings = from_mapping({"node": {"name": "n1"}})
    assert ModelCatalog.from_settings(settings).names() == ("default", "local", "scripted", "smollm2")


def test_a_config_provider_table_replaces_the_built_in_one_of_that_name() -> None:
    cat = ModelCatalog.from_mapping({"providers": {"local": {"kind": "local", "n_threads": 1}}})
    _, _, provider = cat.resolve("default")
    assert provider.options == {"n_threads": 1}


def test_provider_options_are_read_only() -> None:
    _, _, provider = catalog().resolve("big")
    with pytest.raises(TypeError):
        provider.options["base_url"] = "http://elsewhere"  # type: ignore[index]


def test_a_model_without_prices_has_none() -> None:
    _, entry, _ = catalog().resolve("coder")
    assert entry.prices is None


def test_a_catalog_built_in_python_is_checked_too() -> None:
    local = ProviderEntry(name="local", kind="local")
    ok = ModelEntry(model="m", provider="local", provider_model="p", context_window=10, max_input_tokens=10)
    assert ModelCatalog([ok], [local]).resolve("m")[1] is ok
    bad = ModelEntry(model="m", provider="local", provider_model="p", context_window=10, max_input_tokens=11)
    with pytest.raises(ConfigError) as info:
        ModelCatalog([bad], [local])
    assert (info.value.source, info.value.key) == ("<python>", "models.m.max_input_tokens")


# --------------------------------------------------------------------------------------------- validation


def test_a_model_naming_an_unknown_provider() -> None:
    raw = config()
    raw["models"]["coder"]["provider"] = "nowhere"
    err = config_error(raw)
    assert err.key == "models.coder.provider"
    assert "'nowhere'" in err.got and "cx, lab, local, scripted" in err.expected


@pytest.mark.parametrize(
    ("model", "alias", "key", "taken"),
    [
        ("coder", "big", "models.coder.aliases[0]", "an alias of model 'gpt-4.1'"),  # another model's alias
        ("coder", "smollm2", "models.coder.aliases[0]", "the id of model 'smollm2'"),  # another model's id
        ("gpt-4.1", "big", 'models."gpt-4.1".aliases[1]', "an alias of model 'gpt-4.1'"),  # its own, twice
        ("coder", "coder", "models.coder.aliases[0]", "the id of model 'coder'"),  # its own id
    ],
)
def test_an_alias_colliding_with_an_id_or_another_alias(model: str, alias: str, key: str, taken: str) -> None:
    raw = config()
    raw["models"][model].setdefault("aliases", []).append(alias)
    err = config_error(raw)
    assert err.key == key
    assert taken in err.got


def test_a_model_id_in_the_key_is_quoted_when_it_is_not_bare() -> None:
    raw = config()
    raw["models"]["gpt-4.1"]["max_input_tokens"] = 2_000_000
    assert config_error(raw).key == 'models."gpt-4.1".max_input_tokens'


def test_max_input_tokens_above_the_context_window() -> None:
    raw = config()
    raw["models"]["smollm2"]["max_input_tokens"] = 2049
    err = config_error(raw)
    assert err.key == "models.smollm2.max_input_tokens"
    assert "2048" in err.expected and err.got == "2049"


@pytest.mark.parametrize("key", ["context_window", "max_input_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes(key: str, value: int) -> None:
    raw = config()
    raw["models"]["smollm2"][key] = value
    err = config_error(raw)
    assert err.key == f"models.smollm2.{key}"
    assert err.expected == "an integer > 0"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("context_window", "2048"),
        ("context_window", 2048.0),
        ("aliases", "local"),
        ("aliases", ["two words"]),
        ("input_usd_per_mtok", -1.0),
        ("input_usd_per_mtok", float("inf")),
        ("reasoning_efforts", [""]),
        ("provider_model", ""),
    ],
)
def test_mistyped_values_name_their_key(key: str, value: object) -> None:
    raw = config()
    raw["models"]["smollm2"][key] = value
    assert config_error(raw).key.startswith(f"models.smollm2.{key}")


@pytest.mark.parametrize("key", ["provider", "provider_model", "context_window", "max_input_tokens"])
def test_a_missing_required_key(key: str) -> None:
    raw = config()
    del raw["models"]["smollm2"][key]
    err = config_error(raw)
    assert err.key == f"models.smollm2.{key}"
    assert "required" in err.got


def test_an_unknown_model_key_suggests_the_close_one() -> None:
    raw = config()
    raw["models"]["smollm2"]["context_windw"] = 4
    err = config_error(raw)
    assert err.key == "models.smollm2.context_windw"
    assert "did you mean 'context_window'" in err.expected


def test_a_model_table_may_not_name_its_own_id() -> None:
    raw = config()
    raw["models"]["smollm2"]["model"] = "other"
    assert config_error(raw).key == "models.smollm2.model"


def test_a_price_needs_both_input_and_output_and_cached_defaults_to_input() -> None:
    raw = config()
    del raw["models"]["gpt-4.1"]["output_usd_per_mtok"]
    assert config_error(raw).key == 'models."gpt-4.1".output_usd_per_mtok'
    raw = config()
    del raw["models"]["gpt-4.1"]["cached_input_usd_per_mtok"]
    prices = catalog(raw).resolve("big")[1].prices
    assert prices == Prices(input_usd_per_mtok=2.0, output_usd_per_mtok=8.0, cached_input_usd_per_mtok=2.0)


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"models": {}}, "models"),
        ({"models": [{"provider": "local"}]}, "models"),
        ({"models": {"m": "not a table"}}, "models.m"),
        ({"models": {"two words": {}}}, 'models."two words"'),
        ({"providers": "local"}, "providers"),
        ({"providers": {"p": {"kind": "anthropic"}}}, "providers.p.kind"),
        ({"providers": {"p": {}}}, "providers.p.kind"),
        ({"providers": {"p q": {"kind": "local"}}}, 'providers."p q"'),
    ],
)
def test_malformed_sections(raw: dict[str, Any], key: str) -> None:
    assert config_error(raw).key == key


# ------------------------------------------------------------------------------------------------ secrets


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"api_key": "sk-live-123"}, "providers.lab.api_key"),
        ({"API_KEY": "abc"}, "providers.lab.API_KEY"),
        ({"key": "abc"}, "providers.lab.key"),
        ({"token": "abc"}, "providers.lab.token"),
        ({"auth_token": "abc"}, "providers.lab.auth_token"),
        ({"client_secret": "abc"}, "providers.lab.client_secret"),
        ({"password": "abc"}, "providers.lab.password"),
        ({"headers": {"Authorization": "Bearer abc"}}, "providers.lab.headers.Authorization"),
        ({"extra": "sk-ant-abcdef"}, "providers.lab.extra"),
    ],
)
def test_a_credential_in_the_config_is_rejected_without_echoing_it(options: dict[str, Any], key: str) -> None:
    raw = config()
    raw["providers"]["lab"].update(options)
    err = config_error(raw)
    assert err.key == key
    assert "api_key_env" in err.expected
    assert "abc" not in str(err) and "sk-" not in str(err)


@pytest.mark.parametrize("value", ["sk-live-123", "lab_api_key", "1KEY", "LAB-KEY", "", 7])
def test_api_key_env_must_be_a_variable_name(value: object) -> None:
    raw = config()
    raw["providers"]["lab"]["api_key_env"] = value
    err = config_error(raw)
    assert err.key == "providers.lab.api_key_env"
    assert "environment variable" in err.expected
    assert "sk-live" not in str(err)


@pytest.mark.parametrize("option", ["max_tokens_param", "base_url", "timeout"])
def test_ordinary_options_pass(option: str) -> None:
    raw = config()
    raw["providers"]["lab"][option] = "x"
    assert catalog(raw).resolve("big")[2].options[option] == "x"


@pytest.mark.parametrize(
    ("option", "hint"),
    [("max_tokens", "max_tokens_param"), ("prompt_cache_key_prefix", None), ("timeout_s", "timeout")],
)
def test_an_unknown_option_is_refused_with_a_did_you_mean(option: str, hint: str | None) -> None:
    """Not taken for a credential (its name merely contains 'key'), but not passed on either: the client
    would fail with a TypeError at the first turn."""
    raw = config()
    raw["providers"]["lab"][option] = "x"
    err = config_error(raw)
    assert err.key == f"providers.lab.{option}" and err.got == "an unknown option"
    assert err.expected.startswith("an option of a provider of kind openai (")
    assert "max_output_tokens" in err.expected and "stream_tools" in err.expected
    assert (f"did you mean {hint!r}?" in err.expected) if hint else ("did you mean" not in err.expected)


def test_the_options_listed_are_the_constructors() -> None:
    from actors.router.providers.openai_compat import OpenAIProvider

    names = {o.name for o in provider_options("openai")}
    assert names == (set(inspect.signature(OpenAIProvider).parameters) - {"api_key", "sleep"}) | {
        "api_key_env"
    }
    assert {o.name for o in provider_options("scripted")} == {"scripts", "default"}


# ------------------------------------------------------------------------------------------------- prices


def test_prices_bill_cached_input_apart_and_reasoning_inside_output() -> None:
    prices = Prices(input_usd_per_mtok=2.0, output_usd_per_mtok=8.0, cached_input_usd_per_mtok=0.5)
    usage = TokenUsage(
        input_tokens=1_000_000,
        cached_input_tokens=250_000,
        output_tokens=100_000,
        reasoning_output_tokens=60_000,  # part of output_tokens, not billed again
        total_tokens=1_100_000,
    )
    assert prices.cost_usd(usage) == pytest.approx(0.75 * 2.0 + 0.25 * 0.5 + 0.1 * 8.0)
    assert prices.cost_usd(TokenUsage()) == 0.0
    # A provider reporting more cached than input: all input is billed as cached, never negative.
    odd = TokenUsage(input_tokens=10, cached_input_tokens=20)
    assert prices.cost_usd(odd) == pytest.approx(10 * 0.5 / 1e6)


def test_catalog_prices_come_from_the_config() -> None:
    _, entry, _ = catalog().resolve("big")
    assert entry.prices is not None
    assert entry.prices.cost_usd(TokenUsage(input_tokens=1_000, output_tokens=500)) == pytest.approx(0.006)
