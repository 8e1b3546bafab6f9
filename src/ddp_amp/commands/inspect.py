"""show, diagnose and env: what a run left behind, where its ranks parted, and what this machine offers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ddp_amp.commands.options import check_plot_path
from ddp_amp.errors import UsageError


def show(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories to show and compare.", show_default=False)],
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw loss, LR and throughput against step for every "
                                              "run to this .png, .pdf or .svg (needs matplotlib).")] = None,
) -> None:
    """Show runs side by side: summary, loss curve, and what differs between them."""
    from ddp_amp.results.runs import load_run, name_apart

    runs = name_apart([load_run(path) for path in run_dirs])  # every path checked before anything is shown
    check_plot_path(plot)
    from rich.console import Console

    from ddp_amp.results.runs_view import runs_table

    console = Console()
    console.print(runs_table(runs, width=console.width))
    if plot is not None:
        from ddp_amp.results.report import runs_plot

        runs_plot(runs, plot)
        typer.echo(f"ddp-amp: wrote {plot}", err=True)


def diagnose(
    run_dir: Annotated[Path, typer.Argument(help="A run directory whose ranks wrote flight records.",
                                            show_default=False)],
    last: Annotated[int, typer.Option("--last", help="Collectives per rank in the timeline.")] = 8,
) -> None:
    """Where the ranks of a failed or hung run parted, from their flight records.

    The collective a rank never entered (or a mismatch), then each rank's last collectives."""
    from ddp_amp.results.diagnosis import DUMP_DIR, read_records, timeline, where_ranks_parted

    if last < 1:
        raise UsageError(f"--last must be >= 1, got {last}")
    if not run_dir.is_dir():  # a typo is not "a run without flight records"
        raise UsageError(f"diagnose: {str(run_dir)!r} " + ("is not a directory" if run_dir.exists() else
                                                            "does not exist"))
    dumps, damaged = read_records(run_dir)
    if not dumps and damaged:
        raise UsageError(f"diagnose: no flight record in {str(run_dir / DUMP_DIR)!r} could be read: " +
                         "; ".join(f"{path.name}: {why}" for path, why in damaged.items()))
    if not dumps:
        raise UsageError(f"diagnose: {str(run_dir)!r} has no flight records ({DUMP_DIR}/rank<N>.json): the ranks "
                         "write them when a run fails or stalls")
    for path, why in damaged.items():
        typer.echo(f"ddp-amp: warning: skipped the damaged flight record {path}: {why}", err=True)
    from ddp_amp.outputs import read_summary

    # The world size the run recorded, as the launcher's own verdict has it: a rank that left no record (it
    # failed before its first collective) is named, and no verdict is drawn from the others' records alone.
    typer.echo(where_ranks_parted(dumps, read_summary(run_dir).world_size, damaged).line)
    for line in timeline(dumps, last):
        typer.echo(line)


def env(json_output: Annotated[bool, typer.Option("--json", help="One JSON object, for bug reports.")] = False) -> None:
    """Show what ddp-amp sees: torch, backends, devices, CPU bf16 support, cores and threads."""
    from ddp_amp.measure.environment import environment_report

    report = environment_report()
    if json_output:
        import json

        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(f"ddp-amp {report['ddp_amp']}, torch {report['torch']} (CUDA {report['cuda'] or 'none'}, "
               f"NCCL {report['nccl'] or 'none'}), Python {report['python']}")
    backends = ", ".join(name for name, available in report["backends"].items() if available)
    typer.echo(f"backends: {backends or 'none'}")
    threads = report["threads"]
    typer.echo(f"cores {report['cores']}, torch threads {threads['torch']} (OMP_NUM_THREADS "
               f"{threads['OMP_NUM_THREADS'] or 'unset'}), CPU native bf16: "
               f"{'yes' if report['cpu_native_bf16'] else 'no (emulated)'}, AMX: "
               f"{'yes' if report['cpu_amx_bf16'] else 'no'}")
    for device, choice in report["amp_auto"].items():
        if device == "cpu":
            typer.echo("--amp auto on cpu: fp32, bf16 or bf16-true, measured by rank 0 at a run's start")
        else:
            typer.echo(f"--amp auto on {device}: {choice['precision']} ({choice['reason']})")
    cache = report["amp_auto_cpu_cache"]
    typer.echo(f"--amp auto's measured answers ({cache['path']}): {len(cache['answers']) or 'none yet'}")
    for key, answer in sorted(cache["answers"].items()):
        true = (f", bf16-true {answer['bf16_true_speedup']:.2f}x" if "bf16_true_speedup" in answer else "")
        typer.echo(f"  {answer.get('choice')}: bf16 {answer.get('bf16_speedup', float('nan')):.2f}x fp32{true}, "
                   f"{answer.get('measured_at', '?')}: {key}")
    typer.echo(f"CUDA devices: {len(report['gpus'])}")
    for gpu in report["gpus"]:
        native = "native" if gpu["native_bf16"] else "no (emulated; --amp auto uses fp16)"
        typer.echo(f"  cuda:{gpu['index']} {gpu['name']} (compute capability {gpu['compute_capability']}, "
                   f"{gpu['memory_gib']:.1f} GiB) bf16: {native}")
