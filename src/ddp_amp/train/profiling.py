"""--profile START:END: torch.profiler over a window of optimizer steps on every rank.

Outside the window nothing is profiled and nothing costs extra. The window's wall time is taken out of the
run's throughput figure (profiling slows the steps it records), and the device is synchronised at both edges so
that the window holds exactly its own steps' work.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

PROFILE_DIR = "profile"
TOP_OPS = 15


class StepProfiler:
    def __init__(self, window: tuple[int, int] | None, device: torch.device, rank: int, run_dir: Path) -> None:
        self.window, self.device, self.rank = window, device, rank
        self.trace_dir = Path(run_dir) / PROFILE_DIR
        self._profiler: torch.profiler.profile | None = None
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.top_ops: list[dict[str, Any]] = []

    def resumed_at(self, start_step: int) -> None:
        """A run resumed after step `start_step` profiles the part of its window it runs; none, past it."""
        if self.window is not None and self.window[0] <= start_step:
            self.window = (start_step + 1, self.window[1]) if self.window[1] > start_step else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, number: int) -> None:
        """`number`: the optimizer step about to run, from 1."""
        if self.window is None or number != self.window[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._sync()
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()
        self.started_at = time.perf_counter()

    def after_step(self, number: int) -> None:
        if self._profiler is None or number != self.window[1]:
            return
        self._sync()
        self.ended_at = time.perf_counter()
        self.stop()

    def stop(self) -> None:
        """Ends the window (at its last step, or early when the run stops inside it) and writes the trace."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        if self.ended_at is None:
            self._sync()
            self.ended_at = time.perf_counter()
        profiler.__exit__(None, None, None)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.trace_path))  # .gz: torch compresses it
        self.top_ops = self._top_ops(profiler)

    @property
    def trace_path(self) -> Path:
        return self.trace_dir / f"rank{self.rank}.json.gz"

    def _top_ops(self, profiler: torch.profiler.profile) -> list[dict[str, Any]]:
        """The operators with the most self time (on the device where there is one), in milliseconds."""
        on_device = self.device.type == "cuda"
        rows = []
        for event in profiler.key_averages():
            device_us = getattr(event, "self_device_time_total", 0.0) if on_device else 0.0
            rows.append({"name": event.key, "calls": event.count, "self_cpu_ms": event.self_cpu_time_total / 1e3,
                         **({"self_cuda_ms": device_us / 1e3} if on_device else {})})
        rows.sort(key=lambda row: row.get("self_cuda_ms", row["self_cpu_ms"]), reverse=True)
        return rows[:TOP_OPS]

    def overlap(self, steady_from: float | None, measured_steps_from: int) -> tuple[float, int]:
        """(seconds, steps) of the profiled window inside the throughput measurement, which starts at
        perf_counter `steady_from` after step `measured_steps_from`: taken out of the figure."""
        if self.window is None or self.started_at is None or self.ended_at is None:
            return 0.0, 0
        begin = max(self.started_at, steady_from) if steady_from is not None else self.started_at
        steps = self.window[1] - max(self.window[0] - 1, measured_steps_from)
        return max(0.0, self.ended_at - begin), max(0, steps)

    def summary(self) -> dict[str, Any]:
        window_s = (self.ended_at - self.started_at
                    if self.started_at is not None and self.ended_at is not None else None)
        return {"steps": list(self.window), "traces": str(self.trace_dir), "top_ops": self.top_ops,
                "window_s": window_s, "excluded_from_throughput": True}
