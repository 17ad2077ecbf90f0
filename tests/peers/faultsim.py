"""A seeded fault simulation of one conversation across three real processes over ipc.

Processes (started from a ``forkserver``, so a restart costs a fork, not a Python start-up): the Router
(SQLite ledger in its data dir) with ``PlanModel``; the tool host (``ToolHostActor`` with its effect store)
with the ``record`` tool; the conversation (``ConversationActor`` with its write-ahead session file). The
conversation reaches the Router and the host through two ``FaultProxy`` actors in its own process, which
count every message they pass and, at the step the seed chose, inject one fault: SIGKILL of the Router, the
host or the conversation process (by PID), a dropped message, a delayed one, or one delivered twice; or the
host kills itself inside the seed's n-th tool run, after the tool's effect and before its outcome is
stored. The driver (the calling process) runs ``TURNS`` turns of ``CALLS`` tool calls each; whenever a call
fails it restarts the dead processes on the same data dirs and goes on (``continue_turn`` for an
interrupted turn). A fault that kills records the victim (role and PID) in ``faults.log`` first, and the
driver waits for that process's exit (its pidfd) before it counts the dead: a peer's disconnect can reach
the driver before the process has finished exiting, and the forkserver's report of an exit comes later
still.

Then it checks, from the stores themselves: every tool effect ran at most once (the tool's own append-only
log), every provider turn the model saw has exactly one receipt and no intent row is left open (SQL on the
ledger), every request the driver made ended, and the session file keeps the transcript rule (no call
without its result). ``PlanModel`` and ``FaultProxy`` are test doubles, named so: a scripted model that
reads what it has seen from its input, and a proxy that misbehaves on purpose.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import os
import random
import re
import select
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

TURNS = 2
CALLS = 2
KINDS = ("kill_router", "kill_host", "kill_host_in_tool", "kill_conversation", "drop", "delay", "duplicate")
STEPS = 28  # about the number of messages the proxies pass in a clean run (see clean_steps)
TOOL_TIMEOUT = 1.0
CALL_TIMEOUT = 2.0
DRIVER_TIMEOUT = 10.0  # one driver request; a hang fails the seed
ATTEMPTS = 8  # recoveries per turn before the seed is failed as not live
FAULTS = "faults.log"  # in the seed's dir: "<role> <pid>" for each process a fault is killing


@dataclasses.dataclass(frozen=True)
class Plan:
    seed: int
    kind: str
    step: int
    delay: float = 0.0

    @classmethod
    def of(cls, seed: int) -> Plan:
        rng = random.Random(seed)
        kind = rng.choice(KINDS)
        # kill_host_in_tool counts tool runs (the host dies inside the tool, after its effect), the others
        # count the messages the proxies pass.
        steps = TURNS * CALLS if kind == "kill_host_in_tool" else STEPS
        return cls(seed, kind, rng.randrange(1, steps + 1), round(rng.uniform(0.01, 0.3), 3))


# ------------------------------------------------------------------------------------- test doubles


class PlanModel:
    """Provider (test double): turn N calls ``record`` with tags tN.c0..tN.c(CALLS-1), one at a time,
    skipping every tag whose result its input already shows, and calling again (a new call id) while the
    only results say the call did not run; then it answers ``done N``. Each provider turn it
    runs is appended to ``log`` before it emits anything."""

    name = "plan"

    def __init__(self, log: Path, calls: int = CALLS) -> None:
        self.log = log
        self.calls = calls

    def run_turn(self, request: Any, io: Any) -> Any:
        from actors.router.providers.base import NativeToolCall, ProviderOutcome, TextDelta, ToolCallRequested
        from actors.types import CALL_KTOOL, TokenUsage

        text = "\n".join(m.content for m in request.messages)
        turns = re.findall(r"please run turn (\d+)", text)
        n = int(turns[-1]) if turns else -1
        _append(self.log, f"turn {n}")
        for i in range(self.calls):
            tag = f"t{n}.c{i}"
            seen = re.findall(rf"Tool result \({re.escape(tag)}(?:~\d+)?, \w+\): (.*)", text)
            settled = any(not result.startswith("not run") for result in seen)
            attempt = len(seen)
            while not settled and attempt < 4:  # "not run" is safe to retry (a new call id, same effect)
                call_id = tag if attempt == 0 else f"{tag}~{attempt}"
                arguments = json.dumps({"name": "record", "arguments": {"tag": tag}})
                io.emit(
                    ToolCallRequested(NativeToolCall(call_id=call_id, name=CALL_KTOOL, arguments=arguments))
                )
                settled = not io.wait_result(call_id).output.startswith("not run")
                attempt += 1
        io.emit(TextDelta(f"done {n}"))
        return ProviderOutcome(
            answer=f"done {n}",
            usage=TokenUsage(
                input_tokens=10,
                cached_input_tokens=0,
                output_tokens=2,
                reasoning_output_tokens=0,
                total_tokens=12,
            ),
        )

    def close(self) -> None:
        pass


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _killing(faults: Path, role: str, pid: int) -> None:
    """SIGKILL ``pid`` (the process of ``role``), first recording in ``faults`` that it is being killed:
    the driver may hear of the crash (a peer disconnected) before the process has exited, and must not
    look for the dead in that moment and find none."""
    _append(faults, f"{role} {pid}")
    os.kill(pid, signal.SIGKILL)


def make_proxy_class() -> type:
    from actors.base import DEFER, BusActor

    @dataclasses.dataclass(frozen=True)
    class _Later:
        message: Any
        ctx: Any

    class FaultProxy(BusActor):  # a test double: misbehaves on purpose at the plan's step
        def __init__(
            self,
            node: Any,
            address: str,
            *,
            target: str,
            plan: Plan | None,
            steps: Any,
            pids: dict[str, int],
            faults: Path,
        ) -> None:
            super().__init__(node, address)
            self.target = target
            self.plan = plan
            self.steps = steps
            self.pids = pids
            self.faults = faults

        def handle(self, message: Any, ctx: Any) -> Any:
            step = next(self.steps)
            plan = self.plan
            fault = plan.kind if plan is not None and step == plan.step else None
            if fault == "kill_conversation":
                _killing(self.faults, "c", os.getpid())
            if fault in ("kill_router", "kill_host"):
                victim = fault.removeprefix("kill_")
                _killing(self.faults, {"router": "r", "host": "h"}[victim], self.pids[victim])
            if not ctx.wants_reply:
                self.tell_to(self.target, message)
                if fault == "duplicate":
                    self.tell_to(self.target, message)
                return None
            if fault == "drop":
                return DEFER  # never answered: the caller's own deadline ends the request
            if fault == "delay":
                assert plan is not None
                ref = self.actor_ref
                threading.Timer(plan.delay, lambda: ref.tell(_Later(message, ctx))).start()
                return DEFER
            self._forward(message, ctx)
            if fault == "duplicate":
                self._forward(message, None)
            return DEFER

        def on_local(self, message: Any) -> Any:
            if isinstance(message, _Later):
                self._forward(message.message, message.ctx)
                return None
            return super().on_local(message)

        def _forward(self, message: Any, ctx: Any) -> None:
            deadline = ctx.header.deadline if ctx is not None else None
            timeout = 30.0 if deadline is None else max(0.05, deadline - self.node.clock())

            def relay(reply: Any) -> None:
                if ctx is None or ctx.done:
                    return
                if reply.error is not None:
                    ctx.fail(reply.error)
                else:
                    ctx.reply(reply.message)

            self.ask(self.target, message, relay, timeout=timeout)

    return FaultProxy


# ------------------------------------------------------------------------------------------ processes


def _endpoint(base: Path, role: str) -> str:
    return f"ipc://{base / 'sock' / role}.sock"


def _catalog() -> Any:
    from actors.router.catalog import ModelCatalog

    return ModelCatalog.from_mapping(
        {
            "providers": {"plan": {"kind": "scripted"}},
            "models": {
                "plan": {
                    "provider": "plan",
                    "provider_model": "plan",
                    "context_window": 32768,
                    "max_input_tokens": 30000,
                }
            },
        }
    )


@dataclasses.dataclass(frozen=True)
class Options:
    calls: int = CALLS  # tool calls per turn
    journal: bool = True  # the conversation keeps its session file (the write-ahead journal)


def node_main(
    role: str, base: str, plan: Plan | None, pids: dict[str, int], conn: Connection, options: Options
) -> None:
    """One simulated process: its node and actors, until the driver says stop (or it is killed)."""
    from actors.app.wiring import registry
    from actors.conversation import ConversationRuntime, ToolHostActor, ToolRegistry
    from actors.router.actor import RouterActor
    from transport.node import Node, Peer

    root = Path(base)
    peers = {
        "r": [Peer("c", _endpoint(root, "c"))],
        "h": [],
        "c": [Peer("r", _endpoint(root, "r")), Peer("h", _endpoint(root, "h"))],
    }[role]
    node = Node(role, bind=[_endpoint(root, role)], peers=peers, registry=registry()).start()
    try:
        if role == "r":
            node.spawn(
                RouterActor,
                "router",
                catalog=_catalog(),
                data_dir=root / "router",
                providers={"plan": PlanModel(root / "provider.log", options.calls)},
            )
        elif role == "h":
            effects = root / "effects.log"
            runs = itertools.count(1)

            def record(tag: str) -> str:
                """Record one effect."""
                _append(effects, tag)
                if plan is not None and plan.kind == "kill_host_in_tool" and next(runs) == plan.step:
                    _killing(
                        root / FAULTS, "h", os.getpid()
                    )  # the effect happened; its outcome is never stored
                return f"recorded {tag}"

            tools = ToolRegistry()
            tools.register(record, mutating=True)
            node.spawn(ToolHostActor, "tools", registry=tools, effects=root / "host" / "effects.sqlite3")
        else:
            proxy = make_proxy_class()
            steps = itertools.count(1)
            faults = root / FAULTS
            node.spawn(
                proxy, "router-proxy", target="r/router", plan=plan, steps=steps, pids=pids, faults=faults
            )
            node.spawn(
                proxy, "host-proxy", target="h/tools", plan=plan, steps=steps, pids=pids, faults=faults
            )
            builder = (
                ConversationRuntime.builder()
                .node(node)
                .name("conv")
                .llm("plan")
                .router("c/router-proxy")
                .host("c/host-proxy")
                .tool_timeout(TOOL_TIMEOUT)
                .call_timeout(CALL_TIMEOUT)
            )
            if options.journal:
                builder.session_file(root / "session.jsonl")
            builder.build()
        conn.send(("ready", os.getpid()))
        while True:  # the driver's commands: reconnect to a restarted peer (handshake awaited), or stop
            try:
                command = conn.recv()
            except EOFError:
                break
            if command == "stop":
                break
            peer = command[1]
            node.connect(Peer(peer, _endpoint(root, peer)), wait=30.0)
            conn.send("connected")
    finally:
        node.stop()


PEERS_OF = {"r": ("c",), "h": ("c",), "c": ("r",)}  # who connects to whom (the driver connects to c)

_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(
            ["peers.faultsim", "actors.app.wiring", "actors.conversation", "actors.router.actor"]
        )
        _CONTEXT = ctx
    return _CONTEXT


@dataclasses.dataclass
class Child:
    """One process of the cluster. ``pidfd`` (opened while the process is known alive, so it names that
    process and no later holder of its PID) becomes readable the moment the process has exited. That is the
    test of death: ``proc.is_alive()`` asks the forkserver, which reports a death only once it has been
    scheduled to reap the child, so on a loaded machine a process killed long ago can still look alive."""

    role: str
    proc: Any
    conn: Connection
    pid: int
    pidfd: int

    def alive(self) -> bool:
        return not self.wait_exit(0)

    def wait_exit(self, timeout: float) -> bool:
        """True once the process has exited (waiting up to ``timeout`` for it)."""
        readable, _, _ = select.select([self.pidfd], [], [], timeout)
        return bool(readable)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)


class Cluster:
    """The three processes of one seed; every one is ended by its PID in ``close``."""

    def __init__(self, base: Path, plan: Plan | None, options: Options | None = None) -> None:
        self.base = base
        self.plan = plan
        self.options = options or Options()
        self.children: dict[str, Child] = {}
        self.restarts = 0
        self._kills_seen = 0  # lines of the faults log already awaited
        (base / "sock").mkdir(parents=True, exist_ok=True, mode=0o700)
        for role in ("r", "h", "c"):
            self.start(role, plan)

    def start(self, role: str, plan: Plan | None = None) -> None:
        """Start ``role``; a restarted process gets no plan (each seed injects its fault once)."""
        ctx = _context()
        parent, child = ctx.Pipe()
        pids = {"router": self.children["r"].pid, "host": self.children["h"].pid} if role == "c" else {}
        proc = ctx.Process(
            target=node_main, args=(role, str(self.base), plan, pids, child, self.options), daemon=True
        )
        proc.start()
        child.close()
        if not parent.poll(30.0):
            proc.kill()
            raise RuntimeError(f"{role} did not start")
        _, pid = parent.recv()
        # the process is alive here (nothing kills a process before the driver talks to the cluster)
        self.children[role] = Child(role, proc, parent, pid, os.pidfd_open(pid))

    def revive(self) -> list[str]:
        """Restart every process that died (the conversation's proxies come back without faults). A process
        a fault is killing (see ``_killing``) is first waited for until it has exited (bounded)."""
        self.await_kills()
        dead = self.dead()
        for role in dead:
            old = self.children[role]
            old.proc.join(5)
            os.close(old.pidfd)
            self.start(role)
            self.restarts += 1
        for role in dead:  # the processes that talk to it wait for the new handshake
            for other in PEERS_OF[role]:
                if other not in dead:
                    child = self.children[other]
                    child.conn.send(("reconnect", role))
                    if not child.conn.poll(30.0):
                        raise RuntimeError(f"{other} did not reconnect to {role}")
                    child.conn.recv()
        return dead

    def await_kills(self) -> None:
        """Wait (bounded) until every process the faults log says is being killed has exited."""
        log = self.base / FAULTS
        kills = log.read_text().splitlines() if log.exists() else []
        for line in kills[self._kills_seen :]:
            role, pid = line.split()
            child = self.children[role]
            if child.pid == int(pid) and not child.wait_exit(DRIVER_TIMEOUT):
                raise RuntimeError(f"{role} (pid {pid}) was killed but did not exit")
        self._kills_seen = len(kills)

    def dead(self) -> list[str]:
        """The roles whose process has exited (seen from its pidfd, not from the forkserver's report)."""
        return [role for role, c in self.children.items() if not c.alive()]

    def stop(self, role: str) -> None:
        child = self.children[role]
        if child.alive():
            with contextlib.suppress(OSError):
                child.conn.send("stop")
            child.proc.join(10)

    def close(self) -> None:
        for child in self.children.values():
            child.kill()
            child.proc.join(10)
            child.conn.close()
            os.close(child.pidfd)


# --------------------------------------------------------------------------------------------- driver


@dataclasses.dataclass
class Report:
    plan: Plan | None
    restarts: int
    effects: dict[str, int]
    provider_turns: int
    receipts: int
    open_rows: int
    steps_seen: int
    problems: list[str]


def run_seed(seed: int | None, base: Path) -> Report:
    """One seed (None: no fault); the report's ``problems`` is empty when every invariant held."""
    from actors.app.wiring import registry
    from actors.conversation import ConversationRuntime
    from actors.conversation.journal import read_journal
    from transport.errors import BusError
    from transport.node import Node, Peer

    plan = Plan.of(seed) if seed is not None else None
    problems: list[str] = []
    cluster = Cluster(base, plan)
    driver = Node(f"d{os.getpid()}", registry=registry()).start()
    driver.connect(Peer("c", _endpoint(base, "c")), wait=DRIVER_TIMEOUT)
    try:
        rt = ConversationRuntime.connect(driver, "c/conv", timeout=DRIVER_TIMEOUT)
        for n in range(TURNS):
            if not _drive(rt, cluster, n, BusError):
                problems.append(f"turn {n} never completed ({ATTEMPTS} attempts)")
                break
        for role in ("c", "h", "r"):
            cluster.stop(role)
        cluster.start("r")  # a Router on the ledger once more: an intent left open by a crash is settled
        cluster.stop("r")
    finally:
        driver.stop()
        cluster.close()
    effects: dict[str, int] = {}
    log = base / "effects.log"
    for line in log.read_text().split() if log.exists() else ():
        effects[line] = effects.get(line, 0) + 1
    twice = sorted(tag for tag, count in effects.items() if count > 1)
    if twice:
        problems.append(f"effects run more than once: {twice}")
    provider_log = base / "provider.log"
    provider_turns = len(provider_log.read_text().splitlines()) if provider_log.exists() else 0
    receipts, open_rows, per_op = _ledger(base / "router" / "receipts.sqlite3")
    if open_rows:
        problems.append(f"{open_rows} intent row(s) left open")
    if per_op:
        problems.append(f"operations with more than one receipt: {per_op}")
    if receipts < provider_turns:
        problems.append(f"{provider_turns} provider turns but {receipts} receipts")
    transcript = read_journal(base / "session.jsonl").transcript
    problems.extend(_transcript_rule(transcript))
    done = {m.content for m in transcript if m.role == "assistant"}
    problems.extend(
        f"no answer for turn {n}" for n in range(TURNS) if f"done {n}" not in done and not problems
    )
    return Report(plan, cluster.restarts, effects, provider_turns, receipts, open_rows, 0, problems)


def _drive(rt: Any, cluster: Cluster, n: int, bus_error: type[BaseException]) -> bool:
    from transport.node import Peer

    for _ in range(ATTEMPTS):
        try:
            if _answered(rt, n):
                return True
            if rt.interrupted_turn() is not None:
                _wait(cluster, rt.continue_turn_future())
            else:
                _wait(cluster, rt.run_future(f"please run turn {n}"))
        except (bus_error, ConversationLost):
            pass
        if "c" in cluster.revive():
            rt.node.connect(Peer("c", _endpoint(cluster.base, "c")), wait=DRIVER_TIMEOUT)
        _wait_ready(rt, bus_error)
    try:
        return _answered(rt, n)
    except bus_error:
        return False


class ConversationLost(Exception):
    """The conversation process died while the driver waited for its answer."""


def _wait(cluster: Cluster, future: Any) -> Any:
    """The future's result, or ``ConversationLost`` as soon as the conversation process is seen dead
    (checked every 50 ms; a request to a process that died is otherwise only ended by its deadline)."""
    deadline = time.monotonic() + DRIVER_TIMEOUT
    while True:
        try:
            return future.result(timeout=0.05)
        except concurrent.futures.TimeoutError:
            if not cluster.children["c"].alive():
                raise ConversationLost() from None
            if time.monotonic() > deadline:
                raise


def _answered(rt: Any, n: int) -> bool:
    return any(m.role == "assistant" and m.content == f"done {n}" for m in rt.transcript())


def _wait_ready(rt: Any, bus_error: type[BaseException]) -> None:
    """After a restart the conversation answers once its node and actor are up (bounded)."""
    deadline = time.monotonic() + DRIVER_TIMEOUT
    while time.monotonic() < deadline:
        try:
            rt.status(timeout=2.0)
            return
        except bus_error:
            continue


def _ledger(path: Path) -> tuple[int, int, list[str]]:
    """(receipts, open intent rows, operations with more than one receipt), read with SQL."""
    if not path.exists():
        return 0, 0, []
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        columns = {row[1] for row in db.execute("PRAGMA table_info(receipts)")}
        where_open = "status = 'open'" if "status" in columns else "0"
        (open_rows,) = db.execute(f"SELECT COUNT(*) FROM receipts WHERE {where_open}").fetchone()
        (receipts,) = db.execute(f"SELECT COUNT(*) FROM receipts WHERE NOT ({where_open})").fetchone()
        per_op = [
            str(op)
            for (op,) in db.execute(
                "SELECT operation_id FROM receipts GROUP BY operation_id HAVING COUNT(*) > 1"
            )
        ]
    return int(receipts), int(open_rows), per_op


def _transcript_rule(transcript: Any) -> list[str]:
    problems = []
    results = {m.tool_call_id for m in transcript if m.role == "tool"}
    for m in transcript:
        for c in m.tool_calls:
            if c.id not in results:
                problems.append(f"call {c.id} has no result in the transcript")
    return problems


def first_failing(
    seeds: range, base: Path, progress: Callable[[int, Report], None] | None = None
) -> Report | None:
    for seed in seeds:
        report = run_seed(seed, base / f"seed-{seed}")
        if progress is not None:
            progress(seed, report)
        if report.problems:
            return report
    return None


# ----------------------------------------------------------------------------------------------- soak


def _sample(cluster: Cluster) -> dict[str, dict[str, int]]:
    """RSS (KiB) and open file descriptors of each process, read from /proc."""
    out = {}
    for role, child in cluster.children.items():
        status = Path(f"/proc/{child.pid}/status").read_text()
        rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        out[role] = {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{child.pid}/fd"))}
    return out


def soak(turns: int, base: Path, *, journal: bool = True, reset_every: int = 100) -> dict[str, Any]:
    """``turns`` turns with one tool call each across the three processes (no faults): turns/s, and each
    process's RSS and fds after the first turn, in the middle and at the end. Every ``reset_every`` turns the
    transcript is truncated (a journaled command), so what grows is the runtime, not the conversation."""
    from actors.app.wiring import registry
    from actors.conversation import ConversationRuntime
    from transport.node import Node, Peer

    cluster = Cluster(base, None, Options(calls=1, journal=journal))
    driver = Node(f"d{os.getpid()}", registry=registry()).start()
    driver.connect(Peer("c", _endpoint(base, "c")), wait=DRIVER_TIMEOUT)
    samples: dict[str, Any] = {}
    try:
        rt = ConversationRuntime.connect(driver, "c/conv", timeout=DRIVER_TIMEOUT)
        rt.run("please run turn 0")
        samples["start"] = _sample(cluster)
        started = time.perf_counter()
        for n in range(1, turns):
            if n % reset_every == 0:
                rt.truncate_transcript(0)
            rt.run(f"please run turn {n}")
            if n == turns // 2:
                samples["middle"] = _sample(cluster)
        elapsed = time.perf_counter() - started
        samples["end"] = _sample(cluster)
    finally:
        driver.stop()
        for role in ("c", "h", "r"):
            cluster.stop(role)
        cluster.close()
    growth = {
        role: round(100.0 * (samples["end"][role]["rss_kib"] / samples["middle"][role]["rss_kib"] - 1), 1)
        for role in samples["end"]
    }
    return {
        "turns": turns,
        "journal": journal,
        "turns_per_s": round((turns - 1) / elapsed, 1),
        "samples": samples,
        "rss_growth_middle_to_end_pct": growth,
    }


def main() -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="scripts/faultsim", description="the seeded fault simulation")
    parser.add_argument("--seeds", type=int, default=200, help="how many seeds (default 200)")
    parser.add_argument("--first", type=int, default=0, help="the first seed (default 0)")
    args = parser.parse_args()

    def progress(seed: int, report: Report) -> None:
        plan = report.plan
        assert plan is not None
        state = "ok" if not report.problems else "FAILED"
        print(
            f"seed {seed}: {plan.kind} at step {plan.step}: restarts {report.restarts}, {state}", flush=True
        )

    with tempfile.TemporaryDirectory(prefix="kbus-faultsim-") as tmp:
        failing = first_failing(range(args.first, args.first + args.seeds), Path(tmp), progress)
    if failing is not None:
        assert failing.plan is not None
        print(f"first failing seed: {failing.plan.seed} ({failing.plan}): {failing.problems}")
        return 1
    print(f"{args.seeds} seeds from {args.first}: every invariant held")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
