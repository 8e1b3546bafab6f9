"""Start the fork server that spawn's ranks fork from, early and in the background.

Most of a rank's start is importing torch, torch.distributed and torch._dynamo (which DDP's constructor
imports). The fork server imports them once and every rank forks warm. Started before the launcher imports
torch itself, the two imports overlap instead of running one after the other. No torch here: stdlib only.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ddp_amp.worker"]


def start_forkserver() -> None:
    """Idempotent; torch.multiprocessing's "forkserver" context uses this same server."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
