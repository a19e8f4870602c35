"""The job's bearer token: the one check every trainguard server makes, and the one reader
of a token file.

Every control request carries ``Authorization: Bearer <token>`` (the controller's inbox,
the hosts service and daemons, the node agents, the rendezvous store service). A server
checks it with :func:`bearer_ok` before it reads any body, in constant time; a client
sends :func:`bearer`'s header. :func:`read_token_file` reads ``--token-file``, with an
error naming the flag and the file.
"""

from __future__ import annotations

import hmac
import stat
from pathlib import Path

__all__ = ["TokenError", "bearer", "bearer_ok", "read_token_file"]


class TokenError(ValueError):
    """No usable token: a usage error naming the flag."""


def bearer_ok(header: str | None, token: str | bytes) -> bool:
    """Whether the ``Authorization`` header ``header`` carries ``token`` as its bearer
    token (constant time)."""
    scheme, _, credential = (header or "").partition(" ")
    expected = token.encode() if isinstance(token, str) else token
    return scheme.lower() == "bearer" and hmac.compare_digest(credential.strip().encode(), expected)


def bearer(token: str) -> dict[str, str]:
    """The header a client sends with ``token``."""
    return {"Authorization": f"Bearer {token}"}


def read_token_file(path: Path, flag: str = "--token-file", *, private: bool = False) -> str:
    """The token in ``path`` (stripped); :class:`TokenError` naming ``flag`` if the file
    is missing, unreadable, empty, or (``private``) readable by others than its owner."""
    try:
        token = path.read_text().strip()
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise TokenError(f"{flag}: {path} does not exist") from None
    except OSError as exc:
        raise TokenError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if not token:
        raise TokenError(f"{flag}: {path} is empty")
    if private and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(f"{flag}: {path} can be read by others than its owner (chmod 600 {path})")
    return token
