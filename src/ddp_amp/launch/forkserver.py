"""Start the fork server that spawn's ranks fork from, early and in the background.

Most of a rank's start is importing torch, torch.distributed and torch._dynamo (which DDP's constructor
imports). The fork server imports them once and every rank forks warm. Started before the launcher imports
torch itself, the two imports overlap instead of running one after the other. No torch here: stdlib only.

The ranks' parent is the fork server, not the launcher, so a rank's own parent-death signal fires only when
the fork server dies; the fork server itself outlived a SIGKILLed launcher. Its first preload therefore ties
it to the launcher (`ddp_amp.launch.forkserver_tether`): launcher dies -> fork server dies -> ranks die.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os

from ddp_amp.process import LAUNCHER_PID_VAR, stop_signals_blocked

PRELOAD = ["ddp_amp.launch.forkserver_tether", "torch", "torch.distributed", "torch._dynamo", "ddp_amp.worker"]


def start_forkserver() -> None:
    """Idempotent; torch.multiprocessing's "forkserver" context uses this same server."""
    os.environ[LAUNCHER_PID_VAR] = str(os.getpid())  # inherited by the fork server: whom it must die with
    multiprocessing.set_forkserver_preload(PRELOAD)
    # The resource tracker starts first, inside ensure_running: both inherit the blocked stop signals. A rank,
    # forked from the fork server, holds them blocked too until its own handlers are set (ddp_amp.rank.signals):
    # a stop in its first milliseconds waits for the handler instead of being dropped.
    with stop_signals_blocked():
        # It unblocks SIGINT and SIGTERM itself once it has started its process: started first and on its own,
        # it cannot unblock them for the fork server started next (they would reach its ranks unhandled).
        multiprocessing.resource_tracker.ensure_running()
    with stop_signals_blocked():
        multiprocessing.forkserver.ensure_running()
