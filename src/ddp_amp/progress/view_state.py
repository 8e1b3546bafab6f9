"""The launcher's account of a launch, folded from the ranks' progress events: each rank's state (its step, loss,
throughput, heartbeat position, output line, failure) and the run's (restarts, stalls, the summary). Knows
nothing about rendering (progress.display draws it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddp_amp.progress.events import Event


@dataclass
class RankState:
    rank: int
    local_rank: int | None = None
    node: int | None = None
    status: str = "starting"
    step: int = 0
    total_steps: int | None = None
    epoch: int = 0
    loss: float | None = None
    lr: float | None = None
    samples_per_s: float | None = None
    mfu: float | None = None
    """Model FLOPs utilisation at the last log interval (a fraction), where the run counts its FLOPs."""
    loss_scale: float | None = None
    skipped_steps: int = 0
    micro_batch_size: int | None = None
    done: dict[str, Any] | None = None
    traceback: str | None = None
    failure_kind: str | None = None
    """What kind of failure ended the rank (errors.FailureKind), as its error event says."""
    failed_at: float = 0.0
    pid: int | None = None
    position: tuple | None = None
    """(step, micro-step, phase index, phase name) from the rank's heartbeat: where its loop is."""
    stall_after_s: float | None = None
    moved_at: float = 0.0
    world_size: int | None = None
    last_line: str = ""
    """A script's rank: the last line it wrote (stdout or stderr)."""
    reported: dict[str, float] = field(default_factory=dict)
    """A script's rank using ddp_amp.loop: the metrics of its last report() (its step in `step`)."""
    exit_code: int | None = None
    loop: dict[str, Any] = field(default_factory=dict)
    """A script's rank using ddp_amp.loop: how its loop ended, its "loop" events folded (completed_steps,
    stopped_at_step, stopped_by), as loop.json says it on rank 0's node alone."""


@dataclass
class ProgressState:
    """Everything the displays show, folded from events. Knows nothing about rendering."""

    clock: Callable[[], float] = time.monotonic
    started: float = field(default=0.0)
    ranks: dict[int, RankState] = field(default_factory=dict)
    global_loss: float | None = None
    global_samples_per_s: float | None = None
    grad_norm: float | None = None
    """The global gradient norm at the last log interval (the same on every rank)."""
    item_name: str = "samples"
    items_per_s: float | None = None
    summary: dict[str, Any] | None = None
    restarts: int = 0
    steps_before_restart: dict[int, int] = field(default_factory=dict)
    ranks_before_restart: dict[int, int] = field(default_factory=dict)
    """local rank -> the global rank it had when torchrun restarted the group (the agent's log names local ranks)."""
    recovered: list[tuple[int, int, str]] = field(default_factory=list)
    """(attempt, rank, last line) of failures that a restart recovered from: no longer shown as failures."""
    script: bool = False
    """The ranks run a user's script: no steps or losses of ours, their output instead."""
    stopped: bool = False
    """The launcher passed a stop signal on to the ranks: a rank that its SIGINT interrupted stopped, not failed."""

    def __post_init__(self) -> None:
        self.started = self.started or self.clock()

    def apply(self, event: Event) -> None:
        kind = event["type"]
        if kind == "state" and event["status"] in ("starting", "restarting") and event["rank"] not in self.ranks:
            # An elastic job that changed its membership numbers its ranks anew: this process's earlier rank
            # (the same local rank, another global one) is gone.
            local_rank = event.get("local_rank")
            for rank in [r for r, s in self.ranks.items() if local_rank is not None and s.local_rank == local_rank]:
                del self.ranks[rank]
        state = self.ranks.setdefault(event["rank"], RankState(event["rank"]))
        if kind == "state":
            if event["status"] == "restarting":
                self._restarted(event.get("restart", 1))
            state.status = event["status"]
            state.local_rank = event.get("local_rank", state.local_rank)
            state.pid = event.get("pid", state.pid)
            state.node = event.get("node", state.node)
            state.exit_code = event.get("exit_code", state.exit_code)
            state.world_size = event.get("world_size", state.world_size)
        elif kind in ("output", "output_progress"):
            state.last_line = event["line"]
        elif kind == "report":
            state.step, state.reported = event["step"], event["metrics"]
        elif kind == "loop":
            state.loop.update({key: value for key, value in event.items() if key not in ("type", "rank")})
        elif kind == "log":
            state.status = "slow" if event.get("slow") else "running"
            for name in ("step", "total_steps", "epoch", "loss", "lr", "samples_per_s", "mfu", "loss_scale",
                         "skipped_steps", "micro_batch_size"):
                if name in event:
                    setattr(state, name, event[name])
            self.global_loss = event.get("global_loss", self.global_loss)
            self.global_samples_per_s = event.get("global_samples_per_s", self.global_samples_per_s)
            self.grad_norm = event.get("grad_norm", self.grad_norm)
            self.item_name = event.get("item_name", self.item_name)
            if "global_items_per_s" in event:
                self.items_per_s = event["global_items_per_s"]
        elif kind == "done":
            state.status = "stopped" if event.get("stopped") else "done"
            state.done = event
            state.step = event.get("steps", state.step)
            if "summary" in event and (self.summary is None or event["rank"] == 0):
                self.summary = event["summary"]
        elif kind == "error":
            state.status = "failed"
            state.traceback = event["traceback"]
            state.failure_kind = event.get("kind")
            state.failed_at = event.get("time", 0.0)
        elif kind == "heartbeat":
            position = (event["step"], event["micro"], event["phase_index"], event["phase"])
            state.stall_after_s = event.get("stall_after_s", state.stall_after_s)
            if position != state.position:
                state.position, state.moved_at = position, self.clock()
                if state.status == "stalled":
                    state.status = "running"
        elif kind == "stalled":
            state.status = "stalled"

    def _restarted(self, attempt: int) -> None:
        """torchrun restarted the worker group: the earlier attempt's failures are history, not the outcome."""
        if attempt <= self.restarts:
            return
        self.restarts = attempt
        # The step each rank was last seen in: the later of its heartbeat's (sent once a second, so it can be
        # older than the last log line of fast steps) and the one after its last logged step.
        self.steps_before_restart = {state.rank: max(state.position[0] + 1 if state.position else 0, state.step + 1)
                                     for state in self.ranks.values()}
        self.ranks_before_restart = {state.local_rank: state.rank for state in self.ranks.values()
                                     if state.local_rank is not None}
        for state in self.failures():
            self.recovered.append((attempt - 1, state.rank, state.traceback.strip().splitlines()[-1]))
        for state in self.ranks.values():
            state.traceback, state.failed_at, state.done, state.loop = None, 0.0, None, {}
            state.position = None

    def stalls(self) -> list[dict[str, Any]]:
        """"stalled" events for ranks that just stalled: no rank's loop has moved for its stall_after_s, and
        these ranks are the furthest behind. A rank waiting in a collective for a stuck peer has gone further
        (into its backward pass, whose all-reduce waits) than the peer it waits for."""
        now = self.clock()
        # A rank marked slow is training too: the rank that holds the others back is the likeliest to hang.
        beating = [s for s in self.ranks.values()
                   if s.position is not None and s.status in ("running", "slow", "stalled")]
        if not beating or any(now - s.moved_at < (s.stall_after_s or float("inf")) for s in beating):
            return []
        behind = min(s.position[:3] for s in beating)
        if self.script:
            # A script's position is its collectives (rank.script): all ranks at the same one is a pause between
            # collectives, not a hang; one behind, with the others waiting in a collective it has not entered, is.
            if behind == max(s.position[:3] for s in beating):
                return []
            return [{"type": "stalled", "rank": s.rank, "step": s.position[0], "phase": s.position[3],
                     "silent_s": round(now - s.moved_at, 1), "script": True}
                    for s in beating if s.position[:3] == behind and s.status != "stalled"]
        return [{"type": "stalled", "rank": s.rank, "step": s.position[0] + 1, "phase": s.position[3],
                 "silent_s": round(now - s.moved_at, 1)}
                for s in beating if s.position[:3] == behind and s.status != "stalled"]

    def stalled(self) -> list[RankState]:
        return sorted((s for s in self.ranks.values() if s.status == "stalled"), key=lambda s: s.rank)

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    @property
    def mfu(self) -> float | None:
        """The ranks' mean model FLOPs utilisation at their last log interval (None where none counts FLOPs)."""
        values = [s.mfu for s in self.ranks.values() if s.mfu is not None]
        return sum(values) / len(values) if values else None

    @property
    def eta(self) -> float | None:
        running = [s for s in self.ranks.values() if s.total_steps and s.step]
        if not running:
            return None
        done = min(s.step / s.total_steps for s in running)
        return self.elapsed * (1 - done) / done if done < 1 else 0.0

    def failures(self) -> list[RankState]:
        """Failed ranks, first failure first: usually the cause; the others mostly saw it vanish."""
        return sorted((s for s in self.ranks.values() if s.traceback), key=lambda s: (s.failed_at, s.rank))

    def failure_reports(self) -> list[tuple[int, str]]:
        """(rank, text): the first failure's whole traceback, then one line for each rank that failed after."""
        failures = [state for state in self.failures()
                    if not (self.stopped and state.failure_kind == "interrupted")]
        reports = []
        for index, state in enumerate(failures):
            if index == 0:
                reports.append((state.rank, state.traceback.rstrip()))
            else:
                last = state.traceback.strip().splitlines()[-1]
                reports.append((state.rank, f"{last} (after rank {failures[0].rank} failed)"))
        return reports
