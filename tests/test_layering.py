"""Imports point one way: config <- transport <- actors (DESIGN.md §1), read from each module's ast; inside
``actors/``, rooms point one way too (the ``ACTOR_ROOMS`` table), and no first-party module is in a circle.

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
# actors/ is laid out in rooms, lowest first (issue 15): each room may import only the rooms its row names.
# "base" is the shared floor: the modules at the top of actors/ (BASE_MODULES). Any other module must sit in
# a room of this table, so a new subpackage has to be placed here before it can import anything.
BASE_MODULES = frozenset({"base", "types", "effects", "subprocesses", "errors"})
ACTOR_ROOMS: dict[str, frozenset[str]] = {
    "base": frozenset({"base"}),
    "codex": frozenset({"base", "codex"}),
    "router": frozenset({"base", "codex", "router"}),
    "inference": frozenset({"base", "router", "inference"}),
    "runs": frozenset({"base", "router", "inference", "runs"}),
    "conversation": frozenset({"base", "router", "inference", "runs", "conversation"}),
    "app": frozenset({"base", "codex", "router", "inference", "runs", "conversation", "app"}),
}
# Imports that break the table, each to be fixed (none today; keep it empty).
KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset()
# Module circles, each to be fixed (none today; keep it empty).
KNOWN_CIRCLES: frozenset[frozenset[str]] = frozenset()
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


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def actor_room(module: str) -> str | None:
    """The room of an ``actors`` module (or of a name imported from one), ``None`` outside ``actors``."""
    parts = module.split(".")
    if parts[0] != "actors":
        return None
    if len(parts) == 1 or parts[1] in BASE_MODULES:
        return "base"
    return parts[1]


def test_every_actors_module_sits_in_a_room() -> None:
    rooms = {actor_room(module_name(p)) for p in (ROOT / "actors").rglob("*.py")}
    assert rooms <= set(ACTOR_ROOMS), sorted(str(r) for r in rooms - set(ACTOR_ROOMS))


def test_actor_rooms_import_only_what_their_row_allows() -> None:
    """Issue 15: the table of allowed imports between the rooms of ``actors/``, every import form counted
    (function-local and ``TYPE_CHECKING`` imports too: they are how circles hide)."""
    bad, seen = [], set()
    for path in sorted((ROOT / "actors").rglob("*.py")):
        here = actor_room(module_name(path))
        assert here is not None
        for line, module in imported_modules(path):
            there = actor_room(module)
            if there is None or there in ACTOR_ROOMS[here]:
                continue
            seen.add((rel(path), module))
            if (rel(path), module) not in KNOWN_UPWARD:
                bad.append(f"{rel(path)}:{line} ({here}) imports {module} ({there})")
    assert not bad, "\n".join(bad)
    assert seen >= KNOWN_UPWARD, f"fixed, remove from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - seen)}"


def module_graph() -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports (every form; a name imported from a module
    counts as that module). ``from package import submodule`` counts as the submodule only: a package's
    ``__init__`` is imported before any of its modules anyway, so that edge is no circle of its own."""
    names = {module_name(p): p for p in source_files()}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        by_line: dict[int, set[str]] = {}
        for line, module in imported_modules(path):
            target = module if module in names else module.rpartition(".")[0]
            if target in names and target != name:
                by_line.setdefault(line, set()).add(target)
        for targets in by_line.values():
            graph[name] |= {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_circles_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]


def test_no_module_is_in_an_import_circle() -> None:
    """Issue 15: no import circles among config, transport and actors modules, however an import is written
    (a package's ``__init__`` counts as the package)."""
    found = set(circles(module_graph()))
    assert found <= KNOWN_CIRCLES, [sorted(c) for c in found - KNOWN_CIRCLES]
    assert found >= KNOWN_CIRCLES, (
        f"fixed, remove from KNOWN_CIRCLES: {[sorted(c) for c in KNOWN_CIRCLES - found]}"
    )
