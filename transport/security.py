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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from transport.errors import ProtocolError

log = logging.getLogger(__name__)

Z85_KEY_LEN = 40


class SecurityError(Exception):
    """A security setting that must stop the node from binding or connecting (fail closed)."""


@dataclass(frozen=True, slots=True)
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
    """Write ``name.key`` (public) and ``name.key_secret`` (mode 0600) into ``directory`` (mode 0700)."""
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


@dataclass(frozen=True, slots=True)
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

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key.decode("ascii", "replace") in self.allow
        if not ok:
            self.refused += 1
            log.warning("ZAP: refused client key %s for %s", key[:8].decode("ascii", "replace"), domain)
        return ok


class ZapService:
    """The one ZAP authenticator of a ZeroMQ context, shared by the nodes in it (one domain each)."""

    _lock = threading.Lock()
    _by_context: dict[int, ZapService] = {}  # noqa: RUF012 - process-wide table, guarded by _lock

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("kbus.zap"))
        self._auth.start()
        self._providers: dict[str, _Provider] = {}

    @classmethod
    def register(
        cls, context: zmq.Context[zmq.Socket[bytes]], domain: str, allow: Mapping[str, str]
    ) -> _Provider:
        with cls._lock:
            service = cls._by_context.get(id(context))
            if service is None or not service.running:
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
        with cls._lock:
            service = cls._by_context.get(id(context))
            if service is None:
                return
            service._providers.pop(domain, None)
            # An unknown domain is refused by the authenticator: removing the provider closes the door.
            service._auth.credentials_providers.pop(domain, None)
            if not service._providers:
                service._auth.stop()
                del cls._by_context[id(context)]

    @property
    def running(self) -> bool:
        thread = self._auth.thread
        return thread is not None and thread.is_alive()


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
