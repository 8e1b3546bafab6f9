"""The ranks of `ddp-amp spawn` as processes forked from the fork server, and the rendezvous store they join,
started by a launcher that never imports torch.

torch.multiprocessing.start_processes would start the ranks, and a TCPStore in the launcher would serve the
store, but both import torch in the launcher: 1.4 s of CPU per launch (a third of a short launch's), spent
again by the fork server, which imports torch for the ranks anyway. RankProcesses keeps the semantics of
torch's ProcessContext (each rank's traceback in an error file; join() ends the others after the first failure:
a grace period, SIGTERM, another, SIGKILL); the store is served by a child of the fork server, which has torch
imported already, for as long as the launch lasts. Stdlib only here.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from ddp_amp.errors import RunFailed
from ddp_amp.process import LOOPBACK, die_with_parent

STORE_PROCESS_NAME = "ddp-amp-store"
STORE_START_TIMEOUT_S = 60.0
"""How long the store's process may take to serve (a fork and a TCPStore: milliseconds on an idle machine)."""
"""The store keeper's name in /proc/PID/comm (`ps -o comm`): a child of the fork server that is not a rank."""


class RankFailed(Exception):
    """A rank ended unsuccessfully: `error_index` is its rank, `error_pid` its pid."""

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg)
        self.error_index = error_index
        self.error_pid = error_pid


class RankRaised(RankFailed):
    """The rank raised an exception; the message ends with its traceback."""


class RankExited(RankFailed):
    """The rank exited with a non-zero code or was killed by a signal (`signal_name`), raising nothing."""

    def __init__(self, msg: str, error_index: int, error_pid: int, exit_code: int,
                 signal_name: str | None = None) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name


def _run_rank(function: Callable[..., Any], rank: int, args: tuple, error_file: str) -> None:
    """A rank's entry point: `function(rank, *args)`; an exception's traceback goes to `error_file`, exit 1."""
    die_with_parent(signal.SIGINT)  # as torch's: the fork server gone, the rank is interrupted
    try:
        function(rank, *args)
    except KeyboardInterrupt:
        pass  # the launcher interrupted it
    except Exception:
        with open(error_file, "wb") as file:
            pickle.dump(traceback.format_exc(), file)
        sys.exit(1)


class RankProcesses:
    """`nprocs` ranks running `function(rank, *args)`, forked from the fork server."""

    def __init__(self, function: Callable[..., Any], args: tuple, nprocs: int) -> None:
        context = multiprocessing.get_context("forkserver")
        self.processes, self.error_files = [], []
        try:
            for rank in range(nprocs):
                # Named, not created: the file exists only once the rank has failed with an exception.
                with tempfile.NamedTemporaryFile(prefix="ddp-amp-rank-error-", suffix=".pickle") as file:
                    error_file = file.name
                process = context.Process(target=_run_rank, args=(function, rank, args, error_file), daemon=False)
                process.start()
                self.processes.append(process)
                self.error_files.append(error_file)
        except BaseException:  # the ranks started so far would wait for the others until the timeout
            self.kill()
            raise
        self._waiting = {process.sentinel: rank for rank, process in enumerate(self.processes)}

    def join(self, timeout: float | None = None, grace_period: float = 30.0) -> bool:
        """True once every rank has exited with 0; False after `timeout` with some still running. When one fails:
        `grace_period` for the others to end, then SIGTERM, another `grace_period`, then SIGKILL; raises
        RankRaised or RankExited for the failed one."""
        if not self._waiting:
            return True
        failed = None
        for sentinel in multiprocessing.connection.wait(list(self._waiting), timeout=timeout):
            rank = self._waiting.pop(sentinel)
            self.processes[rank].join()
            if self.processes[rank].exitcode != 0:
                failed = rank
                break
        if failed is None:
            return not self._waiting
        self._end_others(grace_period)
        raise self._failure(failed)

    def _end_others(self, grace_period: float) -> None:
        self._join_all(grace_period)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        self._join_all(grace_period)
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()

    def _join_all(self, timeout: float) -> None:
        """Until every rank has exited or `timeout` has passed."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))

    def _failure(self, rank: int) -> RankFailed:
        process = self.processes[rank]
        try:
            with open(self.error_files[rank], "rb") as file:
                trace = pickle.load(file)
        except (OSError, EOFError, pickle.UnpicklingError):  # no traceback, or one cut short by a kill
            code = process.exitcode
            if code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"<Unknown signal {-code}>"
                return RankExited(f"process {rank} terminated with signal {name}", rank, process.pid, code, name)
            return RankExited(f"process {rank} terminated with exit code {code}", rank, process.pid, code)
        return RankRaised(f"\n\n-- Process {rank} terminated with the following error:\n{trace}", rank, process.pid)

    def kill(self) -> None:
        """SIGKILL every live rank and wait for it."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join()

    def remove_error_files(self) -> None:
        for path in self.error_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class StoreKeeper:
    """The rendezvous store (ddp_amp.dist.loopback_store) served on a port bound here, by a child of the fork
    server, until close(). The port is listening from the start: ranks that connect before the child serves it
    wait in the kernel's backlog."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((LOOPBACK, 0))
            self._listener.listen(128)
        except BaseException:
            self._listener.close()
            raise
        self.port = self._listener.getsockname()[1]
        self._world_size, self._timeout_s = world_size, timeout_s
        self._process = self._connection = None

    def start(self) -> None:
        """Start serving (after the ranks: their start-up is the launch's critical path, the store's is not);
        returns once it serves. Raises RunFailed when the child could not."""
        context = multiprocessing.get_context("forkserver")
        self._connection, theirs = context.Pipe()
        self._process = context.Process(target=_serve_store, name=STORE_PROCESS_NAME, daemon=True,
                                        args=(self._listener, self._world_size, self._timeout_s, theirs))
        self._process.start()
        theirs.close()
        self._listener.close()  # the child has its own copy
        try:
            if self._connection.poll(STORE_START_TIMEOUT_S):
                self._connection.recv()
                return
        except (EOFError, OSError):
            pass
        raise RunFailed("the rendezvous store could not be served (its process, a child of the fork server, "
                        f"ended with exit code {self._process.exitcode}; its error is above)")

    def close(self) -> None:
        """Stop serving: the child exits when its end of the pipe closes."""
        self._listener.close()
        if self._process is None:
            return
        self._connection.close()
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _serve_store(listener: socket.socket, world_size: int, timeout_s: float, connection) -> None:
    die_with_parent(signal.SIGKILL)  # the fork server, which dies with the launcher
    _name_this_process(STORE_PROCESS_NAME)
    from ddp_amp.dist import loopback_store

    store = loopback_store(world_size=world_size, timeout_s=timeout_s, listener=listener)
    connection.send("serving")
    try:
        connection.recv()  # until the launcher closes its end (or dies)
    except (EOFError, OSError):
        pass
    del store


def _name_this_process(name: str) -> None:
    try:
        import ctypes

        pr_set_name = 15
        ctypes.CDLL("libc.so.6").prctl(pr_set_name, name.encode()[:15])
    except (OSError, AttributeError):
        pass  # not Linux
