"""The run directory's result files (model.pt, summary.json, metrics.jsonl), written so that a crash never
leaves a half-written one behind. No torch at import: the launcher reads these files too."""

from __future__ import annotations

import errno
import io
import json
import math
import os
from pathlib import Path
from typing import Any

from ddp_amp.files import atomic_write

MODEL_FILE = "model.pt"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
STEP_TIMES_FILE = "step_times.json"  # only from the bench job (ddp-amp bench): every rank's step durations
OUT_OF_MEMORY_FILE = "out_of_memory-rank{rank}.json"
"""bench --max-batch --shard full: a rank's trial ran out of memory (the launch fails; the launcher reads it)."""
DOCTOR_FILE = "doctor.json"  # only from the doctor job (ddp-amp doctor): every rank's figures, written by rank 0
DUMP_DIR = "flight_recorder"  # a failed or stalled rank's flight record: DUMP_DIR/rank<N>.json


BEST_MODEL_FILE = "model_best.pt"  # --keep-best: the weights of the best evaluation so far
LOOP_RECORD_FILE = "loop.json"  # a script using ddp_amp.loop: its loop's account, put in summary.json by the launcher
PRETRAINED_DIR = "pretrained"  # a model with save_pretrained: its own format, written at the end


def save_weights(run_dir: Path, state_dict: dict[str, Any], name: str = MODEL_FILE) -> Path:
    """A model's plain state_dict (no DDP `module.` prefix, CPU tensors), loadable with weights_only=True."""
    import torch

    state = {name: _own_storage(tensor.detach().cpu()) for name, tensor in state_dict.items()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = run_dir / name
    atomic_write(path, buffer.getvalue())
    return path


def _own_storage(tensor: Any) -> Any:
    """A view into a larger buffer (--shard optimizer's parameter buckets) copied out: torch.save writes a
    tensor's whole storage, so the file would hold the buffer and differ from --shard none's."""
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size() else tensor


def strict(record: dict[str, Any]) -> dict[str, Any]:
    """The record with every inf/NaN float (at any depth) as null, and their keys listed under "nonfinite":
    json.dumps would otherwise write bare NaN/Infinity tokens, which strict JSON readers reject."""
    found: list[str] = []

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            found.append(key)
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, key) for v in value]
        return value

    cleaned = clean(record, "")
    if found:
        cleaned["nonfinite"] = sorted(set(found))
    return cleaned


def write_json(path: Path, value: Any) -> Path:
    if isinstance(value, dict):
        value = strict(value)
    atomic_write(path, (json.dumps(value, indent=2, sort_keys=True, allow_nan=False) + "\n").encode())
    return path


def failure_of(summary: dict[str, Any], run_dir: str | Path) -> str | None:
    """The one line that fails a run whose ranks all finished: divergence, a --keep-best metric never logged, or
    an evaluation that raised."""
    if diverged := summary.get("diverged"):
        where = f"step {diverged['step']}" + (f" on rank {diverged['rank']}" if diverged.get("rank") is not None
                                               else "")
        kept = (f"; the newest finite checkpoint is {summary['checkpoint']} (--resume {summary['checkpoint']})"
                if summary.get("checkpoint") else "")
        return (f"training diverged at {where}: {diverged['reason']}; no model.pt written (see --max-nonfinite)"
                f"{kept}")
    if summary.get("keep_best_error"):
        return (f"{summary['keep_best_error']}: no {BEST_MODEL_FILE} kept; the trained weights are in "
                f"{Path(run_dir) / MODEL_FILE}")
    if summary.get("eval_error"):
        return (f"{summary['eval_error']} (the trained weights are in {Path(run_dir) / MODEL_FILE}; the traceback "
                f"in {Path(run_dir) / 'logs'}/)")
    return None


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    return write_json(run_dir / SUMMARY_FILE, summary)


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """The run's summary.json, or {} when there is none (yet) or it cannot be read."""
    try:
        return json.loads((Path(run_dir) / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    """One short line per log interval, written in one call: a reader sees whole lines only. A write that
    fails part-way (disk full) is cut back off, so the file never ends in half a line."""
    line = (json.dumps(strict(record), sort_keys=True, allow_nan=False) + "\n").encode()
    fd = os.open(run_dir / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"short write to {METRICS_FILE}")
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)



def cut_metrics(run_dir: Path, step: int) -> None:
    """Drop the metrics logged after `step`: the resumed run logs those steps again."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line).get("step", 0) <= step]
    atomic_write(path, "".join(kept).encode())

