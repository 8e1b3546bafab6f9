"""--tracker mlflow|wandb on global rank 0: the run's config, every log step's metrics, the evaluations, the
outcome and the run's files, sent to each tracker on a thread of their own, so that no network call is ever
made in the training loop.

One tracker run per training run: each tracker's run id goes into RUN_DIR/trackers.json as soon as the run
exists, and every later attempt in that run dir (--resume auto, a Slurm requeue, a torchrun restart, an elastic
resize, a restarted pod) continues it; a --resume from another run dir's checkpoint continues that run dir's.
A resumed run trains again the steps after its checkpoint, bit for bit as before (test_resume.py): what the
tracker holds already (the last step trackers.json records, and for MLflow the last step of the server's own
history) is not sent again, so each step is there once.

A tracker never stops training: its first error is one warning line on rank 0's output, and that tracker is
dropped for the rest of the launch; the metrics stay in metrics.jsonl, and summary.json's "trackers" says what
each tracker received and what it did not.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddp_amp.files import atomic_write
from ddp_amp.outputs import TRACKERS_FILE
from ddp_amp.rank.tracker_runs import MLflowRun, TrackerRun, WandbRun

PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}
"""The package each --tracker needs (pip install 'ddp-amp[NAME]')."""
FLUSH_S = 60.0
"""How long the end of a run waits for the trackers to take what is queued (the run's files included)."""
NOT_METRICS = ("step", "total_steps", "epoch_step")


def tracker_packages_missing(names: tuple[str, ...]) -> list[str]:
    """The --tracker names whose package is not installed (the launcher refuses them before any rank starts)."""
    import importlib.util

    return [name for name in names if importlib.util.find_spec(PACKAGES[name]) is None]


def run_params(config: Any, **facts: Any) -> dict[str, Any]:
    """The tracker run's parameters: every option of the run (a repeatable one joined), the task's arguments one
    by one, and `facts` (world size, precision, the CPU or GPU)."""
    import dataclasses

    params: dict[str, Any] = {}
    for key, value in dataclasses.asdict(config).items():
        params[key] = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    params.update({f"task_arg.{arg.split('=', 1)[0]}": arg.split("=", 1)[-1] for arg in config.task_arg})
    return {**params, **facts}


def known_runs(run_dir: Path, resume: str | None) -> dict[str, Any]:
    """trackers.json of this run dir, else (--resume PATH in another run dir) of the checkpoint's run dir."""
    import json

    candidates = [run_dir / TRACKERS_FILE]
    if resume not in (None, "auto"):
        checkpoint = Path(resume)
        candidates.append(checkpoint.parent.parent / TRACKERS_FILE)  # RUN_DIR/checkpoints/step-N(.pt)
    for path in candidates:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return {}


class _Tracker:
    """One tracker's state on rank 0: its run, what trackers.json keeps, and what it did not get."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.run: TrackerRun | None = None
        self.kept: dict[str, Any] = {}
        self.sent_steps = 0
        self.unsent_steps = 0
        self.error: str | None = None


class Trackers:
    """Rank 0's trackers. Every call queues work for the trackers' thread and returns at once."""

    def __init__(self, names: tuple[str, ...], run_dir: Path, resume: str | None, *, project: str | None,
                 run_name: str | None, tags: tuple[str, ...], warn: Callable[[str], None] = print) -> None:
        self.run_dir, self.warn = run_dir, warn
        self.known = known_runs(run_dir, resume)
        self.project = project
        self.run_name = run_name or run_dir.resolve().name
        self.tags = {"ddp_amp.run_dir": str(run_dir.resolve()), **dict(tag.split("=", 1) for tag in tags)}
        self.trackers = [_Tracker(name) for name in names]
        self._queue: queue.Queue[tuple[_Tracker, Callable[[], Any], bool] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="ddp-amp-trackers", daemon=True)
        self._thread.start()

    def start(self, params: dict[str, Any]) -> None:
        """Open (or continue) each tracker's run and, for a new one, log the run's parameters."""
        for tracker in self.trackers:
            self._put(tracker, lambda t=tracker: self._open(t, params))

    def log(self, record: dict[str, Any], *, evaluation: bool = False) -> None:
        """A log interval's (or an evaluation's) record, as metrics.jsonl holds it, at its step; a step the
        tracker holds already (sent before a restart) is not sent again."""
        step = int(record["step"])
        metrics = {key: float(value) for key, value in record.items()
                   if key not in NOT_METRICS and not key.startswith("rank_") and isinstance(value, (int, float))
                   and not isinstance(value, bool) and math.isfinite(value)}
        for tracker in self.trackers:
            self._put(tracker, lambda t=tracker: self._log(t, metrics, step, evaluation), counts=True)

    def finish(self, outcome: str, status: str, summary: dict[str, Any], files: list[Path]) -> dict[str, Any]:
        """The outcome and the run's files, then wait (FLUSH_S at most) for everything queued; what each tracker
        got, for summary.json."""
        for tracker in self.trackers:
            self._put(tracker, lambda t=tracker: t.run.finish(outcome, status, summary, files))
        self._queue.put(None)
        self._thread.join(FLUSH_S)
        if self._thread.is_alive():
            self._warn(None, f"not done after {FLUSH_S:.0f}s; what was still queued is not sent")
        return self.report()

    def report(self) -> dict[str, Any]:
        return {t.name: {"run_id": t.kept.get("run_id"), "sent_steps": t.sent_steps,
                         "unsent_steps": t.unsent_steps, **({"error": t.error} if t.error else {})}
                for t in self.trackers}

    def _put(self, tracker: _Tracker, work: Callable[[], Any], counts: bool = False) -> None:
        self._queue.put((tracker, work, counts))

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            tracker, work, counts = item
            if tracker.error is not None:
                tracker.unsent_steps += counts
                continue
            try:
                if work() is not False:
                    tracker.sent_steps += counts
            except Exception as exc:  # noqa: BLE001 - whatever a tracker raises, training goes on
                tracker.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                tracker.unsent_steps += counts
                self._warn(tracker, tracker.error)

    def _open(self, tracker: _Tracker, params: dict[str, Any]) -> None:
        tracker.run = MLflowRun() if tracker.name == "mlflow" else WandbRun(self.run_dir)
        project = self.project or os.environ.get(
            "MLFLOW_EXPERIMENT_NAME" if tracker.name == "mlflow" else "WANDB_PROJECT") or "ddp-amp"
        tracker.kept = tracker.run.open(self.known.get(tracker.name), project, self.run_name, self.tags, params)
        self._keep(tracker)

    def _log(self, tracker: _Tracker, metrics: dict[str, float], step: int, evaluation: bool) -> bool:
        """False for a step the tracker holds already."""
        key = "last_eval_step" if evaluation else "last_step"
        if step <= int(tracker.kept.get(key, 0)):
            return False
        tracker.run.log(metrics, step)
        tracker.kept[key] = step
        self._keep(tracker)
        return True

    def _keep(self, tracker: _Tracker) -> None:
        import json

        self.known[tracker.name] = tracker.kept
        atomic_write(self.run_dir / TRACKERS_FILE, (json.dumps(self.known, indent=1, sort_keys=True) + "\n").encode())

    def _warn(self, tracker: _Tracker | None, what: str) -> None:
        name = tracker.name if tracker is not None else ", ".join(t.name for t in self.trackers)
        self.warn(f"warning: --tracker {name}: {what}; training goes on without it, the metrics stay in "
                  "metrics.jsonl")
