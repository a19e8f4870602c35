"""Report first: push the node's status to the controller the moment something happens.

The supervisor calls :meth:`Reporter.nudge` whenever the node's state or a worker
changes (a worker exited, the node faulted or completed, a log line was a fault); a
thread then POSTs the latest :class:`~trainguard.wire.status.NodeStatus` to the
``report_url`` of the latest attempt request, with the job's token. Nudges coalesce:
a burst of changes sends the newest status once. A push that fails is only logged:
the controller also polls ``GET /status``, so a lost push costs latency, never a fault.
"""

from __future__ import annotations

import http.client
import logging
import ssl
import threading
import urllib.parse
from collections.abc import Callable

from trainguard.auth import bearer
from trainguard.wire.status import NodeStatus

logger = logging.getLogger(__name__)

__all__ = ["PUSH_TIMEOUT_SECONDS", "Reporter"]

PUSH_TIMEOUT_SECONDS = 2.0


class Reporter:
    """Pushes :class:`NodeStatus` snapshots to the controller; see the module docstring."""

    def __init__(
        self,
        snapshot: Callable[[], NodeStatus],
        token: str,
        timeout: float = PUSH_TIMEOUT_SECONDS,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: how an ``https`` report URL's certificate is checked (a job's own CA;
        default: the system's)."""
        self._tls = tls
        self._snapshot = snapshot
        self._token = token
        self._timeout = timeout
        self._url: str | None = None
        self._wake = threading.Event()
        self._closed = False
        self._connection: http.client.HTTPConnection | None = None
        self._connection_url: str | None = None
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="trainguard-report", daemon=True)
        self._thread.start()

    def target(self, url: str | None) -> None:
        """Where to push from now on (None: nowhere; the controller polls)."""
        self._url = url

    def nudge(self) -> None:
        """Something changed: push the newest status soon (coalesced)."""
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(self._timeout + 1.0)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                break
            url = self._url
            if url is None:
                continue
            try:
                self._push(url, self._snapshot().model_dump_json().encode())
            except Exception as exc:  # never let a push take the agent down
                self._drop()
                level = logging.DEBUG if self._warned else logging.WARNING
                self._warned = True
                logger.log(level, "could not push the status to %s: %s", url, exc)
        self._drop()

    def _push(self, url: str, body: bytes) -> None:
        parts = urllib.parse.urlsplit(url)
        for attempt in (0, 1):  # a kept-alive connection the controller closed: once more
            connection = self._connect(url, parts)
            try:
                connection.request(
                    "POST",
                    parts.path or "/",
                    body,
                    {**bearer(self._token), "Content-Type": "application/json"},
                )
                response = connection.getresponse()
                reply = response.read()
            except (ConnectionError, http.client.HTTPException) as exc:
                self._drop()
                if attempt:
                    raise OSError(f"no answer: {exc}") from None
                continue
            if response.status >= 300:
                raise OSError(f"{response.status} {reply[:200]!r}")
            return

    def _connect(self, url: str, parts: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        if self._connection is None or self._connection_url != url:
            self._drop()
            host, port = parts.hostname or "", parts.port
            self._connection = (
                http.client.HTTPSConnection(host, port, timeout=self._timeout, context=self._tls)
                if parts.scheme == "https"
                else http.client.HTTPConnection(host, port, timeout=self._timeout)
            )
            self._connection_url = url
        return self._connection

    def _drop(self) -> None:
        if self._connection is not None:
            self._connection.close()
        self._connection = None
        self._connection_url = None
