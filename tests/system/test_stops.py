"""Stops delivered the way the real world delivers them: to the whole process group (`kill -TERM -PGID`, a
closed terminal's SIGHUP, GNU `timeout`), to one rank alone, and during the final evaluation. Each keeps the
work (a checkpoint at the stop step, without --checkpoint-every), exits 128 + the signal's number with one
line saying how to continue, and leaves no process behind."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import HELPER_TASKS, assert_ok, last_line, read_summary, run_cli

pytestmark = pytest.mark.slow

# --log-every far beyond where the stop lands: the ranks must agree on a stop without waiting for a log step.
QUIET_RUN = ["--device", "cpu", "--task", "linear", "--steps", "1000000", "--log-every", "1000000",
             "--log-format", "plain", "--stop-timeout", "60"]
TRAINING = ["--checkpoint-every", "100", "--keep", "1"]  # the first checkpoint tells the test training began
# Any step's: at hundreds of steps a second, --keep 1 can prune step-100 before a poll sees it.
FIRST_CHECKPOINT = "checkpoints/step-*.pt"


def assert_stopped_with_checkpoint(run, signum: int) -> None:
    _, stderr = run.process.communicate(timeout=90)
    name = signal.Signals(signum).name
    assert run.process.returncode == 128 + signum, stderr
    summary = read_summary(run.run_dir)
    step = summary["stopped_at_step"]
    assert summary["stopped_by"] == name
    assert 100 <= step < 1_000_000
    checkpoint = run.run_dir / "checkpoints" / f"step-{step}.pt"
    assert summary["checkpoint"] == str(checkpoint)
    assert torch.load(checkpoint, weights_only=True)["step"] == step
    assert last_line(stderr) == (f"ddp-amp: error: stopped by {name} at step {step}; checkpoint {checkpoint} "
                                 f"(continue with --resume auto --run-dir {run.run_dir})"), stderr
    assert "Traceback" not in stderr and "KeyError" not in stderr, stderr
    assert not (run.run_dir / "model.pt").exists()
    assert run.wait_until_gone() == [], "processes of the run outlived the stop"


@pytest.mark.parametrize(("command", "signum"), [("spawn", signal.SIGTERM), ("spawn", signal.SIGUSR1),
                                                 ("run", signal.SIGTERM), ("run", signal.SIGUSR1),
                                                 ("spawn", signal.SIGHUP), ("run", signal.SIGHUP)])
def test_a_signal_to_the_whole_process_group_stops_at_one_step_with_a_checkpoint(command, signum, long_run):
    """Every process of the run receives it at once: the fork server and the resource tracker must survive it
    (they ignore it), the launcher and every rank must take it as a stop."""
    run = long_run(command, args=[*QUIET_RUN, *TRAINING], own_session=True, ready=FIRST_CHECKPOINT)
    assert len(run.ranks()) == 2
    if command == "spawn":  # its launcher never imports torch (launch.processes): only the fork server does
        assert "libtorch" not in (Path("/proc") / str(run.pid) / "maps").read_text()
    os.killpg(run.pid, signum)  # the launcher leads its own group, as under setsid
    assert_stopped_with_checkpoint(run, signum)


def test_ranks_killed_in_a_slow_checkpoint_write_after_a_stop_name_the_newest_complete_checkpoint(long_run):
    """SIGTERM while every checkpoint after step 4 takes 60 s to write, with --stop-timeout 1: the ranks, still
    writing the stop's checkpoint, are killed. The line names this run's newest whole checkpoint (step-4.pt),
    not "nothing of this run kept"; nothing is left running."""
    args = ["--device", "cpu", "--task", f"{HELPER_TASKS}:slow_disk_after_step_4", "--steps", "1000000",
            "--checkpoint-every", "2", "--keep", "1000", "--log-every", "1", "--log-format", "plain",
            "--stop-timeout", "1"]
    run = long_run("spawn", args=args, own_session=True, ready="checkpoints/step-4.pt")
    os.killpg(run.pid, signal.SIGTERM)
    _, stderr = run.process.communicate(timeout=90)
    assert run.process.returncode == 143, stderr
    assert last_line(stderr) == (
        "ddp-amp: error: stopped by SIGTERM: the ranks did not stop within --stop-timeout 1s and were killed; the "
        f"newest complete checkpoint is {run.run_dir / 'checkpoints' / 'step-4.pt'} (continue with --resume auto "
        f"--run-dir {run.run_dir})")
    assert run.wait_until_gone() == []
    # the killed ranks wrote no summary.json: the launcher's keeps the line, and show gives it
    record = read_summary(run.run_dir)
    assert record["launch_failure"] == last_line(stderr).removeprefix("ddp-amp: error: ")
    shown = run_cli("show", str(run.run_dir), env={"COLUMNS": "1000"})
    assert f"{run.run_dir.name} stopped: {record['launch_failure']}" in shown.stdout, shown.stdout


def test_a_stop_keeps_the_work_without_checkpoint_every(long_run):
    args = ["--device", "cpu", "--task", "linear", "--steps", "1000000", "--log-every", "50", "--log-format", "plain"]
    run = long_run("spawn", args=args, own_session=True)  # ready at the first metrics line
    os.killpg(run.pid, signal.SIGTERM)
    _, stderr = run.process.communicate(timeout=90)
    assert run.process.returncode == 143, stderr
    step = read_summary(run.run_dir)["stopped_at_step"]
    checkpoints = sorted(p.name for p in (run.run_dir / "checkpoints").glob("*.pt"))
    assert checkpoints == [f"step-{step}.pt"]
    assert f"stopped by SIGTERM at step {step}; checkpoint" in last_line(stderr)
    assert run.wait_until_gone() == []


def test_gnu_timeout_stops_the_run_with_a_checkpoint(long_run):
    """timeout signals its command and then its whole process group. It is signalled here rather than left to
    expire (no wall-clock race with the start-up); it passes a received signal on exactly as its own."""
    run = long_run("spawn", args=[*QUIET_RUN, *TRAINING], prefix=["timeout", "-s", "TERM", "600"],
                   ready=FIRST_CHECKPOINT)
    run.process.send_signal(signal.SIGTERM)  # to timeout, which sends it on to ddp-amp and to its group
    assert_stopped_with_checkpoint(run, signal.SIGTERM)


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_sigusr1_to_one_rank_alone_stops_every_rank(command, long_run):
    """As a scheduler's warning aimed at one process: the other ranks and the launcher learn of it through the
    stop agreement, and the run still ends as a stop (not as a success without model.pt)."""
    run = long_run(command, args=[*QUIET_RUN, *TRAINING], ready=FIRST_CHECKPOINT)
    ranks = run.ranks()
    assert len(ranks) == 2
    os.kill(ranks[-1], signal.SIGUSR1)
    assert_stopped_with_checkpoint(run, signal.SIGUSR1)


def test_a_stop_during_the_final_evaluation_exits_0_with_the_model(tmp_path):
    process = subprocess.run(
        [sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", "--device", "cpu", "--steps", "5",
         "--task", f"{HELPER_TASKS}:group_stop_in_evaluate", "--run-dir", str(tmp_path), "--log-format", "plain"],
        capture_output=True, text=True, timeout=180, start_new_session=True)
    assert_ok(process)
    summary = read_summary(tmp_path)
    assert summary["eval"] == {"evaluated": True} and "stopped_at_step" not in summary
    assert (tmp_path / "model.pt").exists()
    assert last_line(process.stderr) == (f"ddp-amp: SIGTERM came after the run had finished; "
                                         f"{tmp_path / 'model.pt'} is written"), process.stderr
