"""The job's token and TLS settings when its control plane listens beyond loopback.

A job on several hosts listens on the network (the controller's endpoint, each host's
daemon, each node's agent), so it needs a token every host shares: ``--token-file FILE``
(the same file on every host; only its owner should read it) or ``$TRAINGUARD_TOKEN``.
Without one ``trainguard run`` refuses to start (exit 2): no control request beyond
loopback is served without it (torch's rendezvous store takes none: it is served to the
job's hosts' addresses only, :mod:`trainguard.rendezvous.gateway`). The token never
appears on a command line or in a log.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from trainguard.atomic import write_text_atomic
from trainguard.auth import TokenError, read_token_file

__all__ = [
    "TOKEN_ENV",
    "TokenError",
    "client_tls",
    "job_token",
    "server_tls",
    "write_token_file",
]

TOKEN_ENV = "TRAINGUARD_TOKEN"
MIN_TOKEN_CHARS = 16


def job_token(token_file: str | None, env: dict[str, str] | None = None) -> str:
    """The job's token from ``--token-file``, else ``$TRAINGUARD_TOKEN``."""
    environ = os.environ if env is None else env
    if token_file is not None:
        token = read_token_file(Path(token_file), private=True)
    else:
        token = environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise TokenError(
                "a job on several hosts listens beyond this machine and needs a token every "
                f"host shares: --token-file FILE (the same file on each host) or ${TOKEN_ENV}"
            )
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(f"the job's token is too short: at least {MIN_TOKEN_CHARS} characters")
    return token


def write_token_file(path: Path, token: str) -> None:
    """Write the job's token for its node agents (``--token-file``): readable by its owner
    only, and whole or absent for a reader. Several hosts may share the state directory,
    and each writes the job's token file as it joins: a truncate-and-write let an agent
    starting elsewhere read it empty (it exited 2, its node lost)."""
    if not path.is_file() or path.read_text().strip() != token:
        write_text_atomic(path, token, mode=0o600)


def server_tls(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """HTTPS for this host's servers (``--tls-cert``, ``--tls-key``); None without them."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise TokenError("--tls-cert and --tls-key go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise TokenError(f"--tls-cert/--tls-key: cannot load {cert}, {key}: {exc}") from None
    return context


def client_tls(ca: str | None, cert: str | None) -> ssl.SSLContext | None:
    """How this host checks the others' certificates (``--tls-ca``, else the system's);
    None when the job does not use TLS (no ``--tls-cert``)."""
    if cert is None:
        return None
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise TokenError(f"--tls-ca: cannot load {ca}: {exc}") from None
