"""The training core shared by every launcher: DDP + autocast + GradScaler + an LR schedule, done right.

It knows nothing of the terminal or the CLI: it reports through a `Reporter` and returns the run summary.
The loop itself is short; the step, the metrics, the divergence watch and the data each live in a module of
their own beside this one (see docs/architecture.md).
"""

from __future__ import annotations

import gc
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from ddp_amp.config import TrainConfig, parse_window
from ddp_amp.dist import DistEnv
from ddp_amp.errors import RankUsageError
from ddp_amp.outputs import BEST_MODEL_FILE, METRICS_FILE, cut_metrics
from ddp_amp.parallel import strategy_for
from ddp_amp.parallel.base import on_meta_device
from ddp_amp.parallel.float8 import fp8_summary, to_float8
from ddp_amp.precision import Precision
from ddp_amp.tasks import Task
from ddp_amp.tasks.batches import loss_items_counter
from ddp_amp.train.batch_search import largest_batch, one_trial
from ddp_amp.train.best_weights import reconcile, write_best
from ddp_amp.train.data import RankData, is_iterable, loader_workers
from ddp_amp.train.divergence import DivergenceWatch
from ddp_amp.train.evaluation import BestKeeper, Validation
from ddp_amp.train.iterable_data import IterableRankData
from ddp_amp.train.loop_state import LoopState
from ddp_amp.train.metrics import MetricsProcessor, Reporter, probe_numerics
from ddp_amp.train.microbatch import MicroBatches, all_reduce_gradients
from ddp_amp.train.optim import build_optimizer, optimizer_impl, optimizer_state_mb, parameter_counts
from ddp_amp.train.parts import Restored, TrainingParts
from ddp_amp.train.profiling import StepProfiler
from ddp_amp.train.schedule import build_scheduler, run_length
from ddp_amp.train.step import LOG, AmpStep
from ddp_amp.train.stop import StopAgreement


@dataclass
class TrainResult:
    summary: dict[str, Any]
    model: torch.nn.Module
    """The trained model without its DDP wrapper."""
    step_s: list[float]
    """Each optimizer step's duration on this rank, with time_steps (else empty)."""


class Checkpointer(Protocol):
    """Saves the run's state every so many optimizer steps and continues from it (checkpoint.manager)."""

    run_dir: Path

    def due(self, step: int) -> bool: ...

    def save(self, parts: TrainingParts, step: int) -> None: ...

    def load(self, parts: TrainingParts, writers: list[int]) -> Restored | None: ...

    def take_unlogged(self) -> dict[str, Any]: ...

    def model_weights(self, step: int) -> dict[str, torch.Tensor] | None: ...


def micro_batches(config: TrainConfig) -> MicroBatches | None:
    """--micro-batch: auto starts from the whole batch."""
    if config.micro_batch is None:
        return None
    auto = config.micro_batch == "auto"
    return MicroBatches(config.batch_size if auto else int(config.micro_batch), auto)


def rank_data(task: Task, config: TrainConfig, env: DistEnv, device: torch.device) -> RankData | IterableRankData:
    """This rank's share of the training data, in batches (train.data)."""
    workers = loader_workers(config.num_workers, device, env.local_world_size)
    if is_iterable(task.dataset):
        return IterableRankData(task.dataset, env, device, batch_size=config.batch_size, workers=workers,
                                grad_accum=config.grad_accum, collate_fn=task.collate_fn, sharded=task.data_sharded,
                                epochs=config.epochs)
    return RankData(task.dataset, env, device, batch_size=config.batch_size, seed=config.seed, workers=workers,
                    collate_fn=task.collate_fn)


class Trainer:
    def __init__(self, config: TrainConfig, env: DistEnv, device: torch.device, precision: Precision, task: Task,
                 reporter: Reporter, *, checkpoints: Checkpointer | None = None, time_steps: bool = False,
                 stop_signal: Callable[[], int | None] = lambda: None) -> None:
        self.config, self.env, self.device, self.precision = config, env, device, precision
        self.time_steps = time_steps
        """Time every optimizer step, synchronising the device each step: the bench job."""
        self.task, self.reporter = task, reporter
        model = task.model
        if config.sync_batchnorm:  # batch statistics over every rank's batch (the launcher allows it on CUDA)
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if precision.fp8_recipe:  # before DDP or FSDP wraps it: the layers they see compute in fp8
            model = to_float8(model, precision.fp8_recipe)
        self.module = model if on_meta_device(model) else model.to(device)  # meta: storage after sharding
        """The model itself: its state_dict is what checkpoints and model.pt hold, compiled or not."""
        self.strategy = strategy_for(config, device, precision)
        """The parallel mode (--shard): DDP around self.module, or self.module itself sharded (parallel)."""
        self.model = self.strategy.setup_module(self.module, task.shard_units)
        self.optimizer_impl = optimizer_impl(config, precision, device.type,
                                             [p for p in self.module.parameters() if p.requires_grad])
        self.optimizer = build_optimizer(self.module, config, self.strategy, self.optimizer_impl)
        self.scaler = self.strategy.grad_scaler(precision)
        self.data = rank_data(task, config, env, device)
        self.total_steps = run_length(config, self.data.batches_per_epoch)
        self.best = BestKeeper(config.keep_best)
        self.micro = micro_batches(config)
        self.loop_state = LoopState(self.best, self.micro)
        self.parts = TrainingParts(self.strategy, self.module, self.optimizer, build_scheduler(
            self.optimizer, schedule=config.schedule, total_steps=self.total_steps, warmup_steps=config.warmup_steps,
            min_lr_ratio=config.min_lr_ratio), self.scaler, self.data, self.loop_state)
        """What a checkpoint holds (train.parts): handed to the checkpoint manager at each save and load."""
        params = [p for p in self.module.parameters() if p.requires_grad]

        def reduction() -> None:
            all_reduce_gradients(params, env.world_size, config.bucket_mb, config.grad_compression)

        self.step = AmpStep(self.model, task.loss_fn, self.optimizer, self.scaler, self.scheduler, precision,
                            device, self.strategy, grad_accum=config.grad_accum, clip_grad=config.clip_grad,
                            batch_size=config.batch_size, micro=self.micro, gradient_reduction=reduction,
                            task=config.task, every_field=task.pass_every_field,
                            count_items=loss_items_counter(task, self.module))
        self.start_step = 0
        self.checkpoints = checkpoints
        self.stop_signal = stop_signal
        """This rank's stop request (a signal's number, rank.signals), polled every step and agreed on by all
        ranks a step later (train.stop)."""
        self.stopped_at: int | None = None
        self.stopped_by: int | None = None
        self.data_ended_at: int | None = None
        """Iterable data: the step after which some rank's data ran out, where every rank stopped."""
        self.validation = (Validation(task, env, device, precision, batch_size=config.batch_size, spec=config.task,
                                      lockstep=self.strategy.lockstep_evaluation, micro=self.micro)
                           if task.val_dataset is not None else None)
        if self.validation is None and (config.eval_every or config.keep_best):
            raise RankUsageError(f"--task {config.task}: --eval-every and --keep-best need Task.val_dataset, and "
                                 "this task has none")
        self.last_validation: dict[str, float] | None = None
        self._writers: list[int] | None = None
        self.profiler = StepProfiler(parse_window(config.profile) if config.profile else None, device, env.rank,
                                     Path(config.run_dir))

    @property
    def position(self) -> tuple[int, int, int]:
        """(optimizer step, micro-step, phase) of the loop right now, for the heartbeat thread."""
        return self.step.position

    def _optimizer_state_per_rank(self) -> list[float]:
        """Each rank's optimizer state in MB (a collective, once, at the end: every rank builds its summary)."""
        shares: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(shares, optimizer_state_mb(self.optimizer))
        return shares

    def probe_numerics(self) -> dict[str, Any]:
        """train.metrics.probe_numerics on the data set's first batch: for bench, after training."""
        dataset = self.task.dataset
        batch = (self.task.collate_fn or default_collate)([dataset[i] for i in range(min(len(dataset),
                                                                                    self.config.batch_size))])
        return probe_numerics(self.module, self.task.loss_fn, batch, self.optimizer, self.precision, self.device,
                              self.task.pass_every_field)

    def largest_batch(self) -> dict[str, Any]:
        """bench --max-batch: the largest per-rank batch of this task that trains here (train.batch_search)."""
        search = one_trial if self.strategy.one_size_per_launch else largest_batch
        return search(self.step, self.task.dataset, self.device, self.env.world_size, self.config.batch_size,
                      collate_fn=self.task.collate_fn)

    @property
    def scheduler(self):  # the parts' own: replaced where a resized --epochs run re-enters its schedule
        return self.parts.scheduler

    def model_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict on the run dir's writers (None elsewhere); every rank calls it."""
        return self.strategy.model_state(self.module, self.writers)

    @property
    def writers(self) -> list[int]:
        """The ranks that write the run dir (one per node without a shared file system), on every rank."""
        if self._writers is None:
            views: list[Any] = [None] * self.env.world_size
            dist.all_gather_object(views, self.env.writes_run_dir)
            self._writers = [rank for rank, writes in enumerate(views) if writes]
        return self._writers

    def plain_model(self) -> torch.nn.Module | None:
        """The trained model as a plain module on the writers (model.pt, the model's own format, rank 0's
        evaluation), None elsewhere; every rank calls it (a sharded model's weights are gathered)."""
        return self.strategy.plain_model(self.module, self.writers)

    def resume(self) -> str | None:
        """Every rank: continue from the checkpoint the ranks agree on (checkpoint.manager), if any; returns its
        path. The metrics of the run dir are cut back to where this group continues (each step logged once, in
        order) or, on a fresh start, removed: lines there are an earlier attempt's (a restart, or a membership
        change, which torchrun does not count as one); a new run's directory has none (see prepare_run_dir)."""
        restored = self.checkpoints.load(self.parts, self.writers) if self.checkpoints is not None else None
        if restored is not None:
            self.start_step = restored.step
            if restored.world_size != self.env.world_size and self.config.steps is None:
                self._follow_progress()
            reconcile(self.best, self.checkpoints, self.env, self.device, self.reporter.warn)
        if self.checkpoints is not None and self.env.writes_run_dir:
            if restored is None:
                (self.checkpoints.run_dir / METRICS_FILE).unlink(missing_ok=True)
            else:
                cut_metrics(self.checkpoints.run_dir, self.start_step)
        return None if restored is None else str(restored.path)

    def _follow_progress(self) -> None:
        """An --epochs run resumed on another world size: its optimizer steps have another size and its
        length another count. It runs on until the data of its last epoch is used up (every sample once), and
        its schedule is the one of a run of this world size, entered where that run would stand with as many
        steps left: so it ends at the schedule's end, as an unresized run does."""
        config = self.config
        remaining = self.data.remaining_batches(config.epochs) // config.grad_accum
        self.total_steps = max(self.total_steps, remaining)
        self.start_step = self.total_steps - remaining
        for group in self.optimizer.param_groups:  # the schedule starts over from the configured peak
            group["lr"] = config.lr
            for key in ("initial_lr", "max_lr", "min_lr"):
                group.pop(key, None)
        self.parts.scheduler = self.step.scheduler = build_scheduler(
            self.optimizer, schedule=config.schedule, total_steps=self.total_steps, warmup_steps=config.warmup_steps,
            min_lr_ratio=config.min_lr_ratio)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": on purpose here
            for _ in range(self.start_step):
                self.scheduler.step()

    def train(self) -> TrainResult:
        config = self.config
        self.profiler.resumed_at(self.start_step)
        metrics = MetricsProcessor(config, self.env, self.device, self.task, self.scaler, self.profiler,
                                   self.reporter, total_steps=self.total_steps, start_step=self.start_step,
                                   time_steps=self.time_steps, micro=self.micro,
                                   phase_times=self.step.take_phase_times)
        divergence = DivergenceWatch(config.max_nonfinite, self.device)
        stop = StopAgreement(lambda: self.stop_signal())
        diverged: dict[str, Any] | None = None
        iterable = isinstance(self.data, IterableRankData)
        batches = None if iterable else self.data.batches()
        steps_done = self.start_step
        data_left = self.data.can_run(self.start_step)  # iterable data: whether every rank has a first step
        metrics.prepare_utilisation(self.precision.name)
        self.model.train()
        for step in range(self.start_step, self._loop_end(metrics, data_left)):
            number = step + 1
            self.profiler.before_step(number)
            lr = self.scheduler.get_last_lr()[0]
            log_due = number % config.log_every == 0 or number == self.total_steps
            with metrics.counting_flops():
                outcome = self.step(self.data.take() if iterable else batches, step, want_norm=log_due)
            if not outcome.stepped:
                self.loop_state.skipped_steps += 1  # GradScaler found inf/NaN gradients and skipped the update
            diverged = divergence.end_step(number, outcome.loss, outcome.stepped)
            metrics.step_done(number, outcome)
            if number < self.total_steps and not self.data.can_run(number):  # the same step on every rank
                self.data_ended_at = number
                log_due = True
            if log_due or diverged is not None:
                self.step.position = (step, config.grad_accum, LOG)
                # A tripped divergence watch rides along with the log's all-reduce: every rank learns of it at
                # the same step.
                (tripped,) = metrics.log(number, lr=lr, epoch=self.data.epoch,
                                         skipped_steps=self.loop_state.skipped_steps, grad_norm=outcome.grad_norm,
                                         flags=[divergence.tripped()],
                                         extra=self.checkpoints.take_unlogged() if self.checkpoints else None)
                if tripped and diverged is None:
                    diverged = divergence.verdict(self.env)  # where and on which rank: the same on all
            if self.validation is not None and diverged is None and (
                    number == self.total_steps or self.data_ended_at is not None
                    or (config.eval_every and number % config.eval_every == 0)):
                with metrics.paused():
                    self.evaluate(number)
            # After the log line: a checkpoint at step N always has N's line before it (a resume cuts the
            # metrics back to N and never writes that line again).
            if self.checkpoints is not None and self.checkpoints.due(number):
                self.checkpoints.save(self.parts, number)
            if (signum := stop.agreed(number)) and number < self.total_steps and self.stopped_at is None:
                self.stopped_at, self.stopped_by = number, signum  # a signal on any rank, lately
            steps_done = number
            if diverged is not None or self.stopped_at is not None or self.data_ended_at is not None:
                break  # every rank breaks here, at the same step: no rank waits in a collective alone
        if not data_left:
            self.data_ended_at = self.start_step
        stop.close()
        self.data.close()
        summary = self._summary(steps_done, metrics.summary(steps_done), diverged)
        return TrainResult(summary=summary, model=self.module, step_s=metrics.step_s)

    def _loop_end(self, metrics: MetricsProcessor, data_left: bool) -> int:
        """The step the loop runs to; first, the evaluation a stop cut short at the step this run resumes from
        (a stop in it again ends the run there)."""
        if self.validation is not None and self.start_step and self.loop_state.unevaluated == self.start_step:
            with metrics.paused():
                self.evaluate(self.start_step)
        return self.total_steps if data_left and self.stopped_at is None else self.start_step

    def evaluate(self, number: int) -> None:
        """The validation at optimizer step `number` (every rank), logged; the best so far kept as model_best.pt."""
        values, signum = self.validation.run(self.module, self.stop_signal)
        if signum:  # stopped while it evaluated: the ranks stop at this step, with its checkpoint
            self.stopped_at, self.stopped_by = number, signum
            self.loop_state.unevaluated = number
            return
        self.loop_state.unevaluated = None
        self.last_validation = values
        self.reporter.on_eval({"step": number, **values})
        if self.best.offer(number, values, last=number == self.total_steps) and \
                (state := self.model_state()) is not None:  # the same on every rank
            write_best(Path(self.config.run_dir), state, self.best)

    def _summary(self, steps_done: int, figures: dict[str, Any], diverged: dict[str, Any] | None) -> dict[str, Any]:
        """summary.json's account of the loop: what ran, its figures, and how it ended."""
        summary = {**self._describe(steps_done), **figures}
        if diverged is not None:
            summary["diverged"] = diverged
        if self.best.error is not None:
            summary["keep_best_error"] = self.best.error
        if self.stopped_at is not None:
            summary["stopped_at_step"] = self.stopped_at
            summary["stopped_by"] = signal.Signals(self.stopped_by).name
        if self.start_step:
            summary["resumed_from_step"] = self.start_step
        if self.data_ended_at is not None:
            summary["data_ended_at_step"] = self.data_ended_at
        if isinstance(self.data, IterableRankData):
            summary["data_agreement"] = {"seconds": self.data.agreement_s, "count": self.data.agreements}
        if getattr(self.data, "skipped_items", 0):
            summary["resumed_skipping_items"] = self.data.skipped_items
        if self.micro is not None:
            summary["micro_batch_size"] = self.micro.size
            summary["micro_batch_changes"] = self.micro.changes
        if self.validation is not None:
            summary["validation"] = {**(self.last_validation or {}), **self.validation.summary(figures.get("train_s"))}
        if self.best.best is not None:
            summary["best"] = {**self.best.best, "model_path": str(Path(self.config.run_dir) / BEST_MODEL_FILE)}
        return summary

    def _describe(self, steps_done: int) -> dict[str, Any]:
        """What ran: summary.json's description of the run, beside the metrics' figures."""
        config, world_size = self.config, self.env.world_size
        return {
            "task": config.task, **({"task_description": self.task.description} if self.task.description else {}),
            "world_size": world_size, "steps": steps_done,
            "epochs": (round(steps_done * config.grad_accum / self.data.batches_per_epoch, 3)
                       if self.data.batches_per_epoch else None),
            "batch_size": config.batch_size, "global_batch_size": config.batch_size * config.grad_accum * world_size,
            "precision": self.precision.name, "device": str(self.device.type), "backend": dist.get_backend(),
            "skipped_steps": self.loop_state.skipped_steps, "final_lr": self.scheduler.get_last_lr()[0],
            "seed": config.seed,
            "loader_workers": self.data.workers, "optimizer_impl": self.optimizer_impl, **self.strategy.summary(),
            "optimizer_state_mb": self._optimizer_state_per_rank(),
            "ddp": {"bucket_mb": config.bucket_mb, "bucket_view": config.bucket_view,
                    "static_graph": config.static_graph, "grad_compression": config.grad_compression,
                    "find_unused_parameters": config.find_unused_parameters,
                    "broadcast_buffers": config.broadcast_buffers, "sync_batchnorm": config.sync_batchnorm},
            **parameter_counts(self.module),
            **({"fp8": fp8_summary(self.module, self.precision.fp8_recipe)} if self.precision.fp8_recipe else {}),
            "torch_version": torch.__version__,
        }

    def close(self) -> None:
        """Drop the DDP wrapper while the process group is still alive.

        Freed after destroy_process_group, DDP's reducer takes the last reference to the gloo group, whose
        destructor joins gloo's worker threads while holding the GIL, and a worker thread that needs the GIL
        to free a tensor never finishes: the rank hangs at exit (seen here once in a few dozen runs)."""
        dist.barrier()  # every rank's last collective is complete; nothing is in flight (the loader's workers end)
        del self.module, self.model, self.optimizer, self.scaler, self.parts, self.step, self.data
        gc.collect()
