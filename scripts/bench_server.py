"""The far side of scripts/bench: raw pyzmq servers and bus nodes in one child process.

Started by scripts/bench as ``[sys.executable, "-P", "scripts/bench_server.py", ...]``. It serves:

- raw REP echo servers (ipc, plain tcp, CURVE tcp) that unpack and repack each msgpack message;
- raw PULL sinks (ipc, tcp) that unpack and count each message, each with a REP socket answering its count;
- bus node ``srv`` (ipc + plain tcp) with the built-in echo actor, a ``SinkActor`` and a ``DirectSinkActor``;
- bus node ``srv`` (CURVE tcp, ZAP allowlist holding the bench client's key) with the echo actor.

Prints one line ``READY {json}`` with every endpoint once bound, then serves until SIGTERM/SIGINT or until
stdin closes (so a bench that dies never leaves it behind). Never imported by the packages.
"""

from __future__ import annotations

import argparse
import json
import queue
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

import actors
import config
import transport
from actors.app.echo import EchoActor
from actors.app.wiring import registry
from actors.base import BusActor, Context
from actors.router.actor import RouterActor
from actors.router.providers.base import TurnIO, TurnRequest, TurnSteps
from actors.router.providers.scripted import ScriptedProvider
from actors.runs.session import HostActor
from transport import KeyPair, Node, Security
from transport.messages import Echo

READY_TIMEOUT = 10.0


def check_one_root() -> None:
    roots = {Path(str(m.__file__)).resolve().parents[1] for m in (actors, config, transport)}
    if len(roots) != 1:
        raise SystemExit(f"actors/transport/config imported from different places: {roots}")


class BenchScripted(ScriptedProvider):
    """The scripted provider, its script read from the turn's input: "events=N delay=SECONDS".

    Used by scripts/bench both here (through the Router) and directly in the bench process, so both
    sides run exactly the same provider code."""

    def steps(self, request: TurnRequest, io: TurnIO) -> TurnSteps:
        self.add(bench_script(request.messages[-1].content))
        return super().steps(request, io)


def bench_script(spec: str) -> list[dict[str, Any]]:
    """``events=N delay=SECONDS`` (N text events), and ``calls=K`` first: K tool calls before the text."""
    fields = dict(part.split("=", 1) for part in spec.split())
    events, delay = int(fields["events"]), float(fields["delay"])
    step: list[dict[str, Any]] = [{"text": "x"}] + ([{"delay": delay}] if delay > 0 else [])
    calls = [
        {"call": {"name": "bench", "arguments": {"i": i}}, "id": f"call_{i}"}
        for i in range(int(fields.get("calls", 0)))
    ]
    return calls + step * events


def prepared(spec: str, tools: str) -> Any:
    """The round a bench host prepares: the scripted model, scripted by ``spec`` (``bench_script``)."""
    from actors.inference.handle import PreparedRound

    return PreparedRound(
        input=spec,
        provider_input=spec,
        continuation=None,
        model="scripted",
        reasoning_effort="",
        tool_description=tools,
        timeout=None,
    )


class BenchHost:
    """A zero-latency SessionHost: every round runs one scripted one-event turn until ``rounds``, then
    completes. Measures the session loop's own cost per round (scripts/bench --only session)."""

    def __init__(self) -> None:
        self._prepared = prepared("events=1 delay=0", "bench")

    def prepare_round(self, round: int) -> Any:
        from actors.runs.session import RoundPreparation

        return RoundPreparation.Run(prepared=self._prepared)

    def record(self, event: Any) -> None:
        return None

    def execute_tool(self, call: Any, provider_operation_id: Any) -> Any:
        raise RuntimeError("the bench host offers no tools")

    def prepare_provider_resume(self, outcome: Any) -> Any:
        raise RuntimeError("the bench host offers no tools")

    def complete_capture(self, capture: Any, contents: str) -> Any:
        raise RuntimeError("the bench host captures nothing")

    def complete_round(self, completion: Any) -> Any:
        from actors.runs.session import SessionControl

        return SessionControl.Continue()


class BenchToolHost:
    """A zero-latency SessionHost for tool rounds: one provider turn of ``rounds - 1`` tool calls and its
    answer (``Echo(seq=rounds)`` to ``toolhost.rounds`` sets it), each call run at once and continued, the
    completion ending the run: the cost per tool round (scripts/bench --only session)."""

    def __init__(self) -> None:
        self.rounds = 1
        self.calls = 0

    def prepare_round(self, round: int) -> Any:
        from actors.runs.session import RoundPreparation

        spec = f"calls={self.rounds - 1} events=1 delay=0"
        return RoundPreparation.Run(prepared=prepared(spec, "bench(i): nothing"))

    def record(self, event: Any) -> None:
        return None

    def execute_tool(self, call: Any, provider_operation_id: Any) -> Any:
        from actors.runs.session import SessionToolOutcome

        self.calls += 1
        return SessionToolOutcome.success("ok")

    def prepare_provider_resume(self, outcome: Any) -> Any:
        from actors.runs.session import ProviderResume

        return ProviderResume.Continue(outcome=outcome)

    def complete_capture(self, capture: Any, contents: str) -> Any:
        raise RuntimeError("the bench host captures nothing")

    def complete_round(self, completion: Any) -> Any:
        from actors.runs.session import SessionControl

        return SessionControl.Complete(answer=completion.answer)


class ToolRoundsActor(BusActor):
    """``Echo(seq=n>0)``: the tool host's next runs have n rounds, its call count zeroed; ``Echo(seq=0)`` is
    answered with that count."""

    def __init__(self, node: Any, address: str, *, host: BenchToolHost) -> None:
        super().__init__(node, address)
        self.host = host

    def handle(self, message: Any, ctx: Context) -> Any:
        if not isinstance(message, Echo):
            raise TypeError(f"toolhost.rounds does not answer {type(message).__name__}")
        if message.seq > 0:
            self.host.rounds, self.host.calls = message.seq, 0
        return Echo(seq=self.host.calls)


class SinkActor(BusActor):
    """Counts the tells it receives; an ``Echo`` request is answered with ``Echo(seq=count)``."""

    def __init__(self, node: Any, address: str) -> None:
        super().__init__(node, address)
        self.count = 0

    def handle(self, message: Any, ctx: Context) -> Any:
        if not ctx.wants_reply:
            self.count += 1
            return None
        if isinstance(message, Echo):
            return Echo(seq=self.count)
        raise TypeError(f"sink does not answer {type(message).__name__}")


class DirectSinkActor(SinkActor):
    """``SinkActor`` on a socket of its own (``DIRECT``): a peer's tells reach its thread with no I/O-thread
    hand-off, as the raw PULL socket's reach the thread that owns it."""

    DIRECT = True


# ------------------------------------------------------------------------------------------ raw servers
def _in_thread(
    ctx: zmq.Context[Any],
    kind: int,
    endpoint: str,
    serve: Callable[[zmq.Socket[Any]], None],
    curve_secret: str | None = None,
) -> str:
    """Bind a socket inside its own thread (which then owns it) and return the bound endpoint."""
    bound: queue.SimpleQueue[str | BaseException] = queue.SimpleQueue()

    def run() -> None:
        sock = ctx.socket(kind)
        try:
            sock.linger = 0
            if curve_secret is not None:
                # No ZAP handler on this context: any client key is accepted (a raw baseline, not security).
                sock.curve_server = True
                sock.curve_secretkey = curve_secret.encode("ascii")
            sock.bind(endpoint)
            bound.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except (zmq.ZMQError, OSError) as exc:
            sock.close(0)
            bound.put(exc)
            return
        try:
            serve(sock)
        except zmq.ContextTerminated:
            pass  # shutdown: Context.term() wakes every blocked recv with ETERM
        finally:
            sock.close(0)

    threading.Thread(target=run, name=f"raw-{endpoint}", daemon=True).start()
    result = bound.get(timeout=READY_TIMEOUT)
    if isinstance(result, BaseException):
        raise result
    return result


def serve_echo(sock: zmq.Socket[Any]) -> None:
    while True:
        # Unpack and repack, as the bus does with its body: both sides pay the codec.
        sock.send(msgpack.packb(msgpack.unpackb(sock.recv())))


class RawSink:
    """A PULL socket's thread counts what arrives; a REP socket's thread answers with the count."""

    def __init__(self) -> None:
        self.count = 0  # written by the PULL thread only

    def serve_pull(self, sock: zmq.Socket[Any]) -> None:
        while True:
            msgpack.unpackb(sock.recv())
            self.count += 1

    def serve_count(self, sock: zmq.Socket[Any]) -> None:
        while True:
            sock.recv()
            sock.send(msgpack.packb(self.count))


# ---------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="private (0700) folder for ipc sockets")
    ap.add_argument("--secret-key-file", required=True, help="this server's CURVE secret key (0600)")
    ap.add_argument("--allow", required=True, help="the bench client's CURVE public key (Z85)")
    args = ap.parse_args()
    check_one_root()

    folder = Path(args.dir)
    keys = KeyPair.load(args.secret_key_file)
    raw_ctx: zmq.Context[Any] = zmq.Context()
    nodes: list[Node] = []
    try:
        raw_echo = {
            "ipc": _in_thread(raw_ctx, zmq.REP, f"ipc://{folder}/raw-echo", serve_echo),
            "tcp": _in_thread(raw_ctx, zmq.REP, "tcp://127.0.0.1:*", serve_echo),
            "tcp_curve": _in_thread(raw_ctx, zmq.REP, "tcp://127.0.0.1:*", serve_echo, keys.secret),
        }
        raw_sink = {}
        for transport_name, pull_ep, ctl_ep in (
            ("ipc", f"ipc://{folder}/raw-sink", f"ipc://{folder}/raw-sink-ctl"),
            ("tcp", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
        ):
            sink = RawSink()
            raw_sink[transport_name] = {
                "push": _in_thread(raw_ctx, zmq.PULL, pull_ep, sink.serve_pull),
                "count": _in_thread(raw_ctx, zmq.REP, ctl_ep, sink.serve_count),
            }

        plain = Node(
            "srv",
            bind=[f"ipc://{folder}/bus", "tcp://127.0.0.1:*"],
            security=Security(plain_insecure_for_benchmarks=True),
            registry=registry(),
        ).start()
        nodes.append(plain)
        plain.spawn(EchoActor, "echo")
        plain.spawn(SinkActor, "sink")
        plain.spawn(DirectSinkActor, "sink.direct")
        plain.spawn(RouterActor, "router", providers={"scripted": BenchScripted()})
        plain.spawn(HostActor, "host", host=BenchHost())
        tool_host = BenchToolHost()
        plain.spawn(HostActor, "toolhost", host=tool_host)
        plain.spawn(ToolRoundsActor, "toolhost.rounds", host=tool_host)
        curve = Node(
            "srv", bind=["tcp://127.0.0.1:*"], security=Security(keys=keys, allow={args.allow: "bench"})
        ).start()
        nodes.append(curve)
        curve.spawn(EchoActor, "echo")

        info = {
            "raw_echo": raw_echo,
            "raw_sink": raw_sink,
            "bus": {"ipc": plain.endpoints[0], "tcp": plain.endpoints[1], "tcp_curve": curve.endpoints[0]},
            "server_key": keys.public,
        }
        print("READY " + json.dumps(info), flush=True)

        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        signal.signal(signal.SIGINT, lambda *_: done.set())
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
        done.wait()
    finally:
        for node in reversed(nodes):
            node.stop()
        raw_ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
