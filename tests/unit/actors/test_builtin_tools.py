"""The built-in tools of the main job: the calculator's allow-list and bounds, the file tools' confinement."""

from __future__ import annotations

import inspect
import os
import typing
from pathlib import Path

import pytest

from actors.app.builtin_tools import MAX_EXPRESSION_CHARS, ToolRefused, builtin_tools, calculate


# ------------------------------------------------------------------------------------------ calculator
@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("12 * 7", "84"),
        ("(12 + 30) * 2", "84"),
        ("-3 + +5", "2"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("2 ^ 10", "1024"),
        ("6 \u00d7 7", "42"),
        ("84 \u00f7 2", "42"),
        ("2 ** -1", "0.5"),
        ("sqrt(16)", "4"),
        ("round(pi, 3)", "3.142"),
        ("max(3, 9, 4) - min(3, 9, 4)", "6"),
        ("factorial(10)", "3628800"),
        ("0.1 + 0.2", "0.3"),
        ("1.5e3", "1500"),
        ("12 * 7 =", "84"),
    ],
)
def test_calculator_computes(expression: str, value: str) -> None:
    assert calculate(expression) == f"{expression.rstrip('= ')} = {value}"


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("9**9**9", "too large"),  # refused by a size check before computing (else: minutes, GBs)
        ("2 ** 100000", "too large"),
        ("10 ** 4000 * 10 ** 4000", "too large"),
        ("factorial(100000)", "factorial is limited"),
        ("1e308 * 10", "overflow"),
        ("2.0 ** 5000.5", "too large"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("sqrt(-1)", "sqrt"),
        ("__import__('os').system('true')", "only these functions"),
        ("open('x')", "only these functions"),
        ("x + 1", "unknown name 'x'"),
        ("(1).__class__", "not allowed"),
        ("[1, 2]", "not allowed"),
        ("'a' * 3", "not allowed"),
        ("True + 1", "not allowed"),
        ("1 if 1 else 2", "not allowed"),
        ("lambda: 1", "not allowed"),
        ("3 & 1", "not allowed"),
        ("2 < 3", "not allowed"),
        ("sqrt(x=4)", "only these functions"),
        ("1 +", "not an arithmetic expression"),
        ("", "empty"),
        ("1" + "+1" * MAX_EXPRESSION_CHARS, "longer than"),
    ],
)
def test_calculator_refuses_with_a_clear_reason(expression: str, reason: str) -> None:
    with pytest.raises(ToolRefused, match=reason):
        calculate(expression)


def test_tools_have_the_signatures_and_docs_a_registry_derives_schemas_from(tmp_path: Path) -> None:
    tools = builtin_tools(tmp_path)
    assert [t.__name__ for t in tools] == ["calculate", "read_file", "list_dir"]
    for tool in tools:
        assert tool.__doc__ and tool.__doc__.strip()
        hints = typing.get_type_hints(tool)
        assert hints.pop("return") is str
        assert set(hints.values()) == {str}
        assert list(hints) == list(inspect.signature(tool).parameters)


# ---------------------------------------------------------------------------------------------- files
@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "work"
    (root / "sub").mkdir(parents=True)
    (root / "notes.txt").write_text("the answer is 42\n")
    (root / "sub" / "deep.txt").write_text("deep")
    (tmp_path / "secret.txt").write_text("outside")
    return root


def tool(root: Path, name: str, **limits: int) -> typing.Callable[..., str]:
    return next(t for t in builtin_tools(root, **limits) if t.__name__ == name)


def test_read_file_reads_inside_the_working_directory(folder: Path) -> None:
    read = tool(folder, "read_file")
    assert read("notes.txt") == "the answer is 42\n"
    assert read("sub/deep.txt") == "deep"
    assert read("sub/../notes.txt") == "the answer is 42\n"  # a '..' that stays inside is fine
    assert read(str(folder / "notes.txt")) == "the answer is 42\n"  # an absolute path inside too


def test_read_file_truncates_long_files(folder: Path) -> None:
    (folder / "long.txt").write_text("x" * 1000)
    shown = tool(folder, "read_file", max_chars=100)("long.txt")
    assert shown.startswith("x" * 100 + "\n[truncated")
    assert "1000 bytes" in shown
    assert shown.count("x") == 100


@pytest.mark.parametrize("path", ["../secret.txt", "sub/../../secret.txt", "/etc/passwd", "/"])
def test_file_tools_refuse_paths_outside_the_working_directory(folder: Path, path: str) -> None:
    for name in ("read_file", "list_dir"):
        with pytest.raises(ToolRefused, match="outside the working directory"):
            tool(folder, name)(path)


def test_file_tools_refuse_symlinks_leading_outside(folder: Path, tmp_path: Path) -> None:
    (folder / "link.txt").symlink_to(tmp_path / "secret.txt")
    (folder / "linkdir").symlink_to(tmp_path)
    (folder / "inner.txt").symlink_to(folder / "notes.txt")
    read, ls = tool(folder, "read_file"), tool(folder, "list_dir")
    with pytest.raises(ToolRefused, match="outside"):
        read("link.txt")
    with pytest.raises(ToolRefused, match="outside"):
        read("linkdir/secret.txt")
    with pytest.raises(ToolRefused, match="outside"):
        ls("linkdir")
    assert read("inner.txt") == "the answer is 42\n"  # a link that stays inside is followed


def test_a_missing_path_outside_is_refused_as_outside_not_as_missing(folder: Path) -> None:
    with pytest.raises(ToolRefused, match="outside"):
        tool(folder, "read_file")("../nothing-here.txt")
    with pytest.raises(ToolRefused, match="no such file"):
        tool(folder, "read_file")("nothing-here.txt")


def test_read_file_refuses_directories_binaries_and_special_files(folder: Path) -> None:
    read = tool(folder, "read_file")
    with pytest.raises(ToolRefused, match="is a directory"):
        read("sub")
    (folder / "blob.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ToolRefused, match="binary"):
        read("blob.bin")
    os.mkfifo(folder / "pipe")
    with pytest.raises(ToolRefused, match="not a regular file"):
        read("pipe")  # would block forever if opened
    with pytest.raises(ToolRefused, match="NUL"):
        read("notes\0.txt")


def test_list_dir_lists_bounded_and_marks_kinds(folder: Path) -> None:
    (folder / "a-link").symlink_to(folder / "notes.txt")
    ls = tool(folder, "list_dir")
    assert ls().splitlines() == ["a-link@", "notes.txt", "sub/"]
    assert ls("sub") == "deep.txt"
    for i in range(5):
        (folder / "sub" / f"f{i}").write_text("")
    assert tool(folder, "list_dir", max_entries=3)("sub").splitlines() == [
        "deep.txt",
        "f0",
        "f1",
        "[and 3 more entries]",
    ]
    with pytest.raises(ToolRefused, match="not a directory"):
        ls("notes.txt")
    (folder / "empty").mkdir()
    assert ls("empty") == "(empty directory)"


def test_builtin_tools_needs_an_existing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        builtin_tools(tmp_path / "missing")
    with pytest.raises(ValueError):
        builtin_tools(tmp_path, max_chars=0)
