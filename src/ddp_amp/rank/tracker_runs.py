"""One experiment tracker's run, as rank.trackers drives it: MLflow (its client, against MLFLOW_TRACKING_URI) and
Weights & Biases (online, or WANDB_MODE=offline). Each follows its library's own conventions for where it writes;
each method runs on the trackers' thread, never in the training loop, and may raise (rank.trackers catches)."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from ddp_amp.outputs import RunRecord

OUTCOME_TAG = "ddp_amp.outcome"
PARAM_LENGTH = 500
"""A parameter's value is cut to this many characters (MLflow refuses long ones)."""
TAG_LENGTH = 64
"""W&B refuses a longer tag (its settings fail to validate, and the run would not start)."""


def summary_figures(summary: dict[str, Any]) -> dict[str, float]:
    """summary.json's top-level numbers (throughput, peak memory, final loss, times), as "summary/<key>"."""
    import math

    return {f"summary/{key}": float(value) for key, value in summary.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


class TrackerRun:
    """The interface: `open` a run (a new one, or the run `known` names, kept from an earlier attempt), `log`
    metrics at a step, `finish` with the outcome and the run's files."""

    name = ""

    def open(self, known: dict[str, Any] | None, project: str, run_name: str, tags: dict[str, str],
             params: dict[str, Any]) -> dict[str, Any]:
        """What trackers.json keeps of the run (its id at least); `last_step` where the tracker itself knows the
        last step it holds."""
        raise NotImplementedError

    def log_steps(self, steps: list[tuple[dict[str, float], int]]) -> None:
        """Each (metrics, step), in order."""
        raise NotImplementedError

    def finish(self, outcome: str, status: str, summary: dict[str, Any], files: list[Path]) -> None:
        """`status`: finished, stopped or failed."""
        raise NotImplementedError


class MLflowRun(TrackerRun):
    name = "mlflow"

    def __init__(self) -> None:
        # A server that does not answer costs seconds, not MLflow's default minutes of retries (the user's own
        # settings win).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        self.run_id = ""

    def open(self, known, project, run_name, tags, params):
        client = self.client
        if known is not None:
            self.run_id = known["run_id"]
            client.update_run(self.run_id, status="RUNNING")
            # The server's own last step wins over the file's: a crash between the two leaves the file behind.
            held = max((m.step for m in client.get_metric_history(self.run_id, "loss")), default=0)
            return {**known, "last_step": max(held, int(known.get("last_step", 0)))}
        experiment = client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(project)
        run = client.create_run(experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        items = [Param(key, str(value)[:PARAM_LENGTH]) for key, value in sorted(params.items())]
        for start in range(0, len(items), 100):  # MLflow takes 100 parameters a batch
            client.log_batch(self.run_id, params=items[start:start + 100])
        return {"run_id": self.run_id, "experiment_id": experiment_id, "tracking_uri": client.tracking_uri}

    def log_steps(self, steps):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(key, value, now, step) for metrics, step in steps for key, value in metrics.items()]
        for start in range(0, len(items), 1000):  # MLflow takes 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=items[start:start + 1000])

    def finish(self, outcome, status, summary, files):
        client = self.client
        client.set_tag(self.run_id, OUTCOME_TAG, outcome)
        try:  # the files may fail (a full artifact store) or outlast the wait: the run is ended all the same
            if figures := summary_figures(summary):
                self.log_steps([(figures, RunRecord(summary).steps or 0)])
            client.log_dict(self.run_id, summary, "summary.json")
            for path in files:
                if path.is_dir():
                    client.log_artifacts(self.run_id, str(path), artifact_path=path.name)
                elif path.is_file():
                    client.log_artifact(self.run_id, str(path))
        finally:
            client.set_terminated(self.run_id, status={"finished": "FINISHED", "stopped": "KILLED",
                                                       "failed": "FAILED"}[status])


class WandbRun(TrackerRun):
    name = "wandb"

    def __init__(self, run_dir: Path) -> None:
        # Its files beside the run's, unless the user says where (WANDB_DIR).
        self.directory = os.environ.get("WANDB_DIR") or str(run_dir)
        os.environ.setdefault("WANDB_SILENT", "true")  # its banner would interleave with rank 0's output
        from multiprocessing import util

        import wandb

        self.wandb = wandb
        self.run = None
        util.Finalize(None, _remove_wandb_temporaries, exitpriority=0)  # at the rank's end (see there)

    def open(self, known, project, run_name, tags, params):
        run_id = known["run_id"] if known is not None else secrets.token_hex(4)  # W&B's ids: [a-z0-9]
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(project=project, name=run_name, id=run_id, resume="allow", dir=self.directory,
                                   config=params, tags=[f"{k}={v}"[:TAG_LENGTH] for k, v in tags.items()
                                                        if not k.startswith("ddp_amp.")],  # the run dir: in config
                                   settings=self.wandb.Settings(console="off"))
        return {**(known or {}), "run_id": run_id, "project": project, "dir": self.directory,
                "mode": os.environ.get("WANDB_MODE", "online")}

    def log_steps(self, steps):
        for metrics, step in steps:
            self.run.log(metrics, step=step)

    def finish(self, outcome, status, summary, files):
        run = self.run
        with tempfile.TemporaryDirectory() as tmp:
            summary_path = Path(tmp) / "summary.json"
            summary_path.write_text(json.dumps(summary, indent=1, default=str))
            for path in [*files, summary_path]:
                for file in sorted(path.rglob("*")) if path.is_dir() else [path] if path.is_file() else []:
                    run.save(str(file), base_path=str(path.parent), policy="now")
            run.summary.update({**summary_figures(summary), OUTCOME_TAG: outcome})
            if status == "stopped":
                run.mark_preempting()
            run.finish(exit_code=1 if status == "failed" else 0)


def _remove_wandb_temporaries() -> None:
    """wandb keeps two temporary directories for the process's life (its media's and its artifacts',
    TemporaryDirectory objects made at import), which Python removes at exit. A rank is a multiprocessing child,
    which ends with os._exit and runs no exit handler: every W&B run left both in TMPDIR. multiprocessing runs
    this at the rank's end instead. A wandb that keeps them elsewhere keeps them (nothing fails)."""
    import sys

    media = getattr(sys.modules.get("wandb.sdk.data_types._private"), "MEDIA_TMP", None)
    artifact = getattr(sys.modules.get("wandb.sdk.artifacts.artifact"), "Artifact", None)
    for directory in (media, getattr(artifact, "_TMP_DIR", None)):
        if isinstance(directory, tempfile.TemporaryDirectory):
            directory.cleanup()
