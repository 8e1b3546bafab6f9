"""Signals in a rank's first milliseconds: a poller watches the fork server's children (every 0.5 ms on
/proc/<fork server>/task/*/children) and, a few milliseconds after the first rank is forked, stops the whole
process group or SIGKILLs the launcher, as a scheduler would at the worst instant. One trial at each of four
delays per case."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import last_line, read_summary, run_processes, start_launch

# serial: signals timed to the millisecond after a fork: alone, so that another test's load does not
# stretch the delays they aim at.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

DELAYS_S = (0.0, 0.002, 0.010, 0.030)
"""After the first rank's fork: the window before a rank installs its stop handler is these first milliseconds."""
TRIALS = int(os.environ.get("DDP_AMP_TEST_WINDOW_TRIALS", str(len(DELAYS_S))))
"""Each delay once in `make test` (20 launches over the five cases). The window bugs these cases were written
against showed at each of these delays, every time (a dropped SIGTERM at 0, 10 and 30 ms; the launcher's one-time
forwarding in 8 of 8 trials): the delay, not chance, puts the signal in the window, so one trial a delay finds
them, and the poller's 0.5 ms period and the machine's load add the jitter around each. For a soak,
DDP_AMP_TEST_WINDOW_TRIALS=20 (or more) runs each case that many times, the delays in turn."""
RUN = ["--device", "cpu", "--task", "linear", "--steps", "3000", "--batch-size", "8", "--checkpoint-every", "10",
       "--stop-timeout", "20", "--log-format", "json"]


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return found


def _forkserver_of(launcher: int, deadline: float) -> int:
    while time.monotonic() < deadline:
        for child in _children(launcher):
            try:
                if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return child
            except OSError:
                continue
        time.sleep(0.0005)
    raise AssertionError("no fork server appeared")


def _first_rank_forked(forkserver: int, run_dir: Path, deadline: float) -> None:
    """Returns right after the fork server forks its first rank (the resource tracker is the launcher's). The
    launcher's checks run in a child of the fork server before it writes config.json and waits for that child:
    a live child once config.json exists is a rank."""
    while time.monotonic() < deadline:
        if (run_dir / "config.json").exists() and any(_alive(child) for child in _children(forkserver)):
            return
        time.sleep(0.0005)
    raise AssertionError("the fork server never forked a rank")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _launch(command: str, run_dir: Path, mark: str) -> subprocess.Popen:
    extra = ["--max-restarts", "2"] if command == "run" else []
    return start_launch(run_dir, *RUN, *extra, command=command, mark=mark, own_session=True, stdout=subprocess.DEVNULL)

def _signal_in_the_window(process: subprocess.Popen, run_dir: Path, delay_s: float, deliver) -> None:
    deadline = time.monotonic() + 120
    _first_rank_forked(_forkserver_of(process.pid, deadline), run_dir, deadline)
    if delay_s:
        time.sleep(delay_s)
    deliver(process)


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_a_stop_in_a_ranks_first_milliseconds_is_a_stop(tmp_path, command):
    """SIGTERM to the whole process group just after a rank's fork: one agreed stop step, its checkpoint, exit
    143, a line that matches what is on disk, and (under run) no restart spent on it."""
    for trial in range(TRIALS):
        run_dir = tmp_path / f"trial-{trial}"
        process = _launch(command, run_dir, uuid.uuid4().hex)
        delay = DELAYS_S[trial % len(DELAYS_S)]
        _signal_in_the_window(process, run_dir, delay, lambda p: os.killpg(p.pid, signal.SIGTERM))
        _, stderr = process.communicate(timeout=120)
        where = f"trial {trial}, {delay * 1000:.0f} ms after the fork:\n{stderr}"
        assert process.returncode == 143, where
        summary = read_summary(run_dir)
        step = summary["stopped_at_step"]
        checkpoint = run_dir / "checkpoints" / f"step-{step}.pt"
        assert checkpoint.exists(), where
        assert last_line(stderr) == (f"ddp-amp: error: stopped by SIGTERM at step {step}; checkpoint {checkpoint} "
                                     f"(continue with --resume auto --run-dir {run_dir})"), where
        assert not summary.get("restarts"), where


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_a_launcher_killed_in_a_ranks_first_milliseconds_leaves_nothing_running(tmp_path, command):
    for trial in range(TRIALS):
        mark, run_dir = uuid.uuid4().hex, tmp_path / f"trial-{trial}"
        process = _launch(command, run_dir, mark)
        delay = DELAYS_S[trial % len(DELAYS_S)]
        _signal_in_the_window(process, run_dir, delay, lambda p: p.kill())
        process.wait(timeout=30)
        deadline = time.monotonic() + 10  # the bound: nothing left within 10 s of the kill
        while run_processes(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = run_processes(mark)
        for pid in left:  # leave nothing behind for the next trial either way
            os.kill(pid, signal.SIGKILL)
        assert not left, f"trial {trial}, {delay * 1000:.0f} ms after the fork: {len(left)} processes left"


def test_a_rank_killed_in_its_first_milliseconds_costs_run_a_plain_restart(tmp_path):
    """Under `run`, the agent's answer to a dead rank is SIGTERM to the others and, 30 s later, SIGKILL. A peer
    blocked in init_process_group (waiting at the store for the dead one) cannot run its Python handler: it
    must still leave at that SIGTERM (process.BlockedWaitStops), so that torch never needs its SIGKILL."""
    for trial in range(TRIALS):
        run_dir = tmp_path / f"trial-{trial}"
        process = subprocess.Popen(
            [sys.executable, "-m", "ddp_amp", "run", "-n", "2", "--device", "cpu", "--task", "linear", "--steps",
             "5", "--batch-size", "8", "--max-restarts", "1", "--log-format", "json", "--run-dir", str(run_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        delay = DELAYS_S[trial % len(DELAYS_S)]
        deadline = time.monotonic() + 120
        forkserver = _forkserver_of(process.pid, deadline)
        _first_rank_forked(forkserver, run_dir, deadline)
        time.sleep(delay)
        os.kill(next(child for child in _children(forkserver) if _alive(child)), signal.SIGKILL)
        try:
            _, stderr = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        where = f"trial {trial}, {delay * 1000:.0f} ms after the fork"
        assert process.returncode == 0, f"{where}: {stderr}"
        assert "recovered after 1 restart" in stderr, f"{where}: {stderr}"
        assert "forcefully exiting via SIGKILL" not in stderr, f"{where}: a rank ignored the agent's SIGTERM"
        assert read_summary(run_dir)["restarts"] == 1
