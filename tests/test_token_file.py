"""The job's token file, as hosts sharing a state directory write it: owner-only, and
never seen empty or half-written by an agent that starts meanwhile."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

from trainguard.hosts.security import write_token_file

TOKEN = "t" * 43
OTHER = "u" * 43


def test_the_file_is_its_owners_and_holds_the_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    write_token_file(path, TOKEN)
    assert path.read_text() == TOKEN
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    inode = path.stat().st_ino
    write_token_file(path, TOKEN)  # another host joins: the same token, left as it is
    assert path.stat().st_ino == inode
    write_token_file(path, OTHER)  # a new job's: replaced whole
    assert path.read_text() == OTHER
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["token"]  # no temporary left


def test_a_reader_never_sees_it_empty_while_hosts_write_it(tmp_path: Path) -> None:
    path = tmp_path / "token"
    write_token_file(path, TOKEN)
    seen: set[str] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seen.add(path.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(2000):
            write_token_file(path, OTHER if i % 2 else TOKEN)
    finally:
        done.set()
        reader.join()
    assert seen <= {TOKEN, OTHER}, sorted(seen, key=len)[:2]
