"""export: a run's weights as a plain state_dict (.pt, .safetensors) or in the model's own save_pretrained format."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer


def export(
    source: Annotated[Path, typer.Argument(help="A run directory, a checkpoint, or a weights file.",
                                           show_default=False)],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the state_dict to this new file: "
                                                ".pt (or .bin) or .safetensors, by its suffix.")] = None,
    hf: Annotated[Path | None, typer.Option("--hf", help="Write the model with its own save_pretrained into this "
                                            "new directory (a Hugging Face model, or a task model whose "
                                            ".pretrained is one).")] = None,
    which: Annotated[Literal["auto", "best", "last"], typer.Option(
        "--which", help="From a run directory: best (model_best.pt), last (model.pt, else the newest checkpoint), "
        "or auto: the best where the run kept one, else the last.")] = "auto",
) -> None:
    """Export a run's weights: a state_dict file, or the model's save_pretrained format."""
    from ddp_amp.results.export import export as export_weights

    for line in export_weights(source, output=output, hf=hf, which=which):
        typer.echo(line, err=True)
