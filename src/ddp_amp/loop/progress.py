"""report() and the loop's record: each rank's metrics to ddp-amp's live view (a "report" event every --log-every
steps), rank 0's to metrics.jsonl (which `ddp-amp show` reads), and at finish() loop.json, the loop's part of the
run's record (the launcher puts it in summary.json)."""

from __future__ import annotations

import math
import os
import time
from typing import Any

from ddp_amp import outputs
from ddp_amp.checkpoint import storage
from ddp_amp.config.script import LOOP_OPTIONS
from ddp_amp.loop.settings import LoopError
from ddp_amp.progress.channel import EventSender
from ddp_amp.progress.events import warning_event


class Progress:
    def __init__(self, run: Any) -> None:  # the ddp_amp.loop.Loop it serves
        self.run = run
        self.sender = EventSender.from_environ() if run.settings.under_ddp_amp else None
        self.last_step: int | None = None
        self.started = time.time()
        self.tensorboard = None
        """--tensorboard: rank 0's SummaryWriter under RUN_DIR/tensorboard, made at the first report."""
        self.trackers = None
        """--tracker: rank 0's experiment trackers (rank.trackers), opened at the first report."""

    def report(self, step: int, metrics: dict[str, Any], *, last: bool = False) -> None:
        """Every --log-every steps, and at the loop's `last` step."""
        if step % self.run.settings.log_every and not last:
            return
        values = {name: _number(name, value) for name, value in metrics.items()}  # a host sync per tensor
        run = self.run
        if run.rank == 0 and self.last_step is None and run._checkpoints.parts is None and \
                not storage.checkpoints(run.run_dir):
            # This attempt's first line, and no checkpoint it could continue from: an earlier attempt's lines (a
            # restart) are logged again now; dropped, as ddp-amp's own loop drops them. Where a checkpoint is,
            # restore() cuts them back to its step (a report before restore() must not cut them all).
            outputs.cut_metrics(run.run_dir, 0)
        self.last_step = step
        if run.rank == 0:
            outputs.append_metrics(run.run_dir, {"step": step, **values})
            if run.settings.tensorboard:
                self._scalars(step, values)
            if run.settings.tracker:
                self._track({"step": step, **values})
        if self.sender is not None:
            self.sender.send({"type": "report", "rank": run.rank, "step": step, "metrics": values})

    def loop_ended(self, *, completed_steps: int | None = None, stopped_at_step: int | None = None,
                   stopped_by: int | None = None) -> None:
        """A "loop" event: the loop ran every step (completed_steps), or its ranks agreed on a stop at a step
        (stopped_at_step, and the signal). Every rank sends it, since every rank ends the same way at the same
        step: a launcher whose node does not hold rank 0 (loop.json's writer) decides from its own ranks."""
        if self.sender is None:
            return
        import signal

        how = {"completed_steps": completed_steps} if stopped_at_step is None else \
            {"stopped_at_step": stopped_at_step, "stopped_by": signal.Signals(stopped_by).name}
        self.sender.send({"type": "loop", "rank": self.run.rank, **how})

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        """Each metric as the scalar report/<name>."""
        if self.tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run's events replace the earlier attempt's from its first reported step on.
            self.tensorboard = SummaryWriter(str(self.run.run_dir / "tensorboard"), purge_step=step)
        for name, value in values.items():
            if math.isfinite(value):
                self.tensorboard.add_scalar(f"report/{name}", value, step)

    def _track(self, record: dict[str, Any]) -> None:
        """The report's metrics to the trackers: one tracker run per run dir, each step once (rank.trackers)."""
        if self.trackers is None:
            from ddp_amp.rank.trackers import Trackers, run_params

            run, settings = self.run, self.run.settings
            self.trackers = Trackers(settings.tracker, run.run_dir, settings.resume, project=settings.tracker_project,
                                     run_name=settings.tracker_run_name, tags=settings.tracker_tag, warn=self._warn)
            self.trackers.start(run_params(settings, world_size=run.world_size, precision=run.precision,
                                           shard=run.strategy.mode), wait_s=10.0)  # the others go on to a collective
        self.trackers.log(record)

    def _warn(self, line: str) -> None:
        print(line, flush=True)
        if self.sender is not None:
            self.sender.send(warning_event(self.run.rank, line))

    def finish(self) -> None:
        """loop.json on rank 0: the precision, the parallel mode, the steps, how the loop ended."""
        run = self.run
        if run.rank == 0:
            record = {"precision": run.precision, "shard": run.strategy.mode, "grad_accum": run.grad_accum,
                      "world_size": run.world_size, "skipped_steps": run.skipped_steps,
                      "last_reported_step": self.last_step, "seconds": round(time.time() - self.started, 3),
                      "models": [type(model).__name__ for model in run._prepared],
                      "optimizers": [type(optimizer).__name__ for optimizer in run._optimizers],
                      # the options as the loop ran them: setup()'s own defaults under the command line's, where
                      # config.json holds the command line's alone (`ddp-amp show` compares these)
                      "settings": {key: getattr(run.settings, key) for key in LOOP_OPTIONS}}
            if run.completed_steps is not None:
                record["completed_steps"] = run.completed_steps
            if run.model_path is not None:
                record["model"] = str(run.model_path)
            if run.stopped_at is not None:
                import signal

                record.update(stopped_at_step=run.stopped_at, stopped_by=signal.Signals(run.stopped_by).name)
            checkpoints = run._checkpoints
            if checkpoints.last_path is not None:
                record["checkpoint"] = str(checkpoints.last_path)
            if checkpoints.resumed_from is not None:
                record.update(resumed_from=str(checkpoints.resumed_from),
                              resumed_from_step=checkpoints.resumed_from_step)
            for key, variable in (("restarts", "TORCHELASTIC_RESTART_COUNT"),
                                  ("slurm_restart_count", "SLURM_RESTART_COUNT")):
                if int(os.environ.get(variable, "0") or 0):  # this attempt's: how many came before it
                    record[key] = int(os.environ[variable])
            if self.trackers is not None:
                stopped = run.stopped_at is not None
                record["trackers"] = self.trackers.finish(
                    f"stopped at step {run.stopped_at}" if stopped else "finished",
                    "stopped" if stopped else "finished", record, [])
            outputs.write_json(run.run_dir / outputs.LOOP_RECORD_FILE, record)
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.sender is not None:
            self.sender.close()


def _number(name: str, value: Any) -> float:
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        raise LoopError(f"report(): {name}={value!r} is not a number (or a one-element tensor)") from None
    return number  # inf/NaN: metrics.jsonl's writer makes them null
