"""`ddp-amp run` and `ddp-amp multinode`: torchrun's elastic agent, inside the launcher.

torch.distributed.launcher's `launch_agent` is what torchrun itself runs: the same rendezvous, restarts,
membership changes and worker monitoring. Run here, with a function entry point and workers forked from the
fork server that `spawn` preloads, there is no second interpreter importing torch for the agent and no worker
importing torch and torch._dynamo again (torchrun's way cost ~4.6 s more to the first step than spawn,
docs/benchmarks.md).

The agent runs in a thread of its own, so it installs no signal handlers: the launcher keeps its own, and a stop
signal asks the ranks to stop gracefully (at one step, with a checkpoint) instead of torchrun's SIGTERM to all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ddp_amp.config import JobKind
from ddp_amp.errors import RunFailed, exception_line, failure_line, is_peer_symptom
from ddp_amp.launch.agent_torch import agents_recorded, import_torch_without_cpp_warnings, let_workers_leave_when_done
from ddp_amp.launch.agent_watch import AgentWatch
from ddp_amp.launch.forkserver import start_forkserver
from ddp_amp.launch.torchrun import ElasticJob
from ddp_amp.process import StopSignal, signal_processes

AGENT_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
"""The agent's loggers, and torch.multiprocessing's, which the agent starts the ranks with (its "Terminating
process ... via signal SIGTERM" when a rank failed): their records go to the agent's log, not the terminal."""
FAILURE_LINGER_S = 1.0


def worker_entry(config_path: str, env: dict[str, str], kind: JobKind) -> None:
    """A rank, forked from the fork server (whose environment predates this launch: the launch's own
    variables come as an argument)."""
    os.environ.update(env)
    from ddp_amp.worker import main

    try:
        main([config_path, kind])  # the agent's wrapper records a failure's traceback in its error file
        # Done: torch's wrapper now waits for the agent to read the return value. When the agent instead stops
        # this group (another rank failed), its SIGTERM must end the wait, or the agent waits 30 s to SIGKILL.
        from ddp_amp.rank.signals import leave_once_stopped

        leave_once_stopped()
    except BaseException:
        # The agent reports the first rank it sees exit. A rank killed by a signal exits at once, and its peers
        # fail ("connection closed") milliseconds later: lingering here lets the agent see the cause first.
        time.sleep(FAILURE_LINGER_S)
        raise


def script_entry(script: dict, run_dir: str, env: dict[str, str]) -> None:
    """A rank running the user's script under the agent. A script that raised: its traceback goes to the
    agent's error file (as torchrun's @record would write it) and the rank exits 1, without the
    multiprocessing wrapper printing the traceback a second time into the rank's output."""
    import sys

    try:
        _run_script_entry(script, run_dir, env)
    except KeyboardInterrupt:
        # Ctrl-C reaches a rank twice (the terminal's group, then the launcher passing it on): the second one
        # lands while the first's traceback is being reported. torch's process wrapper takes a KeyboardInterrupt
        # for its parent's and exits 0 without the return value the agent waits for: the launch then hung until
        # --stop-timeout ran out. Exit as SIGINT's default action would.
        sys.exit(128 + signal.SIGINT)


def _run_script_entry(script: dict, run_dir: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    import sys

    from ddp_amp.config.script import Script
    from ddp_amp.rank.script import ScriptFailed, run_script

    try:
        code = run_script(Script.from_dict(script), Path(run_dir))
    except ScriptFailed as failed:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(failed)
        time.sleep(FAILURE_LINGER_S)  # as worker_entry: the agent sees the first failure first
        sys.exit(1)
    if code:
        sys.exit(code)
    from ddp_amp.rank.signals import leave_once_stopped

    leave_once_stopped()


def run_agent(job: ElasticJob, config_path: Path, extra_env: dict[str, str], log_path: Path, *,
              rank_pids=lambda: [], stop_timeout: float = 60.0, kind: JobKind = "train", script=None) -> None:
    """Run this node's share of the job (its ranks doing `kind`, or running the user's `script`, a
    launch.script.Script) to completion; a failure becomes RunFailed naming the rank that failed first. The
    agent's log goes to `log_path`."""
    start_forkserver()  # usually running already: the CLI starts it before importing torch
    import_torch_without_cpp_warnings()
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, launch_agent

    let_workers_leave_when_done()
    # The agent reads some of these itself (TORCH_DISABLE_SHARE_RDZV_TCP_STORE); the workers get them all.
    os.environ.update(job.env)
    config = LaunchConfig(
        min_nodes=job.nnodes.min, max_nodes=job.nnodes.max, nproc_per_node=job.nproc_per_node,
        run_id=job.rdzv_id, rdzv_backend="c10d", rdzv_endpoint=job.rdzv_endpoint or "127.0.0.1:0",
        rdzv_configs=dict(job.rdzv_configs), max_restarts=job.max_restarts,
        monitor_interval=job.monitor_interval, start_method="forkserver", local_addr=job.local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_path.parent / "elastic")))
    if job.node_rank is not None:
        config.rdzv_configs["rank"] = job.node_rank  # as torchrun passes --node-rank (c10d assigns its own)
    outcome: dict[str, BaseException] = {}
    # Waited on with an Event, not Thread.join: a signal handler raising inside join() leaves the Thread
    # marked finished while it still runs (CPython's _wait_for_tstate_lock), and every later join returns at once.
    # And polled (_finished_within), never Event.wait: see there.
    finished = threading.Event()

    env = {**job.env, **extra_env}
    entry, args = (worker_entry, [str(config_path), env, kind]) if script is None else \
        (script_entry, [script.to_dict(), str(config_path.parent), env])
    agents: list = []

    def agent() -> None:
        try:
            with agents_recorded(agents):
                launch_agent(config, entry, args)
        except BaseException as exc:  # reported by the launcher's thread
            outcome["error"] = exc
        finally:
            finished.set()

    with _agent_log(log_path), _error_files_of_our_own():
        threading.Thread(target=agent, name="ddp-amp-agent", daemon=True).start()
        watch = AgentWatch(agents, job)  # an agent that no longer sees its ranks end (agent_watch)
        try:
            while not _finished_within(finished, 0.2):  # timed: the main thread keeps handling signals
                if _finished_unseen(watch, job, log_path):
                    return
        except StopSignal as stop:
            # A stop is the end of the job: no restart of ranks it ended (a script's, killed by the signal).
            for running in agents:
                running._remaining_restarts = 0
            # Pass the signal on to the ranks (their pids come with their first event): they stop together at
            # one step and checkpoint; the agent sees them succeed. A rank still starting reports later: it gets
            # the signal as soon as it does (until then it holds stop signals blocked, so none is lost). Past
            # --stop-timeout, kill them: anything the agent starts after that dies with this process.
            _pass_on_until_finished(stop.signum, rank_pids, finished, stop_timeout)
            raise RunFailed(str(stop), exit_code=stop.exit_code) from None
    _raise_failure(outcome.get("error"), log_path, job, kind)


def _raise_failure(error: BaseException | None, log_path: Path, job: ElasticJob, kind: JobKind = "train") -> None:
    """The agent's failure as RunFailed: the rank that failed first and why, or the agent's own error."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if error is None:
        return
    if (line := _rendezvous_failure(error, job, "doctor" if kind == "doctor" else "multinode")) is not None:
        raise RunFailed(f"{line} (the agent's log: {log_path})")
    if isinstance(error, ChildFailedError):  # the rank and why: its traceback was shown, the log is named
        rank, what = root_failure(error.failures)
        note = f" (the agent's log: {log_path})"
        raise RunFailed(f"rank {rank} {what}{note}", rank=rank, note=note)
    raise RunFailed(f"the elastic agent failed: {type(error).__name__}: {_first_line(error)} "
                    f"(its log: {log_path})", details=_tail(log_path))


def _finished_unseen(watch: AgentWatch, job: ElasticJob, log_path: Path) -> bool:
    """Whether this node's ranks all exited 0 while the agent, past its bound, never saw them end (agent_watch):
    finished, as torchrun's agent would have it. Where a rank failed so unseen, RunFailed (_cut_off)."""
    if (overdue := watch.overdue()) is None:
        return False
    ended_s, failures = overdue
    if failures != {}:
        raise _cut_off(ended_s, failures, job, log_path)
    logging.getLogger(AGENT_LOGGERS[0]).warning("ddp-amp: every rank exited 0 %.0fs ago, unseen by the agent: "
                                                "finished", ended_s)
    return True


def _cut_off(ended_s: float, failures: dict | None, job: ElasticJob, log_path: Path) -> RunFailed:
    """The agent has held this node's ended ranks healthy past its bound (agent_watch: a store call blocked by a
    dead link, or results never handed): their failure as the agent would have told it (launch.session retells it
    by their error events), and why the agent never did. The agent's thread, a daemon (blocked in C++ with its
    GIL released, or polling), ends with this process, as the fork server does; the ranks have ended already."""
    waiting = (f"its call to the rendezvous store at {job.rdzv_endpoint} has not returned (the network between "
               "the nodes failed?)" if job.nnodes.max > 1 and job.rdzv_endpoint else "it waits for their results")
    note = (f"; this node's ranks ended {ended_s:.0f}s ago and the elastic agent has not seen it: {waiting} (the "
            f"agent's log: {log_path})")
    if not failures:  # None: their exit codes could not be read
        return RunFailed(note[2:])
    rank, what = root_failure(failures)
    return RunFailed(f"rank {rank} {what}{note}", rank=rank, note=note)


def _rendezvous_failure(error: BaseException, job: ElasticJob, command: str) -> str | None:
    """What a rendezvous failure means to the user, in one line (torch's RendezvousTimeoutError has no message
    at all), or None for another error. A multinode job only: a standalone one's store is this launcher's."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    if job.nnodes.max == 1 or job.rdzv_endpoint is None:
        return None
    where = f"the rendezvous at {job.rdzv_endpoint} (id {job.rdzv_id})"
    if isinstance(error, RendezvousTimeoutError):
        # A node running other training options derives another --rdzv-id: it waits in a rendezvous of its own.
        return (f"fewer than {job.nnodes.min} node(s) (--nnodes {job.nnodes}) joined {where} within "
                f"--rdzv-timeout {job.rdzv_configs.get('join_timeout', '?')}s: start ddp-amp {command} on the "
                "other nodes with the same command (the same options give the same --rdzv-id)")
    if isinstance(error, RendezvousConnectionError):
        return (f"lost the connection to {where}: the node hosting it ended, or the network between the "
                "nodes failed")
    return None


def _finished_within(finished: threading.Event, timeout: float) -> bool:
    """Event.wait(timeout) without taking the Event's lock. A stop signal's handler raises StopSignal in the main
    thread; raised inside Event.wait just after its Condition's lock was acquired (inside __enter__), it leaves
    that lock held for good: the agent thread's finished.set() and this thread's next wait then block forever (a
    launch under `run` SIGTERMed just after a rank's fork hung so, 1 in about 40 tries, py-spy showing both
    threads in Condition.__enter__). is_set() reads a flag; a sleep a handler interrupts holds nothing."""
    deadline = time.monotonic() + timeout
    while not finished.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(0.01, remaining))
    return True


def _pass_on_until_finished(signum: int, rank_pids, finished: threading.Event, stop_timeout: float) -> None:
    signalled: set[int] = set()
    deadline = time.monotonic() + stop_timeout
    while True:
        newly = [pid for pid in rank_pids() if pid not in signalled]
        signal_processes(newly, signum)
        signalled.update(newly)
        if _finished_within(finished, 0.1):
            return
        if time.monotonic() > deadline:
            signal_processes(rank_pids() or list(signalled), signal.SIGKILL)
            _finished_within(finished, 10)  # the agent notices and returns (no restart outlives this process)
            return


def root_failure(failures: dict) -> tuple[int, str]:
    """(global rank, what happened) of the failure that caused the others.

    A rank killed by a signal without raising (no error file: SIGKILL, the OOM killer) is the cause: the others
    raised "connection closed" because it vanished. Otherwise the earliest traceback. (The agent knows the rank
    whose process ended first: launch.session retells it by the ranks' own error events.)"""
    killed = [(rank, f) for rank, f in failures.items() if f.exitcode < 0 and not os.path.isfile(f.error_file)]
    if killed:
        rank, failure = min(killed)
        try:
            return rank, f"died with {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            return rank, f"died with signal {-failure.exitcode}"

    def message(failure) -> str:  # the error file's "Type: text" from @record, as a string or under "message"
        text = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
        return "" if "To enable traceback" in text else text.strip()

    # The earliest failure, but never a peer's symptom ("Connection closed by peer") before a real cause.
    rank, failure = min(failures.items(), key=lambda item: (is_peer_symptom(message(item[1])), item[1].timestamp,
                                                            item[0]))
    text = message(failure)
    if text:
        return rank, f"failed: {failure_line(exception_line(text))}"
    return rank, f"exited with code {failure.exitcode}"


@contextlib.contextmanager
def _error_files_of_our_own() -> Iterator[None]:
    """torch.multiprocessing, under the agent, gives every rank it starts an error file in the temporary directory
    (pytorch-errorfile-*.pickle, written when the rank raises) and never removes one: each failed rank left a file
    in /tmp. Here they go into a directory of this launch's own, removed when the agent is done."""
    import shutil
    import tempfile

    own = tempfile.mkdtemp(prefix="ddp-amp-agent-")
    saved, tempfile.tempdir = tempfile.tempdir, own
    try:
        yield
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(own, ignore_errors=True)


@contextlib.contextmanager
def _agent_log(path: Path) -> Iterator[None]:
    """The agent's log records (rendezvous, restarts, worker failures) go to a file, at INFO, as torchrun's
    would; nothing of it reaches the terminal the progress display owns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    parents = [logging.getLogger(name) for name in AGENT_LOGGERS]
    # torch gives each of its elastic loggers its own level (WARNING unless LOGLEVEL says otherwise).
    loggers = parents + [logger for name, logger in logging.root.manager.loggerDict.items()
                         if isinstance(logger, logging.Logger) and name.startswith(tuple(f"{parent.name}."
                                                                                          for parent in parents))]
    levels = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
    for parent in parents:
        parent.addHandler(handler)
        parent.propagate = False
    try:
        yield
    finally:
        for parent in parents:
            parent.removeHandler(handler)
            parent.propagate = True
        for logger, level in levels:
            logger.setLevel(level)
        handler.close()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
