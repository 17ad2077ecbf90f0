"""Where the native ``codex`` binary is: a configured path, ``KBUS_CODEX_BIN``, or the project's npm install.

``scripts/setup`` installs ``@openai/codex`` into ``.codex/`` at the repository root; the native binary is
in the platform package (``@openai/codex-<platform>/vendor/<target triple>/bin/codex``). The node launcher
(``bin/codex.js``) is never used: it adds a process and orphans the real one on SIGKILL (CODEX.md).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

CODEX_NPM_VERSION = "0.169.0"
ENV_VAR = "KBUS_CODEX_BIN"
ROOT = Path(__file__).resolve().parent.parent.parent

_PLATFORMS = {
    ("linux", "x86_64"): ("linux-x64", "x86_64-unknown-linux-musl"),
    ("linux", "aarch64"): ("linux-arm64", "aarch64-unknown-linux-musl"),
    ("darwin", "x86_64"): ("darwin-x64", "x86_64-apple-darwin"),
    ("darwin", "arm64"): ("darwin-arm64", "aarch64-apple-darwin"),
}


def npm_native_binary(prefix: Path | None = None) -> Path:
    """The native binary inside an npm install under ``prefix`` (default: the project's ``.codex/``)."""
    system, machine = sys.platform, platform.machine()
    key = ("darwin" if system == "darwin" else "linux", machine)
    if key not in _PLATFORMS:
        raise FileNotFoundError(f"no @openai/codex platform package for {system}/{machine}")
    package, triple = _PLATFORMS[key]
    base = (prefix or ROOT / ".codex") / "node_modules" / "@openai" / f"codex-{package}"
    return base / "vendor" / triple / "bin" / "codex"


def find_codex(configured: str | os.PathLike[str] | None = None) -> Path:
    """The codex binary to run: ``configured``, else ``$KBUS_CODEX_BIN``, else the project's npm install.

    Raises ``FileNotFoundError`` naming what was tried (run ``scripts/setup`` to install it)."""
    tried: list[str] = []
    for candidate in (configured, os.environ.get(ENV_VAR) or None):
        if candidate:
            path = Path(candidate)
            if path.is_file() and os.access(path, os.X_OK):
                return path
            tried.append(str(path))
    native = npm_native_binary()
    if native.is_file() and os.access(native, os.X_OK):
        return native
    tried.append(str(native))
    raise FileNotFoundError(f"no codex binary (tried {', '.join(tried)}): run scripts/setup or set {ENV_VAR}")
