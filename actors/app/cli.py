"""The ``kbus`` command: run a node, ping one, make keys, read capture logs; run and chat (chat.py)."""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("kbus")


def check_install() -> None:
    """Guard for the generic top-level names (STYLE.md 3.2): all three must come from one folder."""
    import actors
    import config
    import transport

    roots = {Path(str(m.__file__)).resolve().parents[1] for m in (actors, config, transport)}
    if len(roots) != 1:
        raise SystemExit(
            f"kbus: actors/transport/config imported from different places: {sorted(map(str, roots))}"
        )


# ------------------------------------------------------------------------------------------------- node
def cmd_node(args: argparse.Namespace) -> int:
    from actors.app.wiring import build_node
    from config import ConfigError, load

    try:
        settings = load(args.config)
    except ConfigError as exc:
        print(f"kbus node: {exc}", file=sys.stderr)
        return 2
    from transport.security import SecurityError
    from transport.sockets import BindError

    try:
        node = build_node(settings, capture=args.capture)
    except (ConfigError, SecurityError, BindError) as exc:
        print(f"kbus node: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # an actor that cannot start (its data folder, a provider): one line
        log.debug("kbus node: start failed", exc_info=True)
        print(f"kbus node: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    done = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if done.is_set():  # a second SIGTERM/SIGINT while stopping: no more grace
            _line(f"kbus node {node.name}: second signal: exiting now", sys.stderr)
            os._exit(EXIT_STUCK)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _line(
        f"kbus node {node.name}: listening on {', '.join(node.endpoints) or '(no endpoint)'}; "
        f"actors: {', '.join(node.actors())}"
    )
    try:
        while not done.wait(0.5):
            pass
    finally:
        _line(f"kbus node {node.name}: stopping (grace {args.grace:g}s)")
        started = time.monotonic()
        stuck = node.stop(timeout=args.grace)
        # A stuck actor's own thread lingers too: name the actor, and other threads only when none is stuck.
        left = [f"actor {a}" for a in stuck] or _lingering_threads(args.grace - (time.monotonic() - started))
        if left:
            # Their threads cannot be ended from here and would keep the process alive: exit without them.
            _line(
                f"kbus node {node.name}: stopped, but {', '.join(left)} did not finish within "
                f"{args.grace:g}s (stuck in a handler?): exiting anyway",
                sys.stderr,
            )
            sys.stdout.flush()
            os._exit(EXIT_STUCK)
        _line(f"kbus node {node.name}: stopped")
    return 0


EXIT_STUCK = 3  # kbus node: stopped, but something was stuck and left behind


def _line(text: str, stream: Any = None) -> None:
    """One line in one write: with PYTHONUNBUFFERED, print() writes the text and its newline apart, and a
    log line from another thread (on stderr, often the same pipe) can land in between."""
    out = stream or sys.stdout
    out.write(text + "\n")
    out.flush()


def _lingering_threads(wait: float) -> list[str]:
    """Names of non-daemon threads still running after ``wait`` seconds (they would block the exit)."""
    deadline = time.monotonic() + max(0.0, wait)
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    for thread in others:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [f"thread {t.name}" for t in others if t.is_alive()]


# ------------------------------------------------------------------------------------------------- ping
def _ping_setup(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The ping client's security and the server key, checked; ``ValueError`` says what is wrong."""
    from actors.app.options import server_key as read_server_key
    from transport import KeyPair, Security, SecurityError
    from transport.envelope import is_node_name

    if not args.endpoint.startswith(("ipc://", "tcp://", "inproc://")):
        raise ValueError(f"{args.endpoint!r} is not an endpoint (ipc://PATH or tcp://HOST:PORT)")
    for what, name in (("--node", args.node), ("--name", args.name)):
        if name is not None and not is_node_name(name):
            raise ValueError(f"{what} {name!r} is not a node name")
    if args.count < 1 or not args.timeout > 0:
        raise ValueError("--count must be at least 1 and --timeout more than 0")
    try:
        keys = KeyPair.load(args.key) if args.key else None
        server_key = read_server_key(args.server_key)
    except (SecurityError, OSError, ValueError) as exc:
        raise ValueError(str(exc)) from exc
    security = Security(keys=keys, plain_insecure_for_benchmarks=args.plain)
    if server_key is not None and len(server_key) != 40:
        raise ValueError(f"--server-key {args.server_key!r} is neither a 40-character key nor a key file")
    if security.uses_curve(args.endpoint) and server_key is None:
        raise ValueError(
            "tcp needs the node's public key: --server-key KEY_OR_FILE (or --plain for a benchmark node)"
        )
    return security, server_key


def _client_node(args: argparse.Namespace, command: str) -> tuple[Any, str | None] | int:
    """The started client node of ``kbus ping`` / ``kbus stats`` and the server's key; an exit code (2, one
    line said) when the security options are wrong."""
    from transport import Node

    try:
        security, server_key = _ping_setup(args)
    except ValueError as exc:
        print(f"kbus {command}: {exc}", file=sys.stderr)
        return 2
    # A CURVE server lets a key speak only as the node name its allowlist gives it; `kbus keys NAME`
    # writes NAME.key_secret, so the key file's name is the natural default.
    name = args.name or (Path(args.key).name.split(".")[0] if args.key else f"{command}-{os.getpid()}")
    return Node(name, security=security).start(), server_key


def cmd_ping(args: argparse.Namespace) -> int:
    from transport import BusError, Peer
    from transport.messages import Ping, Pong

    started = _client_node(args, "ping")
    if isinstance(started, int):
        return started
    client, server_key = started
    address = f"{args.node}/{args.actor}"
    client.connect(Peer(args.node, args.endpoint, server_key))
    times: list[float] = []
    failures = 0
    try:
        for i in range(args.count):
            t0 = time.perf_counter()
            try:
                pong = client.request(address, Ping(nonce=i), timeout=args.timeout)
            except BusError as exc:
                failures += 1
                print(f"{address}: seq={i} {type(exc).__name__}: {exc}", flush=True)
                continue
            ms = (time.perf_counter() - t0) * 1000
            assert isinstance(pong, Pong)
            times.append(ms)
            print(f"pong from {pong.actor}: seq={pong.nonce} time={ms:.3f} ms", flush=True)
    finally:
        client.stop()
    summary = f"--- {address}: {args.count} sent, {len(times)} answered"
    if times:
        summary += (
            f", rtt min/median/max = {min(times):.3f}/{statistics.median(times):.3f}/{max(times):.3f} ms"
        )
    print(summary)
    return 0 if failures == 0 else 1


# ------------------------------------------------------------------------------------------------ stats
def cmd_stats(args: argparse.Namespace) -> int:
    """One ``sys.stats`` request to ``NODE/node``: the node's counters, then one line per actor."""
    from transport import BusError, Peer
    from transport.messages import NodeStats, StatsQuery

    started = _client_node(args, "stats")
    if isinstance(started, int):
        return started
    client, server_key = started
    try:
        client.connect(Peer(args.node, args.endpoint, server_key))
        report = client.request(f"{args.node}/node", StatsQuery(), timeout=args.timeout)
    except BusError as exc:
        print(f"kbus stats: {args.node} at {args.endpoint}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.stop()
    assert isinstance(report, NodeStats)
    if args.json:
        print(
            json.dumps(
                {
                    "node": report.node,
                    "counters": report.counters,
                    "actors": {
                        a.actor: {"handled": a.handled, "failed": a.failed, "mailbox": a.mailbox}
                        for a in report.actors
                    },
                }
            )
        )
        return 0
    print(f"node {report.node}")
    width = max((len(k) for k in report.counters), default=0)
    for key in sorted(report.counters):
        print(f"  {key:<{width}}  {report.counters[key]}")
    for a in report.actors:
        print(f"actor {a.actor}: handled {a.handled}, failed {a.failed}, mailbox {a.mailbox}")
    return 0


# ------------------------------------------------------------------------------------------------- keys
def cmd_keys(args: argparse.Namespace) -> int:
    from transport.security import SecurityError, create_keys, load_public_key

    try:
        public, secret = create_keys(args.dir, args.name)
    except SecurityError as exc:
        print(f"kbus keys: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kbus keys: {args.dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"public key file: {public}\nsecret key file: {secret} (mode 0600)")
    print(f"public key: {load_public_key(public)}")
    return 0


# -------------------------------------------------------------------------------------------------- log
def _printable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {str(k): _printable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_printable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return repr(value)


def describe_record(record: Any) -> dict[str, Any]:
    from transport.codec import decode_for_display, decode_header
    from transport.errors import ProtocolError

    out: dict[str, Any] = {"n": record.n, "at": record.at, "actor": record.actor, "mono_ns": record.mono_ns}
    if record.at in ("send", "deliver") and len(record.frames) == 2:
        try:
            header = decode_header(record.frames[0])
            out["header"] = {
                k: v.hex() if isinstance(v, bytes) else v
                for k, v in header._asdict().items()
                if v is not None
            }
            out["body"] = _printable(decode_for_display(record.frames[1]))
        except ProtocolError as exc:
            out["error"] = str(exc)
    else:
        out["frames"] = [_printable(f) for f in record.frames]
    return out


def _short(hex_id: str) -> str:
    # Ids are a per-sender random prefix plus a counter (transport.envelope.id_source): show a bit of both.
    return f"{hex_id[:4]}..{hex_id[-6:]}"


def _one_line(d: dict[str, Any]) -> str:
    head = f"{d['n']:>6} {d['at']:<7} {d['actor']:<24}"
    h = d.get("header")
    if h is None:
        return f"{head} {d.get('error') or json.dumps(d.get('frames'))[:120]}"
    corr = f" re={_short(h['corr'])}" if "corr" in h else ""
    body = json.dumps(d.get("body"), separators=(",", ":"))
    if len(body) > 100:
        body = body[:97] + "..."
    return f"{head} {h['kind']:<14} {h['flow']:<6} {h['src']} -> {h['dst']} id={_short(h['id'])}{corr} {body}"


# What ``kbus log replay`` replays an actor as when no --class is given: the kind of a request it received.
_REPLAY_CLASSES = {
    "router.start_turn": "actors.router.actor:RouterActor",
    "router.resolve_model": "actors.router.actor:RouterActor",
    "router.count_tokens": "actors.router.actor:RouterActor",
    "rs.run": "actors.runs.session:SessionLoopActor",
    "sa.run": "actors.runs.subagent:SubagentRunActor",
    "echo": "actors.app.echo:EchoActor",
}


def _replay_class(spec: str | None, log: Any, actor: str) -> Any:
    import importlib

    from transport.codec import decode_header

    if spec is None:
        for record in log.records:
            if record.at == "deliver" and record.actor == actor:
                spec = _REPLAY_CLASSES.get(decode_header(record.frames[0]).kind)
                if spec is not None:
                    break
        else:
            known = ", ".join(sorted(set(_REPLAY_CLASSES.values())))
            raise ValueError(
                f"cannot tell what {actor} is from the log: give --class MODULE:NAME (known: {known})"
            )
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--class must be MODULE:NAME, not {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--class {spec}: {exc}") from None


def cmd_log_replay(args: argparse.Namespace) -> int:
    from actors.app.wiring import registry
    from transport.capture import CaptureError, read_log
    from transport.replay import Replay, ReplayDivergence

    if not args.verbose:  # a divergence raised inside a handler is reported below, once, not as a traceback
        logging.getLogger("actors").setLevel(logging.CRITICAL)
    try:
        log = read_log(args.file)
        if not any(r.actor == args.actor for r in log.records):
            actors = sorted({r.actor for r in log.records})
            print(f"kbus log replay: {args.file} has no records of {args.actor} (it has {', '.join(actors)})",
                  file=sys.stderr)  # fmt: skip
            return 2
        actor_class = _replay_class(args.actor_class, log, args.actor)
        result = Replay(log, args.actor, registry(), timeout=args.timeout).run(actor_class)
    except ReplayDivergence as exc:
        print(f"{args.file}: {args.actor}: {exc}")
        return 1
    except (CaptureError, ValueError) as exc:
        print(f"kbus log replay: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kbus log replay: {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(
        f"{args.file}: {args.actor} replayed: {result.delivered} inputs, {result.compared} sends compared, "
        "zero divergence"
    )
    return 0


def cmd_log_diff(args: argparse.Namespace) -> int:
    from actors.app.wiring import registry
    from transport.capture import CaptureError, read_log
    from transport.replay import first_divergence

    try:
        a, b = read_log(args.a), read_log(args.b)
        divergence = first_divergence(a, b, registry())
    except CaptureError as exc:
        print(f"kbus log diff: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kbus log diff: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if divergence is None:
        sends = sum(1 for r in a.records if r.at == "send")
        print(f"{args.a} and {args.b}: no divergence ({sends} sends in the first)")
        return 0
    print(f"{args.a} vs {args.b}: {divergence}")
    return 1


def cmd_log(args: argparse.Namespace) -> int:
    from transport.capture import CaptureError, iter_records, read_log, verify

    if args.log_command == "replay":
        return cmd_log_replay(args)
    if args.log_command == "diff":
        return cmd_log_diff(args)
    if args.log_command == "verify":
        report = verify(args.file)
        for problem in report.problems:
            print(f"problem: {problem}")
        print(f"{args.file}: {report.records} records, {'ok' if report.ok else 'NOT OK'}")
        return 0 if report.ok else 1
    try:
        header = read_log(args.file).header if not args.json else None
        if header is not None:
            print(
                f"# {args.file}: node {header.node}, schema {header.schema}, created "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(header.created))} UTC"
            )
        for record in iter_records(args.file):
            d = describe_record(record)
            print(json.dumps(d) if args.json else _one_line(d), flush=False)
    except CaptureError as exc:
        print(f"kbus log: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader stopped early (| head): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 0
    except OSError as exc:
        print(f"kbus log: {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------------------- main
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kbus")
    except PackageNotFoundError:
        return "(not installed)"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kbus", description="kbus: an actor message bus for LLM agents")
    ap.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    ap.add_argument("--version", action="version", version=f"kbus {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("node", help="run a node with the actors its config names, until SIGINT/SIGTERM")
    p.add_argument("--config", required=True, help="TOML file (see config/default.toml)")
    p.add_argument("--capture", help="record every envelope to this .buslog (overrides node.capture)")
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds the actors get to stop on SIGTERM/SIGINT (default 5); past it the process exits "
        f"anyway, with status {EXIT_STUCK}, naming what was stuck (a second signal: at once)",
    )
    p.set_defaults(func=cmd_node)

    p = sub.add_parser("ping", help="round trips to an actor's mailbox (application heartbeat)")
    p.add_argument("endpoint", help="ipc://PATH or tcp://HOST:PORT of the node")
    p.add_argument("--node", required=True, help="the node's name")
    p.add_argument("--actor", default="echo", help="actor name on that node (default: echo)")
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--server-key", help="the node's public key (Z85 text or a .key file), for tcp")
    p.add_argument("--key", help="this client's secret key file (must be on the node's allowlist)")
    p.add_argument("--plain", action="store_true", help="plain tcp (only against benchmark nodes)")
    p.add_argument("--name", help="this client's node name (default: the --key file's name, or ping-PID)")
    p.set_defaults(func=cmd_ping)

    p = sub.add_parser("stats", help="a node's counters (drops by reason) and each actor's")
    p.add_argument("endpoint", help="ipc://PATH or tcp://HOST:PORT of the node")
    p.add_argument("--node", required=True, help="the node's name")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--server-key", help="the node's public key (Z85 text or a .key file), for tcp")
    p.add_argument("--key", help="this client's secret key file (must be on the node's allowlist)")
    p.add_argument("--plain", action="store_true", help="plain tcp (only against benchmark nodes)")
    p.add_argument("--name", help="this client's node name (default: the --key file's name, or stats-PID)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_stats, count=1)

    p = sub.add_parser("keys", help="create a CURVE key pair (NAME.key, NAME.key_secret mode 0600)")
    p.add_argument("name")
    p.add_argument("--dir", default="keys")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("log", help="read capture logs (.buslog)")
    logsub = p.add_subparsers(dest="log_command", required=True)
    show = logsub.add_parser("show", help="one line per record")
    show.add_argument("file")
    show.add_argument("--json", action="store_true", help="one JSON object per record")
    verify_p = logsub.add_parser("verify", help="check the hash chain, numbering and order")
    verify_p.add_argument("file")
    replay_p = logsub.add_parser("replay", help="replay one actor from a log; exit 1 at the first divergence")
    replay_p.add_argument("file")
    replay_p.add_argument("--actor", required=True, help="the actor's address, e.g. n1/router")
    replay_p.add_argument(
        "--class",
        dest="actor_class",
        help="MODULE:NAME of the actor class (or a factory with start(node, address)); default: told by "
        "the requests it received (the Router, a session loop, a subagent run, the echo actor)",
    )
    replay_p.add_argument("--timeout", type=float, default=10.0, help="bound on each replayed step (s)")
    diff_p = logsub.add_parser("diff", help="the first divergence between two logs of one scenario")
    diff_p.add_argument("a")
    diff_p.add_argument("b")
    p.set_defaults(func=cmd_log)

    from actors.app.chat import add_parsers

    add_parsers(sub)  # run, chat: the main job
    _verbose_everywhere(sub)
    return ap


def _verbose_everywhere(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``-v`` after the subcommand too (``kbus run -v``); SUPPRESS keeps one given before it."""
    for p in sub.choices.values():
        p.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging"
        )
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                _verbose_everywhere(action)


def main(argv: Sequence[str] | None = None) -> int:
    check_install()
    from actors.app.chat import options_after_command

    ap = parser()
    commands = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
    args = ap.parse_args(options_after_command(sys.argv[1:] if argv is None else argv, commands))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
