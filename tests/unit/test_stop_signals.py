"""The launcher's stop signals (process.stop_signals_raise), with real signals to a real process: the first one
asks for a graceful stop, the same one again at once is that stop delivered twice (GNU timeout signals its
command and then its process group), and any other second signal ends the process at once."""

import signal
import subprocess
import sys
import time

import pytest

from ddp_amp.process import REPEAT_WINDOW_S

# Stops gracefully on the first stop signal, and exits 128 + its number once the test says the stop is done.
STOPPING_PROCESS = """
import sys, time
from ddp_amp.process import StopSignal, stop_signals_raise
with stop_signals_raise():
    try:
        print("ready", flush=True)
        while True:
            time.sleep(60)
    except StopSignal as stop:
        print(f"stopping after {stop.name}", flush=True)
        sys.stdin.readline()  # the graceful stop lasts until the test writes a line
        sys.exit(stop.exit_code)
"""


@pytest.fixture
def stopping():
    process = subprocess.Popen([sys.executable, "-c", STOPPING_PROCESS], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    yield process
    process.kill()
    process.wait()


def first_stop(process, signum: int) -> None:
    process.send_signal(signum)
    assert process.stdout.readline() == f"stopping after {signal.Signals(signum).name}\n"


def end_stop(process) -> int:
    process.stdin.write("done\n")
    process.stdin.flush()
    return process.wait(timeout=30)


def test_the_same_signal_again_at_once_is_the_same_stop(stopping):
    first_stop(stopping, signal.SIGTERM)
    stopping.send_signal(signal.SIGTERM)  # what GNU timeout's second delivery (to its process group) is
    assert end_stop(stopping) == 128 + signal.SIGTERM


def test_another_stop_signal_ends_the_process_at_once(stopping):
    first_stop(stopping, signal.SIGTERM)
    stopping.send_signal(signal.SIGINT)  # Ctrl-C during a graceful stop
    assert stopping.wait(timeout=30) == -signal.SIGINT


def test_the_same_signal_after_the_repeat_window_ends_the_process_at_once(stopping):
    first_stop(stopping, signal.SIGUSR1)
    time.sleep(REPEAT_WINDOW_S + 0.2)  # at least this long after the first was handled
    stopping.send_signal(signal.SIGUSR1)
    assert stopping.wait(timeout=30) == -signal.SIGUSR1
