"""The pieces of ``kbus run``/``kbus chat`` that need no process: tool specs, the system prompt, settings."""

from __future__ import annotations

import argparse
import io
import itertools
import logging
import os
import select
from pathlib import Path

import pytest

from actors.app.agent import Agent, load_tool, system_prompt
from actors.app.builtin_tools import builtin_tools
from actors.app.chat import DEMO_PROMPT, options_after_command
from actors.app.cli import parser
from actors.app.options import (
    CliError,
    check_credentials,
    check_session_file,
    find_config,
    in_process_settings,
    load_catalog,
)
from actors.app.output import use_colour
from actors.conversation import FinishReason, ToolRegistry
from actors.router.catalog import ModelCatalog

ROOT = Path(__file__).resolve().parents[3]


def test_load_tool_from_a_module_and_from_a_file(tmp_path: Path) -> None:
    assert load_tool("os.path:basename")("a/b.txt") == "b.txt"
    (tmp_path / "extra_tools.py").write_text("def twice(n: int) -> int:\n    return 2 * n\n")
    assert load_tool(f"{tmp_path / 'extra_tools.py'}:twice")(21) == 42


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "expected MODULE:FUNCTION"),
        (":f", "expected MODULE:FUNCTION"),
        ("os:not an identifier", "expected MODULE:FUNCTION"),
        ("no_such_module_kbus:f", "cannot import no_such_module_kbus: ModuleNotFoundError"),
        ("/nonexistent/tools.py:f", "no such file"),
        ("os:no_such_function", "has no 'no_such_function'"),
        ("os:sep", "is not a function"),
    ],
)
def test_load_tool_refuses_bad_specs_in_one_line(spec: str, message: str) -> None:
    with pytest.raises(CliError, match=message) as caught:
        load_tool(spec)
    assert "\n" not in str(caught.value)
    assert caught.value.code == 2


def test_a_tool_module_that_raises_on_import_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(CliError, match="RuntimeError: boom"):
        load_tool(f"{tmp_path / 'broken.py'}:f")


def test_the_system_prompt_lists_every_tool_and_no_example_call(tmp_path: Path) -> None:
    registry = ToolRegistry()
    for fn in builtin_tools(tmp_path):
        registry.register(fn)
    prompt = system_prompt(registry.specs())
    assert "- calculate(expression): Evaluate an arithmetic expression.\n" in prompt
    assert "- read_file(path): Return the text of a file in the working directory.\n" in prompt
    assert "- list_dir(path): List a directory in the working directory, one entry a line.\n" in prompt
    # Nothing the 135M model could copy into an unrelated call: no call, no example value.
    for copied in ('"name"', "(12 + 30) * 2", "notes.txt", "{"):
        assert copied not in prompt
    assert "call_ktool" in prompt
    assert "tool" not in system_prompt(())


def _args(**given: object) -> argparse.Namespace:
    return argparse.Namespace(**{"config": None, "data_dir": None, "command": "run", **given})


def test_in_process_settings_add_a_router_and_keep_the_config_catalog(tmp_path: Path) -> None:
    settings = in_process_settings(_args(data_dir=str(tmp_path)))
    assert [(a.name, a.type) for a in settings.actors] == [("router", "router")]
    assert settings.node.data_dir == tmp_path
    assert settings.node.bind == ()  # in-process: nothing listens
    _, _, provider = ModelCatalog.from_settings(settings).resolve("smollm2")  # the built-in agent entry
    assert provider.kind == "local" and provider.options["tool_choice_after_call"] == "none"

    config = tmp_path / "mine.toml"
    config.write_text('[node]\nname = "mine"\n[providers.scripted]\nkind = "scripted"\n')
    settings = in_process_settings(_args(config=str(config), data_dir=str(tmp_path)))
    assert settings.node.name == "mine"
    assert settings.extra["providers"] == {"scripted": {"kind": "scripted"}}
    assert [a.type for a in settings.actors] == ["router"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[node\n", "not valid TOML"),
        ('[node]\nname = "bad name"\n', "node.name: expected a node name"),
        (
            "[nodes]\n",
            "[nodes]: unknown table (known: node, security, peers, actors, providers, models; "
            "did you mean [node]?)",
        ),
        (
            "[settings]\n",
            "[settings]: unknown table (known: node, security, peers, actors, providers, models)",
        ),
    ],
)
def test_a_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    with pytest.raises(CliError) as caught:
        in_process_settings(_args(config=str(config)))
    assert str(caught.value).startswith(f"{config}: ") and message in str(caught.value)
    assert "\n" not in str(caught.value) and caught.value.code == 2


def test_config_discovery_order(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    found = xdg / "kbus" / "config.toml"
    args = argparse.Namespace(config=None)
    assert find_config(args, {"XDG_CONFIG_HOME": str(xdg)}) is None  # no such file: the built-in catalog
    found.parent.mkdir(parents=True)
    found.write_text("")
    assert find_config(args, {"XDG_CONFIG_HOME": str(xdg)}) == found
    assert find_config(args, {"XDG_CONFIG_HOME": str(xdg), "KBUS_CONFIG": "e.toml"}) == Path("e.toml")
    given = argparse.Namespace(config="a.toml")
    assert find_config(given, {"XDG_CONFIG_HOME": str(xdg), "KBUS_CONFIG": "e.toml"}) == Path("a.toml")


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_only_on_a_terminal_and_never_with_no_color() -> None:
    assert use_colour(Tty(), {})
    assert not use_colour(io.StringIO(), {})
    assert not use_colour(Tty(), {"NO_COLOR": "1"})
    assert not use_colour(Tty(), {"TERM": "dumb"})


def test_two_ctrl_c_within_two_seconds_quit() -> None:
    agent = Agent(parser().parse_args(["run", "hi"]), io.StringIO(), io.StringIO())
    now = [100.0]
    agent.key_clock = lambda: now[0]
    assert not agent.second_interrupt()
    now[0] += 1.9
    assert agent.second_interrupt()
    now[0] += 5.0
    assert not agent.second_interrupt()  # long after: only an interrupt again
    now[0] += 2.0
    assert not agent.second_interrupt()  # exactly two seconds: not "within"


def test_usage_no_receipt_reported_is_unknown_never_zero() -> None:
    from actors.conversation.types import ChatTokenUsage

    agent = Agent(parser().parse_args(["run", "hi"]), io.StringIO(), io.StringIO())
    outcome = argparse.Namespace(finish_reason="stop", steps=0, usage=ChatTokenUsage())
    unknown = argparse.Namespace(receipt_id="rcpt-1", usage=None)
    known = argparse.Namespace(receipt_id="rcpt-2", usage=object())
    assert "· tokens unknown ·" in agent.summary(outcome, [unknown])
    assert "tokens in 0 out 0 total 0 (unknown for 1 of 2 requests)" in agent.summary(
        outcome, [unknown, known]
    )
    assert "tokens in 0 out 0 total 0 · receipts: rcpt-2" in agent.summary(outcome, [known])


@pytest.mark.parametrize(
    ("content", "ok"),
    [
        (None, True),
        ("", True),
        ('{"type":"session","format":2}\n', True),
        ("my notes\n", False),
        ("[1, 2]\n", False),
        ('{"no": "type"}\n', False),
    ],
)
def test_only_a_journal_is_taken_as_a_session_file(tmp_path: Path, content: str | None, ok: bool) -> None:
    path = tmp_path / "s.jsonl"
    if content is not None:
        path.write_text(content)
    if ok:
        check_session_file(str(path))
    else:
        with pytest.raises(CliError, match="not a kbus session file"):
            check_session_file(str(path))


def test_the_demo_runs_the_prompt_the_real_model_test_covers() -> None:
    demo = (ROOT / "scripts" / "demo").read_text()
    assert f"prompt='{DEMO_PROMPT}'" in demo
    assert ".venv/bin/kbus run" in demo


HANG = '[providers.scripted]\nkind = "scripted"\nscripts = [[{ text = "thinking" }, { hang = true }]]\n'


def test_a_turn_past_its_limit_is_interrupted_not_left_running(tmp_path: Path) -> None:
    """IT-06: the turn limit covers every model request of a turn (--max-steps + 1, and a compaction's
    summary), each allowed --timeout; a turn still running at the limit is cancelled, so it ends CANCELLED
    (here at once: the injected clock jumps past the limit) instead of failing while the model runs on."""
    config = tmp_path / "hang.toml"
    config.write_text(HANG)
    args = parser().parse_args(
        ["chat", "--config", str(config), "--model", "scripted", "--data-dir", str(tmp_path / "data"),
         "--timeout", "20", "--max-steps", "3"]
    )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    agent = Agent(args, out, err)
    assert agent.turn_limit() > (3 + 2) * 20  # max_steps + 1 requests, a summary, and the tools' time
    ticks = itertools.chain([0.0], itertools.repeat(agent.turn_limit()))
    agent.clock = lambda: next(ticks)  # the limit is reached at the first check
    agent.start()
    try:
        outcome = agent.turn("take your time")
    finally:
        agent.stop()
    assert outcome.finish_reason is FinishReason.CANCELLED
    assert "the turn ran past its limit of 130 s; interrupting it" in err.getvalue()
    assert "[done] cancelled" in err.getvalue()  # the done line goes to stderr


BLOCKING_TOOL = '''
def wait_here() -> str:
    """Wait until the test says so."""
    with open({entered!r}, "w") as entered:
        entered.write("entered\\n")
    with open({gate!r}) as gate:
        return gate.readline().strip()
'''


class _ReleaseOnWarning(logging.Handler):
    """Opens the tool's gate once the runtime has given up waiting for the busy tool host."""

    def __init__(self, gate: int) -> None:
        super().__init__(logging.WARNING)
        self.gate = gate
        self.released = False

    def emit(self, record: logging.LogRecord) -> None:
        if "did not stop" in record.getMessage() and not self.released:
            self.released = True
            os.write(self.gate, b"released\n")


def test_stopping_with_a_tool_still_running_stops_the_node_without_raising(tmp_path: Path) -> None:
    """``kbus chat`` quitting (a second Ctrl-C) while a tool runs: ``Agent.stop`` logs the busy tool host,
    stops the rest and the node, and raises nothing (before, pykka.Timeout escaped and the node stayed)."""
    entered_path, gate_path = tmp_path / "entered", tmp_path / "gate"
    os.mkfifo(entered_path)
    os.mkfifo(gate_path)
    entered = os.open(entered_path, os.O_RDWR)  # both ends held: neither side's open blocks
    gate = os.open(gate_path, os.O_RDWR)
    tool = tmp_path / "blocking.py"
    tool.write_text(BLOCKING_TOOL.format(entered=str(entered_path), gate=str(gate_path)))
    config = tmp_path / "tool.toml"
    config.write_text(
        '[providers.scripted]\nkind = "scripted"\n'
        'scripts = [[{ call = { name = "wait_here", arguments = {} }, id = "w1" }, { text = "done" }]]\n'
    )
    args = parser().parse_args(
        ["chat", "--config", str(config), "--model", "scripted", "--data-dir", str(tmp_path / "data"),
         "--tools", f"{tool}:wait_here"]
    )  # fmt: skip
    agent = Agent(args, io.StringIO(), io.StringIO())
    agent.stop_timeout = 0.2
    release = _ReleaseOnWarning(gate)
    logger = logging.getLogger("actors.conversation.runtime")
    logger.addHandler(release)
    try:
        agent.start()
        node = agent.node
        agent.runtime.run_future("wait")
        assert select.select([entered], [], [], 10.0)[0], "the tool never started"
        agent.stop(close=False)  # the tool host is busy in wait_here
        assert release.released  # stop waited for the busy host, gave up, and went on
        assert agent.node is None and agent.runtime is None
        assert not node.running and node.actors() == ()  # the node stopped, every actor with it
    finally:
        logger.removeHandler(release)
        os.write(gate, b"released\n")
        if agent.node is not None:
            agent.node.stop()
        os.close(entered)
        os.close(gate)


def test_the_readme_example_config_passes_the_checks(tmp_path: Path) -> None:
    """The README's example ``[providers]``/``[models]`` tables are a config kbus accepts as written."""
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### A local OpenAI-compatible server, or codex") :]
    (block,) = re.findall(r"```toml\n(.*?)```", section, re.S)[:1]
    config = tmp_path / "config.toml"
    config.write_text(block)
    catalog = load_catalog(argparse.Namespace(config=str(config)))[0]
    assert {m.model for m in catalog.models} == {"lab", "gpt"}
    assert check_credentials(catalog, "l", str(config), {"LAB_API_KEY": "k"}).model == "lab"
    with pytest.raises(CliError, match=r"providers\.lab\.api_key_env: the environment variable LAB_API_KEY"):
        check_credentials(catalog, "lab", str(config), {})


COMMANDS = ("node", "run", "chat", "models", "config")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--json", "-m", "x", "run", "P"], ["run", "--json", "-m", "x", "P"]),
        (["--config", "c.toml", "-q", "run", "-v"], ["run", "--config", "c.toml", "-q", "-v"]),
        (["--config=c.toml", "--model=x", "-mx", "chat"], ["chat", "--config=c.toml", "--model=x", "-mx"]),
        (["-v", "models", "--json"], ["models", "-v", "--json"]),
        (["--config", "run", "run", "P"], ["run", "--config", "run", "P"]),  # a value is never the command
        (["run", "--json", "models"], ["run", "--json", "models"]),  # after the command: left alone
        (["--json"], ["--json"]),  # no command: argparse reports it
    ],
)
def test_global_options_before_the_command_are_read_after_it(argv: list[str], expected: list[str]) -> None:
    assert options_after_command(argv, COMMANDS) == expected


def test_options_before_or_after_the_subcommand_parse_alike() -> None:
    """Issue 16: --config, -m, -q, --json and -v in either place give the same arguments."""
    commands = ("run", "chat", "models", "config", "node")
    before = parser().parse_args(
        options_after_command(["--config", "c.toml", "-m", "x", "-q", "--json", "-v", "run", "P"], commands)
    )
    after = parser().parse_args(["run", "P", "--config", "c.toml", "-m", "x", "-q", "--json", "-v"])
    assert {**vars(before), "func": None} == {**vars(after), "func": None}
    assert (after.config, after.model, after.quiet, after.json, after.verbose) == (
        "c.toml",
        "x",
        True,
        True,
        True,
    )
