"""A thread telling the launcher, every second, where this rank's training loop is."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

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
    waiting for a rank that is. The launcher compares the ranks' positions to tell which (see ProgressModel).
    """

    def __init__(self, reporter: WorkerReporter, trainer: Trainer, stall_after: float) -> None:
        self.reporter, self.trainer, self.stall_after = reporter, trainer, stall_after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ddp-amp-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            step, micro, phase = self.trainer.position
            self.reporter.heartbeat(step=step, micro=micro, phase_index=phase, phase=PHASES[phase],
                                    stall_after_s=self.stall_after)

    def __enter__(self) -> Heartbeat:
        if self.reporter.sender is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
