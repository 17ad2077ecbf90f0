"""The kbus_replay pytest plugin used as a user would (pytester), issue 17: the README's example test is
recorded on the real embedded model, replayed offline with the model file gone, and then, with its tool
changed, fails with the first divergence at the recording's record of the tool host's answer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from actors.app.wiring import registry
from transport.capture import read_log
from transport.codec import decode_header

pytest_plugins = ["pytester"]

README = Path(__file__).resolve().parents[2] / "README.md"

# Loaded by the pytester runs: with NO_MODEL set, the embedded model's file cannot be found, so a run that
# needed the model would fail.
CONFTEST = """
import os

if os.environ.get("NO_MODEL"):
    import actors.router.providers.local as local

    def _gone():
        raise FileNotFoundError("the model is unavailable in this run")

    local.default_model_path = _gone
"""


def readme_example() -> str:
    section = README.read_text().split("## Testing your agent with replay", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README section has no python example"
    return match.group(1)


def test_mode_none_without_a_recording_fails_with_one_clear_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_agent=readme_example())
    result = pytester.runpytest_subprocess("--kbus-record-mode=none", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*kbus replay: no recording *n1.buslog (record mode 'none')*"])
    assert not (pytester.path / "replays").exists()


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_record_then_replay_offline_then_a_changed_tool_result_diverges(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = readme_example()
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_agent=code)
    cassette = pytester.path / "replays" / "test_agent" / "test_the_agent_multiplies" / "n1.buslog"

    recorded = pytester.runpytest_subprocess("-p", "no:cacheprovider")  # once: no recording yet, records
    recorded.assert_outcomes(passed=1)
    assert cassette.exists()
    before = cassette.read_bytes()

    monkeypatch.setenv("NO_MODEL", "1")
    replayed = pytester.runpytest_subprocess("--kbus-record-mode=none", "-p", "no:cacheprovider")
    replayed.assert_outcomes(passed=1)
    assert cassette.read_bytes() == before  # replaying never rewrites the recording

    # The tool answers one more: the tool host's reply is the first message that differs.
    assert "return str(a * b)" in code
    pytester.makepyfile(test_agent=code.replace("return str(a * b)", "return str(a * b + 1)"))
    changed = pytester.runpytest_subprocess("--kbus-record-mode=once", "-p", "no:cacheprovider")
    log = read_log(cassette)
    answer = next(
        r
        for r in log.records
        if r.at == "send"
        and r.actor == "n1/agent.host"
        and decode_header(r.frames[0]).kind == "conv.tool_execution"
    )
    assert registry().decode("conv.tool_execution", answer.frames[1]).text == "7006652"
    changed.stdout.fnmatch_lines(
        [
            f"*kbus replay of n1.buslog: first divergence at record {answer.n} (n1/agent.host): "
            "conv.tool_execution differs*",
            "*body.text: expected '7006652', got '7006653'*",
        ]
    )
    assert changed.ret != 0


SCRIPTED = '''
from actors.conversation import ConversationRuntime, ToolRegistry
from actors.router.actor import RouterActor
from actors.router.providers.scripted import ScriptedProvider

NODES = {nodes!r}


def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


def test_scripted(kbus_replay):
    tools = ToolRegistry()
    tools.register(shout)
    script = [{{"call": {{"name": "shout", "arguments": {{"text": "hi"}}}}, "id": "c1"}}, {{"text": "HI"}}]
    for name in NODES:
        with kbus_replay.node(name) as node:
            node.spawn(RouterActor, "router", providers={{"scripted": ScriptedProvider([script])}})
            builder = ConversationRuntime.builder().node(node).llm("scripted").tools(tools)
            agent = builder.name("agent").build()
            assert agent.run("shout hi", timeout=30).final_text == "HI"
            agent.stop()
'''


def test_record_modes_new_episodes_and_all(pytester: pytest.Pytester) -> None:
    """new_episodes records only the nodes the recording lacks; all records every node again."""
    folder = pytester.path / "replays" / "test_modes" / "test_scripted"
    pytester.makepyfile(test_modes=SCRIPTED.format(nodes=["n1"]))
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    first = (folder / "n1.buslog").read_bytes()

    pytester.makepyfile(test_modes=SCRIPTED.format(nodes=["n1", "n2"]))
    result = pytester.runpytest_subprocess("--kbus-record-mode=new_episodes", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert (folder / "n1.buslog").read_bytes() == first  # replayed, not recorded again
    assert (folder / "n2.buslog").exists()  # the new episode, recorded
    second = (folder / "n2.buslog").read_bytes()

    pytester.runpytest_subprocess("--kbus-record-mode=all", "-p", "no:cacheprovider").assert_outcomes(
        passed=1
    )
    assert (folder / "n1.buslog").read_bytes() != first and (folder / "n2.buslog").read_bytes() != second
