"""The stop request of one rank: the first stop signal it received, read by the training loop and agreed on
by all ranks at the same step."""

from __future__ import annotations

import signal


class StopRequest:
    """The first stop signal this rank received (SIGUSR1 from its launcher or a scheduler, SIGINT from a
    terminal). The training loop reads it at log intervals, where all ranks agree to stop at the same step."""

    signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None


STOP_REQUEST = StopRequest()
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGINT)


def stop_on_signals() -> None:
    def handler(signum: int, frame: object) -> None:
        if STOP_REQUEST.signum is None:
            STOP_REQUEST.signum = signum

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
