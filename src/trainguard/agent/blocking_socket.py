"""A socket with a timeout, made blocking for a bulk transfer: the kernel's timeouts.

Python gives a socket with a timeout a non-blocking descriptor and waits for it with
``poll`` before each call, so a ``splice`` or ``sendfile`` on it moves only what the
socket can take or give at that moment: many calls, each with a wait and a retry in
Python. Made blocking, with the timeout as the socket's ``SO_RCVTIMEO`` and
``SO_SNDTIMEO``, one call moves the whole amount (a file, a pipe's worth) however the
bytes come, and the timeout still bounds it: a call that times out fails with
``EAGAIN``, which :func:`blocking` turns into :class:`TimeoutError`.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Iterator

__all__ = ["blocking"]


def _timeval(seconds: float | None) -> bytes:
    """``seconds`` as a ``struct timeval`` (None: no timeout; never 0, which is none)."""
    if seconds is None:
        return struct.pack("ll", 0, 0)
    whole = int(seconds)
    micros = round((seconds - whole) * 1_000_000)
    return struct.pack("ll", whole, micros if whole or micros else 1)


@contextlib.contextmanager
def blocking(sock: socket.socket) -> Iterator[None]:
    """``sock`` blocking, its timeout (``gettimeout``) as its send and receive timeouts;
    as it was after. :class:`TimeoutError` for a call that timed out meanwhile."""
    timeout = sock.gettimeout()
    value = _timeval(timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    sock.setblocking(True)
    try:
        yield
    except BlockingIOError:  # EAGAIN: SO_RCVTIMEO or SO_SNDTIMEO ran out
        raise TimeoutError(f"timed out after {timeout} s") from None
    finally:
        sock.settimeout(timeout)
