"""CurveZMQ keys for the learner's sockets: create them, load them, decide when they are needed.

``python -m arpo_async.core.keys RUN_DIR`` writes a server and a client keypair under
``RUN_DIR/keys/`` (``server.key``, ``server.key_secret``, ``client.key``,
``client.key_secret``; secret files 0600, the folder 0700). The learner loads the server
secret and the public key of every client certificate in the folder (``*.key`` other than
``server.key``: copy more client certificates there to admit them); actors load the
client secret and the server's public key.

The rule both sides follow, so that they always agree: **keys present in the run's keys
folder mean CurveZMQ on every socket**; without keys the sockets are plain, which
``require_security`` allows only for a loopback bind (or with ``transport.insecure``,
loudly). A ZAP authenticator thread, one per ``zmq.Context`` (libzmq allows one ZAP
handler per context), admits only the listed client keys and reports each denial;
``HandshakeWatch`` reports the clients that came without any keys.
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from arpo_async.core.host import is_loopback

log = logging.getLogger(__name__)

KEYS_SUBDIR = "keys"
SERVER, CLIENT = "server", "client"


class SecurityError(RuntimeError):
    """The transport would run without the protection the configuration requires."""


@dataclass(frozen=True)
class ServerKeys:
    public: bytes  # z85, 40 bytes
    secret: bytes
    allowed_clients: list[bytes]  # z85 public keys admitted by the authenticator


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def keys_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / KEYS_SUBDIR


def generate(run_dir: str | Path, force: bool = False) -> Path:
    """Write a server and a client keypair under ``run_dir/keys``; returns that folder."""
    out = keys_dir(run_dir)
    existing = [p for p in (out / f"{SERVER}.key_secret", out / f"{CLIENT}.key_secret")
                if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists; pass --force to replace the keys "
                              "(running actors and learner will stop authenticating)")
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        for name in (SERVER, CLIENT):
            public, secret = zmq.auth.create_certificates(str(out), name)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
    finally:
        os.umask(old_umask)
    return out


def _load(path: Path, need_secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise FileNotFoundError(f"CurveZMQ key file missing: {path} "
                                "(create keys with: python -m arpo_async.core.keys RUN_DIR)")
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path}: not a CurveZMQ certificate ({exc})") from None
    if need_secret:
        if not secret:
            raise ValueError(f"{path}: no secret-key in this certificate")
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            log.warning("%s is readable by other users (mode %o); chmod 600 it", path, mode)
    return public, secret


def load_server_keys(directory: str | Path) -> ServerKeys:
    directory = Path(directory)
    public, secret = _load(directory / f"{SERVER}.key_secret", need_secret=True)
    clients = [_load(p, need_secret=False)[0] for p in sorted(directory.glob("*.key"))
               if p.name != f"{SERVER}.key"]
    if not clients:
        raise FileNotFoundError(f"{directory}: no client certificate (*.key) to admit")
    return ServerKeys(public=public, secret=secret, allowed_clients=clients)


def load_client_keys(directory: str | Path, name: str = CLIENT) -> ClientKeys:
    directory = Path(directory)
    public, secret = _load(directory / f"{name}.key_secret", need_secret=True)
    server_public, _ = _load(directory / f"{SERVER}.key", need_secret=False)
    return ClientKeys(public=public, secret=secret, server_public=server_public)


def require_security(host: str, insecure: bool,
                     keys_dir: str | Path | None) -> ServerKeys | None:
    """The learner's keys for binding ``host``, or None for plain sockets.

    Keys present in ``keys_dir``: always used. No keys: fine on loopback; any other bind
    raises SecurityError unless ``insecure`` (then a warning says what is exposed).
    """
    if keys_dir is not None and (Path(keys_dir) / f"{SERVER}.key_secret").exists():
        return load_server_keys(keys_dir)
    if is_loopback(host):
        return None
    if not insecure:
        raise SecurityError(
            f"transport.host={host!r} is not a loopback address and there are no CurveZMQ "
            f"keys in {keys_dir}: anyone who can reach the port could inject trajectories "
            "and read the weights. Create keys with `python -m arpo_async.core.keys RUN_DIR`, "
            "or set transport.insecure=true to accept this.")
    log.warning("binding %s WITHOUT encryption or authentication (transport.insecure=true): "
                "anyone who can reach the ports can send trajectories and fetch weights", host)
    return None


def server_keys_for(cfg) -> ServerKeys | None:
    """``require_security`` for a resolved Config (learner side)."""
    t = cfg.transport
    return require_security(t.host, t.insecure, keys_dir(cfg.run.dir))


def client_keys_for(cfg) -> ClientKeys | None:
    """Client keys when the run has keys (the same rule as ``require_security``)."""
    directory = keys_dir(cfg.run.dir)
    if not (directory / f"{CLIENT}.key_secret").exists():
        return None
    return load_client_keys(directory)


# ----------------------------------------------------------------------------- sockets


def configure_server(sock: zmq.Socket, keys: ServerKeys) -> None:
    """Make ``sock`` a CURVE server (before bind)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def configure_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``sock`` a CURVE client of the server (before connect)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


class _AllowList:
    """ZAP credentials provider: admits the listed public keys, reports the rest."""

    def __init__(self, allowed: list[bytes], on_denied: Callable[[bytes], None]):
        self.allowed = frozenset(allowed)
        self.on_denied = on_denied

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        self.on_denied(key)
        return False


class HandshakeWatch:
    """Reports the peers of a CURVE server socket whose handshake failed before ZAP saw a
    key: a client with no CurveZMQ keys at all speaks the NULL mechanism, which the
    server refuses without asking the authenticator (a wrong key reaches ZAP and is
    reported by ``start_authenticator``'s ``on_denied``). ``poll`` reads the socket's
    monitor without waiting; call it from the thread that uses the socket."""

    EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

    def __init__(self, sock: zmq.Socket, on_failed: Callable[[int], None]):
        self.monitor = sock.get_monitor_socket(self.EVENTS)
        self.on_failed = on_failed

    def poll(self) -> None:
        while self.monitor is not None and self.monitor.poll(0):
            self.on_failed(parse_monitor_message(self.monitor.recv_multipart())["event"])

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None


def start_authenticator(ctx: zmq.Context, keys: ServerKeys,
                        on_denied: Callable[[bytes], None]) -> ThreadAuthenticator:
    """Start the one ZAP handler of ``ctx``; ``on_denied(z85_key)`` runs in its thread."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("arpo_async.zap"))
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_AllowList(keys.allowed_clients,
                                                                      on_denied))
    return auth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arpo_async.core.keys",
                                     description="Create CurveZMQ keys under RUN_DIR/keys.")
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--force", action="store_true", help="replace existing keys")
    args = parser.parse_args(argv)
    try:
        out = generate(args.run_dir, force=args.force)
    except (FileExistsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote CurveZMQ keys to {out} (server.key_secret stays with the learner, "
          "client.key_secret and server.key go to every actor host)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
