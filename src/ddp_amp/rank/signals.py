"""The stop request of one rank: the first stop signal it received, read by the training loop and agreed on
by all ranks at the same step (train.stop.StopAgreement)."""

from __future__ import annotations

import os
import signal
import threading
import time

from ddp_amp.process import BLOCKED_WAIT_STOPS, STOP_SIGNALS


class StopRequest:
    """The first stop signal this rank received: passed on by its launcher, or delivered by the system to the
    whole process group or job step (SIGTERM from kill, timeout, systemd or scancel; SIGHUP from a closed
    terminal; SIGINT from Ctrl-C; SIGUSR1 from Slurm's --signal warning). Later ones change nothing: the
    rank is stopping already, and the launcher's second signal is what ends everything at once."""

    signum: int | None = None


STOP_REQUEST = StopRequest()


def stop_on_signals() -> None:
    """The handler first, then the signals unblocked: a rank forked from the fork server has held them blocked
    since its first instant (process.stop_signals_blocked), and one that arrived meanwhile is delivered now.
    A stop that comes while the rank is blocked in the start-up's rendezvous is watched for as well
    (process.BlockedWaitStops)."""

    def handler(signum: int, frame: object) -> None:
        if STOP_REQUEST.signum is None:
            STOP_REQUEST.signum = signum
            BLOCKED_WAIT_STOPS.noticed(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    BLOCKED_WAIT_STOPS.install()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


LEAVE_DELAY_S = 0.5
"""After a stop, how long a finished rank stays: enough for torch's wrapper to hand its return value to the agent
(a small write to a pipe, right after the entry function returns)."""


def leave_once_stopped() -> None:
    """For a rank whose work is done and which torchrun's function-entry wrapper keeps waiting until its agent has
    read the return value: after a stop signal (received already, or from now on) it leaves, exit 0, once the
    value is handed over. The agent's SIGTERM that stops a group after another rank failed would otherwise go
    unheeded (the work is done, there is nothing to stop) and it would wait 30 s to SIGKILL this rank."""

    def leave(*_: object) -> None:
        threading.Thread(target=_exit_after, args=(LEAVE_DELAY_S,), name="ddp-amp-leave", daemon=True).start()

    for sig in STOP_SIGNALS:
        signal.signal(sig, leave)
    if STOP_REQUEST.signum is not None:
        leave()


def _exit_after(delay_s: float) -> None:
    time.sleep(delay_s)
    os._exit(0)


def wait_for_own_stop_signal(timeout_s: float, poll_s: float = 0.05) -> None:
    """Wait until this rank has received a stop signal itself (not only agreed to another rank's), up to
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while STOP_REQUEST.signum is None and time.monotonic() < deadline:
        time.sleep(poll_s)
