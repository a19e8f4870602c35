"""The controller's side of a multi-host job: hosts join it, and renew their lease.

Two routes on the server agents push their statuses to (:class:`~trainguard.platform.inbox.Inbox`,
bound to the ``--rdzv-endpoint``): ``POST /join`` (a :class:`~trainguard.wire.hosts.JoinRequest`;
the :class:`~trainguard.hosts.roster.Roster` decides) and ``GET /hosts/<host id>`` (the
host's lease: the job's phase, the host's standing, and at the end the job's exit code,
which every host's ``trainguard run`` exits with). Both check the job's bearer token before
anything else.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from aiohttp import web

from trainguard.atomic import write_text_atomic
from trainguard.auth import bearer_ok
from trainguard.hosts.roster import HostRecord, JoinRefused, Roster
from trainguard.wire.base import WireError, parse_json
from trainguard.wire.hosts import MAX_LEASE_EVENTS, HostLease, JoinReply, JoinRequest

__all__ = ["HostsService"]

MAX_JOIN_BYTES = 1 << 20
STOP_CHECK_SECONDS = 0.2  # how soon a signal ends the wait for hosts
REFUSAL_NOTE_SECONDS = 10.0  # a host refused for its token is said this often at most
EVENTS_KEPT = 1000  # event lines kept for hosts that have not renewed their lease yet


class HostsService:
    """Joins and leases of one job's hosts (see the module doc). Thread-safe."""

    def __init__(
        self,
        roster: Roster,
        token: str,
        *,
        lease_seconds: float,
        partition_timeout: float,
        durable_url: str = "",
        clock: Callable[[], float] = time.time,
        say: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.roster = roster
        self.job_id = ""  # set once the job has its id
        self._token = token.encode()
        self.lease_seconds = lease_seconds
        self.partition_timeout = partition_timeout
        self.durable_url = durable_url
        self._clock = clock
        self.say = say
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._phase = "Pending"
        self._restarts = 0
        self._result: tuple[int, str] | None = None  # exit code, reason
        # The job's event lines for the hosts (numbered; the newest EVENTS_KEPT), and
        # the number of the last one each host was handed.
        self._events: deque[tuple[int, str]] = deque(maxlen=EVENTS_KEPT)
        self._published = 0
        self._handed: dict[str, int] = {}
        self._peers_file: Path | None = None
        self._refusals_said: dict[str, float] = {}  # address -> when a 401 was said

    @property
    def peers_file(self) -> Path | None:
        """Where the joined hosts' addresses are kept, for the rendezvous store's door
        (:mod:`trainguard.rendezvous.gateway`); written at once and at each join."""
        return self._peers_file

    @peers_file.setter
    def peers_file(self, path: Path | None) -> None:
        with self._lock:
            self._peers_file = path
            self._write_peers()

    def _write_peers(self) -> None:
        if self._peers_file is not None:
            addrs = sorted({h.addr for h in self.roster.hosts.values()})
            write_text_atomic(self._peers_file, json.dumps(addrs), mode=0o600)

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/join", self._join), web.get("/hosts/{host_id}", self._lease)]

    # -- the job's side ------------------------------------------------------------------

    def set_phase(self, phase: str, restarts: int) -> None:
        """The job's phase and restarts now: every host's record shows them."""
        with self._lock:
            self._phase, self._restarts = phase, restarts

    def _say_refused(self, address: str) -> None:
        """Say that a join without the job's token was refused: once per address every
        :data:`REFUSAL_NOTE_SECONDS` (a flood of them is one line, not a line each)."""
        now = time.monotonic()
        with self._lock:
            if now - self._refusals_said.get(address, -REFUSAL_NOTE_SECONDS) < (
                REFUSAL_NOTE_SECONDS
            ):
                return
            if len(self._refusals_said) > 1024:
                self._refusals_said.clear()
            self._refusals_said[address] = now
        self.say(
            f"refused a join from {address}: missing or wrong bearer token (the token "
            "file, or $TRAINGUARD_TOKEN, must be the same on every host)"
        )

    def publish(self, line: str) -> None:
        """An event line every host prints with its next lease."""
        with self._lock:
            self._published += 1
            self._events.append((self._published, line))

    def _unseen(self, host_id: str) -> list[str]:
        """The event lines ``host_id`` was not handed yet (the newest, at most a lease's
        worth); from now on, for a host new to the lease. Under the lock."""
        last = self._handed.get(host_id, self._published)
        self._handed[host_id] = self._published
        lines = [line for number, line in self._events if number > last]
        return lines[-MAX_LEASE_EVENTS:]

    def finish(self, phase: str, exit_code: int, reason: str) -> None:
        """The job ended: every host's next lease says so (and with what exit code)."""
        with self._lock:
            self._phase, self._result = phase, (exit_code, reason)

    def lose(self, node_id: str) -> HostRecord | None:
        """``node_id`` was declared lost: its host is fenced (its lease says so)."""
        with self._lock:
            return self.roster.lose(node_id)

    def holder(self, node_id: str) -> HostRecord | None:
        with self._lock:
            return self.roster.holder(node_id)

    def bind(self, node_id: str, busy: set[str]) -> HostRecord | None:
        """The host to launch ``node_id`` on (:meth:`Roster.bind`): a lease older than
        three renewals is stale."""
        with self._lock:
            return self.roster.bind(node_id, busy, self._clock(), 3 * self.lease_seconds)

    def wait_for(
        self,
        node_ids: Sequence[str],
        timeout: float,
        stop: Callable[[], bool] = lambda: False,
    ) -> list[str]:
        """Wait up to ``timeout`` seconds for hosts to hold ``node_ids``, or until
        ``stop()`` (a signal: looked at every :data:`STOP_CHECK_SECONDS`); the ones still
        missing."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while (
                (missing := self.roster.joined(node_ids))
                and not stop()
                and (left := deadline - time.monotonic()) > 0
            ):
                self._changed.wait(min(left, STOP_CHECK_SECONDS))
            return missing

    def capacity(self, running: set[str], silent_after: float) -> tuple[int, tuple[str, ...]]:
        """How many hosts the job may use now (the controller's own, and those that
        renewed their lease within ``silent_after`` seconds), and the nodes of ``running``
        whose host went silent or was fenced: capacity taken away (an elastic job scales
        down without them)."""
        with self._lock:
            now = self._clock()
            live = [
                h
                for h in self.roster.hosts.values()
                if not h.lost and (h.local or now - h.last_seen <= silent_after)
            ]
            held = {h.node_id for h in live}
            return len(live), tuple(sorted(n for n in running if n not in held))

    def hosts_seen_since(self, when: float) -> list[HostRecord]:
        with self._lock:
            return [h for h in self.roster.hosts.values() if h.last_seen >= when]

    # -- the routes ----------------------------------------------------------------------

    async def _join(self, request: web.Request) -> web.Response:
        if not bearer_ok(request.headers.get("Authorization"), self._token):
            self._say_refused(request.remote or "?")
            return _error(401, "missing or wrong bearer token")
        if (request.content_length or 0) > MAX_JOIN_BYTES:
            return _error(413, f"a join is at most {MAX_JOIN_BYTES} bytes")
        try:
            join = parse_json(JoinRequest, await request.read(), "join")
        except WireError as exc:
            return _error(400, str(exc))
        refused: str | None = None
        with self._changed:
            if self._result is not None:
                return _error(409, f"job {self.job_id} has ended: {self._result[1]}")
            try:
                record = self.roster.join(join, self._clock())
            except JoinRefused as exc:
                refused = str(exc)
            else:
                self._handed.setdefault(record.host_id, self._published)
                self._write_peers()
                self._changed.notify_all()
        if refused is not None:  # the refused host exits saying why; so does this side
            self.say(f"refused host {join.hostname} ({join.addr}): {refused}")
            return _error(409, refused)
        self.say(
            f"host {record.hostname} ({record.addr}) joined as {record.node_id} ({record.role})"
        )
        reply = JoinReply(
            job_id=self.job_id,
            role="node" if record.role == "node" else "spare",
            node_id=record.node_id,
            lease_seconds=self.lease_seconds,
            partition_timeout=self.partition_timeout,
            durable_url=self.durable_url,
        )
        return web.json_response(reply.to_json())

    async def _lease(self, request: web.Request) -> web.Response:
        if not bearer_ok(request.headers.get("Authorization"), self._token):
            return _error(401, "missing or wrong bearer token")
        with self._lock:
            host = self.roster.hosts.get(request.match_info["host_id"])
            if host is None:
                return _error(404, "no such host in this job")
            host.last_seen = self._clock()
            result = self._result
            lease = HostLease(
                phase=self._phase,
                standing="lost" if host.lost else "member",
                restarts=self._restarts,
                finished=result is not None,
                exit_code=result[0] if result else None,
                reason=result[1] if result else None,
                events=self._unseen(host.host_id),
            )
        return web.json_response(lease.to_json())


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
