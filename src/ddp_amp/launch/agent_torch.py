"""torch's elastic agent, adapted to run in a thread of the launcher (launch.agent): torch imported quietly,
finished workers let go, and the agent it makes recorded. Each reaches into torch where its public API has no
door, and each is guarded so that a torch where the door moved is left as it is."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def import_torch_without_cpp_warnings() -> None:
    """torch, imported in the launcher with c10's C++ log at ERROR unless the user set TORCH_CPP_LOG_LEVEL: the
    agent's TCPStore warns on stderr, ~10 lines of C++ frames a warning, when the rendezvous host goes away (the
    launcher's own line says so), over the progress display. c10 reads the variable once, as torch loads; it is
    taken away again so that nothing this launcher starts later inherits it (the ranks, forked from the fork
    server, never see it: it started before)."""
    import sys

    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def let_workers_leave_when_done(context_class: type | None = None) -> bool:
    """Make torch's function-entry worker context let each worker leave as soon as it is done, as torchrun's
    subprocess workers do; whether it now does.

    A worker run as a function hands its return value to the agent and then waits until the agent says it has
    read every worker's (MultiprocessContext's finished-reading event). A rank whose work is done stays alive,
    its connections open: a script whose rank 1 returns early leaves rank 0 hanging in its next collective until
    its timeout (under torchrun it fails at once, "Connection closed by peer"); at a membership change the agent
    sends SIGTERM and joins its workers without ever reading, so our ranks, which take the SIGTERM as a stop
    (one step, a checkpoint), would wait until its SIGKILL 30 s later. The event is set as the context starts,
    before any worker can sleep on it: each worker puts its return value (None: a small write to a pipe, read
    by the agent's next poll) and exits. (Setting it later risks a hang: multiprocessing's Event.set waits for
    every sleeper to wake, and one killed while it slept never does.)

    The one patch of a private torch API, so it is guarded: where the class no longer has `_start(self)`, or no
    longer makes `_worker_finished_event`, torch's behaviour is left as it is (finished ranks then leave at the
    agent's signal: rank.signals.leave_once_stopped)."""
    if context_class is None:
        from torch.distributed.elastic.multiprocessing.api import MultiprocessContext as context_class
    start = getattr(context_class, "_start", None)
    if getattr(start, "lets_workers_leave", False):
        return True
    if not _start_is_as_patched(context_class, start):
        return False

    def _start(self) -> None:
        finished_reading = getattr(self, "_worker_finished_event", None)
        if finished_reading is not None:
            finished_reading.set()  # no worker is running yet, so none sleeps on it
        start(self)

    _start.lets_workers_leave = True
    context_class._start = _start
    return True


def _start_is_as_patched(context_class: type, start) -> bool:
    """torch's worker context still has what the patch wraps: `_start(self)`, and the finished-reading event
    its __init__ makes."""
    import inspect

    if not callable(start):
        return False
    try:
        parameters = list(inspect.signature(start).parameters)
        source = inspect.getsource(context_class)
    except (TypeError, ValueError, OSError):
        return False
    return parameters == ["self"] and "self._worker_finished_event =" in source


@contextlib.contextmanager
def agents_recorded(agents: list) -> Iterator[None]:
    """The agent that launch_agent makes, appended to `agents`, so that a stop can take its remaining restarts
    away (torchrun's own agent gets the stop signal itself and shuts down; ours runs in a thread that gets none).
    torch's agent counts down `_remaining_restarts` (torch 2.13); where that changes, a stopped script's ranks
    may be restarted by the agent, and are killed with it at --stop-timeout."""
    import torch.distributed.launcher.api as launcher_api

    made = getattr(launcher_api, "LocalElasticAgent", None)
    if not isinstance(made, type):
        yield
        return

    class Recorded(made):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            agents.append(self)

    launcher_api.LocalElasticAgent = Recorded
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = made
