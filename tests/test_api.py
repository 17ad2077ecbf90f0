"""The public API, pinned (issue 15; as httpx's ``test_exported_members``): every package's ``__init__`` says
what it offers in its docstring and exports exactly its public names in ``__all__`` (in ruff's order); every
name it exports is really there."""

from __future__ import annotations
import __future__

import importlib
import types

import pytest

FACES = (
    "actors",
    "actors.app",
    "actors.codex",
    "actors.conversation",
    "actors.inference",
    "actors.router",
    "actors.router.providers",
    "actors.runs",
    "config",
    "transport",
)


def isort_order(name: str) -> tuple[int, str]:
    """The order ruff keeps ``__all__`` in (RUF022, isort style): CONSTANTS, then Classes, then functions."""
    kind = 0 if name.isupper() or (name.upper() == name and "_" in name) else 1 if name[:1].isupper() else 2
    return kind, name


def public_names(module: types.ModuleType) -> list[str]:
    """What a face offers: its public names, less the submodules (a package holds them once imported) and
    the ``from __future__`` feature objects."""
    names = (
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and not isinstance(value, __future__._Feature)
    )
    return sorted(names, key=isort_order)


@pytest.mark.parametrize("name", FACES)
def test_face_exports_exactly_its_public_names(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__ and module.__doc__.strip(), f"{name}/__init__.py does not say what it offers"
    exported = list(module.__all__)
    assert exported == sorted(exported, key=isort_order), f"{name}.__all__ is not in ruff's (isort) order"
    assert exported == public_names(module), f"{name}: __all__ and the public names differ"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not hold: {missing}"


def test_every_package_has_a_face_in_the_table() -> None:
    """A new package must be added to FACES, so its face is pinned too."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    packages = {
        ".".join(p.parent.relative_to(root).parts)
        for top in ("actors", "config", "transport")
        for p in (root / top).rglob("__init__.py")
    }
    assert packages == set(FACES)
