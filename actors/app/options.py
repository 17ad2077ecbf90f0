"""What ``kbus run`` and ``kbus chat`` are given, checked before anything starts (``actors.app.chat``).

The config file found and read, the catalog it gives, the credentials its model needs, the in-process
node's settings, the frame and prompt limits, a ``--session`` file; ``CliError`` is a one-line failure with
its exit code."""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final


# sampling and a fixed seed make its answers repeatable.
class CliError(Exception):
    """A one-line message for the user and the exit code that goes with it."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "kbus"


# Top-level tables a kbus config may have: the node's sections (config.Settings) and the catalog's.
KNOWN_TABLES: Final = ("node", "security", "peers", "actors", "providers", "models")


def find_config(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> Path | None:
    """``--config``, else ``$KBUS_CONFIG``, else ``$XDG_CONFIG_HOME/kbus/config.toml`` (default
    ``~/.config/kbus/config.toml``) if that file exists; None: the built-in catalog."""
    given = getattr(args, "config", None) or env.get("KBUS_CONFIG")
    if given:
        return Path(given)
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    found = Path(base) / "kbus" / "config.toml"
    return found if found.is_file() else None


def read_config(path: Path | None) -> tuple[dict[str, Any], str, Path | None]:
    """The parsed file (``{}`` without one), its name for messages and its folder; every top-level table
    checked against ``KNOWN_TABLES`` (a misspelt ``[provider.x]`` would otherwise be ignored)."""
    import difflib

    if path is None:
        return {}, "<kbus run>", None
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CliError(f"{path}: not valid TOML: {exc}") from None
    for key in raw:
        if key not in KNOWN_TABLES:
            close = difflib.get_close_matches(key, KNOWN_TABLES, n=1, cutoff=0.6)
            hint = f"; did you mean [{close[0]}]?" if close else ""
            raise CliError(f"{path}: [{key}]: unknown table (known: {', '.join(KNOWN_TABLES)}{hint})")
    return raw, str(path), path.absolute().parent


def load_catalog(args: argparse.Namespace) -> tuple[Any, dict[str, Any], str, Path | None]:
    """The catalog the in-process Router will serve, checked before anything starts (CliError 2)."""
    from actors.router.catalog import ModelCatalog
    from config import ConfigError

    raw, source, base_dir = read_config(find_config(args))
    try:
        return ModelCatalog.from_mapping(raw, source=source), raw, source, base_dir
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def check_credentials(catalog: Any, model: str, source: str, env: Mapping[str, str] = os.environ) -> Any:
    """The model's ResolvedAgentModel; CliError 2 for an unknown model or an unset ``api_key_env``."""
    from actors.router.catalog import UnknownModel

    try:
        resolved, _, provider = catalog.resolve(model)
    except UnknownModel as exc:
        raise CliError(str(exc)) from None
    var = provider.options.get("api_key_env")
    if isinstance(var, str) and not env.get(var):
        raise CliError(
            f"{source}: providers.{provider.name}.api_key_env: the environment variable {var} is not set"
        )
    return resolved


def in_process_settings(args: argparse.Namespace) -> Any:
    from config import ConfigError, from_mapping

    _, raw, source, base_dir = load_catalog(args)
    node = dict(raw.get("node", {}))
    node.setdefault("name", f"kbus-{args.command}-{os.getpid()}")
    node.setdefault("data_dir", str(args.data_dir or default_data_dir()))
    actors = dict(raw.get("actors", {}))
    if not any(isinstance(a, Mapping) and a.get("type") == "router" for a in actors.values()):
        actors["router"] = {"type": "router"}
    raw = {**raw, "node": node, "actors": actors}
    try:
        return from_mapping(raw, source=source, base_dir=base_dir)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def security_of(args: argparse.Namespace) -> Any:
    from transport import KeyPair, Security

    keys = KeyPair.load(args.key) if args.key else None
    return Security(keys=keys)


def credential_names(args: argparse.Namespace) -> tuple[str, ...]:
    """Every ``api_key_env`` the catalog names (the built-in one, or ``--config``'s): ``run_command``'s
    environment never holds them. A config that cannot be read names none here (loading it reports why)."""
    try:
        catalog = load_catalog(args)[0]
    except CliError:
        return ()
    names = (p.options.get("api_key_env") for p in catalog.providers)
    return tuple(sorted({n for n in names if isinstance(n, str)}))


FRAME_SETTING: Final = "max_frame_bytes in the config's [node] table"


def frame_limit(args: argparse.Namespace) -> int:
    """The largest message this process's node carries (``node.max_frame_bytes``): the config's ``[node]``
    value, else enough for the largest context window of its ``[models.*]`` (``config.default_frame_bytes``:
    1 MiB for the built-in catalog). With ``--connect`` a config that cannot be read gives 1 MiB."""
    from config import default_frame_bytes

    try:
        raw = load_catalog(args)[1]
    except CliError:
        if getattr(args, "connect", None):
            return default_frame_bytes({})
        raise
    node = raw.get("node")
    given = node.get("max_frame_bytes") if isinstance(node, Mapping) else None
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return given
    return default_frame_bytes(raw)


def prompt_bytes(frame_bytes: int) -> int:
    """The largest prompt a turn can carry: a round's message holds its transcript twice (its input and its
    provider input), with room for the rest (``config.settings.FRAME_SLACK_BYTES``)."""
    from config.settings import FRAME_SLACK_BYTES

    return max(0, (frame_bytes - FRAME_SLACK_BYTES) // 2)


def check_prompt_size(text: str, frame_bytes: int) -> None:
    """CliError 2 for a prompt larger than a bus message can carry, naming the setting that changes it."""
    size = len(text.encode("utf-8"))
    limit = prompt_bytes(frame_bytes)
    if size > limit:
        raise CliError(
            f"the prompt is {size} bytes; with a bus message limit of {frame_bytes} bytes a prompt may have "
            f"at most {limit} (raise it with {FRAME_SETTING})"
        )


def check_session_file(path: str) -> None:
    """CliError 2 unless ``path`` is missing, empty or starts with a kbus journal record: a resumed session
    appends to the file, and must never append to a file of the user's."""
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 16)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CliError(f"--session {path}: {exc.strerror or exc}") from None
    if not first.strip():
        return
    try:
        record = json.loads(first)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        raise CliError(f"--session {path}: not a kbus session file (its first line is no journal record)")


def server_key(text: str | None) -> str | None:
    """A ``--server-key`` argument: the key itself, or read from the file it names."""
    if text is None:
        return None
    if os.path.exists(text):
        from transport.security import load_public_key

        return load_public_key(text)
    return text
