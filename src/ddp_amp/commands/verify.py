"""verify: a run's checkpoints and weights checked against the checksums written with them, without training."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def verify(
    path: Annotated[Path, typer.Argument(help="A run directory (every checkpoint, model.pt, model_best.pt), or one "
                                         "checkpoint or weights file.", show_default=False)],
) -> None:
    """Check that a run's checkpoints and weights hold the bytes written (their checksums); exit 1 if not."""
    from ddp_amp.results.integrity import report
    from ddp_amp.results.integrity import verify as verify_files

    lines, code = report(verify_files(path))
    for line in lines:
        typer.echo(line)
    raise typer.Exit(code)
