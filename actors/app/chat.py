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
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

from actors.app import people_cli
from actors.app.agent import DEFAULT_MODEL, Agent, forwarded_interrupts, running_agent, tool_registry
from actors.app.options import (
    FRAME_SETTING,
    CliError,
    check_prompt_size,
    default_data_dir,
    find_config,
    frame_limit,
    load_catalog,
)

DEMO_PROMPT: Final = (
    'What is 1234 * 5678? Call call_ktool with {"name": "calculate", "arguments": {"expression": '
    '"1234 * 5678"}} and answer with the result.'
)


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
        with forwarded_interrupts(), running_agent(args) as agent:
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
        with forwarded_interrupts(), running_agent(args) as agent:
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

    data_dir = Path(args.data_dir or default_data_dir())
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
