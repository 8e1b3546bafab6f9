"""The per-rank entry of every launcher: standard environment + run config in, trained model and files out.

spawn calls `run_worker(config)` in each child; torchrun runs `python -m ddp_amp.worker RUN_DIR/config.json`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import random
import resource
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddp_amp import checkpoint
from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv, process_group, resolve_device, set_cpu_threads, settle_run_dir_writers
from ddp_amp.errors import RankSetupError
from ddp_amp.precision import Precision, cpu_has_native_bf16, cuda_has_native_bf16, resolve_precision
from ddp_amp.process import die_with_parent
from ddp_amp.progress.channel import ADDRESS_VAR, EventSender
from ddp_amp.progress.events import plain_line
from ddp_amp.progress.session import LOG_DIR_VAR
from ddp_amp.tasks import Task, build_task
from ddp_amp.train import PHASES, Trainer


class WorkerReporter:
    """Sends this rank's progress events to the launcher and, on each node's local rank 0, appends the
    (already all-reduced) metrics to metrics.jsonl. Without a launcher listening (a hand-written torchrun
    command), rank 0 prints plain lines instead."""

    def __init__(self, env: DistEnv, run_dir: Path, sender: EventSender | None) -> None:
        self.env, self.run_dir, self.sender = env, run_dir, sender
        self.item_name = "samples"
        self.items_per_sample = 1
        self.last_loss: float | None = None
        self.scalars: TensorBoardScalars | None = None
        """Set on global rank 0 with --tensorboard."""

    def _send(self, event: dict[str, Any]) -> None:
        event = {"rank": self.env.rank, **event}
        if self.sender is not None:
            self.sender.send(event)
        elif self.env.rank == 0 and (line := plain_line(event)):
            print(line, flush=True)

    def state(self, status: str, **extra: Any) -> None:
        self._send({"type": "state", "status": status, "local_rank": self.env.local_rank,
                    "node": int(os.environ.get("GROUP_RANK", "0")), "world_size": self.env.world_size, **extra})

    def on_log(self, record: dict[str, Any]) -> None:
        if self.env.writes_run_dir:
            checkpoint.append_metrics(self.run_dir, {k: v for k, v in record.items() if not k.startswith("rank_")})
        if self.scalars is not None:
            self.scalars.write(record, self.item_name)
        self.last_loss = record["rank_loss"]
        event = {"type": "log", "step": record["step"], "total_steps": record["total_steps"],
                 "epoch": record["epoch"], "loss": record["rank_loss"], "global_loss": record["loss"],
                 "lr": record["lr"], "samples_per_s": record["rank_samples_per_s"],
                 "global_samples_per_s": record["samples_per_s"], "skipped_steps": record["skipped_steps"],
                 "item_name": self.item_name}
        if self.item_name != "samples":
            event["items_per_s"] = record["rank_samples_per_s"] * self.items_per_sample
            event["global_items_per_s"] = record["samples_per_s"] * self.items_per_sample
        if "loss_scale" in record:
            event["loss_scale"] = record["loss_scale"]
        if record.get("grad_norm") is not None and math.isfinite(record["grad_norm"]):
            event["grad_norm"] = record["grad_norm"]
        self._send(event)

    def done(self, summary: dict[str, Any], peak_memory_mb: float) -> None:
        event = {"type": "done", "steps": summary["steps"], "samples_per_s": summary["rank_samples_per_s"],
                 "peak_memory_mb": peak_memory_mb, "final_loss": self.last_loss,
                 "stopped": "stopped_at_step" in summary}
        if self.env.writes_run_dir:
            event["summary"] = summary
        self._send(event)

    def heartbeat(self, **position: Any) -> None:
        self._send({"type": "heartbeat", **position})

    def error(self, text: str) -> None:
        self._send({"type": "error", "traceback": text, "time": time.time()})


class TensorBoardScalars:
    """--tensorboard: the metrics of each log interval as TensorBoard scalars under RUN_DIR/tensorboard."""

    TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "loss_scale": "amp/loss_scale",
            "skipped_steps": "amp/skipped_steps", "samples_per_s": "throughput/samples_per_s"}

    def __init__(self, run_dir: Path) -> None:
        self.directory = run_dir / "tensorboard"
        self.writer = None

    def write(self, record: dict[str, Any], item_name: str) -> None:
        step = record["step"]
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run's events replace the earlier attempt's from its first logged step on.
            self.writer = SummaryWriter(str(self.directory), purge_step=step)
        for key, tag in self.TAGS.items():
            value = record.get(key)
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        if item_name != "samples" and f"{item_name}_per_s" in record:
            self.writer.add_scalar(f"throughput/{item_name}_per_s", record[f"{item_name}_per_s"], step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def redirect_output(rank: int) -> None:
    """Send this rank's own stdout/stderr to RUN_DIR/logs/rank<N>.log while a launcher renders progress:
    a stray print or warning must not garble the live display (failures still arrive as events)."""
    log_dir = os.environ.get(LOG_DIR_VAR)
    if not log_dir:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(Path(log_dir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run_worker(config: TrainConfig) -> dict[str, Any] | None:
    """Train on this rank. Local rank 0 writes the run directory and returns the summary; others return None."""
    started = time.time()
    die_with_parent()
    env = DistEnv.from_environ()
    redirect_output(env.rank)
    sender = EventSender.from_environ()
    reporter = WorkerReporter(env, Path(config.run_dir), sender)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    stop_on_signals()  # before the launcher learns our pid: its SIGUSR1 must never find the default action
    # The pid lets the launcher ask this rank to stop gracefully (SIGUSR1), under torchrun too.
    reporter.state("restarting" if restart else "starting", restart=restart, pid=os.getpid())
    try:
        return _train(config, env, reporter, started, restart)
    except RankSetupError as exc:
        reporter.error(str(exc))
        raise
    except Exception:
        reporter.error(traceback.format_exc())
        raise
    finally:
        if reporter.scalars is not None:
            reporter.scalars.close()
        if sender is not None:
            sender.close()


def _train(config: TrainConfig, env: DistEnv, reporter: WorkerReporter, started: float,
           restarts: int) -> dict[str, Any] | None:
    device = resolve_device(config.device, env.local_rank)
    if device.type == "cuda" and config.tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = config.tf32 == "on"
        torch.backends.cudnn.allow_tf32 = config.tf32 == "on"
    threads = set_cpu_threads(env.local_world_size) if device.type == "cpu" else torch.get_num_threads()
    run_dir = Path(config.run_dir)
    if device.type == "cuda":
        nccl_watchdog_environment(run_dir)
    with process_group(env, device, timeout_s=config.timeout):
        env = reporter.env = settle_run_dir_writers(env, run_dir)
        if config.tensorboard and env.rank == 0:
            reporter.scalars = TensorBoardScalars(run_dir)
        precision = agreed_precision(config, device)
        torch.manual_seed(config.seed)  # identical initial weights on every rank, run after run
        task = build_task(config.task)
        check_task_contract(task, config.task)
        if env.writes_run_dir:
            check_room_for_weights(run_dir, task.model)
        # The randomness of training itself (dropout, augmentation) differs between ranks, or every rank would
        # draw the same masks and waste data parallelism; it is still fixed by the seed and the rank.
        seed_rank_randomness(config.seed + env.rank)
        reporter.item_name, reporter.items_per_sample = task.item_name, task.items_per_sample
        trainer = Trainer(config, env, device, precision, task, reporter)
        trainer.stop_requested = lambda: STOP_REQUEST.signum is not None
        resumed = resume(trainer, config, env, run_dir, device, restarted=restarts > 0)
        checkpointer = RunCheckpointer(config, env, run_dir, device) if config.checkpoint_every else None
        trainer.checkpointer = checkpointer
        reporter.state("running")
        with Heartbeat(reporter, trainer, stall_after_s(config.timeout)):
            result = trainer.train()
        summary = result.summary
        if checkpointer is not None:
            if trainer.stopped_at is not None and not checkpointer.saved(trainer.stopped_at):
                checkpointer.save(trainer, trainer.stopped_at)  # keep the work: a checkpoint at the stop
            checkpointer.close()  # waits for the write in flight
            if checkpointer.last_path is not None:
                summary["checkpoint"] = str(checkpointer.last_path)
        trainer.close()  # on success only: after a failure the launcher stops every rank anyway
        summary["restarts"] = restarts
        if resumed is not None:
            summary["resumed_from"] = resumed  # the checkpoint's path; its step is resumed_from_step
        if trainer.stopped_at is not None:
            summary["stopped_by"] = STOP_REQUEST.name
        rank_times = None
        if config.record_step_times:
            rank_times = [None] * env.world_size
            dist.all_gather_object(rank_times, {"rank": env.rank, "step_s": result.step_s,
                                                "peak_memory_mb": peak_memory_mb(device)})
        summary["threads_per_rank"] = threads
        summary["worker_start_s"] = started - (config.launch_time or started)
        summary["tf32"] = config.tf32
        if env.writes_run_dir:
            reporter.state("checkpointing")
            # The weights and the summary first: an evaluation that fails must not cost the trained model.
            # A diverged run's weights are NaN or untrained, a stopped run's unfinished: neither is saved as
            # model.pt, which marks a finished run.
            finished = "diverged" not in summary and "stopped_at_step" not in summary
            if finished:
                summary["model_path"] = str(checkpoint.save_weights(run_dir, result.model))
            summary["summary_path"] = str(run_dir / checkpoint.SUMMARY_FILE)
            if rank_times is not None:
                checkpoint.write_json(run_dir / checkpoint.STEP_TIMES_FILE, rank_times)
            checkpoint.write_summary(run_dir, summary)
            if task.evaluate is not None and finished:
                evaluate_into(summary, task, config.task, result.model, device)
                checkpoint.write_summary(run_dir, summary)
        reporter.done(summary, peak_memory_mb(device))
        return summary if env.writes_run_dir else None


def check_task_contract(task: Task, spec: str) -> None:
    """The first item of the data set, checked against the Task contract on every rank: a wrong shape would
    otherwise surface as a misleading error from deep inside the model."""
    dataset = task.dataset
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise RankSetupError(f"--task {spec}: the dataset must be map-style (__len__ and __getitem__), got "
                             f"{type(dataset).__name__}")
    if len(dataset) == 0:
        raise RankSetupError(f"--task {spec}: the dataset is empty")
    item = dataset[0]
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return
    if isinstance(item, Mapping):
        shape = f"a {type(item).__name__} with keys {sorted(map(str, item))}"
    elif isinstance(item, (tuple, list)):
        shape = f"a {type(item).__name__} of {len(item)} elements"
    elif isinstance(item, torch.Tensor):
        shape = f"a single tensor of shape {tuple(item.shape)}"
    else:
        shape = f"a {type(item).__name__}"
    raise RankSetupError(f"--task {spec}: dataset items must be (inputs, target) pairs, but item 0 is {shape}; "
                         "return a pair from __getitem__ (inputs may themselves be a dict or a tuple)")


def check_room_for_weights(run_dir: Path, model: torch.nn.Module) -> None:
    """Before training: the run dir's file system must hold model.pt, or the trained work would be lost at
    the very end (the write fails, the weights exist nowhere else)."""
    need = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + WEIGHTS_OVERHEAD
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise RankSetupError(f"--run-dir {run_dir}: {free / 2**20:.1f} MiB free, but model.pt needs "
                             f"{need / 2**20:.1f} MiB; free some space or choose another --run-dir")


WEIGHTS_OVERHEAD = 1 << 20  # torch.save's framing, summary.json and metrics.jsonl, generously
HEARTBEAT_S = 1.0


class StopRequest:
    """The first stop signal this rank received (SIGUSR1 from its launcher or a scheduler, SIGINT from a
    terminal). The training loop reads it at log intervals, where all ranks agree to stop at the same step."""

    signum: int | None = None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None


STOP_REQUEST = StopRequest()
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGINT)


def stop_on_signals() -> None:
    def handler(signum: int, frame: object) -> None:
        if STOP_REQUEST.signum is None:
            STOP_REQUEST.signum = signum

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


class RunCheckpointer:
    """Checkpoints every --checkpoint-every steps: every rank's RNG state is gathered, the writer copies the
    state to host memory and a background thread writes it (atomically), so training waits for the copy only."""

    def __init__(self, config: TrainConfig, env: DistEnv, run_dir: Path, device: torch.device) -> None:
        self.config, self.env, self.run_dir, self.device = config, env, run_dir, device
        self.last_path: Path | None = None
        self.last_step: int | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def due(self, step: int) -> bool:
        return step % self.config.checkpoint_every == 0

    def saved(self, step: int) -> bool:
        return self.last_step == step

    def save(self, trainer: Trainer, step: int) -> None:
        rng = [None] * self.env.world_size
        dist.all_gather_object(rng, checkpoint.rng_state(self.device))  # a collective: every rank, every time
        self.last_step = step
        if not self.env.writes_run_dir:
            return
        self._wait()
        state = {"step": step, "trainer": _to_host(trainer.state_dict()), "rng": rng,
                 "config": dataclasses.asdict(self.config), "world_size": self.env.world_size}
        self.last_path = checkpoint.checkpoint_dir(self.run_dir) / f"step-{step}.pt"
        self._thread = threading.Thread(target=self._write, args=(state,), name="ddp-amp-checkpoint")
        self._thread.start()

    def _write(self, state: dict[str, Any]) -> None:
        try:
            checkpoint.save_checkpoint(self.run_dir, state, keep=self.config.keep)
        except BaseException as exc:  # re-raised in the training thread, at the next save or at close
            self._error = exc

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self._wait()


def _to_host(value: Any) -> Any:
    """A copy in host memory: training goes on changing the originals while the copy is written."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_host(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(item) for item in value)
    return value


def resume(trainer: Trainer, config: TrainConfig, env: DistEnv, run_dir: Path, device: torch.device, *,
           restarted: bool) -> str | None:
    """Continue from the newest checkpoint this launch wrote (after torchrun restarted the workers, for a
    failure or because an elastic job's membership changed: torchrun does not count the latter as a restart),
    else from config.resume. Every rank ends up with the same state: the ranks agree on the newest checkpoint
    any of them can read, and ranks that cannot read it (a node that joined later, without a shared file
    system) receive it from one that can. Returns the checkpoint's path when it resumed."""
    found = _checkpoint_to_continue(config, run_dir)
    views = [None] * env.world_size
    dist.all_gather_object(views, found[1]["step"] if found else None)
    steps = [step for step in views if step is not None]
    if not steps:
        if restarted and env.writes_run_dir:
            # Restarted from the beginning: the earlier attempt's log lines no longer apply.
            (run_dir / checkpoint.METRICS_FILE).unlink(missing_ok=True)
        return None
    newest = max(steps)
    if any(step != newest for step in views):
        source = views.index(newest)
        shipped = [found if env.rank == source else None]
        dist.broadcast_object_list(shipped, src=source)
        found = shipped[0]
    path, state = found
    differ = checkpoint.mismatches(state["config"], state["world_size"], dataclasses.asdict(config),
                                   None if config.elastic else env.world_size)
    if differ:
        raise RankSetupError(f"--resume {path}: this run differs from the checkpoint's: {'; '.join(differ)}")
    trainer.load_state_dict(state["trainer"], state["step"], saved_world_size=state["world_size"])
    if env.rank < len(state["rng"]):  # an elastic job that grew: the new ranks keep their seeded streams
        checkpoint.set_rng_state(state["rng"][env.rank], device)
    if env.writes_run_dir:
        checkpoint.cut_metrics(run_dir, state["step"])
    return str(path)


def _checkpoint_to_continue(config: TrainConfig, run_dir: Path) -> tuple[Path, dict] | None:
    """This rank's own view: (path, state) of the checkpoint it would continue from, or None.

    Only this launch's checkpoints count (launch_time tells them apart), restart or not: the run dir may still
    hold an earlier run's (the one --resume continues, or one --overwrite replaced), which a restarted group
    must never pick up as its own. Before this launch wrote one, a restart continues from --resume, if given."""
    found = checkpoint.newest_valid_checkpoint(
        run_dir, warn=lambda line: print(f"warning: {line}"),
        accept=lambda state: state["config"].get("launch_time") == config.launch_time)
    if found is not None or config.resume is None:
        return found
    path = Path(config.resume)
    try:
        return path, checkpoint.load_checkpoint(path)
    except checkpoint.CheckpointError as exc:
        if config.elastic:
            return None  # a node without the file: it receives the state from a rank that has it
        raise RankSetupError(f"--resume {exc}") from None


def stall_after_s(timeout_s: float) -> float:
    """How long no rank's loop may stand still before the launcher calls the furthest-behind one stalled:
    a quarter of the collective timeout (so it is named well before the timeout fails the run), 2 s to 60 s."""
    return min(60.0, max(2.0, timeout_s / 4))


class Heartbeat:
    """A thread telling the launcher, every second, where this rank's training loop is (Trainer.position).

    A loop that stands still while its heartbeat goes on is stuck: in a hung user function, or in a collective
    waiting for a rank that is. The launcher compares the ranks' positions to tell which (see ProgressModel).
    """

    def __init__(self, reporter: WorkerReporter, trainer: Trainer, stall_after: float) -> None:
        self.reporter, self.trainer, self.stall_after = reporter, trainer, stall_after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ddp-amp-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            step, micro, phase = self.trainer.position
            self.reporter.heartbeat(step=step, micro=micro, phase_index=phase, phase=PHASES[phase],
                                    stall_after_s=self.stall_after)

    def __enter__(self) -> Heartbeat:
        if self.reporter.sender is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def nccl_watchdog_environment(run_dir: Path) -> None:
    """What torch offers for hangs on NCCL, unless the user chose otherwise: fail a timed-out collective
    instead of hanging, and have the flight recorder dump every rank's last collectives into the run dir."""
    for key, value in {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                       "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                       "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(run_dir.resolve() / "nccl_trace_rank_")}.items():
        os.environ.setdefault(key, value)


def agreed_precision(config: TrainConfig, device: torch.device) -> Precision:
    """The precision every rank uses, decided from each rank's own device and agreed on by all of them.

    bf16 counts only where it is native (a GPU of compute capability 8.0 or newer): with --amp auto a job
    whose GPUs are mixed trains in fp16 everywhere, since ranks in one DDP job must step the same way.
    """
    if device.type == "cuda":
        native = cuda_has_native_bf16(torch.cuda.get_device_capability(device))
    else:
        native = cpu_has_native_bf16()
    flag = torch.tensor([1.0 if native else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # once, at start-up
    native_everywhere = bool(flag.item())
    return resolve_precision(device.type, config.amp, config.dtype, cuda_bf16=native_everywhere,
                             cpu_native_bf16=native_everywhere if device.type == "cpu" else None)


def seed_rank_randomness(seed: int) -> None:
    torch.manual_seed(seed)  # CPU and every CUDA device
    random.seed(seed)
    np.random.seed(seed % 2**32)


def evaluate_into(summary: dict[str, Any], task: Task, task_name: str, model: torch.nn.Module,
                  device: torch.device) -> None:
    """Run the task's evaluation on the trained model (on its device) and record its result, or its error
    under `eval_error` (the launcher then exits 1 with that one line; the traceback goes to this rank's log)."""
    model.eval()
    try:
        if _takes_device(task.evaluate):
            summary["eval"] = task.evaluate(model, device)
        else:
            summary["eval"] = task.evaluate(model)  # the one-argument contract of earlier versions
    except Exception as exc:  # a user's evaluate: whatever it raises, the trained weights are kept
        traceback.print_exc()
        summary["eval_error"] = f"task {task_name}: evaluate failed: {type(exc).__name__}: {exc}"


def _takes_device(evaluate: Any) -> bool:
    try:
        parameters = inspect.signature(evaluate).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def main(argv: list[str] | None = None) -> None:
    """`python -m ddp_amp.worker CONFIG_JSON`: the entry torchrun starts on every rank."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m ddp_amp.worker RUN_DIR/config.json")
    config = TrainConfig.from_json(Path(args[0]).read_text())
    summary = run_worker(config)
    failure = summary and checkpoint.failure_of(summary, config.run_dir)
    if failure and not os.environ.get(ADDRESS_VAR):
        # Started by a hand-written torchrun: no ddp-amp launcher reads the summary, so say it and fail here.
        print(f"ddp-amp: error: {failure}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # record: a failing rank's traceback goes to torchrun's error file, so its summary names the root cause.
    record(main)()
