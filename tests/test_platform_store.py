"""The store's batch (one per drive-loop turn): one transaction for its writes, and none
at all for a turn that wrote nothing, so an idle job's controller takes no write lock."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from trainguard.platform.store import DB_NAME, JobAsks, JobNotFound, Store


def writer_lock_free(root: Path) -> bool:
    """Whether another connection can take the database's write lock right now."""
    other = sqlite3.connect(root / DB_NAME, timeout=0, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError as exc:
        assert "locked" in str(exc)
        return False
    finally:
        other.close()


def test_a_batch_that_writes_nothing_takes_no_lock_and_one_that_writes_commits_once(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path)
    try:
        store.create_job("j1", "job", "job.yaml", tmp_path / "j1", 2, 2, {})
        with store.batch():
            store.add_events("j1", [])  # nothing to write
            assert writer_lock_free(tmp_path)
        with store.batch():
            store.update_job("j1", phase="Running")
            store.update_job("j1", restarts=1)
            assert not writer_lock_free(tmp_path)  # one transaction, still open
        assert writer_lock_free(tmp_path)
        assert store.job("j1").phase == "Running" and store.job("j1").restarts == 1
        with pytest.raises(RuntimeError), store.batch():
            store.update_job("j1", phase="Failed")
            raise RuntimeError("the turn failed")
        assert store.job("j1").phase == "Running"  # rolled back
        assert writer_lock_free(tmp_path)
    finally:
        store.close()


def test_asks_reads_what_another_process_asked_of_a_running_job(tmp_path: Path) -> None:
    store, other = Store(tmp_path), Store(tmp_path)  # the controller's, a CLI command's
    try:
        store.create_job("j1", "job", "job.yaml", tmp_path / "j1", 2, 2, {})
        assert store.asks("j1") == JobAsks(None, None, "[]")
        other.request("j1", "stop")
        other.set_capacity("j1", 1)
        other.request_replace("j1", "node-1", "bad disk")
        assert store.asks("j1") == JobAsks("stop", 1, '[["node-1", "bad disk"]]')
        row = store.job("j1")
        assert (row.desired, row.capacity, row.node_requests) == (
            "stop",
            1,
            '[["node-1", "bad disk"]]',
        )
        with pytest.raises(JobNotFound, match="no job 'nope'"):
            store.asks("nope")
    finally:
        store.close()
        other.close()
