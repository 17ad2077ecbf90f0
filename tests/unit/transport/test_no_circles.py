"""The I/O thread reaches its node through the ``IoHost`` interface only (issue 15, item 6): it never imports
``transport.node`` and never touches a private member of the node. (No module anywhere is in an import
circle: ``tests/test_layering.py`` checks that for every package.)"""

from __future__ import annotations

import ast
from pathlib import Path

TRANSPORT = Path(__file__).resolve().parents[3] / "transport"


def test_the_io_thread_never_imports_the_node_nor_touches_its_private_members() -> None:
    tree = ast.parse((TRANSPORT / "io_thread.py").read_text(encoding="utf-8"))
    imported = {
        module
        for n in ast.walk(tree)
        for module in (
            [n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in getattr(n, "names", [])]
        )
        if isinstance(n, ast.Import | ast.ImportFrom)
    }
    assert "transport.node" not in imported
    assert "transport.envelope" in imported  # the walk sees imports at all
    private = [
        f"{n.lineno}: node.{n.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
        and isinstance(n.value, ast.Name | ast.Attribute)
        and (n.value.id if isinstance(n.value, ast.Name) else n.value.attr) == "node"
    ]
    assert private == []
