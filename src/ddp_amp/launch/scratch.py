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
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

PREFIX = "ddp-amp-launch-"

JANITOR = """\
import shutil, signal, sys
for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(stop, signal.SIG_IGN)
paths = sys.stdin.buffer.read().split(b"\\0")
for path in filter(None, paths):
    shutil.rmtree(path, ignore_errors=True)
"""
"""The janitor's code: every NUL-terminated path it was given, removed once its stdin ends (the launcher gone)."""

_janitor: subprocess.Popen | None = None


def own_temporary_directory() -> str:
    """This launcher's temporary directory, made (with its janitor) on the first call; tempfile's default from
    then on, in this process only."""
    global _janitor
    if _janitor is not None:
        return tempfile.gettempdir()
    directory = tempfile.mkdtemp(prefix=PREFIX)
    _janitor = subprocess.Popen([sys.executable, "-I", "-S", "-c", JANITOR], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    remove_when_gone(directory)
    tempfile.tempdir = directory
    from multiprocessing import util

    # After multiprocessing's own clean-up at exit (its pymp-* directory's, -100), which expects it in place.
    util.Finalize(None, _finish, args=(directory,), exitpriority=-200)
    return directory


def remove_when_gone(path: str) -> None:
    """`path` removed by the janitor too, once this launcher has ended (a directory made outside this launcher's
    own: launch.forkserver's socket directory where TMPDIR is too long for a socket's path)."""
    if _janitor is not None:
        _janitor.stdin.write(os.fsencode(path) + b"\0")
        _janitor.stdin.flush()


def _finish(directory: str) -> None:
    """At a launcher's normal exit: the directory removed, the janitor told (its pipe closed) and waited for, so
    that nothing of the launch outlives the command."""
    shutil.rmtree(directory, ignore_errors=True)
    if _janitor is not None:
        _janitor.stdin.close()
        try:
            _janitor.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _janitor.kill()
