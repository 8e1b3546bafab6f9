"""The launcher's temporary files in one directory of its own, removed however the launcher ends.

A launcher puts a few things in TMPDIR: multiprocessing's pymp-* directory with the fork server's socket, the
named error file of each rank it forks, torchrun's agent's directory (launch.agent). A launcher that ends by
itself removes them; one killed by SIGKILL (the OOM killer, `kill -9`, a scheduler's last word) ran no clean-up,
and its fork server, tied to it by the same signal, can run none either: every such kill left them in TMPDIR.

Here the launcher makes them all in one directory of its own, `ddp-amp-launch-*` under TMPDIR (tempfile's
directory, for this process only: the ranks' and the user's TMPDIR is theirs, unchanged), and starts a janitor:
a bare interpreter (no site, no torch) in a session of its own that ignores the stop signals and waits for the
end of a pipe that only the launcher holds. The pipe ends when the launcher does, by whatever signal; the janitor
then removes the directory and exits. A launcher that ends by itself removes it first and waits for the janitor.
What kills every process of a job at once (a Slurm step's cgroup, systemd's control group, a container's end)
kills the janitor too: there the directory stays, as before.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

PREFIX = "ddp-amp-launch-"

JANITOR = """\
import os, shutil, signal, sys, time
for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(stop, signal.SIG_IGN)
paths = [path for path in sys.stdin.buffer.read().split(b"\\0") if path]
for pause in (0, 0.1, 0.5, 1, 2, 5):
    time.sleep(pause)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    if not any(os.path.lexists(path) for path in paths):
        break
"""
"""The janitor's code: every NUL-terminated path it was given, removed once its stdin ends (the launcher gone);
again, a few times over some seconds, while one is still there: the ranks, dying too, may still write into it (a
failed rank's error file), and a file made while rmtree walks leaves its directory standing."""

_janitor: subprocess.Popen | None = None
_directory: str | None = None


def own_temporary_directory() -> str:
    """This launcher's temporary directory, made (with its janitor) on the first call; tempfile's default from
    then on, in this process only. Without a janitor (none could start) the launch goes on: only a SIGKILLed
    launcher's files stay behind, as they would without this module."""
    global _janitor, _directory
    if _directory is not None:
        return _directory
    _directory = tempfile.mkdtemp(prefix=PREFIX)
    try:
        # Its first line says what it is where ps and top show its command line.
        code = f"# ddp-amp: removes the temporary directory of launcher {os.getpid()} once it has ended\n{JANITOR}"
        _janitor = subprocess.Popen([sys.executable, "-I", "-S", "-c", code], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                    cwd="/")  # keeps no directory of the user's busy (for an unmount)
    except OSError:
        _janitor = None
    os.register_at_fork(after_in_child=_not_in_a_child)
    remove_when_gone(_directory)
    tempfile.tempdir = _directory
    from multiprocessing import util

    # After multiprocessing's own clean-up at exit (its pymp-* directory's, -100), which expects it in place.
    util.Finalize(None, _finish, args=(_directory,), exitpriority=-200)
    return _directory


def remove_when_gone(path: str) -> None:
    """`path` removed by the janitor too, once this launcher has ended (a directory made outside this launcher's
    own: launch.forkserver's socket directory where TMPDIR is too long for a socket's path)."""
    global _janitor
    if _janitor is not None:
        try:
            _janitor.stdin.write(os.fsencode(path) + b"\0")
            _janitor.stdin.flush()
        except OSError:  # the janitor is gone (killed): the launch goes on without one
            _janitor = None


def _not_in_a_child() -> None:
    """A process forked from the launcher closes its copy of the janitor's pipe: the janitor waits for the
    launcher alone, and a child that outlives it does not keep it (nor a launcher's normal exit) waiting."""
    global _janitor
    if _janitor is not None:
        _janitor.stdin.close()
        _janitor = None


def _finish(directory: str) -> None:
    """At a launcher's normal exit: the directory removed, the janitor told (its pipe closed) and waited for, so
    that nothing of the launch outlives the command."""
    shutil.rmtree(directory, ignore_errors=True)
    if _janitor is not None:
        with contextlib.suppress(OSError):
            _janitor.stdin.close()
        try:
            _janitor.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _janitor.kill()
