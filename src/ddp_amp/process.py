"""Process plumbing that needs no torch: dying with the launcher, and turning stop signals into exceptions."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

LAUNCHER_PID_VAR = "DDP_AMP_LAUNCHER_PID"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""What asks a run to stop: kill/schedulers, Ctrl-C, a closed terminal, Slurm's --signal warning (USR1 or USR2,
see --requeue-signal)."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as under taskset or a cgroup cpuset); GNU `nproc`
    would honour OMP_NUM_THREADS instead."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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


REPEAT_WINDOW_S = 1.0
"""A repeat of the stop signal within this long of the first is the same stop delivered twice: GNU `timeout`
signals its command and then its whole process group, which holds the command again, microseconds apart."""


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within the block, the STOP_SIGNALS raise StopSignal in the main thread, so the launcher stops its ranks
    (gracefully) and says so instead of vanishing with them still running. A second signal ends the launcher at
    once, and its ranks with it (their parent-death signal), by that signal's default action: any other stop
    signal, or the same one more than REPEAT_WINDOW_S after the first (sooner, it is the first delivered twice)."""
    first: list[tuple[int, float]] = []

    def handler(signum: int, frame: object) -> None:
        if not first:
            first.append((signum, time.monotonic()))
            raise StopSignal(signum)
        first_signum, first_at = first[0]
        if signum == first_signum and time.monotonic() - first_at < REPEAT_WINDOW_S:
            return
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

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
