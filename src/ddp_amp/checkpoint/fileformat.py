"""The checkpoint file: everything needed to continue a run bit for bit, as tensors and plain types only,
written atomically; finding the newest one that loads, pruning, and what a resume must share with it."""

from __future__ import annotations

import io
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddp_amp.files import atomic_write

CHECKPOINT_DIR = "checkpoints"
_CHECKPOINT_NAME = re.compile(r"^step-(\d+)\.pt$")
# What a resume must share with the run that wrote the checkpoint (the batches and the schedule depend on it).
MUST_MATCH = ("task", "batch_size", "grad_accum", "schedule", "warmup_steps", "min_lr_ratio", "steps", "epochs",
              "optimizer", "lr", "seed")


class CheckpointError(Exception):
    """A checkpoint that cannot be used: truncated, corrupt, or holding something other than plain data."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoints, newest (highest step) first."""
    found = []
    for path in checkpoint_dir(run_dir).glob("step-*.pt"):
        if match := _CHECKPOINT_NAME.match(path.name):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found, reverse=True)]


def save_checkpoint(run_dir: str | Path, state: dict[str, Any], keep: int) -> Path:
    """Write step-<N>.pt atomically (temporary file, fsync, rename: a kill at any instant leaves the previous
    checkpoint whole), then delete all but the newest `keep`."""
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = directory / f"step-{state['step']}.pt"
    atomic_write(path, buffer.getbuffer())
    for old in checkpoints(run_dir)[keep:]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """torch.load with weights_only=True: tensors and plain types only. Anything else (a pickled object, whose
    code would run on loading) is refused, never unpickled."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: refused, it holds more than tensors and plain data ({first})") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except Exception as exc:  # truncated zip, corrupt data: torch raises several types
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not {"step", "trainer", "rng", "config", "world_size"} <= state.keys():
        raise CheckpointError(f"{path}: not a ddp-amp checkpoint")
    return state


def newest_valid_checkpoint(run_dir: str | Path, warn=print, accept=lambda state: True
                            ) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads (and that `accept` takes); newer ones that do not load (a write cut
    short) are skipped with a warning."""
    for path in checkpoints(run_dir):
        try:
            state = load_checkpoint(path)
        except CheckpointError as exc:
            warn(f"skipping checkpoint {exc}")
            continue
        if accept(state):
            return path, state
    return None


def mismatches(checkpoint_config: dict[str, Any], checkpoint_world_size: int, config: dict[str, Any],
               world_size: int | None) -> list[str]:
    """What differs between a checkpoint's run and the run resuming it, as flags ("--batch-size 16
    (checkpoint: 32)"); world_size None: not known yet (checked again by the ranks)."""
    differ = []
    if world_size is not None and world_size != checkpoint_world_size:
        differ.append(f"world size {world_size} (checkpoint: {checkpoint_world_size})")
    for name in MUST_MATCH:
        if config.get(name) != checkpoint_config.get(name):
            differ.append(f"--{name.replace('_', '-')} {config.get(name)} (checkpoint: {checkpoint_config.get(name)})")
    return differ


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
