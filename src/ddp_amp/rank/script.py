"""A rank that runs the user's own training script, as `python -u SCRIPT ARGS` under torchrun would.

The launcher has set torchrun's environment contract (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), so the
script's `init_process_group()` needs no arguments. Before the script starts, the rank
- ties itself to its launcher (a SIGKILLed launcher leaves nothing running),
- sends its stdout and stderr to the launcher, which keeps them in RUN_DIR/logs/rank<N>.log and shows them
  (ddp_amp.progress.output), unbuffered as `python -u`,
- reports its pid (the launcher passes stop signals on to it) and, at the end, its outcome,
- turns torch's flight recorder on and writes it out now and then and when the script fails, so that a hang in
  the script's own collectives can be located (`ddp-amp diagnose RUN_DIR`),
- gives the stop signals back their default actions (a script handles them, or dies of them, as under torchrun),
- keeps every process group the script destroys referenced until the rank exits (see _keep_destroyed_groups).
The script's sys.argv, __main__, working directory and sys.path[0] are what `python SCRIPT` gives it.
"""

from __future__ import annotations

import functools
import io
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from ddp_amp.config.script import Script
from ddp_amp.errors import failure_kind
from ddp_amp.process import FORKSERVER_PID_VAR, STOP_SIGNALS, children_started_as_the_platform_does, die_with_parent
from ddp_amp.progress.channel import EventSender
from ddp_amp.progress.output import OUTPUT_VAR, connect_stream
from ddp_amp.rank import flight_recorder

RUN_DIR_VAR = "DDP_AMP_RUN_DIR"
"""The run directory, for a script that wants to write its files there (the loop module does)."""
HEARTBEAT_S = 1.0
"""How often a script's rank tells the launcher where its collectives are (the launcher's stall marking)."""
STALL_MIN_S = 10.0
STALL_PAUSES = 5.0
"""A script's rank is marked stalled when no rank's collectives moved for STALL_PAUSES times the longest pause
seen between them, and at least STALL_MIN_S, while it is behind the others (they wait in a collective it has not
entered): a script whose collectives come minutes apart is not marked for pausing between them."""
RECORD_EVERY_S = 2.0
"""How often the flight recorder is written while the script runs (only when it has changed): a rank stuck in
user code or killed by the launcher still leaves what it last entered."""


class ScriptFailed(Exception):
    """The script raised: its traceback, as the rank's error."""


_AT_RETURN: list[Callable[[int], None]] = []


def at_script_return(check: Callable[[int], None]) -> None:
    """`check(exit_code)` runs once the script has returned (or called sys.exit), before the rank reports its
    outcome; what it raises is the script's failure. ddp_amp.loop's check that finish() was called: a rank's
    process ends with os._exit, so atexit's handlers never run there."""
    _AT_RETURN.append(check)


def forget_at_script_return(check: Callable[[int], None]) -> None:
    if check in _AT_RETURN:
        _AT_RETURN.remove(check)


def _checks_at_return(code: int) -> None:
    """Every check registered, each once; the first error raised after all have run."""
    errors = []
    while _AT_RETURN:
        try:
            _AT_RETURN.pop(0)(code)
        except BaseException as exc:  # raised below, once the others have run
            errors.append(exc)
    if errors:
        raise errors[0]


def run_script(script: Script, run_dir: Path) -> int:
    """Run `script` on this rank; its exit status (0, or what it passed to sys.exit). An exception the script
    raised is reported (an error event, the rank's log) and raised again as ScriptFailed."""
    forkserver = os.environ.get(FORKSERVER_PID_VAR)
    die_with_parent(parent=int(forkserver) if forkserver else None)
    children_started_as_the_platform_does()
    rank = int(os.environ.get("RANK", "0"))
    os.environ[RUN_DIR_VAR] = str(run_dir)
    _capture_output(rank)
    sender = EventSender.from_environ()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    send = (lambda event: sender.send({"rank": rank, **event})) if sender is not None else (lambda event: None)
    send({"type": "state", "status": "restarting" if restart else "starting", "restart": restart, "pid": os.getpid(),
          "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "node": int(os.environ.get("GROUP_RANK", "0")),
          "world_size": int(os.environ.get("WORLD_SIZE", "1"))})
    flight_recorder.enable()
    flight_recorder.forget(run_dir, rank)
    recorder = _Recorder(run_dir, rank, send)
    _threads_as_a_fresh_interpreter()
    _default_signal_actions()
    _keep_destroyed_groups()
    send({"type": "state", "status": "running"})
    try:
        code = _run(script)
        _checks_at_return(code)
    except BaseException as exc:
        text = script_traceback(exc)
        recorder.write(f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                       where=_raised_at(exc))
        send({"type": "error", "traceback": text, "kind": failure_kind(exc), "time": time.time()})
        raise ScriptFailed(text) from None
    finally:
        recorder.stop()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    send({"type": "state", "status": "done" if code == 0 else "failed", "exit_code": code})
    if sender is not None:
        sender.close()
    return code


def _run(script: Script) -> int:
    """The script as __main__; its sys.exit status (0 when it returns)."""
    os.chdir(script.cwd)
    try:
        if script.module:
            sys.argv = [script.target, *script.args]  # run_module puts the module's file first, as python -m
            sys.path[0] = os.getcwd()
            runpy.run_module(script.target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script.target, *script.args]  # as typed: runpy.run_path would make it absolute
            sys.path[0] = os.path.dirname(script.path)
            _run_as_main(script.path)
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)  # as the interpreter does with sys.exit("message")
        return 1
    return 0


def _run_as_main(path: str) -> None:
    """The file as `python PATH` runs it: a fresh __main__ module (its __file__ absolute, no __spec__), the code
    compiled under its path, so that tracebacks, pickling of its classes and multiprocessing's spawn (which
    re-runs __main__ by its __file__) see what they would under python."""
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__spec__ = None
    main.__cached__ = None
    sys.modules["__main__"] = main
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def script_traceback(exc: BaseException) -> str:
    """The traceback as `python SCRIPT` prints it: from the script's first frame, without this module's and
    runpy's frames above it."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _capture_output(rank: int) -> None:
    """fd 1 and 2 become connections to the launcher's output server, and sys.stdout/sys.stderr unbuffered
    text streams on them, as `python -u` (torchrun starts scripts so): every line reaches the log and the
    terminal when it is written. Without a launcher reading (a hand-made start), the output stays where it is."""
    if not os.environ.get(OUTPUT_VAR):
        return
    for fd, name in ((1, "stdout"), (2, "stderr")):
        connection = connect_stream(rank, name)
        if connection is None:
            return
        os.dup2(connection.fileno(), fd)
        connection.close()
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                                   write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace", write_through=True)


def _threads_as_a_fresh_interpreter() -> None:
    """The fork server imported torch before this rank's OMP_NUM_THREADS was set: apply it, as a fresh
    interpreter would have read it at start."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _default_signal_actions() -> None:
    """The stop signals as a fresh interpreter has them (SIGINT raises KeyboardInterrupt, the others end the
    process unless the script handles them), then unblocked: a rank forked from the fork server held them
    blocked since its first instant, and one that came meanwhile is delivered now."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _keep_destroyed_groups() -> None:
    """Make `destroy_process_group` keep a reference to the groups it destroys.

    A script that calls `dist.destroy_process_group()` while its DDP model is still alive (the example this project
    grew from does) frees the gloo group's last reference when the model goes, later, in the middle of its own
    code: the group's destructor joins gloo's worker threads while holding the GIL, and a worker that needs the GIL
    to free a tensor never finishes. The rank hangs after its last line, or aborts ("terminate called without an
    active exception"), under plain torchrun too (docs/scripts.md). A rank here ends with os._exit (multiprocessing
    does that for a forked worker), so a group kept referenced is never destructed: the script's ranks end
    whenever its model is freed. The group is destroyed for the script as before (shut down, unregistered, a
    new one can be made). They are kept in ddp_amp.dist.KEPT_GROUPS, with a failed rank's and a loop's."""
    import torch.distributed
    from torch.distributed import distributed_c10d

    from ddp_amp.dist import KEPT_GROUPS

    destroy = distributed_c10d.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        if group is None or group is distributed_c10d.GroupMember.WORLD:
            KEPT_GROUPS.extend(distributed_c10d._world.pg_map)  # every group goes with the default one
        else:
            KEPT_GROUPS.append(group)
        destroy(group)

    distributed_c10d.destroy_process_group = torch.distributed.destroy_process_group = destroy_process_group


LIBRARY_PATHS = ("site-packages", "/lib/python", "<frozen", "<string>", "/ddp_amp/")


def _innermost_own(frames) -> str | None:
    """"file:line in function" of the last of `frames` (outermost first) that is the user's code: not the
    standard library's, an installed package's or ddp-amp's."""
    found = None
    for frame in frames:
        if not any(part in frame.f_code.co_filename for part in LIBRARY_PATHS):
            found = frame
    if found is None:
        return None
    return f"{os.path.basename(found.f_code.co_filename)}:{found.f_lineno} in {found.f_code.co_name}"


def _raised_at(exc: BaseException) -> str | None:
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return _innermost_own(frames)


class _Recorder:
    """From a daemon thread (a rank blocked in a collective or in the script's own code cannot): this rank's
    heartbeat every HEARTBEAT_S, where its collectives are (the launcher marks a rank that holds the others
    back as stalled, as it does for ddp-amp's loop), and its flight record every RECORD_EVERY_S while it changes
    or while the rank waits in a collective (so that the record says how long it waited); once more when the
    script fails."""

    def __init__(self, run_dir: Path, rank: int, send=lambda event: None) -> None:
        self.run_dir, self.rank, self.send = run_dir, rank, send
        self._stopped = threading.Event()
        self._last: tuple | None = None
        self._lock = threading.Lock()
        self._main = threading.main_thread().ident
        self._moved: tuple | None = None
        self._moved_at = time.monotonic()
        self._longest_still = 0.0
        threading.Thread(target=self._loop, name="ddp-amp-flight-recorder", daemon=True).start()

    def _loop(self) -> None:
        ticks = 0
        while not self._stopped.wait(HEARTBEAT_S):
            ticks += 1
            waiting = self._beat()
            if ticks % round(RECORD_EVERY_S / HEARTBEAT_S) == 0:
                self.write("the last record written while the script ran", only_if_changed=not waiting)

    def _beat(self) -> bool:
        """One heartbeat: (the last collective's number, whether it completed) is where this rank is; the stall
        threshold grows with the longest pause between collectives seen so far. Whether it waits in one."""
        entries = flight_recorder.entries()
        if not entries:
            return False
        last = entries[-1]
        # gloo's entries stay "scheduled"; "retired" says the work finished (nccl's say "completed" too)
        sequence = int(last.get("collective_seq_id") or 0)
        completed = last.get("state") == "completed" or bool(last.get("retired"))
        now = time.monotonic()
        if (sequence, completed) != self._moved:
            self._longest_still = max(self._longest_still, now - self._moved_at)
            self._moved, self._moved_at = (sequence, completed), now
        operation = str(last.get("profiling_name") or "?").split(":")[-1]  # "gloo:all_reduce"
        where = (f"collective #{sequence} ({operation})" if not completed
                 else f"{self._where() or 'its code'}, after collective #{sequence}")
        self.send({"type": "heartbeat", "step": sequence, "micro": int(completed), "phase_index": 0,
                   "phase": where, "stall_after_s": max(STALL_MIN_S, STALL_PAUSES * self._longest_still),
                   "script": True})
        return not completed

    def write(self, reason: str, only_if_changed: bool = False, where: str | None = None) -> None:
        with self._lock:
            entries = flight_recorder.entries()
            if not entries:
                return  # no collective yet (or the recorder is off)
            last = entries[-1]
            marker = (len(entries), last.get("collective_seq_id"), last.get("state"), last.get("retired"))
            if only_if_changed and marker == self._last:
                return
            self._last = marker
            try:
                flight_recorder.dump(self.run_dir, self.rank, reason, None, recorded=entries,
                                     where=where or self._where())
            except OSError:  # a full disk: the record is a help, never the rank's failure (nor a second one)
                pass

    def _where(self) -> str | None:
        """The script's own line the main thread is at (or under)."""
        frame = sys._current_frames().get(self._main)
        frames = []
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        return _innermost_own(reversed(frames))

    def stop(self) -> None:
        self._stopped.set()

