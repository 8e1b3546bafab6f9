"""The stop request of one rank: the first stop signal it received, read by the training loop and agreed on
by all ranks at the same step (train.stop.StopAgreement)."""

from __future__ import annotations

import signal
import time

from ddp_amp.process import STOP_SIGNALS


class StopRequest:
    """The first stop signal this rank received: passed on by its launcher, or delivered by the system to the
    whole process group or job step (SIGTERM from kill, timeout, systemd or scancel; SIGHUP from a closed
    terminal; SIGINT from Ctrl-C; SIGUSR1 from Slurm's --signal warning). Later ones change nothing: the
    rank is stopping already, and the launcher's second signal is what ends everything at once."""

    signum: int | None = None


STOP_REQUEST = StopRequest()


def stop_on_signals() -> None:
    """The handler first, then the signals unblocked: a rank forked from the fork server has held them blocked
    since its first instant (process.stop_signals_blocked), and one that arrived meanwhile is delivered now."""

    def handler(signum: int, frame: object) -> None:
        if STOP_REQUEST.signum is None:
            STOP_REQUEST.signum = signum

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def wait_for_own_stop_signal(timeout_s: float, poll_s: float = 0.05) -> None:
    """Wait until this rank has received a stop signal itself (not only agreed to another rank's), up to
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while STOP_REQUEST.signum is None and time.monotonic() < deadline:
        time.sleep(poll_s)
