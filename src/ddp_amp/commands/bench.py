"""bench: what mixed precision (or torch.compile) buys, or with --max-batch how far the batch grows."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from ddp_amp.commands.options import (
    Launcher,
    check_json_path,
    check_plot_path,
    run_dir_option,
    with_training_options,
)
from ddp_amp.commands.panels import BENCH, LAUNCH, with_full_help
from ddp_amp.errors import UsageError

DEFAULT_TASK = "mlp-wide"
"""On CPU ranks: a model whose matmuls dominate its step, still learning while it is timed."""
GPU_DEFAULT_TASK = {"task": "gpt", "task_arg": ("size=124m",)}
GPU_DEFAULT_BATCH = 8
"""On GPUs, unless --task is given: GPT-2 small, 8 sequences of 1024 tokens per rank (unless --batch-size): the CPU
task would only time the launch of its small kernels (the transformer task's bf16 measured 0.82x fp32 on an
H200)."""

BenchRunDir = run_dir_option("runs/bench-<timestamp>",
                             "A new or empty directory that holds each launch's run directory")


@with_full_help
@with_training_options(task=DEFAULT_TASK, shown={"task": f"{DEFAULT_TASK} on CPU ranks, gpt size=124m on GPUs",
                                                  "batch_size": f"32 on CPU ranks, {GPU_DEFAULT_BATCH} on GPUs"})
def bench(
    ctx: typer.Context,
    train: dict,
    amp: Annotated[Literal["auto", "both", "on", "off", "all"], typer.Option(
        "--amp", rich_help_panel=BENCH, help="auto: all on a CPU with native bf16, both elsewhere; both (off and on, "
        "interleaved), on, off, or all: fp32, autocast and bf16-true weights (and fp8 on GPUs that have it, with "
        "torchao), interleaved.")] = "auto",
    compile: Annotated[Literal["off", "on", "both"], typer.Option(
        "--compile", rich_help_panel=BENCH,
        help="torch.compile: off, on, or both (eager and compiled, interleaved). Compiled runs take what "
             "--compile brings with it: bf16-true's AdamW on CPU ranks in one compiled pass "
             "(--optimizer-impl auto).")] = "off",
    shard: Annotated[str, typer.Option(
        "--shard", rich_help_panel=BENCH, help="none, optimizer or full (as spawn's), or several, comma-separated "
        "(none,full): run interleaved, each compared with the first in throughput and memory.")] = "none",
    warmup: Annotated[int, typer.Option("--warmup", rich_help_panel=BENCH,
                                        help="Untimed steps before the timed --steps.")] = 10,
    repeats: Annotated[int, typer.Option("--repeats", rich_help_panel=BENCH,
                                         help="Interleaved repeats of each precision.")] = 2,
    nproc: Annotated[str | None, typer.Option(
        "--nproc-per-node", "--nproc", "--gpus", "-n", rich_help_panel=LAUNCH, help="Ranks: a number, or gpu, cpu "
        "or auto as spawn takes them \\[default: every visible GPU with CUDA, 2 on CPU].")] = None,
    launcher: Launcher = "spawn",
    json_path: Annotated[Path | None, typer.Option("--json", rich_help_panel=BENCH,
                                                   help="Write every raw figure to this file.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", rich_help_panel=BENCH,
                                              help="Draw step times, off vs on (needs matplotlib).")] = None,
    max_batch: Annotated[bool, typer.Option(
        "--max-batch", rich_help_panel=BENCH, help="Instead of timing: per precision, the largest per-rank batch "
        "that trains (under --max-memory, or the device's memory) and the throughput at it.")] = False,
    run_dir: BenchRunDir = None,
) -> None:
    """Measure what mixed precision (or torch.compile) buys: the same training off and on, interleaved."""
    from ddp_amp.measure.bench import DEFAULT_STEPS, BenchOptions

    steps = train.pop("steps")
    if amp == "auto" and (train["dtype"] != "auto" or max_batch):
        amp = "both"  # a --dtype alone: that precision against fp32; --max-batch: fp32's batch against AMP's
    options = BenchOptions(amp=amp, steps=DEFAULT_STEPS if steps is None else steps, warmup=warmup,
                           repeats=repeats, launcher=launcher, compile=compile,
                           shards=tuple(mode.strip() for mode in shard.split(",")))
    _refuse_conflicts(train, options, max_batch=max_batch, shard=shard)
    check_json_path(json_path)
    check_plot_path(plot)
    given = _given(ctx, "task", "batch_size")
    report = _measure(train, options, nproc=nproc, run_dir=run_dir, max_batch=max_batch, given=given)
    from rich.console import Console

    from ddp_amp.results.report import bench_plot, bench_table, max_batch_plot, max_batch_table

    Console().print(max_batch_table(report) if max_batch else bench_table(report))
    if json_path is not None:
        from ddp_amp.outputs import write_json_report

        write_json_report(json_path, report, "bench")
        typer.echo(f"ddp-amp: wrote {json_path}", err=True)
    if plot is not None:
        (max_batch_plot if max_batch else bench_plot)(report, plot)
        typer.echo(f"ddp-amp: wrote {plot}", err=True)


def _refuse_conflicts(train: dict, options, *, max_batch: bool, shard: str) -> None:
    """Flags that contradict each other or bench, in one line each, before anything runs."""
    if train["epochs"] is not None:
        raise UsageError("--epochs does not apply to bench; use --steps (timed) and --warmup")
    if train["resume"] is not None:  # each variant would resume the same checkpoint, its --steps counted from it
        raise UsageError("--resume does not apply to bench: each of its runs trains from step 0 (--init-from gives "
                         "them starting weights)")
    if options.amp == "off" and train["dtype"] != "auto":
        raise UsageError(f"--dtype {train['dtype']} conflicts with --amp off (fp32 alone); drop one of them")
    if max_batch and options.amp == "all":
        raise UsageError("--max-batch compares fp32 with one AMP precision: use --amp both, on or off (and --dtype)")
    if max_batch and options.compile != "off":
        raise UsageError("--max-batch searches eager runs; drop --compile")
    if max_batch and len(options.shards) > 1:
        raise UsageError(f"--max-batch searches one --shard mode at a time; drop the others from --shard {shard}")


def _for_this_machine(train: dict, options, cuda: bool, nproc: int):
    """--amp auto resolved for this device (measure.bench.resolved_amp), whether `all` can include fp8, and each
    variant's precision checked before the first launch (a --dtype these devices cannot run is refused now, not
    after the fp32 runs)."""
    import dataclasses

    import torch

    from ddp_amp.measure.bench import resolved_amp, variant_precision
    from ddp_amp.precision import (
        cpu_has_native_bf16,
        cuda_devices_have_fp8,
        cuda_devices_have_native_bf16,
        fp8_refusal,
        resolve_precision,
    )

    gpus = range(min(nproc, torch.cuda.device_count())) if cuda else range(0)  # too many: preflight's refusal
    fp8 = cuda and fp8_refusal("cuda", cuda_devices_have_fp8(gpus)) is None
    options = dataclasses.replace(options, amp=resolved_amp(options.amp, "cuda" if cuda else "cpu",
                                                            cpu_has_native_bf16()), fp8=fp8)
    for mode in options.modes:
        chosen = variant_precision(train, options, mode)
        resolve_precision("cuda" if cuda else "cpu", chosen["amp"], chosen["dtype"],
                          cuda_bf16=cuda and cuda_devices_have_native_bf16(gpus), cuda_fp8=fp8)
    return options


def _given(ctx: typer.Context, *names: str) -> set[str]:
    """Which of these options the user gave, not left at their defaults."""
    return {name for name in names if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"}


def _measure(train: dict, options, *, nproc: str | None, run_dir: str | None, max_batch: bool,
             given: set[str] = frozenset()) -> dict:
    """Every flag checked before anything is created; then the interleaved launches (measure.bench) or the
    batch search (measure.max_batch). --nproc-per-node is read as spawn reads it (launch.torchrun.parse_nproc)."""
    import torch

    from ddp_amp.config import TrainConfig
    from ddp_amp.launch.preflight import RUNS_ROOT, default_run_dir
    from ddp_amp.launch.torchrun import parse_nproc

    cuda = train["device"] != "cpu" and torch.cuda.is_available()
    nproc = (torch.cuda.device_count() if cuda else 2) if nproc is None else parse_nproc(nproc)
    if cuda and "task" not in given:
        train.update(GPU_DEFAULT_TASK, batch_size=train["batch_size"] if "batch_size" in given else GPU_DEFAULT_BATCH)
    options = _for_this_machine(train, options, cuda, nproc)
    for mode in options.shards:  # every mode's combination with the other flags, before anything runs
        TrainConfig(**train, steps=options.warmup + options.steps, shard=mode)
    train["shard"] = options.shards[0]
    root = Path(run_dir) if run_dir else RUNS_ROOT / f"bench-{default_run_dir().name}"
    if root.exists() and not root.is_dir():
        raise UsageError(f"--run-dir {str(root)!r} is an existing file, not a directory")
    if root.is_dir() and any(root.iterdir()):  # bench writes a directory of runs of its own: never into a used one
        raise UsageError(f"--run-dir {str(root)!r} is not empty; bench writes its runs into a new or empty "
                         "directory: choose another")
    status = lambda line: typer.echo(line, err=True)  # noqa: E731
    if not max_batch:
        from ddp_amp.measure.bench import run_bench

        return run_bench(train, options, nproc=nproc, run_root=root, status=status)
    from ddp_amp.measure.max_batch import host_memory_share_gib, run_max_batch

    if train["max_memory"] is None and train["device"] != "cuda" and not cuda:
        # CPU ranks: a cap the allocator fails at cleanly, before the kernel's OOM killer would
        train["max_memory"] = round(host_memory_share_gib(nproc), 2)
    return run_max_batch(train, options, nproc=nproc, run_root=root, status=status)
