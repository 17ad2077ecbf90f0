"""Built-in tools for the main job (``kbus run`` / ``kbus chat``): a calculator and read-only file access.

Each tool is a plain function with type hints and a docstring, so a tool registry can derive its name,
description and JSON schema from it. A tool either returns its result as text or raises ``ToolRefused``
with a one-line reason meant for the model (and the user) to read.

- ``calculate(expression)``: returns ``"EXPRESSION = VALUE"`` (the embedded 135M model copies that line
  into its answer; after a bare number it rambled). Arithmetic over an AST allow-list, never ``eval``:
  numbers, ``+ - * / // % **``, parentheses, unary minus and plus, the constants ``pi``/``e``/``tau``
  and a few ``math`` functions. ``^`` is read as a power, the multiplication and division signs as
  ``*`` and ``/``.
  Sizes are bounded: the expression's length, every integer's size in bits (checked *before* a power is
  computed, so ``9**9**9`` is refused at once) and float overflow.
- ``read_file(path)`` and ``list_dir(path)``: read-only, confined to one working directory. A path is
  resolved (symlinks followed) and must end up inside the directory: absolute paths elsewhere, ``..``
  escapes and symlinks leading out are refused. Output is bounded (``max_chars``; ``max_entries``).
  Confinement is checked when the path is resolved; a symlink swapped in between that check and the read
  is not guarded against (the tools are meant for a user's own folder, not a hostile one).

The workspace tools (``workspace_tools``; ``register_workspace_tools`` registers them as mutating, for plan
mode and the permission hook) change files, confined to the same folder by the same resolution:

- ``write_file(path, content)``: creates or replaces a file (parent folders made as needed), atomically (a
  temporary file renamed over it), keeping an existing file's mode.
- ``edit_file(path, old_text, new_text)``: replaces the one exact occurrence of ``old_text``; none or several
  is an error result that says how many.
- ``run_command(command, timeout_seconds)``: ``/bin/sh -c COMMAND`` in the working directory with stdin
  closed, in its own process group. Past its timeout, or when the ``cancel`` event is set, the whole group is
  killed (SIGKILL); processes it leaves running in its group are ended when it returns. Each output stream is
  capped at ``max_output`` bytes and the full size is noted. Its environment is this process's without any
  credential: every variable ``secret_env`` names (the CLI passes each ``api_key_env`` of the Router catalog)
  and every variable whose name contains KEY, TOKEN, SECRET, PASSWORD, PASSWD or CREDENTIAL (any case) is
  removed (``command_environment``).

Each records what it wrote in the ``TouchedFiles`` it was given: the two file tools the path, and
``run_command`` (which cannot know) the "everything" mark, so the next checkpoint covers the whole tree.
"""

from __future__ import annotations

import ast
import contextlib
import math
import operator
import os
import re
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from actors.subprocesses import run_bounded

if TYPE_CHECKING:
    from actors.conversation.checkpoints import TouchedFiles
    from actors.conversation.tools import ToolRegistry

__all__ = [
    "MAX_EXPRESSION_CHARS",
    "MAX_INT_BITS",
    "WORKSPACE_TOOLS",
    "ToolRefused",
    "builtin_tools",
    "calculate",
    "command_environment",
    "register_workspace_tools",
    "workspace_tools",
]

MAX_EXPRESSION_CHARS: Final = 500
MAX_INT_BITS: Final = 4096  # about 1233 decimal digits
MAX_EXPONENT: Final = 10_000  # for float powers; integer powers are bounded by MAX_INT_BITS
MAX_FILE_CHARS: Final = 4000
MAX_DIR_ENTRIES: Final = 200
MAX_WRITE_BYTES: Final = 4 * 1024 * 1024  # what write_file and edit_file write at most
COMMAND_TIMEOUT: Final = 60.0  # seconds run_command gives a command unless told otherwise
MAX_COMMAND_TIMEOUT: Final = 600.0
MAX_COMMAND_OUTPUT: Final = 8000  # bytes kept of each output stream of run_command
WORKSPACE_TOOLS: Final = ("write_file", "edit_file", "run_command")
SECRET_NAME: Final = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


class ToolRefused(ValueError):
    """A tool call a built-in tool will not (or cannot) carry out; the message says why, in one line."""


# ------------------------------------------------------------------------------------------ calculator

Number = int | float

_BINARY: Final[dict[type[ast.operator], Callable[[Number, Number], Number]]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: Final[dict[type[ast.unaryop], Callable[[Number], Number]]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_CONSTANTS: Final[dict[str, float]] = {"pi": math.pi, "e": math.e, "tau": math.tau}


def _round(x: Number, digits: Number = 0) -> Number:
    if not isinstance(digits, int) or abs(digits) > 100:
        raise ToolRefused("round(x, digits) needs a whole number of digits between -100 and 100")
    return round(x, digits) if digits else round(x)


_FUNCTIONS: Final[dict[str, Callable[..., Number]]] = {
    "abs": abs,
    "round": _round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "log10": math.log10,
    "log2": math.log2,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "floor": math.floor,
    "ceil": math.ceil,
    "factorial": math.factorial,
}
_MAX_FACTORIAL: Final = 500  # 500! has about 3767 bits


def _check_size(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolRefused(f"the result is too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and math.isnan(value):
        raise ToolRefused("the result is not a number")
    if isinstance(value, float) and math.isinf(value):
        raise ToolRefused("the result is too large (floating-point overflow)")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(base, int) and isinstance(exponent, int) and exponent >= 0:
        # Refuse before computing: bits(base ** n) >= n * (bits(base) - 1), so this bound never refuses a
        # result that would fit, and whatever it lets through has at most n * bits(base) bits (small).
        if base not in (-1, 0, 1) and exponent * max(1, abs(base).bit_length() - 1) > MAX_INT_BITS:
            raise ToolRefused(f"the power {base}**{exponent} is too large (more than {MAX_INT_BITS} bits)")
        power: int = base**exponent
        return power
    if abs(exponent) > MAX_EXPONENT:
        raise ToolRefused(f"the exponent {exponent} is too large (at most {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise ToolRefused("division by zero (zero to a negative power)")
    try:
        result = math.pow(base, exponent)
    except OverflowError:
        raise ToolRefused("the result is too large (floating-point overflow)") from None
    except ValueError:
        raise ToolRefused(f"{base}**{exponent} is not a real number") from None
    return result


def _evaluate(node: ast.AST) -> Number:
    match node:
        case ast.Expression(body=body):
            return _evaluate(body)
        case ast.Constant(value=value) if type(value) in (int, float):
            assert isinstance(value, int | float)
            return _check_size(value)
        case ast.Name(id=name) if name in _CONSTANTS:
            return _CONSTANTS[name]
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
            return _UNARY[type(op)](_evaluate(operand))
        case ast.BinOp(left=left, op=ast.Pow(), right=right):
            return _check_size(_power(_evaluate(left), _evaluate(right)))
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            a, b = _evaluate(left), _evaluate(right)
            try:
                return _check_size(_BINARY[type(op)](a, b))
            except ZeroDivisionError:
                raise ToolRefused("division by zero") from None
            except OverflowError:
                raise ToolRefused("the result is too large (floating-point overflow)") from None
        case ast.Call(func=ast.Name(id=name), args=args, keywords=[]) if name in _FUNCTIONS:
            values = [_evaluate(arg) for arg in args]
            if name == "factorial" and values and isinstance(values[0], int) and values[0] > _MAX_FACTORIAL:
                raise ToolRefused(f"factorial is limited to n <= {_MAX_FACTORIAL}")
            try:
                return _check_size(_FUNCTIONS[name](*values))
            except ToolRefused:
                raise
            except (TypeError, ValueError) as exc:
                raise ToolRefused(f"{name}: {exc}") from None
            except OverflowError:
                raise ToolRefused(f"{name}: the result is too large") from None
        case ast.Name(id=name):
            known = ", ".join([*_CONSTANTS, *_FUNCTIONS])
            raise ToolRefused(f"unknown name {name!r} (known: {known})")
        case ast.Call():
            raise ToolRefused(f"only these functions can be called: {', '.join(_FUNCTIONS)}")
    raise ToolRefused(f"not allowed in a calculation: {type(node).__name__}")


def _format(value: Number) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.15g}"
    return str(value)


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression; returns "EXPRESSION = VALUE", e.g. "6 * 7 = 42".

    Supports numbers, + - * / // % ** (or ^), parentheses, pi, e, and the functions sqrt, exp, log,
    log10, log2, sin, cos, tan, floor, ceil, abs, round, min, max, factorial.

    Args:
        expression: the arithmetic to evaluate, e.g. "(12 + 30) * 2".
    """
    text = expression.strip().rstrip("=").strip()
    if not text:
        raise ToolRefused("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolRefused(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    shown, text = text, text.replace("^", "**").replace("\u00d7", "*").replace("\u00f7", "/")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolRefused(f"not an arithmetic expression: {expression.strip()[:80]!r}") from None
    except (ValueError, MemoryError, RecursionError):  # NUL bytes, absurd nesting
        raise ToolRefused("not an arithmetic expression") from None
    try:
        return f"{shown} = {_format(_evaluate(tree))}"
    except RecursionError:
        raise ToolRefused("the expression is nested too deeply") from None


# ---------------------------------------------------------------------------------------------- files


class _Folder:
    """One working directory: resolves a tool's path argument inside it, or refuses."""

    def __init__(self, workdir: str | os.PathLike[str]) -> None:
        root = Path(workdir).resolve(strict=True)
        if not root.is_dir():
            raise NotADirectoryError(f"{workdir} is not a directory")
        self.root = root

    def resolve(self, path: str) -> Path:
        text = path.strip() or "."
        if "\0" in text:
            raise ToolRefused("a path cannot contain a NUL character")
        candidate = Path(text)
        if not candidate.is_absolute():
            candidate = self.root / candidate
        try:
            resolved = candidate.resolve(strict=True)  # follows every symlink, so a link out is seen
        except FileNotFoundError:
            resolved = candidate.resolve(strict=False)
            if not resolved.is_relative_to(self.root):
                raise self._outside(path) from None
            raise ToolRefused(f"no such file or directory: {self.shown(resolved)}") from None
        except (OSError, RuntimeError) as exc:  # symlink loops, permissions
            raise ToolRefused(f"cannot resolve {path!r}: {type(exc).__name__}") from None
        if not resolved.is_relative_to(self.root):
            raise self._outside(path)
        return resolved

    def resolve_target(self, path: str) -> Path:
        """A path a tool may write: it need not exist, but after every existing symlink on it is followed it
        must be inside the directory (and not the directory itself)."""
        text = path.strip()
        if not text:
            raise ToolRefused("a path is needed")
        if "\0" in text:
            raise ToolRefused("a path cannot contain a NUL character")
        candidate = Path(text)
        if not candidate.is_absolute():
            candidate = self.root / candidate
        try:
            resolved = candidate.resolve(strict=False)  # follows the symlinks that exist, a dangling one too
        except (OSError, RuntimeError) as exc:
            raise ToolRefused(f"cannot resolve {path!r}: {type(exc).__name__}") from None
        if not resolved.is_relative_to(self.root):
            raise self._outside(path)
        if resolved == self.root:
            raise ToolRefused(f"{path!r} is the working directory itself, not a file in it")
        return resolved

    def shown(self, path: Path) -> str:
        """A path as the model should see it: relative to the working directory."""
        relative = path.relative_to(self.root).as_posix()
        return "." if relative in ("", ".") else relative

    @staticmethod
    def _outside(path: str) -> ToolRefused:
        return ToolRefused(f"{path!r} is outside the working directory; use a path inside it")


def _read_file(folder: _Folder, path: str, max_chars: int) -> str:
    target = folder.resolve(path)
    if target.is_dir():
        raise ToolRefused(f"{folder.shown(target)} is a directory; use list_dir")
    if not stat.S_ISREG(target.stat().st_mode):
        raise ToolRefused(f"{folder.shown(target)} is not a regular file")
    limit = max_chars * 4 + 4  # UTF-8: at most 4 bytes a character; read no more than can be shown
    try:
        with target.open("rb") as f:
            data = f.read(limit + 1)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise ToolRefused(f"cannot read {folder.shown(target)}: {exc.strerror}") from None
    if b"\0" in data:
        raise ToolRefused(f"{folder.shown(target)} is a binary file, not text")
    text = data[:limit].decode("utf-8", errors="replace")
    if len(text) <= max_chars and len(data) <= limit:
        return text
    return f"{text[:max_chars]}\n[truncated: the first {max_chars} characters of {size} bytes]"


def _list_dir(folder: _Folder, path: str, max_entries: int) -> str:
    target = folder.resolve(path)
    if not target.is_dir():
        raise ToolRefused(f"{folder.shown(target)} is not a directory; use read_file")
    try:
        names = sorted(os.listdir(target))
    except OSError as exc:
        raise ToolRefused(f"cannot list {folder.shown(target)}: {exc.strerror}") from None
    lines: list[str] = []
    for name in names[:max_entries]:
        entry = target / name
        if entry.is_symlink():
            lines.append(f"{name}@")
        elif entry.is_dir():
            lines.append(f"{name}/")
        else:
            lines.append(name)
    if len(names) > max_entries:
        lines.append(f"[and {len(names) - max_entries} more entries]")
    return "\n".join(lines) if lines else "(empty directory)"


# ------------------------------------------------------------------------------------ workspace tools


def command_environment(
    secret_env: Iterable[str] = (), base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``base`` (default: this process's environment) without credentials: the names in ``secret_env`` and
    every name that contains KEY, TOKEN, SECRET, PASSWORD, PASSWD or CREDENTIAL, in any case."""
    named = set(secret_env)
    source = os.environ if base is None else base
    return {k: v for k, v in source.items() if k not in named and not SECRET_NAME.search(k)}


def _atomic_write(target: Path, data: bytes) -> None:
    """Replace ``target`` by a file holding ``data`` (a temporary file renamed over it: never half written),
    with the old file's mode, or the umask's default for a new one."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name[:40]}.", suffix=".kbus-tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _write_file(folder: _Folder, path: str, content: str, touched: TouchedFiles | None) -> str:
    target = folder.resolve_target(path)
    shown = folder.shown(target)
    data = content.encode("utf-8", errors="surrogateescape")
    if len(data) > MAX_WRITE_BYTES:
        raise ToolRefused(f"the content is {len(data)} bytes; write_file writes at most {MAX_WRITE_BYTES}")
    existed = os.path.lexists(target)
    if existed and not stat.S_ISREG(os.stat(target).st_mode):
        raise ToolRefused(f"{shown} exists and is not a regular file")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(target, data)
    except OSError as exc:
        raise ToolRefused(f"cannot write {shown}: {exc.strerror or exc}") from None
    if touched is not None:
        touched.add(shown)
    return f"wrote {len(data)} bytes to {shown} ({'replaced' if existed else 'created'})"


def _edit_file(folder: _Folder, path: str, old_text: str, new_text: str, touched: TouchedFiles | None) -> str:
    if not old_text:
        raise ToolRefused("old_text is empty; give the exact text to replace")
    target = folder.resolve(path)
    shown = folder.shown(target)
    if not stat.S_ISREG(target.stat().st_mode):
        raise ToolRefused(f"{shown} is not a regular file")
    if target.stat().st_size > MAX_WRITE_BYTES:
        raise ToolRefused(f"{shown} is larger than {MAX_WRITE_BYTES} bytes; edit_file edits smaller files")
    try:
        raw = target.read_bytes()
    except OSError as exc:
        raise ToolRefused(f"cannot read {shown}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolRefused(f"{shown} is not UTF-8 text") from None
    count = text.count(old_text)
    if count != 1:
        how = "does not occur" if count == 0 else f"occurs {count} times"
        raise ToolRefused(
            f"old_text {how} in {shown}; it must occur exactly once (found {count} matches)"
            + ("; include more of the surrounding text" if count > 1 else "")
        )
    edited = text.replace(old_text, new_text, 1).encode("utf-8")
    if len(edited) > MAX_WRITE_BYTES:
        raise ToolRefused(f"the edited file would be larger than {MAX_WRITE_BYTES} bytes")
    try:
        _atomic_write(target, edited)
    except OSError as exc:
        raise ToolRefused(f"cannot write {shown}: {exc.strerror or exc}") from None
    if touched is not None:
        touched.add(shown)
    return f"replaced 1 occurrence in {shown} ({len(raw)} -> {len(edited)} bytes)"


def _stream(name: str, data: bytes, size: int) -> str:
    if size == 0:
        return f"{name}: (empty)"
    text = data.decode("utf-8", errors="replace")
    if size > len(data):
        return f"{name} (the first {len(data)} of {size} bytes):\n{text}\n[{name} truncated]"
    return f"{name} ({size} bytes):\n{text}"


def workspace_tools(
    workdir: str | os.PathLike[str],
    *,
    touched: TouchedFiles | None = None,
    secret_env: Iterable[str] = (),
    command_timeout: float = COMMAND_TIMEOUT,
    max_command_timeout: float = MAX_COMMAND_TIMEOUT,
    max_output: int = MAX_COMMAND_OUTPUT,
    cancel: threading.Event | None = None,
    on_command_start: Callable[[int], None] | None = None,
) -> list[Callable[..., str]]:
    """``write_file``, ``edit_file`` and ``run_command`` confined to ``workdir`` (see the module docstring).
    ``cancel``: set it to end a running command's process group; ``on_command_start(pid)`` is told each
    command's pid (its process group id)."""
    if command_timeout <= 0 or max_command_timeout < command_timeout or max_output < 1:
        raise ValueError("need 0 < command_timeout <= max_command_timeout and max_output >= 1")
    folder = _Folder(workdir)
    hidden = tuple(secret_env)

    def write_file(path: str, content: str) -> str:
        """Create or replace a file in the working directory with the given text.

        Args:
            path: relative to the working directory, e.g. "notes.txt" or "src/main.py".
            content: the whole new text of the file.
        """
        return _write_file(folder, path, content, touched)

    def edit_file(path: str, old_text: str, new_text: str) -> str:
        """Replace the one exact occurrence of old_text in a file with new_text.

        Args:
            path: relative to the working directory, e.g. "src/main.py".
            old_text: the exact text to replace; it must occur exactly once in the file.
            new_text: the text to put in its place.
        """
        return _edit_file(folder, path, old_text, new_text, touched)

    def run_command(command: str, timeout_seconds: float = command_timeout) -> str:
        """Run a shell command in the working directory; returns its exit code and output (bounded).

        Args:
            command: a /bin/sh command line, e.g. "ls -l" or "python3 -m pytest -q".
            timeout_seconds: seconds before the command and everything it started are killed.
        """
        if not command.strip():
            raise ToolRefused("the command is empty")
        if "\0" in command:
            raise ToolRefused("a command cannot contain a NUL character")
        if not 0 < timeout_seconds <= max_command_timeout:
            raise ToolRefused(f"timeout_seconds must be more than 0 and at most {max_command_timeout:g}")
        if touched is not None:
            touched.add_all()  # whatever it writes, the next checkpoint covers the whole tree
        try:
            done = run_bounded(
                ["/bin/sh", "-c", command],
                timeout=timeout_seconds,
                limit=max_output,
                cwd=folder.root,
                env=command_environment(hidden),
                cancel=cancel,
                on_start=on_command_start,
            )
        except OSError as exc:
            raise ToolRefused(f"cannot start /bin/sh: {exc.strerror or exc}") from None
        out = _stream("stdout", done.stdout, done.stdout_size)
        output = f"{out}\n{_stream('stderr', done.stderr, done.stderr_size)}"
        if done.timed_out:
            raise ToolRefused(
                f"the command ran past {timeout_seconds:g} s and was killed with its process group\n{output}"
            )
        if done.cancelled:
            raise ToolRefused(f"the command was cancelled and killed with its process group\n{output}")
        return f"exit code {done.returncode}\n{output}"

    return [write_file, edit_file, run_command]


def register_workspace_tools(registry: ToolRegistry, workdir: str | os.PathLike[str], **options: Any) -> None:
    """Register ``workspace_tools(workdir, **options)`` on ``registry``, each as mutating; ``write_file``
    also as safe to rerun (the same content again), the other two not (an edit or a command may not be)."""
    for fn in workspace_tools(workdir, **options):
        registry.register(fn, mutating=True, rerun_safe=fn.__name__ == "write_file")


def builtin_tools(
    workdir: str | os.PathLike[str],
    *,
    max_chars: int = MAX_FILE_CHARS,
    max_entries: int = MAX_DIR_ENTRIES,
) -> list[Callable[..., str]]:
    """The built-in tools, the file tools confined to ``workdir`` (which must exist): ``calculate``,
    ``read_file``, ``list_dir``."""
    if max_chars < 1 or max_entries < 1:
        raise ValueError("max_chars and max_entries must be at least 1")
    folder = _Folder(workdir)

    def read_file(path: str) -> str:
        """Return the text of a file in the working directory (bounded; longer files are truncated).

        Args:
            path: relative to the working directory, e.g. "notes.txt" or "src/main.py".
        """
        return _read_file(folder, path, max_chars)

    def list_dir(path: str = ".") -> str:
        """List a directory in the working directory, one entry a line (directories end with /).

        Args:
            path: relative to the working directory; "." is the working directory itself.
        """
        return _list_dir(folder, path, max_entries)

    return [calculate, read_file, list_dir]
