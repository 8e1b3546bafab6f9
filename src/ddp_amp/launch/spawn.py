"""`ddp-amp spawn`: N ranks on this machine forked from the fork server, environment set as torchrun would.

The launcher binds the rendezvous store's port itself, on loopback (bound, not guessed, so two jobs on one
machine never collide; reachable from this machine only), has it served for as long as the launch lasts, and
tells the workers to join it as clients, exactly as a torchrun agent does. A stop signal asks the ranks to stop
together (see cli._launch). No torch here (launch.processes says why).
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import time
from pathlib import Path

from ddp_amp.config import JobKind, TrainConfig
from ddp_amp.errors import RunFailed, exception_line, failure_line, is_peer_symptom
from ddp_amp.launch.forkserver import start_forkserver
from ddp_amp.launch.processes import RankExited, RankFailed, RankProcesses, RankRaised, StoreKeeper
from ddp_amp.process import LOOPBACK, DeferredStops, StopSignal, signal_processes

FAILURE_GRACE_S = 3.0
"""After a rank fails, how long the others get to exit, and then to obey SIGTERM, before SIGKILL (torch's join
waits 30 s each). The run has failed: a rank still alive is waiting in a collective for the failed one, where
no signal handler of ours can run."""


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        # The store is this launcher's: ranks connect as clients (torch's env:// honours this, as under torchrun).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def script_environment(world_size: int, run_id: str) -> dict[str, str]:
    """What torchrun's agent sets beside rank_environment, for a user's script that may read it: the role (one,
    "default"), the restart count, the run id; OMP_NUM_THREADS=1 for several ranks unless the user set it."""
    env = {"ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1",
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id}
    if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    return env


def _rank_main(rank: int, config: TrainConfig, world_size: int, port: int, extra_env: dict[str, str],
               kind: JobKind) -> None:
    os.environ.update({**extra_env, **rank_environment(rank, world_size, port)})
    from ddp_amp.worker import run_worker

    run_worker(config, kind)


def _script_rank_main(rank: int, script: dict, run_dir: str, world_size: int, port: int,
                      extra_env: dict[str, str]) -> None:
    """A rank running the user's script; its exit status is the script's (an exception: raised, for join)."""
    os.environ.update({**extra_env, **script_environment(world_size, f"ddp-amp-{port}"),
                       **rank_environment(rank, world_size, port), "ROLE_RANK": str(rank)})
    from ddp_amp.config.script import Script
    from ddp_amp.rank.script import run_script

    code = run_script(Script.from_dict(script), Path(run_dir))
    if code:
        sys.exit(code)


def spawn(config: TrainConfig, nproc: int, extra_env: dict[str, str] | None = None, kind: JobKind = "train",
          script=None) -> None:
    """Run `nproc` ranks of job `kind` (or of the user's `script`, a launch.script.Script) to completion
    (`extra_env` added to each rank's environment). Raises RunFailed naming the first rank that failed."""
    store = StoreKeeper(world_size=nproc, timeout_s=config.timeout)
    start_forkserver()  # usually already running: the CLI starts it first
    # A stop that arrives while the ranks are forked waits until every rank exists (each holds it blocked until
    # its handler is set, see process.stop_signals_blocked); it is raised inside the loop below, where it is
    # passed on to all of them.
    deferred = DeferredStops()
    deferred.hold()
    try:
        context = _start_with_store(store, config, nproc, extra_env or {}, kind, script)
    except BaseException:
        deferred.release()
        raise
    stop: StopSignal | None = None
    try:
        # join() returns True once all ranks exited cleanly; on the first failure it terminates the others
        # and raises with the failing rank and its traceback.
        deadline, released = None, False
        while True:
            try:
                if not released:  # inside the try: a stop that came during the forks is raised here
                    released = True
                    deferred.release()
                # A script's ranks under a stop end as their own handlers do: one that exits first must not
                # cut short another's checkpoint; they get what is left of --stop-timeout, not the failure grace.
                grace = (FAILURE_GRACE_S if stop is None or script is None
                         else max(deadline - time.monotonic(), FAILURE_GRACE_S))
                if context.join(timeout=None if stop is None else 0.5, grace_period=grace):
                    break
            except RankFailed:
                if stop is None or script is None:
                    raise
                # A script's rank that the stop ended (by the signal's default action, or its own handler's
                # exit): the stop, not a failure. join() has ended the others as well.
                context.kill()  # none outlives the launcher
                break
            except StopSignal as first:
                # Ask every rank to stop at one step they agree on (and checkpoint); wait --stop-timeout. The
                # signal itself is passed on (the ranks take every stop signal), so the run records its name.
                stop, deadline = first, time.monotonic() + config.stop_timeout
                signal_processes([p.pid for p in context.processes if p.is_alive()], first.signum)
                continue
            if stop is not None and time.monotonic() > deadline:
                # SIGKILL: a rank takes SIGTERM as a request to stop, which it has had. None outlives the launcher.
                context.kill()
                break
        if stop is not None:
            raise RunFailed(str(stop), exit_code=stop.exit_code)
    except RankFailed as exc:
        raise _failure(context, exc, Path(config.run_dir)) from None
    except KeyboardInterrupt:
        context.kill()  # none outlives the launcher
        raise RunFailed("interrupted", exit_code=130) from None
    finally:
        store.close()
        context.remove_error_files()


def _failure(context: RankProcesses, exc: RankFailed, run_dir: Path) -> RunFailed:
    """A rank's failure, as join() reported it, named: the rank that failed first and its exception, or the
    rank that exited (its code, its signal, what C++ printed as it aborted)."""
    if isinstance(exc, RankRaised):
        rank, traceback_text = _first_failure(context, exc)
        line = exception_line(traceback_text) if traceback_text else "unknown error"
        return RunFailed(f"rank {rank} failed: {failure_line(line)}", details=traceback_text, rank=rank)
    why = _abort_message(run_dir, exc.error_index) if exc.signal_name == "SIGABRT" else None
    return RunFailed(f"rank {exc.error_index} exited with {_describe_exit(exc)}" + (f": {why}" if why else ""),
                     rank=exc.error_index)


def _start_with_store(store: StoreKeeper, config: TrainConfig, nproc: int, extra_env: dict[str, str],
                      kind: JobKind, script) -> RankProcesses:
    """The ranks, then the store they meet at; when either fails, neither is left running."""
    context = None
    try:
        context = _start_ranks(config, nproc, store.port, extra_env, kind, script)
        store.start()
        return context
    except BaseException:
        if context is not None:
            context.kill()
        store.close()
        raise


def _start_ranks(config: TrainConfig, nproc: int, port: int, extra_env: dict[str, str], kind: JobKind,
                 script) -> RankProcesses:
    if script is None:
        entry, args = _rank_main, (config, nproc, port, extra_env, kind)
    else:
        entry, args = _script_rank_main, (script.to_dict(), config.run_dir, nproc, port, extra_env)
    return RankProcesses(entry, args, nproc)


def _first_failure(context: RankProcesses, exc: RankRaised) -> tuple[int, str]:
    """The rank that failed first, and its traceback.

    join() reports whichever failed rank it looks at first, often a rank that only saw its peer vanish
    ("Connection closed by peer"). Each failing rank's wrapper writes its traceback to an error file as it
    fails, so the oldest file names the root cause; but a rank whose error is only a peer's symptom never
    counts first while another rank failed with something else (its peer may close its connections before it
    raises: a rank that tears down its process group, or one slow to write its file)."""
    written = []
    for rank, path in enumerate(context.error_files):
        try:
            mtime = os.stat(path).st_mtime_ns
            with open(path, "rb") as f:
                text = pickle.load(f).strip()
        except (OSError, EOFError, pickle.UnpicklingError):
            continue  # this rank did not raise (it succeeded, or was terminated)
        written.append((is_peer_symptom(exception_line(text)), mtime, rank, text))
    if written:
        _, _, rank, text = min(written)
        return rank, text
    return exc.error_index, str(exc).split("terminated with the following error:", 1)[-1].strip()


def _abort_message(run_dir: Path, rank: int) -> str | None:
    """What C++ printed as it aborted the rank (`terminate called ...`, then `  what():  ...`), from the end of
    the rank's log: gloo aborts a rank that receives a collective of another size ("Is there a distributed
    collective mismatch in your code?"), before any Python handler could say so."""
    try:
        with open(run_dir / "logs" / f"rank{rank}.log", "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 8192))
            tail = log.read().decode(errors="replace")
    except OSError:
        return None
    found = [line.split("what():", 1)[1].strip() for line in tail.splitlines() if "what():" in line]
    return re.sub(r"^\[enforce fail at [^\]]*\]\s*", "", found[-1]) if found else None


def _describe_exit(exc: RankExited) -> str:
    if exc.signal_name:
        return f"signal {exc.signal_name}"
    match = re.search(r"exit code (-?\d+)", str(exc))
    return f"exit code {match.group(1) if match else exc.exit_code}"
