"""The run directory, before a launch: checked, created, locked, an earlier run's files cleared under
--overwrite, and an elastic job's directory recognised by a node that joins it later."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ddp_amp.config import CONFIG_FILE
from ddp_amp.errors import UsageError
from ddp_amp.files import DirectoryInUse, DirectoryLock, remove_partial_writes
from ddp_amp.outputs import (
    BEST_MODEL_FILE,
    METRICS_FILE,
    MODEL_FILE,
    PRETRAINED_DIR,
    STEP_TIMES_FILE,
    SUMMARY_FILE,
)


@dataclass
class PreparedRunDir:
    path: Path
    lock: DirectoryLock | None
    """Held by the launcher for the whole launch: a second launch into the same directory is refused."""


EARLIER_RUN_FILES = (MODEL_FILE, METRICS_FILE, SUMMARY_FILE, STEP_TIMES_FILE, BEST_MODEL_FILE)
# checkpoint.fileformat, rank.reporter, profiling, the pretrained format
EARLIER_RUN_DIRS = ("checkpoints", "tensorboard", "profile", PRETRAINED_DIR)


def clear_earlier_run(path: Path) -> None:
    """--overwrite: everything an earlier run left is gone before this one writes anything. Its checkpoints
    above all: a longer run's higher steps would outrank this run's in pruning and in --resume auto."""
    import shutil

    for name in EARLIER_RUN_FILES:
        (path / name).unlink(missing_ok=True)
    for name in EARLIER_RUN_DIRS:
        if (path / name).is_dir():
            shutil.rmtree(path / name)


def restart_choice(path: Path) -> str | None:
    """How a job that its scheduler restarts (a requeued Slurm job, a pod recreated by its controller) takes up its
    own run dir: "resume" from the newest checkpoint where there is one; "overwrite" an unfinished attempt that
    left none; None for a new or a finished run (whose model.pt is never overwritten: that is refused)."""
    if has_checkpoint(path):
        return "resume"
    if (path / METRICS_FILE).exists() and not (path / MODEL_FILE).exists():
        return "overwrite"
    return None


def has_checkpoint(path: Path) -> bool:
    """A checkpoint in the run dir: a step-<N>.pt, or a sharded step-<N>/ that DCP finished (its .metadata)."""
    return any(found.suffix == ".pt" or (found / ".metadata").is_file()
               for found in (path / "checkpoints").glob("step-*"))


def running_job(path: Path) -> str | None:
    """The job id of the elastic multinode job whose config.json is in `path`, if any."""
    try:
        written = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    return written.get("job_id") if isinstance(written, dict) and written.get("elastic") else None


def prepare_run_dir(run_dir: str | Path, *, overwrite: bool, unique: bool = False,
                    lock: bool = True, resuming: bool = False, joining: str | None = None) -> PreparedRunDir:
    """Check `--run-dir` before launch, create it and lock it. Refuses to clobber a file, an earlier run's
    weights or metrics, or a directory another launch is using; removes temporary files a killed write left.

    unique: the directory must be new; if the name is taken (two runs started in the same second), a -2, -3…
    suffix is added. The check and the creation are one mkdir, so concurrent launches cannot share it.
    lock: False for multinode, whose nodes may legitimately share one directory on a shared file system.
    resuming: an unfinished run's metrics are expected (the resumed run cuts them back to its checkpoint).
    joining: an elastic multinode job's id: when the directory is that job's (a node joining it later, on a
    shared file system), nothing is refused and nothing of the running job's is touched.
    """
    path = Path(run_dir)
    flag = f"--run-dir {str(path)!r}"
    if unique:
        base, n = path, 1
        while True:
            try:
                path.mkdir(parents=True)
                break
            except FileExistsError:
                n += 1
                path = base.with_name(f"{base.name}-{n}")
            except OSError as exc:
                raise UsageError(f"{flag} cannot be created: {exc.strerror}") from None
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} is an existing file, not a directory")
    if joining is not None and path.is_dir() and running_job(path) == joining:
        return PreparedRunDir(path, None)
    if (path / MODEL_FILE).exists() and not overwrite:
        raise UsageError(f"{flag} already holds a finished run (model.pt); choose another or pass --overwrite")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} cannot be created: {exc.strerror}") from None
    held = None
    if lock:
        try:
            held = DirectoryLock(path)
        except DirectoryInUse as busy:
            raise UsageError(f"{flag} is in use by another ddp-amp launch (pid {busy.pid}); wait for it to end "
                             "or choose another directory") from None
        except OSError as exc:
            raise UsageError(f"{flag} is not writable: {exc.strerror}") from None
    if not overwrite and not resuming and any((path / name).exists() for name in (METRICS_FILE, SUMMARY_FILE)):
        if held:
            held.release()
        raise UsageError(f"{flag} holds an unfinished earlier run (metrics, no model.pt); pass --overwrite to "
                         "start over in it, or choose another directory")
    try:
        remove_partial_writes(path)
        if (path / "checkpoints").is_dir():
            remove_partial_writes(path / "checkpoints")
        if overwrite:
            clear_earlier_run(path)
        elif resuming:
            (path / SUMMARY_FILE).unlink(missing_ok=True)  # the stopped attempt's; this run writes its own
    except OSError as exc:
        raise UsageError(f"{flag} is not writable: {exc.strerror}") from None
    return PreparedRunDir(path, held)
