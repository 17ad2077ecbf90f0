"""The transport imports in one direction (issue 15, item 6): no circle among its modules, counting every
import wherever it sits (module level, inside functions, under TYPE_CHECKING), and the I/O thread reaches its
node through the ``IoHost`` interface only, never a private member."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TRANSPORT = ROOT / "transport"


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in sorted(TRANSPORT.glob("*.py")):
        name = f"transport.{path.stem}" if path.stem != "__init__" else "transport"
        out = edges.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transport."):
                out.add(node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.startswith("transport."))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    return found


def test_no_import_circle_inside_the_transport() -> None:
    edges = graph()
    assert "transport.messages" in edges["transport.codec"]  # the graph is read at all
    assert cycles(edges) == []


def test_the_io_thread_never_imports_the_node_nor_touches_its_private_members() -> None:
    source = (TRANSPORT / "io_thread.py").read_text(encoding="utf-8")
    assert "transport.node" not in graph()["transport.io_thread"]
    tree = ast.parse(source)
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
