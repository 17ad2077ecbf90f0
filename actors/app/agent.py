"""The agent behind ``kbus run`` and ``kbus chat`` (``actors.app.chat``).

``Agent`` builds one conversation on a node (in this process, or ``--connect`` to a running node's Router)
with the built-in tools plus ``--tools module:function`` (``load_tool``) and a system prompt listing them,
and runs its turns; ``InterruptForwarder`` brings Ctrl-C to the main thread, whichever thread it hit."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import math
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, TextIO

from actors.app import people_cli
from actors.app.builtin_tools import builtin_tools, register_workspace_tools
from actors.app.options import (
    CliError,
    check_credentials,
    check_prompt_size,
    check_session_file,
    credential_names,
    default_data_dir,
    frame_limit,
    in_process_settings,
    load_catalog,
    security_of,
    server_key,
)
from actors.app.output import Progress, TurnPrinter, use_colour

DEFAULT_MODEL: Final = "smollm2"
CONNECT_WAIT: Final = 5.0  # seconds to reach a --connect endpoint and its Router
# An in-process Router answers once its actor has started (ledger recovery, on a loaded machine slowly):
# wait for that answer, but end at once if the actor stopped instead, and give up only after this long.
STARTUP_WAIT: Final = 120.0
STOP_SEEN_WAIT: Final = 5.0  # how long a Router that refused as stopped may take to be marked stopped
QUIT_WINDOW: Final = 2.0  # seconds: a second Ctrl-C within this of the first quits
TURN_MARGIN: Final = 30.0  # seconds a turn may take beyond its model requests' --timeout each (tools)
CANCEL_GRACE: Final = 30.0  # seconds a turn interrupted at its limit has to end (a tool finishing, IT-02)


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
        data_dir = Path(self.args.data_dir or default_data_dir())
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
            settings = in_process_settings(self.args)
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
            self.node = Node(
                name, registry=registry(self.frame_bytes), security=security_of(self.args)
            ).start()
            key = server_key(self.args.server_key)
            self.node.connect(Peer(self.args.node, self.args.connect, key), wait=CONNECT_WAIT)
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
def running_agent(args: argparse.Namespace) -> Iterator[Agent]:
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
