"""``transport/WIRE.md`` is enough to write a client (issue 18 item 8), and its tables are the registry's.

The client (``tests/peers/wire_client.py``) is written from WIRE.md alone; these tests check that it
imports nothing of kbus, run it as its own process against a real ``kbus node`` over ipc, and check that
the committed WIRE.md is what ``scripts/wire-doc`` generates from the registry today.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import KbusNode
from integration.test_node_hardening import echo_node_config

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "tests" / "peers" / "wire_client.py"
WIRE_DOC = ROOT / "scripts" / "wire-doc"


def test_the_wire_client_imports_only_pyzmq_msgpack_and_the_standard_library() -> None:
    tree = ast.parse(CLIENT.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").partition(".")[0])
    foreign = roots - set(sys.stdlib_module_names) - {"zmq", "msgpack", "__future__"}
    assert not foreign, f"the wire client imports {sorted(foreign)}"


@pytest.mark.integration
def test_a_client_built_from_wire_md_runs_echo_ping_a_tell_an_expired_deadline_and_an_unknown_actor(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode]
) -> None:
    kbus_node(echo_node_config(ipc_dir))
    done = subprocess.run(
        [sys.executable, "-P", str(CLIENT), f"ipc://{ipc_dir}/n1.sock", "--node", "n1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["kbus_modules"] == []  # nothing of kbus was loaded, not even indirectly

    reply = {"src": "n1/echo", "dst": "wc/main", "flow": "reply"}
    assert result["echo"] == {
        **reply,
        "kind": "echo",
        "body": {"payload": "0001", "text": "hi", "seq": 7, "data": None},
    }
    assert result["ping"] == {**reply, "kind": "sys.pong", "body": {"nonce": 42, "actor": "n1/echo"}}
    assert result["stream"] == [["part", 0], ["part", 1], ["part", 2], ["reply", 3]]

    errors = {e["re"]: e for e in result["tell_errors"]}
    assert set(errors) == {"failing", "lost"}
    assert errors["failing"]["flow"] == "tell" and errors["failing"]["src"] == "n1/echo"
    assert errors["failing"]["body"]["error"] == "protocol"
    assert errors["lost"]["src"] == "n1/node" and errors["lost"]["body"]["error"] == "not_delivered"
    assert result["after_tells"]["body"]["nonce"] == 1  # the good tell was answered with nothing

    assert result["expired"]["answered"] is False
    assert result["expired"]["next"]["body"] == {"nonce": 2, "actor": "n1/echo"}
    assert result["stats"]["expired_on_arrival"] == 1

    unknown = result["unknown_actor"]
    assert unknown["kind"] == "sys.error" and unknown["src"] == "n1/node" and unknown["flow"] == "reply"
    assert unknown["body"]["error"] == "not_delivered"
    assert unknown["body"]["message"] == "no actor n1/ghost"
    assert result["stats"] == {"kind": "sys.node_stats", "expired_on_arrival": 1, "actors": ["echo"]}


def wire_doc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", str(WIRE_DOC), *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_the_committed_wire_md_is_what_the_registry_generates(tmp_path: Path) -> None:
    checked = wire_doc("--check")
    assert checked.returncode == 0, checked.stderr
    # And the check is real: a copy with one body row fewer, or a tag fewer, fails it.
    text = (ROOT / "transport" / "WIRE.md").read_text()
    for drifted in (
        text.replace("| `nonce` | int | `0` |\n", "", 1),
        text.replace("### `sys.stats`\n", "### `sys.statistics`\n", 1),
    ):
        assert drifted != text
        copy = tmp_path / "WIRE.md"
        copy.write_text(drifted)
        failed = wire_doc("--check", "--file", str(copy))
        assert failed.returncode == 1
        assert failed.stderr.count("\n") == 1 and "differs from the message registry" in failed.stderr


def test_wire_md_lists_every_registered_tag_and_error() -> None:
    from actors.app.wiring import registry

    text = (ROOT / "transport" / "WIRE.md").read_text()
    reg = registry()
    missing = [tag for tag in reg.tags if f"### `{tag}`\n" not in text]
    assert not missing
    assert all(f"| `{name}` |" in text for name in reg.errors.names())
