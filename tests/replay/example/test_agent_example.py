"""The README's "Testing your agent with replay" example, verbatim (tests/replay/test_plugin.py runs it)."""

from actors.conversation import ConversationRuntime, ToolRegistry
from actors.router.actor import RouterActor


def multiply(a: int, b: int) -> str:
    """Multiply two integers."""
    return str(a * b)


def test_the_agent_multiplies(kbus_replay):
    tools = ToolRegistry()
    tools.register(multiply)
    with kbus_replay.node("n1") as node:  # records n1.buslog the first time, replays it later
        node.spawn(RouterActor, "router")  # the embedded SmolLM2 model (only while recording)
        agent = ConversationRuntime.builder().node(node).llm("smollm2").tools(tools).name("agent").build()
        outcome = agent.run(
            'What is 1234 * 5678? Call call_ktool with {"name": "multiply", "arguments": {"a": 1234, "b": 5678}} '
            "and answer with the result.",
            timeout=120,
        )
        results = [m.content for m in agent.transcript() if m.role == "tool"]
        agent.stop()
    assert outcome.steps == 1 and results == ["7006652"]
