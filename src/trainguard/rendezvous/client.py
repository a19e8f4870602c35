"""The controller's handle on the job's rendezvous store service (:mod:`.service`).

:func:`start_service` starts it (a detached subprocess: it outlives a controller that
is killed, for ``trainguard resume``) without waiting for it; :meth:`StoreServiceHandle.open`
waits for it the first time, then gives each attempt its store's port. :func:`find_service`
is ``trainguard resume``'s: the running service of a dead controller, taken over
(``POST /attach``), or None. Anything that goes wrong (no torch in the controller's
Python, the service died) makes :meth:`~StoreServiceHandle.open` return None: the
attempt falls back to a store on rank 0, trainguard's behaviour before the service.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainguard.agent.controller_watch import start_ticks
from trainguard.http_client import call_json
from trainguard.platform.procs import runs
from trainguard.rendezvous.service import TOKEN_ENV

__all__ = ["MODE_ENV", "StoreServiceHandle", "find_service", "rendezvous_mode", "start_service"]

logger = logging.getLogger(__name__)

MODE_ENV = "TRAINGUARD_RENDEZVOUS_STORE"
"""``service`` (the default): the job's store service serves every attempt's store;
``rank0``: rank 0 hosts it, as torch's ``env://`` does without an agent store."""
MODES = ("service", "rank0")
START_TIMEOUT = 60.0
"""s an attempt's start waits for the service to import torch and listen (its first
attempt's, in practice: it starts with the agents); past it the attempt's rank 0 hosts
the store, and a later attempt uses the service once it is up."""
REQUEST_TIMEOUT = 10.0


class StoreServiceHandle:
    """One job's store service, as its controller sees it."""

    def __init__(
        self,
        state_file: Path,
        token: str,
        process: subprocess.Popen[bytes] | None = None,
        start_timeout: float = START_TIMEOUT,
    ) -> None:
        self.state_file = state_file
        self._token = token
        self._process = process  # None: adopted from a dead controller
        self._start_timeout = start_timeout
        self._deadline = time.monotonic() + start_timeout
        self._url: str | None = None
        self._failed: str | None = None
        self._next: dict[int, int] = {}  # the next attempt's store, opened ahead
        self._ahead: threading.Thread | None = None  # telling the service of it

    @property
    def failed(self) -> str | None:
        """Why the service is not used (None: it is, or may still be)."""
        return self._failed

    def open(self, attempt: int) -> int | None:
        """The port of ``attempt``'s store; None: the service is unavailable (logged once).

        The service opened it ahead with the previous attempt's (``next``): then this
        returns at once, and tells the service in the background (which opens the one
        after).
        """
        ahead = self._ahead
        if ahead is not None:
            ahead.join()
        if self._failed is not None:
            return None
        port = self._next.get(attempt)
        if port is not None:
            self._ahead = threading.Thread(target=self._open, args=(attempt,), daemon=True)
            self._ahead.start()
            return port
        return self._open(attempt)

    def _open(self, attempt: int) -> int | None:
        try:
            reply = self._request("/open", {"attempt": attempt})
            self._next = {attempt + 1: int(reply["next"])}
            return int(reply["port"])
        except TimeoutError:  # still starting (a busy machine): not failed, not waited for
            logger.warning(
                "rendezvous store service not up within %.0f s: rank 0 hosts attempt %d's store",
                self._start_timeout,
                attempt,
            )
            return None
        except (OSError, ValueError, KeyError) as exc:
            self._fail(f"cannot open attempt {attempt}'s store: {exc}")
            return None

    def attach(self) -> None:
        """Make this process the service's owner (``trainguard resume``)."""
        pid = os.getpid()
        self._request("/attach", {"pid": pid, "start": start_ticks(pid)})

    def shutdown(self) -> None:
        """Stop the service (the job ended); waits for a service this process started."""
        if self._ahead is not None:
            self._ahead.join()
        asked = False
        if self._url is not None or self._failed is None:
            with contextlib.suppress(OSError, ValueError, TimeoutError):
                self._request("/shutdown", {}, wait=False)
                asked = True
        if self._process is not None:
            if not asked and self._process.poll() is None:
                # Still starting (importing torch): it serves nothing yet, and would only
                # be killed after REQUEST_TIMEOUT (a job stopped while hosts joined).
                self._process.terminate()
            try:
                self._process.wait(REQUEST_TIMEOUT)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    # -- internals -----------------------------------------------------------------

    def _fail(self, why: str) -> None:
        self._failed = why
        logger.warning("rendezvous store service: %s; rank 0 hosts each attempt's store", why)

    def _base_url(self, wait: bool) -> str:
        while self._url is None:
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(self.state_file.read_text())
                self._url = f"http://127.0.0.1:{int(state['control_port'])}"
                break
            if self._process is not None and self._process.poll() is not None:
                raise OSError(f"the service exited with {self._process.returncode}")
            if not wait or time.monotonic() >= self._deadline:
                raise TimeoutError("the service did not start in time")
            time.sleep(0.05)
        return self._url

    def _request(self, path: str, body: dict[str, Any], wait: bool = True) -> dict[str, Any]:
        url = self._base_url(wait) + path
        return call_json(url, self._token, body, timeout=REQUEST_TIMEOUT)


def rendezvous_mode() -> str:
    """Who serves the attempts' stores (:data:`MODE_ENV`); a bad value is a usage error."""
    mode = os.environ.get(MODE_ENV, "service") or "service"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def start_service(
    state_file: Path,
    token: str,
    grace: float,
    log_file: Path | None = None,
    start_timeout: float = START_TIMEOUT,
    host: str = "127.0.0.1",
    peers_file: Path | None = None,
) -> StoreServiceHandle:
    """Start the job's store service (see the module docstring); returns at once. Ranks
    reach its stores at ``host`` (the job's address), from the job's hosts only: loopback
    and the addresses ``peers_file`` lists (:mod:`trainguard.rendezvous.gateway`)."""
    state_file.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        state_file.unlink()  # a previous service's: not this one's port
    command = [
        sys.executable, "-m", "trainguard.rendezvous.service",
        "--state", str(state_file), "--owner", str(os.getpid()), "--grace", f"{grace:g}",
        "--host", host,
    ]  # fmt: skip
    if peers_file is not None:
        command += ["--peers-file", str(peers_file)]
    env = {**os.environ, TOKEN_ENV: token, "OMP_NUM_THREADS": "1"}
    out = open(log_file, "ab") if log_file is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # lives on for trainguard resume (its own grace)
        )
    finally:
        if log_file is not None:
            out.close()  # type: ignore[union-attr]
    return StoreServiceHandle(state_file, token, process, start_timeout)


def find_service(state_file: Path, token: str) -> StoreServiceHandle | None:
    """The running service a dead controller left (taken over), or None."""
    try:
        state = json.loads(state_file.read_text())
        pid, started = int(state["pid"]), state.get("started")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not runs(pid, started):
        return None
    handle = StoreServiceHandle(state_file, token, start_timeout=0.0)
    try:
        handle.attach()
    except (OSError, ValueError, TimeoutError) as exc:
        logger.warning("rendezvous store service (pid %d) did not answer: %s", pid, exc)
        return None
    return handle
