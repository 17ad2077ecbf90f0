"""config.settings: TOML + environment -> frozen, checked Settings; every bad input names its key."""

import ast
import dataclasses
import pickle
import re
import sys
import textwrap
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import pytest

import config
from config import (
    DEFAULT_CONFIG,
    ActorSpec,
    AllowedClient,
    ConfigError,
    NodeSettings,
    PeerSettings,
    Rule,
    SecuritySettings,
    Settings,
    build,
    from_mapping,
    load,
    settings_for_node,
)
from config.settings import _from_text

KEY = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"  # the zguide's example server key
OTHER_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
CERT = f"""\
#   ****  Generated on 2026-01-01 by pyzmq  ****
#   ZeroMQ CURVE Public Certificate

metadata
curve
    public-key = "{KEY}"
"""


def write(tmp_path: Path, text: str, name: str = "kbus.toml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def load_error(path: Path, env: Mapping[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(path, env=env or {})
    return info.value


def mapping_error(raw: Mapping[str, object], **kwargs: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        from_mapping(raw, source="kbus.toml", **kwargs)  # type: ignore[arg-type]
    return info.value


# --- a full file ---


def test_full_file_converts_every_field_and_resolves_paths_against_its_directory(
    tmp_path: Path,
) -> None:
    write(tmp_path, CERT, "conf/keys/n2.key")
    path = write(
        tmp_path,
        f"""
        [node]
        name = "n1"
        bind = ["ipc://run/n1.sock", "tcp://127.0.0.1:5555", "inproc://local"]
        data_dir = "data"
        capture = "n1.buslog"
        max_frame_bytes = 2048
        max_header_bytes = 512
        request_timeout = 5
        heartbeat_ivl_ms = 0
        heartbeat_timeout_ms = 3000
        sndhwm = 10
        rcvhwm = 20
        [security]
        mode = "curve"
        secret_key_file = "keys/n1.key_secret"
        allow = [
          {{ node = "n2", public_key_file = "keys/n2.key" }},
          {{ node = "cli", public_key = "{OTHER_KEY}" }},
        ]
        [[peers]]
        name = "n2"
        endpoint = "tcp://127.0.0.1:5556"
        public_key_file = "keys/n2.key"
        [[peers]]
        name = "n3"
        endpoint = "ipc:///run/n3.sock"
        [actors.echo]
        type = "echo"
        [actors."session/1"]
        type = "session"
        foo = 3
        nested = {{ a = [1, 2] }}
        """,
        "conf/kbus.toml",
    )
    conf = tmp_path / "conf"

    settings = load(path, env={})

    assert settings.node == NodeSettings(
        name="n1",
        bind=(f"ipc://{conf}/run/n1.sock", "tcp://127.0.0.1:5555", "inproc://local"),
        data_dir=conf / "data",
        capture=conf / "n1.buslog",
        max_frame_bytes=2048,
        max_header_bytes=512,
        request_timeout=5.0,
        heartbeat_ivl_ms=0,
        heartbeat_timeout_ms=3000,
        sndhwm=10,
        rcvhwm=20,
    )
    assert type(settings.node.request_timeout) is float
    assert settings.security == SecuritySettings(
        mode="curve",
        secret_key_file=conf / "keys/n1.key_secret",
        allow=(AllowedClient(node="n2", public_key=KEY), AllowedClient(node="cli", public_key=OTHER_KEY)),
    )
    assert settings.peers == (
        PeerSettings(name="n2", endpoint="tcp://127.0.0.1:5556", public_key=KEY),
        PeerSettings(name="n3", endpoint="ipc:///run/n3.sock"),
    )
    assert settings.actors == (
        ActorSpec(name="echo", type="echo"),
        ActorSpec(name="session/1", type="session", options={"foo": 3, "nested": {"a": [1, 2]}}),
    )
    assert settings.source == str(path)
    assert settings.extra == {}


def test_minimal_mapping_takes_every_default() -> None:
    settings = from_mapping({"node": {"name": "n1"}})

    assert settings == Settings(node=NodeSettings(name="n1"))
    assert settings.node.data_dir == Path(".kbus")  # no base_dir: relative paths stay as written
    assert settings.node.capture is None
    assert settings.node.max_frame_bytes == 1 << 20
    assert settings.security.mode == "curve"
    assert (settings.peers, settings.actors, settings.source) == ((), (), "<mapping>")


def test_default_data_dir_lives_next_to_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nname = "n1"\n')

    assert load(path, env={}).node.data_dir == tmp_path / ".kbus"


def test_absolute_home_and_special_ipc_paths_are_not_rebased(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = write(
        tmp_path,
        """
        [node]
        name = "n1"
        bind = ["ipc:///abs/n1.sock", "ipc://@abstract", "ipc://*"]
        data_dir = "/var/lib/kbus"
        capture = "~/n1.buslog"
        """,
    )

    node = load(path, env={}).node

    assert node.bind == ("ipc:///abs/n1.sock", "ipc://@abstract", "ipc://*")
    assert node.data_dir == Path("/var/lib/kbus")
    assert node.capture == tmp_path / "home" / "n1.buslog"


def test_capture_false_means_off() -> None:
    assert from_mapping({"node": {"name": "n1", "capture": False}}).node.capture is None


# --- conversions, one type at a time ---


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("name", 3, "node.name: expected a node name of letters, digits, '_', '.' and '-', got 3"),
        ("max_frame_bytes", "big", "node.max_frame_bytes: expected an integer > 0, got 'big'"),
        ("max_frame_bytes", True, "node.max_frame_bytes: expected an integer > 0, got True"),
        ("max_frame_bytes", 1.5, "node.max_frame_bytes: expected an integer > 0, got 1.5"),
        ("max_frame_bytes", 0, "node.max_frame_bytes: expected an integer > 0, got 0"),
        ("sndhwm", -1, "node.sndhwm: expected an integer >= 0, got -1"),
        ("hosts", -1, "node.hosts: expected an integer from 0 to 256 (0: an own thread per actor), got -1"),
        ("tool_hosts", 1000, "node.tool_hosts: expected an integer from 0 to 256"),
        ("hosts", "four", "node.hosts: expected an integer from 0 to 256"),
        ("request_timeout", "5", "node.request_timeout: expected a finite number of seconds > 0"),
        ("request_timeout", False, "node.request_timeout: expected a finite number of seconds"),
        ("request_timeout", float("inf"), "node.request_timeout: expected a finite number"),
        ("request_timeout", 0, "node.request_timeout: expected a finite number of seconds > 0"),
        ("data_dir", 5, "node.data_dir: expected a path without '..', got 5"),
        ("data_dir", "", "node.data_dir: expected a path without '..', got ''"),
        ("capture", True, "node.capture: expected a path without '..', got True"),
        ("bind", "tcp://127.0.0.1:1", "node.bind: expected a list of strings, got 'tcp://"),
        ("bind", ["inproc://a", "udp://b"], "node.bind[1]: expected an endpoint starting with"),
        ("bind", ["tcp://"], "node.bind[0]: expected an endpoint starting with inproc://, ipc://"),
        ("bind", [7], "node.bind[0]: expected an endpoint starting with inproc://, ipc:// or tcp"),
    ],
)
def test_a_bad_node_value_names_file_key_and_expectation(key: str, value: object, expected: str) -> None:
    err = mapping_error({"node": {"name": "n1", key: value}})

    assert str(err).startswith("kbus.toml: " + expected)


def test_error_message_reads_source_key_expected_got(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nname = "n1"\nmax_frame_bytes = "big"\n')

    err = load_error(path)

    assert str(err) == f"{path}: node.max_frame_bytes: expected an integer > 0, got 'big'"
    assert (err.source, err.key, err.expected, err.got) == (
        str(path),
        "node.max_frame_bytes",
        "an integer > 0",
        "'big'",
    )
    assert isinstance(err, ValueError)


def test_got_is_cut_to_80_characters() -> None:
    err = mapping_error({"node": {"name": "x/" * 100}})

    assert len(err.got) == 80
    assert err.got.startswith("'x/x/") and err.got.endswith("...")


def test_config_error_survives_pickling() -> None:
    err = ConfigError("kbus.toml", "node.name", "a string", "3")

    copy = pickle.loads(pickle.dumps(err))

    assert (copy.source, copy.key, copy.expected, copy.got, str(copy)) == (
        err.source,
        err.key,
        err.expected,
        err.got,
        str(err),
    )


def test_literal_accepts_only_its_values() -> None:
    settings = from_mapping({"node": {"name": "n1"}, "security": {"mode": "plain-insecure-for-benchmarks"}})
    assert settings.security.mode == "plain-insecure-for-benchmarks"

    err = mapping_error({"node": {"name": "n1"}, "security": {"mode": "none"}})

    assert str(err) == (
        "kbus.toml: security.mode: expected one of 'curve', 'plain-insecure-for-benchmarks', got 'none'"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Inner:
    level: Annotated[int, Rule("an integer from 1 to 9", lambda v: 1 <= v <= 9)] = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class _Section:
    """A section a later issue might add: built by declaring it, nothing else."""

    flag: bool
    label: str = "x"
    count: int = 0
    ratio: float = 1.0
    where: Path | None = None
    paths: tuple[Path, ...] = ()
    colour: Literal["red", "blue"] = "red"
    inner: _Inner = _Inner()
    inners: tuple[_Inner, ...] = ()
    table: Mapping[str, object] = field(default_factory=dict)


def test_a_declared_dataclass_is_built_by_the_generic_converter(tmp_path: Path) -> None:
    section = build(
        _Section,
        {
            "flag": True,
            "label": "y",
            "count": 2,
            "ratio": 3,
            "where": "w",
            "paths": ["a", "/b"],
            "colour": "blue",
            "inner": {"level": 5},
            "inners": [{"level": 2}, {}],
            "table": {"k": [1]},
        },
        base_dir=tmp_path,
    )

    assert section == _Section(
        flag=True,
        label="y",
        count=2,
        ratio=3.0,
        where=tmp_path / "w",
        paths=(tmp_path / "a", Path("/b")),
        colour="blue",
        inner=_Inner(level=5),
        inners=(_Inner(level=2), _Inner(level=1)),
        table={"k": [1]},
    )


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"flag": 1}, "models.flag: expected true or false, got 1"),
        ({"flag": "true"}, "models.flag: expected true or false, got 'true'"),
        ({"flag": True, "label": 1}, "models.label: expected a string, got 1"),
        ({"flag": True, "ratio": "1"}, "models.ratio: expected a number, got '1'"),
        ({"flag": True, "paths": ["a", 2]}, "models.paths[1]: expected a path, got 2"),
        ({"flag": True, "colour": "green"}, "models.colour: expected one of 'red', 'blue'"),
        ({"flag": True, "inner": 3}, "models.inner: expected a table, got 3"),
        ({"flag": True, "inner": {"level": 10}}, "models.inner.level: expected an integer from 1 to 9"),
        ({"flag": True, "inners": [{}, {"level": 0}]}, "models.inners[1].level: expected an integer"),
        ({"flag": True, "inners": {"level": 1}}, "models.inners: expected a list of tables"),
        ({"flag": True, "table": [1]}, "models.table: expected a table, got [1]"),
        ({}, "models.flag: expected true or false, got nothing (the key is required)"),
        ({"flag": True, "inner": {"levle": 1}}, "models.inner.levle: expected a known key of"),
    ],
)
def test_the_generic_converter_names_each_bad_value(table: Mapping[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(_Section, table, source="kbus.toml", key="models")

    assert str(info.value).startswith("kbus.toml: " + expected)


# --- missing and unknown keys ---


def test_missing_required_keys_are_named() -> None:
    assert str(mapping_error({})) == ("kbus.toml: node: expected a table, got nothing (the key is required)")
    assert str(mapping_error({"node": {}})).startswith(
        "kbus.toml: node.name: expected a node name of letters, digits, '_', '.' and '-', "
        "got nothing (the key is required)"
    )
    err = mapping_error({"node": {"name": "n1"}, "peers": [{"name": "n2"}]})
    assert str(err) == (
        "kbus.toml: peers[0].endpoint: expected an endpoint starting with inproc://, ipc:// or "
        "tcp://, got nothing (the key is required)"
    )
    err = mapping_error({"node": {"name": "n1"}, "actors": {"echo": {"kind": "echo"}}})
    assert str(err).startswith("kbus.toml: actors.echo.type: expected a non-empty string, got nothing")
    err = mapping_error({"node": {"name": "n1"}, "security": {"allow": [{"node": "n2"}]}})
    assert "security.allow[0].public_key: expected a Z85 public key (40 characters) (as " in str(err)
    assert "public_key or public_key_file), got nothing" in str(err)


def test_a_typo_in_a_known_section_is_an_error_listing_the_known_keys(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nname = "n1"\nbnid = ["ipc://x"]\n')

    err = load_error(path)

    assert err.key == "node.bnid"
    assert str(err).startswith(f"{path}: node.bnid: expected a known key of node (bind, capture, ")
    assert "did you mean 'bind'?" in str(err)
    assert str(err).endswith("got an unknown key")


def test_a_typo_in_a_peer_names_the_peer() -> None:
    err = mapping_error(
        {"node": {"name": "n1"}, "peers": [{"name": "n2", "endpiont": "ipc://x", "endpoint": "ipc://y"}]}
    )

    assert err.key == "peers[0].endpiont"
    assert "endpoint, name, public_key, public_key_file" in err.expected


def test_unknown_top_level_tables_are_kept_in_extra() -> None:
    models = {"small": {"path": "m.gguf"}}
    settings = from_mapping({"node": {"name": "n1"}, "models": models, "providers": [{"a": 1}]})

    assert settings.extra == {"models": models, "providers": [{"a": 1}]}


def test_a_misspelt_known_section_is_not_kept_as_extra() -> None:
    err = mapping_error({"node": {"name": "n1"}, "secuirty": {"mode": "curve"}})

    assert str(err) == (
        "kbus.toml: secuirty: expected a known section (did you mean 'security'?), got an unknown section"
    )
    assert mapping_error({"node": {"name": "n1"}, "peer": [{"name": "x"}]}).key == "peer"


def test_a_top_level_scalar_is_an_error() -> None:
    err = mapping_error({"name": "n1", "node": {"name": "n1"}})

    assert str(err).startswith("kbus.toml: name: expected a table")


def test_a_section_that_is_not_a_table_is_an_error() -> None:
    assert str(mapping_error({"node": "n1"})) == "kbus.toml: node: expected a table, got 'n1'"
    assert mapping_error({"node": {"name": "n1"}, "actors": [1]}).key == "actors"
    assert mapping_error({"node": {"name": "n1"}, "actors": {"echo": 1}}).key == "actors.echo"


# --- files ---


def test_toml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nname = "n1"\nbind = [\n  "ipc://a"\n  "ipc://b"\n]\n')

    err = load_error(path)

    assert str(err).startswith(f"{path}: expected valid TOML, got ")
    assert "line 5" in str(err)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    err = load_error(tmp_path / "missing.toml")

    assert str(err) == (
        f"{tmp_path / 'missing.toml'}: expected a readable TOML file, got No such file or directory"
    )


def test_a_file_that_is_not_utf8_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "kbus.toml"
    path.write_bytes(b'[node]\nname = "\xff"\n')

    assert str(load_error(path)).startswith(f"{path}: expected ")


# --- environment ---


def test_env_wins_over_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path / "..")
    cwd = tmp_path.parent
    path = write(tmp_path, '[node]\nname = "n1"\nmax_frame_bytes = 10\n', "conf/kbus.toml")

    settings = load(
        path,
        env={
            "KBUS_NODE_NAME": "n9",
            "KBUS_NODE_BIND": "ipc://run/n9.sock, tcp://127.0.0.1:5555,",
            "KBUS_NODE_CAPTURE": "n9.buslog",
            "KBUS_NODE_MAX_FRAME_BYTES": "2048",
            "KBUS_NODE_REQUEST_TIMEOUT": "2.5",
            "KBUS_SECURITY_MODE": "curve",
            "KBUS_SECURITY_SECRET_KEY_FILE": "k/n9.key_secret",
        },
    )

    assert settings.node.name == "n9"
    # Paths and ipc endpoints from the environment are relative to the working directory.
    assert settings.node.bind == (f"ipc://{cwd}/run/n9.sock", "tcp://127.0.0.1:5555")
    assert settings.node.capture == cwd / "n9.buslog"
    assert settings.node.max_frame_bytes == 2048
    assert settings.node.request_timeout == 2.5
    assert settings.node.data_dir == tmp_path / "conf" / ".kbus"
    assert settings.security.mode == "curve"
    assert settings.security.secret_key_file == cwd / "k/n9.key_secret"


def test_the_environment_alone_cannot_turn_curve_off(tmp_path: Path) -> None:
    """Issue 18 item 5: KBUS_SECURITY_MODE switched a config that says curve to plain tcp."""
    plain = {"KBUS_SECURITY_MODE": "plain-insecure-for-benchmarks"}
    for text in ('[node]\nname = "n1"\n', '[node]\nname = "n1"\n[security]\nmode = "curve"\n'):
        path = write(tmp_path, text)
        error = load_error(path, env=plain)
        assert error.key == "KBUS_SECURITY_MODE" and error.source == "<env>"
        assert "only by security.mode in the config file" in str(error)
    # Saying what the file says already is fine, and so is turning CURVE on.
    path = write(tmp_path, '[node]\nname = "n1"\n[security]\nmode = "plain-insecure-for-benchmarks"\n')
    assert load(path, env=plain).security.mode == "plain-insecure-for-benchmarks"
    assert load(path, env={"KBUS_SECURITY_MODE": "curve"}).security.mode == "curve"


def test_env_can_switch_an_optional_setting_off_and_empty_a_list(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nname = "n1"\ncapture = "x.buslog"\nbind = ["ipc://a"]\n')

    node = load(path, env={"KBUS_NODE_CAPTURE": "", "KBUS_NODE_BIND": ""}).node

    assert (node.capture, node.bind) == (None, ())
    assert load(path, env={"KBUS_NODE_CAPTURE": "false"}).node.capture is None


def test_env_alone_can_supply_the_node() -> None:
    settings = from_mapping({}, env={"KBUS_NODE_NAME": "n1"})

    assert settings.node.name == "n1"


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("KBUS_NODE_MAX_FRAME_BYTES", "big", "expected an integer > 0, got 'big'"),
        ("KBUS_NODE_MAX_FRAME_BYTES", "-1", "expected an integer > 0, got -1"),
        ("KBUS_NODE_REQUEST_TIMEOUT", "soon", "expected a finite number of seconds > 0, got 'soon'"),
        ("KBUS_NODE_NAME", "a/b", "expected a node name"),
        ("KBUS_SECURITY_MODE", "off", "expected one of 'curve', 'plain-insecure-for-benchmarks'"),
    ],
)
def test_a_bad_env_value_names_the_variable(tmp_path: Path, var: str, value: str, expected: str) -> None:
    path = write(tmp_path, '[node]\nname = "n1"\n')

    err = load_error(path, env={var: value})

    assert (err.source, err.key) == ("<env>", var)
    assert str(err).startswith(f"<env>: {var}: {expected}")


def test_a_bad_env_list_item_names_its_index(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nname = "n1"\n')

    err = load_error(path, env={"KBUS_NODE_BIND": "ipc://a,udp://b"})

    assert str(err).startswith("<env>: KBUS_NODE_BIND[1]: expected an endpoint starting with")


def test_an_unknown_kbus_node_variable_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nname = "n1"\n')

    err = load_error(path, env={"KBUS_NODE_BNID": "ipc://a"})

    assert str(err).startswith("<env>: KBUS_NODE_BNID: expected one of KBUS_NODE_NAME, KBUS_NODE_BIND")
    assert "KBUS_SECURITY_ALLOW" in str(load_error(path, env={"KBUS_SECURITY_ALLOW": "x"}))


def test_other_variables_are_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nname = "n1"\n')
    env = {"KBUS_TEST_WORKERS": "2", "KBUS_PYTHON": "python3", "NODE_NAME": "x", "kbus_node_x": "1"}

    assert load(path, env=env).node.name == "n1"


def test_env_text_parses_as_toml_would() -> None:
    assert [_from_text(bool, t) for t in ("true", "Yes", "1", "on", "false", "NO", "0", "off")] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    assert _from_text(bool, "maybe") == "maybe"  # left for the converter to reject
    assert _from_text(int, " 42 ") == 42
    assert _from_text(float, "1e3") == 1000.0
    assert _from_text(tuple[int, ...], "1, 2,,3") == [1, 2, 3]
    assert _from_text(Path | None, "") is None


# --- keys and CURVE ---


def test_public_key_file_reads_a_zmq_certificate(tmp_path: Path) -> None:
    zmq_auth = pytest.importorskip("zmq.auth")
    (tmp_path / "keys").mkdir()
    public_file, _ = zmq_auth.create_certificates(str(tmp_path / "keys"), "n2")
    expected, _ = zmq_auth.load_certificate(public_file)
    path = write(
        tmp_path,
        """
        [node]
        name = "n1"
        [security]
        allow = [{ node = "n2", public_key_file = "keys/n2.key" }]
        [[peers]]
        name = "n2"
        endpoint = "ipc://n2.sock"
        public_key_file = "keys/n2.key"
        """,
    )

    settings = load(path, env={})

    assert settings.security.allow[0].public_key == expected.decode()
    assert settings.peers[0].public_key == expected.decode()


def test_a_bad_public_key_file_is_named(tmp_path: Path) -> None:
    write(tmp_path, "metadata\ncurve\n", "keys/empty.key")
    write(tmp_path, 'curve\n    public-key = "short"\n', "keys/short.key")
    toml = '[node]\nname = "n1"\n[[security.allow]]\nnode = "n2"\npublic_key_file = "keys/{}"\n'

    missing = load_error(write(tmp_path, toml.format("nope.key"), "a.toml"))
    empty = load_error(write(tmp_path, toml.format("empty.key"), "b.toml"))
    short = load_error(write(tmp_path, toml.format("short.key"), "c.toml"))

    assert missing.key == "security.allow[0].public_key_file"
    assert missing.expected == "a readable zmq public key file"
    assert "nope.key" in missing.got and "No such file" in missing.got
    assert empty.expected == 'a zmq key file with a line public-key = "..."'
    assert str(short).endswith(
        "security.allow[0].public_key_file: expected a Z85 public key (40 characters), got 'short'"
    )


def test_public_key_and_public_key_file_together_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, CERT, "n2.key")
    path = write(
        tmp_path,
        f'[node]\nname = "n1"\n[[peers]]\nname = "n2"\nendpoint = "ipc://x"\n'
        f'public_key = "{KEY}"\npublic_key_file = "n2.key"\n',
    )

    err = load_error(path)

    assert str(err) == (
        f"{path}: peers[0].public_key: expected public_key or public_key_file, not both, got both"
    )


@pytest.mark.parametrize(
    "key",
    [KEY[:-1], KEY + "x", KEY[:-1] + '"', KEY[:-1] + ",", "#" * 40, ""],
)
def test_z85_keys_are_checked(key: str) -> None:
    err = mapping_error(
        {"node": {"name": "n1"}, "peers": [{"name": "n2", "endpoint": "ipc://x", "public_key": key}]}
    )

    assert err.key == "peers[0].public_key"
    assert err.expected == "a Z85 public key (40 characters)"


def test_a_tcp_bind_with_curve_needs_a_secret_key_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nname = "n1"\nbind = ["tcp://127.0.0.1:5555"]\n')

    err = load_error(path)

    assert str(err) == (
        f"{path}: security.secret_key_file: expected a path (a tcp bind with CURVE needs "
        "security.secret_key_file), got nothing"
    )
    # The environment can open the same hole; it is closed the same way.
    ipc = write(tmp_path, '[node]\nname = "n1"\n', "ipc.toml")
    assert "a tcp bind with CURVE needs security.secret_key_file" in str(
        load_error(ipc, env={"KBUS_NODE_BIND": "tcp://127.0.0.1:5555"})
    )


def test_a_tcp_bind_is_allowed_with_a_secret_key_or_explicitly_plain() -> None:
    tcp = {"name": "n1", "bind": ["tcp://127.0.0.1:5555"]}

    curve = from_mapping({"node": tcp, "security": {"secret_key_file": "n1.key_secret"}})
    plain = from_mapping({"node": tcp, "security": {"mode": "plain-insecure-for-benchmarks"}})
    ipc = from_mapping({"node": {"name": "n1", "bind": ["ipc://a", "inproc://b"]}})

    assert curve.security.secret_key_file == Path("n1.key_secret")
    assert plain.node.bind == ("tcp://127.0.0.1:5555",)
    assert ipc.security.secret_key_file is None


def test_a_tcp_peer_with_curve_needs_a_secret_key_and_the_server_key() -> None:
    peer = {"name": "n2", "endpoint": "tcp://127.0.0.1:5556"}

    no_secret = mapping_error({"node": {"name": "n1"}, "peers": [peer]})
    no_server_key = mapping_error(
        {"node": {"name": "n1"}, "security": {"secret_key_file": "k"}, "peers": [peer]}
    )

    assert "a tcp peer with CURVE needs security.secret_key_file" in str(no_secret)
    assert no_server_key.key == "peers[0].public_key"
    assert str(no_server_key).endswith("got nothing")


def test_direct_construction_fails_closed_too() -> None:
    with pytest.raises(ConfigError, match=r"a tcp bind with CURVE needs security\.secret_key_file"):
        Settings(node=NodeSettings(name="n1", bind=("tcp://127.0.0.1:1",)))


# --- names ---


@pytest.mark.parametrize("name", ["", "a/b", "a b", "..", ".", "é"])
def test_bad_node_names_are_rejected(name: str) -> None:
    assert mapping_error({"node": {"name": name}}).key == "node.name"


@pytest.mark.parametrize("name", ["a/b/c", "a b", "/a", "a/", "", "a/..", "é"])
def test_bad_actor_names_are_rejected(name: str) -> None:
    err = mapping_error({"node": {"name": "n1"}, "actors": {name: {"type": "echo"}}})

    assert err.expected.startswith("an actor name")
    assert err.key == f'actors."{name}"'


def test_an_actor_table_may_not_name_itself() -> None:
    err = mapping_error({"node": {"name": "n1"}, "actors": {"echo": {"type": "echo", "name": "x"}}})

    assert err.key == "actors.echo.name"
    assert "the table's own name is its name" in err.expected


def test_peer_names_are_unique() -> None:
    peers = [{"name": "n2", "endpoint": "ipc://a"}, {"name": "n2", "endpoint": "ipc://b"}]

    err = mapping_error({"node": {"name": "n1"}, "peers": peers})

    assert str(err) == "kbus.toml: peers[1].name: expected a name no other entry of peers uses, got 'n2'"


# --- the example file, the Python entry points ---


def test_default_toml_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # the result must not depend on the working directory

    settings = load(DEFAULT_CONFIG, env={})

    here = DEFAULT_CONFIG.parent
    assert settings.node.name == "local"
    assert settings.node.bind == (f"ipc://{here}/run/local.sock",)
    assert settings.node.data_dir == here / "data"
    assert settings.node.capture is None
    assert settings.security == SecuritySettings(mode="curve")
    assert settings.actors == (ActorSpec(name="echo", type="echo"),)
    assert settings.peers == ()
    assert settings.extra == {}


def test_default_toml_states_the_real_defaults() -> None:
    text = DEFAULT_CONFIG.read_text(encoding="utf-8")
    node_part = text.split("\n[node]\n", 1)[1].split("\n[security]\n", 1)[0]
    commented = re.findall(r"^# (\w+) = (\S+)", node_part, flags=re.MULTILINE)
    defaults = {f.name: f.default for f in dataclasses.fields(NodeSettings)}

    shown = {key: tomllib.loads(f"v = {value}")["v"] for key, value in commented if key != "capture"}

    assert len(shown) >= 7
    assert all(shown[key] == defaults[key] for key in shown), shown


def test_settings_for_node_checks_like_a_file() -> None:
    settings = settings_for_node("n1", bind=["inproc://a"], request_timeout=2)

    assert settings.node == NodeSettings(name="n1", bind=("inproc://a",), request_timeout=2.0)
    assert settings.security == SecuritySettings()
    with pytest.raises(ConfigError, match=r"node\.bnid: expected a known key"):
        settings_for_node("n1", bnid=())
    with pytest.raises(ConfigError, match="a tcp bind with CURVE"):
        settings_for_node("n1", bind=("tcp://127.0.0.1:1",))


def test_direct_construction_checks_and_settles_types() -> None:
    node = NodeSettings(name="n1", bind=["inproc://a"], request_timeout=3, data_dir="d")  # type: ignore[arg-type]

    assert node.bind == ("inproc://a",)
    assert type(node.request_timeout) is float
    assert node.data_dir == Path("d")
    with pytest.raises(ConfigError) as info:
        NodeSettings(name="a/b")
    assert str(info.value).startswith("<python>: NodeSettings.name: expected a node name")


def test_settings_are_frozen() -> None:
    settings = settings_for_node("n1")

    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.node.name = "n2"  # type: ignore[misc]


def test_config_imports_only_the_standard_library() -> None:
    for module in Path(config.__file__).parent.glob("*.py"):
        tree = ast.parse(module.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in ("config", "_typeshed"), (
                    f"{module.name} imports {name}"
                )


# --- '..' (issue 18 item 7) ---


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('data_dir = "../elsewhere"', "node.data_dir"),
        ('capture = "logs/../../n1.buslog"', "node.capture"),
        ('data_dir = "/srv/kbus/../../etc"', "node.data_dir"),
        ('bind = ["ipc://../n1.sock"]', "node.bind[0]"),
        ('bind = ["ipc:///run/kbus/../n1.sock"]', "node.bind[0]"),
    ],
    ids=["data_dir", "capture", "absolute", "ipc", "absolute-ipc"],
)
def test_a_path_with_a_parent_step_is_refused(tmp_path: Path, text: str, key: str) -> None:
    """Relative paths stay inside the config file's folder; no path may step up with '..'."""
    error = load_error(write(tmp_path, f'[node]\nname = "n1"\n{text}\n'))
    assert error.key == key
    assert "without '..'" in error.expected


def test_the_environment_may_not_step_up_either(tmp_path: Path) -> None:
    error = load_error(write(tmp_path, '[node]\nname = "n1"\n'), env={"KBUS_NODE_DATA_DIR": "../x"})
    assert error.key == "KBUS_NODE_DATA_DIR"


def test_a_config_file_reached_through_a_parent_step_is_fine(tmp_path: Path) -> None:
    write(tmp_path, '[node]\nname = "n1"\ndata_dir = "d"\nbind = ["ipc://n1.sock"]\n', "conf/kbus.toml")
    (tmp_path / "other").mkdir()
    settings = load(tmp_path / "other" / ".." / "conf" / "kbus.toml", env={})
    assert settings.node.data_dir == tmp_path / "conf" / "d"
    assert settings.node.bind == (f"ipc://{tmp_path}/conf/n1.sock",)


def test_the_frame_limit_fits_the_largest_context_window_unless_set() -> None:
    """Issue 16: node.max_frame_bytes, when neither the file nor the environment sets it, carries a round
    of the largest [models.*] context window (10 bytes a token + 64 KiB, at least 1 MiB); a value given
    in [node] or KBUS_NODE_MAX_FRAME_BYTES wins."""
    models = {"small": {"context_window": 4096}, "big": {"context_window": 1_000_000}, "odd": {"x": 1}}
    assert from_mapping({"node": {"name": "n"}}).node.max_frame_bytes == 1 << 20
    assert from_mapping(
        {"node": {"name": "n"}, "models": {"s": {"context_window": 4096}}}
    ).node.max_frame_bytes == (1 << 20)
    big = from_mapping({"node": {"name": "n"}, "models": models}).node.max_frame_bytes
    assert big == config.frame_bytes_for(1_000_000) and 10_000_000 + (64 << 10) <= big < 10_000_000 + (
        128 << 10
    )
    assert big % (64 << 10) == 0
    given = {"node": {"name": "n", "max_frame_bytes": 2 << 20}, "models": models}
    assert from_mapping(given).node.max_frame_bytes == 2 << 20
    env = {"KBUS_NODE_MAX_FRAME_BYTES": "3145728"}
    assert from_mapping({"node": {"name": "n"}, "models": models}, env=env).node.max_frame_bytes == 3 << 20
    assert config.default_frame_bytes({"models": {"m": {"context_window": "many"}}}) == 1 << 20
