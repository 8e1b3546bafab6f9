"""The run directory's files, written so that a crash never leaves a half-written one behind."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch

from ddp_amp.files import atomic_write

MODEL_FILE = "model.pt"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
STEP_TIMES_FILE = "step_times.json"  # only with record_step_times (ddp-amp bench): every rank's step durations


def save_weights(run_dir: Path, model: torch.nn.Module) -> Path:
    """The plain state_dict (no DDP `module.` prefix, CPU tensors), loadable with weights_only=True."""
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = run_dir / MODEL_FILE
    atomic_write(path, buffer.getvalue())
    return path


def write_json(path: Path, value: Any) -> Path:
    atomic_write(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())
    return path


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    return write_json(run_dir / SUMMARY_FILE, summary)


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    # One short line per log interval, written in one call: a reader sees whole lines only.
    with open(run_dir / METRICS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
