"""Small file helpers that need no torch."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: set it straight back
    os.umask(mask)
    return mask


def writer_tag() -> str:
    """Who writes a temporary file: host and pid, in its name, so that a process sharing the directory (another
    node of a job on a shared file system) removes only its own leftovers, or those of a writer known dead."""
    return f"{socket.gethostname()}.{os.getpid()}"


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename it over `path` (atomic on POSIX): a crash or a
    concurrent reader never sees a half-written file. The file gets the mode a plain open() would give it
    (0666 less the umask: 0644 under 022), not mkstemp's 0600, so others sharing the directory can read it."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{writer_tag()}.", suffix=".tmp")
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # one error naming the file it was for (a full disk: which write found it full), not
        # the flush's and then the close's, chained
        Path(tmp).unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
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
    """Delete the temporary files atomic_write leaves when its process is killed mid-write
    (`.NAME.HOST.PID.*.tmp`), and the directories a sharded checkpoint is written into (`.step-N.HOST.PID.tmp/`):
    this host's whose writer is dead. A live writer's (rank 0 of a running job that another node joins on a
    shared file system) and another host's are left alone."""
    import shutil

    host = socket.gethostname()
    removed = []
    for leftover in directory.glob(".*.tmp"):
        if _writer_is_dead(leftover.name, host):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
            removed.append(leftover)
    return removed


def _writer_is_dead(name: str, host: str) -> bool:
    """`.NAME.HOST.PID.RANDOM.tmp`: HOST is this machine and no process PID lives."""
    prefix = f".{host}."
    at = name.rfind(prefix)
    if at < 0:
        return False
    pid = name[at + len(prefix):].split(".", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    # A zombie answers kill(0) too: a writer killed with its parent waits for init to reap it (a relaunch right
    # after a kill -9 of the whole job found it so), but it never writes again.
    return _is_zombie(int(pid))  # else alive (our own included: a thread of ours may be writing it)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc (not Linux), or it just went: the next launch cleans up
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def write_new_file(path: Path, text: str, flag: str) -> None:
    """`text` to a file that must not exist yet (what --emit-slurm and --emit-k8s write): one line naming `flag`
    when it exists, its directory does not, or it cannot be written."""
    from ddp_amp.errors import UsageError

    if path.exists():
        raise UsageError(f"{flag} {str(path)!r} already exists; remove it or choose another name")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: directory {str(path.parent)!r} does not exist")
    try:
        atomic_write(path, text.encode())
    except OSError as exc:
        raise UsageError(f"{flag} {str(path)!r} cannot be written: {exc.strerror}") from None
