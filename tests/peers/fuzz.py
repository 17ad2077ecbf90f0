"""A seeded wire fuzzer against one real node running every actor type (``fuzz_node.py``), issue 18.

``Topology`` starts the processes (the fake Responses server for codex, then the node) and ends them by
their PIDs. ``FrameMaker(seed)`` makes hostile frames of a few classes, deterministically from its seed
(only ``ts``/``deadline`` follow the clock):

- ``garbage``: random bytes for header and body; ``shape``: the wrong number of frames;
- ``header``: a well-formed header with one slot broken (type, flow, address, id size, version, times);
- ``body_bytes``: a good header, random bytes for the body; ``unknown_kind``: a tag nobody registered;
- ``typed``: a body built from the registry's field types for a random tag, now and then with a field of
  the wrong type, missing or unknown, huge counts and long strings included;
- ``reply``: a reply or part with a made-up ``corr``; ``expired``: a request whose deadline passed.

``Fuzzer.batch(n)`` sends ``n`` frames spread over the actors (reading whatever comes back), then checks
with a well-behaved client (a real ``transport.Node``) that every actor answers ``Ping`` with its own
address, that echo, stream and the Router's stats answer right, and that the node's process is alive.
``main()`` is ``scripts/fuzz``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import types
import typing
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import msgpack
import zmq

from actors.app.wiring import registry
from actors.router.messages import GetRouterStats, RouterStats
from transport import BusError, Node, Peer
from transport.messages import Echo, EchoStream, NodeStats, Ping, Pong, StatsQuery

PEERS = Path(__file__).resolve().parent
NODE = "fz"
CLASSES = ("garbage", "shape", "header", "body_bytes", "unknown_kind", "typed", "reply", "expired")
WEIGHTS = (1, 1, 2, 2, 1, 8, 1, 1)
FLOWS = ("tell", "ask", "stream")
CHECK_TIMEOUT = 60.0  # every actor answers Ping within this, after each batch


# --------------------------------------------------------------------------------------------- processes
@dataclass
class Process:
    proc: subprocess.Popen[str]
    info: dict[str, Any]


def _start(cmd: list[str], timeout: float, log: Path) -> Process:
    with log.open("a") as errors:  # the child's log lines (stderr), for a reader after the run
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            start_new_session=True,
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _readable(proc.stdout, deadline - time.monotonic()):
            break
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("READY "):
            return Process(proc, json.loads(line[6:]))
    _end(proc)
    raise RuntimeError(f"{cmd[2]} did not say READY within {timeout}s")


def _readable(stream: Any, timeout: float) -> bool:
    import select

    ready, _, _ = select.select([stream], [], [], max(0.0, timeout))
    return bool(ready)


def _end(proc: subprocess.Popen[str]) -> None:
    """By PID: SIGTERM, then SIGKILL after a bound."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


class Topology:
    """The fake model server (for codex) and the fuzz node, each its own process, ended by PID on exit."""

    def __init__(self, folder: Path, *, codex: str | None) -> None:
        self.folder = folder
        self.codex = codex
        self.processes: list[Process] = []
        self.node: Process | None = None

    def __enter__(self) -> Topology:
        python = [sys.executable, "-P"]
        extra: list[str] = []
        try:
            if self.codex is not None:
                server = _start(
                    [
                        *python,
                        str(PEERS / "fake_responses_server.py"),
                        "--stdin-lifeline",
                        "--script",
                        json.dumps([{"text": ["ok"]}]),
                    ],
                    30,
                    self.folder / "model-server.log",
                )
                self.processes.append(server)
                extra = ["--codex", self.codex, "--base-url", str(server.info["base_url"])]
            self.node = _start(
                [
                    *python,
                    str(PEERS / "fuzz_node.py"),
                    "--stdin-lifeline",
                    "--name",
                    NODE,
                    "--bind",
                    f"ipc://{self.folder}/fz.sock",
                    "--data-dir",
                    str(self.folder),
                    *extra,
                ],
                90,
                self.folder / "node.log",
            )
            self.processes.append(self.node)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for process in reversed(self.processes):
            _end(process.proc)

    @property
    def endpoint(self) -> str:
        assert self.node is not None
        return str(self.node.info["endpoints"][0])

    @property
    def actors(self) -> list[str]:
        assert self.node is not None
        return list(self.node.info["actors"])

    def rss_kib(self) -> int:
        assert self.node is not None
        return rss_kib(self.node.proc.pid)

    def alive(self) -> bool:
        return self.node is not None and self.node.proc.poll() is None


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# ------------------------------------------------------------------------------------------------ frames
class FrameMaker:
    """Hostile frames from a seed. ``make(actor)`` returns (class, frames) with frames after the delimiter."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.reg = registry()
        self.tags = sorted(self.reg.tags)
        self._hints = {tag: self._fields(tag) for tag in self.tags}
        self._n = 0

    def _fields(self, tag: str) -> list[tuple[str, Any, bool]]:
        cls = self.reg.cls_for(tag)
        assert cls is not None
        hints = get_type_hints(cls, include_extras=True)
        return [
            (
                f.name,
                hints[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
            if f.init
        ]

    def new_id(self) -> bytes:
        self._n += 1
        return self.rng.randbytes(8) + self._n.to_bytes(8, "big")

    def header(self, kind: str, dst: str, flow: str, *, deadline: float | None = None) -> list[Any]:
        now = time.time()
        return [
            self.new_id(),
            kind,
            "fuzz/x",
            dst,
            flow,
            now,
            0,
            None,
            None,
            None,
            None,
            None,
            1,
            now + 30 if deadline is None else deadline,
            None,
            1,
        ]

    def make(self, actor: str) -> tuple[str, list[bytes]]:
        rng = self.rng
        cls = rng.choices(CLASSES, WEIGHTS)[0]
        dst = f"{NODE}/{actor}"
        flow = rng.choice(FLOWS)
        pack = _pack
        if cls == "garbage":
            return cls, [rng.randbytes(rng.randrange(0, 64)), rng.randbytes(rng.randrange(0, 256))]
        if cls == "shape":
            count = rng.choice((0, 1, 3, 4))
            return cls, [rng.randbytes(rng.randrange(0, 16)) for _ in range(count)]
        tag = rng.choice(self.tags)
        if cls == "header":
            head = self.header(tag, dst, flow)
            slot = rng.randrange(16)
            head[slot] = rng.choice(
                (None, True, -1, 2**64 - 1, 1.5, math.nan, "x", b"\x00" * 15, [], {}, "no/such/x/y")
            )
            return cls, [pack(head), pack(self.body(tag))]
        if cls == "body_bytes":
            return cls, [pack(self.header(tag, dst, flow)), rng.randbytes(rng.randrange(0, 300))]
        if cls == "unknown_kind":
            kind = rng.choice(("", "x", "sys.", "echo.x", tag + ".more", "\u2603"))
            return cls, [pack(self.header(kind, dst, flow)), pack(self.body(tag))]
        if cls == "reply":
            head = self.header(tag, dst, rng.choice(("reply", "part")))
            head[7] = self.new_id()
            return cls, [pack(head), pack(self.body(tag))]
        if cls == "expired":
            head = self.header(tag, dst, rng.choice(("ask", "stream")), deadline=time.time() - 5)
            return cls, [pack(head), pack(self.body(tag))]
        return cls, [pack(self.header(tag, dst, flow)), pack(self.body(tag))]

    def body(self, tag: str) -> dict[str, Any]:
        rng = self.rng
        out: dict[str, Any] = {}
        for name, hint, required in self._hints[tag]:
            roll = rng.random()
            if roll < 0.04 and required:
                continue  # a required field missing
            if roll < 0.12:
                out[name] = self.wrong(0)
            elif required or rng.random() < 0.6:
                out[name] = self.value(hint, 0)
        if rng.random() < 0.04:
            out[rng.choice(("x", "$t", "\u00e9", "a" * 200))] = self.wrong(0)
        return out

    def wrong(self, depth: int) -> Any:
        rng = self.rng
        return rng.choice(
            (
                None,
                True,
                0,
                -1,
                2**63 - 1,
                -(2**63),
                1e308,
                math.inf,
                "",
                "x" * rng.choice((1, 100, 5000)),
                b"\xff" * rng.randrange(0, 40),
                [1, "a", None],
                {"k": [{"k": 1}]},
                msgpack.ExtType(1, rng.randbytes(16)),
            )
        )

    def value(self, hint: Any, depth: int) -> Any:
        """A value of ``hint``'s wire form (WIRE.md Appendix A), drawn from edge cases and small values."""
        rng = self.rng
        if depth > 6:
            return None
        origin = get_origin(hint)
        if origin is Annotated:
            return (
                self.wrong(depth)
                if "kbus.json" in hint.__metadata__
                else self.value(get_args(hint)[0], depth)
            )
        if hint is Any or hint is object:
            return self.wrong(depth)
        if hint is type(None):
            return None
        if hint is str:
            return rng.choice(
                (
                    "",
                    "x",
                    "fz/echo",
                    "fz/router",
                    "scripted",
                    "smollm2",
                    "\u2603" * 3,
                    "a" * rng.choice((8, 3000)),
                )
            )
        if hint is bytes:
            return rng.randbytes(rng.choice((0, 1, 16, 200)))
        if hint is bool:
            return rng.random() < 0.5
        if hint is int:
            return rng.choice((0, 1, 2, 3, -1, 100, 10**6, 2**31, 2**63 - 1, -(2**63)))
        if hint is float:
            return rng.choice((0.0, 0.5, 1.0, -1.0, 30.0, 1e9, 1e-9, math.inf, math.nan))
        if hint is uuid.UUID:
            return msgpack.ExtType(1, rng.randbytes(16))
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return rng.choice(list(hint)).value
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            tag = hint.TAG  # type: ignore[attr-defined]
            if tag not in self._hints:
                return None
            return {"$t": tag, **self.body(tag)} if depth < 4 else None
        if origin in (Union, types.UnionType):
            return self.value(rng.choice(get_args(hint)), depth + 1)
        if origin is typing.Literal:
            return rng.choice(get_args(hint))
        if origin in (tuple, list):
            args = get_args(hint)
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                return [self.value(a, depth + 1) for a in args]
            item = args[0] if args else Any
            return [self.value(item, depth + 1) for _ in range(rng.choice((0, 1, 2, 3)))]
        if origin in (dict, Mapping):
            args = get_args(hint)
            item = args[1] if args else Any
            return {f"k{i}": self.value(item, depth + 1) for i in range(rng.choice((0, 1, 2)))}
        return self.wrong(depth)


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------------ fuzzer
class Stalled(Exception):
    """The node stopped taking frames (its I/O thread is stuck or starved)."""


@dataclass
class Report:
    frames: Counter[str] = field(default_factory=Counter)
    per_actor: Counter[str] = field(default_factory=Counter)
    answers: int = 0
    batches: int = 0
    dead: list[str] = field(default_factory=list)  # "actor: why", from the checks
    wrong: list[str] = field(default_factory=list)  # a well-behaved request answered wrongly
    crashed: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    stalled: str = ""  # why sending stopped, if it did


class Fuzzer:
    """Hostile frames over one DEALER, checks over a well-behaved ``Node`` client (see the module doc)."""

    def __init__(self, topology: Topology, seed: int) -> None:
        self.topology = topology
        self.maker = FrameMaker(seed)
        self.actors = topology.actors
        self.report = Report()
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvhwm = 100_000
        self.sock.connect(topology.endpoint)
        self.client = Node(
            f"wb{os.getpid()}", peers=[Peer(NODE, topology.endpoint)], registry=registry()
        ).start()

    def close(self) -> None:
        self.sock.close(0)
        self.client.stop()

    def _drain(self) -> None:
        while self.sock.poll(0):
            self.sock.recv_multipart()
            self.report.answers += 1

    def batch(self, frames_per_actor: int, actors: list[str] | None = None) -> None:
        targets = actors or self.actors
        for i in range(frames_per_actor * len(targets)):
            actor = targets[i % len(targets)]
            cls, frames = self.maker.make(actor)
            try:
                self._send([b"", *frames])
            except Stalled as exc:
                self.report.stalled = f"{exc} (after {sum(self.report.frames.values())} frames)"
                node = self.topology.node
                if node is not None and node.proc.poll() is None:
                    os.kill(node.proc.pid, signal.SIGUSR1)  # its threads' stacks into node.log (C-level)
                return
            self.report.frames[cls] += 1
            self.report.per_actor[actor] += 1
            if i % 64 == 0:
                self._drain()
        self._drain()
        self.report.batches += 1
        self.check()

    def _send(self, frames: list[bytes]) -> None:
        deadline = time.monotonic() + CHECK_TIMEOUT
        while True:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                # The node is behind: read what it answered meanwhile, and wait a bounded while.
                if time.monotonic() > deadline:
                    raise Stalled("the node took no frame for a minute") from None
                self.sock.poll(50, zmq.POLLIN | zmq.POLLOUT)
                self._drain()

    def check(self) -> None:
        """Every actor answers Ping; echo, stream and Router stats answer right; the process lives."""
        report, client = self.report, self.client
        if not self.topology.alive():
            report.crashed = True
            return
        for actor in self.actors:
            address = f"{NODE}/{actor}"
            try:
                pong = client.request(address, Ping(nonce=report.batches), timeout=CHECK_TIMEOUT)
            except BusError as exc:
                report.dead.append(f"{actor}: {type(exc).__name__}: {exc}")
                continue
            if pong != Pong(nonce=report.batches, actor=address):
                report.wrong.append(f"{actor}: Ping answered {pong!r}")
        try:
            echo = Echo(text="well", seq=report.batches, payload=b"\x01")
            if client.request(f"{NODE}/echo", echo, timeout=CHECK_TIMEOUT) != echo:
                report.wrong.append("echo: answered another message")
            parts = list(client.stream(f"{NODE}/echo", EchoStream(count=3), timeout=CHECK_TIMEOUT))
            if [p.seq for p in parts] != [0, 1, 2, 3]:
                report.wrong.append(f"echo.stream: {parts!r}")
            if "router" in self.actors:
                stats = client.request(f"{NODE}/router", GetRouterStats(), timeout=CHECK_TIMEOUT)
                if not isinstance(stats, RouterStats):
                    report.wrong.append(f"router.get_stats: {stats!r}")
            node_stats = client.request(f"{NODE}/node", StatsQuery(), timeout=CHECK_TIMEOUT)
            assert isinstance(node_stats, NodeStats)
            report.stats = node_stats.counters
            missing = set(self.actors) - {a.actor for a in node_stats.actors}
            if missing:
                report.dead.extend(f"{a}: no longer on the node" for a in sorted(missing))
        except BusError as exc:
            report.wrong.append(f"well-behaved request: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def fuzzing(folder: Path, seed: int, codex: str | None) -> Iterator[Fuzzer]:
    with Topology(folder, codex=codex) as topology:
        fuzzer = Fuzzer(topology, seed)
        try:
            yield fuzzer
        finally:
            fuzzer.close()


# -------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/fuzz", description="fuzz a node running every actor type")
    ap.add_argument("--frames", type=int, default=100_000, help="frames in all (default 100000)")
    ap.add_argument("--batch", type=int, default=20_000, help="frames between liveness checks")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-codex", action="store_true", help="leave the codex adapter out")
    ap.add_argument("--keep", help="a folder to copy the node's log into at the end")
    args = ap.parse_args(argv)
    codex = None
    if not args.no_codex:
        from actors.codex.binary import find_codex

        codex = str(find_codex())
    with tempfile.TemporaryDirectory(prefix="kbus-fuzz-") as tmp, fuzzing(Path(tmp), args.seed, codex) as fz:
        actors = len(fz.actors)
        rss_before = fz.topology.rss_kib()
        started = time.monotonic()
        sent = 0
        while sent < args.frames and not fz.report.crashed and not fz.report.stalled:
            per_actor = max(1, min(args.batch, args.frames - sent) // actors)
            fz.batch(per_actor)
            sent += per_actor * actors
            print(f"... {sent} frames, RSS {fz.topology.rss_kib() // 1024} MiB", file=sys.stderr, flush=True)
        elapsed = time.monotonic() - started
        rss_after = fz.topology.rss_kib() if fz.topology.alive() else 0
        r = fz.report
        print(
            f"seed {args.seed}: {sum(r.frames.values())} frames in {elapsed:.0f} s "
            f"to actors {', '.join(fz.actors)}"
        )
        for cls in CLASSES:
            print(f"  {cls:<13} {r.frames[cls]}")
        print(f"answers read: {r.answers}; batches checked: {r.batches}")
        print(f"crashes: {int(r.crashed)}; dead actors: {len(r.dead)}; wrong answers: {len(r.wrong)}")
        for line in r.dead + r.wrong:
            print(f"  {line}")
        print(f"node RSS: {rss_before // 1024} MiB before, {rss_after // 1024} MiB after")
        print("node counters: " + json.dumps({k: v for k, v in sorted(r.stats.items()) if v}))
        if r.stalled:
            print(f"STALLED: {r.stalled}")
        if args.keep:
            import shutil

            Path(args.keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(tmp) / "node.log", Path(args.keep) / "node.log")
        return 0 if not (r.crashed or r.dead or r.wrong or r.stalled) else 1


if __name__ == "__main__":
    sys.exit(main())
