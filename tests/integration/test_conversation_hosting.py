"""Many conversations in one node, hosted on its host pools (actors/base.py ``HostPool``): threads grow with
the pools' configured size, not with the number of conversations. The Router runs in its own process
(``kbus node``) over ipc, so every thread counted here is the conversation side's."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import KbusNode

from actors.app.wiring import registry
from actors.base import HostPool
from actors.conversation import ConversationRuntime, Message, ToolRegistry
from actors.conversation.kernel import CONVERSATION_HOSTS, TOOL_HOSTS
from transport import Node, Peer

pytestmark = pytest.mark.integration

HOSTS, TOOL_HOST_COUNT = 3, 2
N = 100  # then 2N: 200 conversations alive, all running a turn at once
WAIT = 120.0  # bounds a whole wave of turns on a loaded machine

ROUTER_CONFIG = """
[node]
name = "brain"
bind = ["ipc://brain.sock"]
data_dir = "data"
[actors.router]
type = "router"
[providers.scripted]
kind = "scripted"
default = [
  { call = { name = "add", arguments = { a = 40, b = 2 } }, id = "call-1" },
  { text = "The answer is 42.", chunks = 2 },
  { usage = { input_tokens = 20, output_tokens = 5, total_tokens = 25 } },
]
[models.scripted]
provider = "scripted"
provider_model = "scripted-v1"
context_window = 4096
max_input_tokens = 4000
"""


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def run_wave(runtimes: list[ConversationRuntime]) -> None:
    """One turn on every runtime at once; each answers its own question, with its own tool result."""
    futures = {rt: rt.run_future(f"question of {rt.address}", timeout=WAIT) for rt in runtimes}
    concurrent.futures.wait(futures.values(), timeout=WAIT)
    for rt, future in futures.items():
        outcome = future.result(timeout=0)
        assert outcome.final_text == "The answer is 42."
        transcript = rt.transcript(timeout=WAIT)
        assert transcript[-4] == Message.user(f"question of {rt.address}")
        assert transcript[-2].role == "tool" and transcript[-2].content == "42"


def test_threads_do_not_grow_with_the_conversations_hosted(
    ipc_dir: Path, make_node: Callable[..., Node], kbus_node: Callable[..., KbusNode]
) -> None:
    """N conversations, then 2N, each with its tool host and plan gates, all running a turn at once: the
    node's thread count is the same for both, and within the pools' size of what it was before any."""
    (ipc_dir / "brain.toml").write_text(ROUTER_CONFIG)
    kbus_node(ipc_dir / "brain.toml")
    node = make_node("n1", registry=registry(), peers=[Peer("brain", f"ipc://{ipc_dir}/brain.sock")])
    node.connect(node.peers()["brain"], wait=20)
    HostPool.configure(node, CONVERSATION_HOSTS, HOSTS)
    HostPool.configure(node, TOOL_HOSTS, TOOL_HOST_COUNT)
    tools = ToolRegistry()
    tools.register(add)
    runtimes: list[ConversationRuntime] = []

    def build(n: int) -> None:
        for _ in range(n):
            b = ConversationRuntime.builder().node(node).router("brain/router").llm("scripted").tools(tools)
            runtimes.append(b.timeout(WAIT).build())

    before = threading.active_count()
    try:
        build(N)
        run_wave(runtimes)
        with_n = threading.active_count()
        build(N)
        run_wave(runtimes)
        with_2n = threading.active_count()
        assert len(runtimes) == 2 * N
        assert with_2n == with_n, (before, with_n, with_2n)
        assert with_n - before <= HOSTS + TOOL_HOST_COUNT, (before, with_n)
    finally:
        for rt in runtimes:
            rt.stop()
