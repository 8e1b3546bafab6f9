"""Small file helpers that need no torch."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename it over `path` (atomic on POSIX): a crash or a
    concurrent reader never sees a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


LOCK_FILE = ".lock"


class DirectoryInUse(Exception):
    def __init__(self, pid: str) -> None:
        super().__init__(pid)
        self.pid = pid


class DirectoryLock:
    """An exclusive flock on DIR/.lock, held until this process exits (or release()).

    The kernel drops a flock when its holder dies, however it dies: a stale .lock file blocks nothing.
    The holder's pid is written into the file, for the message another launch shows.
    """

    def __init__(self, directory: Path) -> None:
        import fcntl

        self.path = directory / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # OSError: unwritable
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise DirectoryInUse(holder) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def lock_holder(directory: Path) -> str | None:
    """The pid held in DIR/.lock while a launch holds it, else None. Only looks: takes nothing, writes nothing."""
    import fcntl

    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)  # also drops the shared lock, if it was granted
    return None


def remove_partial_writes(directory: Path) -> list[Path]:
    """Delete the temporary files atomic_write leaves when its process is killed mid-write (`.NAME.*.tmp`).
    Only safe while holding the directory's lock: no other writer can be half-way through one."""
    removed = []
    for leftover in directory.glob(".*.tmp"):
        leftover.unlink(missing_ok=True)
        removed.append(leftover)
    return removed
