"""Talking to every agent of a job: concurrent polls and requests, over kept-alive HTTP.

- A poller thread asks every located agent for its status, ``concurrency`` at a time,
  once per ``poll_interval`` (a cycle that takes longer starts the next at once; the
  controller sets the interval through :meth:`AgentTransport.pace`), and wakes the
  drive loop when a cycle is done. Agents also push on their own
  (:mod:`trainguard.platform.inbox`); both land in the :class:`ReportBook`. Polls pause
  while requests go out: a stop broadcast to thousands of nodes comes first.
- :meth:`AgentTransport.send` delivers requests to many agents at once, each retried
  briefly when the agent does not answer. A request that still gets no answer is a
  failed contact in the book; one the agent refuses comes back as a
  :class:`~trainguard.control.reports.Refusal` for the controller.

Requests go out in parallel with bounded concurrency: the nodes are dealt to a few
threads, each of which talks to its share one after the other (a thread waiting for
one agent's reply lets the others work; a future per request would cost more than the
request). Stopping 4096 nodes costs about a second, not 4096 round trips in a row. A
poll of at most ``poll_concurrency`` nodes (a job of a few nodes, twice a second) is the
poller thread's alone: it sends every request, then reads each reply as it comes, so
a poll cycle wakes no other thread.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from trainguard.agent.client import AgentClient, AgentError, AgentUnreachable, StatusPoll
from trainguard.control.reports import Refusal, RequestKind
from trainguard.platform.book import ReportBook
from trainguard.wire.requests import (
    AttemptRequest,
    NodeAssignment,
    PersistRequest,
    ReplaceRequest,
    StopRequest,
)

logger = logging.getLogger(__name__)

__all__ = ["AgentTransport", "Delivery"]

RETRY_DELAYS = (0.1, 0.3)
"""Pauses before retrying a request that got no answer (then it is a failed contact)."""
POLL_CONCURRENCY = 8
SEND_CONCURRENCY = 16

T = TypeVar("T")
R = TypeVar("R")

Payload = NodeAssignment | ReplaceRequest | StopRequest | PersistRequest


@dataclass(frozen=True)
class Delivery:
    """One request for one node's agent (an assignment for ``start`` and ``rejoin``)."""

    node_id: str
    request: RequestKind
    attempt: int | None
    payload: Payload


DEFAULT_CONTACT_TIMEOUT = 5.0
"""Seconds each poll or request to an agent on this machine may take."""


class AgentTransport:
    """The job's connections to its agents; see the module docstring."""

    def __init__(
        self,
        book: ReportBook,
        token: str,
        *,
        poll_interval: float,
        timeout: float = DEFAULT_CONTACT_TIMEOUT,
        report_url: str | None = None,
        poll_concurrency: int = POLL_CONCURRENCY,
        send_concurrency: int = SEND_CONCURRENCY,
    ) -> None:
        self.book = book
        self.report_url = report_url
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.cycle_seconds: list[float] = []  # the latest poll cycles' durations
        self._token = token
        self._clients: dict[str, AgentClient] = {}
        self._clients_lock = threading.Lock()
        self._poll_concurrency = poll_concurrency
        self._send_concurrency = send_concurrency
        self._polls = ThreadPoolExecutor(poll_concurrency, thread_name_prefix="tg-poll")
        self._sends = ThreadPoolExecutor(send_concurrency, thread_name_prefix="tg-send")
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._sending = 0  # send() calls under way (polls wait for them)
        self._idle = threading.Condition()
        self._poller = threading.Thread(target=self._poll_forever, name="tg-poller", daemon=True)

    def start(self) -> None:
        self._poller.start()

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._poller.is_alive():
            self._poller.join(self.timeout + 1.0)
        self._polls.shutdown(wait=False, cancel_futures=True)
        self._sends.shutdown(wait=True, cancel_futures=True)
        with self._clients_lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def client(self, node_id: str) -> AgentClient | None:
        """A client of the node's current agent (None until it is located)."""
        url = self.book.url(node_id)
        if url is None:
            return None
        with self._clients_lock:
            client = self._clients.get(node_id)
            if client is None or client.base_url != url.rstrip("/"):
                if client is not None:
                    client.close()
                client = self._clients[node_id] = AgentClient(url, self._token, self.timeout)
            return client

    # -- requests ------------------------------------------------------------------------

    def send(self, deliveries: Sequence[Delivery]) -> list[Refusal]:
        """Deliver every request, concurrently; returns the refusals."""
        if not deliveries:
            return []
        with self._idle:
            self._sending += 1
        try:
            results = _dealt(self._sends, self._deliver, deliveries, self._send_concurrency)
        finally:
            with self._idle:
                self._sending -= 1
                self._idle.notify_all()
        return [r for r in results if r is not None]

    def _deliver(self, delivery: Delivery) -> Refusal | None:
        client = self.client(delivery.node_id)
        if client is None:
            self.book.failed(delivery.node_id, f"/{delivery.request}: agent not located")
            return None
        for pause in (*RETRY_DELAYS, None):
            try:
                self._call(client, delivery)
                return None
            except AgentUnreachable as exc:
                if pause is None or self._stop.is_set():
                    node, kind = delivery.node_id, delivery.request
                    logger.warning("%s: /%s: no answer: %s", node, kind, exc)
                    self.book.failed(delivery.node_id, str(exc))
                    return None
                time.sleep(pause)
            except AgentError as exc:
                return Refusal(delivery.node_id, delivery.request, delivery.attempt, str(exc))
        return None

    def _call(self, client: AgentClient, delivery: Delivery) -> None:
        payload = delivery.payload
        if isinstance(payload, NodeAssignment):
            peers = {p: url for p in payload.replica_peers if (url := self.book.url(p))}
            request = AttemptRequest(assignment=payload, peers=peers, report_url=self.report_url)
            if delivery.request == "start":
                client.start(request)
            else:
                client.rejoin(request)
        elif isinstance(payload, ReplaceRequest):
            client.replace(payload)
        elif isinstance(payload, StopRequest):
            client.stop(payload)
        else:
            client.persist(payload)

    # -- polls ---------------------------------------------------------------------------

    def poll(self, node_ids: Sequence[str] | None = None) -> None:
        """One concurrent status poll of these nodes (default: every located one)."""
        nodes = list(self.book.urls()) if node_ids is None else list(node_ids)
        if len(nodes) <= self._poll_concurrency:
            self._poll_together(nodes)
        else:
            _dealt(self._polls, self._poll_node, nodes, self._poll_concurrency)

    def _poll_node(self, node_id: str) -> None:
        if self._sending:
            return  # requests first; this node is polled next cycle
        client = self.client(node_id)
        if client is None:
            return
        try:
            status = client.status()
        except AgentError as exc:
            self.book.failed(node_id, str(exc))
            return
        self.book.answered(status)

    def _poll_together(self, node_ids: Sequence[str]) -> None:
        """Poll a few nodes from this thread: every request first, then each reply as it
        comes (an agent that does not answer holds up no other's reply)."""
        if self._sending:
            return  # requests first; these nodes are polled next cycle
        waiting: dict[int, tuple[str, AgentClient, StatusPoll]] = {}
        for node_id in node_ids:
            client = self.client(node_id)
            if client is None:
                continue
            try:
                sent = client.status_sent()
            except AgentError as exc:
                self.book.failed(node_id, str(exc))
                continue
            waiting[sent.sock.fileno()] = (node_id, client, sent)
        readable = select.poll()
        for fd in waiting:
            readable.register(fd, select.POLLIN)
        deadline = time.monotonic() + self.timeout
        while waiting and (left := deadline - time.monotonic()) > 0:
            for fd, _ in readable.poll(left * 1000):
                readable.unregister(fd)
                node_id, client, sent = waiting.pop(fd)
                try:
                    self.book.answered(client.status_of(sent))
                except AgentError as exc:
                    self.book.failed(node_id, str(exc))
        for node_id, client, sent in waiting.values():
            self.book.failed(node_id, str(client.timed_out(sent)))

    def _poll_forever(self) -> None:
        while not self._stop.is_set():
            with self._idle:
                while self._sending and not self._stop.is_set():
                    self._idle.wait(self.poll_interval)
            began = time.monotonic()
            try:
                self.poll()
            except RuntimeError:  # the pool shut down under us: closing
                return
            self.cycle_seconds = [*self.cycle_seconds[-99:], time.monotonic() - began]
            self.book.wake()
            while (
                not self._stop.is_set()
                and (left := began + self.poll_interval - time.monotonic()) > 0
            ):
                self._kick.wait(left)  # set by pace() (a shorter interval) and close()
                self._kick.clear()

    def pace(self, interval: float) -> None:
        """Poll every ``interval`` seconds from now on (a cycle is due that long after the
        previous one began): a shorter interval than the one being waited out takes
        effect at once, so a controller that wants fresh reports gets them now."""
        if interval == self.poll_interval:
            return
        logger.debug("polls every %gs from now on", interval)
        shorter = interval < self.poll_interval
        self.poll_interval = interval
        if shorter:
            self._kick.set()


def _dealt(
    pool: ThreadPoolExecutor, call: Callable[[T], R], items: Sequence[T], threads: int
) -> list[R]:
    """``call`` on every item, the items dealt round robin to ``threads`` hands that each
    go through theirs in turn: the calling thread plays the first, tasks of ``pool`` the
    others (a poll of a few nodes wakes one thread fewer); the results in no particular
    order."""
    if not items:
        return []
    hands = [items[i::threads] for i in range(min(threads, len(items)))]
    futures = [pool.submit(lambda hand: [call(item) for item in hand], h) for h in hands[1:]]
    mine = [call(item) for item in hands[0]]
    return [*mine, *(result for f in futures for result in f.result())]
