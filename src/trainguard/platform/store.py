"""Jobs, attempts, nodes and events in SQLite, under the state directory.

One writer per job (the process running its controller); any number of
readers (``list``, ``describe``, ``logs``, ``delete``) in other processes. WAL
mode lets readers see a running job without blocking it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import stat
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.control.events import Event
from trainguard.platform.doorbell import ring
from trainguard.platform.procs import start_time

STATE_DIR_ENV = "TRAINGUARD_STATE_DIR"
DEFAULT_STATE_DIR = "~/.trainguard"
DB_NAME = "trainguard.db"
# Columns added to the schema after its first release: (table, column, declaration).
_ADDED_COLUMNS = (
    ("jobs", "faults_json", "TEXT NOT NULL DEFAULT '[]'"),
    # Each recorded pid's start time (trainguard.platform.procs.start_time): `delete`
    # signals a pid only while its start time is still this one (not a reused pid).
    ("jobs", "controller_started", "TEXT"),
    ("nodes", "agent_started", "TEXT"),
    ("nodes", "worker_starts_json", "TEXT NOT NULL DEFAULT '[]'"),
    # Nodes someone asked to replace (`trainguard node replace`): [[node id, why], ...].
    ("jobs", "node_requests", "TEXT NOT NULL DEFAULT '[]'"),
    # Elastic jobs: the nodes the job may use (`trainguard scale --capacity`; NULL: its size).
    ("jobs", "capacity", "INTEGER"),
    # The machine a node runs on, by name, and its running workers there, [[rank, pid],
    # ...], on whichever host: `describe` shows them (only worker_pids, this machine's
    # own, are ever signalled).
    ("nodes", "host", "TEXT"),
    ("nodes", "workers_json", "TEXT NOT NULL DEFAULT '[]'"),
)
# How long a write waits for a competing writer before giving up.
BUSY_TIMEOUT_SECONDS = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    phase TEXT NOT NULL,
    reason TEXT,
    source TEXT,
    job_dir TEXT NOT NULL,
    nnodes INTEGER NOT NULL,
    nproc_per_node INTEGER NOT NULL,
    restarts INTEGER NOT NULL DEFAULT 0,
    controller_pid INTEGER,
    desired TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    spec_json TEXT NOT NULL,
    faults_json TEXT NOT NULL DEFAULT '[]'
);
CREATE TABLE IF NOT EXISTS attempts (
    job_id TEXT NOT NULL,
    number INTEGER NOT NULL,
    phase TEXT NOT NULL,
    reason TEXT,
    master_addr TEXT,
    master_port INTEGER,
    started_at REAL NOT NULL,
    ended_at REAL,
    PRIMARY KEY (job_id, number)
);
CREATE TABLE IF NOT EXISTS nodes (
    job_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    node_rank INTEGER,
    ranks_json TEXT NOT NULL DEFAULT '[]',
    state TEXT NOT NULL,
    attempt INTEGER,
    agent_pid INTEGER,
    agent_url TEXT,
    worker_pids_json TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (job_id, node_id)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL,
    attempt INTEGER,
    node TEXT,
    rank INTEGER,
    data_json TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_job ON events (job_id, id);
CREATE TABLE IF NOT EXISTS samples (
    job_id TEXT NOT NULL,
    time REAL NOT NULL,
    attempt INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    value REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_job ON samples (job_id, rank, time);
"""
# ``samples`` rows: the job's progress (``rank`` -1, ``value`` the step) and each rank's
# pace (``value`` its seconds per step), as trainguard.observe.history.SeriesSample.


def state_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The state directory: the flag, else ``$TRAINGUARD_STATE_DIR``, else ``~/.trainguard``."""
    raw = explicit or os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR
    return Path(raw).expanduser().resolve()


class StateDirError(Exception):
    """A state directory that cannot be used; ``str()`` is one line naming it."""


def open_store(explicit: str | os.PathLike[str] | None = None, writable: bool = True) -> Store:
    """The store in `state_dir(explicit)`; StateDirError (exit 2) when it cannot be one:
    a file, not writable (`writable`: a job is to be run in it), no database to open."""
    if explicit:
        flag = "--state-dir"
    elif os.environ.get(STATE_DIR_ENV):
        flag = f"${STATE_DIR_ENV}"
    else:
        flag = "state directory"
    try:
        root = state_dir(explicit)
    except (OSError, RuntimeError) as err:  # RuntimeError: a symlink loop
        raise StateDirError(f"{flag}: {err}") from None
    name = f"{flag} {root}"
    if root.exists() and not root.is_dir():
        raise StateDirError(f"{name}: is a file, not a directory")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise StateDirError(f"{name}: cannot create it: {err.strerror or err}") from None
    if writable and not os.access(root, os.W_OK | os.X_OK):
        raise StateDirError(f"{name}: not writable")
    try:
        return Store(root)
    except (OSError, sqlite3.Error) as err:
        reason = getattr(err, "strerror", None) or err
        raise StateDirError(f"{name}: cannot open its database {DB_NAME}: {reason}") from None


class JobNotFound(LookupError):
    pass


class AmbiguousJob(JobNotFound):
    """A name that several jobs have: ``str()`` names them, so the user can pick an id."""

    def __init__(self, name: str, ids: Sequence[str]) -> None:
        super().__init__(
            f"{len(ids)} jobs are named {name!r}: {', '.join(ids)}; give one of these ids"
        )
        self.ids = list(ids)


# Specs (redacted), commands, paths, logs and tokens are this user's only: the state dir is
# 0700 and its database 0600 (SQLite gives its -wal and -shm files the database's mode).
_DIR_MODE, _FILE_MODE = 0o700, 0o600


def _private(path: Path, mode: int = _DIR_MODE) -> None:
    """Make ``path`` (when it is ours) readable by its owner only; an older trainguard
    made them 0755/0644. Not ours (a shared directory): left as it is."""
    with contextlib.suppress(OSError):
        info = path.stat()
        if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) != mode:
            os.chmod(path, mode)


def _private_file(db: Path) -> Path:
    """``db`` created 0600 (never readable by others, not even for a moment)."""
    with contextlib.suppress(OSError):  # sqlite3.connect says why it cannot open it
        os.close(os.open(db, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _FILE_MODE))
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        _private(path, _FILE_MODE)
    return db


@dataclass(frozen=True)
class JobRow:
    id: str
    name: str
    phase: str
    reason: str | None
    source: str | None
    job_dir: str
    nnodes: int
    nproc_per_node: int
    restarts: int
    controller_pid: int | None
    desired: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    spec_json: str
    faults_json: str = "[]"
    controller_started: str | None = None  # the controller's start time (procs.start_time)
    node_requests: str = "[]"  # [[node id, why], ...]: replacements asked for, in order
    capacity: int | None = None  # elastic: the nodes the job may use (None: its size)


@dataclass(frozen=True)
class JobAsks:
    """What other processes ask of a running job (``delete``/``stop``, ``scale``,
    ``node replace``): the columns of its row the controller reads on every turn."""

    desired: str | None
    capacity: int | None
    node_requests: str  # as JobRow.node_requests


@dataclass(frozen=True)
class NodeRow:
    """One node of a job as ``describe`` shows it."""

    node_id: str
    state: str
    node_rank: int | None = None
    ranks: tuple[int, ...] = ()
    attempt: int | None = None
    agent_pid: int | None = None
    agent_url: str | None = None
    worker_pids: tuple[int, ...] = ()
    # Start times (procs.start_time) of the agent and of each worker pid, in order.
    agent_started: str | None = None
    worker_starts: tuple[str | None, ...] = ()
    # The machine the node runs on (its hostname), and (rank, pid) of each running worker
    # there, a node on another host's too: shown, never signalled (worker_pids are).
    host: str | None = None
    workers: tuple[tuple[int, int], ...] = ()


class Store:
    """A handle on the state directory's database. Cheap to open; not shared across threads."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        _private(root)
        self._db = sqlite3.connect(
            _private_file(root / DB_NAME), timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None
        )
        self._db.row_factory = sqlite3.Row
        self._depth = 0  # open transactions (a batch and the writes inside it)
        self._begun = False  # the open batch's transaction has begun (its first write)
        self._db.execute("PRAGMA journal_mode=WAL")
        # A commit is written to the WAL without an fsync (SQLite's advice for WAL): one
        # costs ~0.17 ms of CPU and ~5 ms of wall time with one, and the drive loop
        # commits a turn's metric samples about every second turn. A commit survives a
        # crash of the process; only a crash of the machine may lose the last few.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """A state directory made by an older trainguard lacks newer columns: add them."""

        def missing() -> bool:
            return any(
                column not in {r["name"] for r in self._db.execute(f"PRAGMA table_info({t})")}
                for t, column, _ in _ADDED_COLUMNS
            )

        if not missing():
            return
        with self._tx() as db:  # one writer at a time: two processes may open it at once
            for table, column, declaration in _ADDED_COLUMNS:
                have = {row["name"] for row in db.execute(f"PRAGMA table_info({table})")}
                if column not in have:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Every write inside is one transaction (one commit), not one each; a batch that
        wrote nothing (a drive-loop turn where nothing changed) opens none."""
        if self._depth:
            with self._tx():
                yield
            return
        self._depth, self._begun = 1, False
        try:
            yield
        except BaseException:
            if self._begun:
                self._db.execute("ROLLBACK")
            raise
        finally:
            self._depth, begun, self._begun = 0, self._begun, False
        if begun:
            self._db.execute("COMMIT")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        if self._depth:  # inside a batch: part of its transaction, begun by its first write
            if not self._begun:
                self._db.execute("BEGIN IMMEDIATE")
                self._begun = True
            self._depth += 1
            try:
                yield self._db
            finally:
                self._depth -= 1
            return
        self._db.execute("BEGIN IMMEDIATE")
        self._depth, self._begun = 1, True
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        finally:
            self._depth, self._begun = 0, False
        self._db.execute("COMMIT")

    # -- jobs ----------------------------------------------------------------

    def create_job(
        self,
        job_id: str,
        name: str,
        source: str,
        job_dir: Path,
        nnodes: int,
        nproc_per_node: int,
        spec: dict[str, Any],
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO jobs (id, name, phase, source, job_dir, nnodes, nproc_per_node,"
                " controller_pid, controller_started, created_at, spec_json)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    job_id,
                    name,
                    "Pending",
                    source,
                    str(job_dir),
                    nnodes,
                    nproc_per_node,
                    os.getpid(),
                    start_time(os.getpid()),
                    time.time(),
                    json.dumps(spec),
                ),
            )

    def update_job(self, job_id: str, **fields: Any) -> None:
        allowed = {
            "phase",
            "reason",
            "restarts",
            "started_at",
            "finished_at",
            "controller_pid",
            "controller_started",
            "faults",
        }
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot update job fields {sorted(bad)}")
        if not fields:
            return
        if "controller_pid" in fields and "controller_started" not in fields:
            fields["controller_started"] = start_time(fields["controller_pid"])
        if "faults" in fields:
            fields["faults_json"] = json.dumps(fields.pop("faults"))
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as db:
            db.execute(f"UPDATE jobs SET {cols} WHERE id = ?", (*fields.values(), job_id))

    def request(self, job_id: str, desired: str) -> None:
        """Ask the job's controller (in whatever process) to act, e.g. ``desired="delete"``.
        Each ask rings the job's doorbell (:meth:`_ring`)."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET desired = ? WHERE id = ?", (desired, job_id))
        self._ring(job_id)

    def set_capacity(self, job_id: str, capacity: int, delta: bool = False) -> int:
        """Set (or, with ``delta``, change) how many nodes an elastic job may use; the
        new value."""
        with self._tx() as db:
            row = db.execute("SELECT capacity FROM jobs WHERE id = ?", (job_id,)).fetchone()
            current = row["capacity"] if row is not None else None
            value = max(0, (current or 0) + capacity) if delta else capacity
            db.execute("UPDATE jobs SET capacity = ? WHERE id = ?", (value, job_id))
        self._ring(job_id)
        return int(value)

    def request_replace(self, job_id: str, node_id: str, reason: str) -> None:
        """Ask the job's controller to replace a node (``trainguard node replace``)."""
        with self._tx() as db:
            row = db.execute("SELECT node_requests FROM jobs WHERE id = ?", (job_id,)).fetchone()
            requests = json.loads(row["node_requests"]) if row is not None else []
            requests.append([node_id, reason])
            db.execute(
                "UPDATE jobs SET node_requests = ? WHERE id = ?", (json.dumps(requests), job_id)
            )
        self._ring(job_id)

    def _ring(self, job_id: str) -> None:
        """Ring the doorbell of the job's controller (:mod:`trainguard.platform.doorbell`)
        after an ask is committed: it reads the ask now, not at its next turn (a quiet
        poll's 2 s later). Nothing happens where no controller holds one."""
        row = self._db.execute("SELECT job_dir FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is not None:
            ring(Path(row["job_dir"]))

    def job(self, ref: str) -> JobRow:
        """A job by id, or by name when one job has it; :class:`AmbiguousJob` (newest
        first) when several do, :class:`JobNotFound` when none."""
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (ref,)).fetchone()
        if row is not None:
            return JobRow(**dict(row))
        rows = self._db.execute(
            "SELECT * FROM jobs WHERE name = ? ORDER BY created_at DESC", (ref,)
        ).fetchall()
        if not rows:
            raise JobNotFound(f"no job {ref!r} in {self.root}")
        if len(rows) > 1:
            raise AmbiguousJob(ref, [r["id"] for r in rows])
        return JobRow(**dict(rows[0]))

    def asks(self, job_id: str) -> JobAsks:
        """:class:`JobAsks` of a job, read without the rest of its row (its spec): the
        drive loop reads it twice a second."""
        row = self._db.execute(
            "SELECT desired, capacity, node_requests FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
        if row is None:
            raise JobNotFound(f"no job {job_id!r} in {self.root}")
        return JobAsks(row["desired"], row["capacity"], row["node_requests"])

    def newest_named(self, name: str) -> JobRow | None:
        """The newest job named ``name``, if any."""
        row = self._db.execute(
            "SELECT * FROM jobs WHERE name = ? ORDER BY created_at DESC LIMIT 1", (name,)
        ).fetchone()
        return None if row is None else JobRow(**dict(row))

    def jobs(self) -> list[JobRow]:
        rows = self._db.execute("SELECT * FROM jobs ORDER BY created_at").fetchall()
        return [JobRow(**dict(r)) for r in rows]

    def remove_job(self, job_id: str) -> None:
        with self._tx() as db:
            for table, key in (
                ("jobs", "id"),
                ("attempts", "job_id"),
                ("nodes", "job_id"),
                ("events", "job_id"),
                ("samples", "job_id"),
            ):
                db.execute(f"DELETE FROM {table} WHERE {key} = ?", (job_id,))

    # -- attempts, nodes, events ---------------------------------------------

    def upsert_attempt(
        self,
        job_id: str,
        number: int,
        phase: str,
        started_at: float,
        master_addr: str | None,
        master_port: int | None,
        reason: str | None = None,
        ended_at: float | None = None,
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO attempts (job_id, number, phase, reason, master_addr, master_port,"
                " started_at, ended_at) VALUES (?,?,?,?,?,?,?,?)"
                " ON CONFLICT (job_id, number) DO UPDATE SET phase = excluded.phase,"
                " reason = excluded.reason, ended_at = excluded.ended_at,"
                " master_addr = COALESCE(excluded.master_addr, master_addr),"
                " master_port = COALESCE(excluded.master_port, master_port)",
                (job_id, number, phase, reason, master_addr, master_port, started_at, ended_at),
            )

    def attempts(self, job_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT number, phase, reason, master_addr, master_port, started_at, ended_at"
            " FROM attempts WHERE job_id = ? ORDER BY number",
            (job_id,),
        ).fetchall()
        return [dict(r) for r in rows]

    def upsert_nodes(self, job_id: str, rows: Sequence[NodeRow]) -> None:
        """Write these nodes' rows (whole rows, one statement for all)."""
        if not rows:
            return
        with self._tx() as db:
            db.executemany(
                "INSERT INTO nodes (job_id, node_id, node_rank, ranks_json, state, attempt,"
                " agent_pid, agent_url, worker_pids_json, agent_started, worker_starts_json,"
                " host, workers_json)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)"
                " ON CONFLICT (job_id, node_id) DO UPDATE SET node_rank = excluded.node_rank,"
                " ranks_json = excluded.ranks_json, state = excluded.state,"
                " attempt = excluded.attempt, agent_pid = excluded.agent_pid,"
                " agent_url = excluded.agent_url, worker_pids_json = excluded.worker_pids_json,"
                " agent_started = excluded.agent_started,"
                " worker_starts_json = excluded.worker_starts_json,"
                " host = excluded.host, workers_json = excluded.workers_json",
                [
                    (
                        job_id,
                        r.node_id,
                        r.node_rank,
                        json.dumps(list(r.ranks)),
                        r.state,
                        r.attempt,
                        r.agent_pid,
                        r.agent_url,
                        json.dumps(list(r.worker_pids)),
                        r.agent_started,
                        json.dumps(list(r.worker_starts)),
                        r.host,
                        json.dumps([list(w) for w in r.workers]),
                    )
                    for r in rows
                ],
            )

    def nodes(self, job_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT * FROM nodes WHERE job_id = ? ORDER BY node_rank, node_id", (job_id,)
        ).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d.pop("job_id")
            d["ranks"] = json.loads(d.pop("ranks_json"))
            d["worker_pids"] = json.loads(d.pop("worker_pids_json"))
            d["worker_starts"] = json.loads(d.pop("worker_starts_json"))
            d["workers"] = [{"rank": r, "pid": p} for r, p in json.loads(d.pop("workers_json"))]
            out.append(d)
        return out

    def add_events(self, job_id: str, events: Sequence[Event]) -> None:
        if not events:
            return
        with self._tx() as db:
            db.executemany(
                "INSERT INTO events (job_id, time, kind, message, attempt, node, rank, data_json)"
                " VALUES (?,?,?,?,?,?,?,?)",
                [
                    (
                        job_id,
                        e.time,
                        e.kind,
                        e.message,
                        e.attempt,
                        e.node,
                        e.rank,
                        json.dumps(e.data),
                    )
                    for e in events
                ],
            )

    def add_samples(self, job_id: str, rows: Sequence[tuple[float, int, int, float]]) -> None:
        """Append ``(time, attempt, rank, value)`` rows (see ``samples`` in the schema)."""
        if rows:
            with self._tx() as db:
                db.executemany(
                    "INSERT INTO samples (job_id, time, attempt, rank, value) VALUES (?,?,?,?,?)",
                    [(job_id, *row) for row in rows],
                )

    def samples(self, job_id: str) -> list[tuple[float, int, int, float]]:
        """Every ``(time, attempt, rank, value)`` row of the job, oldest first."""
        rows = self._db.execute(
            "SELECT time, attempt, rank, value FROM samples WHERE job_id = ? ORDER BY time",
            (job_id,),
        ).fetchall()
        return [(r["time"], r["attempt"], r["rank"], r["value"]) for r in rows]

    def events(self, job_id: str) -> list[Event]:
        rows = self._db.execute(
            "SELECT time, kind, message, attempt, node, rank, data_json FROM events"
            " WHERE job_id = ? ORDER BY id",
            (job_id,),
        ).fetchall()
        return [
            Event(
                r["time"],
                r["kind"],
                r["message"],
                r["attempt"],
                r["node"],
                r["rank"],
                json.loads(r["data_json"]),
            )
            for r in rows
        ]
