"""The main job: ``kbus run "PROMPT"`` (one turn) and ``kbus chat`` (a REPL): an agent answering on the bus.

Both build one conversation (``actors.conversation.ConversationRuntime``) with the built-in tools
(``actors.builtin_tools``: calculator, read_file, list_dir confined to ``--workdir``) plus any ``--tools
module:function``, stream the answer as the model generates it, show each tool call and its result, and end
each turn with its usage and the ids of the Router's usage receipts.

Where the model runs:

- in-process (the default): a node in this process with the Router (``actors.nodes.build_node``) and the
  conversation. The catalog is the Router's built-in one (``DEFAULT_CATALOG``) unless ``--config FILE``
  gives ``[providers.*]`` / ``[models.*]`` tables (and optionally ``[node]``); receipts go to ``--data-dir``.
- ``--connect ENDPOINT --node NAME``: a running ``kbus node`` with the Router; this process runs the
  conversation and its tools (they work on this machine's files) and asks that node's Router for the model.

The embedded ``smollm2`` model (135M parameters) is weak: in the built-in catalog it may decide to call a tool
on its first request and must answer in text after a tool result (``tool_choice_after_call = "none"``); the
system prompt lists the tools with the exact call form; ``--max-steps`` bounds tool calls per turn. It follows
a prompt that spells the call out (see ``DEMO_PROMPT``) and copies the calculator's ``"EXPR = VALUE"`` line
into its answer; asked vaguely, it often calls a tool that does not exist.

``--edit`` adds the workspace tools (``write_file``, ``edit_file``, ``run_command``, registered as mutating);
``--checkpoints`` binds the session to a shadow git repository of ``--workdir`` under ``--data-dir`` (tools
``checkpoint_save``/``list``/``diff``/``restore``; every save covers the whole tree, so a file a command
wrote is never missed); ``kbus checkpoints list|diff|restore`` reads and restores them from outside a chat.

Exit codes: 0 done, 1 a turn failed, 2 bad input (unknown model, bad ``--tools``, bad config), 3 the
endpoint or its Router is unreachable, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, TextIO

from actors import people_cli
from actors.builtin_tools import builtin_tools, register_workspace_tools

DEMO_PROMPT: Final = (
    'What is 1234 * 5678? Call call_ktool with {"name": "calculate", "arguments": {"expression": '
    '"1234 * 5678"}} and answer with the result.'
)
DEFAULT_MODEL: Final = "smollm2"
CONNECT_WAIT: Final = 5.0  # seconds to reach a --connect endpoint and its Router
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


_EXAMPLE = re.compile(r'e\.g\. "([^"]*)"')


def _example_arguments(parameters: Any) -> str:
    """A JSON object of example argument values (from the parameter's 'e.g. "..."' when it has one)."""
    properties = parameters.get("properties", {}) if isinstance(parameters, dict) else {}
    example: dict[str, Any] = {}
    for name, schema in properties.items():
        found = _EXAMPLE.search(str(schema.get("description", "")))
        kind = schema.get("type")
        if found:
            example[name] = found.group(1)
        elif kind in ("integer", "number"):
            example[name] = 1
        elif kind == "boolean":
            example[name] = True
        else:
            example[name] = "..."
    return json.dumps(example)


def system_prompt(specs: Sequence[Any]) -> str:
    """The focused prompt: each tool with the exact ``call_ktool`` form that runs it."""
    if not specs:
        return "You are a helpful assistant. Answer briefly."
    lines = ["You are a helpful assistant. Tools you can call with call_ktool:"]
    for spec in specs:
        plain = re.sub(r"\s*\([^)]*\)", "", spec.description)  # no parentheticals: "(bounded; ...)"
        summary = plain.split(". ")[0].split("; ")[0].rstrip(".")
        call = f'{{"name": "{spec.name}", "arguments": {_example_arguments(spec.parameters)}}}'
        lines.append(f"- {spec.name}: {summary}. Call: {call}")
    lines.append("After a tool result, answer the user in one short sentence.")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- progress
class Progress:
    """A spinner on stderr while the model loads or thinks; one line instead when stderr is not a tty."""

    FRAMES = "|/-\\"

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, label: str) -> None:
        self.stop()
        self._stop = threading.Event()
        if not self.stream.isatty():
            print(f"kbus: {label} ...", file=self.stream, flush=True)
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
class TurnPrinter:
    """The conversation's event sink: streams text, shows tool calls and results, notes the turn's end.

    ``emit`` runs on the sink actor's thread; the main thread reads what it recorded only after
    ``TurnFinished`` (``finished`` is set), so the two never write at the same time.
    """

    SHOWN_LINES = 12
    SHOWN_CHARS = 600

    def __init__(self, out: TextIO, progress: Progress) -> None:
        self.out = out
        self.progress = progress
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

    def newline(self) -> None:
        if not self.at_line_start:
            self._write("\n")

    def emit(self, event: Any) -> None:
        from actors.conversation import TextDelta, ToolCallFinished, ToolCallStarted, TurnFinished

        match event:
            case TextDelta(text=text):
                self.streamed = True
                self._write(text)
            case ToolCallStarted(name=name, arguments=arguments):
                self.tool_calls += 1
                self.newline()
                self._write(f"[tool call] {name} {arguments}\n")
            case ToolCallFinished(name=name, ok=ok, text=text):
                self._write(f"[tool {'result' if ok else 'error'}] {name}: {self._clip(text)}\n")
                self.streamed = False  # the answer is the text after the last tool call
            case TurnFinished():
                self.finished.set()
            case _:
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


# ------------------------------------------------------------------------------------------------ agent
def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "kbus"


def _in_process_settings(args: argparse.Namespace) -> Any:
    from config import from_mapping

    raw: dict[str, Any] = {}  # the Router's built-in catalog (actors/router/catalog.py DEFAULT_CATALOG)
    source, base_dir = "<kbus run>", None
    if args.config:
        path = Path(args.config)
        try:
            with path.open("rb") as f:
                raw = tomllib.load(f)
        except OSError as exc:
            raise CliError(f"--config {args.config}: {exc.strerror or exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise CliError(f"--config {args.config}: not valid TOML: {exc}") from None
        source, base_dir = str(path), path.absolute().parent
    node = dict(raw.get("node", {}))
    node.setdefault("name", f"kbus-{args.command}-{os.getpid()}")
    node.setdefault("data_dir", str(args.data_dir or _default_data_dir()))
    actors = dict(raw.get("actors", {}))
    if not any(isinstance(a, Mapping) and a.get("type") == "router" for a in actors.values()):
        actors["router"] = {"type": "router"}
    raw = {**raw, "node": node, "actors": actors}
    return from_mapping(raw, source=source, base_dir=base_dir)


def _security(args: argparse.Namespace) -> Any:
    from transport import KeyPair, Security

    keys = KeyPair.load(args.key) if args.key else None
    return Security(keys=keys)


def credential_names(args: argparse.Namespace) -> tuple[str, ...]:
    """Every ``api_key_env`` the catalog names (the built-in one, or ``--config``'s): ``run_command``'s
    environment never holds them. A config that cannot be read names none here (loading it reports why)."""
    from actors.router.catalog import ModelCatalog
    from config import ConfigError

    raw: dict[str, Any] = {}
    if args.config:
        try:
            with open(args.config, "rb") as f:
                raw = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            return ()
    try:
        catalog = ModelCatalog.from_mapping(raw)
    except (ConfigError, ValueError):
        return ()
    names = (p.options.get("api_key_env") for p in catalog.providers)
    return tuple(sorted({n for n in names if isinstance(n, str)}))


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
        self.progress = Progress(err)
        self.printer = TurnPrinter(out, self.progress)
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
        self.on_poll: Callable[[], None] = lambda: None  # between polls of a running turn (people_cli.py)

    def _new_operation(self) -> uuid.UUID:
        op = uuid.uuid4()
        self.operations.append(op)
        return op

    # ------------------------------------------------------------------------------ start and stop
    def start(self) -> None:
        from actors.conversation import Compactor, ConversationRuntime, ToolRegistry, ToolRegistryError

        if self.args.max_steps < 1:
            raise CliError("--max-steps must be at least 1")
        registry = ToolRegistry()  # load tools before starting anything: a bad spec starts nothing
        try:
            workdir = Path(self.args.workdir or os.getcwd())
            for fn in builtin_tools(workdir):
                registry.register(fn)
            if self.args.edit:
                register_workspace_tools(
                    registry, workdir, secret_env=credential_names(self.args), cancel=self.cancel_commands
                )
            for spec in self.args.tools or ():
                registry.register(load_tool(spec))
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise CliError(f"--workdir: {exc}") from None
        except ToolRegistryError as exc:
            raise CliError(f"--tools: {exc}") from None
        if self.args.connect:
            self._connect()
        else:
            self._in_process()
        resolved = self.check_model(self.model)
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
        from actors.nodes import build_node
        from config import ConfigError

        try:
            settings = _in_process_settings(self.args)
            self.node = build_node(settings)
        except ConfigError as exc:
            raise CliError(f"{exc}") from None
        router = next(a.name for a in settings.actors if a.type == "router")
        self.router = f"{self.node.name}/{router}"

    def _connect(self) -> None:
        from actors.nodes import registry
        from transport import BusError, Node, Peer
        from transport.envelope import is_node_name

        if not self.args.node:
            raise CliError("--connect needs --node NAME (the name of the node at that endpoint)")
        if not is_node_name(self.args.node):
            raise CliError(f"--node {self.args.node!r} is not a node name")
        if not re.match(r"^(ipc|tcp)://.+", self.args.connect):
            raise CliError(f"--connect {self.args.connect!r}: expected ipc://PATH or tcp://HOST:PORT")
        # A CURVE server lets a key speak only as the node name its allowlist gives it: like `kbus ping`,
        # default to the key file's name (`kbus keys NAME` writes NAME.key_secret).
        name = self.args.name or (
            Path(self.args.key).name.split(".")[0]
            if self.args.key
            else f"kbus-{self.args.command}-{os.getpid()}"
        )
        try:
            self.node = Node(name, registry=registry(), security=_security(self.args)).start()
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
            return RouterClient(self.node, self.router).resolve_model(model, timeout=CONNECT_WAIT)
        except UnknownModel as exc:
            raise CliError(f"{exc}") from None
        except BusError as exc:
            raise CliError(
                f"the Router at {self.router} does not answer: {type(exc).__name__}: {exc}", 3
            ) from None

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

    def turn(self, text: str | None) -> Any:
        """One turn: stream it, then print its usage and receipts; returns its RuntimeOutcome. ``None``
        continues the turn the session file shows interrupted (``continue_turn``)."""
        from actors.conversation import CancellationToken

        token = CancellationToken()
        self.runtime.set_interrupt_token(token)
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
                    if token.is_cancelled():
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
            self.printer._write(outcome.final_text)
        self.printer.newline()
        self.out.write(self.summary(outcome, self.operations[first_operation:]) + "\n")
        self.out.flush()
        return outcome

    def receipts(self, operations: Sequence[uuid.UUID]) -> str:
        """The ids of the receipts the Router issued for the turn's provider turns (or why not)."""
        from actors.router.client import RouterClient
        from transport import BusError

        router = RouterClient(self.node, self.router, timeout=CONNECT_WAIT)
        try:
            ids = [r.receipt_id for op in operations for r in router.receipts_for(op)]
        except BusError as exc:
            return f"(not available: {type(exc).__name__}: {exc})"
        return ", ".join(ids) or "(none)"

    def summary(self, outcome: Any, operations: Sequence[uuid.UUID]) -> str:
        usage = outcome.usage
        calls = outcome.steps
        return (
            f"[done] {outcome.finish_reason} · {calls} tool call{'s' if calls != 1 else ''} · "
            f"tokens in {usage.prompt_tokens} out {usage.completion_tokens} total {usage.total_tokens} · "
            f"receipts: {self.receipts(operations)}"
        )


def _server_key(text: str | None) -> str | None:
    if text is None:
        return None
    if os.path.exists(text):
        from transport.security import load_public_key

        return load_public_key(text)
    return text


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


def _failed(command: str, exc: BaseException) -> int:
    from transport import BusError

    if isinstance(exc, CliError):
        print(f"kbus {command}: {exc}", file=sys.stderr)
        return exc.code
    if isinstance(exc, BusError):
        print(f"kbus {command}: the turn failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    raise exc


# --------------------------------------------------------------------------------------------- commands
def cmd_run(args: argparse.Namespace) -> int:
    from transport import BusError

    if not args.prompt.strip():
        print("kbus run: the prompt is empty", file=sys.stderr)
        return 2
    args.interactive = sys.stdin.isatty()  # without a terminal an ask is denied, a plan rejected
    try:
        with _agent(args) as agent:
            outcome = agent.turn(args.prompt)
    except (CliError, BusError) as exc:
        return _failed("run", exc)
    except KeyboardInterrupt:
        print("\nkbus run: interrupted", file=sys.stderr)
        return 130
    return 0 if str(outcome.finish_reason) != "cancelled" else 130


CHAT_HELP = """commands:
  /model NAME   use another catalog model from the next turn on
  /compact      summarise the conversation so far (keeps the last messages)
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
        with _agent(args) as agent:
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
                    agent.runtime.compact_now()
                    after = len(agent.runtime.transcript())
                except BusError as exc:
                    print(f"kbus: compaction failed: {exc}", flush=True)
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
            else:
                print(f"unknown command {command}; /help lists them", flush=True)
            continue
        try:
            agent.turn(line)
        except BusError as exc:
            agent.printer.newline()
            print(f"kbus: the turn failed: {type(exc).__name__}: {exc}", flush=True)


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
def add_parsers(sub: Any) -> None:
    """Add ``run`` and ``chat`` to the ``kbus`` command's subparsers."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--model", default=DEFAULT_MODEL, help=f"catalog model or alias (default {DEFAULT_MODEL})"
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
        p.add_argument("--timeout", type=float, default=300.0, help="seconds one model request may take")
        p.add_argument("--config", help="in-process: a TOML with [providers.*]/[models.*] (and [node])")
        p.add_argument(
            "--data-dir", help="in-process: where receipts are stored (default ~/.local/share/kbus)"
        )
        p.add_argument(
            "--connect", metavar="ENDPOINT", help="use the Router of a running node (ipc:// or tcp://)"
        )
        p.add_argument("--node", help="with --connect: that node's name")
        p.add_argument("--router", default="router", help="with --connect: the Router's actor name")
        p.add_argument("--server-key", help="with tcp: the node's public key (Z85 text or a .key file)")
        p.add_argument("--key", help="with tcp: this client's secret key file (on the node's allowlist)")
        p.add_argument(
            "--name",
            help="with --connect: this client's node name (default: the --key file's name, or kbus-run-PID)",
        )
        people_cli.add_people_arguments(p)

    p = sub.add_parser("run", help="one agent turn: answer PROMPT (streamed), with tools, through the bus")
    p.add_argument("prompt")
    common(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="an agent conversation in the terminal (/help inside)")
    common(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("checkpoints", help="list, diff or restore the checkpoints of a working tree")
    p.add_argument("action", choices=("list", "diff", "restore"))
    p.add_argument("ids", nargs="*", metavar="ID", help="diff: ID [ID|worktree]; restore: ID")
    p.add_argument("--workdir", help="the working tree (default: the current folder)")
    p.add_argument("--data-dir", help="where the shadow repositories are (default ~/.local/share/kbus)")
    p.add_argument("--session", help="only this checkpoint session")
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="diff: print at most this much")
    p.set_defaults(func=cmd_checkpoints)
