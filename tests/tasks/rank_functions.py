"""What a rank runs in tests/system/test_rank_processes.py, started by launch.processes.RankProcesses as spawn
starts ranks (forked from the fork server, so importable by name): `function(rank, *args)`."""

import os
import signal
import time
from pathlib import Path

from ddp_amp.files import atomic_write  # a reader never sees the pid file empty


def _takes_sigterm() -> None:
    """As a rank once its handlers are set: a rank forked from the fork server starts with the stop signals
    blocked (launch.forkserver), and here SIGTERM keeps its default action, death."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def first_fails_second_cleans_up(rank: int, marker_dir: str) -> None:
    """Rank 0 raises at once; rank 1 finds its peer gone a moment later and spends a second in a `finally` that
    writes a marker (a checkpoint's flush, a log's close) before its own error ends it. A SIGTERM in that second
    kills it before the marker."""
    _takes_sigterm()
    if rank == 0:
        raise ValueError("rank 0 fails on purpose")
    time.sleep(0.3)
    try:
        raise RuntimeError("the peer is gone")
    finally:
        time.sleep(1.0)
        Path(marker_dir, f"rank{rank}.cleaned").write_text("done")


def first_fails_second_ignores_sigterm(rank: int, marker_dir: str) -> None:
    """Rank 0 raises at once; rank 1 ignores SIGTERM and never ends by itself: only SIGKILL ends it."""
    if rank == 0:
        raise ValueError("rank 0 fails on purpose")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _takes_sigterm()
    atomic_write(Path(marker_dir, "rank1.ignoring"), str(os.getpid()).encode())
    while True:
        time.sleep(1)


def waits_to_be_killed(rank: int, marker_dir: str) -> None:
    """Every rank reports its pid and waits: the test damages a rank's error file and kills it."""
    atomic_write(Path(marker_dir, f"rank{rank}.pid"), str(os.getpid()).encode())
    while True:
        time.sleep(1)
