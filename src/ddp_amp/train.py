"""The training core shared by every launcher: DDP + autocast + GradScaler + an LR schedule, done right.

It knows nothing of the terminal or the CLI: it reports through a `Reporter` and returns the run summary.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from ddp_amp.config import TrainConfig, parse_window
from ddp_amp.dist import DistEnv, usable_cores
from ddp_amp.precision import Precision, autocast, grad_scaler
from ddp_amp.profiling import StepProfiler
from ddp_amp.schedule import build_scheduler
from ddp_amp.tasks import Task


class Reporter(Protocol):
    """How the core tells the outside world what it is doing. Called on every rank."""

    def on_log(self, record: dict[str, Any]) -> None:
        """Metrics of one log interval: the all-reduced figures, plus this rank's own under `rank_*` keys."""


@dataclass
class TrainResult:
    summary: dict[str, Any]
    model: torch.nn.Module
    """The trained model without its DDP wrapper."""
    step_s: list[float]
    """Each optimizer step's duration on this rank, when config.record_step_times (else empty)."""


MAX_DEFAULT_WORKERS = 4
PHASES = ("data", "forward", "backward", "step", "log")
"""Where the training loop can be, in order within one optimizer step; `Trainer.position` names one."""
DATA, FORWARD, BACKWARD, STEP, LOG = range(len(PHASES))


def steady_state_start(total_steps: int) -> int:
    """Steps excluded from the throughput figure: start-up, DDP's bucket rebuild, the first allocations."""
    return 0 if total_steps < 4 else min(20, max(1, total_steps // 10))


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor inside `batch` (tensors, mappings, namedtuples, lists, tuples, nested) moved to `device`;
    anything else is returned as it is. non_blocking: from pinned memory the copy overlaps compute."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {key: to_device(value, device) for key, value in batch.items()}
        try:
            return type(batch)(moved)
        except (TypeError, ValueError):  # a Mapping type that cannot be built from a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields positionally
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def loader_workers(requested: int | None, device: torch.device, local_world_size: int) -> int:
    """DataLoader workers per rank. CPU ranks already use every core for compute, so loading stays in the rank;
    a GPU rank gets a few workers out of its share of the cores, so the GPU does not wait for the next batch."""
    if requested is not None:
        return requested
    if device.type == "cpu":
        return 0
    return max(0, min(MAX_DEFAULT_WORKERS, usable_cores() // local_world_size - 1))


def build_loader(dataset: Any, sampler: Any, batch_size: int, workers: int, device: torch.device,
                 seed: int) -> DataLoader:
    # A generator of its own: each new iterator draws its workers' base seed from it, not from the global
    # RNG, so where an iterator starts (a resume mid-epoch) does not shift the training randomness.
    extra: dict[str, Any] = {"generator": torch.Generator().manual_seed(seed)}
    if workers:
        # Workers live as long as the run (not re-forked every epoch) and keep two batches each ready.
        extra.update(persistent_workers=True, prefetch_factor=2)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=device.type == "cuda", **extra)


def optimizer_impl(config: TrainConfig, precision: Precision) -> str:
    """--optimizer-impl auto: fused, one kernel for every parameter (on this CPU AdamW's step took 13-18 ms
    fused against 72-112 ms in torch's default per-parameter loop); foreach under fp16's GradScaler, because a
    fused step takes the scaler's overflow flag itself and is called even for a step it skips, which the host
    (the LR schedule, the skipped-step count) would then learn of only through an extra sync per step."""
    if config.optimizer_impl != "auto":
        return config.optimizer_impl
    return "foreach" if precision.uses_scaler else "fused"


def build_optimizer(model: torch.nn.Module, config: TrainConfig, impl: str = "loop") -> torch.optim.Optimizer:
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[impl]
    if config.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                               weight_decay=config.weight_decay, **kind)
    return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, **kind)


def wrap_ddp(model: torch.nn.Module, config: TrainConfig, device: torch.device) -> DDP:
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=config.bucket_mb, gradient_as_bucket_view=config.bucket_view,
              static_graph=config.static_graph)
    if config.grad_compression != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        ddp.register_comm_hook(None, hook[config.grad_compression])  # None: the default process group
    return ddp


class Checkpointer(Protocol):
    """Saves the trainer's state every so many optimizer steps (the worker provides one)."""

    def due(self, step: int) -> bool: ...

    def save(self, trainer: Trainer, step: int) -> None: ...


class ResumableSampler(Sampler):
    """A DistributedSampler that can start its next pass `skip_batches` batches in, without loading them:
    a run resumed mid-epoch sees exactly the batches an uninterrupted one would have."""

    def __init__(self, inner: DistributedSampler, batch_size: int) -> None:
        self.inner, self.batch_size, self.skip_batches = inner, batch_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = list(self.inner)[self.skip_batches * self.batch_size:]
        self.skip_batches = 0
        return iter(indices)

    def __len__(self) -> int:
        return len(self.inner)


class DivergenceWatch:
    """Notices a run that no longer trains, without a host sync per step.

    Non-finite losses are counted on the device (a streak per rank, and the step where it first reached the
    limit); whether any rank tripped travels in the all-reduce that logging makes anyway, and only then does a
    second one find where. Skipped fp16 steps are already known on the host, so a collapsed loss scale is caught
    at the step where it happens.
    """

    NEVER = 2**40

    def __init__(self, limit: int, device: torch.device) -> None:
        self.limit = limit
        self.streak = torch.zeros((), dtype=torch.int64, device=device)
        self.tripped_at = torch.full((), self.NEVER, dtype=torch.int64, device=device)
        self.step_finite = torch.ones((), dtype=torch.bool, device=device)
        self.skip_streak = 0

    def observe_loss(self, loss: torch.Tensor) -> None:
        if self.limit:
            self.step_finite &= torch.isfinite(loss)

    def end_step(self, step: int, stepped: bool) -> dict[str, Any] | None:
        if not self.limit:
            return None
        self.streak = torch.where(self.step_finite, 0, self.streak + 1)
        self.tripped_at = torch.where((self.streak >= self.limit) & (self.tripped_at == self.NEVER), step,
                                      self.tripped_at)
        self.step_finite.fill_(True)
        self.skip_streak = 0 if stepped else self.skip_streak + 1
        if self.skip_streak >= self.limit:
            return {"step": step, "rank": None,
                    "reason": f"the fp16 loss scale collapsed: GradScaler skipped {self.limit} steps in a row "
                              "(inf/NaN gradients every step)"}
        return None

    def tripped(self) -> torch.Tensor:
        """1.0 on the device once this rank's streak has reached the limit (summed across ranks by logging)."""
        return (self.tripped_at != self.NEVER).float().reshape(1)

    def verdict(self, env: DistEnv) -> dict[str, Any]:
        """Once some rank tripped, on every rank: the earliest step (and its rank) where a streak reached the
        limit."""
        # Step and rank in one number, so a MIN all-reduce finds the earliest, lowest rank first.
        code = self.tripped_at * env.world_size + env.rank
        dist.all_reduce(code, op=dist.ReduceOp.MIN)
        step, rank = divmod(int(code.item()), env.world_size)
        return {"step": step, "rank": rank,
                "reason": f"the loss was inf/NaN for {self.limit} consecutive steps"}


class Trainer:
    def __init__(self, config: TrainConfig, env: DistEnv, device: torch.device, precision: Precision, task: Task,
                 reporter: Reporter) -> None:
        self.config, self.env, self.device, self.precision = config, env, device, precision
        self.task, self.reporter = task, reporter
        model = task.model.to(device)
        self.module = model
        """The model itself: its state_dict is what checkpoints and model.pt hold, compiled or not."""
        # --compile compiles the module inside DDP. torch documents compiling the DDP wrapper instead (its
        # DDPOptimizer splits the graph at bucket boundaries), but in this torch that captures no graph at all
        # (a graph break at DDP.forward, pytorch/pytorch#140416); inside, the whole forward and backward compile,
        # and DDP's reducer all-reduces the gradients as the compiled backward hands them over.
        self.model = wrap_ddp(torch.compile(model) if config.compile else model, config, device)
        self.optimizer_impl = optimizer_impl(config, precision)
        self.optimizer = build_optimizer(model, config, self.optimizer_impl)
        self.scaler = grad_scaler(precision, device.type)
        # Counts the optimizer steps actually taken. GradScaler calls optimizer.step() only when the gradients
        # are finite (it learns that with the one host sync it already makes), so a skipped step is seen here
        # without reading the scale back from the device. (A fused optimizer takes the scaler's found_inf itself
        # and would break this: never built under a GradScaler, see optimizer_impl.)
        self.steps_taken = 0
        self.optimizer.register_step_post_hook(self._count_step)
        self.sampler = ResumableSampler(DistributedSampler(task.dataset, num_replicas=env.world_size,
                                                           rank=env.rank, shuffle=True, seed=config.seed,
                                                           drop_last=False), config.batch_size)
        # The sampler pads every rank to the same number of samples, so every rank runs the same number of
        # batches: no rank waits forever in an all-reduce the others never join.
        self.loader_workers = loader_workers(config.num_workers, device, env.local_world_size)
        self.loader = build_loader(task.dataset, self.sampler, config.batch_size, self.loader_workers, device,
                                   seed=config.seed + env.rank)
        micro_per_epoch = len(self.loader)
        if config.steps is not None:
            self.total_steps = config.steps
        else:
            self.total_steps = config.epochs * micro_per_epoch // config.grad_accum
        if self.total_steps < 1:
            raise ValueError(f"--epochs {config.epochs} gives no optimizer step: the data set has "
                             f"{micro_per_epoch} batches per rank, fewer than --grad-accum {config.grad_accum}")
        if config.warmup_steps >= self.total_steps:
            raise ValueError(f"--warmup-steps {config.warmup_steps} must be smaller than the run's "
                             f"{self.total_steps} optimizer steps")
        self.scheduler = build_scheduler(self.optimizer, schedule=config.schedule, total_steps=self.total_steps,
                                         warmup_steps=config.warmup_steps, min_lr_ratio=config.min_lr_ratio)
        self.epoch = 0
        self.batches_in_epoch = 0
        """Micro-batches of the current epoch already trained on: where a resumed run picks the data up."""
        self.start_step = 0
        self.skipped_steps = 0
        self.position: tuple[int, int, int] = (0, 0, DATA)
        """(optimizer step, micro-step, phase): rebound, never mutated, so a watchdog thread reads it whole."""
        self.checkpointer: Checkpointer | None = None
        self.stop_requested: Callable[[], bool] = lambda: False
        """Polled (a host flag, no collective) and agreed on by all ranks at log intervals."""
        self.stopped_at: int | None = None
        self.profiler = StepProfiler(parse_window(config.profile) if config.profile else None, device, env.rank,
                                     Path(config.run_dir))

    def _micro_batches(self) -> Iterator[Any]:
        """Batches across epochs, endlessly; set_epoch reshuffles (the same way on every rank) each epoch."""
        while True:
            self.sampler.set_epoch(self.epoch)
            self.sampler.skip_batches = self.batches_in_epoch  # mid-epoch after a resume, else 0
            for batch in self.loader:
                self.batches_in_epoch += 1
                yield batch
            self.epoch += 1
            self.batches_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything that decides the rest of the run, except the RNG states (per rank, see checkpoint)."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any], step: int, saved_world_size: int | None = None) -> None:
        """Continue from a checkpoint taken after optimizer step `step`, by `saved_world_size` ranks."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])  # the loss scale and its growth tracker
        self.epoch, self.batches_in_epoch = state["epoch"], state["batches_in_epoch"]
        if saved_world_size and saved_world_size != self.env.world_size:
            # An elastic job resized: the epoch goes on from the share of its samples already seen (the shards
            # differ, so a few samples of this epoch may be seen twice or not at all).
            self.batches_in_epoch = self.batches_in_epoch * saved_world_size // self.env.world_size
        self.skipped_steps = state["skipped_steps"]
        self.start_step = step

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train(self) -> TrainResult:
        config, env = self.config, self.env
        samples_per_step = config.batch_size * config.grad_accum  # per rank
        measure_from = steady_state_start(self.total_steps)
        start = time.time()
        launch = config.launch_time or start
        batches = self._micro_batches()
        # Metrics live on the device and are read only at log intervals: a .item() per step would make
        # every step wait for the device.
        loss_sum = torch.zeros((), device=self.device)
        loss_count = 0
        divergence = DivergenceWatch(config.max_nonfinite, self.device)
        diverged: dict[str, Any] | None = None
        first_step_at = steady_at = None
        interval_start, interval_steps = time.perf_counter(), 0
        record: dict[str, Any] = {}
        step_s: list[float] = []
        step_started = time.perf_counter()
        on_gpu = self.device.type != "cpu"
        self.model.train()
        steps_done = self.start_step
        profiler = self.profiler
        step_clock = time.perf_counter()
        first_step_s = None
        for step in range(self.start_step, self.total_steps):
            profiler.before_step(step + 1)
            lr = self.scheduler.get_last_lr()[0]
            for micro in range(config.grad_accum):
                self.position = (step, micro, DATA)
                inputs, target = next(batches)
                if on_gpu:
                    inputs, target = to_device((inputs, target), self.device)
                # Gradients are all-reduced only on the last micro-step; the others accumulate locally.
                sync = contextlib.nullcontext() if micro == config.grad_accum - 1 else self.model.no_sync()
                self.position = (step, micro, FORWARD)
                with sync:
                    with autocast(self.precision, self.device.type):
                        loss = self.task.loss_fn(self.model(inputs), target)
                    self.position = (step, micro, BACKWARD)  # DDP's all-reduce runs inside backward
                    # Each micro-step contributes 1/K of the mean; no extra kernel when there is one micro-step.
                    self.scaler.scale(loss if config.grad_accum == 1 else loss / config.grad_accum).backward()
                loss_sum += loss.detach().float()
                loss_count += 1
                divergence.observe_loss(loss.detach())
            self.position = (step, config.grad_accum, STEP)
            log_due = (step + 1) % config.log_every == 0 or step + 1 == self.total_steps
            grad_norm = None
            if config.clip_grad is not None or log_due:
                # The norm of the true gradients: unscale first (a no-op without fp16). The gradients are
                # all-reduced already, so this rank's norm is the global one; it stays on the device (read with
                # the log's other values) and is computed at log steps only, unless clipping needs it anyway.
                self.scaler.unscale_(self.optimizer)
                params = [p for p in self.model.parameters() if p.grad is not None]
                if config.clip_grad is not None:
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.clip_grad)
                else:
                    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            stepped = self._optimizer_step()
            self.optimizer.zero_grad(set_to_none=True)
            if stepped:
                self.scheduler.step()
            else:
                # GradScaler found inf/NaN and skipped the update; the schedule must not advance either.
                self.skipped_steps += 1
            interval_steps += 1
            # Known on the host (every rank skips the same steps: the gradients were all-reduced), no sync.
            diverged = divergence.end_step(step + 1, stepped)
            if config.record_step_times:
                # Benchmark mode: wait for the device so each step's time is its own.
                self._sync()
                now = time.perf_counter()
                step_s.append(now - step_started)
                step_started = now
            profiler.after_step(step + 1)
            if self.checkpointer is not None and self.checkpointer.due(step + 1):
                self.checkpointer.save(self, step + 1)
            if first_step_at is None:
                self._sync()
                first_step_at = time.time()
                first_step_s = time.perf_counter() - step_clock
            if step + 1 == measure_from:
                self._sync()
                steady_at = time.perf_counter()
            if log_due or diverged is not None:
                self.position = (step, config.grad_accum, LOG)
                # A stop request (a signal on any rank) and a tripped divergence watch ride along: every rank
                # learns of them at the same step.
                flags = torch.tensor([float(loss_count), float(self.stop_requested())], device=self.device)
                local = torch.cat([loss_sum.reshape(1), flags, divergence.tripped()])
                totals = local.clone()
                dist.all_reduce(totals)  # also a sync point: the interval's time below is real
                now = time.perf_counter()
                interval_s = now - interval_start
                norm = (grad_norm if grad_norm is not None else torch.full((), math.nan, device=self.device))
                (local_loss, local_count, _, _, total_loss, total_count, stops, tripped,
                 norm_value) = torch.cat([local, totals, norm.reshape(1).float()]).tolist()
                if stops and step + 1 < self.total_steps:
                    self.stopped_at = step + 1
                if tripped and diverged is None:
                    diverged = divergence.verdict(env)  # where and on which rank: all-reduced, the same on all
                rank_samples_per_s = interval_steps * samples_per_step / interval_s
                record = {
                    "step": step + 1,
                    "total_steps": self.total_steps,
                    "epoch": self.epoch,
                    "loss": total_loss / total_count,
                    "lr": lr,
                    "samples_per_s": rank_samples_per_s * env.world_size,
                    "skipped_steps": self.skipped_steps,
                    "grad_norm": norm_value,
                    "elapsed_s": time.time() - start,
                    # This rank's own view, for the per-rank display (not written to metrics.jsonl).
                    "rank_loss": local_loss / local_count,
                    "rank_samples_per_s": rank_samples_per_s,
                }
                if self.task.item_name != "samples":
                    record[f"{self.task.item_name}_per_s"] = record["samples_per_s"] * self.task.items_per_sample
                if self.scaler.is_enabled():
                    record["loss_scale"] = self.scaler.get_scale()  # a host sync, at log intervals only
                self.reporter.on_log(record)
                loss_sum.zero_()
                loss_count, interval_start, interval_steps = 0, now, 0
            steps_done = step + 1
            if diverged is not None or self.stopped_at is not None:
                break  # every rank breaks here, at the same step: no rank waits in a collective alone
        profiler.stop()  # a run that stopped inside the window
        self._sync()
        end = time.time()
        steady_s = time.perf_counter() - steady_at if steady_at is not None else end - start
        steady_steps = steps_done - max(measure_from, self.start_step)
        # Profiled steps run slower: they are not part of the figure.
        profiled_s, profiled_steps = profiler.overlap(steady_at, max(measure_from, self.start_step))
        if profiled_steps < steady_steps:
            steady_s, steady_steps = steady_s - profiled_s, steady_steps - profiled_steps
        steady_steps = max(1, steady_steps)
        rank_samples_per_s = steady_steps * samples_per_step / steady_s
        samples_per_s = rank_samples_per_s * env.world_size
        summary: dict[str, Any] = {
            "task": config.task,
            "world_size": env.world_size,
            "steps": steps_done,
            "epochs": round(steps_done * config.grad_accum / len(self.loader), 3),
            "batch_size": config.batch_size,
            "global_batch_size": config.batch_size * config.grad_accum * env.world_size,
            "final_loss": record.get("loss"),
            "samples_per_s": samples_per_s,
            "rank_samples_per_s": rank_samples_per_s,
            "precision": self.precision.name,
            "device": str(self.device.type),
            "backend": dist.get_backend(),
            "train_s": end - start,
            "wall_s": end - launch,
            "time_to_first_step_s": (first_step_at or end) - launch,
            "skipped_steps": self.skipped_steps,
            "final_lr": self.scheduler.get_last_lr()[0],
            "seed": config.seed,
            "loader_workers": self.loader_workers,
            "optimizer_impl": self.optimizer_impl,
            "ddp": {"bucket_mb": config.bucket_mb, "bucket_view": config.bucket_view,
                    "static_graph": config.static_graph, "grad_compression": config.grad_compression},
            "torch_version": torch.__version__,
        }
        if self.task.item_name != "samples":
            summary[f"{self.task.item_name}_per_s"] = samples_per_s * self.task.items_per_sample
        if self.task.flops_per_item:
            summary[f"model_flops_per_{self.task.item_name.rstrip('s')}"] = self.task.flops_per_item
        if profiler.window is not None:
            summary["profile"] = profiler.summary()
        if config.compile and first_step_s is not None:
            # The first step traces and compiles (a shape seen later, like a smaller last batch, compiles
            # again); the throughput above is measured after the warm-up steps, without it.
            summary["compile_s"] = first_step_s
        if self.scaler.is_enabled():
            summary["loss_scale"] = self.scaler.get_scale()
        if diverged is not None:
            summary["diverged"] = diverged
        if self.stopped_at is not None:
            summary["stopped_at_step"] = self.stopped_at
        if self.start_step:
            summary["resumed_from_step"] = self.start_step
        return TrainResult(summary=summary, model=self.module, step_s=step_s)

    def close(self) -> None:
        """Drop the DDP wrapper while the process group is still alive.

        Freed after destroy_process_group, DDP's reducer takes the last reference to the gloo group, whose
        destructor joins gloo's worker threads while holding the GIL, and a worker thread that needs the GIL
        to free a tensor never finishes: the rank hangs at exit (seen here once in a few dozen runs).
        """
        dist.barrier()  # every rank's last collective is complete; nothing is in flight
        # the loader's workers end too
        del self.module, self.model, self.optimizer, self.scaler, self.scheduler, self.loader
        gc.collect()

    def _count_step(self, *_: Any) -> None:
        self.steps_taken += 1

    def _optimizer_step(self) -> bool:
        """One optimizer step through the scaler; False when the scaler skipped it (inf/NaN gradients)."""
        if not self.scaler.is_enabled():
            self.optimizer.step()
            return True
        taken = self.steps_taken
        self.scaler.step(self.optimizer)  # host sync (inside GradScaler): were the gradients finite?
        self.scaler.update()  # stays on the device
        return self.steps_taken > taken
