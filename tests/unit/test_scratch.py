"""launch.scratch: a launcher's temporary directory goes however the launcher ends. Each test runs a bare child
interpreter as the launcher (no torch): it makes its directory, a file in it, and a directory outside it given to
the janitor, then ends by itself or by SIGKILL."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from helpers import MARK_VAR, run_processes

LAUNCHER = """\
import os, signal, sys, tempfile, time
from ddp_amp.launch.scratch import own_temporary_directory, remove_when_gone
own = own_temporary_directory()
assert own_temporary_directory() == own == tempfile.gettempdir()  # one per process
with tempfile.NamedTemporaryFile(delete=False) as file:  # a rank's error file, say
    file.write(b"x")
outside = sys.argv[2]
os.mkdir(outside)
remove_when_gone(outside)
print(own, file.name, flush=True)
if sys.argv[1] == "killed, its forked child alive":
    if os.fork() == 0:  # a child of the launcher's own that outlives it
        devnull = os.open(os.devnull, os.O_WRONLY)  # the test reads the launcher's output to its end
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        time.sleep(60)
        os._exit(0)
if sys.argv[1].startswith("killed"):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def launcher(how: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, str, list[Path]]:
    mark = uuid.uuid4().hex
    outside = tmp_path / "outside"
    env = {"TMPDIR": str(tmp_path / "tmp"), MARK_VAR: mark, "PATH": "/usr/bin:/bin"}
    (tmp_path / "tmp").mkdir()
    result = subprocess.run([sys.executable, "-c", LAUNCHER, how, str(outside)], capture_output=True, text=True,
                            env=env, timeout=60)
    own, file = result.stdout.split()
    return result, mark, [Path(own), Path(file), outside]


def test_a_launcher_that_ends_by_itself_leaves_no_directory_and_no_janitor(tmp_path):
    result, mark, paths = launcher("ends", tmp_path)
    assert result.returncode == 0, result.stderr
    assert paths[0].parent == tmp_path / "tmp" and paths[0].name.startswith("ddp-amp-launch-")
    assert paths[1].parent == paths[0]
    # Removed before the launcher exited, and its janitor waited for: nothing to poll for.
    assert not paths[0].exists()
    assert run_processes(mark) == []
    # The directory outside is the janitor's to remove (the launcher removes only its own), once it has read EOF.
    assert not paths[2].exists()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_sigkilled_launcher_leaves_nothing_once_its_janitor_has_run(tmp_path):
    result, mark, paths = launcher("killed", tmp_path)
    assert result.returncode == -signal.SIGKILL, result.stderr
    deadline = time.monotonic() + 30
    while (run_processes(mark) or any(path.exists() for path in paths)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [path for path in paths if path.exists()] == []
    assert run_processes(mark) == []
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_child_forked_from_the_launcher_does_not_keep_the_janitor_waiting(tmp_path):
    """The child holds no copy of the janitor's pipe (closed at the fork): the directory goes when the launcher
    does, while the child still lives."""
    result, mark, paths = launcher("killed, its forked child alive", tmp_path)
    try:
        # The janitor removes the paths, then exits: wait for both (without the fork hook it never does either).
        deadline = time.monotonic() + 30
        while (any(path.exists() for path in paths) or len(run_processes(mark)) > 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [path for path in paths if path.exists()] == []
        assert len(run_processes(mark)) == 1  # the child, asleep
    finally:
        for pid in run_processes(mark):
            os.kill(pid, signal.SIGKILL)
