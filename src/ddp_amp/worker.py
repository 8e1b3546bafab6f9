"""The per-rank entry of every launcher: standard environment + run config + job kind in, trained model and files
out.

spawn calls `run_worker(config, job)` in each child; torchrun runs `python -m ddp_amp.worker RUN_DIR/config.json
JOB`.
It only sets up and runs: each concern lives in ddp_amp.rank (setup, signals, heartbeat, evaluation, reporter),
ddp_amp.checkpoint and ddp_amp.train.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_amp import outputs
from ddp_amp.checkpoint.manager import CheckpointManager
from ddp_amp.checkpoint.weights import save_pretrained
from ddp_amp.config import JOB_KINDS, JobKind, TrainConfig
from ddp_amp.dist import DistEnv, process_group, settle_run_dir_writers
from ddp_amp.errors import RankOutOfMemory, RankSetupError, failure_kind
from ddp_amp.process import FORKSERVER_PID_VAR, children_started_as_the_platform_does, die_with_parent
from ddp_amp.progress.channel import ADDRESS_VAR, EventSender
from ddp_amp.rank import flight_recorder, setup
from ddp_amp.rank.final_evaluation import evaluate_into
from ddp_amp.rank.heartbeat import Heartbeat, stall_after_s
from ddp_amp.rank.reporter import WorkerReporter
from ddp_amp.rank.signals import STOP_REQUEST, stop_on_signals, wait_for_own_stop_signal
from ddp_amp.rank.trackers import OPEN_S, Trackers, run_params
from ddp_amp.tasks import Task
from ddp_amp.train.metrics import memory_now_mb, peak_memory
from ddp_amp.train.microbatch import is_out_of_memory
from ddp_amp.train.step import PHASES
from ddp_amp.train.trainer import Trainer, TrainResult

ELASTIC_STOP_WAIT_S = 20.0
"""How long a rank of an elastic job that stopped for another rank's signal waits for its own agent's: more
than an agent's monitor interval (--monitor-interval, 0.1 s by default) and its rendezvous state's 1 s cache."""


def run_worker(config: TrainConfig, job: JobKind = "train") -> dict[str, Any] | None:
    """Run `job` (config.JobKind) on this rank. Local rank 0 writes the run directory and returns the summary;
    others return None."""
    started = time.time()
    stop_on_signals()  # first: a stop that arrived since the fork is pending, and is taken now
    # The fork server's pid as it was at the fork (its own environment), not the parent now: a fork server that
    # died since would already be replaced by the reaper.
    forkserver = os.environ.get(FORKSERVER_PID_VAR)
    die_with_parent(parent=int(forkserver) if forkserver else None)
    children_started_as_the_platform_does()
    env = DistEnv.from_environ()
    setup.redirect_output(env.rank)
    sender = EventSender.from_environ()
    reporter = WorkerReporter(env, Path(config.run_dir), sender)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The pid lets the launcher ask this rank to stop gracefully (SIGUSR1), under torchrun too.
    reporter.state("restarting" if restart else "starting", restart=restart, pid=os.getpid())
    try:
        return _run_job(config, job, env, reporter, started, restart)
    except RankSetupError as exc:
        reporter.error(str(exc), failure_kind(exc))
        raise
    except RankOutOfMemory as exc:
        traceback.print_exc()  # the allocator's own error stays in the rank's log; the launcher shows one line
        _dump_flight_record(config, reporter, f"failed: {exc}", exc)
        reporter.error(str(exc), failure_kind(exc))
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        _dump_flight_record(config, reporter, f"failed: {type(exc).__name__}: {first}", exc)
        reporter.error(traceback.format_exc(), failure_kind(exc))
        raise
    finally:
        reporter.scalars.close()
        if sender is not None:
            sender.close()


LOOP_POSITION = "ddp_amp_loop_position"
"""The attribute an exception that left the training loop carries: where the loop was (step, micro-step, phase),
for the flight record (set by _failures_located)."""


@contextmanager
def _failures_located(trainer: Trainer) -> Iterator[None]:
    try:
        yield
    except BaseException as exc:
        if hasattr(trainer, "step"):  # not after trainer.close(), which lets the loop's parts go
            step, micro, phase = trainer.position
            setattr(exc, LOOP_POSITION, (step + 1, micro, PHASES[phase]))
        raise


def _dump_flight_record(config: TrainConfig, reporter: WorkerReporter, reason: str, exc: BaseException) -> None:
    flight_recorder.dump(Path(config.run_dir), reporter.env.rank, reason, getattr(exc, LOOP_POSITION, None))


@dataclass
class RankRun:
    """One rank's launch, set up: what every job kind starts from."""

    config: TrainConfig
    job: JobKind
    env: DistEnv
    reporter: WorkerReporter
    device: torch.device
    precision: Any
    """The precision every rank agreed on (precision.Precision); --amp auto's measurement may change it."""
    threads: int
    flushing: Any
    started: float
    restarts: int

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)


def _run_job(config: TrainConfig, job: JobKind, env: DistEnv, reporter: WorkerReporter, started: float,
             restarts: int) -> dict[str, Any] | None:
    """The process group and the precision all ranks agree on, then the job (JOBS)."""
    device, threads, flushing = setup.prepare_device(config, env.local_rank, env.local_world_size)
    run_dir = Path(config.run_dir)
    flight_recorder.enable()  # before the process group is made
    flight_recorder.forget(run_dir, env.rank)
    with process_group(env, device, timeout_s=config.timeout):
        env = reporter.env = settle_run_dir_writers(env, run_dir)
        if config.tensorboard and env.rank == 0:
            reporter.write_tensorboard()
        precision = setup.agreed_precision(config, device)
        run = RankRun(config, job, env, reporter, device, precision, threads, flushing, started, restarts)
        return JOBS[job](run)


@dataclass
class Built:
    """A trainer built and resumed where a checkpoint says, with what its summary tells of how it was built."""

    trainer: Trainer
    checkpoints: CheckpointManager
    task: Task
    baseline_mb: Any
    """The device's memory before the model existed (train.metrics.memory_now_mb)."""
    amp_probe: dict[str, Any] | None
    initial: dict[str, Any] | None
    resumed: str | None


def _built_trainer(run: RankRun) -> Built:
    config, env, reporter, device = run.config, run.env, run.reporter, run.device
    setup.import_mode_libraries(config)  # code, not training state: in the baseline
    baseline = memory_now_mb(device)  # before the model exists: the peak less it is the training state's
    task = setup.build_checked_task(config, env)
    run.precision, amp_probe = setup.measured_precision(run.precision, config, task, env, device)
    if amp_probe is not None:
        reporter.precision_chosen(run.precision)
    initial = setup.load_initial_weights(task, config)
    reporter.item_name, reporter.items_per_sample = task.item_name, task.items_per_sample
    checkpoints = CheckpointManager(config, env, run.run_dir, device)
    trainer = Trainer(config, env, device, run.precision, task, reporter, checkpoints=checkpoints,
                      time_steps=run.job == "bench", stop_signal=lambda: STOP_REQUEST.signum)
    with _failures_located(trainer):
        resumed = trainer.resume()
    if config.tracker and run.job == "train" and env.rank == 0:
        reporter.trackers = Trackers(config.tracker, run.run_dir, config.resume, project=config.tracker_project,
                                     run_name=config.tracker_run_name, tags=config.tracker_tag, warn=reporter.warn)
        reporter.trackers.start(run_params(config, world_size=env.world_size, precision=run.precision.name,
                                           device=setup.device_name(device), torch=torch.__version__),
                                wait_s=min(OPEN_S, config.timeout / 4))  # the others wait in a collective
    reporter.state("running")
    return Built(trainer, checkpoints, task, baseline, amp_probe, initial, resumed)


def _train(run: RankRun) -> dict[str, Any] | None:
    """train (spawn, run, multinode), and bench: the trainer's loop, its summary, model.pt (bench: every rank's
    step times beside it)."""
    config, env, device = run.config, run.env, run.device
    built = _built_trainer(run)
    trainer, checkpoints = built.trainer, built.checkpoints
    with _failures_located(trainer):  # the flight record of a failing rank says where its loop was
        with Heartbeat(run.reporter, trainer, stall_after_s(config.timeout), run.run_dir):
            result = trainer.train()
        memory = peak_memory(device)  # of training: before rank 0's evaluation
        summary = _finish_training(trainer, checkpoints, result, memory, bench=run.job == "bench")
        if built.amp_probe is not None:
            summary["amp_auto"] = _probe_summary(built.amp_probe, run.precision)
        summary.update(restarts=run.restarts, baseline_memory_mb=built.baseline_mb, threads_per_rank=run.threads,
                       tf32=config.tf32, flush_denormal=run.flushing,
                       worker_start_s=run.started - (config.launch_time or run.started),
                       # its step: resumed_from_step
                       **({"resumed_from": built.resumed} if built.resumed is not None else {}),
                       **({"checkpoints_skipped": checkpoints.skipped} if checkpoints.skipped else {}),
                       **({"init_from": {**built.initial, "used": built.resumed is None}}
                          if built.initial is not None else {}))
        rank_times = None
        if run.job == "bench":  # every rank's step times, for the launcher's analysis
            rank_times = [None] * env.world_size
            dist.all_gather_object(rank_times, {"rank": env.rank, "step_s": result.step_s, **memory})
        if env.writes_run_dir:
            run.reporter.state("checkpointing")
            write_results(config, summary, result, built.task, rank_times, device)
        if (sent := run.reporter.finish_trackers(summary)) is not None:  # after model.pt: its files go too
            summary["trackers"] = sent
            outputs.write_summary(run.run_dir, summary)
        run.reporter.done(summary, memory)
        _wait_for_own_agent(config, trainer)
        return summary if env.writes_run_dir else None


def _probe_summary(probe: dict[str, Any], precision) -> dict[str, Any]:
    """summary.json's amp_auto: the choice, the measured ratio and whether it came from the cache."""
    keep = ("choice", "bf16_speedup", "fp32_pass_s", "bf16_pass_s", "bf16_true_speedup", "bf16_true_pass_s",
            "probe_s", "cached", "why", "key")
    return {**{k: probe[k] for k in keep if k in probe}, "reason": precision.reason}


def _wait_for_own_agent(config: TrainConfig, trainer: Trainer) -> None:
    if config.elastic and trainer.stopped_at is not None and STOP_REQUEST.signum is None:
        # Stopped for another rank's signal. In an elastic job that is nearly always a membership change:
        # each node's agent stops its workers (SIGTERM) when it notices a newcomer, at its own monitor
        # interval, and the ranks of the first one agreed with every rank on a stop step. This rank's agent
        # has not noticed yet: a clean exit now would be, to it, the end of the job, and its node would
        # leave the job. Its SIGTERM comes within a monitor interval; a stop of another node alone never
        # sends one, and the node ends as stopped after the wait.
        wait_for_own_stop_signal(ELASTIC_STOP_WAIT_S)


def _finish_training(trainer: Trainer, checkpointer: CheckpointManager, result: TrainResult,
                     memory: dict[str, float], *, bench: bool) -> dict[str, Any]:
    """After the loop: the stop checkpoint, the writes in flight waited for, the trainer closed; the summary."""
    numerics = trainer.probe_numerics() if bench else {}
    checkpointer.save_at_stop(trainer.parts, trainer.stopped_at)
    checkpointer.close()  # waits for the write in flight
    if outputs.RunRecord(result.summary).finished:
        result.model = trainer.plain_model()  # every rank (a sharded model's weights are gathered): model.pt
    trainer.close()  # on success only: after a failure the launcher stops every rank anyway
    summary = {**result.summary, **memory, **numerics}
    if "SLURM_RESTART_COUNT" in os.environ:  # how often Slurm requeued this job
        summary["slurm_restart_count"] = int(os.environ["SLURM_RESTART_COUNT"])
    summary.update(checkpointer.figures())
    if checkpointer.last_path is not None:
        summary["checkpoint"] = str(checkpointer.last_path)
    if checkpointer.nonfinite_steps:
        summary["nonfinite_checkpoints_skipped"] = checkpointer.nonfinite_steps
    return summary


def _doctor(run: RankRun) -> None:
    """ddp-amp doctor: the measurements instead of training, in RUN_DIR/doctor.json on every node."""
    from ddp_amp.rank.doctor import measure

    config, env, ready_at = run.config, run.env, time.time()
    figures = measure(env, run.device, run.precision, ready_at, config.launch_time or ready_at)
    if env.writes_run_dir:  # every node's run directory gets the whole job's figures
        outputs.write_json(run.run_dir / outputs.DOCTOR_FILE,
                           {**figures, "world_size": env.world_size, "backend": dist.get_backend(),
                            "precision": run.precision.name, "torch": torch.__version__,
                            "elapsed_s": time.time() - (config.launch_time or ready_at)})
    return None


def _search_max_batch(run: RankRun) -> dict[str, Any] | None:
    """bench --max-batch: the search instead of training; its result in summary.json, no model.pt."""
    config, env, reporter, device, threads = run.config, run.env, run.reporter, run.device, run.threads
    trainer = _built_trainer(run).trainer
    with Heartbeat(reporter, trainer, stall_after_s(config.timeout)), _failures_located(trainer):
        try:
            found = trainer.largest_batch()
        except Exception as exc:  # one size per launch (--shard full): a size that does not fit ends it
            if trainer.strategy.one_size_per_launch and (isinstance(exc, RankOutOfMemory) or is_out_of_memory(exc)):
                outputs.write_json(Path(config.run_dir) / outputs.OUT_OF_MEMORY_FILE.format(rank=env.rank),
                                   {"rank": env.rank, "batch_size": config.batch_size, "error": str(exc)[:500]})
            raise
    memory = peak_memory(device)
    summary = {"max_batch_search": found, "precision": trainer.precision.name, "world_size": env.world_size,
               "backend": dist.get_backend(), "threads_per_rank": threads, "steps": 0,
               "rank_samples_per_s": (found["samples_per_s"] or 0) / env.world_size, **memory}
    trainer.close()
    if env.writes_run_dir:
        outputs.write_summary(Path(config.run_dir), summary)
    reporter.done(summary, memory)
    return summary if env.writes_run_dir else None


def write_results(config: TrainConfig, summary: dict[str, Any], result: TrainResult, task: Task,
                  rank_times: list | None, device: torch.device) -> None:
    """model.pt and summary.json first: an evaluation that fails must not cost the trained model. A diverged
    run's weights are NaN or untrained, a stopped run's unfinished: neither is saved as model.pt, which marks
    a finished run."""
    run_dir = Path(config.run_dir)
    finished = outputs.RunRecord(summary).finished
    if finished:
        summary["model_path"] = str(outputs.save_weights(run_dir, result.model.state_dict()))
        # A Hugging Face model (or a task's wrapper of one, at .pretrained) also in its own format.
        if (pretrained := save_pretrained(result.model, run_dir / outputs.PRETRAINED_DIR)) is not None:
            summary["pretrained_path"] = str(pretrained)
    summary["summary_path"] = str(run_dir / outputs.SUMMARY_FILE)
    if rank_times is not None:
        outputs.write_json(run_dir / outputs.STEP_TIMES_FILE, rank_times)
    outputs.write_summary(run_dir, summary)
    if task.evaluate is not None and finished:
        evaluate_into(summary, task, config.task, result.model, device)
        outputs.write_summary(run_dir, summary)


JOBS: dict[str, Callable[[RankRun], dict[str, Any] | None]] = {
    "train": _train, "bench": _train, "max-batch": _search_max_batch, "doctor": _doctor}
"""What each job kind (config.JobKind) does once the process group and the precision are set up."""


def main(argv: list[str] | None = None) -> None:
    """`python -m ddp_amp.worker CONFIG_JSON [JOB]`: the entry torchrun starts on every rank (JOB: train by
    default, or bench, max-batch, doctor)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or (len(args) == 2 and args[1] not in JOB_KINDS):
        sys.exit(f"usage: python -m ddp_amp.worker RUN_DIR/config.json [{'|'.join(JOB_KINDS)}]")
    config = TrainConfig.from_json(Path(args[0]).read_text())
    summary = run_worker(config, *args[1:])
    failure = summary and outputs.RunRecord(summary).failure(config.run_dir)
    if failure and not os.environ.get(ADDRESS_VAR):
        # Started by a hand-written torchrun: no ddp-amp launcher reads the summary, so say it and fail here.
        print(f"ddp-amp: error: {failure}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # record: a failing rank's traceback goes to torchrun's error file, so its summary names the root cause.
    record(main)()
