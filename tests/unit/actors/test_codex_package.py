"""The codex package's face and floor: ``actors.codex.__all__`` is sorted and is exactly its public names, and
no codex module imports the Router, the application's wiring or anything above ``codex`` in the floors
(shared bases < codex < router < inference < runs < conversation < app), at module level or in a function."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import actors.codex

CODEX = Path(actors.codex.__file__).parent
# What codex may import of the first party: itself, the shared bases, and the lower top-level packages.
ALLOWED_PREFIXES = ("actors.codex", "transport", "config")
ALLOWED_BASES = frozenset({"actors.base", "actors.types", "actors.effects", "actors.subprocesses"})


def _isort_style(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps: CONSTANTS, then Classes, then functions, each alphabetical."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_the_face_lists_exactly_its_public_names_sorted() -> None:
    public = {
        name
        for name, value in vars(actors.codex).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert actors.codex.__all__ == sorted(actors.codex.__all__, key=_isort_style)
    assert set(actors.codex.__all__) == public


def _first_party_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # ``from actors import nodes`` names the module in the alias
            found += [
                (node.lineno, f"{node.module}.{alias.name}")
                for alias in node.names
                if node.module == "actors"
            ]
    return [(line, name) for line, name in found if name.split(".")[0] in {"actors", "transport", "config"}]


def test_codex_imports_nothing_above_its_floor() -> None:
    """The circle codex -> nodes -> router -> providers.codex -> codex stays broken."""
    bad = []
    for path in sorted(CODEX.glob("*.py")):
        for line, name in _first_party_imports(path):
            if name == "actors" or name in ALLOWED_BASES or name.startswith(ALLOWED_PREFIXES):
                continue
            bad.append(f"{path.name}:{line} imports {name}")
    assert bad == []
