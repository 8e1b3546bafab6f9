"""Process plumbing that needs no torch: dying with the launcher, and turning stop signals into exceptions."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

LOOPBACK = "127.0.0.1"
"""Where a launcher on one machine serves its rendezvous store: reachable from this machine only."""
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


FORKSERVER_PID_VAR = "DDP_AMP_FORKSERVER_PID"
"""Set by the fork server in its own environment (launch.forkserver_tether): a rank forked from it knows the
parent it must die with, without reading it after the fork (when a dead parent would already be replaced)."""


def children_started_as_the_platform_does() -> None:
    """A rank forked from the fork server inherits its start method ("forkserver", from multiprocessing's
    preparation data), so the rank's own children came from the launcher's fork server too: DataLoader workers
    that could not import a data set class of a --task file (loaded from its path, under a name of its own), and
    a script's workers that re-ran the script. A rank starts its children as the platform does, as under
    torchrun (fork, on Linux before Python 3.14)."""
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Within the block, the STOP_SIGNALS are blocked, not lost: one that arrives stays pending and is delivered
    when the block ends. A process started here inherits the blocked mask through fork and exec: the fork server
    and the resource tracker never unblock them (a signal to the whole process group or Slurm job step must not
    kill either, which would take every rank with it), and a rank forked from the fork server holds every stop
    signal from its first instant until its handler is set and it unblocks them (rank.signals)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class DeferredStops:
    """Stop signals recorded instead of acted on from `hold()` until `release()`, which raises the first one
    again through the handlers in force before: the launcher takes a stop at a point where it can pass it on to
    every rank, not halfway through forking them. (Blocking the signals in the main thread would not do: the
    launcher's other threads would take them, and Python runs its handlers in the main thread anyway.)"""

    def __init__(self) -> None:
        self.arrived: list[int] = []
        self.previous: dict = {}

    def hold(self) -> None:
        self.previous = {sig: signal.signal(sig, self._record) for sig in STOP_SIGNALS}

    def _record(self, signum: int, frame: object) -> None:
        self.arrived.append(signum)

    def release(self) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)
        self.previous = {}
        if self.arrived:
            signal.raise_signal(self.arrived.pop(0))


STARTUP_STOP_GRACE_S = 5.0
"""How long a stop signal may wait for a rank that is blocked in the start-up's rendezvous: the others join within
milliseconds when they are alive (the fork server has torch imported already), and a peer that died at start-up
never does."""


class BlockedWaitStops:
    """Stop signals noticed while the main thread is blocked in C++ (init_process_group waiting at the store for
    peers), where Python cannot run its handler until the wait returns: which, with a peer killed at start-up,
    is the store's timeout, and torchrun's agent SIGKILLs the rank 30 s after its SIGTERM. Python's C-level
    handler writes each signal's number to a wake-up pipe at once; a thread reads it, and when the wait is still
    blocked STARTUP_STOP_GRACE_S after both the stop and the wait began, ends the process with 128 + the
    signal. Nothing is lost: no step has run before the group exists."""

    def __init__(self) -> None:
        self.stop: tuple[int, float] | None = None
        self.waiting_since: float | None = None
        self.what = ""
        self._pipe: tuple[int, int] | None = None

    def install(self) -> None:
        """From the main thread, once its handlers are set and before it unblocks the stop signals (a pending one
        is then written to the pipe too)."""
        if self._pipe is not None:
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._pipe = (read, write)
        threading.Thread(target=self._watch, name="ddp-amp-startup-stops", daemon=True).start()

    def noticed(self, signum: int) -> None:
        """A stop the handler already took (before the wait began)."""
        if self.stop is None:
            self.stop = (signum, time.monotonic())

    @contextlib.contextmanager
    def blocked_wait(self, what: str) -> Iterator[None]:
        self.what, self.waiting_since = what, time.monotonic()
        try:
            yield
        finally:
            self.waiting_since = None

    def _watch(self) -> None:
        stops = {int(sig) for sig in STOP_SIGNALS}
        while True:
            if select.select([self._pipe[0]], [], [], 0.2)[0]:
                for signum in os.read(self._pipe[0], 64):
                    if signum in stops:
                        self.noticed(signum)
            since = self.waiting_since
            if self.stop is None or since is None:
                continue
            signum, stopped_at = self.stop
            if time.monotonic() - max(stopped_at, since) > STARTUP_STOP_GRACE_S:
                name = signal.Signals(signum).name
                sys.stderr.write(f"ddp-amp: stopped by {name} while {self.what}, blocked for more than "
                                 f"{STARTUP_STOP_GRACE_S:g}s (a peer that died at start-up never joins); no step "
                                 "had run\n")
                sys.stderr.flush()
                os._exit(128 + signum)


BLOCKED_WAIT_STOPS = BlockedWaitStops()


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask Linux to send `sig` to this process when its parent dies, so nothing outlives a killed launcher.

    If the parent is already gone (it died between our fork and this call), we were re-parented and the
    request would never fire: deliver the signal now instead. `parent`: the pid the parent had at the fork, where
    it is known; read now, it would be the new parent's already.
    """
    parent = os.getppid() if parent is None else parent
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
        self.startup: str | None = "nothing was written"
        """What the launch had changed on disk when the stop landed while it was still starting (before any rank
        trained), set by the launch as it goes (launch.session.Launch.stops_told); None once the ranks started."""
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


class ChildDied(Exception):
    """call_in_child's child ended without an answer (killed by a signal, or it exited the process itself)."""


def call_spawned(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a fresh child interpreter (multiprocessing's spawn), as call_in_child answers: for a
    command that starts no fork server (export) but must not run a user's code in its own process. Spawn rather
    than the launcher's fork server, started for one call: it preloads what only ranks need (torch._dynamo, the
    worker); and rather than fork: this process has torch's threads running already. It dies with this one."""
    import multiprocessing

    return call_in_child(multiprocessing.get_context("spawn"), "ddp-amp-child", function, args)


CHILD_EXIT_S = 5.0
"""How long a child that answered gets to end on its own (a thread the user's code left running may hold it)."""


def call_in_child(context, name: str, function: Callable[..., Any], args: tuple) -> Any:
    """`function(*args)` in a child of multiprocessing `context`, with this process's environment and working
    directory as they are now: its result, or its exception raised here; ChildDied where it died unanswered."""
    receive, send = context.Pipe(duplex=False)
    # A spawned child's parent is this process, whose pid it is told: this one killed or interrupted while the
    # child still starts (a loaded machine), the child, re-parented by then, sees it and ends. A fork server's
    # child has the fork server as its parent, tied to this process in turn.
    parent = os.getpid() if context.get_start_method() == "spawn" else None
    child = context.Process(target=_call_and_send,
                            args=(send, dict(os.environ), os.getcwd(), function, args, parent),
                            daemon=True, name=name)
    child.start()
    send.close()
    answered = False
    try:
        succeeded, value = receive.recv()
        answered = True
    except EOFError:  # the child died without an answer
        child.join(5)
        raise ChildDied(f"exit code {child.exitcode}") from None
    finally:
        receive.close()
        # Its answer sent, the child ends on its own: killed at once, it left what its exit would have cleaned
        # up (a semaphore tqdm's lock made: "resource_tracker: ... leaked semaphore objects" at this one's exit).
        # Unanswered (this launcher interrupted, Ctrl-C), it is killed at once.
        child.join(CHILD_EXIT_S if answered else 0)
        if child.is_alive():
            child.kill()
        child.join()
    if not succeeded:
        raise value
    return value


def _call_and_send(send, environ: dict[str, str], cwd: str, function: Callable[..., Any], args: tuple,
                   parent: int | None) -> None:
    die_with_parent(signal.SIGKILL, parent)  # the fork server (which dies with the launcher), or call_spawned's caller
    # As in this launcher now, not as when the fork server started (a variable set in between, a chdir).
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    try:
        result = (True, function(*args))
    except BaseException as exc:  # noqa: BLE001 -- handed to the launcher, which raises it
        result = (False, exc)
    try:
        send.send(result)
    except Exception as exc:  # an unpicklable exception or result
        send.send((False, RuntimeError(f"{type(result[1]).__name__}: {result[1]}"[:2000] + f" ({exc})")))


def process_limit() -> tuple[int, str] | None:
    """The most processes (threads included) this node lets this launch start, and what sets it: kernel.pid_max,
    kernel.threads-max, this cgroup's pids.max, and `ulimit -u` (which does not bind root); None where none can be
    read (not Linux). A launch that needs more than this cannot start them all, whatever else runs."""
    from pathlib import Path

    files = {"/proc/sys/kernel/pid_max": "kernel.pid_max", "/proc/sys/kernel/threads-max": "kernel.threads-max"}
    with contextlib.suppress(OSError):  # cgroup v2 (0::/path) or v1's pids controller (N:pids:/path)
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, where = line.split(":", 2)
            if controllers in ("", "pids"):
                root = "/sys/fs/cgroup" + ("/pids" if controllers else "")
                files[f"{root}{where.rstrip('/')}/pids.max"] = "the cgroup's pids.max"
    limits = []
    for path, name in files.items():
        with contextlib.suppress(OSError):
            if (text := Path(path).read_text().strip()).isdigit():
                limits.append((int(text), name))
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY:
        limits.append((soft, "ulimit -u"))
    return min(limits) if limits else None
