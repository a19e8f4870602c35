"""The memory tier's directories are the user's own: 0700, files 0600, from the start
(checkpoint/tier_dir.py); one someone else made first is refused (issue 38)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint.tier_dir import TierDirError, private_dir, user_root
from trainguard.platform.local import MEMORY_ROOT


@pytest.fixture
def public(tmp_path: Path) -> Iterator[Path]:
    """A world-writable, sticky directory like /dev/shm, under a umask of 0: whatever
    is not 0777 was asked for when it was created."""
    shared = tmp_path / "shm"
    shared.mkdir()
    shared.chmod(0o1777)
    old = os.umask(0)
    try:
        yield shared
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_tier_root_is_per_user() -> None:
    assert user_root() == Path(f"/dev/shm/trainguard-{os.getuid()}")
    assert user_root() == MEMORY_ROOT


def test_directories_are_created_0700_and_files_0600(public: Path) -> None:
    tier = public / f"trainguard-{os.getuid()}" / "job-1" / "node-0" / "memory"
    with Checkpointer(memory_dir=str(tier), job_id="job-1", memory_keep=1, environ={}) as ckpt:
        ckpt.save(1, {"w": torch.ones(8)})
    for part in (tier, *tier.parents):
        if part == public:
            break
        assert _mode(part) == 0o700, part
    files = list(tier.iterdir())
    assert {p.suffix for p in files} == {".data", ".meta"}
    assert all(_mode(p) == 0o600 for p in files), [(p.name, oct(_mode(p))) for p in files]


def test_an_own_directory_open_to_others_is_closed(public: Path) -> None:
    old = public / "trainguard-old"
    old.mkdir(mode=0o755)
    private_dir(old / "job")
    assert _mode(old) == 0o700 and _mode(old / "job") == 0o700


def test_a_link_in_place_of_the_root_is_refused(public: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (public / "trainguard-x").symlink_to(elsewhere)
    with pytest.raises(TierDirError, match="is a link"):
        private_dir(public / "trainguard-x" / "job")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make another user's directory")
def test_another_users_directory_is_refused(public: Path) -> None:
    """Anyone may create /dev/shm/trainguard-<uid> before its user does."""
    planted = public / "trainguard-0"
    planted.mkdir(mode=0o777)
    os.chown(planted, 4242, 4242)
    with pytest.raises(TierDirError, match="belongs to uid 4242"):
        Checkpointer(memory_dir=str(planted / "job"), job_id="job", environ={})
    assert not (planted / "job").exists()
