"""Run directories read back: what `ddp-amp show` compares. Plain files only; no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_amp.config import CONFIG_FILE
from ddp_amp.errors import UsageError
from ddp_amp.files import lock_holder
from ddp_amp.outputs import METRICS_FILE, SUMMARY_FILE, RunRecord, metrics_lines


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    summary: RunRecord
    metrics: list[dict[str, Any]] = field(default_factory=list)
    state: str = "finished"
    """finished, stopped, diverged, failed (its evaluation raised, or a user's script failed), in progress (a
    launch holds it), or unfinished (no summary and no launch: stopped or killed before the end, or another
    node's)."""

    @property
    def work(self) -> str:
        """What the ranks ran: the task, or the user's script and its arguments (its file's name)."""
        script = self.config.get("script")
        if isinstance(script, dict):
            target = script.get("target", "?")
            return " ".join([*(["-m", target] if script.get("module") else [Path(target).name]),
                             *script.get("args", [])])
        return str(self.config.get("task", "-"))

    label: str | None = None
    """Its name where another run shown beside it has the same folder name (name_apart)."""

    @property
    def name(self) -> str:
        return self.label or self.path.name or str(self.path)

    @property
    def loss_key(self) -> str:
        """The metric shown as the loss: `loss`, else (a script's own report() through ddp_amp.loop, e.g. a GAN's
        loss_d and loss_g) the first metric whose name starts with "loss", alphabetically."""
        names = {key for record in self.metrics for key in record}
        if "loss" in names or not names:
            return "loss"
        return min((key for key in names if key.startswith("loss")), default="loss")

    @property
    def loop(self) -> dict[str, Any]:
        """A script's loop account (ddp_amp.loop's loop.json in summary.json), or {}."""
        return self.summary.loop


def name_apart(runs: list[Run]) -> list[Run]:
    """Runs of the same folder name (a/run, b/run) named by as many of their paths' last parts as tell them
    apart (a/run, b/run), so that their columns and rows can be told apart; the others keep their names."""
    for run in runs:
        alike = [other for other in runs if other.path.name == run.path.name]
        if len(alike) > 1:
            parts = [other.path.resolve().parts for other in alike]
            depth = next((n for n in range(2, max(map(len, parts)) + 1)
                          if len({p[-n:] for p in parts}) == len(parts)), max(map(len, parts)))
            run.label = str(Path(*run.path.resolve().parts[-depth:]))
    return runs


def load_run(path: Path) -> Run:
    """A run directory's config, summary and metrics; a path that is not one is a UsageError."""
    if not path.exists():
        raise UsageError(f"show: {str(path)!r} does not exist")
    if not path.is_dir():
        raise UsageError(f"show: {str(path)!r} is not a directory")
    if not (path / CONFIG_FILE).is_file():
        raise UsageError(f"show: {str(path)!r} is not a run directory (no {CONFIG_FILE})")
    try:
        config = _json_object((path / CONFIG_FILE).read_text(), CONFIG_FILE)
        summary = RunRecord(_json_object((path / SUMMARY_FILE).read_text(), SUMMARY_FILE)
                            if (path / SUMMARY_FILE).is_file() else {})
        metrics = [_json_object(line, METRICS_FILE) for line in metrics_lines((path / METRICS_FILE).read_text())
                   ] if (path / METRICS_FILE).is_file() else []
    except (OSError, ValueError) as exc:
        raise UsageError(f"show: {str(path)!r} has an unreadable file: {exc}") from None
    settings = summary.loop.get("settings")  # a loop script's options as it ran them (setup()'s defaults too)
    if "script" in config and isinstance(settings, dict):
        config = {**config, **settings}
    if lock_holder(path) is not None:
        state = "in progress"
    elif not summary:
        state = "unfinished"
    elif summary.outcome is not None:  # a user's script: finished, failed or stopped, as its launcher saw it
        state = summary.outcome
    elif summary.launch_failure is not None:  # ddp-amp's loop, its ranks failed or were killed: the launcher's
        state = "stopped" if (summary.raw.get("exit_code") or 0) > 128 else "failed"  # verdict (> 128: a signal)
    elif summary.diverged is not None:
        state = "diverged"
    elif summary.stopped_at_step is not None:
        state = "stopped"
    elif summary.eval_error is not None:
        state = "failed"
    else:
        state = "finished"
    return Run(path, config, summary, metrics, state)


def _json_object(text: str, name: str) -> dict[str, Any]:
    """`text` as the JSON object ddp-amp writes there; a ValueError naming `name` for anything else."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"{name} holds a JSON {type(value).__name__}, not an object")
    return value


IGNORED_DIFFERENCES = {"run_dir", "launch_time", "resume", "record_step_times"}


NOT_RECORDED = "(not recorded)"
"""The value of an option that a run's config lacks: it was made by a version without that option."""


SCRIPT_OPTIONS = {"script", "stop_timeout", "device"}
"""What a plain script's run is launched with: the other options of config.json are ddp-amp's loop's defaults,
which it does not run (a difference there says nothing about the runs)."""
NOT_USED = "-"
"""The value shown for an option a run did not train with (a script's run, beside ddp-amp's loop's)."""


def options_taken(run: Run) -> set[str] | None:
    """The options of config.json that a run trained with: None for all of them (ddp-amp's loop); a script's:
    what it is launched with, and ddp_amp.loop's options where it used that loop."""
    if "script" not in run.config:
        return None
    from ddp_amp.config.script import LOOP_OPTIONS

    return SCRIPT_OPTIONS | (set(LOOP_OPTIONS) if run.loop else set())


def config_differences(runs: list[Run]) -> dict[str, list[Any]]:
    """The options whose values differ between the runs that trained with them (run_dir, the launchers' own
    fields and the like excepted), in order; a run that did not (a script's, for most of ddp-amp's loop's
    options) shows NOT_USED there."""
    from ddp_amp.config import NOT_OPTIONS

    keys = sorted({key for run in runs for key in run.config} - IGNORED_DIFFERENCES - set(NOT_OPTIONS))
    taken = [options_taken(run) for run in runs]
    differences = {}
    for key in keys:
        users = [t is None and key != "script" or t is not None and key in t for t in taken]
        values = [run.work if key == "script" and key in run.config else run.config.get(key, NOT_RECORDED)
                  for run in runs]
        if len({json.dumps(value) for value, used in zip(values, users) if used}) > 1:
            differences[key] = [value if used else NOT_USED for value, used in zip(values, users)]
    return differences


def why_not_finished(run: Run) -> str | None:
    """The one line that says why a run did not finish (a failure, a stop), as its launch ended on it."""
    record = run.summary
    if run.state == "finished" or not record:
        return None
    if record.outcome is not None:  # a script's, as its launcher saw it; a loop script's stop at its step
        loop = run.loop
        if loop.get("stopped_at_step") is not None:
            return f"stopped by {loop.get('stopped_by')} at step {loop['stopped_at_step']}"
        return record.raw.get("failure") or (f"stopped by {record.raw['stopped_by']}"
                                             if record.raw.get("stopped_by") else None)
    if record.stopped_at_step is not None:
        return f"stopped by {record.stopped_by} at step {record.stopped_at_step}"
    return record.failure(run.path)


def curve(run: Run, key: str) -> list[tuple[int, float]]:
    """(step, value) of one logged metric; for an in-progress run, what it has logged so far."""
    return [(m["step"], m[key]) for m in run.metrics if isinstance(m.get(key), (int, float))]
