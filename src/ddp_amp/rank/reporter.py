"""A rank's sinks: progress events to the launcher, metrics.jsonl on the ranks that write the run directory,
and TensorBoard scalars on global rank 0. Without a launcher listening (a hand-written torchrun command),
rank 0 prints plain lines instead."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from ddp_amp import outputs
from ddp_amp.dist import DistEnv
from ddp_amp.errors import FailureKind
from ddp_amp.progress.channel import EventSender
from ddp_amp.progress.events import DoneEvent, ErrorEvent, LogEvent, StateEvent, plain_line, warning_event
from ddp_amp.rank.trackers import Trackers


class WorkerReporter:
    """Sends this rank's progress events to the launcher and, on each node's local rank 0, appends the
    (already all-reduced) metrics to metrics.jsonl. Without a launcher listening (a hand-written torchrun
    command), rank 0 prints plain lines instead."""

    def __init__(self, env: DistEnv, run_dir: Path, sender: EventSender | None) -> None:
        self.env, self.run_dir, self.sender = env, run_dir, sender
        self.item_name = "samples"
        self.items_per_sample = 1
        self.last_loss: float | None = None
        self.scalars: TensorBoardScalars | NoScalars = NoScalars()
        """TensorBoard scalars on global rank 0 with --tensorboard (`write_tensorboard`); a sink that keeps
        nothing elsewhere, so no call site asks which."""
        self.trackers: Trackers | None = None
        """--tracker: global rank 0's experiment trackers (rank.trackers), set once the trainer has resumed."""

    def write_tensorboard(self) -> None:
        self.scalars = TensorBoardScalars(self.run_dir)

    def _send(self, event: dict[str, Any]) -> None:
        event = {"rank": self.env.rank, **event}
        if self.sender is not None:
            self.sender.send(event)
        elif self.env.rank == 0 and (line := plain_line(event)):
            print(line, flush=True)

    def on_eval(self, record: dict[str, Any]) -> None:
        """An evaluation's means (val_loss, val_<metric>) at its step: metrics.jsonl, TensorBoard, an event."""
        if self.env.writes_run_dir:
            outputs.append_metrics(self.run_dir, record)
        self.scalars.write(record, self.item_name)
        if self.trackers is not None:
            self.trackers.log(record, evaluation=True)
        self._send({"type": "eval", **record})

    def state(self, status: str, **extra: Any) -> None:
        event: StateEvent = {"type": "state", "status": status, "local_rank": self.env.local_rank,
                             "node": int(os.environ.get("GROUP_RANK", "0")), "world_size": self.env.world_size,
                             **extra}
        self._send(event)

    def precision_chosen(self, precision) -> None:
        """--amp auto's measured answer, once (rank 0's, which every rank took)."""
        if self.env.rank == 0:
            self._send({"type": "precision", "precision": precision.name, "reason": precision.reason})

    def on_log(self, record: dict[str, Any]) -> None:
        if self.env.writes_run_dir:
            outputs.append_metrics(self.run_dir, {k: v for k, v in record.items() if not k.startswith("rank_")})
        self.scalars.write(record, self.item_name)
        if self.trackers is not None:
            self.trackers.log(record)
        self.last_loss = record["rank_loss"]
        event: LogEvent = {"type": "log", "step": record["step"], "total_steps": record["total_steps"],
                 "epoch": record["epoch"], "loss": record["rank_loss"], "global_loss": record["loss"],
                 "lr": record["lr"], "samples_per_s": record["rank_samples_per_s"],
                 "global_samples_per_s": record["samples_per_s"], "skipped_steps": record["skipped_steps"],
                 "item_name": self.item_name}
        if self.item_name != "samples":
            event["items_per_s"] = record["rank_samples_per_s"] * self.items_per_sample
            event["global_items_per_s"] = record["samples_per_s"] * self.items_per_sample
        if "mfu" in record:  # model FLOPs utilisation, where the run counts its FLOPs
            event["mfu"] = record["mfu"]
        if "loss_scale" in record:
            event["loss_scale"] = record["loss_scale"]
        if "micro_batch_size" in record:
            event["micro_batch_size"] = record["micro_batch_size"]
        if self.env.rank in record.get("slow_ranks", ()):
            event["slow"] = True
        if record.get("grad_norm") is not None and math.isfinite(record["grad_norm"]):
            event["grad_norm"] = record["grad_norm"]
        self._send(event)

    def done(self, summary: dict[str, Any], memory: dict[str, float]) -> None:
        """`memory`: train.metrics.peak_memory of the training, measured before any evaluation."""
        record = outputs.RunRecord(summary)
        event: DoneEvent = {"type": "done", "steps": record.steps, "samples_per_s": record.rank_samples_per_s,
                 **memory, "final_loss": self.last_loss, "precision": record.precision,
                 "stopped": record.stopped_at_step is not None}
        if self.env.writes_run_dir:
            event["summary"] = summary
        self._send(event)

    def finish_trackers(self, summary: dict[str, Any]) -> dict[str, Any] | None:
        """The run's outcome and files to the trackers, and what each got (summary.json's "trackers")."""
        if self.trackers is None:
            return None
        record = outputs.RunRecord(summary)
        stopped = record.stopped_at_step
        status, outcome = ("stopped", f"stopped at step {stopped}") if stopped is not None else (
            ("finished", "finished") if record.finished else ("failed", "diverged"))
        files = [self.run_dir / name for name in (outputs.MODEL_FILE, outputs.BEST_MODEL_FILE, outputs.PRETRAINED_DIR)
                 if (self.run_dir / name).exists()]
        trackers, self.trackers = self.trackers, None
        return trackers.finish(outcome, status, summary, files)

    def warn(self, line: str) -> None:
        """One line for the launcher's output (as the rank's own stderr would show there) and the rank's log; safe
        from any thread (the trackers' thread warns)."""
        print(line, flush=True)
        if self.sender is not None:
            self.sender.send(warning_event(self.env.rank, line))

    def heartbeat(self, **position: Any) -> None:
        self._send({"type": "heartbeat", **position})

    def error(self, text: str, kind: FailureKind) -> None:
        """This rank failed: `text` its one line or traceback, `kind` what kind of failure (errors.failure_kind)."""
        event: ErrorEvent = {"type": "error", "rank": self.env.rank, "traceback": text, "kind": kind,
                             "time": time.time()}
        self._send(event)
        if self.trackers is not None:
            trackers, self.trackers = self.trackers, None
            lines = [line for line in text.strip().splitlines() if line.strip()]
            trackers.finish(f"failed: rank {self.env.rank}: {lines[-1] if lines else kind}", "failed", {}, [])


class NoScalars:
    """The scalar sink of every rank but global rank 0, and of runs without --tensorboard."""

    def write(self, record: dict[str, Any], item_name: str) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardScalars:
    """--tensorboard: the metrics of each log interval as TensorBoard scalars under RUN_DIR/tensorboard."""

    TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "loss_scale": "amp/loss_scale",
            "skipped_steps": "amp/skipped_steps", "samples_per_s": "throughput/samples_per_s"}

    def __init__(self, run_dir: Path) -> None:
        self.directory = run_dir / "tensorboard"
        self.writer = None

    def write(self, record: dict[str, Any], item_name: str) -> None:
        step = record["step"]
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run's events replace the earlier attempt's from its first logged step on.
            self.writer = SummaryWriter(str(self.directory), purge_step=step)
        tags = {**self.TAGS, **{key: f"val/{key[4:]}" for key in record if key.startswith("val_")}}
        for key, tag in tags.items():
            value = record.get(key)
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        if item_name != "samples" and f"{item_name}_per_s" in record:
            self.writer.add_scalar(f"throughput/{item_name}_per_s", record[f"{item_name}_per_s"], step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
