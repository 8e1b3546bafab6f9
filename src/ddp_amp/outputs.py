"""The run directory's result files (model.pt, summary.json, metrics.jsonl), written so that a crash never
leaves a half-written one behind. No torch at import: the launcher reads these files too."""

from __future__ import annotations

import errno
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_amp.files import atomic_write, checksum_file_of, write_checksum

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
TRACKERS_FILE = "trackers.json"  # --tracker: each tracker's run id, continued by every later attempt


def save_weights(run_dir: Path, state_dict: dict[str, Any], name: str = MODEL_FILE) -> Path:
    """A model's plain state_dict (no DDP `module.` prefix, CPU tensors), loadable with weights_only=True; or
    several, {model name: state_dict} (a script loop's models)."""
    import torch

    state = {name: {key: _own_storage(inner.detach().cpu()) for key, inner in value.items()}
             if isinstance(value, dict) else _own_storage(value.detach().cpu()) for name, value in state_dict.items()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = run_dir / name
    checksum_file_of(path).unlink(missing_ok=True)  # a kill before the new one is written: unchecked, not damaged
    write_checksum(path, atomic_write(path, buffer.getbuffer(), checksum=True))  # model.pt.checksum
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


def write_json_report(path: Path, report: dict[str, Any], command: str) -> None:
    """bench's and doctor's --json: the report with ddp-amp's mark, which lets a later --json replace it (and
    nothing else: commands.options.check_json_path)."""
    from ddp_amp.files import WRITTEN_BY, write_report

    text = json.dumps(strict({**report, "written_by": f"{WRITTEN_BY} {command}"}), indent=2, sort_keys=True,
                      allow_nan=False) + "\n"
    write_report(path, "--json", lambda temporary: temporary.write_text(text))


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    return write_json(run_dir / SUMMARY_FILE, summary)


def read_summary(run_dir: str | Path) -> RunRecord:
    """The run's summary.json, empty (false) when there is none (yet) or it cannot be read."""
    try:
        record = json.loads((Path(run_dir) / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return RunRecord({})
    return RunRecord(record if isinstance(record, dict) else {})


@dataclass(frozen=True)
class Divergence:
    step: int
    rank: int | None
    reason: str


class _Key:
    """A key of summary.json read as an attribute of RunRecord (its name is the key); None where the run did not
    write it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = name

    def __get__(self, record: RunRecord | None, owner: type) -> Any:
        return self if record is None else record.raw.get(self.key)


class RunRecord:
    """summary.json as its readers see it: every key they read is named here, once (the ranks write it:
    worker, train.trainer, train.metrics, checkpoint.manager, launch.script for a user's script). A key the run
    did not write reads as None (or an empty value); `raw` is the whole record, for what lists every figure."""

    def __init__(self, raw: dict[str, Any] | None) -> None:
        self.raw: dict[str, Any] = raw or {}

    def __bool__(self) -> bool:
        return bool(self.raw)

    # How the run ended.
    stopped_at_step: int | None = _Key()
    """The step every rank stopped at, for a stop signal (not set for a run that ended)."""
    stopped_by: str | None = _Key()
    keep_best_error: str | None = _Key()
    eval_error: str | None = _Key()
    launch_failure: str | None = _Key()
    """ddp-amp's loop: the verdict of a launch that failed after it trained (a rank killed or raising), written
    by the launcher where the ranks wrote no summary (launch.verdict.record_failure)."""
    outcome: str | None = _Key()
    """A user's script's end as its launcher saw it (finished, failed, stopped); None for ddp-amp's loop."""
    data_ended_at_step: int | None = _Key()
    # Where its work is.
    model_path: str | None = _Key()
    summary_path: str | None = _Key()
    checkpoint: str | None = _Key()
    """The newest checkpoint written (never one that held inf/NaN)."""
    # Resumes.
    resumed_from_step: int | None = _Key()
    resumed_skipping_items: int | None = _Key()
    # What ran.
    world_size: int | None = _Key()
    backend: str | None = _Key()
    precision: str | None = _Key()
    steps: int | None = _Key()
    global_batch_size: int | None = _Key()
    threads_per_rank: int | None = _Key()
    flush_denormal: Any = _Key()
    model_flops_per_token: float | None = _Key()
    model_flops_per_sample: float | None = _Key()
    task_description: str | None = _Key()
    """What was trained, in a line (Task.description: a built-in task's size)."""
    # Its figures.
    mfu: float | None = _Key()
    """Model FLOPs utilisation over the steady state: achieved_tflops_per_rank over peak_tflops_per_rank, the
    peak from peak_source (a GPU's data sheet, or a matmul rate measured on the rank)."""
    achieved_tflops_per_rank: float | None = _Key()
    peak_tflops_per_rank: float | None = _Key()
    peak_source: str | None = _Key()
    final_loss: float | None = _Key()
    samples_per_s: float | None = _Key()
    rank_samples_per_s: float | None = _Key()
    """This rank's own throughput (the rank's summary before it is written; summary.json holds rank 0's)."""
    tokens_per_s: float | None = _Key()
    wall_s: float | None = _Key()
    """This launch's wall time; a resumed run's launches in all: wall_s_all_launches (and their count)."""
    wall_s_all_launches: float | None = _Key()
    launches: int | None = _Key()
    time_to_first_step_s: float | None = _Key()
    peak_memory_mb: float | None = _Key()
    baseline_memory_mb: float | None = _Key()
    optimizer_state_mb: Any = _Key()
    compile_s: float | None = _Key()
    subnormal_fraction: dict[str, float] | None = _Key()
    gradient_to_weight_norm: float | None = _Key()
    trainable_parameters: int | None = _Key()
    frozen_parameters: int | None = _Key()
    profile: dict[str, Any] | None = _Key()
    max_batch_search: dict[str, Any] | None = _Key()

    @property
    def diverged(self) -> Divergence | None:
        value = self.raw.get("diverged")
        return None if not value else Divergence(value["step"], value.get("rank"), value["reason"])

    @property
    def finished(self) -> bool:
        """Trained to its end (its model.pt is written): neither diverged nor stopped by a signal."""
        return self.diverged is None and self.stopped_at_step is None and self.launch_failure is None

    @property
    def restarts(self) -> int:
        return self.raw.get("restarts") or 0

    @property
    def checkpoints_skipped(self) -> list[str]:
        return self.raw.get("checkpoints_skipped") or []

    @property
    def loop(self) -> dict[str, Any]:
        """A script's loop account (ddp_amp.loop's loop.json), or {}."""
        loop = self.raw.get("loop")
        return loop if isinstance(loop, dict) else {}

    @property
    def eval(self) -> dict[str, Any]:
        """Task.evaluate's values."""
        return self.raw.get("eval") or {}

    @property
    def validation(self) -> dict[str, Any]:
        return self.raw.get("validation") or {}

    def failure(self, run_dir: str | Path) -> str | None:
        """The one line that fails a run whose ranks all finished: divergence, a --keep-best metric never
        logged, or an evaluation that raised; or the launcher's verdict on ranks that did not all finish."""
        if self.launch_failure:
            return self.launch_failure
        if diverged := self.diverged:
            where = f"step {diverged.step}" + (f" on rank {diverged.rank}" if diverged.rank is not None else "")
            kept = f"; the newest finite checkpoint is {self.checkpoint} (--resume {self.checkpoint})" \
                if self.checkpoint else ""
            return (f"training diverged at {where}: {diverged.reason}; no model.pt written (see --max-nonfinite)"
                    f"{kept}")
        if self.keep_best_error:
            return (f"{self.keep_best_error}: no {BEST_MODEL_FILE} kept; the trained weights are in "
                    f"{Path(run_dir) / MODEL_FILE}")
        if self.eval_error:
            return (f"{self.eval_error} (the trained weights are in {Path(run_dir) / MODEL_FILE}; the traceback "
                    f"in {Path(run_dir) / 'logs'}/)")
        return None


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



def metrics_lines(text: str) -> list[str]:
    """metrics.jsonl's lines, each ending in a newline: a last line without one, which does not parse, is half
    of a write the machine did not finish (power lost, a filesystem that fails mid-write), and is left out."""
    lines = [line for line in text.splitlines(keepends=True) if line.strip()]
    if lines and not lines[-1].endswith("\n"):
        try:
            json.loads(lines[-1])
            lines[-1] += "\n"
        except ValueError:
            lines.pop()
    return lines


def cut_metrics(run_dir: Path, step: int) -> None:
    """Drop the metrics logged after `step`: the resumed run logs those steps again."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return
    kept = [line for line in metrics_lines(path.read_text()) if json.loads(line).get("step", 0) <= step]
    atomic_write(path, "".join(kept).encode())


def has_checkpoint(path: Path) -> bool:
    """A checkpoint in the run dir: a step-<N>.pt, or a sharded step-<N>/ that DCP finished (its .metadata)."""
    return any(found.suffix == ".pt" or (found / ".metadata").is_file()
               for found in (path / "checkpoints").glob("step-*"))  # checkpoint.storage.CHECKPOINT_DIR


def earlier_run(path: Path) -> list[str]:
    """What of an earlier launch's work the run dir holds (its record, metrics, checkpoints, loop.json): a launch
    into it without --resume or --overwrite is refused, whatever either launch ran (a task, a script, a loop)."""
    found = [name for name in (METRICS_FILE, SUMMARY_FILE, LOOP_RECORD_FILE) if (path / name).exists()]
    return found + ["checkpoints/"] if has_checkpoint(path) else found
