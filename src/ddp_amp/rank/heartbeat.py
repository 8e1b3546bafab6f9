"""A thread telling the launcher, every second, where this rank's training loop is."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ddp_amp.rank import flight_recorder
from ddp_amp.train.step import PHASES

if TYPE_CHECKING:
    from ddp_amp.rank.reporter import WorkerReporter
    from ddp_amp.train.trainer import Trainer

HEARTBEAT_S = 1.0

def stall_after_s(timeout_s: float) -> float:
    """How long no rank's loop may stand still before the launcher calls the furthest-behind one stalled:
    a quarter of the collective timeout (so it is named well before the timeout fails the run), 2 s to 60 s."""
    return min(60.0, max(2.0, timeout_s / 4))


class Heartbeat:
    """Sends the trainer's position (step, micro-step, phase) every HEARTBEAT_S.

    A loop that stands still while its heartbeat goes on is stuck: in a hung user function, or in a collective
    waiting for a rank that is. The launcher compares the ranks' positions to tell which (see ProgressState).
    A loop that has stood still for `stall_after` seconds also writes this rank's flight record (once per
    stall): the stuck main thread cannot, and the run may end before it could.
    """

    def __init__(self, reporter: WorkerReporter, trainer: Trainer, stall_after: float,
                 run_dir: Path | None = None) -> None:
        self.reporter, self.trainer, self.stall_after, self.run_dir = reporter, trainer, stall_after, run_dir
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ddp-amp-heartbeat", daemon=True)

    def _beat(self) -> None:
        last, since, dumped = None, time.monotonic(), False
        while not self._stop.wait(HEARTBEAT_S):
            position = self.trainer.position
            step, micro, phase = position
            if self.reporter.sender is not None:
                self.reporter.heartbeat(step=step, micro=micro, phase_index=phase, phase=PHASES[phase],
                                        stall_after_s=self.stall_after)
            if position != last:
                last, since, dumped = position, time.monotonic(), False
            elif not dumped and self.run_dir is not None and time.monotonic() - since >= self.stall_after:
                dumped = True
                flight_recorder.dump(self.run_dir, self.reporter.env.rank, f"no progress for {self.stall_after:g}s",
                                     (step + 1, micro, PHASES[phase]))

    def __enter__(self) -> Heartbeat:
        if self.reporter.sender is not None or self.run_dir is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
