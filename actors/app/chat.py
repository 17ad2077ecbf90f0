"""The main job: ``kbus run "PROMPT"`` (one turn) and ``kbus chat`` (a REPL): an agent answering on the bus.

Both build one conversation (``actors.conversation.ConversationRuntime``) with the built-in tools
(``actors.app.builtin_tools``: calculator, read_file, list_dir confined to ``--workdir``) plus any ``--tools
module:function``, stream the answer as the model generates it, show each tool call and its result, and end
each turn with its usage and the ids of the Router's usage receipts.

Where the model runs:

- in-process (the default): a node in this process with the Router (``actors.app.wiring.build_node``) and the
  conversation. The catalog is the Router's built-in one (``DEFAULT_CATALOG``) unless ``--config FILE``
  gives ``[providers.*]`` / ``[models.*]`` tables (and optionally ``[node]``); receipts go to ``--data-dir``.
- ``--connect ENDPOINT --node NAME``: a running ``kbus node`` with the Router; this process runs the
  conversation and its tools (they work on this machine's files) and asks that node's Router for the model.

The embedded ``smollm2`` model (135M parameters) is weak: in the built-in catalog it may decide to call a tool
on its first request and must answer in text after a tool result (``tool_choice_after_call = "none"``); the
system prompt lists the tools and their arguments, with no example call to copy (the local provider's grammar
keeps a call to the turn's tools); ``--max-steps`` bounds tool calls per turn. It follows a prompt that
spells the call out (see ``DEMO_PROMPT``); ``scripts/bench-tools`` measures it on 12 plain prompts.

``--edit`` adds the workspace tools (``write_file``, ``edit_file``, ``run_command``, registered as mutating);
``--checkpoints`` binds the session to a shadow git repository of ``--workdir`` under ``--data-dir`` (tools
``checkpoint_save``/``list``/``diff``/``restore``; every save covers the whole tree, so a file a command
wrote is never missed); ``kbus checkpoints list|diff|restore`` reads and restores them from outside a chat.

Output: the answer alone on stdout; tool lines, the spinner (a terminal only) and the ``[done]`` line on
stderr (``-q``: the answer alone; ``--json``: one JSON object per event on stdout, see ``TurnPrinter``).
The prompt is the argument, or stdin when there is none or it is ``-``. The config is ``--config``, else
``$KBUS_CONFIG``, else ``$XDG_CONFIG_HOME/kbus/config.toml`` if it exists (``find_config``), checked before
anything starts (``read_config``, ``load_catalog``, ``check_credentials``). ``kbus models`` lists the
catalog, ``kbus config --explain`` every provider and model option (from the constructors).

Every failure is one line on stderr (``guarded``; ``-v`` for a traceback and the log). Exit codes: 0 done,
1 a turn failed or an internal error, 2 bad input (unknown model, bad ``--tools``, bad config, a prompt over
a limit, a ``--session`` file that is no journal), 3 the model server, the endpoint or its Router is
unreachable, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, TextIO

from actors.app import people_cli
from actors.app.builtin_tools import builtin_tools, register_workspace_tools

DEMO_PROMPT: Final = (
    'What is 1234 * 5678? Call call_ktool with {"name": "calculate", "arguments": {"expression": '
    '"1234 * 5678"}} and answer with the result.'
)
DEFAULT_MODEL: Final = "smollm2"
CONNECT_WAIT: Final = 5.0  # seconds to reach a --connect endpoint and its Router
# An in-process Router answers once its actor has started (ledger recovery, on a loaded machine slowly):
# wait for that answer, but end at once if the actor stopped instead, and give up only after this long.
STARTUP_WAIT: Final = 120.0
STOP_SEEN_WAIT: Final = 5.0  # how long a Router that refused as stopped may take to be marked stopped
QUIT_WINDOW: Final = 2.0  # seconds: a second Ctrl-C within this of the first quits
TURN_MARGIN: Final = 30.0  # seconds a turn may take beyond its model requests' --timeout each (tools)
CANCEL_GRACE: Final = 30.0  # seconds a turn interrupted at its limit has to end (a tool finishing, IT-02)


# The in-process catalog. The 135M model decides between a call and an answer on its first request ("auto")
# and must answer after a tool result ("none"): with "auto" again it called tools over and over. Greedy
# sampling and a fixed seed make its answers repeatable.
class CliError(Exception):
    """A one-line message for the user and the exit code that goes with it."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------------------------------ tools
def load_tool(spec: str) -> Callable[..., Any]:
    """``module:function`` or ``path/to/file.py:function``; CliError (one line) for anything else.

    A module name is looked up on ``sys.path`` and then in the working directory (appended last, so it can
    never shadow an installed package).
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise CliError(f"--tools {spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise CliError(f"--tools {spec!r}: no such file {module_name}")
            loader_spec = importlib.util.spec_from_file_location(f"kbus_tools_{path.stem}", path)
            if loader_spec is None or loader_spec.loader is None:
                raise CliError(f"--tools {spec!r}: cannot load {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            cwd = os.getcwd()
            if cwd not in sys.path:
                sys.path.append(cwd)
            module = importlib.import_module(module_name)
    except CliError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever importing user code raised, in one line
        raise CliError(
            f"--tools {spec!r}: cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise CliError(f"--tools {spec!r}: {module_name} has no {attr!r}")
    if not callable(fn):
        raise CliError(f"--tools {spec!r}: {attr} is not a function")
    return fn  # type: ignore[no-any-return]


def system_prompt(specs: Sequence[Any]) -> str:
    """The focused prompt: each tool's name, arguments and first sentence, and no example call (the 135M
    model copied an example's values into unrelated calls: ``list_dir {"path": "notes.txt"}`` for "list
    the files here"); which tool and which arguments are possible, the local provider's grammar enforces."""
    if not specs:
        return "You are a helpful assistant. Answer briefly."
    lines = [
        "You are a helpful assistant. To use a tool, call call_ktool with the tool's name and its arguments.",
        "Tools:",
    ]
    for spec in specs:
        plain = re.sub(r"\s*\([^)]*\)", "", spec.description)  # no parentheticals: "(bounded; ...)"
        summary = plain.split(". ")[0].split("; ")[0].rstrip(".")
        props = spec.parameters.get("properties", {}) if isinstance(spec.parameters, dict) else {}
        lines.append(f"- {spec.name}({', '.join(props)}): {summary}.")
    lines.append("After a tool result, answer the user in one short sentence.")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- progress
class Progress:
    """A spinner on stderr while the model loads or thinks; nothing when stderr is not a terminal."""

    FRAMES = "|/-\\"

    def __init__(self, stream: TextIO, *, quiet: bool = False) -> None:
        self.stream = stream
        self.quiet = quiet
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, label: str) -> None:
        self.stop()
        self._stop = threading.Event()
        if self.quiet or not self.stream.isatty():  # a script reading stderr gets no progress noise
            return
        stop, stream, started = self._stop, self.stream, time.monotonic()

        def spin() -> None:
            i = 0
            while not stop.wait(0.1):
                stream.write(f"\r{self.FRAMES[i % 4]} {label} ({time.monotonic() - started:.0f} s)")
                stream.flush()
                i += 1
            stream.write("\r\033[K")
            stream.flush()

        self._thread = threading.Thread(target=spin, name="kbus-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(2.0)


# ----------------------------------------------------------------------------------------------- events
def use_colour(stream: TextIO, env: Mapping[str, str] = os.environ) -> bool:
    """Colour only on a terminal, and never with ``NO_COLOR`` set (https://no-color.org) or TERM=dumb."""
    return stream.isatty() and not env.get("NO_COLOR") and env.get("TERM") != "dumb"


class TurnPrinter:
    """The conversation's event sink: streams text, shows tool calls and results, notes the turn's end.

    ``mode``: ``"text"`` (the answer on ``out``, tool lines on ``err``), ``"quiet"`` (the answer alone) or
    ``"json"`` (one JSON object per event on ``out``: ``text``, ``tool_call``, ``tool_result``, ``done``).

    ``emit`` runs on the sink actor's thread; the main thread reads what it recorded only after
    ``TurnFinished`` (``finished`` is set), so the two never write at the same time.
    """

    SHOWN_LINES = 12
    SHOWN_CHARS = 600

    def __init__(
        self,
        out: TextIO,
        progress: Progress,
        *,
        err: TextIO | None = None,
        mode: str = "text",
        colour: bool = False,
    ) -> None:
        self.out = out
        self.err = out if err is None else err
        self.progress = progress
        self.mode = mode
        self.colour = colour
        self.finished = threading.Event()
        self.streamed = False
        self.at_line_start = True
        self.tool_calls = 0

    def begin(self) -> None:
        self.finished = threading.Event()
        self.streamed = False
        self.at_line_start = True
        self.tool_calls = 0

    def _write(self, text: str) -> None:
        self.progress.stop()
        if text:
            self.out.write(text)
            self.out.flush()
            self.at_line_start = text.endswith("\n")

    def json_line(self, obj: Mapping[str, Any]) -> None:
        self.progress.stop()
        self.out.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.out.flush()

    def note(self, line: str, style: str = "2") -> None:
        """A line on ``err`` (tool lines, the done line), dim or coloured on a terminal; none when quiet."""
        if self.mode != "text":
            return
        self.progress.stop()
        if self.err is self.out:
            self.newline()
        if self.colour:
            line = f"\033[{style}m{line}\033[0m"
        self.err.write(line + "\n")
        self.err.flush()

    def answer(self, text: str) -> None:
        """Answer text (streamed, or the whole answer when nothing was streamed)."""
        if self.mode == "json":
            self.json_line({"type": "text", "text": text})
        else:
            self._write(text)

    def newline(self) -> None:
        if not self.at_line_start and self.mode != "json":
            self._write("\n")

    def emit(self, event: Any) -> None:
        from actors.conversation import TextDelta, ToolCallFinished, ToolCallStarted, TurnFinished

        match event:
            case TextDelta(text=text):
                self.streamed = True
                self.answer(text)
            case ToolCallStarted(call_id=call_id, name=name, arguments=arguments):
                self.tool_calls += 1
                if self.mode == "json":
                    self.json_line(
                        {"type": "tool_call", "call_id": call_id, "name": name, "arguments": arguments}
                    )
                else:
                    self.newline()
                    self.note(f"[tool call] {name} {arguments}", "36")
            case ToolCallFinished(call_id=call_id, name=name, ok=ok, text=text):
                if self.mode == "json":
                    self.json_line(
                        {"type": "tool_result", "call_id": call_id, "name": name, "ok": ok, "text": text}
                    )
                else:
                    kind = "result" if ok else "error"
                    self.note(f"[tool {kind}] {name}: {self._clip(text)}", "2" if ok else "31")
                self.streamed = False  # the answer is the text after the last tool call
            case TurnFinished():
                self.finished.set()
            case _:
                line = loop_event_line(event)
                if line is not None:  # goal, wakeup and job events: status lines, on stderr
                    self.newline()
                    self.note(line, "35")
                else:
                    self.other(event)  # plans, permission asks, todos (people_cli.py)

    def other(self, event: Any) -> None:
        pass

    def _clip(self, text: str) -> str:
        if len(text) > self.SHOWN_CHARS:
            text = text[: self.SHOWN_CHARS] + " ..."
        lines = text.splitlines() or [""]
        if len(lines) > self.SHOWN_LINES:
            lines = [*lines[: self.SHOWN_LINES], f"... ({len(lines) - self.SHOWN_LINES} more lines)"]
        return "\n    ".join(lines)


def loop_event_line(event: Any) -> str | None:
    """One line for a goal, wakeup or job event (issue 12), or None for any other event."""
    from actors.conversation import types as t

    match event:
        case t.GoalSet(condition=condition, max_turns=n):
            return f"[goal] set: {condition} (at most {max(n, 1)} turn{'s' if max(n, 1) != 1 else ''})"
        case t.GoalContinuing(reason=reason, turns=n):
            return f"[goal] not yet after turn {n}: {reason}"
        case t.GoalAchieved(turns=n, reason=reason):
            return f"[goal] achieved after {n} turn{'s' if n != 1 else ''}: {reason}"
        case t.GoalCleared(reason=reason):
            return f"[goal] ended: {reason.replace('_', ' ')}"
        case t.WakeupScheduled(delay_s=delay, prompt=prompt):
            return f"[wakeup] scheduled in {delay:g}s" + (f": {prompt}" if prompt else "")
        case t.WakeupWaiting(due=due):
            return f"[wakeup] sleeping until {time.strftime('%H:%M:%S', time.localtime(due))}"
        case t.WakeupFired():
            return "[wakeup] woke up"
        case t.WakeupCancelled(reason=reason):
            return f"[wakeup] cancelled ({reason})"
        case t.JobStarted(job_id=job_id, command=command):
            return f"[job] started {job_id}: {command}"
        case t.JobFinished(job_id=job_id, exit_code=code, lost=lost):
            status = "lost (outcome unknown)" if lost else ("stopped" if code is None else f"exit {code}")
            return f"[job] finished {job_id}: {status}"
    return None


# ------------------------------------------------------------------------------------------------ agent
def _default_data_dir() -> Path:
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


def _in_process_settings(args: argparse.Namespace) -> Any:
    from config import ConfigError, from_mapping

    _, raw, source, base_dir = load_catalog(args)
    node = dict(raw.get("node", {}))
    node.setdefault("name", f"kbus-{args.command}-{os.getpid()}")
    node.setdefault("data_dir", str(args.data_dir or _default_data_dir()))
    actors = dict(raw.get("actors", {}))
    if not any(isinstance(a, Mapping) and a.get("type") == "router" for a in actors.values()):
        actors["router"] = {"type": "router"}
    raw = {**raw, "node": node, "actors": actors}
    try:
        return from_mapping(raw, source=source, base_dir=base_dir)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def _security(args: argparse.Namespace) -> Any:
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


def tool_registry(args: argparse.Namespace, cancel: threading.Event | None = None) -> Any:
    """The tools every turn has: the built-ins on ``--workdir``, the workspace tools with ``--edit``, and
    each ``--tools`` spec; CliError 2 for a bad folder or spec (before anything starts)."""
    from actors.conversation import ToolRegistry, ToolRegistryError

    registry = ToolRegistry()
    try:
        workdir = Path(args.workdir or os.getcwd())
        for fn in builtin_tools(workdir):
            registry.register(fn)
        if args.edit:
            register_workspace_tools(
                registry, workdir, secret_env=credential_names(args), cancel=cancel or threading.Event()
            )
        for spec in args.tools or ():
            registry.register(load_tool(spec))
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise CliError(f"--workdir: {exc}") from None
    except ToolRegistryError as exc:
        raise CliError(f"--tools: {exc}") from None
    return registry


def checkpoint_session(args: argparse.Namespace) -> str:
    """The checkpoint session of a chat: ``--checkpoint-session``, else one derived from ``--session`` (the
    same file gives the same session again), else a new one."""
    import hashlib

    if args.checkpoint_session:
        return str(args.checkpoint_session)
    if args.session:
        path = os.path.abspath(args.session)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(path).stem).strip("._-")[:60] or "chat"
        return f"{stem}-{hashlib.sha256(os.fsencode(path)).hexdigest()[:8]}"
    return f"chat-{uuid.uuid4().hex[:12]}"


class Agent:
    """One conversation wired to a Router: in-process or on a ``--connect``-ed node."""

    def __init__(self, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
        self.args = args
        self.out, self.err = out, err
        mode = (
            "json" if getattr(args, "json", False) else "quiet" if getattr(args, "quiet", False) else "text"
        )
        self.progress = Progress(err, quiet=mode == "quiet")
        self.printer = TurnPrinter(out, self.progress, err=err, mode=mode, colour=use_colour(err))
        self.node: Any = None
        self.router = ""
        self.runtime: Any = None
        self.model = args.model
        self.loaded: set[str] = set()  # local models that answered once (they load on first use)
        self.local = False  # whether the current model runs embedded in the Router's process
        self.last_outcome: Any = None
        # Every operation id the conversation starts a kernel run under (on its actor thread; list.append
        # is atomic): the Router files each provider turn's receipt under its parent operation, and
        # GetReceiptsFor lists them (in-process or on a --connect-ed node alike).
        self.operations: list[uuid.UUID] = []
        self.clock: Callable[[], float] = time.monotonic  # the turn limit's clock (tests inject one)
        self.stop_timeout = 10.0  # seconds ``stop`` waits for each actor of the conversation
        self.cancel_commands = threading.Event()  # set on stop: a run_command still running is killed
        self.checkpoint_session: str | None = None
        self.shadow: Any = None
        self.resolved: Any = None  # the current model's ResolvedAgentModel
        self.frame_bytes = 1 << 20  # this process's node.max_frame_bytes (set by start)
        self.last_interrupt = -math.inf  # when Ctrl-C was last pressed (two within QUIT_WINDOW quit)
        self.key_clock: Callable[[], float] = time.monotonic
        self.wakeup_slot: Any = None
        self.on_poll: Callable[[], None] = lambda: None  # between polls of a running turn (people_cli.py)

    def _new_operation(self) -> uuid.UUID:
        op = uuid.uuid4()
        self.operations.append(op)
        return op

    # ------------------------------------------------------------------------------ start and stop
    def start(self) -> None:
        from actors.conversation import Compactor, ConversationRuntime

        if self.args.max_steps < 1:
            raise CliError("--max-steps must be at least 1")
        if self.args.session:
            check_session_file(self.args.session)
        if not self.args.connect:  # the config, the model and its credential: before anything starts
            catalog, _, source, _ = load_catalog(self.args)
            check_credentials(catalog, self.model, source)
        registry = tool_registry(self.args, self.cancel_commands)  # a bad spec starts nothing
        workdir = Path(self.args.workdir or os.getcwd())
        if self.args.connect:
            self._connect()
        else:
            self._in_process()
        resolved = self.check_model(self.model)
        self.resolved = resolved
        self.local = str(resolved.provider) == "local"
        # Cross-turn compaction (and /compact) once the estimate passes half the model's input budget.
        compactor = Compactor(threshold_tokens=max(256, resolved.max_input_tokens // 2), keep_recent_n=4)
        builder = (
            ConversationRuntime.builder()
            .node(self.node)
            .router(self.router)
            .llm(self.model)
            .tools(registry)
            .system_prompt(
                self.args.system if self.args.system is not None else system_prompt(registry.specs())
            )
            .event_sink(self.printer)
            .compactor(compactor)
            .max_steps(self.args.max_steps)
            .round_timeout(self.args.timeout)
            .timeout(self.turn_limit() + CANCEL_GRACE)
            .user_id(os.environ.get("USER", "kbus"))
            .operation_ids(self._new_operation)
        )
        if self.args.session:
            builder = builder.session_file(self.args.session)
        builder = people_cli.configure_builder(builder, self.args)
        try:
            self.runtime = builder.build()
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot start the conversation: {exc}") from None
        people_cli.install(self)
        if self.args.session:
            restored = len(self.runtime.transcript())
            if restored:
                print(f"kbus: resumed {restored} messages from {self.args.session}", file=self.err)
        if self.args.checkpoints:
            self._enable_checkpoints(workdir)

    def _enable_checkpoints(self, workdir: Path) -> None:
        from actors.conversation import ConversationError
        from actors.conversation.shadow import CheckpointError, ShadowRepo

        session = checkpoint_session(self.args)
        data_dir = Path(self.args.data_dir or _default_data_dir())
        try:
            ShadowRepo.ref(session)
            self.shadow = ShadowRepo.for_work_tree(workdir, data_dir)
            log = ShadowRepo.default_folder(workdir, data_dir) / f"{session}.jsonl"
            self.runtime.enable_checkpoints(self.shadow, session, log, restore_tool=True, timeout=60.0)
        except (CheckpointError, ConversationError) as exc:
            raise CliError(f"--checkpoints: {exc}") from None
        self.checkpoint_session = session
        print(
            f"kbus: checkpoints on (session {session}); the agent saves them with checkpoint_save",
            file=self.err,
        )

    def _in_process(self) -> None:
        from actors.app.wiring import build_node
        from config import ConfigError

        try:
            settings = _in_process_settings(self.args)
            self.node = build_node(settings)
        except ConfigError as exc:
            raise CliError(f"{exc}") from None
        router = next(a.name for a in settings.actors if a.type == "router")
        self.router = f"{self.node.name}/{router}"
        self.frame_bytes = settings.node.max_frame_bytes

    def _connect(self) -> None:
        from actors.app.wiring import registry
        from transport import BusError, Node, Peer
        from transport.envelope import is_node_name

        if not self.args.node:
            raise CliError("--connect needs --node NAME (the name of the node at that endpoint)")
        if not is_node_name(self.args.node):
            raise CliError(f"--node {self.args.node!r} is not a node name")
        if not re.match(r"^(ipc|tcp)://.+", self.args.connect):
            raise CliError(f"--connect {self.args.connect!r}: expected ipc://PATH or tcp://HOST:PORT")
        if self.args.connect.startswith("tcp://") and not self.args.server_key:
            raise CliError(
                f"--connect {self.args.connect}: tcp is CURVE-encrypted: give --server-key (the node's "
                "public key, Z85 text or its .key file) and --key (this client's secret key file)"
            )
        # A CURVE server lets a key speak only as the node name its allowlist gives it: like `kbus ping`,
        # default to the key file's name (`kbus keys NAME` writes NAME.key_secret).
        name = self.args.name or (
            Path(self.args.key).name.split(".")[0]
            if self.args.key
            else f"kbus-{self.args.command}-{os.getpid()}"
        )
        self.frame_bytes = frame_limit(self.args)  # the node at the endpoint has its own (its config's)
        try:
            self.node = Node(name, registry=registry(self.frame_bytes), security=_security(self.args)).start()
            server_key = _server_key(self.args.server_key)
            self.node.connect(Peer(self.args.node, self.args.connect, server_key), wait=CONNECT_WAIT)
        except BusError as exc:
            raise CliError(f"cannot reach {self.args.connect} (node {self.args.node}): {exc}", 3) from None
        except (OSError, ValueError) as exc:
            raise CliError(f"--connect {self.args.connect}: {exc}", 3) from None
        self.router = f"{self.args.node}/{self.args.router}"

    def check_model(self, model: str) -> Any:
        """The Router's ResolvedAgentModel for ``model`` (CliError 2 if unknown; 3 if no Router answers)."""
        from actors.router.catalog import UnknownModel
        from actors.router.client import RouterClient
        from transport import BusError

        try:
            if self.args.connect:
                return RouterClient(self.node, self.router).resolve_model(model, timeout=CONNECT_WAIT)
            return self._local_router_answer(RouterClient(self.node, self.router), model)
        except UnknownModel as exc:
            raise CliError(f"{exc}") from None
        except BusError as exc:
            raise CliError(
                f"the Router at {self.router} does not answer: {type(exc).__name__}: {exc}", 3
            ) from None

    def _local_router_answer(self, client: Any, model: str) -> Any:
        """The in-process Router's answer to ``resolve_model``: waited for while its actor runs (it
        queues the request until it has started), bounded by ``STARTUP_WAIT``; a CliError at once if the
        actor stopped instead of starting."""
        import concurrent.futures

        from transport.errors import NotDelivered

        ref = self.node.lookup(self.router.rpartition("/")[2])  # None: it has stopped already
        future = client.resolve_model_future(model, timeout=STARTUP_WAIT)

        def stopped() -> bool:
            return ref is not None and not getattr(ref, "is_alive", lambda: True)()

        gone = False
        while not future.done():
            concurrent.futures.wait([future], timeout=0.25)
            if not future.done() and stopped():
                future.cancel()
                gone = True
                break
        if not gone and isinstance(future.exception(), NotDelivered):
            # refused on its way out: the node forgets the actor a moment before pykka marks it stopped
            gone = ref is None or ref.actor_stopped.wait(STOP_SEEN_WAIT)
        if gone:
            # stopped instead of starting: seen by the poll, or by the request it refused on the way out
            raise CliError(f"the Router {self.router} did not start (it stopped; -v shows why)", 1)
        return future.result()

    def stop(self, *, close: bool = True) -> None:
        """End the session (``close``: SessionEnd, after any running turn) and stop what ``start`` started."""
        self.progress.stop()
        self.cancel_commands.set()
        try:
            if self.runtime is not None:
                if close:
                    try:
                        self.runtime.close(self.last_outcome, timeout=10.0)
                    except Exception as exc:  # noqa: BLE001 - closing must not hide why we stop
                        print(f"kbus: closing the conversation: {exc}", file=self.err)
                runtime, self.runtime = self.runtime, None
                runtime.stop(timeout=self.stop_timeout)  # a busy tool is logged and left to the node
        finally:
            if self.node is not None:
                node, self.node = self.node, None
                node.stop(timeout=self.stop_timeout)

    # -------------------------------------------------------------------------------------- turns
    def turn_limit(self) -> float:
        """How long one turn may run before it is interrupted: up to ``--max-steps`` + 1 model requests and a
        cross-turn compaction's summary, each allowed ``--timeout``, plus the tools' time."""
        return float((self.args.max_steps + 2) * self.args.timeout + TURN_MARGIN)

    def second_interrupt(self) -> bool:
        """Note a Ctrl-C; whether it came within the quit window of the one before (then: quit). The window
        is QUIT_WINDOW seconds, or ``KBUS_QUIT_WINDOW`` seconds when that is set (a slow terminal, tests)."""
        now = self.key_clock()
        try:
            window = float(os.environ.get("KBUS_QUIT_WINDOW", QUIT_WINDOW))
        except ValueError:
            window = QUIT_WINDOW
        second, self.last_interrupt = now - self.last_interrupt < window, now
        return second

    def check_prompt(self, text: str) -> None:
        """Refuse a prompt no request could carry, in one line naming the limit and what changes it."""
        from actors.router.providers.base import estimate_tokens

        check_prompt_size(text, self.frame_bytes)
        if self.resolved is not None:
            tokens = estimate_tokens(text)
            if tokens > self.resolved.max_input_tokens:
                raise CliError(
                    f"the prompt is about {tokens} tokens; model {self.resolved.model} takes at most "
                    f"{self.resolved.max_input_tokens} (max_input_tokens of [models.{self.resolved.model}])"
                )

    def turn(self, text: str | None) -> Any:
        """One turn: stream it, then print its usage and receipts; returns its RuntimeOutcome. ``None``
        continues the turn the session file shows interrupted (``continue_turn``)."""
        from actors.conversation import CancellationToken

        token = CancellationToken()
        self.runtime.set_interrupt_token(token)
        self.last_interrupt = -math.inf  # a new prompt: a Ctrl-C before it was not meant to quit
        self.printer.begin()
        if self.local and self.model not in self.loaded:
            waiting = f"loading {self.model} (first use) and thinking"
        else:
            waiting = f"waiting for {self.model}"
        self.progress.start(waiting)
        first_operation = len(self.operations)
        limit = self.turn_limit()
        deadline = self.clock() + limit
        # Each future has its own deadline: the limit plus CANCEL_GRACE.
        future = self.runtime.run_future(text) if text is not None else self.runtime.continue_turn_future()
        try:
            while True:
                try:
                    outcome = future.result(timeout=0.2)
                    break
                except TimeoutError:
                    self.on_poll()  # a plan to approve, a call to allow: asked here, on the main thread
                    if self.clock() >= deadline and not token.is_cancelled():  # never left running on
                        self.progress.stop()
                        token.cancel()
                        note = f"\nkbus: the turn ran past its limit of {limit:g} s; interrupting it"
                        print(note, file=self.err, flush=True)
                    continue
                except KeyboardInterrupt:
                    if token.is_cancelled() or self.second_interrupt():
                        raise
                    self.progress.stop()
                    token.cancel()
                    print("\nkbus: interrupting the turn (Ctrl-C again to quit)", file=self.err, flush=True)
        finally:
            self.progress.stop()
        self.loaded.add(self.model)
        self.last_outcome = outcome
        self.printer.finished.wait(10.0)  # events travel apart from the reply: let them land first
        if not self.printer.streamed and outcome.final_text:
            self.printer.answer(outcome.final_text)
        self.printer.newline()
        self.report(outcome, self.operations[first_operation:])
        return outcome

    def loop(self, start: Callable[[], Any]) -> list[Any]:
        """A goal or wakeup loop (``start()`` returns its future): its events stream as they happen;
        Ctrl-C interrupts it (a second one quits). Prints one summary line; returns the outcomes."""
        from actors.conversation import CancellationToken

        token = CancellationToken()
        self.runtime.set_interrupt_token(token)
        self.printer.begin()
        first_operation = len(self.operations)
        future = start()
        while True:
            try:
                outcomes: list[Any] = future.result(timeout=0.2)
                break
            except TimeoutError:
                continue
            except KeyboardInterrupt:
                if token.is_cancelled():
                    raise
                token.cancel()
                print("\nkbus: interrupting the loop (Ctrl-C again to quit)", file=self.err, flush=True)
        self.printer.finished.wait(10.0)
        self.printer.newline()
        if outcomes:
            self.last_outcome = outcomes[-1]
        total = sum(o.usage.total_tokens for o in outcomes)
        receipts, why = self.receipts(self.operations[first_operation:])
        ids = ", ".join(r.receipt_id for r in receipts) or why or "(none)"
        self.err.write(
            f"[loop done] {len(outcomes)} turn{'s' if len(outcomes) != 1 else ''} · tokens {total} · "
            f"receipts: {ids}\n"
        )
        self.err.flush()
        return outcomes

    def goal_loop(self, prompt: str, condition: str, max_turns: int) -> list[Any]:
        return self.loop(lambda: self.runtime.run_goal_loop_future(prompt, condition, max_turns))

    def wakeup_loop(self, prompt: str) -> list[Any]:
        from actors.conversation.runtime import WakeupSlot

        if self.wakeup_slot is None:  # schedule_wakeup joins the tools at the first /loop only
            self.wakeup_slot = WakeupSlot("chat")
            self.runtime.register_wakeup_tool(self.wakeup_slot)
        slot = self.wakeup_slot
        return self.loop(lambda: self.runtime.run_loop_future(prompt, slot))

    def receipts(self, operations: Sequence[uuid.UUID]) -> tuple[list[Any], str | None]:
        """The receipts the Router issued for the turn's provider turns, or why there are none."""
        from actors.router.client import RouterClient
        from transport import BusError

        wait = CONNECT_WAIT if self.args.connect else STARTUP_WAIT
        router = RouterClient(self.node, self.router, timeout=wait)
        try:
            return [r for op in operations for r in router.receipts_for(op)], None
        except BusError as exc:
            return [], f"(not available: {type(exc).__name__}: {exc})"

    def report(self, outcome: Any, operations: Sequence[uuid.UUID]) -> None:
        """The turn's end: the ``[done]`` line on stderr, or the ``done`` event with ``--json``."""
        if self.printer.mode == "quiet":
            return
        receipts, why = self.receipts(operations)
        known = [r.usage for r in receipts if r.usage is not None]
        # A provider that reports no usage (llama.cpp's server in a stream) leaves it unknown: never 0.
        usage = outcome.usage if known else None
        if self.printer.mode == "json":
            self.printer.json_line(
                {
                    "type": "done",
                    "finish_reason": str(outcome.finish_reason),
                    "tool_calls": outcome.steps,
                    "usage": None
                    if usage is None
                    else {
                        "input_tokens": usage.prompt_tokens,
                        "output_tokens": usage.completion_tokens,
                        "total_tokens": usage.total_tokens,
                        "complete": len(known) == len(receipts),
                    },
                    "receipts": [r.receipt_id for r in receipts],
                }
            )
            return
        self.printer.note(self.summary(outcome, receipts, why))

    def summary(self, outcome: Any, receipts: Sequence[Any], why: str | None = None) -> str:
        calls = outcome.steps
        known = sum(1 for r in receipts if r.usage is not None)
        if receipts and not known:
            tokens = "tokens unknown"
        else:
            usage = outcome.usage
            tokens = (
                f"tokens in {usage.prompt_tokens} out {usage.completion_tokens} total {usage.total_tokens}"
            )
            if known < len(receipts):
                tokens += f" (unknown for {len(receipts) - known} of {len(receipts)} requests)"
        ids = why or ", ".join(r.receipt_id for r in receipts) or "(none)"
        return (
            f"[done] {outcome.finish_reason} · {calls} tool call{'s' if calls != 1 else ''} · "
            f"{tokens} · receipts: {ids}"
        )


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


def _server_key(text: str | None) -> str | None:
    if text is None:
        return None
    if os.path.exists(text):
        from transport.security import load_public_key

        return load_public_key(text)
    return text


class InterruptForwarder:
    """Ctrl-C reaches the main thread at once, also when the kernel hands SIGINT to another thread.

    Why it is needed: at ``input()`` Python's readline module waits in ``select()`` on the main thread and
    looks at signals only when that call is interrupted (EINTR). GNU readline blocks SIGINT on the main
    thread while it draws the prompt (``_rl_block_sigint``), so a Ctrl-C pressed then (the second of a quick
    pair: it lands while the first one's prompt is redrawn) is delivered to some other thread of the
    process (an actor's, the node's I/O thread): Python notes it, but the main thread's ``select()`` sleeps
    on until Enter. Blocking SIGINT in the other threads does not help: the signal then waits until readline
    unblocks it, its handler runs just before ``select()``, and ``select()`` sleeps all the same.

    What it does: every signal's C handler writes the signal's number to a pipe (``signal.set_wakeup_fd``),
    whichever thread it ran on. A watcher thread that reads a SIGINT there sends the main thread a no-op
    ``POKE`` signal (``signal.pthread_kill``), every ``POKE_EVERY`` seconds until the SIGINT handler has
    run (at most ``POKE_FOR`` seconds a press): the poke interrupts ``select()``, and Python then runs the
    pending SIGINT handler there. The poke is never SIGINT itself, so a press is never counted twice (a
    doubled press would quit). A poke that arrives when nothing waits is a no-op.
    """

    POKE: Final = signal.SIGUSR2
    POKE_EVERY: Final = 0.02
    POKE_FOR: Final = 2.0

    def __init__(self) -> None:
        self.pressed = 0  # SIGINTs the watcher read from the pipe
        self.handled = 0  # SIGINT handler runs on the main thread
        self._ran = threading.Event()  # set by each handler run
        self._read_fd = self._write_fd = -1
        self._saved: tuple[Any, Any, int] | None = None
        self._thread: threading.Thread | None = None

    def install(self) -> bool:
        """Start forwarding (the main thread only; False elsewhere, nothing changed)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        saved_int = signal.signal(signal.SIGINT, self._on_sigint)
        saved_poke = signal.signal(self.POKE, lambda signum, frame: None)
        saved_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._saved = (saved_int, saved_poke, saved_fd)
        self._thread = threading.Thread(target=self._watch, name="kbus-sigint", daemon=True)
        self._thread.start()
        return True

    def uninstall(self) -> None:
        if self._saved is None:
            return
        saved_int, saved_poke, saved_fd = self._saved
        self._saved = None
        signal.set_wakeup_fd(saved_fd)
        signal.signal(signal.SIGINT, saved_int)
        signal.signal(self.POKE, saved_poke)
        os.close(self._write_fd)  # the watcher reads EOF and ends
        if self._thread is not None:
            self._thread.join(1.0)
        os.close(self._read_fd)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.handled += 1
        self._ran.set()
        raise KeyboardInterrupt

    def _watch(self) -> None:
        main = threading.main_thread().ident
        assert main is not None
        while True:
            try:
                got = os.read(self._read_fd, 64)
            except OSError:
                return
            if not got:
                return
            presses = got.count(signal.SIGINT)
            if not presses:
                continue  # the pokes' own bytes, other signals
            self.pressed += presses
            deadline = time.monotonic() + self.POKE_FOR
            while self.handled < self.pressed and time.monotonic() < deadline:
                self._ran.clear()
                if self.handled >= self.pressed:
                    break
                with contextlib.suppress(OSError):  # the process is exiting
                    signal.pthread_kill(main, self.POKE)
                self._ran.wait(self.POKE_EVERY)
            if self.handled < self.pressed:  # presses merged into one handler run: in step again
                self.pressed = self.handled


@contextmanager
def forwarded_interrupts() -> Iterator[InterruptForwarder]:
    forwarder = InterruptForwarder()
    forwarder.install()
    try:
        yield forwarder
    finally:
        forwarder.uninstall()


QUIT_STOP_TIMEOUT = 1.0  # seconds a second Ctrl-C waits for each actor before the process exits


@contextmanager
def _agent(args: argparse.Namespace) -> Iterator[Agent]:
    agent = Agent(args, sys.stdout, sys.stderr)
    try:
        agent.start()
        yield agent
    except KeyboardInterrupt:  # quit now: a close would wait for the turn still running
        print("\nkbus: quitting", file=sys.stderr, flush=True)
        agent.stop_timeout = QUIT_STOP_TIMEOUT  # a tool still running is left behind (daemon thread)
        agent.stop(close=False)
        raise
    except BaseException:
        agent.stop()
        raise
    agent.stop()


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def failure_code(exc: BaseException) -> int:
    """3 when the model or the bus could not be reached (a provider unavailable, nothing delivered, the
    outcome unknown), else 1."""
    from actors.router.messages import ProviderUnavailable
    from transport.errors import NotDelivered, Unavailable

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ProviderUnavailable | NotDelivered | Unavailable):
            return 3
        current = current.__cause__ or current.__context__
    return 1


def _failed(command: str, exc: BaseException) -> int:
    from transport import BusError

    if isinstance(exc, CliError):
        print(f"kbus {command}: {one_line(exc)}", file=sys.stderr)
        return exc.code
    if isinstance(exc, BusError):
        said = one_line(exc)
        if re.search(r"body of \d+ bytes exceeds \d+", said):  # a transcript over the bus's message limit
            said += f" (the bus's message limit: raise it with {FRAME_SETTING})"
        print(f"kbus {command}: the turn failed: {type(exc).__name__}: {said}", file=sys.stderr)
        return failure_code(exc)
    raise exc


def guarded(command: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``fn`` with every failure as one line on stderr: a bug is exit 1 (its traceback with ``-v``), and
    log records below CRITICAL (receipts in warnings) only with ``-v``."""

    def run(args: argparse.Namespace) -> int:
        verbose = bool(getattr(args, "verbose", False))
        if not verbose:
            logging.getLogger().setLevel(logging.CRITICAL)
        capture = getattr(args, "capture_dir", None)
        if capture:  # every node of this run captures (transport.capture.capture_from_env)
            os.environ["KBUS_CAPTURE"] = capture
        try:
            return fn(args)
        except BrokenPipeError:  # stdout closed early (| head): nothing more to say
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        except Exception as exc:  # the last word: one line, not a traceback
            if verbose:
                raise
            print(
                f"kbus {command}: internal error: {type(exc).__name__}: {one_line(exc)} "
                "(-v shows the traceback)",
                file=sys.stderr,
            )
            return 1

    return run


def read_prompt(args: argparse.Namespace, stdin: TextIO) -> str:
    """The prompt argument, or stdin when there is none or it is ``-``; CliError 2 if empty."""
    prompt = args.prompt
    if prompt is None or prompt == "-":
        if prompt is None and stdin.isatty():
            raise CliError("no prompt: give it as an argument, or on stdin (echo PROMPT | kbus run)")
        prompt = stdin.read()
    if not prompt.strip():
        raise CliError("the prompt is empty")
    return str(prompt)


# --------------------------------------------------------------------------------------------- commands
def cmd_run(args: argparse.Namespace) -> int:
    from transport import BusError

    if args.goal is not None and not args.goal.strip():
        print("kbus run: the --goal condition is empty", file=sys.stderr)
        return 2
    if args.max_turns < 1:
        print(f"kbus run: --max-turns must be at least 1, not {args.max_turns}", file=sys.stderr)
        return 2
    args.interactive = sys.stdin.isatty()  # without a terminal an ask is denied, a plan rejected
    try:
        prompt = read_prompt(args, sys.stdin)
        check_prompt_size(prompt, frame_limit(args))  # before anything starts
        with forwarded_interrupts(), _agent(args) as agent:
            agent.check_prompt(prompt)
            if args.goal is not None:
                outcomes = agent.goal_loop(prompt, args.goal, args.max_turns)
                if not outcomes:
                    return 1
                outcome = outcomes[-1]
            else:
                outcome = agent.turn(prompt)
    except (CliError, BusError) as exc:
        return _failed("run", exc)
    except KeyboardInterrupt:
        print("\nkbus run: interrupted", file=sys.stderr)
        return 130
    return 0 if str(outcome.finish_reason) != "cancelled" else 130


def cmd_models(args: argparse.Namespace) -> int:
    """``kbus models``: the catalog's models (name, provider, window, aliases), from the config found."""
    try:
        catalog = load_catalog(args)[0]
    except CliError as exc:
        return _failed("models", exc)
    rows = [
        (
            m.model,
            f"{m.provider} ({catalog.resolve(m.model)[2].kind})",
            str(m.context_window),
            ", ".join(m.aliases),
        )
        for m in catalog.models
    ]
    if args.json:
        for m in catalog.models:
            print(
                json.dumps(
                    {
                        "model": m.model,
                        "provider": m.provider,
                        "provider_model": m.provider_model,
                        "context_window": m.context_window,
                        "max_input_tokens": m.max_input_tokens,
                        "aliases": list(m.aliases),
                    }
                )
            )
        return 0
    header = ("MODEL", "PROVIDER", "WINDOW", "ALIASES")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(3)]
    for row in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return 0


def cmd_tools(args: argparse.Namespace) -> int:
    """``kbus tools``: the tools a turn of ``kbus run``/``kbus chat`` with these options has (the built-ins,
    ``--edit``'s, each ``--tools``), with the arguments the model is told; ``--json``: one object per tool
    (``name``, ``description``, ``parameters`` as JSON schema, ``mutating``)."""
    try:
        registry = tool_registry(args)
    except CliError as exc:
        return _failed("tools", exc)
    for spec in registry.specs():
        mutating = registry.is_mutating(spec.name)
        if args.json:
            row = {
                "name": spec.name,
                "description": spec.description,
                "parameters": spec.parameters,
                "mutating": mutating,
            }
            print(json.dumps(row, ensure_ascii=False))
            continue
        props = spec.parameters.get("properties", {}) if isinstance(spec.parameters, dict) else {}
        summary = spec.description.split("\n")[0]
        print(f"{spec.name}({', '.join(props)}){' [changes files]' if mutating else ''}: {summary}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """``kbus config``: which file is used and whether it is sound; ``--explain``: every option."""
    from actors.router.catalog import _PROVIDER_CLASSES, model_options, provider_options

    if args.explain:
        for kind in ("openai", "codex", "local", "scripted"):
            assert kind == "scripted" or kind in _PROVIDER_CLASSES
            print(f"[providers.NAME] kind = {kind!r}")
            for o in provider_options(kind):
                print(f"  {o.name} = {o.default}" if o.default else f"  {o.name} (required)")
        print("[models.NAME]")
        for o in model_options():
            print(f"  {o.name} = {o.default}" if o.default else f"  {o.name} (required)")
        return 0
    path = find_config(args)
    try:
        catalog, _, source, _ = load_catalog(args)
    except CliError as exc:
        return _failed("config", exc)
    print(f"{source if path else 'no config file: the built-in catalog'}: {len(catalog.models)} models ok")
    return 0


CHAT_HELP = """commands:
  /model NAME   use another catalog model from the next turn on
  /compact      summarise the conversation so far (keeps the last messages)
  /goal COND    work toward COND: turns until a judge finds it met (at most --max-turns turns)
  /goal         show the current goal; /goal clear clears it
  /loop PROMPT  run PROMPT, then again each time the model calls schedule_wakeup
  /checkpoints  list this session's checkpoints (with --checkpoints)
  /restore ID   restore the working tree to checkpoint ID; the model is told what changed
  /todos        the current todo list
  /plan on|off  turn plan mode on or off (mutating tools are denied while it is on)
  /help         this list
  /quit         leave (Ctrl-D too); Ctrl-C interrupts a running turn"""


def cmd_chat(args: argparse.Namespace) -> int:
    from transport import BusError

    if sys.stdin.isatty():
        import readline  # noqa: F401 - input() gets line editing and history once it is imported
    args.interactive = True  # chat reads its input lines: plans and asks are asked there too

    try:
        with forwarded_interrupts(), _agent(args) as agent:
            print(
                f"kbus chat: model {agent.model}; /help for commands, /quit to leave",
                file=sys.stderr,
                flush=True,
            )
            interrupted = agent.runtime.interrupted_turn()
            if interrupted is not None:  # the last session stopped during a turn: go on with it first
                print(
                    f"kbus: continuing turn {interrupted}, interrupted when the session stopped",
                    file=sys.stderr,
                )
                try:
                    agent.turn(None)
                except BusError as exc:
                    print(f"kbus: the interrupted turn could not continue: {exc}", file=sys.stderr)
            _repl(agent)
    except (CliError, BusError) as exc:
        return _failed("chat", exc)
    except KeyboardInterrupt:
        print("\nkbus chat: bye", file=sys.stderr)
        return 130
    return 0


def _repl(agent: Agent) -> None:
    from transport import BusError

    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print(file=sys.stdout)
            return
        except KeyboardInterrupt:
            if agent.second_interrupt():  # the first one's turn may have ended already: quit anyway
                raise
            print(file=sys.stdout)
            continue
        if not line:
            continue
        if line.startswith("/"):
            command, _, rest = line.partition(" ")
            rest = rest.strip()
            if command in ("/quit", "/exit"):
                return
            if command == "/help":
                print(CHAT_HELP, flush=True)
            elif command == "/model":
                if not rest:
                    print(f"model: {agent.model}", flush=True)
                    continue
                try:
                    resolved = agent.check_model(rest)
                    agent.runtime.set_llm(rest)
                except CliError as exc:
                    print(f"kbus: {exc}", flush=True)
                    continue
                agent.model, agent.local = rest, str(resolved.provider) == "local"
                print(f"model: {rest} (from the next turn on)", flush=True)
            elif command == "/compact":
                try:
                    before = len(agent.runtime.transcript())
                    agent.progress.start(f"compacting with {agent.model}")  # a model writes the summary
                    try:
                        agent.runtime.compact_now()
                    finally:
                        agent.progress.stop()
                    after = len(agent.runtime.transcript())
                except BusError as exc:  # a summary refused (empty, an echo) or failed: nothing replaced
                    print(f"kbus: /compact: {one_line(exc)}", flush=True)
                    continue
                if after == before:
                    print(f"nothing to compact yet ({before} messages)", flush=True)
                else:
                    print(f"compacted: {before} messages -> {after}", flush=True)
            elif command == "/todos":
                from actors.conversation.people import render_todos

                print(render_todos(agent.runtime.current_todos()), flush=True)
            elif command == "/plan" and rest in ("on", "off"):
                agent.runtime.set_plan_mode(rest == "on")
                print(f"plan mode {rest}", flush=True)
            elif command in ("/checkpoints", "/restore"):
                _checkpoint_command(agent, command, rest)
            elif command in ("/goal", "/loop"):
                _loop_command(agent, command, rest)
            else:
                print(f"unknown command {command}; /help lists them", flush=True)
            continue
        try:
            agent.check_prompt(line)
        except CliError as exc:
            print(f"kbus: {one_line(exc)}", flush=True)
            continue
        try:
            agent.turn(line)
        except BusError as exc:
            agent.printer.newline()
            print(f"kbus: the turn failed: {type(exc).__name__}: {exc}", flush=True)


def _loop_command(agent: Agent, command: str, rest: str) -> None:
    from transport import BusError

    try:
        if command == "/loop":
            if not rest:
                print("usage: /loop PROMPT", flush=True)
                return
            agent.wakeup_loop(rest)
        elif not rest:
            goal = agent.runtime.current_goal()
            print(
                "no goal" if goal is None else f"goal: {goal.condition} ({goal.turns}/{goal.max_turns} turns)"
            )
        elif rest == "clear":
            agent.runtime.clear_goal()
        else:
            agent.goal_loop(rest, rest, agent.args.max_turns)
    except BusError as exc:
        agent.printer.newline()
        print(f"kbus: {command} failed: {type(exc).__name__}: {exc}", flush=True)


def _checkpoint_command(agent: Agent, command: str, rest: str) -> None:
    from actors.conversation.checkpoints import checkpoint_lines
    from actors.conversation.shadow import CheckpointError
    from transport import BusError

    if agent.checkpoint_session is None or agent.shadow is None:
        print("checkpoints are off; start kbus chat with --checkpoints", flush=True)
        return
    try:
        if command == "/checkpoints":
            found = agent.shadow.list(agent.checkpoint_session)
            print("\n".join(checkpoint_lines(found)) or "no checkpoints yet", flush=True)
        elif not rest:
            print("usage: /restore CHECKPOINT_ID", flush=True)
        else:
            print(agent.runtime.restore_checkpoint(rest, timeout=120.0).text, flush=True)
    except (CheckpointError, BusError) as exc:
        print(f"kbus: {exc}", flush=True)


# ------------------------------------------------------------------------------------------- checkpoints
def cmd_checkpoints(args: argparse.Namespace) -> int:
    """``kbus checkpoints list|diff|restore``: every session's checkpoints of ``--workdir``."""
    from actors.conversation.checkpoints import append_restore_line, checkpoint_lines
    from actors.conversation.shadow import WORKTREE, CheckpointError, ShadowRepo

    data_dir = Path(args.data_dir or _default_data_dir())
    try:
        workdir = Path(args.workdir or os.getcwd())
        folder = ShadowRepo.default_folder(workdir, data_dir)
        shadow = ShadowRepo.for_work_tree(workdir, data_dir)
        if not (shadow.git_dir / "config").is_file():
            raise CliError(f"no checkpoints of {shadow.work_tree} in {data_dir}")
        if args.action == "list":
            sessions = [args.session] if args.session else shadow.sessions()
            for session in sessions:
                found = shadow.list(session)
                print(f"session {session}: {len(found)} checkpoint(s)")
                for line in checkpoint_lines(found):
                    print(f"  {line}")
            if not sessions:
                print("no checkpoints")
            return 0
        if not args.ids:
            raise CliError(f"checkpoints {args.action} needs a checkpoint id")
        if args.action == "diff":
            first = args.ids[0]
            if first.lower() == WORKTREE:
                if len(args.ids) < 2:
                    raise CliError("checkpoints diff worktree needs a checkpoint id after it")
                info = _find(shadow, args.ids[1], args.session)
            else:
                info = _find(shadow, first, args.session)
            second = args.ids[1] if len(args.ids) > 1 else WORKTREE
            print(shadow.diff(info.session_id, first, second, max_bytes=args.max_bytes))
            return 0
        if len(args.ids) != 1:
            raise CliError("checkpoints restore takes one checkpoint id")
        info = _find(shadow, args.ids[0], args.session)
        report = shadow.restore(info.session_id, info.checkpoint_id)
        append_restore_line(folder / f"{info.session_id}.jsonl", report, shadow.clock())
        print(report.text)
        return 0
    except CliError as exc:
        print(f"kbus checkpoints: {exc}", file=sys.stderr)
        return exc.code
    except CheckpointError as exc:
        print(f"kbus checkpoints: {exc}", file=sys.stderr)
        return 1


def _find(shadow: Any, checkpoint_id: str, session: str | None) -> Any:
    return shadow.resolve(session, checkpoint_id) if session else shadow.find(checkpoint_id)


# ----------------------------------------------------------------------------------------------- parser
GLOBAL_FLAGS: Final = frozenset({"-q", "--quiet", "--json", "-v", "--verbose"})
GLOBAL_VALUED: Final = frozenset({"--config", "-m", "--model"})


def options_after_command(argv: Sequence[str], commands: Iterable[str]) -> list[str]:
    """``argv`` with the global options given before the subcommand (``--config FILE``, ``-m MODEL``, ``-q``,
    ``--json``, ``-v``) moved right after it, where its own parser reads them: ``kbus --json -m x run P`` is
    ``kbus run --json -m x P``. A subcommand without such an option refuses it as usual (a usage error).
    Without a subcommand ``argv`` is returned as it is (argparse says what is missing)."""
    names = set(commands)
    before: list[str] = []
    moved: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in names:
            return [*before, arg, *moved, *argv[i + 1 :]]
        if arg == "--":
            break
        joined = "=" in arg and arg.split("=", 1)[0] in GLOBAL_VALUED  # --config=FILE, --model=M
        if arg in GLOBAL_FLAGS or joined or (arg.startswith("-m") and arg != "-m"):  # or -mMODEL
            moved.append(arg)
        elif arg in GLOBAL_VALUED and i + 1 < len(argv):
            moved += [arg, argv[i + 1]]
            i += 1
        else:
            before.append(arg)
        i += 1
    return list(argv)


def config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="a TOML with [providers.*]/[models.*] (and [node]); default $KBUS_CONFIG, else "
        "$XDG_CONFIG_HOME/kbus/config.toml (~/.config/kbus/config.toml) if it exists",
    )


def add_parsers(sub: Any) -> None:
    """Add ``run``, ``chat``, ``models``, ``tools``, ``config`` and ``checkpoints`` to the ``kbus``
    subparsers."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "-m", "--model", default=DEFAULT_MODEL, help=f"catalog model or alias (default {DEFAULT_MODEL})"
        )
        p.add_argument("--json", action="store_true", help="one JSON object per event on stdout")
        p.add_argument(
            "-q", "--quiet", action="store_true", help="the answer alone: no tool lines, progress or [done]"
        )
        p.add_argument(
            "--tools",
            action="append",
            metavar="MODULE:FUNCTION",
            help="add a tool (a function with type hints and a docstring); repeatable; FILE.py:FUNCTION too",
        )
        p.add_argument("--workdir", help="the folder the file tools work in (default: the current one)")
        p.add_argument(
            "--edit",
            action="store_true",
            help="add the workspace tools write_file, edit_file and run_command (confined to --workdir)",
        )
        p.add_argument(
            "--checkpoints",
            action="store_true",
            help="checkpoint tools on a shadow git repository of --workdir (under --data-dir)",
        )
        p.add_argument("--checkpoint-session", help="with --checkpoints: the checkpoint session's name")
        p.add_argument("--session", help="JSONL session file: resumed when it exists, appended to")
        p.add_argument("--system", help="the system prompt (default: one listing the tools)")
        p.add_argument("--max-steps", type=int, default=4, help="tool calls per turn at most (default 4)")
        p.add_argument("--max-turns", type=int, default=5, help="a goal loop's turns at most (default 5)")
        p.add_argument("--timeout", type=float, default=300.0, help="seconds one model request may take")
        config_option(p)
        p.add_argument(
            "--data-dir", help="in-process: where receipts are stored (default ~/.local/share/kbus)"
        )
        p.add_argument(
            "--connect", metavar="ENDPOINT", help="use the Router of a running node (ipc:// or tcp://)"
        )
        p.add_argument("--node", help="with --connect: that node's name")
        p.add_argument(
            "--capture",
            dest="capture_dir",
            metavar="DIR",
            help="write one DIR/<node>.buslog per node of the run",
        )
        p.add_argument("--router", default="router", help="with --connect: the Router's actor name")
        p.add_argument("--server-key", help="with tcp: the node's public key (Z85 text or a .key file)")
        p.add_argument("--key", help="with tcp: this client's secret key file (on the node's allowlist)")
        p.add_argument(
            "--name",
            help="with --connect: this client's node name (default: the --key file's name, or kbus-run-PID)",
        )
        people_cli.add_people_arguments(p)

    p = sub.add_parser("run", help="one agent turn: answer PROMPT (streamed), with tools, through the bus")
    p.add_argument("prompt", nargs="?", help="the prompt; read from stdin when absent or '-'")
    p.add_argument("--goal", metavar="CONDITION", help="a goal loop: turns until a judge finds CONDITION met")
    common(p)
    p.set_defaults(func=guarded("run", cmd_run))

    p = sub.add_parser("chat", help="an agent conversation in the terminal (/help inside)")
    common(p)
    p.set_defaults(func=guarded("chat", cmd_chat))

    p = sub.add_parser("models", help="the catalog's models: name, provider, context window, aliases")
    config_option(p)
    p.add_argument("--json", action="store_true", help="one JSON object per model")
    p.set_defaults(func=guarded("models", cmd_models))

    p = sub.add_parser("tools", help="the tools a turn has with these options (--json: with their schemas)")
    p.add_argument("--json", action="store_true", help="one JSON object per tool, with its JSON schema")
    p.add_argument("--workdir", help="the folder the file tools work in (default: the current one)")
    p.add_argument("--edit", action="store_true", help="with the workspace tools, as kbus run --edit")
    p.add_argument("--tools", action="append", metavar="MODULE:FUNCTION", help="add a tool, as kbus run")
    config_option(p)
    p.set_defaults(func=guarded("tools", cmd_tools))

    p = sub.add_parser("config", help="check the config file in use; --explain lists every option")
    config_option(p)
    p.add_argument("--explain", action="store_true", help="every provider and model option, with defaults")
    p.set_defaults(func=guarded("config", cmd_config))

    p = sub.add_parser("checkpoints", help="list, diff or restore the checkpoints of a working tree")
    p.add_argument("action", choices=("list", "diff", "restore"))
    p.add_argument("ids", nargs="*", metavar="ID", help="diff: ID [ID|worktree]; restore: ID")
    p.add_argument("--workdir", help="the working tree (default: the current folder)")
    p.add_argument("--data-dir", help="where the shadow repositories are (default ~/.local/share/kbus)")
    p.add_argument("--session", help="only this checkpoint session")
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="diff: print at most this much")
    p.set_defaults(func=guarded("checkpoints", cmd_checkpoints))
