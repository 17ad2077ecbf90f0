"""Issue 18 item 4: the folder of an ipc socket. A missing one is created 0700; an existing one is never
changed (a bind used to chmod it to 0700, also through a symlink); one anyone may write into without the
sticky bit is refused. Real nodes, real ipc sockets.
"""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from actors.app.echo import EchoActor
from transport import Node, Peer, SecurityError
from transport.messages import Echo

pytestmark = pytest.mark.integration

WAIT = 10.0


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def serves(make_node: Callable[..., Node], endpoint: str) -> bool:
    server = make_node(f"s{uuid.uuid4().hex[:8]}", bind=[endpoint])
    server.spawn(EchoActor, "echo")
    client = make_node(f"c{uuid.uuid4().hex[:8]}", peers=[Peer(server.name, server.endpoints[0])])
    return bool(client.request(f"{server.name}/echo", Echo(seq=1), timeout=WAIT) == Echo(seq=1))


def test_a_missing_folder_is_created_private_at_every_level(
    make_node: Callable[..., Node], ipc_dir: Path
) -> None:
    folder = ipc_dir / "a" / "b"
    assert serves(make_node, f"ipc://{folder}/n.sock")
    assert mode(ipc_dir / "a") == 0o700
    assert mode(folder) == 0o700


@pytest.mark.parametrize("folder_mode", [0o755, 0o750, 0o1777, 0o711], ids=oct)
def test_an_existing_folder_is_never_changed(
    make_node: Callable[..., Node], ipc_dir: Path, folder_mode: int
) -> None:
    folder = ipc_dir / "shared"
    folder.mkdir()
    os.chmod(folder, folder_mode)
    assert serves(make_node, f"ipc://{folder}/n.sock")
    assert mode(folder) == folder_mode


def test_a_folder_behind_a_symlink_is_not_changed_either(
    make_node: Callable[..., Node], ipc_dir: Path
) -> None:
    target = ipc_dir / "real"
    target.mkdir()
    os.chmod(target, 0o755)
    (ipc_dir / "link").symlink_to(target)
    assert serves(make_node, f"ipc://{ipc_dir}/link/n.sock")
    assert mode(target) == 0o755


@pytest.mark.parametrize("folder_mode", [0o777, 0o773], ids=oct)
def test_a_folder_anyone_may_write_without_the_sticky_bit_is_refused(ipc_dir: Path, folder_mode: int) -> None:
    folder = ipc_dir / "open"
    folder.mkdir()
    os.chmod(folder, folder_mode)
    node = Node("n1", bind=[f"ipc://{folder}/n.sock"])
    with pytest.raises(SecurityError, match="writable by anyone and has no sticky bit"):
        node.start()
    assert not node.running
    assert mode(folder) == folder_mode
    assert not (folder / "n.sock").exists()


def test_an_abstract_socket_leaves_the_working_folder_alone(
    make_node: Callable[..., Node], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ipc://@name`` has no folder; the old code took the working folder for it and chmodded that."""
    os.chmod(tmp_path, 0o755)
    monkeypatch.chdir(tmp_path)
    assert serves(make_node, f"ipc://@kbus-test-{uuid.uuid4().hex}")
    assert mode(tmp_path) == 0o755
