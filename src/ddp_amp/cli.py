"""The `ddp-amp` command line. Commands are thin: parse, build a config, call one launcher function.

torch is imported only inside the commands that launch something, so `ddp-amp --help` stays fast.
This module is the only place where the project's errors become exit codes.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Annotated, Any

import typer

from ddp_amp.errors import RunFailed, UsageError

app = typer.Typer(
    name="ddp-amp",
    help="Launch PyTorch DistributedDataParallel training with automatic mixed precision.",
    add_completion=False,
    pretty_exceptions_enable=False,
)

TRAINING = "Training"


def _option(default: Any, *names: str, help: str, type_: Any) -> tuple[Any, Any]:
    return (default, Annotated[type_, typer.Option(*names, help=help, rich_help_panel=TRAINING)])


# Every training option, defined once and added to each launching command by @training_options.
# The names match TrainConfig's fields; TrainConfig validates the values.
TRAINING_OPTIONS: dict[str, tuple[Any, Any]] = {
    "task": _option("mlp", "--task", type_=str,
                    help="linear, mlp, transformer, or your own module:factory / path/file.py:factory."),
    "device": _option("auto", "--device", type_=str, help="auto, cpu or cuda (CUDA ranks use nccl, CPU ranks gloo)."),
    "amp": _option("auto", "--amp", type_=str, help="Mixed precision: auto, on or off."),
    "dtype": _option("auto", "--dtype", type_=str, help="Autocast dtype: auto, bf16 or fp16 (+GradScaler)."),
    "optimizer": _option("adamw", "--optimizer", type_=str, help="adamw or sgd."),
    "lr": _option(3e-3, "--lr", type_=float, help="Peak learning rate."),
    "momentum": _option(0.9, "--momentum", type_=float, help="SGD momentum."),
    "weight_decay": _option(0.0, "--weight-decay", type_=float, help="Weight decay."),
    "schedule": _option("cosine", "--schedule", type_=str,
                        help="constant, cosine, exponential, step or onecycle (in optimizer steps)."),
    "warmup_steps": _option(0, "--warmup-steps", type_=int, help="Linear warm-up steps."),
    "min_lr_ratio": _option(0.1, "--min-lr-ratio", type_=float, help="Final LR of cosine/exponential, x --lr."),
    "batch_size": _option(32, "--batch-size", type_=int, help="Samples per rank per micro-step."),
    "steps": _option(None, "--steps", type_=int | None, help="Optimizer steps \\[default: 100]."),
    "epochs": _option(None, "--epochs", type_=int | None, help="Epochs, instead of --steps."),
    "grad_accum": _option(1, "--grad-accum", type_=int, help="Micro-steps per optimizer step (DDP no_sync)."),
    "clip_grad": _option(None, "--clip-grad", type_=float | None, help="Clip the gradient norm (after unscale)."),
    "log_every": _option(10, "--log-every", type_=int, help="Reduce and log metrics every N steps."),
    "seed": _option(0, "--seed", type_=int, help="Seed: same seed and world size, same result."),
}

RunDir = Annotated[str | None, typer.Option("--run-dir", help="Output directory \\[default: runs/<timestamp>].",
                                            rich_help_panel=TRAINING)]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Allow --run-dir to replace an earlier run's files.",
                                         rich_help_panel=TRAINING)]


def training_options(command):
    """Add TRAINING_OPTIONS to a command's signature; the command receives them as one dict, `train`."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "train"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
             for name, (default, annotation) in TRAINING_OPTIONS.items()]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        train = {name: kwargs.pop(name) for name in TRAINING_OPTIONS}
        return command(train=train, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=own + added)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + added}
    return wrapper


@app.command()
@training_options
def spawn(
    train: dict,
    nproc: Annotated[int, typer.Option("--gpus", "--nproc", "-n",
                                       help="Ranks to start: one per GPU with CUDA, CPU processes otherwise.")] = 1,
    run_dir: RunDir = None,
    overwrite: Overwrite = False,
) -> None:
    """Launch N ranks on this machine with torch.multiprocessing."""
    from ddp_amp.launch.preflight import preflight

    plan = preflight(train, nproc_per_node=nproc, flag="--gpus", overwrite=overwrite, run_dir=run_dir)
    _announce(plan, nproc)
    from ddp_amp.launch.spawn import spawn as spawn_ranks

    spawn_ranks(plan.config, nproc)
    _finish(plan)


@app.command()
def env() -> None:
    """Show what ddp-amp sees: torch, devices, CPU bf16 support, cores."""
    import torch

    from ddp_amp.dist import usable_cores
    from ddp_amp.precision import cpu_has_native_bf16

    typer.echo(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    typer.echo(f"cores {usable_cores()}, CPU native bf16: {'yes' if cpu_has_native_bf16() else 'no (emulated)'}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    typer.echo(f"CUDA devices: {count}")
    for index in range(count):
        typer.echo(f"  cuda:{index} {torch.cuda.get_device_name(index)} "
                   f"bf16: {'yes' if torch.cuda.is_bf16_supported() else 'no'}")


def _announce(plan, nproc: int) -> None:
    config = plan.config
    typer.echo(f"ddp-amp: {nproc} rank(s) on {plan.device_type}, precision {plan.precision.name}, "
               f"task {config.task}, run dir {config.run_dir}")
    if plan.precision.warning:
        typer.echo(f"ddp-amp: warning: {plan.precision.warning}", err=True)


def _finish(plan) -> None:
    import json

    from ddp_amp.checkpoint import SUMMARY_FILE

    summary = json.loads((plan.config_path.parent / SUMMARY_FILE).read_text())
    loss = summary["final_loss"]
    extra = "".join(f", {k} {v:.4g}" for k, v in summary.get("eval", {}).items())
    typer.echo(f"ddp-amp: done in {summary['wall_s']:.1f}s: final loss {loss:.4f}{extra}, "
               f"{summary['samples_per_s']:.0f} samples/s, weights in {summary['model_path']}")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turning every expected error into one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    try:
        # standalone_mode=False: errors come back here instead of being drawn as multi-line panels.
        code = app(args=args or ["--help"], prog_name="ddp-amp", standalone_mode=False)
    except typer.TyperException as exc:  # bad flags and values, as typer parses them
        typer.echo(f"ddp-amp: error: {exc.format_message()}", err=True)
        code = 2 if exc.exit_code == 1 else exc.exit_code
    except typer.Abort:
        typer.echo("ddp-amp: aborted", err=True)
        code = 130
    except UsageError as exc:
        for problem in exc.problems:
            typer.echo(f"ddp-amp: error: {problem}", err=True)
        code = 2
    except RunFailed as exc:
        if exc.details:
            typer.echo(exc.details, err=True)
        typer.echo(f"ddp-amp: error: {exc}", err=True)
        code = exc.exit_code
    sys.exit(code if isinstance(code, int) else 0)
