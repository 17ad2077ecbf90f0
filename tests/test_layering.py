"""Imports point one way: config <- transport <- actors (DESIGN.md §1), read from each module's ast.

Also: no pickle anywhere (DESIGN.md §3), msgpack only in the two modules that own the wire format, and the
three packages imported from one folder (STYLE.md §3.2).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("config", "transport", "actors")
# package -> the first-party packages it must never import.
FORBIDDEN: dict[str, frozenset[str]] = {
    "config": frozenset({"transport", "actors"}),
    "transport": frozenset({"actors"}),
    "actors": frozenset(),
}
MSGPACK_OWNERS = frozenset({"transport/codec.py", "transport/capture.py"})
PICKLE_MODULES = frozenset({"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve", "marshal"})
PICKLE_CALLS = frozenset({"send_pyobj", "recv_pyobj"})  # pyzmq's pickle helpers (DESIGN.md §3)


def source_files() -> list[Path]:
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert files, f"no sources under {ROOT}"
    return files


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def imported_modules(path: Path, root: Path = ROOT) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import in ``path``, wherever it sits (module level,
    inside functions, under TYPE_CHECKING), and for ``importlib.import_module("...")`` / ``__import__``
    calls with a literal name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    # The package a relative import starts from: the folder, for __init__.py and plain modules alike.
    package_parts = list(path.relative_to(root).parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # `from transport import codec` imports transport.codec too
                yield node.lineno, f"{module}.{alias.name}" if module else alias.name
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield node.lineno, arg.value


def top(module: str) -> str:
    return module.partition(".")[0]


def test_sources_are_found() -> None:
    found = {rel(p) for p in source_files()}
    assert {"transport/codec.py", "transport/node.py", "actors/base.py", "config/settings.py"} <= found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package: str) -> None:
    """DESIGN.md §1: config imports neither transport nor actors; transport never imports actors."""
    bad = [
        f"{rel(path)}:{line} imports {module}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, module in imported_modules(path)
        if top(module) in FORBIDDEN[package]
    ]
    assert not bad, "\n".join(bad)


def test_no_pickle_anywhere() -> None:
    """DESIGN.md §3: no pickle anywhere on the wire (send_pyobj is banned)."""
    bad = []
    for path in source_files():
        for line, module in imported_modules(path):
            if top(module) in PICKLE_MODULES:
                bad.append(f"{rel(path)}:{line} imports {module}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in PICKLE_CALLS:
                bad.append(f"{rel(path)}:{node.lineno} uses {node.attr}")
    assert not bad, "\n".join(bad)


def test_msgpack_only_in_codec_and_capture() -> None:
    """transport/codec.py and transport/capture.py own the wire format; nothing else speaks msgpack."""
    users = {
        rel(path)
        for path in source_files()
        for _, module in imported_modules(path)
        if top(module) == "msgpack"
    }
    assert users <= MSGPACK_OWNERS, sorted(users - MSGPACK_OWNERS)
    assert "transport/codec.py" in users  # the check itself sees msgpack imports


def test_the_import_walker_sees_every_form(tmp_path: Path) -> None:
    """The checks above are only as good as this walker: every way to import must show up."""
    text = (
        "import actors.base\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from actors import echo\n"
        "def f():\n"
        "    import pickle\n"
        "    from .. import actors as a\n"
        "    from . import node\n"
        "    import importlib\n"
        "    importlib.import_module('actors.cli')\n"
    )
    (tmp_path / "transport").mkdir()
    path = tmp_path / "transport" / "mod.py"
    path.write_text(text, encoding="utf-8")
    modules = {m for _, m in imported_modules(path, tmp_path)}
    assert {"actors.base", "actors", "actors.echo", "pickle", "actors.cli", "transport.node"} <= modules
    assert ".actors" not in modules


def test_packages_come_from_one_folder() -> None:
    """STYLE.md §3.2: actors, config and transport must be imported from the same folder."""
    if not (ROOT / "config" / "__init__.py").exists():
        pytest.skip("config/__init__.py does not exist yet: the config package cannot be imported")
    roots = {}
    for name in PACKAGES:
        module = importlib.import_module(name)
        assert module.__file__ is not None, f"{name} is a namespace package (no __init__.py)"
        roots[name] = Path(module.__file__).resolve().parents[1]
    assert len(set(roots.values())) == 1, roots
