"""Checkpoints on disk (checkpoint.formats says how each format stages and writes one; this module, what both
share): the checkpoints directory and its names, the sidecar of metadata beside each, the single file written
atomically and loaded weights-only (tensors and plain types only), finding the newest one that loads, pruning,
the random states, and what a resume must share with the run that saved it."""

from __future__ import annotations

import io
import json
import pickle
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddp_amp.checkpoint import sharded
from ddp_amp.config import CONFIG_FILE
from ddp_amp.files import UNREADABLE_RECORD, atomic_write, checksum_mismatch, not_a_torch_file, read_checksum_record
from ddp_amp.files import damage_of as file_damage

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_NAME = re.compile(r"^step-(\d+)(\.pt)?$")
"""step-<N>.pt (one file) or step-<N>/ (--checkpoint-format sharded: a DCP directory, checkpoint.sharded)."""
# What a resume must share with the run that wrote the checkpoint (the batches and the schedule depend on it).
MUST_MATCH = ("task", "batch_size", "grad_accum", "schedule", "warmup_steps", "min_lr_ratio", "steps", "epochs",
              "optimizer", "lr", "seed")


METADATA = ("step", "world_size", "config", "saved_at")
"""What choosing a checkpoint needs, kept in its sidecar (the config holds the launch time; saved_at, the
time.time() of the save, is absent from checkpoints written before it was)."""


class CheckpointError(Exception):
    """A checkpoint that cannot be used: truncated, corrupt, or holding something other than plain data."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoints, newest first: the latest launch's, then the latest saved, then the highest step.

    A step number alone does not say which is newer: a run continued on another world size counts its steps
    as a run of that size would (2 ranks stopped at step 7, continued by 4 from their step 3 and stopped at 6:
    step-7.pt is the older). The launch time and the save time (metadata) order them; a checkpoint whose
    metadata cannot be read ranks last."""
    found = []
    for path in checkpoint_dir(run_dir).glob("step-*"):
        if (match := CHECKPOINT_NAME.match(path.name)) and (path.suffix == ".pt") != path.is_dir():
            try:
                metadata = read_metadata(path)
                when = (metadata["config"].get("launch_time") or 0.0, metadata.get("saved_at") or 0.0)
            except (CheckpointError, KeyError, TypeError, AttributeError):
                when = (-1.0, -1.0)
            found.append((when, int(match.group(1)), path))
    return [path for *_, path in sorted(found, key=lambda item: item[:2], reverse=True)]


def sidecar(path: Path) -> Path:
    """step-N.json beside step-N.pt (or step-N/): the checkpoint's metadata, read without loading it."""
    return path.with_suffix(".json")


def metadata_of(state: dict[str, Any]) -> dict[str, Any]:
    return {key: state.get(key) for key in METADATA}


def save_checkpoint(run_dir: str | Path, state: dict[str, Any], keep: int, protect_step: int | None = None, *,
                    checksum: bool = True) -> Path:
    """Write step-<N>.pt atomically (temporary file, fsync, rename: a kill at any instant leaves the previous
    checkpoint whole) and its metadata beside it, with the file's checksum (computed while it is written), then
    prune to `keep` (see prune). `checksum` False: none (benchmarks/checksums.py's baseline)."""
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = directory / f"step-{state['step']}.pt"
    # An earlier sidecar of this step (another launch's) goes first: a kill between the new file and its
    # sidecar must leave a file without a checksum (read as one written before checksums), never one beside
    # another file's checksum (read as damaged).
    sidecar(path).unlink(missing_ok=True)
    record = atomic_write(path, buffer.getbuffer(), checksum=checksum)
    write_sidecar(path, state, {"checksum": record} if record else {})
    drop_other_format(path)
    prune(run_dir, keep, state["config"].get("launch_time"), protect_step)
    return path


def write_sidecar(path: Path, state: dict[str, Any], checksums: dict[str, Any] | None = None) -> None:
    """The metadata, and `checksums`: {"checksum": record} of a single file (a sharded checkpoint keeps its
    files' in its own manifest, sharded.CHECKSUMS_FILE)."""
    atomic_write(sidecar(path), json.dumps({**metadata_of(state), **(checksums or {})}, sort_keys=True).encode())


def drop_other_format(path: Path) -> None:
    """After a checkpoint and its sidecar are in place: the other format's checkpoint of the same step goes
    (step-N.pt and step-N/ would share step-N.json, which now describes the new one). A run continued in the
    other format reaches a step again when it resumed from an earlier checkpoint or on another world size."""
    other = path.with_name(path.stem) if path.suffix == ".pt" else path.with_name(f"{path.name}.pt")
    if sharded.is_sharded_checkpoint(other):
        sharded.remove(other)
    elif other.is_file():
        other.unlink()


def prune(run_dir: str | Path, keep: int, launch_time: float | None, protect_step: int | None = None) -> None:
    """Keep the newest `keep` checkpoints, this launch's first: an earlier run's, whatever its steps (a longer
    run's reach higher), never outranks one this launch wrote. The best step's (--keep-best) is never pruned,
    and does not count against `keep`."""
    ranked = []
    for path in checkpoints(run_dir):
        if protect_step is not None and path.stem == f"step-{protect_step}":  # step-N.pt, or step-N/ (sharded)
            continue
        try:
            mine = read_metadata(path)["config"].get("launch_time") == launch_time
        except CheckpointError:
            mine = False  # unreadable: the first to go
        ranked.append((not mine, path))
    ranked.sort(key=lambda item: item[0])  # stable: newest first within each group
    for _, old in ranked[keep:]:
        sidecar(old).unlink(missing_ok=True)
        if sharded.is_sharded_checkpoint(old):
            sharded.remove(old)
        else:
            old.unlink(missing_ok=True)


def part_of_a_checkpoint(path: Path) -> str | None:
    """Why the file `path` is a piece of a checkpoint, not one (naming the checkpoint to give instead), or None: a
    file of a sharded checkpoint's directory, or a checkpoint's step-N.json record. Without this they read as a
    damaged checkpoint, or (extras.pt, which holds the step, config and schedule) as one without weights."""
    if not path.is_file():
        return None
    parent = path.parent
    # A part lost leaves the manifest beside the others; a manifest alone is no checkpoint (the name is common).
    if sharded.is_complete(parent) or (parent / sharded.CHECKSUMS_FILE).is_file() and (
            (parent / sharded.EXTRAS_FILE).is_file() or any(parent.glob("*.distcp"))):
        return f"a file of the sharded checkpoint {parent}, not a checkpoint; give {parent}"
    if path.suffix == ".json" and CHECKPOINT_NAME.match(path.stem):
        single = path.with_suffix(".pt")
        checkpoint = single if single.is_file() or not path.with_suffix("").is_dir() else path.with_suffix("")
        return f"the record written beside {checkpoint}, not a checkpoint; give {checkpoint}"
    return None


def not_a_checkpoint_because(path: Path) -> str | None:
    """Why `path`, given as one checkpoint (--resume PATH), is something else a run directory holds (saying what
    to give instead), or None: a piece of a checkpoint, the checkpoints directory or a run directory, which
    would otherwise read as a sharded checkpoint left incomplete."""
    if why := part_of_a_checkpoint(path):
        return why
    if not path.is_dir() or CHECKPOINT_NAME.match(path.name):  # step-N/ itself: complete, or a damaged one
        return None
    if (path / CHECKPOINT_DIR).is_dir() or (path / CONFIG_FILE).is_file():
        return (f"a run directory, not a checkpoint; give one of its checkpoints ({CHECKPOINT_DIR}/step-N.pt or "
                f"step-N/), or continue from its newest with --resume auto --run-dir {path}")
    if path.name == CHECKPOINT_DIR:
        return ("a run's directory of checkpoints, not a checkpoint; give one of them (step-N.pt or step-N/), or "
                f"continue from the newest with --resume auto --run-dir {path.parent}")
    return None


def read_metadata(path: Path) -> dict[str, Any]:
    """A checkpoint's step, world size, config and launch: from its sidecar, else (a checkpoint written before
    sidecars, or one whose sidecar a kill prevented) from the file itself, memory-mapped, so that its tensors
    are never read into memory."""
    try:
        return json.loads(sidecar(path).read_text())
    except (OSError, ValueError):
        pass
    state = load_checkpoint(path, mmap=True)
    return metadata_of(state)


def load_checkpoint(path: str | Path, *, mmap: bool = False, verify: bool = True) -> dict[str, Any]:
    """torch.load with weights_only=True: tensors and plain types only. Anything else (a pickled object, whose
    code would run on loading) is refused, never unpickled. mmap: tensors stay on disk until used.

    `verify` (and not mmap, which reads metadata only): the checkpoint's files are first checked against the
    checksums written with them (damage_of); a mismatch is a CheckpointError naming the file, as a torn file is.
    A checkpoint written before checksums is loaded without.

    A sharded checkpoint (a directory) gives its extras: everything but the model and the optimizer, which the
    ranks read together (sharded.load_local_state); state["format"] is "sharded" then."""
    path = Path(path)
    if why := not_a_checkpoint_because(path):
        raise CheckpointError(f"{path}: {why}")
    if verify and not mmap and not sharded.is_sharded_checkpoint(path) and \
            (recorded := read_sidecar_checksum(path)) is not None:
        return _load_verified(path, recorded)
    if verify and not mmap and (damage := damage_of(path)):  # first: damage can also make a file unreadable
        raise CheckpointError(damage)
    if sharded.is_sharded_checkpoint(path):
        if not sharded.is_complete(path):
            raise CheckpointError(f"{path}: incomplete (no {sharded.DCP_METADATA_FILE} or {sharded.EXTRAS_FILE})")
        if why := sharded.unreadable_because(path):
            raise CheckpointError(f"{path}: unreadable, {why}")
    try:
        state = (sharded.read_extras(path) if sharded.is_sharded_checkpoint(path)
                 else torch.load(path, map_location="cpu", weights_only=True, mmap=mmap))
    except pickle.UnpicklingError as exc:
        if why := not_a_torch_file(path):  # torch's message would blame a pickle there is not
            raise CheckpointError(f"{path}: {why}") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: refused, it holds more than tensors and plain data ({first})") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except Exception as exc:  # truncated zip, corrupt data: torch raises several types
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not {"step", "trainer", "rng", "config", "world_size"} <= state.keys():
        raise CheckpointError(f"{path}: not a ddp-amp checkpoint")
    if state.get("format") == "sharded" and not path.is_dir():  # extras.pt moved out of its directory
        raise CheckpointError(f"{path}: the extras of a sharded checkpoint, without its parts; give its step-N "
                              "directory")
    return state


def _load_verified(path: Path, recorded: dict[str, Any]) -> dict[str, Any]:
    """A single file loaded while its checksum is computed on another thread (zlib's CRC and the reads release
    the GIL; both read the same pages), so that the check costs a resume little beside the load itself; the
    state is returned only once the bytes matched. A damaged file is named as damaged, whatever the load made
    of its bytes."""
    if recorded is UNREADABLE_RECORD:
        raise CheckpointError(f"{path}: damaged, its {sidecar(path).name} is unreadable")
    with ThreadPoolExecutor(1, thread_name_prefix="ddp-amp-checksum") as pool:
        checking = pool.submit(checksum_mismatch, path, recorded)
        try:
            state = load_checkpoint(path, verify=False)
        except CheckpointError:
            if mismatch := checking.result():
                raise CheckpointError(f"{path}: damaged, {mismatch}") from None
            raise
        if mismatch := checking.result():
            raise CheckpointError(f"{path}: damaged, {mismatch}")
    return state


def damage_of(path: Path) -> str | None:
    """Why a checkpoint's bytes are not those written ("PATH: damaged, ..." naming the file that differs and
    how), from the checksums written with it: a single file's in its sidecar, a sharded one's in its manifest.
    None when every file matches, or when it carries no checksum (written before checksums were)."""
    if sharded.is_sharded_checkpoint(path):
        if (records := sharded.read_checksums(path)) is None:
            return f"{path}: damaged, its {sharded.CHECKSUMS_FILE} is unreadable"
        for name, recorded in records.items():
            if not (path / name).is_file():
                return f"{path}: damaged, its part {name} is missing"
            if mismatch := checksum_mismatch(path / name, recorded):
                return f"{path}: damaged, {name}: {mismatch}"
        return None
    return file_damage(path, sidecar(path), key="checksum")


def read_sidecar_checksum(path: Path) -> dict[str, Any] | None:
    """A single-file checkpoint's checksum record, from its sidecar (files.read_checksum_record's answers: None
    also where the sidecar is missing, a kill between the file and its sidecar)."""
    return read_checksum_record(sidecar(path), key="checksum")


def nonfinite_tensors(state: Any, where: str = "") -> list[str]:
    """Where `state` (a checkpoint's trainer state, at any depth) holds inf or NaN floats."""
    if isinstance(state, torch.Tensor):
        return [where] if state.is_floating_point() and not bool(torch.isfinite(state).all()) else []
    if isinstance(state, dict):
        return [name for key, value in state.items() for name in nonfinite_tensors(value, f"{where}.{key}")]
    if isinstance(state, (list, tuple)):
        return [name for i, value in enumerate(state) for name in nonfinite_tensors(value, f"{where}[{i}]")]
    return []


def newest_valid_checkpoint(run_dir: str | Path, warn=print, accept=lambda metadata: True, *, verify: bool = True
                            ) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint whose metadata `accept` takes and that loads whole and finite; newer ones that do
    not load (a write cut short) or hold inf/NaN are skipped with a warning. Only metadata is read to choose,
    so at most one checkpoint is in memory at once."""
    for path in checkpoints(run_dir):
        try:
            if not accept(read_metadata(path)):
                continue
            state = load_checkpoint(path, verify=verify)
        except CheckpointError as exc:
            warn(f"skipping checkpoint {exc}")
            continue
        if bad := nonfinite_tensors(state["trainer"]):
            warn(f"skipping checkpoint {path}: inf/NaN in {bad[0].lstrip('.')}")
            continue
        return path, state
    return None


def mismatches(checkpoint_config: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's run and the run resuming it, as flags ("--batch-size 16
    (checkpoint: 32)"). The world size may differ: the data and the schedule follow (train.data, Trainer)."""
    differ, said = [], set()
    if {"steps", "epochs"} <= checkpoint_config.keys() and \
            (config.get("epochs") is None) != (checkpoint_config.get("epochs") is None):
        # One run counted in steps, the other in epochs: one difference, named by the flag each run was given
        # (as two, it read "--epochs None (checkpoint: 1)", a flag nobody passed)
        differ.append(f"{_length(config)} (checkpoint: {_length(checkpoint_config)})")
        said = {"steps", "epochs"}
    for name in MUST_MATCH:
        if name not in checkpoint_config or name in said:  # not recorded (a script loop's before it had the
            continue                                         # core's config), or said above
        if config.get(name) != checkpoint_config.get(name):
            differ.append(f"{_flag(name, config)} (checkpoint: {checkpoint_config.get(name)})")
    return differ


def _length(config: dict[str, Any]) -> str:
    """How long a run is, as the flag it was given: --epochs N, else --steps N."""
    return _flag("epochs", config) if config.get("epochs") is not None else _flag("steps", config)


def _flag(name: str, config: dict[str, Any]) -> str:
    """`name`'s flag and value in the resuming run, marked where it is the default: a user who forgot a flag
    on the resume reads "--steps 100, the default", not a --steps 100 they never typed."""
    import dataclasses

    from ddp_amp.config import DEFAULT_STEPS, TrainConfig

    # --steps' default is DEFAULT_STEPS where no --epochs is given (TrainConfig's field says None)
    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)} | {"steps": DEFAULT_STEPS}
    value = config.get(name)
    return f"--{name.replace('_', '-')} {value}" + (", the default" if defaults.get(name, ...) == value else "")


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random states as tensors and plain types (numpy's array becomes a tensor)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))


def to_host(value: Any) -> Any:
    """A copy in host memory, each tensor with storage of its own: training goes on changing the originals while the
    copy is written (and a view of a larger buffer would save the whole buffer)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: to_host(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(item) for item in value)
    return value
