"""The rank processes spawn starts (launch.processes.RankProcesses), with real processes forked from a fork server
and real signals: how a failure is read when its traceback was cut short, and how long the other ranks get before
they are ended. (multiprocessing's own fork server: ddp-amp's start_forkserver would mark this pytest process as a
launcher with a warm fork server, and the unit tests that run after it in the same worker would check in it.)"""

import os
import signal
import threading
import time

import pytest
import rank_functions

from ddp_amp.launch.processes import RankExited, RankProcesses, RankRaised
from ddp_amp.launch.spawn import FAILURE_GRACE_S

pytestmark = pytest.mark.slow


def wait_for(path, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("damage", [b"", b"\x80\x04\x95\x10"], ids=["empty", "cut-short"])
def test_a_rank_killed_while_writing_its_traceback_is_named_by_its_signal(damage, tmp_path):
    """An error file that exists but is empty or a pickle cut short (its rank killed mid-write): the failure is
    the rank's exit status ("terminated with signal SIGKILL"), never an EOFError or UnpicklingError escaping."""
    ranks = RankProcesses(rank_functions.waits_to_be_killed, (str(tmp_path),), 2)
    try:
        wait_for(tmp_path / "rank1.pid")
        with open(ranks.error_files[1], "wb") as file:
            file.write(damage)
        os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGKILL)
        with pytest.raises(RankExited) as failure:
            ranks.join(grace_period=0.5)
    finally:
        ranks.kill()
        ranks.remove_error_files()
    assert failure.value.error_index == 1 and failure.value.signal_name == "SIGKILL"
    assert str(failure.value) == "process 1 terminated with signal SIGKILL"


def test_the_other_ranks_get_the_failure_grace_before_sigterm(tmp_path):
    """Rank 0 raises; rank 1 spends a second in a finally: within the grace it finishes (its marker written) and
    ends by its own error (exit 1), not by SIGTERM."""
    ranks = RankProcesses(rank_functions.first_fails_second_cleans_up, (str(tmp_path),), 2)
    try:
        with pytest.raises(RankRaised) as failure:
            ranks.join(grace_period=FAILURE_GRACE_S)
    finally:
        ranks.kill()
        ranks.remove_error_files()
    assert failure.value.error_index == 0 and "rank 0 fails on purpose" in str(failure.value)
    assert (tmp_path / "rank1.cleaned").read_text() == "done"
    assert ranks.processes[1].exitcode == 1


def test_a_rank_that_ignores_sigterm_is_killed_after_the_second_grace(tmp_path):
    """Rank 1 ignores SIGTERM and never ends: after the grace, SIGTERM, and another grace, SIGKILL ends it
    (exit status -9); join returns with rank 0's failure and nothing left running."""
    ranks = RankProcesses(rank_functions.first_fails_second_ignores_sigterm, (str(tmp_path),), 2)
    raised = []

    def join() -> None:
        try:
            ranks.join(grace_period=0.5)
        except RankRaised as failure:
            raised.append(failure)

    joining = threading.Thread(target=join, daemon=True)
    try:
        wait_for(tmp_path / "rank1.ignoring")
        joining.start()
        joining.join(120)  # a guard against a hang, far beyond the two half-second graces: join must return
        assert not joining.is_alive(), "join never returned: rank 1, which ignores SIGTERM, was never SIGKILLed"
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
        ranks.remove_error_files()
    assert raised and raised[0].error_index == 0
    assert ranks.processes[1].exitcode == -signal.SIGKILL
    assert not any(process.is_alive() for process in ranks.processes)
