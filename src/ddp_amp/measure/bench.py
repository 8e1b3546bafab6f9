"""`ddp-amp bench`: the same training with AMP off and on, interleaved, per-step times from every rank.

Launcher side only: each measurement is an ordinary launch (spawn or torchrun) of the common core with
the bench job (config.JobKind), which makes every rank time each optimizer step (synchronising the device first) and
rank 0 write all ranks' times to step_times.json. This module turns those files into honest figures.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_amp.outputs import STEP_TIMES_FILE, RunRecord, read_summary


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]), as numpy's default."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Measurement:
    """One launch: every rank's timed step durations (warm-up already dropped) and its summary."""

    precision: str
    repeat: int
    step_s: dict[int, list[float]]
    peak_memory_mb: dict[int, float]
    summary: RunRecord

    @classmethod
    def load(cls, run_dir: Path, precision: str, repeat: int, warmup: int) -> Measurement:
        summary = read_summary(run_dir)
        ranks = json.loads((run_dir / STEP_TIMES_FILE).read_text())
        return cls(precision, repeat, {r["rank"]: r["step_s"][warmup:] for r in ranks},
                   {r["rank"]: r["peak_memory_mb"] for r in ranks}, summary)

    @property
    def median_step_s(self) -> float:
        return statistics.median(t for times in self.step_s.values() for t in times)


def _precision_entry(runs: list[Measurement]) -> dict[str, Any]:
    """One precision's figures over its interleaved repeats."""
    pooled = [t for m in runs for times in m.step_s.values() for t in times]
    per_rank = {rank: statistics.median(t for m in runs for t in m.step_s[rank]) for rank in runs[0].step_s}
    first = runs[0].summary
    median = statistics.median(pooled)
    samples_per_s = first.global_batch_size / median
    entry = {
        "step_s_median": median,
        "step_s_p90": percentile(pooled, 90),
        "slowest_rank_step_s_median": max(per_rank.values()),
        "per_rank_step_s_median": {str(rank): value for rank, value in per_rank.items()},
        "samples_per_s": samples_per_s,
        "peak_memory_mb": max(max(m.peak_memory_mb.values()) for m in runs),  # reserved, on a GPU
        "final_loss": statistics.median(m.summary.final_loss for m in runs),
        "repeats": [{"repeat": m.repeat, "step_s_median": m.median_step_s, "final_loss": m.summary.final_loss,
                     "step_s": {str(rank): times for rank, times in m.step_s.items()}} for m in runs],
    }
    if first.compile_s is not None:
        entry["compile_s"] = statistics.median(m.summary.compile_s for m in runs)
    if first.subnormal_fraction is not None:  # the worst of the repeats
        entry["subnormal_fraction"] = {part: max(m.summary.subnormal_fraction[part] for m in runs)
                                       for part in first.subnormal_fraction}
        entry["gradient_to_weight_norm"] = min(m.summary.gradient_to_weight_norm for m in runs)
        entry["flush_denormal"] = first.flush_denormal
    if first.tokens_per_s is not None:
        entry["tokens_per_s"] = samples_per_s * first.tokens_per_s / first.samples_per_s
    if first.model_flops_per_sample and first.peak_tflops_per_rank:
        # The table's throughput in FLOP/s per rank, over the peak the ranks measured or looked up (median).
        tflops = samples_per_s / first.world_size * first.model_flops_per_sample / 1e12
        from ddp_amp.train.utilisation import Peak, held_to

        mfu, peak = held_to(tflops, Peak(statistics.median(m.summary.peak_tflops_per_rank for m in runs),
                                         first.peak_source))  # none over 100%, as a run's summary claims none
        entry.update(achieved_tflops_per_rank=tflops, peak_tflops_per_rank=peak.tflops, mfu=mfu,
                     peak_source=peak.source)
    return entry


def analyse(measurements: list[Measurement]) -> dict[str, Any]:
    """Per precision: step-time median/p90 over all ranks' steps, the slowest rank's median, throughput, peak
    memory, final loss; then the speedup of the AMP precision over fp32 per interleaved repeat."""
    by_precision: dict[str, list[Measurement]] = {}
    for m in measurements:
        by_precision.setdefault(m.precision, []).append(m)
    results = {precision: _precision_entry(runs) for precision, runs in by_precision.items()}
    report: dict[str, Any] = {"precisions": results}
    # Variants are "fp32", "bf16"... and, with --compile, "fp32+compile"...: AMP is compared within eager runs
    # (or within compiled ones when there are no eager runs), compilation within each precision.
    compiled = [label for label in results if label.endswith(COMPILED)]
    eager = [label for label in results if not label.endswith(COMPILED)]
    for label in compiled:
        base = label.removesuffix(COMPILED)
        if base in results:
            pairs = [a.median_step_s / b.median_step_s for a, b in zip(by_precision[base], by_precision[label])]
            report.setdefault("compile_speedup", {})[base] = _ratios(pairs)
    labels = eager or compiled
    suffix = "" if eager else COMPILED
    fp32 = "fp32" + suffix
    for amp in [p for p in labels if p != fp32] if fp32 in results else []:
        pairs = [a.median_step_s / b.median_step_s for a, b in zip(by_precision[fp32], by_precision[amp])]
        loss_off, loss_on = results[fp32]["final_loss"], results[amp]["final_loss"]
        # "speedup" and "loss_agreement": the first half precision (autocast); "speedups": each one (--amp all).
        report.setdefault("speedup", {"amp": amp, **_ratios(pairs)})
        report.setdefault("loss_agreement", {fp32: loss_off, amp: loss_on, "relative_difference": abs(
            loss_on - loss_off) / max(abs(loss_off), 1e-12)})
        report.setdefault("speedups", {})[amp] = {
            **_ratios(pairs),
            "loss_relative_difference": abs(loss_on - loss_off) / max(abs(loss_off), 1e-12)}
    return report


def _ratios(pairs: list[float]) -> dict[str, Any]:
    """A speedup as the median of the per-repeat ratios: each repeat's two runs ran side by side, so each ratio
    is free of the machine's drift between repeats. The ratio of medians pooled over every repeat was not: with
    a slow repeat for one precision and a fast one for the other it read 1.24x where the repeats said 0.91x and
    1.10x."""
    return {"median": statistics.median(pairs), "per_repeat": pairs, "min": min(pairs), "max": max(pairs)}


SUBNORMAL_NOTE_AT = 1e-3
"""The share of subnormal values in a part (activations, gradients, weights, optimizer state) that bench
names under its table: enough to put a CPU's step on its slow path for a visible share of the step."""
COLLAPSED_GRADIENTS_AT = 1e-6
"""A gradient norm below this fraction of the weights' norm: the model has stopped learning (a converged
classifier's gradients are ~1e-9 of it, one still learning ~1e-2)."""


def numerics_notes(report: dict[str, Any]) -> list[str]:
    """What makes a precision's step times measure something other than its arithmetic, one line each."""
    notes = []
    for label, entry in report["precisions"].items():
        shares = entry.get("subnormal_fraction", {})
        worst = max(shares, key=shares.get, default=None)
        if worst is not None and shares[worst] >= SUBNORMAL_NOTE_AT:
            notes.append(f"{label}: {shares[worst]:.1%} of the {worst.replace('_', ' ')} were subnormal (below "
                         "1.2e-38), which CPUs compute on a path many times slower: its step times measure that "
                         "more than its arithmetic; --flush-denormal on (the default on CPU ranks) flushes them")
        ratio = entry.get("gradient_to_weight_norm")
        if ratio is not None and ratio < COLLAPSED_GRADIENTS_AT:
            notes.append(f"{label}: the gradients had collapsed by the end ({ratio:.1e} of the weights' norm): the "
                         "model stopped learning within the timed steps, where subnormals arise; use fewer "
                         "--steps or a task that is still learning")
    return notes


AMP_CHOICES = ("auto", "both", "on", "off", "all")
BF16_WEIGHTS = "true"
"""The variant of `--amp all` that trains with bf16 weights (--dtype bf16-true) beside fp32 and autocast."""
FP8 = "fp8"
"""The variant of `--amp all` that trains with torchao's float8 layers (--dtype fp8), where the GPUs have fp8."""


def resolved_amp(amp: str, device_type: str, cpu_native_bf16: bool) -> str:
    """--amp auto, bench's default: the comparisons a user would choose from here. On a CPU with native bf16,
    bf16 weights (bf16-true) beside fp32 and autocast, as `all`: they are often the fastest there (2.15x fp32 on
    an AMD Zen 5, against 1.30x for autocast); elsewhere fp32 against autocast, as `both`."""
    if amp != "auto":
        return amp
    return "all" if device_type == "cpu" and cpu_native_bf16 else "both"
COMPILE_CHOICES = ("off", "on", "both")
COMPILED = "+compile"
LAUNCHERS = ("spawn", "run")
DEFAULT_STEPS = 30


@dataclass(frozen=True)
class BenchOptions:
    amp: str = "both"
    """Resolved: not auto (resolved_amp)."""
    steps: int = DEFAULT_STEPS
    """Timed optimizer steps per launch."""
    warmup: int = 10
    """Untimed steps first: DDP's bucket rebuild, the allocator, GradScaler's first skips."""
    repeats: int = 2
    launcher: str = "spawn"
    compile: str = "off"
    """off, on or both (eager and compiled runs of each precision, interleaved)."""
    shards: tuple[str, ...] = ("none",)
    """The --shard modes to run, interleaved; the figures of the others are compared with the first's."""
    fp8: bool = False
    """The GPUs have fp8 and torchao is installed: `all` includes fp8."""

    def __post_init__(self) -> None:
        from ddp_amp.errors import UsageError

        problems = []
        if self.amp not in AMP_CHOICES:
            problems.append(f"--amp {self.amp!r} is not one of {', '.join(AMP_CHOICES)}")
        if self.steps < 1:
            problems.append(f"--steps must be >= 1, got {self.steps}")
        if self.warmup < 0:
            problems.append(f"--warmup must be >= 0, got {self.warmup}")
        if self.repeats < 1:
            problems.append(f"--repeats must be >= 1, got {self.repeats}")
        if self.compile not in COMPILE_CHOICES:
            problems.append(f"--compile {self.compile!r} is not one of {', '.join(COMPILE_CHOICES)}")
        from ddp_amp.config import SHARD_MODES

        if not all(self.shards):  # `--shard ""` or `--shard none,`: an empty name is no mode to name as unknown
            problems.append(f"--shard {','.join(self.shards)!r} names an empty mode; give one or more of "
                            f"{', '.join(SHARD_MODES)}, separated by commas")
        elif unknown := [mode for mode in self.shards if mode not in SHARD_MODES]:
            problems.append(f"--shard {','.join(self.shards)}: {', '.join(unknown)} is not one of "
                            f"{', '.join(SHARD_MODES)}")
        elif len(set(self.shards)) != len(self.shards) or not self.shards:
            problems.append(f"--shard {','.join(self.shards)}: name each mode once")
        if self.launcher not in LAUNCHERS:
            problems.append(f"--launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}")
        if problems:
            raise UsageError(*problems)

    @property
    def modes(self) -> list[str]:
        every = ["off", "on", BF16_WEIGHTS, *([FP8] if self.fp8 else [])]
        return {"both": ["off", "on"], "all": every}.get(self.amp, [self.amp])

    @property
    def variants(self) -> list[tuple[str, bool, str]]:
        """(AMP mode, compiled, shard mode) of each launch in one interleaved round."""
        compiled = {"off": [False], "on": [True], "both": [False, True]}[self.compile]
        return [(mode, flag, shard) for mode in self.modes for flag in compiled for shard in self.shards]


def variant_precision(train_options: dict[str, Any], options: BenchOptions, mode: str) -> dict[str, str]:
    """--amp and --dtype of one variant: off is fp32; on keeps the --dtype given (all's autocast variant is
    autocast); true and fp8 train with bf16 weights and fp8 layers."""
    dtype = train_options.get("dtype", "auto")
    if mode == "off":
        return {"amp": "off", "dtype": "auto"}
    if mode in (BF16_WEIGHTS, FP8):
        return {"amp": "on", "dtype": "bf16-true" if mode == BF16_WEIGHTS else FP8}
    if options.amp == "all" and dtype in ("bf16-true", FP8, "fp8-rowwise"):
        dtype = "bf16"
    return {"amp": mode, "dtype": dtype}


def compare_shards(by_shard: dict[str, list[Measurement]]) -> dict[str, Any]:
    """Per mode after the first and per precision: its throughput, rank 0's training-state memory (the peak
    less the baseline, summary.json's) and the slowest rank's peak, over the first mode's, per interleaved pair
    (medians, with the range)."""
    (base, reference), *others = by_shard.items()

    def state(m: Measurement) -> float:
        return m.summary.peak_memory_mb - m.summary.baseline_memory_mb

    def ratios(pairs: list[tuple[Measurement, Measurement]], figure) -> dict[str, float]:
        values = [figure(a) / figure(b) for a, b in pairs]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    comparison: dict[str, Any] = {"against": base}
    for shard, runs in others:
        for precision in dict.fromkeys(m.precision for m in runs):
            pairs = [(a, b) for a, b in zip([m for m in runs if m.precision == precision],
                                            [m for m in reference if m.precision == precision])]
            comparison.setdefault(shard, {})[precision] = {
                "throughput": ratios(pairs, lambda m: 1 / m.median_step_s),
                "training_state_memory": ratios(pairs, state),
                "training_state_mb": statistics.median(state(a) for a, _ in pairs),
                "optimizer_state_mb": pairs[0][0].summary.optimizer_state_mb}
    return comparison


def _variant_name(mode: str, compiled: bool, shard: str) -> str:
    return f"{mode}{COMPILED if compiled else ''}{'' if shard == 'none' else ' ' + shard}"


def run_bench(train_options: dict[str, Any], options: BenchOptions, *, nproc: int, run_root: Path,
              status=print) -> dict[str, Any]:
    """Launch every (repeat, precision) once, interleaved off, on, off, on..., and analyse the step times."""
    from ddp_amp.launch.session import launch_quietly

    notes, summary, plan = [], None, None
    by_shard: dict[str, list[Measurement]] = {shard: [] for shard in options.shards}
    total = options.repeats * len(options.variants)
    for repeat in range(options.repeats):
        for mode, compiled, shard in options.variants:
            run_options = {**train_options, **variant_precision(train_options, options, mode),
                           "steps": options.warmup + options.steps,
                           "log_every": max(1, options.warmup + options.steps), "compile": compiled, "shard": shard}
            sharded = "" if shard == "none" else f"-{shard}"
            run_dir = run_root / f"{mode}{'-compile' if compiled else ''}{sharded}-{repeat}"
            plan = launch_quietly(run_options, run_dir, nproc=nproc, launcher=options.launcher, kind="bench")
            if plan.precision.warning and plan.precision.warning not in notes:
                notes.append(plan.precision.warning)
            label = plan.precision.name + (COMPILED if compiled else "")
            measurement = Measurement.load(run_dir, label, repeat, options.warmup)
            by_shard[shard].append(measurement)
            summary = measurement.summary
            done = sum(map(len, by_shard.values()))
            status(f"bench: {done}/{total} {label}{'' if shard == 'none' else ' --shard ' + shard} repeat "
                   f"{repeat + 1}: {measurement.median_step_s * 1e3:.2f} ms/step (median)")
    report = analyse(by_shard[options.shards[0]])  # the first mode's table; the others compared with it
    if len(options.shards) > 1:
        report["shards"] = compare_shards(by_shard)
    tf32 = train_options.get("tf32")
    from ddp_amp.measure.environment import environment

    env = environment(plan.device_type, summary, None if tf32 is None else tf32 == "on")
    if summary.model_flops_per_token:
        env["model_flops_per_token"] = summary.model_flops_per_token
    if summary.task_description:
        env["task"] = summary.task_description
    env["flush_denormal"] = summary.flush_denormal
    report["environment"] = env
    if FP8 in options.modes and options.compile == "off":
        notes.append("fp8 ran eager: torchao's float8 casts are fast under torch.compile (its advice), so this row "
                     "understates fp8; compare with --compile on")
    report["notes"] = notes + numerics_notes(report)
    report["method"] = {"warmup": options.warmup, "steps": options.steps, "repeats": options.repeats,
                        "order": "interleaved " + ", ".join(_variant_name(*v) for v in options.variants),
                        "shard": list(options.shards),
                        "launcher": options.launcher,
                        "nproc": nproc, "task": train_options["task"], "run_root": str(run_root)}
    return report
