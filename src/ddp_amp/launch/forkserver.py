"""Start the fork server that spawn's ranks fork from, early and in the background.

Most of a rank's start is importing torch, torch.distributed and torch._dynamo (which DDP's constructor
imports). The fork server imports them once and every rank forks warm. Started before the launcher imports
torch itself, the two imports overlap instead of running one after the other. No torch here: stdlib only.

The ranks' parent is the fork server, not the launcher, so a rank's own parent-death signal fires only when
the fork server dies; the fork server itself outlived a SIGKILLed launcher. Its first preload therefore ties
it to the launcher (`ddp_amp.launch.forkserver_tether`): launcher dies -> fork server dies -> ranks die.

The launcher's own checks that build the task (launch.preflight) run in a child of the fork server too
(`call_warm`): building a task on the meta device runs torch's Python reference kernels, whose first call
imports torch._dynamo, ~1.4 s of CPU that the fork server has spent already.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
from collections.abc import Callable
from typing import Any

from ddp_amp.launch.scratch import own_temporary_directory, remove_when_gone
from ddp_amp.process import LAUNCHER_PID_VAR, ChildDied, call_in_child, stop_signals_blocked

PRELOAD = ["ddp_amp.launch.forkserver_tether", "torch", "torch.distributed", "torch._dynamo", "ddp_amp.worker"]


_started = False


WarmChildDied = ChildDied
"""call_warm's child ended without an answer (killed by a signal, or it exited the process itself)."""


def start_forkserver() -> None:
    """Idempotent; torch.multiprocessing's "forkserver" context uses this same server."""
    global _started
    _started = True
    own_temporary_directory()  # the socket's directory (and the rest of this launcher's) removed however it ends
    os.environ[LAUNCHER_PID_VAR] = str(os.getpid())  # inherited by the fork server: whom it must die with
    multiprocessing.set_forkserver_preload(PRELOAD)
    _short_socket_directory()
    # The resource tracker starts first, inside ensure_running: both inherit the blocked stop signals. A rank,
    # forked from the fork server, holds them blocked too until its own handlers are set (ddp_amp.rank.signals):
    # a stop in its first milliseconds waits for the handler instead of being dropped.
    with stop_signals_blocked():
        # It unblocks SIGINT and SIGTERM itself once it has started its process: started first and on its own,
        # it cannot unblock them for the fork server started next (they would reach its ranks unhandled).
        multiprocessing.resource_tracker.ensure_running()
    with stop_signals_blocked():
        multiprocessing.forkserver.ensure_running()


SOCKET_PATH_MAX = 107
"""The longest path a Unix socket's address takes on Linux (sun_path holds 108 bytes with its NUL)."""


def _short_socket_directory() -> None:
    """multiprocessing puts the fork server's socket in a pymp-XXXXXXXX directory under TMPDIR, which with a
    long TMPDIR makes the socket's path longer than a Unix socket allows (OSError: AF_UNIX path too long,
    raised from deep in multiprocessing). Its directory is made once per process: where TMPDIR is too long,
    make it under /tmp (or the current directory) instead, and tell launch.scratch's janitor of it; everything
    else keeps using this launcher's own directory under TMPDIR."""
    import tempfile
    from multiprocessing import util

    longest = os.path.join(tempfile.gettempdir(), "pymp-xxxxxxxx", "listener-xxxxxxxx")
    if len(os.fsencode(longest)) <= SOCKET_PATH_MAX:
        return
    saved = tempfile.tempdir
    try:
        tempfile.tempdir = next((place for place in ("/tmp", "/var/tmp", os.getcwd())
                                 if os.access(place, os.W_OK) and len(place) < 40), None)
        remove_when_gone(util.get_temp_dir())  # made now, in the short place; kept for this process
    finally:
        tempfile.tempdir = saved


def call_warm(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a child of the fork server, where torch is imported already, with this process's
    environment and working directory: its result, or its exception raised here. In this process when no fork
    server was started (a dry run). The child dies with the fork server, which dies with this launcher; this
    launcher interrupted (Ctrl-C) kills it."""
    if not _started:
        return function(*args)
    return call_in_child(multiprocessing.get_context("forkserver"), "ddp-amp-checks", function, args)
