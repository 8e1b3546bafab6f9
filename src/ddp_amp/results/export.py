"""`ddp-amp export`: a run's weights out of ddp-amp, as a plain state_dict (.pt or .safetensors) or in the model's
own format (`save_pretrained`), from a run directory, a checkpoint, or a weights file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ddp_amp.config import CONFIG_FILE
from ddp_amp.errors import RunFailed, UsageError
from ddp_amp.files import check_parent_dir, checksum_file_of, not_a_torch_file
from ddp_amp.outputs import BEST_MODEL_FILE, MODEL_FILE


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
    if source.is_file() and source.suffix != ".safetensors" and (why := not_a_torch_file(source)):  # config.json
        raise UsageError(f"export {str(source)!r}: {why}; export takes a run directory, a checkpoint, a weights "
                         "file (.pt, .bin, .safetensors) or a save_pretrained directory")
    try:  # a checkpoint knows its run (from its sidecar step-N.json)
        config = storage.read_metadata(source).get("config") if storage.sidecar(source) != source else None
    except storage.CheckpointError:
        config = None
    return source, config if isinstance(config, dict) else None


def export(source: Path, *, output: Path | None, hf: Path | None, which: str = "auto") -> list[str]:
    """Write what was asked; one line per file written. Everything that can be checked is checked before
    anything is written (the model's save_pretrained too): a refusal leaves nothing behind."""
    _check_outputs(output, hf)
    chosen, config = choose_source(source, which)
    if hf is None:
        return write(chosen, None, source, output, None)
    if config is None:
        raise UsageError(f"--hf: {str(source)!r} does not say which task made it: export from the run directory "
                         "or one of its checkpoints")
    # The task's factory is the user's code: it runs in a child, never in this process (process.call_spawned).
    from ddp_amp.process import ChildDied, call_spawned

    try:
        return call_spawned(write, chosen, config, source, output, hf)
    except ChildDied as exc:  # the task's code ended the process (os._exit, a crash)
        raise RunFailed(f"--hf: building the model of --task {config['task']} ended its process ({exc})") from None


def _check_outputs(output: Path | None, hf: Path | None) -> None:
    if output is None and hf is None:
        raise UsageError("export: give -o OUT.pt|OUT.safetensors, --hf DIR, or both")
    if output is not None and output.suffix not in (".pt", ".bin", ".safetensors"):
        raise UsageError(f"-o {str(output)!r}: the file's suffix chooses its format: .pt, .bin or .safetensors")
    for flag, path in (("-o", output), ("--hf", hf)):
        if path is not None and os.path.lexists(path):  # a dangling symlink too: never replaced
            raise UsageError(f"{flag} {str(path)!r} already exists; remove it or choose another name")
    if output is not None and os.path.lexists(checksum_file_of(output)):  # written beside it: never another's
        raise UsageError(f"-o {str(output)!r}: {str(checksum_file_of(output))!r} (where its checksum goes) already "
                         "exists; remove it or choose another name")
    for flag, path in (("-o", output), ("--hf", hf)):
        if path is not None:
            check_parent_dir(path, flag)


def write(chosen: Path, config: dict[str, Any] | None, source: Path, output: Path | None, hf: Path | None
          ) -> list[str]:
    """The weights of `chosen` read, the task's model built with them where --hf asks (in a child: export), then
    written: --hf first (the user's save_pretrained), then -o; a failure removes what this call wrote."""
    import shutil

    from ddp_amp.checkpoint.weights import WeightsError, read_weights, save_pretrained, save_weights_file
    from ddp_amp.tasks.loading import USER_EXITS

    try:
        state = read_weights(chosen)
    except WeightsError as exc:
        raise UsageError(f"export: {exc}") from None
    model = _model_with(state, config) if hf is not None else None
    written = []
    if hf is not None:
        try:
            save_pretrained(model, hf)
        except USER_EXITS as exc:  # the model's own code, or the disk: its staging directory is gone already
            why = _one_line(exc) if isinstance(exc, Exception) else (
                f"it called sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else "KeyboardInterrupt")
            raise RunFailed(f"--hf {str(hf)!r}: save_pretrained of the model of --task {config['task']} failed: "
                            f"{why}") from None
        written.append(f"ddp-amp: wrote {hf}/ with save_pretrained (from {chosen})")
    if output is not None:
        try:
            save_weights_file(state, output)
        except OSError as exc:  # a full disk, say: its atomic write left nothing behind
            if hf is not None:
                shutil.rmtree(hf, ignore_errors=True)
            raise UsageError(f"-o {str(output)!r} cannot be written: {exc.strerror or exc}") from None
        written.insert(0, f"ddp-amp: wrote {output} ({len(state)} tensors from {chosen})")
    return written


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def _model_with(state: dict, config: dict[str, Any]):
    """The run's model, built by its task as the ranks built it, holding `state`; refused where it has no
    save_pretrained or the weights do not fit it."""
    import torch

    from ddp_amp.checkpoint.weights import fit, pretrained_of
    from ddp_amp.tasks import build_task

    torch.manual_seed(config.get("seed", 0))
    task = config["task"]
    try:
        model = build_task(task, config.get("task_arg") or ()).model
    except UsageError:  # a --task or --task-arg that no longer resolves (a moved file): said by the loader
        raise
    except Exception as exc:  # the task's own code failed: its fault, not the arguments'
        raise RunFailed(f"--task {task}: building its model for --hf failed: {_one_line(exc)}") from None
    if pretrained_of(model) is None:
        raise UsageError(f"--hf: the model of --task {task} has no save_pretrained (nor a .pretrained attribute "
                         "with one); export a state_dict with -o instead")
    result = fit(state, model.state_dict())
    if problems := result.problems(strict=True):
        raise UsageError(f"--hf: the weights do not fit the model of --task {task}: " + "; ".join(problems))
    model.load_state_dict(result.loadable)
    return model
