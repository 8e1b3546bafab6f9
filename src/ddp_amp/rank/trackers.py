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
import time
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
OPEN_S = 60.0
"""How long the start waits for the trackers' runs to open."""
SEND_EVERY_S = 2.0
"""The trackers' thread sends at most this often: the steps of a shorter interval go in one request."""
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
    arguments = getattr(config, "task_arg", ())  # a script's loop (loop.settings) has none
    params.update({f"task_arg.{arg.split('=', 1)[0]}": arg.split("=", 1)[-1] for arg in arguments})
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
    """Rank 0's trackers. `start` waits for the runs to open (before the first step: importing a tracker's library
    and its first requests would otherwise take the loop's time); every later call queues work for the trackers'
    thread and returns at once. The thread sends what has gathered at most every SEND_EVERY_S, each tracker's
    steps in one request where it takes them so (MLflow's log_batch): a request per log step, its HTTP and JSON
    work under the GIL, cost the mlp task's loop a third of its throughput on two cores."""

    def __init__(self, names: tuple[str, ...], run_dir: Path, resume: str | None, *, project: str | None,
                 run_name: str | None, tags: tuple[str, ...], warn: Callable[[str], None] = print) -> None:
        self.run_dir, self.warn = run_dir, warn
        self.known = known_runs(run_dir, resume)
        self.project = project
        self.run_name = run_name or run_dir.resolve().name
        self.tags = {"ddp_amp.run_dir": str(run_dir.resolve()), **dict(tag.split("=", 1) for tag in tags)}
        self.trackers = [_Tracker(name) for name in names]
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self.cpu_s = self.sending_cpu_s = 0.0
        self._opened = threading.Event()
        self._finishing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ddp-amp-trackers", daemon=True)
        self._thread.start()

    def start(self, params: dict[str, Any], wait_s: float = OPEN_S) -> None:
        """Open (or continue) each tracker's run and, for a new one, log the run's parameters; waits `wait_s` at
        most (a tracker still opening then goes on opening beside the loop). The other ranks wait meanwhile in the
        first collective: `wait_s` stays well inside the process group's timeout."""
        self._queue.put(("open", params))
        self._opened.wait(wait_s)

    def log(self, record: dict[str, Any], *, evaluation: bool = False) -> None:
        """A log interval's (or an evaluation's) record, as metrics.jsonl holds it, at its step; a step the
        tracker holds already (sent before a restart) is not sent again."""
        metrics = {key: float(value) for key, value in record.items()
                   if key not in NOT_METRICS and not key.startswith("rank_") and isinstance(value, (int, float))
                   and not isinstance(value, bool) and math.isfinite(value)}
        self._queue.put(("log", (int(record["step"]), metrics, evaluation)))

    def finish(self, outcome: str, status: str, summary: dict[str, Any], files: list[Path]) -> dict[str, Any]:
        """The outcome and the run's files, then wait (FLUSH_S at most) for everything queued; what each tracker
        got, for summary.json."""
        import copy

        # A copy: the caller goes on with its summary while the thread may still be sending this one.
        self._queue.put(("finish", (outcome, status, copy.deepcopy(summary), files)))
        self._queue.put(None)
        self._finishing.set()
        self._thread.join(FLUSH_S)
        if self._thread.is_alive():
            self._warn(None, f"not done after {FLUSH_S:.0f}s; what was still queued is not sent")
        return self.report()

    def report(self) -> dict[str, Any]:
        """Per tracker: its run id, the steps it got and did not, its error; and the CPU seconds the trackers'
        thread took, all trackers together: in all (the library's import, the opening and the end's uploads
        included), and sending while the loop ran (between the opening and the end: what it cost the loop)."""
        return {t.name: {"run_id": t.kept.get("run_id"), "sent_steps": t.sent_steps,
                         "unsent_steps": t.unsent_steps, "thread_cpu_s": round(self.cpu_s, 3),
                         "sending_cpu_s": round(self.sending_cpu_s, 3), **({"error": t.error} if t.error else {})}
                for t in self.trackers}

    def _serve(self) -> None:
        try:
            self._serve_batches()
        finally:
            self.cpu_s = time.thread_time()

    def _serve_batches(self) -> None:
        while True:
            batch = [self._queue.get()]
            while batch[-1] is not None:  # whatever else is queued goes with it
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            opening, ending = batch[0] is not None and batch[0][0] == "open", batch[-1] is None
            started = time.thread_time()
            for tracker in self.trackers:
                self._send(tracker, [item for item in batch if item is not None])
            if not (opening or ending):
                self.sending_cpu_s += time.thread_time() - started
            self._opened.set()
            if batch[-1] is None:
                return
            self._finishing.wait(SEND_EVERY_S)  # steps gather meanwhile; the run's end cuts the wait short

    def _send(self, tracker: _Tracker, items: list[tuple[str, Any]]) -> None:
        """One tracker's share of a batch, in order: its open, its new steps (together), its finish."""
        steps = [item[1] for item in items if item[0] == "log"]
        try:
            for kind, work in items:
                if tracker.error is None and kind == "open":
                    self._open(tracker, work)
            if tracker.error is None:
                new = [(step, metrics, evaluation) for step, metrics, evaluation in steps
                       if step > int(tracker.kept.get("last_eval_step" if evaluation else "last_step", 0))]
                if new:
                    tracker.run.log_steps([(metrics, step) for step, metrics, _ in new])
                    for step, _, evaluation in new:
                        tracker.kept["last_eval_step" if evaluation else "last_step"] = step
                    self._keep(tracker)
                tracker.sent_steps += len(new)
                steps = []
            for kind, work in items:
                if tracker.error is None and kind == "finish":
                    tracker.run.finish(*work)
        except Exception as exc:  # noqa: BLE001 - whatever a tracker raises, training goes on
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            tracker.error = f"{type(exc).__name__}: {first}"
            self._warn(tracker, tracker.error)
        if tracker.error is not None:
            tracker.unsent_steps += len(steps)
            self._end_anyway(tracker, items)

    @staticmethod
    def _end_anyway(tracker: _Tracker, items: list[tuple[str, Any]]) -> None:
        """A tracker that failed during the run is still told how the run ended, once, quietly (an outage may
        have passed): its run is not left running for ever."""
        for kind, work in items:
            if kind == "finish" and tracker.run is not None:
                try:
                    tracker.run.finish(*work)
                except Exception:  # noqa: BLE001 - warned of already
                    pass

    def _open(self, tracker: _Tracker, params: dict[str, Any]) -> None:
        tracker.run = MLflowRun() if tracker.name == "mlflow" else WandbRun(self.run_dir)
        project = self.project or os.environ.get(
            "MLFLOW_EXPERIMENT_NAME" if tracker.name == "mlflow" else "WANDB_PROJECT") or "ddp-amp"
        tracker.kept = tracker.run.open(self.known.get(tracker.name), project, self.run_name, self.tags, params)
        self._keep(tracker)

    def _keep(self, tracker: _Tracker) -> None:
        import json

        self.known[tracker.name] = tracker.kept
        atomic_write(self.run_dir / TRACKERS_FILE, (json.dumps(self.known, indent=1, sort_keys=True) + "\n").encode())

    def _warn(self, tracker: _Tracker | None, what: str) -> None:
        name = tracker.name if tracker is not None else ", ".join(t.name for t in self.trackers)
        self.warn(f"warning: --tracker {name}: {what}; training goes on without it, the metrics stay in "
                  "metrics.jsonl")
