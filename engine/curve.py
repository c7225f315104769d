"""Authenticated, encrypted router-worker links: ZeroMQ CURVE (elliptic-curve keys, per-connection
encryption) with pyzmq's ZAP authenticator on the router.

    retouch keys generate router --out keys/     # keys/router.key (public), keys/router.key_secret
    retouch keys generate worker-a --out keys/   # one pair per worker (or one shared by all)

The router holds its secret key and a folder of the public keys of the workers it lets in; a worker
holds its own secret key and the router's public key. The files are pyzmq's certificate format
(`zmq.auth.create_certificates`). Workers the server starts itself get a key pair made for the run,
handed over in their environment (readable only by the same user) and allowed for that run alone.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from retouch.errors import InputError

logger = logging.getLogger("retouch.curve")

# The keys of a worker the server starts itself (z85 text), passed in its environment.
SECRET_ENV, PUBLIC_ENV, SERVER_ENV = "RETOUCH_CURVE_SECRET", "RETOUCH_CURVE_PUBLIC", "RETOUCH_CURVE_SERVER"


def generate(name: str, out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write `out_dir/name.key` (public) and `out_dir/name.key_secret` (keep it private)."""
    if not name or "/" in name or name.startswith("."):
        raise InputError(f"a key name is a plain file name, got {name!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise InputError(f"{path} exists; remove it first (keys are never overwritten)")
    zmq.auth.create_certificates(out, name)
    secret.chmod(0o600)
    return public, secret


def read_secret(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of a `.key_secret` file."""
    public, secret = _read(path)
    if secret is None:
        raise InputError(f"{path} holds no secret key (pass the .key_secret file)")
    return public, secret


def read_public(path: str | os.PathLike) -> bytes:
    return _read(path)[0]


def _read(path) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():
        raise InputError(f"key file {path} not found")
    try:
        return zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise InputError(f"{path} is not a ZeroMQ certificate: {exc}") from None


def is_loopback(address: str) -> bool:
    """True for addresses no other host can reach: ipc://, inproc://, tcp:// on a loopback IP."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name or an interface ("*", "eth0"): reachable from elsewhere
        return False


@dataclass
class AllowedKeys:
    """The workers' public keys a router lets in; counts who it refused."""

    keys: set[bytes] = field(default_factory=set)
    refused: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _logged: set[bytes] = field(default_factory=set)  # refused keys already logged

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> AllowedKeys:
        folder = Path(directory)
        if not folder.is_dir():
            raise InputError(f"--curve-allowed {directory} is not a folder of worker public keys")
        keys = {read_public(path) for path in sorted(folder.glob("*.key"))}
        if not keys:
            raise InputError(f"--curve-allowed {directory} holds no *.key file: no worker could join")
        return cls(keys)

    def allow(self, public: bytes) -> None:
        with self._lock:
            self.keys.add(public)

    def callback(self, domain: str, key: bytes) -> bool:  # ZAP: called with the client's z85 key
        with self._lock:
            allowed = key in self.keys
            self.refused += not allowed
            first = not allowed and key not in self._logged
            if first:
                self._logged.add(key)
        if first:  # once per key: a refused worker keeps trying every second
            logger.warning("refused a worker whose CURVE public key %s is not in --curve-allowed",
                           key.decode("ascii", "replace"))
        return allowed


class RouterSecurity:
    """The router's side: its key pair and the workers it allows. `apply(socket)` before bind."""

    def __init__(self, secret_file: str | os.PathLike, allowed: AllowedKeys):
        self.public, self.secret = read_secret(secret_file)
        self.allowed = allowed
        self._authenticator: ThreadAuthenticator | None = None

    def apply(self, context: zmq.Context, socket: zmq.Socket) -> None:
        self._authenticator = ThreadAuthenticator(context)
        self._authenticator.start()
        self._authenticator.configure_curve_callback("*", self.allowed)
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True

    def local_worker_env(self) -> dict[str, str]:
        """Keys for a worker this server starts: a fresh pair, allowed for this run only."""
        public, secret = zmq.curve_keypair()
        self.allowed.allow(public)
        return {SECRET_ENV: secret.decode(), PUBLIC_ENV: public.decode(), SERVER_ENV: self.public.decode()}

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


@dataclass(frozen=True)
class WorkerKeys:
    """A worker's side: its key pair and the router's public key."""

    public: bytes
    secret: bytes
    server: bytes

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike, server_file: str | os.PathLike) -> WorkerKeys:
        public, secret = read_secret(secret_file)
        return cls(public, secret, read_public(server_file))

    @classmethod
    def from_env(cls) -> WorkerKeys | None:
        if SECRET_ENV not in os.environ:
            return None
        return cls(os.environ[PUBLIC_ENV].encode(), os.environ[SECRET_ENV].encode(), os.environ[SERVER_ENV].encode())

    def apply(self, socket: zmq.Socket) -> None:
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_serverkey = self.server
