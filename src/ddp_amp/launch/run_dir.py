"""The run directory, before a launch: checked, created, locked, an earlier run's files cleared under
--overwrite, and an elastic job's directory recognised by a node that joins it later."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_amp.config import CONFIG_FILE
from ddp_amp.errors import UsageError
from ddp_amp.files import (
    CHECKSUM_SUFFIX,
    LOCK_FILE,
    DirectoryInUse,
    DirectoryLock,
    lock_holder,
    remove_partial_writes,
)
from ddp_amp.outputs import (
    BEST_MODEL_FILE,
    DOCTOR_FILE,
    DUMP_DIR,
    LOOP_RECORD_FILE,
    METRICS_FILE,
    MODEL_FILE,
    PRETRAINED_DIR,
    STEP_TIMES_FILE,
    SUMMARY_FILE,
    TRACKERS_FILE,
    earlier_run,
    has_checkpoint,
)


@dataclass
class PreparedRunDir:
    path: Path
    lock: DirectoryLock | None
    """Held by the launcher for the whole launch: a second launch into the same directory is refused."""
    set_aside: Path | None = None
    """--overwrite: where the earlier run's files wait (clear_earlier_run, settle_earlier_run); --resume: where
    the stopped attempt's record waits (its summary.json, a loop script's loop.json)."""
    output_before: tuple = ()
    """training_output(path) once the earlier run's files were set aside: what this launch trained is the
    difference (trained_since)."""
    logs_before: dict[str, int] | None = None
    """--resume: the sizes of the earlier run's logs, which this launch appends to (cut back after a launch that
    did not train: put_back_logs)."""


EARLIER_RUN_FILES = (MODEL_FILE, METRICS_FILE, SUMMARY_FILE, STEP_TIMES_FILE, BEST_MODEL_FILE, TRACKERS_FILE,
                     LOOP_RECORD_FILE, DOCTOR_FILE, MODEL_FILE + CHECKSUM_SUFFIX, BEST_MODEL_FILE + CHECKSUM_SUFFIX)
# checkpoint.storage, rank.reporter, profiling, the pretrained format, W&B's files (rank.tracker_runs), the
# ranks' output (progress.output), their flight records (rank.flight_recorder)
EARLIER_RUN_DIRS = ("checkpoints", "tensorboard", "profile", PRETRAINED_DIR, "wandb", "logs", DUMP_DIR)

TRAINING_OUTPUT = (METRICS_FILE, MODEL_FILE, LOOP_RECORD_FILE)
"""What only a launch that trained writes (besides a checkpoint): metrics.jsonl (a logged step), model.pt,
ddp_amp.loop's loop.json (written at finish())."""


SET_ASIDE_DIR = ".overwritten"
"""--overwrite: where the earlier run's files wait until the new run has trained (then they are deleted) or has
failed before training (then they are put back): no refusal ever costs the earlier run."""


FAILED_LAUNCH_DIR = ".failed-launch"
"""--overwrite, a launch that did not train: its own files (its summary.json, its ranks' logs) wait here, beside
the earlier run put back, until the next launch into the directory."""


def clear_earlier_run(path: Path, names: tuple[str, ...] | None = None) -> Path | None:
    """--overwrite: everything an earlier run left is out of the way before this one writes anything: its
    checkpoints above all (a longer run's higher steps would outrank this run's in pruning and in --resume auto).
    Moved, not deleted, to RUN_DIR/.overwritten (one rename each); the directory, or None if there was nothing."""
    aside = path / SET_ASIDE_DIR
    import shutil

    shutil.rmtree(path / FAILED_LAUNCH_DIR, ignore_errors=True)  # an earlier failed launch's record: superseded
    if aside.exists():  # a launch killed before it settled: its earlier run is put back unless it trained
        settle_earlier_run(path, aside, trained=wrote_training_output(path))
    moved = False
    for name in names or (*EARLIER_RUN_FILES, *EARLIER_RUN_DIRS, CONFIG_FILE, "config.toml"):
        if (path / name).exists():
            aside.mkdir(exist_ok=True)
            (path / name).rename(aside / name)
            moved = True
    return aside if moved else None


def set_aside_by_clearing(path: Path, file: str | Path) -> bool:
    """Whether `file` is among the earlier run's files that clear_earlier_run moves out of the run dir `path`."""
    try:
        inside = Path(file).resolve().relative_to(path.resolve()).parts
    except ValueError:
        return False
    return bool(inside) and inside[0] in (*EARLIER_RUN_FILES, *EARLIER_RUN_DIRS, CONFIG_FILE, "config.toml")


def put_back_logs(path: Path, before: dict[str, int]) -> None:
    """After a resumed launch that did not train: the logs it appended to cut back to their earlier sizes, the
    logs it started removed (its own record of what happened is kept in FAILED_LAUNCH_DIR)."""
    logs = path / "logs"
    kept = path / FAILED_LAUNCH_DIR / "logs"
    for log in sorted(logs.rglob("*")) if logs.is_dir() else []:
        name = str(log.relative_to(path))
        if not log.is_file() or before.get(name) == log.stat().st_size:
            continue
        (kept / log.relative_to(logs)).parent.mkdir(parents=True, exist_ok=True)
        if name in before:
            with open(log, "rb") as read:
                read.seek(before[name])
                (kept / log.relative_to(logs)).write_bytes(read.read())  # this launch's lines
            os.truncate(log, before[name])
        else:
            log.rename(kept / log.relative_to(logs))


def settle_earlier_run(path: Path, aside: Path | None, *, trained: bool) -> bool:
    """After an --overwrite launch: the earlier run's files deleted once the new run has trained, or put back
    when it failed before its first step (its record of the failure set aside in turn, in FAILED_LAUNCH_DIR);
    whether they came back."""
    import shutil

    if aside is None or not aside.exists():
        return False
    if trained:
        shutil.rmtree(aside, ignore_errors=True)
        return False
    failed = path / FAILED_LAUNCH_DIR
    shutil.rmtree(failed, ignore_errors=True)
    for item in list(aside.iterdir()):
        if (path / item.name).exists():
            failed.mkdir(exist_ok=True)
            (path / item.name).rename(failed / item.name)
        item.rename(path / item.name)
    aside.rmdir()
    return True


def training_output(path: Path) -> tuple:
    """What training has written in the run dir (TRAINING_OUTPUT's sizes and times, the checkpoints' names): a
    launch trained when this changed while it ran (trained_since)."""
    def stamp(item: Path):
        try:
            found = item.stat()
        except OSError:
            return None
        return found.st_size, found.st_mtime_ns

    checkpoints = sorted(found.name for found in (path / "checkpoints").glob("step-*")
                         if found.suffix == ".pt" or (found / ".metadata").is_file())
    return (*(stamp(path / name) for name in TRAINING_OUTPUT), tuple(checkpoints))


def trained_since(path: Path, before: tuple) -> bool:
    """Whether the launch whose run dir held `before` (training_output at its preflight) has trained: a step
    logged, a checkpoint kept, model.pt or loop.json written since."""
    return training_output(path) != before


def wrote_training_output(path: Path) -> bool:
    """Whether the run dir holds what only training writes: a checkpoint, metrics.jsonl, model.pt, loop.json.
    After an --overwrite set the earlier run's aside, whatever of these is there is this launch's."""
    return has_checkpoint(path) or any((path / name).exists() for name in TRAINING_OUTPUT)


WRITTEN_NAMES = (*EARLIER_RUN_FILES, *EARLIER_RUN_DIRS, CONFIG_FILE, "config.toml", LOCK_FILE)
"""Every name a launch writes at the top of its run dir."""


def files_not_ddp_amps(path: Path, resuming: bool = False) -> list[str]:
    """The names a launch would write (WRITTEN_NAMES) that the directory holds although it is not a run dir of
    ddp-amp's: a user's project folder given as --run-dir, a script's own config.json. ddp-amp never replaces
    them, not even under --overwrite. A run dir is known by its config.json (a launch writes it first): ddp-amp's
    names the run's launch_time and run_dir. Under --resume, checkpoints/ is what the user asked to continue from
    (checkpoints copied into a new directory): --resume checks them, and they are kept."""
    if not path.is_dir() or is_ddp_amp_config(path / CONFIG_FILE) or is_ddp_amp_config(
            path / SET_ASIDE_DIR / CONFIG_FILE):
        return []
    found = []
    for name in WRITTEN_NAMES:
        item = path / name
        if resuming and name == "checkpoints":
            continue
        if name == LOCK_FILE and item.is_file() and (item.stat().st_size == 0 or item.read_bytes().strip().isdigit()):
            continue  # a lock of ddp-amp's (empty, or its holder's pid) left by a launch killed before config.json
        if item.exists() or item.is_symlink():
            found.append(name + ("/" if item.is_dir() else ""))
    return found


def is_ddp_amp_config(path: Path) -> bool:
    try:
        written = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(written, dict) and {"launch_time", "run_dir"} <= written.keys()


def running_job(path: Path) -> str | None:
    """The job id of the elastic multinode job whose config.json is in `path`, if any."""
    written = _config_of(path)
    return written.get("job_id") if written.get("elastic") else None


def running_job_id(path: Path) -> str | None:
    """The job id of the multinode job (elastic or not) whose config.json is in `path`, if any."""
    return _config_of(path).get("job_id")


def _config_of(path: Path) -> dict:
    try:
        written = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return written if isinstance(written, dict) else {}


def prepare_run_dir(run_dir: str | Path, *, overwrite: bool, unique: bool = False, lock: bool = True,
                    resuming: bool = False, joining: str | None = None, dry_run: bool = False) -> PreparedRunDir:
    """Check `--run-dir` before launch, create it and lock it. Refuses to clobber a file, an earlier run's
    weights or metrics, or a directory another launch is using; removes temporary files a killed write left.

    unique: the directory must be new; if the name is taken (two runs started in the same second), a -2, -3…
    suffix is added. The check and the creation are one mkdir, so concurrent launches cannot share it.
    lock: False for multinode, whose nodes may legitimately share one directory on a shared file system.
    resuming: an unfinished run's metrics are expected (the resumed run cuts them back to its checkpoint).
    joining: an elastic multinode job's id: when the directory is that job's (a node joining it later, on a
    shared file system), nothing is refused and nothing of the running job's is touched.
    dry_run: checked and created as for a launch, and nothing else (dry_run_dir): no lock, nothing set aside.
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
    if foreign := files_not_ddp_amps(path, resuming):
        raise UsageError(f"{flag} holds {', '.join(foreign)}, which ddp-amp did not write (no config.json of "
                         "ddp-amp's beside them) and would replace; choose another directory")
    if (path / MODEL_FILE).exists() and not overwrite:
        raise UsageError(f"{flag} already holds a finished run (model.pt); choose another or pass --overwrite")
    if dry_run:
        return dry_run_dir(path, flag, overwrite=overwrite, resuming=resuming, lock=lock)
    _create(path, flag)
    held, locked_before = None, (path / LOCK_FILE).exists()
    if lock:
        try:
            held = DirectoryLock(path)
        except DirectoryInUse as busy:
            raise UsageError(f"{flag} is in use by another ddp-amp launch (pid {busy.pid}); wait for it to end "
                             "or choose another directory") from None
        except OSError as exc:
            raise UsageError(f"{flag} is not writable: {exc.strerror}") from None
    if not overwrite and not resuming and (earlier := earlier_run(path)):  # after the lock: "in use" comes first
        if held:
            held.release()
            if not locked_before:  # a refusal leaves nothing behind
                (path / LOCK_FILE).unlink(missing_ok=True)
        raise earlier_run_refused(flag, earlier)
    aside = _tidy(path, flag, overwrite=overwrite, resuming=resuming)
    logs = {str(log.relative_to(path)): log.stat().st_size for log in (path / "logs").rglob("*") if log.is_file()} \
        if resuming and not overwrite else None
    return PreparedRunDir(path, held, aside, training_output(path), logs)


def earlier_run_refused(flag: str, earlier: list[str]) -> UsageError:
    return UsageError(f"{flag} holds an earlier run ({', '.join(earlier)}); continue it with --resume auto, start "
                      "over in it with --overwrite, or choose another directory")


def _create(path: Path, flag: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} cannot be created: {exc.strerror}") from None


def dry_run_dir(path: Path, flag: str, *, overwrite: bool, resuming: bool, lock: bool) -> PreparedRunDir:
    """The run dir of a dry run, checked and created if new; the caller writes its config.json there."""
    check_dry_run(path, flag, overwrite=overwrite, resuming=resuming, lock=lock)
    _create(path, flag)
    return PreparedRunDir(path, None)


def check_dry_run(path: Path, flag: str, *, overwrite: bool, resuming: bool, lock: bool) -> None:
    """A dry run writes RUN_DIR/config.json, which the command it prints reads, and nothing else: the refusals of
    a launch, without taking the lock (it only looks: a launch running there is said, as it is to a launch).

    Under --overwrite or --resume, a launch first sets the earlier run aside (clear_earlier_run) and then writes
    its config.json in its place. A dry run cannot: it must leave the earlier run exactly as it was, and the
    command it prints cannot set anything aside (the launcher does, not torchrun), so run by hand it would train
    into the earlier run's files, a longer run's checkpoints outranking this one's. So it refuses, in one line:
    no command is better than one that reads the earlier run's config.json, or that mixes two runs. A config.json
    alone (another dry run's: a launch writes config.toml beside it) is replaced, as by a launch without either."""
    if not path.is_dir():
        return
    if lock and (holder := lock_holder(path)):
        raise UsageError(f"{flag} is in use by another ddp-amp launch (pid {holder}); wait for it to end or choose "
                         "another directory")
    if not overwrite and not resuming:
        if earlier := earlier_run(path):
            raise earlier_run_refused(flag, earlier)
        return
    names = (*EARLIER_RUN_FILES, *EARLIER_RUN_DIRS, CONFIG_FILE, "config.toml", SET_ASIDE_DIR) if overwrite else \
        (SUMMARY_FILE, LOOP_RECORD_FILE, CONFIG_FILE, "config.toml")
    found = [name + ("/" if (path / name).is_dir() else "") for name in names
             if (path / name).exists() and not name.endswith(CHECKSUM_SUFFIX)]
    if found and found != [CONFIG_FILE]:
        what = "an earlier run" if overwrite else "the stopped run's record"
        instead = "or dry-run into a new --run-dir" if overwrite else "which puts the record back if it does not train"
        raise UsageError(f"--dry-run: {flag} holds {what} ({', '.join(found)}), which this launch would set aside "
                         "before writing its config.json; a dry run changes nothing of an earlier run, so it cannot "
                         f"write the config.json its command reads: launch without --dry-run, {instead}")


def _tidy(path: Path, flag: str, *, overwrite: bool, resuming: bool) -> Path | None:
    """Partial writes a kill left removed; under --overwrite the earlier run set aside (where it waits)."""
    try:
        remove_partial_writes(path)
        if (path / "checkpoints").is_dir():
            remove_partial_writes(path / "checkpoints")
        if overwrite:
            return clear_earlier_run(path)
        if resuming:  # the stopped attempt's record, config and a loop script's account: this run writes its own
            return clear_earlier_run(path, names=(SUMMARY_FILE, LOOP_RECORD_FILE, CONFIG_FILE, "config.toml"))
    except OSError as exc:
        raise UsageError(f"{flag} is not writable: {exc.strerror}") from None
    return None


def with_earlier_launches(plan, record: dict[str, Any] | None = None) -> None:
    """A resumed run's summary.json (or a script's `record`, before it is written) counts the launches it took
    and their wall time in all (wall_s_all_launches), from the stopped attempt's record set aside at the
    preflight: its own wall_s is this launch's."""
    from ddp_amp.outputs import write_summary

    earlier = plan.set_aside / SUMMARY_FILE if plan.set_aside is not None and plan.config.resume else None
    current = Path(plan.config.run_dir) / SUMMARY_FILE
    try:
        before = json.loads(earlier.read_text()) if earlier is not None and earlier.is_file() else None
        now = record if record is not None else json.loads(current.read_text()) if current.is_file() else None
    except (OSError, ValueError):
        return
    if not before or not now or not isinstance(now.get("wall_s"), (int, float)):
        return
    now["launches"] = int(before.get("launches") or 1) + 1
    now["wall_s_all_launches"] = round(float(before.get("wall_s_all_launches") or before.get("wall_s") or 0.0)
                                       + now["wall_s"], 3)
    if record is None:
        try:
            write_summary(Path(plan.config.run_dir), now)
        except OSError:
            pass  # the launch's own verdict comes through; the record keeps this launch's figures


def settle_overwritten(plan, *, trained: bool | None = None) -> None:
    """--overwrite: the earlier run's files, set aside at the preflight, deleted now that this run has trained
    (logged a step, or kept a checkpoint or model.pt), or put back after a launch that failed before; --resume:
    the stopped attempt's record, the same way."""
    run_dir = Path(plan.config.run_dir)
    if trained is None:
        trained = trained_since(run_dir, plan.output_before)
    try:
        restored = settle_earlier_run(run_dir, plan.set_aside, trained=trained)
        if not trained and plan.logs_before is not None:  # after: settling clears FAILED_LAUNCH_DIR first
            put_back_logs(run_dir, plan.logs_before)
    except OSError as exc:  # said, never raised: it runs after the launch, whose own outcome must come through
        _say(f"ddp-amp: warning: the earlier run's files could not be "
            f"{'deleted' if trained else 'put back'} ({exc}); they are in {plan.set_aside}")
        return
    if restored:
        kept = run_dir / FAILED_LAUNCH_DIR
        _say(f"ddp-amp: this launch ended before it trained, so the earlier run's files in {run_dir} are "
            "back as they were" + (f"; this launch's record and logs are in {kept}" if kept.exists() else ""))


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
