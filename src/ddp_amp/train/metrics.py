"""What a run measures, in one place: the loss and the throughput of each log interval (one all-reduce that
also carries the ranks' stop and divergence flags), the steady-state window that summary.json's throughput
comes from, the profiler's share of it, memory peaks and MFU. It feeds the reporter, whose sinks are
metrics.jsonl, the launcher's events and TensorBoard.

Host syncs happen at log intervals only (the all-reduce, `.tolist()`, the loss scale), plus one at the first
step, one at the start of the steady state and two around each validation, which make those instants real on
an asynchronous device.
"""

from __future__ import annotations

import contextlib
import functools
import math
import resource
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv
from ddp_amp.tasks import Task
from ddp_amp.train.profiling import StepProfiler
from ddp_amp.train.step import PHASES, StepOutcome
from ddp_amp.train.stragglers import StragglerWatch
from ddp_amp.train.utilisation import Peak, device_peak, held_to


class Reporter(Protocol):
    """How the core tells the outside world what it is doing. Called on every rank."""

    def on_log(self, record: dict[str, Any]) -> None:
        """Metrics of one log interval: the all-reduced figures, plus this rank's own under `rank_*` keys."""


def steady_state_start(total_steps: int) -> int:
    """Steps excluded from the throughput figure: start-up, DDP's bucket rebuild, the first allocations."""
    return 0 if total_steps < 4 else min(20, max(1, total_steps // 10))


def peak_memory(device: torch.device) -> dict[str, float]:
    """This rank's peak memory so far, in MiB. On a GPU `peak_memory_mb` is what the caching allocator reserved,
    which is what runs out, and `peak_memory_allocated_mb` what tensors used of it; on a CPU the peak resident
    set of the process."""
    if device.type == "cuda":
        return {"peak_memory_mb": torch.cuda.max_memory_reserved(device) / 2**20,
                "peak_memory_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20}
    return {"peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux reports KiB


def memory_now_mb(device: torch.device) -> float:
    """This rank's memory right now, measured as peak_memory's peak is: on a GPU what the caching allocator holds
    reserved, on a CPU the process's resident set. Taken before the model is built, it is summary.json's
    baseline_memory_mb: the training state's memory is the peak less it."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device) / 2**20
    with open("/proc/self/statm", encoding="ascii") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * resource.getpagesize() / 2**20


def _subnormal_share(tensors) -> tuple[int, int]:
    """(subnormal values, values) among the floating tensors: non-zero and below the dtype's smallest normal
    (1.2e-38 in fp32 and bf16, 6.1e-5 in fp16)."""
    found = total = 0
    for t in tensors:
        if torch.is_tensor(t) and t.is_floating_point() and t.numel():
            found += int(((t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)).sum())
            total += t.numel()
    return found, total


def probe_numerics(module: torch.nn.Module, loss_fn, batch, optimizer: torch.optim.Optimizer,
                   precision, device: torch.device, every_field: bool = False) -> dict[str, Any]:
    """Whether a step's times measure arithmetic, for bench. `subnormal_fraction`: the share of subnormal
    values in one forward and backward of `batch` (activations: every module's output; gradients), in the
    weights and in the optimizer's state; CPUs compute subnormals on a path many times slower.
    `gradient_to_weight_norm`: near 0 when the model has stopped learning (gradients ~0, softmax outputs of
    exp(-100)), which is how subnormals arise. Run once, after training, on the unwrapped module in eval mode
    (no all-reduce, no running statistics updated); the gradients it makes are dropped."""
    from ddp_amp.precision import autocast
    from ddp_amp.tasks.batches import batch_loss
    from ddp_amp.train.data import to_device

    counts = {"activations": [0, 0], "gradients": [0, 0]}

    def count_output(_module, _inputs, output) -> None:
        found, total = _subnormal_share(output if isinstance(output, (tuple, list)) else [output])
        counts["activations"][0] += found
        counts["activations"][1] += total

    hooks = [m.register_forward_hook(count_output) for m in module.modules()]
    was_training = module.training
    module.eval()
    try:
        with autocast(precision, device.type):
            loss = batch_loss(module, to_device(batch, device), loss_fn, every_field=every_field)
        loss.float().backward()
    finally:
        for hook in hooks:
            hook.remove()
        module.train(was_training)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    counts["gradients"] = list(_subnormal_share(grads))
    ratio = (float(torch.nn.utils.get_total_norm(grads) / torch.nn.utils.get_total_norm(list(module.parameters())))
             if grads else math.nan)
    module.zero_grad(set_to_none=True)
    counts["weights"] = list(_subnormal_share(module.parameters()))
    counts["optimizer_state"] = list(_subnormal_share(v for entry in optimizer.state.values() for v in entry.values()))
    return {"subnormal_fraction": {name: found / total if total else 0.0 for name, (found, total) in counts.items()},
            "gradient_to_weight_norm": ratio}


class MetricsProcessor:
    """One per run of the training loop; `step_done` after every optimizer step, `log` at log intervals,
    `summary` at the end."""

    def __init__(self, config: TrainConfig, env: DistEnv, device: torch.device, task: Task,
                 scaler: torch.amp.GradScaler, profiler: StepProfiler, reporter: Reporter, *, total_steps: int,
                 start_step: int, time_steps: bool = False, micro: Any = None,
                 phase_times: Callable[[], list[float]] | None = None) -> None:
        self.config, self.env, self.device, self.task = config, env, device, task
        self.time_steps = time_steps
        """Time each optimizer step, the device synchronised first (the bench job)."""
        self.scaler, self.profiler, self.reporter = scaler, profiler, reporter
        self.micro = micro
        """The run's train.microbatch.MicroBatches, whose size each log record carries (None without)."""
        self.phase_times: Callable[[], list[float]] = phase_times or (lambda: [0.0] * len(PHASES))
        """This rank's seconds per phase since the last log (AmpStep.take_phase_times)."""
        self.stragglers = StragglerWatch(env.rank, env.world_size)
        self.total_steps, self.start_step = total_steps, start_step
        self.samples_per_step = config.batch_size * config.grad_accum
        """A full step's samples on this rank; what a step counts when its batches cannot be counted."""
        # The samples the steps actually took (an epoch's last batch may be short): the throughput's numerator.
        self.samples_done = self.samples_at_steady = self.profiled_samples = self.interval_samples = 0
        self.counted_flops: float | None = None
        """The FLOPs counting_flops counted in a step, until step_done divides them by its samples."""
        self.measure_from = steady_state_start(total_steps)
        self.start = time.time()
        # The interval's loss lives on the device and is read only at log intervals: a .item() per step would
        # make every step wait for the device.
        self.loss_sum = torch.zeros((), device=device)
        self.loss_count = 0
        self.interval_start = time.perf_counter()
        self.record: dict[str, Any] = {}
        self.step_s: list[float] = []
        """Each optimizer step's duration on this rank, with time_steps (bench)."""
        self.step_started = self.step_clock = time.perf_counter()
        self.flops_per_sample: float | None = (task.flops_per_item * task.items_per_sample
                                               if task.flops_per_item else None)
        """Training FLOPs (forward and backward) per sample: the task's count, else the first step's
        (counting_flops)."""
        self.flops_counted = self.flops_per_sample is not None
        self.peak_measured_again = False
        self.peak: Peak | None = None
        """What this rank can compute in the run's precision (train.utilisation.device_peak), set before the first
        step (prepare_utilisation)."""
        self.first_step_at: float | None = None
        self.first_step_s: float | None = None
        self.steady_at: float | None = None
        self.paused_s = 0.0
        """Seconds of the steady-state window spent outside training (validations): not in its throughput."""

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_done(self, number: int, outcome: StepOutcome) -> None:
        """After optimizer step `number` (from 1): its loss into the interval's sum, and the windows' edges."""
        self.loss_sum += outcome.loss
        self.loss_count += outcome.micro_steps
        samples = outcome.samples or self.samples_per_step
        self.interval_samples += samples
        self.samples_done += samples
        if self.counted_flops is not None:
            self.flops_per_sample, self.counted_flops = self.counted_flops / samples or None, None
        window = self.profiler.window
        if window and window[0] <= number <= window[1] and number > self.measure_from:
            self.profiled_samples += samples  # taken out of the steady state with the window's seconds
        if self.time_steps:
            self._sync()  # benchmark mode: wait for the device so each step's time is its own
            now = time.perf_counter()
            self.step_s.append(now - self.step_started)
            self.step_started = now
        self.profiler.after_step(number)
        if self.first_step_at is None:
            self._sync()
            self.first_step_at = time.time()
            self.first_step_s = time.perf_counter() - self.step_clock
        if number == self.measure_from:
            self._sync()
            self.steady_at = time.perf_counter()
            self.samples_at_steady = self.samples_done

    @contextlib.contextmanager
    def paused(self):
        """Around what is not training (a validation and its best model's save): its seconds are left out of
        the log interval's throughput, the next step's time (bench) and summary.json's steady-state window, as
        a hand-written loop that validates elsewhere would measure. The device is synchronised first, so the
        steps queued before it count as theirs."""
        self._sync()
        began = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            paused_s = time.perf_counter() - began
            self.interval_start += paused_s
            self.step_started += paused_s
            if self.steady_at is not None:
                self.paused_s += paused_s

    def log(self, number: int, *, lr: float, epoch: int, skipped_steps: int, grad_norm: torch.Tensor | None,
            flags: list[torch.Tensor], extra: dict[str, Any] | None = None) -> list[float]:
        """The interval's record, all-reduced, to the reporter. `flags`: one-element device tensors that ride
        along in the same all-reduce (a stop request, a tripped divergence watch); returned summed over ranks.
        `extra`: this rank's own figures for the line (the checkpoints saved since the last one)."""
        count = torch.tensor([float(self.loss_count)], device=self.device)
        times = self.stragglers.pack(self.phase_times(), self.device)  # every rank's row, summed: a table
        local = torch.cat([self.loss_sum.reshape(1), count, *flags, times])
        totals = local.clone()
        dist.all_reduce(totals)  # also a sync point: the interval's time below is real
        now = time.perf_counter()
        interval_s = now - self.interval_start
        norm = grad_norm if grad_norm is not None else torch.full((), math.nan, device=self.device)
        values = torch.cat([local[:2], totals, norm.reshape(1).float()]).tolist()  # one host read for all
        local_loss, local_count, total_loss, total_count, *summed, norm_value = values
        summed_flags, table = summed[:len(flags)], summed[len(flags):]
        rank_times = self.stragglers.unpack(table)
        rank_samples_per_s = self.interval_samples / interval_s
        record = {"step": number, "total_steps": self.total_steps, "epoch": epoch, "loss": total_loss / total_count,
                  "lr": lr, "samples_per_s": rank_samples_per_s * self.env.world_size, "skipped_steps": skipped_steps,
                  "grad_norm": norm_value, "elapsed_s": time.time() - self.start,
                  "time_per_rank_s": [[round(seconds, 4) for seconds in row] for row in rank_times],
                  "slow_ranks": self.stragglers.slow,
                  # This rank's own view, for the per-rank display (not written to metrics.jsonl).
                  "rank_loss": local_loss / local_count, "rank_samples_per_s": rank_samples_per_s}
        if self.task.item_name != "samples":
            record[f"{self.task.item_name}_per_s"] = record["samples_per_s"] * self.task.items_per_sample
        measured_again = self.peak_measured_again
        record.update(self.utilisation(record["samples_per_s"]))
        if self.micro is not None:
            record["micro_batch_size"] = self.micro.size
        if self.scaler.is_enabled():
            record["loss_scale"] = self.scaler.get_scale()  # a host sync, at log intervals only
        record.update(extra or {})
        self.reporter.on_log(record)
        self.record = record
        self.loss_sum.zero_()
        # The next interval starts now, or after the peak utilisation() just measured again (not training)
        start = now if self.peak_measured_again == measured_again else time.perf_counter()
        self.loss_count, self.interval_start, self.interval_samples = 0, start, 0
        return summed_flags

    def prepare_utilisation(self, precision: str) -> None:
        """The peak this rank's MFU is held to, where there will be a FLOP count: the task's, or the first step's
        (not under --compile, whose kernels torch's counter does not see). Measured before the run's clocks
        start: the time to the first step and the first interval's throughput do not include it."""
        if self.flops_per_sample or not self.config.compile:
            tf32 = self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
            self.peak = device_peak(self.device, precision, tf32=tf32)
            self.measure_peak = functools.partial(device_peak, self.device, precision, tf32=tf32)
            self.start = time.time()
            self.step_started = self.step_clock = self.interval_start = time.perf_counter()

    @contextlib.contextmanager
    def counting_flops(self):
        """Around each step until one is counted, for a task that does not count its FLOPs: torch's
        FlopCounterMode counts the forward and backward's matmuls and convolutions on this rank (attention too
        where its kernel is one the counter knows; a CPU's scaled_dot_product_attention is not). Not while
        --micro-batch auto is still finding its size: the counter's module tracker holds a pass that ran out of
        memory (its backward never ended) until the mode exits, so the retry would run beside the failed pass's
        activations and halve again for nothing. A settled size never changes (an out-of-memory then is an
        error), so the step counted is a plain one: the first settled step."""
        if self.flops_counted or self.config.compile or (self.micro is not None and self.micro.auto
                                                         and not self.micro.settled):
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            yield
        self.flops_counted = True
        self.counted_flops = counter.get_total_flops()  # per sample once step_done knows the step's samples

    def utilisation(self, samples_per_s: float) -> dict[str, float]:
        """The training FLOP/s per rank (`tflops_per_rank`) and, against the rank's peak, the model FLOPs
        utilisation (`mfu`), of a throughput as samples_per_s gives it (this rank's rate times the world size:
        the ranks step in lockstep). Empty without a count."""
        if not self.flops_per_sample:
            return {}
        figures = {"tflops_per_rank": samples_per_s / self.env.world_size * self.flops_per_sample / 1e12}
        if self.peak is not None and (mfu := self._mfu(figures["tflops_per_rank"] * 1e12)) is not None:
            figures["mfu"] = mfu
        return figures

    def _mfu(self, flops_per_s: float) -> float | None:
        """The rate against the rank's peak. Above 100%, which no true peak allows, a CPU's measured peak was
        taken while other work held the cores (a shared machine): measured once more, its seconds paused, the
        faster kept; still above (or a GPU's), no MFU is claimed and the peak's source says why. Not measured
        again on a GPU: mid-run, its memory may be full."""
        if self.peak.mfu(flops_per_s) > 1 and self.peak.source.startswith("measured") and \
                self.device.type == "cpu" and not self.peak_measured_again:
            self.peak_measured_again = True
            with self.paused():
                again = self.measure_peak()
            self.peak = max(self.peak, again, key=lambda peak: peak.tflops)
        mfu, self.peak = held_to(flops_per_s / 1e12, self.peak)
        return mfu

    def summary(self, steps_done: int) -> dict[str, Any]:
        """The run's throughput over the steady state (profiled steps and validations left out) and its
        timings."""
        self.profiler.stop()  # a run that stopped inside the window
        self._sync()
        end = time.time()
        measured_from = max(self.measure_from, self.start_step)
        steady_s = (time.perf_counter() - self.steady_at - self.paused_s if self.steady_at is not None
                    else end - self.start)
        steady_steps = steps_done - measured_from
        steady_samples = self.samples_done - self.samples_at_steady
        # Profiled steps run slower: they are not part of the figure.
        profiled_s, profiled_steps = self.profiler.overlap(self.steady_at, measured_from)
        if profiled_steps < steady_steps:
            steady_s, steady_steps = steady_s - profiled_s, steady_steps - profiled_steps
            steady_samples -= self.profiled_samples
        rank_samples_per_s = (steady_samples if steady_steps > 0 else self.samples_per_step) / steady_s
        samples_per_s = rank_samples_per_s * self.env.world_size
        launch = self.config.launch_time or self.start
        summary: dict[str, Any] = {
            "final_loss": self.record.get("loss"), "samples_per_s": samples_per_s,
            "rank_samples_per_s": rank_samples_per_s, "train_s": end - self.start, "wall_s": end - launch,
            "time_to_first_step_s": (self.first_step_at or end) - launch}
        item = self.task.item_name
        if item != "samples":
            summary[f"{item}_per_s"] = samples_per_s * self.task.items_per_sample
        if self.task.flops_per_item:
            summary[f"model_flops_per_{item.rstrip('s')}"] = self.task.flops_per_item
        if self.flops_per_sample:
            figures = self.utilisation(samples_per_s)
            summary.update(model_flops_per_sample=self.flops_per_sample, mfu=figures.get("mfu"),
                           achieved_tflops_per_rank=figures["tflops_per_rank"])
        if self.peak is not None:
            summary.update(peak_tflops_per_rank=self.peak.tflops, peak_source=self.peak.source)
        if self.profiler.window is not None:
            summary["profile"] = self.profiler.summary()
        if self.config.compile and self.first_step_s is not None:
            # The first step traces and compiles (a shape seen later, like a smaller last batch, compiles
            # again); the throughput above is measured after the warm-up steps, without it.
            summary["compile_s"] = self.first_step_s
            from torch._dynamo.utils import counters  # imported with torch.compile already

            summary["compiled_frames"] = int(counters["frames"]["ok"])  # 0: nothing was compiled after all
        if self.scaler.is_enabled():
            summary["loss_scale"] = self.scaler.get_scale()
        summary.update(self.stragglers.summary())
        return summary
