"""`ddp-amp export`: a run's weights out of ddp-amp, as a plain state_dict (.pt or .safetensors) or in the model's
own format (`save_pretrained`), from a run directory, a checkpoint, or a weights file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ddp_amp.config import CONFIG_FILE
from ddp_amp.errors import UsageError
from ddp_amp.files import checksum_file_of
from ddp_amp.outputs import BEST_MODEL_FILE, MODEL_FILE

WHICH = ("auto", "best", "last")


def choose_source(source: Path, which: str) -> tuple[Path, dict[str, Any] | None]:
    """(the weights file to export, the run's config where one is known). A run directory gives its best
    (model_best.pt), its last (model.pt, else its newest checkpoint), or with auto the best where it kept one."""
    from ddp_amp.checkpoint import storage

    if not source.exists():
        raise UsageError(f"export: {str(source)!r} does not exist")
    if source.is_dir() and (source / CONFIG_FILE).is_file():
        config = json.loads((source / CONFIG_FILE).read_text())
        best, last = source / BEST_MODEL_FILE, source / MODEL_FILE
        newest = next(iter(storage.checkpoints(source)), None)
        if which == "best" and not best.exists():
            raise UsageError(f"export --which best: {str(source)!r} kept no {BEST_MODEL_FILE} (train with --keep-best)")
        chosen = best if which == "best" or (which == "auto" and best.exists()) else last if last.exists() else newest
        if chosen is None or not chosen.exists():
            raise UsageError(f"export: {str(source)!r} holds no weights yet (no {MODEL_FILE}, no checkpoint)")
        return chosen, config
    if source.is_dir() and not storage.sharded.is_complete(source):
        return source, None  # a save_pretrained directory
    try:
        config = storage.read_metadata(source)["config"]  # a checkpoint knows its run
    except storage.CheckpointError:
        config = None
    return source, config


def export(source: Path, *, output: Path | None, hf: Path | None, which: str = "auto") -> list[str]:
    """Write what was asked; one line per file written."""
    from ddp_amp.checkpoint.weights import WeightsError, read_weights, save_pretrained, save_weights_file

    if output is None and hf is None:
        raise UsageError("export: give -o OUT.pt|OUT.safetensors, --hf DIR, or both")
    if output is not None and output.suffix not in (".pt", ".bin", ".safetensors"):
        raise UsageError(f"-o {str(output)!r}: the file's suffix chooses its format: .pt, .bin or .safetensors")
    for flag, path in (("-o", output), ("--hf", hf)):
        if path is not None and path.exists():
            raise UsageError(f"{flag} {str(path)!r} already exists; remove it or choose another name")
    if output is not None and checksum_file_of(output).exists():  # written beside the file: never another's replaced
        raise UsageError(f"-o {str(output)!r}: {str(checksum_file_of(output))!r} (where its checksum goes) already "
                         "exists; remove it or choose another name")
    for flag, path in (("-o", output), ("--hf", hf)):
        if path is not None and not path.resolve().parent.is_dir():
            raise UsageError(f"{flag} {str(path)!r}: directory {str(path.parent)!r} does not exist")
        if path is not None and not os.access(path.resolve().parent, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {str(path)!r}: directory {str(path.parent)!r} is not writable")
    chosen, config = choose_source(source, which)
    try:
        state = read_weights(chosen)
    except WeightsError as exc:
        raise UsageError(f"export: {exc}") from None
    written = []
    if output is not None:
        try:
            save_weights_file(state, output)
        except OSError as exc:  # a full disk, say: its atomic write left nothing behind
            raise UsageError(f"-o {str(output)!r} cannot be written: {exc.strerror or exc}") from None
        written.append(f"ddp-amp: wrote {output} ({len(state)} tensors from {chosen})")
    if hf is not None:
        model = _model_with(state, config, source)
        if save_pretrained(model, hf) is None:
            raise UsageError(f"--hf: the model of --task {config['task']} has no save_pretrained (nor a .pretrained "
                             "attribute with one); export a state_dict with -o instead")
        written.append(f"ddp-amp: wrote {hf}/ with save_pretrained (from {chosen})")
    return written


def _model_with(state: dict, config: dict[str, Any] | None, source: Path):
    """The run's model, built by its task as the ranks built it, holding `state`."""
    import torch

    from ddp_amp.checkpoint.weights import fit
    from ddp_amp.tasks import build_task

    if config is None:
        raise UsageError(f"--hf: {str(source)!r} does not say which task made it: export from the run directory "
                         "or one of its checkpoints")
    torch.manual_seed(config.get("seed", 0))
    model = build_task(config["task"], config.get("task_arg") or ()).model
    result = fit(state, model.state_dict())
    if problems := result.problems(strict=True):
        raise UsageError(f"--hf: the weights do not fit the model of --task {config['task']}: " + "; ".join(problems))
    model.load_state_dict(result.loadable)
    return model
