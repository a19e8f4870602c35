"""The memory tier's directories: the user's own, closed to everyone else.

``/dev/shm`` is shared by every user of the machine (mode 1777), and the memory tier
holds the model's state. So the tier of each user lives under a root of its own,
``/dev/shm/trainguard-<uid>`` (:func:`user_root`; a job's tiers in ``<root>/<job>``),
its directories are created ``0700`` (:func:`private_dir`) and its files ``0600``
(:func:`open_private`), with those modes from the start rather than changed after. A
directory someone else made first (anyone may create ``/dev/shm/trainguard-<uid>``
before the user does) is refused, never used: :class:`TierDirError` names it.

Torch-free: the node agent, the controller and the data cache use it too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["SHM", "TierDirError", "create_private", "open_private", "private_dir", "user_root"]

SHM = Path("/dev/shm")


class TierDirError(PermissionError):
    """A directory of the tier that is not this user's own (or not a directory)."""


def user_root(base: Path = SHM) -> Path:
    """``/dev/shm/trainguard-<uid>``: where this user's memory tiers live."""
    return base / f"trainguard-{os.getuid()}"


def private_dir(path: str | Path) -> Path:
    """Create ``path`` and its missing parents with mode ``0700``; returns it.

    Every directory of it from the first one inside a world-writable directory (such as
    ``/dev/shm`` or ``/tmp``) down, and ``path`` itself, must be a directory of this
    user's and not a link: else :class:`TierDirError`. One of this user's that others
    may read (made by an older trainguard) is closed to them (``0700``).
    """
    target = Path(os.path.abspath(path))
    uid = os.getuid()
    ours = False  # from here down, every directory must be this user's
    for part in (*reversed(target.parents), target):
        try:
            os.mkdir(part, 0o700)  # the umask can only take bits away from 0700
        except FileExistsError:
            pass
        except OSError as exc:
            if not part.is_dir():
                raise TierDirError(exc.errno, f"cannot create {part}: {exc.strerror}") from None
        if ours or part == target:
            _check_own(part, uid)
        ours = ours or bool(os.stat(part).st_mode & stat.S_IWOTH)
    return target


def _check_own(part: Path, uid: int) -> None:
    info = os.lstat(part)
    if not stat.S_ISDIR(info.st_mode):
        kind = "a link" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise TierDirError(f"{part} is {kind}: refusing to keep the memory tier there")
    if info.st_uid != uid:
        raise TierDirError(
            f"{part} belongs to uid {info.st_uid}, not to this user (uid {uid}): refusing to "
            "keep the memory tier there (another user may read or replace it); remove it, "
            "or point TRAINGUARD_CHECKPOINT_MEMORY_DIR elsewhere"
        )
    if info.st_mode & 0o077:
        os.chmod(part, 0o700)


def create_private(path: str | Path) -> int:
    """``path`` opened to write (created ``0600``, or truncated), not through a link: its
    descriptor (for ``os.write``/``splice``; the caller closes it)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)


def open_private(path: str | Path) -> BinaryIO:
    """:func:`create_private`'s descriptor as a buffered file."""
    return os.fdopen(create_private(path), "wb")
