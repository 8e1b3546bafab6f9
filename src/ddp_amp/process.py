"""Process plumbing that needs no torch: dying with the launcher, and turning stop signals into exceptions."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

LAUNCHER_PID_VAR = "DDP_AMP_LAUNCHER_PID"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""What asks a run to stop: kill/schedulers, Ctrl-C, a closed terminal, Slurm's --signal warning (USR1 or USR2,
see --requeue-signal)."""


@contextlib.contextmanager
def stop_signals_ignored() -> Iterator[None]:
    """Within the block, the STOP_SIGNALS are ignored. A process exec'd here inherits SIG_IGN (an exec resets
    handlers, not ignored signals): the fork server and the resource tracker, started inside this block, ignore
    them from their first instant. Signals reach a whole process group or Slurm job step, and either helper
    dying by one would take every rank with it (the ranks' parent-death signal)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies, so nothing outlives a killed launcher.

    If the parent is already gone (it died between our fork and this call), we were re-parented and the
    request would never fire: deliver the signal now instead.
    """
    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, sig)
    except (OSError, AttributeError):
        return  # not Linux: rely on the launcher's own clean-up
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


class StopSignal(Exception):
    """The launcher was asked to stop (SIGTERM from `kill` or a scheduler, SIGHUP from a closed terminal)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process killed by that signal (SIGTERM: 143)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within the block, the STOP_SIGNALS raise StopSignal in the main thread, so the launcher stops its ranks
    (gracefully) and says so instead of vanishing with them still running. A second signal is not caught:
    it ends the launcher at once, and its ranks with it."""

    def handler(signum: int, frame: object) -> None:
        for sig in STOP_SIGNALS:  # a second signal ends the launcher at once (its ranks die with it)
            signal.signal(sig, signal.SIG_DFL)
        raise StopSignal(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def signal_processes(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
