"""Everything checked before a single process starts: flags, devices, precision, task, run directory.

Whatever is wrong becomes a UsageError (one line per problem, exit code 2) and nothing is launched or written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ddp_amp.config import CONFIG_FILE, TrainConfig
from ddp_amp.errors import UsageError
from ddp_amp.files import atomic_write
from ddp_amp.launch import option_checks
from ddp_amp.launch import run_dir as run_dirs
from ddp_amp.launch.devices import device_facts
from ddp_amp.launch.option_checks import check_ddp_options, check_max_memory, check_tensorboard, check_trackers
from ddp_amp.launch.run_dir import EARLIER_RUN_DIRS, EARLIER_RUN_FILES, prepare_run_dir, running_job, running_job_id
from ddp_amp.launch.task_checks import checks_of_task
from ddp_amp.precision import Precision, resolve_precision
from ddp_amp.process import StopSignal

RUNS_ROOT = Path("runs")


def changed_on_disk(run_dir: Path, *, created: bool, cleared: bool) -> str:
    """What a launch has changed on disk once its run directory is prepared: the one line of a stop that lands
    while it is still starting (before any rank trained) says it, so the user knows what is left of an earlier
    run (StopSignal.startup)."""
    if cleared:
        return f"--overwrite had already removed the earlier run's files in {run_dir}"
    if created:
        return f"{run_dir} was created, with this launch's config.json only"
    return f"{run_dir} holds this launch's config.json; nothing of an earlier run there was changed"


@contextmanager
def stops_say(changed: str) -> Iterator[None]:
    """A stop signal raised inside says `changed` (what the launch has changed on disk so far)."""
    try:
        yield
    except StopSignal as exc:
        exc.startup = changed
        raise


@dataclass(frozen=True)
class LaunchPlan:
    config: TrainConfig
    """The validated config, run_dir and launch_time filled in; also written to run_dir/config.json."""
    device_type: str
    precision: Precision
    config_path: Path
    run_dir_lock: object = None
    """The run directory's lock, held as long as this plan (the launch) lives."""
    set_aside: Path | None = None
    """--overwrite: the earlier run's files, set aside until this launch has trained (launch.run_dir); --resume:
    the stopped attempt's record."""
    output_before: tuple = ()
    """What training had written in the run dir at the preflight (launch.run_dir.training_output)."""
    logs_before: dict[str, int] | None = None
    """--resume: the earlier run's logs' sizes (launch.run_dir.put_back_logs)."""
    init: dict | None = None
    """--init-from: what of the file fits the model (loaded, missing, unexpected tensors)."""
    fields_left_out: tuple[str, ...] = ()
    """The batch fields the model's forward does not take (tasks.batches.fields_left_out): said at the start."""
    changed_on_disk: str = "nothing was written"
    """What this launch has changed on disk (changed_on_disk): a stop before any rank trained says it."""


def default_run_dir() -> Path:
    """runs/<date>_<time>; prepare_run_dir(unique=True) adds a suffix if two runs start in the same second."""
    return RUNS_ROOT / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def resolve_resume(config: TrainConfig, world_size: int | None) -> str | None:
    """--resume auto|PATH -> the checkpoint's path, after checking it loads, is finite and matches this run.
    A checkpoint of another world size is taken, with one line saying what that changes. `--resume auto` with no
    checkpoint at all is None: the run starts from the beginning, and says so (a requeue loop that always passes
    --resume auto works from its first attempt on); --resume PATH stays strict."""
    from ddp_amp.checkpoint import storage as checkpoint

    def warn(line: str) -> None:
        print(f"ddp-amp: warning: {line}", file=sys.stderr)

    if config.resume == "auto":
        directory = checkpoint.checkpoint_dir(config.run_dir)
        if not checkpoint.checkpoints(config.run_dir):
            if (Path(config.run_dir) / "model.pt").exists():
                raise UsageError(f"--resume auto: {config.run_dir} holds a finished run (model.pt) and no "
                                 "checkpoint; choose another --run-dir or pass --overwrite without --resume")
            return None  # preflight says so once the run dir is this launch's (not before a refusal)
        found = checkpoint.newest_valid_checkpoint(config.run_dir, warn=warn)
        if found is None:
            raise UsageError(f"--resume auto: no valid checkpoint in {directory} (each was skipped, above)")
        path, state = found
    else:
        path = Path(config.resume)
        try:
            state = checkpoint.load_checkpoint(path)
        except checkpoint.CheckpointError as exc:
            raise UsageError(f"--resume {exc}") from None
        if bad := checkpoint.nonfinite_tensors(state["trainer"]):
            finite = checkpoint.newest_valid_checkpoint(path.parent.parent, warn=lambda line: None)
            instead = f"; the newest finite one is {finite[0]}" if finite else "; no finite one is beside it"
            raise UsageError(f"--resume {path}: refused, it holds inf/NaN (in {bad[0].lstrip('.')}){instead}")
    differ = checkpoint.mismatches(state["config"], dataclasses.asdict(config))
    if differ:
        raise UsageError(f"--resume {path}: this run differs from the checkpoint's: {'; '.join(differ)}")
    saved = state["world_size"]
    if world_size is not None and world_size != saved:
        per_step = config.batch_size * config.grad_accum
        warn(f"--resume {path}: written by {saved} ranks, continued by {world_size}: the global batch goes from "
             f"{per_step * saved} to {per_step * world_size} samples; each remaining sample of the epoch is still "
             "trained on once" + (", and the schedule keeps its end" if config.steps is None else ""))
    return str(path.resolve())


def _resumed(config: TrainConfig, world_size: int | None, overwrite: bool) -> tuple[TrainConfig, bool]:
    """--resume resolved to its checkpoint, and whether the launch starts over: --resume auto with no checkpoint
    clears an unfinished earlier attempt's files (no checkpoint, no model.pt), as --overwrite would. Only when
    there are some: the first attempt of a multinode job in a shared run dir must not set aside another node's
    config.json. An --init-from file that either sets aside is refused: no rank could read it."""
    starting_over = False
    if config.resume is not None:
        from ddp_amp.launch.forkserver import WarmChildDied, call_warm

        try:  # reading a checkpoint takes torch: in a child of the fork server, which has it imported
            resume = call_warm(resolve_resume, config, world_size)
        except WarmChildDied:
            resume = resolve_resume(config, world_size)
        config = config.replace(resume=resume)
        starting_over = config.resume is None and any(
            (Path(config.run_dir) / name).exists() for name in (*EARLIER_RUN_FILES, *EARLIER_RUN_DIRS))
    if config.init_from and (overwrite or starting_over) and run_dirs.set_aside_by_clearing(
            Path(config.run_dir), config.init_from):
        raise UsageError(f"--init-from {config.init_from}: a file of the earlier run in {config.run_dir}, which "
                         f"{'--overwrite' if overwrite else '--resume auto (no checkpoint: it starts over)'} sets "
                         "aside before the ranks read it; copy it out of the run dir first, or give another --run-dir")
    return config, starting_over


def preflight(config: TrainConfig, *, nproc_per_node: int, flag: str = "--nproc", overwrite: bool = False,
              run_dir: str | None = None, extra: dict | None = None, lock_run_dir: bool = True,
              world_size: int | None = -1, batch_check: bool = True, dry_run: bool = False) -> LaunchPlan:
    """Validate and prepare one launch of the warm-started `config` (launch.session.warm_start). `flag` names
    the process-count option in messages; `extra` sets TrainConfig fields that are not command-line options;
    `batch_check` False: a --batch-size larger than the data set is not refused (a measuring command's trials);
    `dry_run`: config.json written and nothing else, no earlier run set aside (launch.run_dir.check_dry_run)."""
    launch_time = time.time()
    if overwrite and config.resume is not None:
        raise UsageError("--overwrite starts the run dir over and --resume continues it: pass one of them")
    config = config.replace(**(extra or {}), run_dir=str(run_dir or default_run_dir()), launch_time=launch_time)
    option_checks.check_processes(config, nproc_per_node, flag)  # --nproc and the DataLoader workers
    if world_size == -1:  # one node (spawn, run)
        world_size = nproc_per_node
    devices = device_facts(config.device, nproc_per_node)
    device_type = devices.device_type
    if device_type == "cuda" and not devices.visible:
        raise UsageError("--device cuda: no CUDA GPU is visible; use --device cpu or auto")
    if device_type == "cuda" and nproc_per_node > devices.visible:
        raise UsageError(f"{flag} {nproc_per_node} needs {nproc_per_node} GPUs but {devices.visible} "
                         f"{'is' if devices.visible == 1 else 'are'} visible with --device cuda; "
                         "lower it or use --device cpu")
    # What the ranks will decide on this node's GPUs (each rank checks its own device again, and all agree).
    precision = resolve_precision(device_type, config.amp, config.dtype, cuda_bf16=devices.cuda_bf16,
                                   cuda_fp8=devices.cuda_fp8)
    check_ddp_options(config, device_type, precision)
    check_max_memory(config, devices)
    check_tensorboard(config)
    check_trackers(config)
    # bench --max-batch tries sizes past the data set's length on purpose: its trials are not refused.
    init, left_out = checks_of_task(config, world_size if batch_check else None)
    asked_resume = config.resume
    config, starting_over = _resumed(config, world_size, overwrite)
    # Last, so that a rejected launch leaves nothing behind.
    joining = config.job_id if config.elastic else None
    joins = joining is not None and running_job(Path(config.run_dir)) == joining
    existed = Path(config.run_dir).exists()
    prepared = prepare_run_dir(config.run_dir, overwrite=overwrite or starting_over, unique=run_dir is None,
                               lock=lock_run_dir, resuming=config.resume is not None, joining=joining,
                               dry_run=dry_run)
    path = prepared.path
    if asked_resume == "auto" and config.resume is None:
        from ddp_amp.checkpoint.storage import checkpoint_dir

        print(f"ddp-amp: --resume auto: no checkpoint in {checkpoint_dir(path)}: starting from the beginning",
              file=sys.stderr)
    changed = changed_on_disk(path, created=not existed or str(path) != config.run_dir,
                              cleared=overwrite or starting_over)
    if str(path) != config.run_dir:
        config = config.replace(run_dir=str(path))
    # A node joining a running elastic job in a shared run dir keeps the job's config.json (its ranks read it
    # at every restart) and writes its own beside it.
    config_path = path / (f"config.{socket.gethostname()}.{os.getpid()}.json" if joins else CONFIG_FILE)
    option_checks.warn_of_workers(config, nproc_per_node)  # after the last refusal
    with stops_say(changed):
        _write_config(config_path, (config.to_json() + "\n").encode())
    return LaunchPlan(config=config, device_type=device_type, precision=precision, config_path=config_path,
                      run_dir_lock=prepared.lock, init=init, set_aside=prepared.set_aside,
                      output_before=prepared.output_before, logs_before=prepared.logs_before,
                      fields_left_out=left_out, changed_on_disk=changed)


def _write_config(path: Path, content: bytes) -> None:
    try:
        atomic_write(path, content)
    except OSError as exc:
        raise UsageError(f"--run-dir {str(path.parent)!r} is not writable: {exc.strerror}") from None


def _same_job_requeued(config: TrainConfig) -> bool:
    """A requeued attempt of the multinode job whose config.json is in the run dir (Slurm's SLURM_RESTART_COUNT,
    the same rendezvous id): it continues that job's run dir as --resume auto would."""
    return bool(config.job_id) and running_job_id(Path(config.run_dir)) == config.job_id and \
        int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0


def preflight_script(config: TrainConfig, script, *, nproc_per_node: int, flag: str = "--nproc",
                     overwrite: bool = False, run_dir: str | None = None, extra: dict | None = None,
                     lock_run_dir: bool = True, dry_run: bool = False) -> LaunchPlan:
    """Prepare a launch of the user's `script` (launch.script.Script, checked already): the run directory for its
    ranks' logs and the record, and config.json (the launch's options and the script). The run dir follows the
    rules of every launch (launch.run_dir): an earlier run in it needs --resume or --overwrite."""
    if nproc_per_node < 1:
        raise UsageError(f"{flag} must be >= 1, got {nproc_per_node}")
    config = config.replace(**(extra or {}), run_dir=str(run_dir or default_run_dir()), launch_time=time.time())
    devices = device_facts(config.device, nproc_per_node)
    device_type = "cuda" if devices.visible else "cpu"
    check_trackers(config)  # a script using ddp_amp.loop takes --tracker (launch.script refuses it elsewhere)
    if overwrite and config.resume is not None:
        raise UsageError("--overwrite starts the run dir over and --resume continues it: pass one of them")
    from ddp_amp.launch.script import check_script_resume

    check_script_resume(config.resume)
    existed = Path(config.run_dir).exists()
    # The same rules as for ddp-amp's own loop: an earlier run there (of a task, a script or a loop script) is
    # continued with --resume (the script resumes itself; its record is replaced) or started over with --overwrite.
    prepared = prepare_run_dir(config.run_dir, overwrite=overwrite, unique=run_dir is None, lock=lock_run_dir,
                               resuming=config.resume is not None or _same_job_requeued(config), dry_run=dry_run)
    path = prepared.path
    changed = changed_on_disk(path, created=not existed or str(path) != config.run_dir, cleared=overwrite)
    config = config.replace(run_dir=str(path))
    config_path = path / CONFIG_FILE
    record = {**json.loads(config.to_json()), "script": script.to_dict()}
    with stops_say(changed):
        _write_config(config_path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
    return LaunchPlan(config=config, device_type=device_type, precision=None, config_path=config_path,
                      run_dir_lock=prepared.lock, set_aside=prepared.set_aside, changed_on_disk=changed,
                      output_before=prepared.output_before, logs_before=prepared.logs_before)
