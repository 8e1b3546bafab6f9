"""Small file helpers that need no torch."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Any


def not_a_torch_file(path: Path) -> str | None:
    """Why `path` cannot be a file torch.save wrote (a zip archive, or a pickle in the legacy format), or None:
    for a load that failed, so the error says "not a torch file" rather than what torch guessed."""
    try:
        with open(path, "rb") as file:
            head = file.read(4)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if head == b"PK\x03\x04" or head[:1] == b"\x80":
        return None
    return "not a file torch.save wrote (neither a zip archive nor a pickle)"


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: set it straight back
    os.umask(mask)
    return mask


def writer_tag() -> str:
    """Who writes a temporary file: host and pid, in its name, so that a process sharing the directory (another
    node of a job on a shared file system) removes only its own leftovers, or those of a writer known dead."""
    return f"{socket.gethostname()}.{os.getpid()}"


def atomic_write(path: Path, data: bytes, *, checksum: bool = False) -> dict[str, Any] | None:
    """Write to a temporary file beside `path`, then rename it over `path` (atomic on POSIX): a crash or a
    concurrent reader never sees a half-written file. The file gets the mode a plain open() would give it
    (0666 less the umask: 0644 under 022), not mkstemp's 0600, so others sharing the directory can read it.

    `checksum`: the bytes' checksum record (checksum_record), computed on another thread while they are
    written and fsynced (zlib's CRC releases the GIL), so that it costs the write almost nothing."""
    summing = _Summing(data) if checksum else None
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
    finally:
        record = summing.result() if summing is not None else None
    return record


CHECKSUM_ALGORITHM = "crc32"
"""zlib's CRC-32 (benchmarks/checksums.py: the fastest of the standard library's on every CPU measured, at several
times the speed of a write and fsync): it detects every burst of damage up to 32 bits and all but 1 in 2^32 of
the rest, which is what a failing disk, a cut copy or bit rot leaves. A guard against accidents, not against an
adversary (who would rewrite the checksum too)."""
CHECKSUM_SUFFIX = ".checksum"
"""A weights file's checksum record beside it: model.pt.checksum (JSON)."""
_CHUNK = 16 << 20


def checksum_record(data: bytes | memoryview) -> dict[str, Any]:
    return {"algorithm": CHECKSUM_ALGORITHM, "value": f"{zlib.crc32(data):08x}", "bytes": len(data)}


class _Summing:
    """checksum_record(data) on a thread of its own."""

    def __init__(self, data: bytes | memoryview) -> None:
        self._record: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, args=(data,), name="ddp-amp-checksum", daemon=True)
        self._thread.start()

    def _run(self, data: bytes | memoryview) -> None:
        self._record = checksum_record(data)

    def result(self) -> dict[str, Any] | None:
        self._thread.join()
        return self._record


def file_checksum(path: Path) -> dict[str, Any]:
    """The checksum record of a file's bytes, read in chunks (never the whole file in memory at once)."""
    crc, size = 0, 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while read := f.readinto(buffer):
            crc = zlib.crc32(view[:read], crc)
            size += read
    return {"algorithm": CHECKSUM_ALGORITHM, "value": f"{crc:08x}", "bytes": size}


def checksum_mismatch(path: Path, recorded: dict[str, Any]) -> str | None:
    """What about the file at `path` differs from its `recorded` checksum record, in words; None when it matches
    (or when the record is of an algorithm this version does not know: nothing can be said)."""
    if recorded.get("algorithm") != CHECKSUM_ALGORITHM:
        return None
    try:
        found = file_checksum(path)
    except OSError as exc:  # a failing disk's EIO is what checksums are for: the file is not what was written
        return f"unreadable ({exc.strerror or type(exc).__name__})"
    if found["bytes"] != recorded.get("bytes"):
        return f"{found['bytes']} bytes, {recorded.get('bytes')} recorded"
    if found["value"] != recorded.get("value"):
        return f"its {CHECKSUM_ALGORITHM} is {found['value']}, {recorded.get('value')} recorded"
    return None


def checksum_file_of(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def write_checksum(path: Path, record: dict[str, Any]) -> None:
    """`path`'s checksum record beside it (after `path` itself is in place)."""
    atomic_write(checksum_file_of(path), (json.dumps(record, sort_keys=True) + "\n").encode())


UNREADABLE_RECORD: dict[str, Any] = {"algorithm": "unreadable"}
"""What recorded_checksum gives for a record that is there and does not parse: damaged itself (it is written
atomically, so a kill never leaves it half written)."""


def read_checksum_record(record_file: Path, key: str | None = None) -> dict[str, Any] | None:
    """A checksum record from the JSON file `record_file` (itself, or its `key`: a checkpoint's sidecar holds it
    under "checksum"); None where there is none (no such file, or no such key: written before checksums);
    UNREADABLE_RECORD where the file is there and does not parse as one (written atomically, it is damaged)."""
    try:
        held = json.loads(record_file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return UNREADABLE_RECORD
    if key is not None:
        if not isinstance(held, dict):
            return UNREADABLE_RECORD
        held = held.get(key)
        if held is None:
            return None
    return held if isinstance(held, dict) else UNREADABLE_RECORD


def recorded_checksum(path: Path) -> dict[str, Any] | None:
    """The checksum record written beside the weights file `path` (read_checksum_record's answers)."""
    return read_checksum_record(checksum_file_of(path))


def damage_of(path: Path, record_file: Path | None = None, key: str | None = None) -> str | None:
    """Why the file at `path` is damaged (its bytes do not match the checksum recorded for it, or the record is
    unreadable), in words naming it; None when it matches or no checksum was recorded. The record: in
    `record_file` (under `key`), by default a weights file's own beside it (model.pt.checksum)."""
    if not path.is_file():  # a directory has no record beside it (and `.` has no name to put one beside)
        return None
    record_file = record_file or checksum_file_of(path)
    recorded = read_checksum_record(record_file, key)
    if recorded is None:
        return None
    if recorded is UNREADABLE_RECORD:
        return f"{path}: damaged, its {record_file.name} is unreadable"
    return f"{path}: damaged, {mismatch}" if (mismatch := checksum_mismatch(path, recorded)) else None


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
    check_parent_dir(path, flag)
    try:
        atomic_write(path, text.encode())
    except OSError as exc:
        raise UsageError(f"{flag} {str(path)!r} cannot be written: {exc.strerror}") from None


WRITTEN_BY = "written by ddp-amp"
"""The mark of a report ddp-amp writes (a --json report's `written_by`, a --plot's metadata): a later --json or
--plot replaces a file that carries it, and no other (a rerun of `bench --json out.json` just works; a model.pt
or a user's figure given by mistake is refused)."""
MARK_SCAN_BYTES = 16 << 20
"""How much of an existing file is searched for the mark: reports are far smaller."""
PLOT_FORMATS = {".png": "Software", ".pdf": "Creator", ".svg": "Creator"}
"""--plot's formats, by suffix, and the metadata key that carries the mark in each."""


def check_parent_dir(path: Path, flag: str) -> None:
    """The directory a file `flag` names will be written in exists and can be written: one line naming `flag`."""
    from ddp_amp.errors import UsageError

    parent = path.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: directory {str(path.parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {str(path)!r}: directory {str(path.parent)!r} is not writable")


def written_by_ddp_amp(path: Path) -> bool:
    try:
        with open(path, "rb") as file:
            return WRITTEN_BY.encode() in file.read(MARK_SCAN_BYTES)
    except OSError:
        return False


def check_report_path(path: Path | None, flag: str, suffixes: tuple[str, ...] = ()) -> None:
    """Before anything runs: `path` can take the report `flag` writes (its suffix one of `suffixes` where given;
    not a directory; in a writable directory; new, or a report ddp-amp wrote). One line naming `flag` if not."""
    from ddp_amp.errors import UsageError

    if path is None:
        return
    where, given = f"{flag} {str(path)!r}", path
    path = through_link(path)  # the file written: its suffix chooses the format
    if suffixes and path.suffix.lower() not in suffixes:
        links = f" (it links to {str(path)!r})" if path != given else ""
        raise UsageError(f"{where}{links}: the suffix chooses the format: {', '.join(suffixes)}")
    if path.is_dir():
        raise UsageError(f"{where} is a directory; name a file")
    check_parent_dir(path, flag)
    if path.exists() and not written_by_ddp_amp(path):
        raise UsageError(f"{where} already exists and is not a report ddp-amp wrote; remove it or choose another "
                         "name")


def through_link(path: Path) -> Path:
    """Where a report named by a symbolic link goes: where the link points (dangling or not), as a shell's `>`
    writes it. Renamed over the link, it would replace the link, a file the user made, with ours."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def write_report(path: Path, flag: str, write: Any) -> None:
    """`write(temporary_path)` then the temporary file renamed over `path`: a failed write leaves no half file
    and the earlier report as it was. An OSError is one line naming `flag`."""
    from ddp_amp.errors import UsageError

    path = through_link(path)
    temporary = path.with_name(f".{path.name}.{writer_tag()}.tmp")
    try:
        write(temporary)
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise UsageError(f"{flag} {str(path)!r} cannot be written: {exc.strerror or exc}") from None
