"""`ddp-amp verify`: whether a run's checkpoints and weights files hold the bytes written, checked against the
checksums written with them (checkpoint.storage.damage_of, files.damage_of), without training; for a run copied
between machines or kept a long time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddp_amp.errors import UsageError
from ddp_amp.files import damage_of, not_a_torch_file, recorded_checksum
from ddp_amp.outputs import BEST_MODEL_FILE, MODEL_FILE


@dataclass(frozen=True)
class Verdict:
    path: Path
    status: str
    """ok (its checksum matches), damaged, unreadable (it cannot be loaded), or unchecked (no checksum was written
    with it, and it loads)."""
    why: str = ""


def verify(path: Path) -> list[Verdict]:
    """Every checkpoint of the run dir `path` (newest first), then model.pt and model_best.pt; or the one
    checkpoint or weights file `path` is."""
    from ddp_amp.checkpoint import sharded, storage

    if not path.exists():
        raise UsageError(f"verify {path}: no such file or directory")
    if path.is_file() or sharded.is_complete(path):
        checkpoints, weights = ([path], []) if storage.sidecar(path).is_file() or path.is_dir() else ([], [path])
    elif (path / storage.CHECKPOINT_DIR).is_dir() or (path / MODEL_FILE).is_file():
        checkpoints = storage.checkpoints(path)
        weights = [path / name for name in (MODEL_FILE, BEST_MODEL_FILE) if (path / name).is_file()]
    else:
        raise UsageError(f"verify {path}: neither a run directory (no checkpoints/ or {MODEL_FILE} in it), a "
                         "checkpoint nor a weights file")
    return [_checkpoint(storage, sharded, p) for p in checkpoints] + [_weights(p) for p in weights]


def _checkpoint(storage, sharded, path: Path) -> Verdict:
    """Loaded as a resume would load it (the checksums first, then the file itself: a torn file has none to
    fail)."""
    try:
        storage.load_checkpoint(path)
    except storage.CheckpointError as exc:
        damaged = str(exc).startswith(f"{path}: damaged, ")
        return Verdict(path, "damaged" if damaged else "unreadable",
                       str(exc).removeprefix(f"{path}: damaged, " if damaged else f"{path}: "))
    recorded = sharded.read_checksums(path) if path.is_dir() else storage.read_sidecar_checksum(path)
    return Verdict(path, "ok") if recorded else Verdict(path, "unchecked", "no checksum recorded (written before "
                                                                           "checksums)")


def _weights(path: Path) -> Verdict:
    if damage := damage_of(path):
        return Verdict(path, "damaged", damage.removeprefix(f"{path}: damaged, "))
    if recorded_checksum(path) is None:  # nothing proves its bytes: at least it must load
        if why := _unloadable_because(path):
            return Verdict(path, "unreadable", why)
        return Verdict(path, "unchecked", "no checksum recorded beside it")
    return Verdict(path, "ok")


def _unloadable_because(path: Path) -> str | None:
    """Why the weights file `path` cannot be loaded (a torn or foreign file), or None: opened as export and
    --init-from would open it, its tensors left on disk (mmap, safetensors' header)."""
    import torch

    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as file:
                file.keys()
            return None
        if why := not_a_torch_file(path):
            return why
        # mmap needs torch.save's zip format; a legacy pickle (its first byte 0x80) is loaded whole.
        with open(path, "rb") as file:
            legacy = file.read(1) == b"\x80"
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=not legacy)
    except Exception as exc:  # a truncated archive, a header that is not JSON, ...
        text = str(exc).strip()
        return f"cannot be loaded ({type(exc).__name__}{': ' + text.splitlines()[0][:160] if text else ''})"
    if isinstance(state, dict) and {"trainer", "step", "config"} <= state.keys():  # a checkpoint without sidecar
        return None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return "holds no state_dict (a mapping of names to tensors)"
    return None


def report(verdicts: list[Verdict]) -> tuple[list[str], int]:
    """The lines to print (one per file, then the count) and the exit code: 1 when anything is damaged or
    unreadable, else 0."""
    lines = [f"{v.status:<10} {v.path}" + (f": {v.why}" if v.why else "") for v in verdicts]
    counts = {status: sum(v.status == status for v in verdicts) for status in ("ok", "damaged", "unreadable",
                                                                                "unchecked")}
    lines.append(f"{len(verdicts)} file{'s' if len(verdicts) != 1 else ''}: "
                 + ", ".join(f"{n} {status}" for status, n in counts.items() if n or status == "ok"))
    return lines, 1 if counts["damaged"] or counts["unreadable"] else 0
