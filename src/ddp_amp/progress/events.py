"""Progress events: dicts that travel as one JSON line each, their types (one TypedDict per event type, below:
what the ranks send and the launcher's model reads), and their plain-text rendering.

Every event has "type" and "rank"; the rest depends on the type:

    state  status (starting, running, checkpointing, done, failed, restarting), local_rank, node, world_size,
           restart (torchrun's restart count); a script's rank also exit_code with done or failed
    log    step, total_steps, epoch, loss (this rank's, over the interval), global_loss (all ranks), lr,
           samples_per_s (this rank), global_samples_per_s, items_per_s / item_name, loss_scale, skipped_steps,
           micro_batch_size (with --micro-batch), slow (this rank holds the others back: train.stragglers)
    done   steps, samples_per_s (this rank's mean), precision (this rank's), peak_memory_mb (GPU: reserved;
           CPU: peak RSS), on a GPU peak_memory_allocated_mb, final_loss, stopped (by a stop signal,
           before the last step), plus the run summary on the
           node's writer (wall_s, time_to_first_step_s, model_path, summary_path)
    error  traceback (the failing rank's, sent once; a self-explaining error's one line), kind (errors.FailureKind:
           the launcher exits 2 for "usage"), time
    precision  precision, reason: --amp auto's answer on CPU ranks, measured by rank 0 (sent by rank 0 once)
    heartbeat  step (optimizer steps done), micro, phase_index, phase (data, forward, backward, step, log):
           where the rank's loop is, sent every second; stall_after_s
    stalled    step, phase, silent_s: made by the launcher when no rank's loop has moved for a while, for the
           ranks furthest behind (the others wait for them)
    output     stream (stdout, stderr), line: a line a user's script wrote on the rank (made by the launcher
           from the rank's captured output, progress.output; a line rewritten with carriage returns as a terminal
           shows it, its last state)
    output_progress  stream, line: such a line before its newline, as it stands now (a progress bar: about four
           a second while it moves; the rank's live row shows it, plain output prints nothing)
    report     step, metrics: a ddp_amp.loop script's report() (every --log-every steps and its loop's last)
    loop       completed_steps (its steps() ran every step), or stopped_at_step and stopped_by (its ranks agreed
           on a stop there, by that signal): how a ddp_amp.loop script's loop ended, sent by every rank
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict


class StateEvent(TypedDict, total=False):
    type: Literal["state"]
    rank: int
    status: str
    local_rank: int
    node: int
    world_size: int
    restart: int
    pid: int
    exit_code: int


class LogEvent(TypedDict, total=False):
    type: Literal["log"]
    rank: int
    step: int
    total_steps: int
    epoch: int
    loss: float
    global_loss: float
    lr: float
    samples_per_s: float
    global_samples_per_s: float
    items_per_s: float
    global_items_per_s: float
    item_name: str
    mfu: float
    """The rank's model FLOPs utilisation over the interval (a fraction)."""
    loss_scale: float
    skipped_steps: int
    micro_batch_size: int
    grad_norm: float
    slow: bool


class DoneEvent(TypedDict, total=False):
    type: Literal["done"]
    rank: int
    steps: int
    samples_per_s: float
    precision: str
    peak_memory_mb: float
    peak_memory_allocated_mb: float
    final_loss: float | None
    stopped: bool
    summary: dict[str, Any]
    """The run's summary (outputs.RunRecord reads it), on the node's writer."""


class ErrorEvent(TypedDict):
    type: Literal["error"]
    rank: int
    traceback: str
    kind: str
    """errors.FailureKind."""
    time: float


class HeartbeatEvent(TypedDict, total=False):
    type: Literal["heartbeat"]
    rank: int
    step: int
    micro: int
    phase_index: int
    phase: str
    stall_after_s: float
    script: bool
    """A script's rank (rank.script): step is its last collective's number, micro whether it completed."""


class StalledEvent(TypedDict):
    type: Literal["stalled"]
    rank: int
    step: int
    phase: str
    silent_s: float
    script: NotRequired[bool]
    """A script's rank: step is its last collective's number, phase where its code is."""


class PrecisionEvent(TypedDict):
    type: Literal["precision"]
    rank: int
    precision: str
    reason: str


class OutputEvent(TypedDict):
    type: Literal["output"]
    rank: int
    stream: str
    line: str
    warning: NotRequired[bool]
    """ddp-amp's own warning from the rank (a tracker that failed): shown under --quiet too."""


def warning_event(rank: int, line: str) -> OutputEvent:
    """ddp-amp's own warning line from a rank, as the display shows it (under --quiet too)."""
    return {"type": "output", "rank": rank, "stream": "stderr", "line": line, "warning": True}


class OutputProgressEvent(TypedDict):
    type: Literal["output_progress"]
    rank: int
    stream: str
    line: str


class ReportEvent(TypedDict):
    type: Literal["report"]
    rank: int
    step: int
    metrics: dict[str, float]


class LoopEvent(TypedDict, total=False):
    type: Literal["loop"]
    rank: int
    completed_steps: int
    stopped_at_step: int
    stopped_by: str


Event = (StateEvent | LogEvent | DoneEvent | ErrorEvent | HeartbeatEvent | StalledEvent | PrecisionEvent
         | OutputEvent | OutputProgressEvent | ReportEvent | LoopEvent | dict[str, Any])
"""Any progress event ("eval" events carry a validation's values under their own names: a plain dict)."""


def metrics_text(metrics: dict[str, float]) -> str:
    """A script's reported metrics (ddp_amp.loop's report()), as "name value" pairs."""
    return " ".join(f"{name} {value:.4g}" for name, value in metrics.items())


def plain_line(event: dict[str, Any]) -> str | None:
    """One line for a non-terminal output, rank first; None for events that print nothing."""
    kind, rank = event.get("type"), event.get("rank")
    if kind == "log":
        line = (f"[rank {rank}] step {event['step']}/{event['total_steps']} loss {event['loss']:.4f} "
                f"lr {event['lr']:.1e} {event['samples_per_s']:.0f} samples/s")
        if event.get("item_name", "samples") != "samples":
            line += f" {event['items_per_s']:.0f} {event['item_name']}/s"
        if "mfu" in event:
            line += f" MFU {event['mfu']:.1%}"
        if "grad_norm" in event:
            line += f" grad norm {event['grad_norm']:.3g}"
        if "loss_scale" in event:
            line += f" scale {event['loss_scale']:.0f} skipped {event['skipped_steps']}"
        if "micro_batch_size" in event:
            line += f" micro-batch {event['micro_batch_size']}"
        if event.get("slow"):
            line += " slow (holds the others back)"
        return line
    if kind == "report":
        return f"[rank {rank}] step {event['step']} {metrics_text(event['metrics'])}"
    if kind == "state" and event["status"] in ("starting", "restarting"):
        details = [f"restart {event['restart']}"] if event.get("restart") else []
        if event.get("world_size"):
            details.append(f"world size {event['world_size']}")
        return f"[rank {rank}] {event['status']}" + (f" ({', '.join(details)})" if details else "")
    if kind == "eval":
        values = " ".join(f"{k} {v:.4g}" for k, v in event.items() if k.startswith("val_") and isinstance(v, float))
        return f"[rank {rank}] eval at step {event['step']}: {values}" if rank == 0 else None
    if kind == "done":
        outcome = "stopped" if event.get("stopped") else "done"
        # No loss when no step was logged: a restarted group that resumed from a checkpoint at the last step.
        loss = "none logged" if event.get("final_loss") is None else f"{event['final_loss']:.4f}"
        return (f"[rank {rank}] {outcome}: {event['steps']} steps, {event['samples_per_s']:.0f} samples/s, "
                f"peak memory {event['peak_memory_mb']:.0f} MB, final loss {loss}")
    if kind == "error":
        return f"[rank {rank}] failed:\n{event['traceback']}"
    if kind == "output":
        return f"[rank {rank}] {event['line']}"
    if kind == "precision":
        return f"ddp-amp: --amp auto chose {event['precision']}: {event['reason']}"
    if kind == "stalled" and event.get("script"):
        return (f"[rank {rank}] stalled: no collective moved for {event['silent_s']:.0f}s; it is at "
                f"{event['phase']}, the other ranks wait for it in a later one")
    if kind == "stalled":
        return (f"[rank {rank}] stalled: no progress for {event['silent_s']:.0f}s in step {event['step']} "
                f"({event['phase']}); the other ranks are waiting for it")
    return None
