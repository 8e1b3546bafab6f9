"""The `ddp-amp` command line: the app, --version, the command registry and main(), the one place where the
project's errors become exit codes.

Each command lives in ddp_amp.commands, one module per family, and is thin: parse, build a config, call one
function. torch is imported only inside the commands that launch something, so `ddp-amp --help` stays fast.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ddp_amp.commands import bench, doctor, export, inspect, train, verify
from ddp_amp.commands.panels import PanelledCommand
from ddp_amp.commands.torchrun_names import TorchrunNames
from ddp_amp.errors import RunFailed, UsageError
from ddp_amp.process import StopSignal, stop_signals_raise

app = typer.Typer(
    name="ddp-amp",
    help="Launch PyTorch DistributedDataParallel training with automatic mixed precision.",
    add_completion=True,
    pretty_exceptions_enable=False,
)

COMMANDS = (
    train.spawn,
    train.run,
    train.multinode,
    bench.bench,
    inspect.show,
    doctor.doctor,
    inspect.diagnose,
    inspect.env,
    export.export,
    verify.verify,
)
"""In the order --help lists them."""
SCRIPT_CONTEXT = {"allow_interspersed_args": False}
"""spawn, run and multinode: options come before SCRIPT; every word after it is the script's, as torchrun takes
`training_script [args]` (an --lr after the script is the script's own)."""
TAKES_A_SCRIPT = (train.spawn, train.run, train.multinode)
PANELLED = (*TAKES_A_SCRIPT, bench.bench)
"""The training commands: options grouped by concern, --help the most used of them, --help-all every one. Every
command's options also answer to torchrun's spellings of them (commands.torchrun_names)."""
for command in COMMANDS:
    app.command(context_settings=SCRIPT_CONTEXT if command in TAKES_A_SCRIPT else None,
                cls=PanelledCommand if command in PANELLED else TorchrunNames)(command)


def _print_version(value: bool) -> None:
    if value:
        from ddp_amp import __version__

        typer.echo(f"ddp-amp {__version__}")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print ddp-amp's version and exit.")] = False,
) -> None:
    """Launch PyTorch DistributedDataParallel training with automatic mixed precision."""


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turning every expected error into one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    try:
        # standalone_mode=False: errors come back here instead of being drawn as multi-line panels. A stop
        # signal before the ranks start (the whole job step is signalled while this one starts) is one line
        # and 128 + its number, like a stop later on.
        with stop_signals_raise():
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
    except StopSignal as exc:  # a stop signal outside a launcher's own handling: during its start-up
        where = "" if exc.startup is None else f" while the launch was starting, before any rank trained: " \
            f"{exc.startup}"
        typer.echo(f"ddp-amp: error: {exc}{where}", err=True)
        code = exc.exit_code
    except RunFailed as exc:
        if exc.details:
            typer.echo(exc.details, err=True)
        typer.echo(f"ddp-amp: error: {exc}", err=True)
        code = exc.exit_code
    sys.exit(code if isinstance(code, int) else 0)
