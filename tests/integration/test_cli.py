"""The ``kbus`` command end to end: node, ping, keys, log show/verify, each in real processes."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import KbusNode

pytestmark = pytest.mark.integration

KBUS = [sys.executable, "-P", "-m", "actors.app.cli"]


def kbus(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KBUS, *args], capture_output=True, text=True, timeout=timeout, check=False)


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_node_ping_and_clean_shutdown_over_ipc(ipc_dir: Path, kbus_node: Callable[..., KbusNode]) -> None:
    config = write_config(
        ipc_dir / "n1.toml",
        """
[node]
name = "n1"
bind = ["ipc://n1.sock"]
capture = "n1.buslog"
[actors.echo]
type = "echo"
""",
    )
    node = kbus_node(config)
    ping = kbus("ping", f"ipc://{ipc_dir}/n1.sock", "--node", "n1", "--count", "3")
    assert ping.returncode == 0, ping.stderr
    assert ping.stdout.count("pong from n1/echo") == 3
    assert "3 sent, 3 answered" in ping.stdout

    assert node.stop() == 0
    assert "stopped" in "".join(node.output)

    # The node captured the exchange: readable, one line per record, JSON on request, and verified.
    log_file = ipc_dir / "n1.buslog"
    shown = kbus("log", "show", str(log_file))
    assert shown.returncode == 0, shown.stderr
    record_lines = [line for line in shown.stdout.splitlines() if not line.startswith("#")]
    assert len(record_lines) == 6
    assert sum("sys.ping" in line for line in record_lines) == 3
    as_json = kbus("log", "show", "--json", str(log_file))
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [r["at"] for r in records] == ["deliver", "send"] * 3
    assert records[1]["header"]["kind"] == "sys.pong"
    assert kbus("log", "verify", str(log_file)).returncode == 0

    # A torn tail is reported, not hidden.
    data = log_file.read_bytes()
    log_file.write_bytes(data[:-5])
    verified = kbus("log", "verify", str(log_file))
    assert verified.returncode == 1
    assert "torn" in verified.stdout.lower()


def test_ping_over_tcp_with_curve_and_a_refused_key(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode]
) -> None:
    keys = ipc_dir / "keys"
    for name in ("n1", "cli", "stranger"):
        made = kbus("keys", name, "--dir", str(keys))
        assert made.returncode == 0, made.stderr
    cli_public = next(line for line in kbus_public(keys / "cli.key").splitlines())
    config = write_config(
        ipc_dir / "n1.toml",
        f"""
[node]
name = "n1"
bind = ["tcp://127.0.0.1:0"]
[security]
secret_key_file = "keys/n1.key_secret"
allow = [{{ node = "cli", public_key = "{cli_public}" }}]
[actors.echo]
type = "echo"
""",
    )
    port = kbus_node(config).port
    ok = kbus(
        "ping",
        f"tcp://127.0.0.1:{port}",
        "--node",
        "n1",
        "--count",
        "2",
        "--server-key",
        str(keys / "n1.key"),
        "--key",
        str(keys / "cli.key_secret"),
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("pong from n1/echo") == 2
    refused = kbus(
        "ping",
        f"tcp://127.0.0.1:{port}",
        "--node",
        "n1",
        "--count",
        "1",
        "--timeout",
        "3",
        "--server-key",
        str(keys / "n1.key"),
        "--key",
        str(keys / "stranger.key_secret"),
    )
    assert refused.returncode == 1
    assert "NotDelivered" in refused.stdout
    assert "0 answered" in refused.stdout


def kbus_public(path: Path) -> str:
    for line in path.read_text().splitlines():
        if "public-key" in line:
            return line.split('"')[1]
    raise AssertionError(f"no public key in {path}")


def test_keys_are_private_and_never_overwritten(tmp_path: Path) -> None:
    made = kbus("keys", "n1", "--dir", str(tmp_path / "keys"))
    assert made.returncode == 0
    secret = tmp_path / "keys" / "n1.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    before = secret.read_bytes()
    again = kbus("keys", "n1", "--dir", str(tmp_path / "keys"))
    assert again.returncode == 1
    assert "not overwriting" in again.stderr
    assert secret.read_bytes() == before


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[node]\nname = "n1"\nmax_frame_bytes = "big"\n', "node.max_frame_bytes"),
        ('[node]\nname = "n1"\nbind = ["tcp://127.0.0.1:0"]\n', "secret_key_file"),
        ('[node]\nname = "n1"\n[actors.x]\ntype = "nope"\n', "actors.x.type"),
        ("[node\n", "n1.toml"),
    ],
    ids=["bad-type", "tcp-without-key", "unknown-actor-type", "not-toml"],
)
def test_a_bad_config_names_the_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    config = write_config(tmp_path / "n1.toml", text)
    result = kbus("node", "--config", str(config), timeout=30)
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------ one line and a non-zero exit (item 7)
def one_line_failure(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.count("\n") == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_a_node_on_a_tcp_port_in_use_fails_in_one_line(tmp_path: Path) -> None:
    """Issue 18 item 7: it printed a 24-line traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(
            tmp_path / "n1.toml",
            f'[node]\nname = "n1"\nbind = ["tcp://127.0.0.1:{port}"]\n'
            '[security]\nmode = "plain-insecure-for-benchmarks"\n',
        )
        result = kbus("node", "--config", str(config), timeout=30)
    # The plain-tcp warning is logged only once the node is up; it never got that far.
    one_line_failure(result, 2, f"cannot bind tcp://127.0.0.1:{port}", "in use")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('bind = ["ipc://../n1.sock"]', "node.bind[0]"),
        ('data_dir = "../data"', "node.data_dir"),
        ('capture = "../n1.buslog"', "node.capture"),
    ],
    ids=["bind", "data_dir", "capture"],
)
def test_a_parent_step_in_a_node_path_fails_in_one_line(tmp_path: Path, text: str, key: str) -> None:
    config = write_config(tmp_path / "n1.toml", f'[node]\nname = "n1"\n{text}\n')
    one_line_failure(kbus("node", "--config", str(config), timeout=30), 2, key, "without '..'")


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "."])
def test_a_key_name_is_a_node_name(tmp_path: Path, name: str) -> None:
    """Issue 18 item 7: ``kbus keys ../x --dir keys`` wrote outside ``--dir``."""
    (tmp_path / "keys").mkdir()
    one_line_failure(kbus("keys", name, "--dir", str(tmp_path / "keys")), 1, "not a node name")
    assert list(tmp_path.rglob("*.key*")) == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["foo://x", "--node", "n1"], "is not an endpoint"),
        (["ipc:///nonexistent/x.sock", "--node", "../n1"], "is not a node name"),
        (["tcp://127.0.0.1:9", "--node", "n1"], "--server-key"),
        (["tcp://127.0.0.1:9", "--node", "n1", "--server-key", "short"], "neither a 40-character key"),
        (
            ["tcp://127.0.0.1:9", "--node", "n1", "--plain", "--key", "/nonexistent/n.key_secret"],
            "cannot read",
        ),
        (["ipc:///nonexistent/x.sock", "--node", "n1", "--count", "0"], "--count"),
    ],
    ids=["scheme", "node-name", "no-server-key", "bad-server-key", "missing-key-file", "count"],
)
def test_a_bad_ping_argument_fails_in_one_line(args: list[str], needle: str) -> None:
    one_line_failure(kbus("ping", *args, timeout=30), 2, needle)


def test_a_log_read_by_a_reader_that_stops_early_ends_quietly() -> None:
    """Issue 16: ``kbus log show F | head -1``: the first line, then a quiet exit (no BrokenPipeError). The
    pipe holds 4 KiB, less than the listing (about 20 KiB), so the command is still writing when the
    reader goes."""
    log = Path(__file__).parents[1] / "replay" / "session_tool_round.buslog"
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    try:
        shown = subprocess.Popen([*KBUS, "log", "show", str(log)], stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as reader:
            assert reader.readline().startswith(b"# ")
        assert shown.wait(timeout=60) == 0  # the reader has gone, as head goes after its line
        assert shown.stderr is not None and shown.stderr.read() == b""
    finally:
        if shown.poll() is None:
            shown.kill()
        shown.wait()


def test_reading_a_missing_log_fails_in_one_line(tmp_path: Path) -> None:
    one_line_failure(kbus("log", "show", str(tmp_path / "none.buslog")), 1, "No such file")
