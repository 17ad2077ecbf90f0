"""CURVE keys, the ZAP authenticator and the client-key allowlist; fail closed.

A CURVE server with no ZAP handler accepts *any* client key, so a node never binds CURVE unless the
authenticator of its ZeroMQ context is running and holds this node's allowlist (its ZAP domain is the node
name). The authenticated key, not the routing id a peer chooses, is the identity: ``node_for_key`` says
which node name a key may speak as.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from transport.envelope import is_node_name
from transport.errors import ProtocolError
from transport.logs import LogLimiter
from transport.records import frozen

log = logging.getLogger(__name__)

Z85_KEY_LEN = 40


class SecurityError(Exception):
    """A security setting that must stop the node from binding or connecting (fail closed)."""


@frozen
class KeyPair:
    """A CURVE key pair in Z85 text."""

    public: str
    secret: str

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public.decode("ascii"), secret.decode("ascii"))

    @classmethod
    def load(cls, secret_file: str | os.PathLike[str]) -> KeyPair:
        """Read a zmq.auth secret certificate; refuse one that others can read."""
        path = Path(secret_file)
        try:
            mode = path.stat().st_mode
        except OSError as exc:
            raise SecurityError(f"{path}: cannot read secret key: {exc}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecurityError(f"{path}: secret key file is readable by others (chmod 600 it)")
        public, secret = zmq.auth.load_certificate(path)
        if secret is None:
            raise SecurityError(f"{path}: not a secret key file (no secret-key line)")
        return cls(public.decode("ascii"), secret.decode("ascii"))


def load_public_key(public_file: str | os.PathLike[str]) -> str:
    public, _ = zmq.auth.load_certificate(Path(public_file))
    return str(public.decode("ascii"))


def create_keys(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` (mode 0600) into ``directory`` (mode 0700).

    ``name`` is a node name (the name the key will speak as), so it never leaves ``directory``."""
    if not is_node_name(name) or not name.strip("."):
        raise SecurityError(f"{name!r} is not a node name (letters, digits, '_', '.', '-'; not only dots)")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    public_file = folder / f"{name}.key"
    secret_file = folder / f"{name}.key_secret"
    if public_file.exists() or secret_file.exists():
        raise SecurityError(f"{folder}: keys named {name!r} exist already; not overwriting")
    # Create the secret file 0600 *before* any key bytes land in it.
    old = os.umask(0o077)
    try:
        pub, sec = zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old)
    os.chmod(sec, 0o600)
    os.chmod(pub, 0o644)
    return Path(pub), Path(sec)


@frozen
class Security:
    """How a node protects tcp: CURVE with an allowlist (default) or, for benchmarks only, nothing.

    ``allow`` maps client public keys (Z85) to the node name each may speak as. ``curve_ipc`` extends CURVE
    to ipc binds (ipc is otherwise protected by the 0700 socket directory).
    """

    keys: KeyPair | None = None
    allow: Mapping[str, str] = field(default_factory=dict)
    plain_insecure_for_benchmarks: bool = False
    curve_ipc: bool = False

    def uses_curve(self, endpoint: str) -> bool:
        if endpoint.startswith("tcp://"):
            return not self.plain_insecure_for_benchmarks
        return self.curve_ipc and endpoint.startswith("ipc://")

    def node_for_key(self, key: str) -> str | None:
        return self.allow.get(key)


class _Provider:
    """pyzmq's credentials-provider protocol: one per ZAP domain (node)."""

    def __init__(self, allow: Mapping[str, str]) -> None:
        self.allow = dict(allow)
        self.refused = 0
        self._log_limit = LogLimiter()

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key.decode("ascii", "replace") in self.allow
        if not ok:
            self.refused += 1
            shown = key[:8].decode("ascii", "replace")
            self._log_limit.log(
                log, logging.WARNING, "refused", "ZAP: refused client key %s for %s", shown, domain
            )
        return ok


class ZapService:
    """The one ZAP authenticator of a ZeroMQ context, shared by the nodes in it (one domain each).

    It lives as long as its context: a node that stops only removes its domain (an unknown domain is
    refused, so that closes the door). Stopping the authenticator and starting another one on the same
    context races libzmq: closing the ZAP socket frees ``inproc://zeromq.zap.01`` later, on libzmq's reaper
    thread, so the next bind could fail with "Address already in use" (the flake of issue 18). Where a
    restart cannot be avoided (the authenticator's thread died, or ``close`` was called before the owner
    terminates its context), ``register`` waits a bounded time for libzmq to release the endpoint.

    The table is keyed by ``id(context)``; each entry holds its context (the authenticator keeps a reference),
    so an id cannot be reused by another context while its entry exists.
    """

    _lock = threading.Lock()
    _by_context: dict[int, ZapService] = {}  # noqa: RUF012 - process-wide table, guarded by _lock
    BIND_WAIT = 5.0  # seconds register() waits for a closed ZAP socket's endpoint to be released

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.context = context
        self._auth = _start_authenticator(context, self.BIND_WAIT)
        self._providers: dict[str, _Provider] = {}

    @classmethod
    def register(
        cls, context: zmq.Context[zmq.Socket[bytes]], domain: str, allow: Mapping[str, str]
    ) -> _Provider:
        with cls._lock:
            service = cls._by_context.get(id(context))
            if service is not None and not service.running:
                # Its thread died: close what it still holds before a new one binds the ZAP endpoint.
                log.warning("ZAP: the authenticator of this context stopped; starting a new one")
                service._auth.stop()
                service = None
            if service is None:
                service = cls(context)
                cls._by_context[id(context)] = service
            provider = _Provider(allow)
            service._providers[domain] = provider
            service._auth.configure_curve_callback(domain=domain, credentials_provider=provider)
            if not service.running:
                raise SecurityError("the ZAP authenticator did not start: refusing to bind CURVE")
            return provider

    @classmethod
    def unregister(cls, context: zmq.Context[zmq.Socket[bytes]], domain: str) -> None:
        """Close the door for ``domain``; the authenticator keeps running for the context's other nodes
        (and for the next one: see the class docstring)."""
        with cls._lock:
            service = cls._by_context.get(id(context))
            if service is None:
                return
            service._providers.pop(domain, None)
            # An unknown domain is refused by the authenticator: removing the provider closes the door.
            service._auth.credentials_providers.pop(domain, None)

    @classmethod
    def close(cls, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Stop the context's authenticator (for an owner about to terminate its own context: ``term()``
        waits for every socket, the ZAP socket included). A later ``register`` starts a new one."""
        with cls._lock:
            service = cls._by_context.pop(id(context), None)
        if service is not None:
            service._auth.stop()

    def domains(self) -> tuple[str, ...]:
        return tuple(self._providers)

    @classmethod
    def service_for(cls, context: zmq.Context[zmq.Socket[bytes]]) -> ZapService | None:
        with cls._lock:
            return cls._by_context.get(id(context))

    @property
    def running(self) -> bool:
        thread = self._auth.thread
        return thread is not None and thread.is_alive()


def _start_authenticator(context: zmq.Context[zmq.Socket[bytes]], wait: float) -> ThreadAuthenticator:
    """A started authenticator; retries the ZAP bind while a closed predecessor's endpoint is released."""
    deadline = time.monotonic() + wait
    delay = 0.001
    while True:
        auth = ThreadAuthenticator(context, log=logging.getLogger("kbus.zap"))
        # pyzmq names the control pipe after id(auth); a new object can get a stopped one's id while libzmq
        # still holds that endpoint, the same race as the ZAP endpoint's. A fresh name each time.
        auth.pipe_endpoint = f"inproc://kbus.zap-pipe.{uuid.uuid4().hex}"
        try:
            auth.start()
            return auth
        except zmq.ZMQError as exc:
            _discard(auth)
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise SecurityError(f"the ZAP authenticator could not bind: {exc}") from exc
        # libzmq releases the endpoint on its reaper thread, within microseconds to milliseconds: a short,
        # bounded back-off, not a wait for an event (libzmq offers none).
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _discard(auth: ThreadAuthenticator) -> None:
    """Close what a half-started authenticator holds. Not ``stop()``: it would send TERMINATE over a pipe
    that may have no peer, and a PAIR send without a peer blocks."""
    if auth.pipe is not None:
        auth.pipe.close(linger=0)
        auth.pipe = None  # type: ignore[assignment]
    if auth.zap_socket is not None:
        auth.zap_socket.close(linger=0)
        auth.zap_socket = None  # type: ignore[assignment]


def configure_server(sock: zmq.Socket[bytes], security: Security, domain: str) -> None:
    if security.keys is None:
        raise SecurityError(f"node {domain}: CURVE needs a key pair (security.secret_key_file)")
    sock.curve_server = True
    sock.curve_secretkey = security.keys.secret.encode("ascii")
    sock.curve_publickey = security.keys.public.encode("ascii")
    sock.zap_domain = domain.encode()


def configure_client(sock: zmq.Socket[bytes], security: Security, server_key: str | None) -> None:
    if server_key is None:
        raise SecurityError("connecting over CURVE needs the server's public key")
    if len(server_key) != Z85_KEY_LEN:
        raise SecurityError(f"server key must be {Z85_KEY_LEN} Z85 characters")
    keys = security.keys or KeyPair.generate()
    sock.curve_secretkey = keys.secret.encode("ascii")
    sock.curve_publickey = keys.public.encode("ascii")
    sock.curve_serverkey = server_key.encode("ascii")


def user_id(frame: zmq.Frame) -> str:
    """The authenticated client key of an inbound frame (the ZAP User-Id)."""
    try:
        value = frame.get("User-Id")
    except zmq.ZMQError as exc:  # no ZAP on this connection: nothing authenticated it
        raise ProtocolError("frame carries no authenticated identity") from exc
    return str(value)
