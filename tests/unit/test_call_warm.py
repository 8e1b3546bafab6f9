"""launch.forkserver.call_warm: the launcher's checks in a child of the fork server. Its answer, its exception
(type and message), this process's environment and directory as they are now, and a child that dies unanswered."""

import os
import tempfile

import pytest

from ddp_amp.errors import UsageError
from ddp_amp.launch.forkserver import WarmChildDied, call_warm, start_forkserver


@pytest.fixture(autouse=True)
def _temporary_directory_kept():
    """start_forkserver() makes this process a launcher, whose temporary directory is its own from then on
    (launch.scratch): the test process's other tests keep TMPDIR's."""
    saved = tempfile.tempdir
    yield
    tempfile.tempdir = saved


def _where_and_what(name: str) -> tuple[int, str, str | None]:
    return os.getpid(), os.getcwd(), os.environ.get(name)


def _refuse(line: str) -> None:
    raise UsageError(line)


def test_the_child_answers_with_this_processs_environment_and_directory_as_they_are_now(tmp_path, monkeypatch):
    start_forkserver()
    monkeypatch.setenv("DDP_AMP_TEST_CALL_WARM", "set after the fork server started")
    monkeypatch.chdir(tmp_path)
    pid, cwd, value = call_warm(_where_and_what, "DDP_AMP_TEST_CALL_WARM")
    assert pid != os.getpid() and cwd == str(tmp_path) and value == "set after the fork server started"


def test_the_childs_exception_is_raised_here_with_its_type_and_message():
    start_forkserver()
    with pytest.raises(UsageError, match="^--task x: no such thing$"):
        call_warm(_refuse, "--task x: no such thing")


def test_a_child_that_dies_without_an_answer_is_told_apart():
    start_forkserver()
    with pytest.raises(WarmChildDied, match="exit code 3"):
        call_warm(os._exit, 3)


def test_a_child_that_answered_ends_on_its_own_and_leaves_the_resource_tracker_nothing(tmp_path):
    """export --hf ran save_pretrained in a child whose tqdm bar made a multiprocessing lock; killed as soon as
    it answered, the child never released it: "resource_tracker: There appear to be 1 leaked semaphore objects"
    at the command's exit, every time."""
    import subprocess
    import sys

    (tmp_path / "locks.py").write_text("import multiprocessing\n\nLOCKS = []\n\n\ndef make_a_lock():\n"
                                       "    LOCKS.append(multiprocessing.RLock())  # tqdm's write lock is one\n"
                                       "    return 7\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import locks; "
            "from ddp_amp.process import call_spawned; print(call_spawned(locks.make_a_lock))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "7\n", result.stderr
    assert "leaked" not in result.stderr, result.stderr


def test_a_launcher_interrupted_before_the_child_answered_kills_it_at_once(tmp_path):
    """Ctrl-C while a check runs in the child: the child is killed at once, not waited for as one that has
    answered (the launcher waited CHILD_EXIT_S more, 10 s then). The wait is made 600 s here: a launcher that
    waited would outlast the test's 60."""
    import signal
    import subprocess
    import sys
    import time

    code = ("import time; import ddp_amp.process as process; process.CHILD_EXIT_S = 600; "
            "print('calling', flush=True); process.call_spawned(time.sleep, 3600)")
    # SIGINT as a terminal's Ctrl-C finds it, whatever this process does with it: a process that ignores SIGINT
    # (a background job of a non-interactive shell does) passes that on through exec, and Python then installs
    # no KeyboardInterrupt.
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert launcher.stdout.readline() == "calling\n"
        time.sleep(1)  # the child is under way (an interrupt before it started only makes this easier)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert "KeyboardInterrupt" in err


def _processes_with(marker: str) -> set[int]:
    """The pids whose environment holds `marker` (a launcher started with it and the children it passed it to)."""
    from pathlib import Path

    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.add(int(entry.name))
            except OSError:
                pass
    return found


def test_a_launcher_killed_while_its_spawned_child_still_starts_leaves_no_child_running():
    """The launcher SIGKILLed while its spawned child still starts, before that child has asked to die with its
    parent (here its start is held 2 s: an argument whose unpickling sleeps, as a loaded machine can hold it):
    re-parented by then, it used to take its new parent for the launcher and run on (a call of an hour here);
    told the launcher's pid, it sees the launcher gone and ends."""
    import signal
    import subprocess
    import sys
    import time
    import uuid

    marker = f"DDP_AMP_TEST_MARKER={uuid.uuid4().hex}"
    name, value = marker.split("=")
    code = ("import time; import ddp_amp.process as process\n"
            "class Slow:\n"
            "    def __reduce__(self):\n"
            "        return (eval, (\"__import__('time').sleep(2) or 3600\",))\n"
            "process.call_spawned(time.sleep, Slow())")
    launcher = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, name: value},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _processes_with(marker) - {launcher.pid}:
            assert launcher.poll() is None and time.monotonic() < deadline, "the child never started"
            time.sleep(0.01)
        time.sleep(0.5)  # the launcher has handed the child its arguments; the child is unpickling them
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while (left := _processes_with(marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"still running: {left}"
