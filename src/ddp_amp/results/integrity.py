"""`ddp-amp verify`: whether a run's checkpoints and weights files hold the bytes written, checked against the
checksums written with them (checkpoint.storage.damage_of, files.damage_of), without training; for a run copied
between machines or kept a long time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddp_amp.errors import UsageError
from ddp_amp.files import (
    CHECKSUM_ALGORITHM,
    CHECKSUM_SUFFIX,
    UNREADABLE_RECORD,
    checksum_file_of,
    damage_of,
    not_a_torch_file,
    read_checksum_record,
    recorded_checksum,
)
from ddp_amp.outputs import BEST_MODEL_FILE, MODEL_FILE

TEXT_SUFFIXES = (".json", ".jsonl", ".toml", ".log", ".txt", ".yaml", ".yml", ".md", ".csv")
"""What no weights file is (a run's config.json, metrics.jsonl, a log): refused as input, not called unreadable."""


@dataclass(frozen=True)
class Verdict:
    path: Path
    status: str
    """ok (its checksum matches), damaged, unreadable (it cannot be loaded), or unchecked (no checksum was written
    with it, and it loads)."""
    why: str = ""


def verify(path: Path) -> list[Verdict]:
    """Every checkpoint of the run dir `path` (newest first), then model.pt and model_best.pt; or the one
    checkpoint or weights file `path` is. A file missing beside its checksum record is damaged (ddp-amp writes
    a file before its record and removes the record first); one a launch pruned while this read is left out."""
    from ddp_amp.checkpoint import sharded, storage

    if not path.exists():
        raise UsageError(f"verify {path}: no such file or directory")
    if (recorded := _recorded_by(storage, path)) is not None:
        raise UsageError(f"verify {path}: the record written beside {recorded}, not a checkpoint or weights "
                         f"file; verify {recorded} or the run directory")
    if why := storage.part_of_a_checkpoint(path):  # its checksum is in the checkpoint's manifest, checked with it
        raise UsageError(f"verify {path}: {why}, or the run directory")
    if path.is_file() and path.suffix in TEXT_SUFFIXES:
        raise UsageError(f"verify {path}: a {path.suffix} file, not a checkpoint or weights file; verify the run "
                         "directory, a checkpoint or a weights file")
    if path.is_file() or _sharded_checkpoint(sharded, path):
        checkpoints, weights = ([path], []) if storage.sidecar(path).is_file() or path.is_dir() else ([], [path])
        return [_checkpoint(storage, sharded, p) for p in checkpoints] + [_weights(p) for p in weights]
    names = (MODEL_FILE, BEST_MODEL_FILE)
    if not ((path / storage.CHECKPOINT_DIR).is_dir() or any((path / name).is_file()
                                                           or checksum_file_of(path / name).is_file()
                                                           for name in names)):
        raise UsageError(f"verify {path}: neither a run directory (no checkpoints/ or {MODEL_FILE} in it), a "
                         "checkpoint nor a weights file")
    found = [_checkpoint(storage, sharded, p) for p in storage.checkpoints(path)]
    lost = [Verdict(p, "damaged", f"missing (its {record.name} is there)") for p, record in _lost(storage, path)]
    weights = [_weights(path / name) for name in names
               if (path / name).is_file() or checksum_file_of(path / name).is_file()]
    return [verdict for verdict in found if verdict is not None] + lost + weights


def _recorded_by(storage, path: Path) -> Path | None:
    """The checkpoint or weights file whose checksum record the file `path` is (step-N.json, model.pt.checksum),
    or None."""
    if not path.is_file():
        return None
    if path.name.endswith(CHECKSUM_SUFFIX):
        return path.with_name(path.name.removesuffix(CHECKSUM_SUFFIX))
    if path.suffix == ".json" and storage.CHECKPOINT_NAME.match(path.stem):
        single = path.with_suffix(".pt")
        return single if single.is_file() or not path.with_suffix("").is_dir() else path.with_suffix("")
    return None


def _sharded_checkpoint(sharded, path: Path) -> bool:
    """A sharded checkpoint's directory, whole or with a part lost: its DCP files, or the manifest of them."""
    return sharded.is_complete(path) or (path / sharded.CHECKSUMS_FILE).is_file()


def _lost(storage, run_dir: Path) -> list[tuple[Path, Path]]:
    """(checkpoint, its sidecar) of every sidecar whose checkpoint is gone: step-N.pt where the sidecar holds its
    checksum, else step-N (it could have been either format)."""
    lost = []
    for record in sorted(storage.checkpoint_dir(run_dir).glob("step-*.json"), reverse=True):
        stem = record.with_suffix("")
        if storage.CHECKPOINT_NAME.match(stem.name) and not stem.exists() and not stem.with_suffix(".pt").exists():
            single = read_checksum_record(record, key="checksum") is not None
            lost.append((stem.with_suffix(".pt") if single else stem, record))
    return lost


def _checkpoint(storage, sharded, path: Path) -> Verdict | None:
    """Loaded as a resume would load it (the checksums first, then the file itself: a torn file has none to
    fail). None when it is gone, file and sidecar, by the time it is read: a launch pruned it (--keep)."""
    try:
        storage.load_checkpoint(path)
    except storage.CheckpointError as exc:
        if not path.exists() and not storage.sidecar(path).exists():
            return None
        damaged = str(exc).startswith(f"{path}: damaged, ")
        return Verdict(path, "damaged" if damaged else "unreadable",
                       str(exc).removeprefix(f"{path}: damaged, " if damaged else f"{path}: "))
    if path.is_dir():
        records = list(sharded.read_checksums(path).values())
    else:
        records = [recorded] if (recorded := storage.read_sidecar_checksum(path)) else []
    if not records:
        return Verdict(path, "unchecked", "no checksum recorded (written before checksums)")
    return _unknown_algorithm(path, records) or Verdict(path, "ok")


def _unknown_algorithm(path: Path, records: list[dict]) -> Verdict | None:
    """`unchecked` where a checksum is of an algorithm this version does not know (files.checksum_mismatch
    checks nothing then)."""
    unknown = sorted({str(r.get("algorithm")) for r in records} - {CHECKSUM_ALGORITHM})
    if not unknown:
        return None
    return Verdict(path, "unchecked", "its checksum is of an algorithm this version does not know "
                                      f"({', '.join(map(repr, unknown))})")


def _weights(path: Path) -> Verdict:
    if not path.exists():
        return Verdict(path, "damaged", f"missing (its {checksum_file_of(path).name} is there)")
    if damage := damage_of(path):
        return Verdict(path, "damaged", damage.removeprefix(f"{path}: damaged, "))
    if (recorded := recorded_checksum(path)) is not None and recorded is not UNREADABLE_RECORD:
        if unknown := _unknown_algorithm(path, [recorded]):
            return unknown if not (why := _unloadable_because(path)) else Verdict(path, "unreadable", why)
    if recorded is None:  # nothing proves its bytes: at least it must load
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
