"""A user's own training script, launched as torchrun launches it: `ddp-amp spawn|run -n 2 SCRIPT ARGS`. Real
2-rank gloo runs of the project's origin example and of a script with ways to fail; real signals."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from helpers import (
    CHECKS_SCRIPT,
    ORIGIN_SCRIPT,
    TASKS,
    last_line,
    launch_script,
    read_summary,
    run_processes,
    start_launch,
)

pytestmark = pytest.mark.slow
EPOCHS = "20"


@pytest.fixture(scope="module")
def torchrun_weights(tmp_path_factory):
    """The origin example under plain `torchrun --standalone --nproc-per-node 2`: the weights to match. As
    written, its `python` ranks hang or abort at exit now and then under load, after the weights are saved: gloo's
    group destructor (docs/scripts.md; 1 run in 15 beside two busy loops). Freeing the DDP model first was not
    enough (a clean-clone `make test` saw "terminate called without an active exception" with it), so here each
    rank leaves, after a barrier, with os._exit, as ddp-amp's ranks do: no destructor runs."""
    folder = tmp_path_factory.mktemp("torchrun")
    source = ORIGIN_SCRIPT.read_text()
    destroy = "    dist.destroy_process_group()"
    assert source.count(destroy) == 1
    fixed = folder / ORIGIN_SCRIPT.name
    fixed.write_text(source.replace(destroy, "    dist.barrier()\n    import os\n    os._exit(0)"))
    out = folder / "model.pt"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(fixed), "--epochs", EPOCHS, "--out", str(out)], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "TMPDIR": str(folder)})  # torchrun's logs
    assert result.returncode == 0, result.stderr
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_the_origin_example_runs_unchanged_and_ends_on_torchruns_weights(command, tmp_path, torchrun_weights):
    """Exit 0; every rank's prints in the terminal, prefixed by its rank, and in its log; the same final weights
    as torchrun's; the run's record says what ran."""
    out = tmp_path / "model.pt"
    result = launch_script(tmp_path / "run", ORIGIN_SCRIPT, "--epochs", EPOCHS, "--out", str(out), command=command,
                           options=("--log-format", "plain"))
    assert result.returncode == 0, result.stderr
    weights = torch.load(out, weights_only=True)
    assert weights.keys() == torchrun_weights.keys()
    assert all(torch.equal(weights[k], torchrun_weights[k]) for k in weights)
    for rank in (0, 1):
        printed = [line for line in result.stdout.splitlines() if line.startswith(f"[rank {rank}] Rank {rank}, Epoch")]
        assert len(printed) == int(EPOCHS), result.stdout
        logged = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text().splitlines()
        assert [line for line in logged if line.startswith(f"Rank {rank}, Epoch")] == \
            [line.removeprefix(f"[rank {rank}] ") for line in printed]
    summary = read_summary(tmp_path / "run")
    assert summary["outcome"] == "finished" and summary["exit_code"] == 0 and summary["world_size"] == 2
    assert summary["script"] == [str(ORIGIN_SCRIPT), "--epochs", EPOCHS, "--out", str(out)]


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_each_rank_sees_torchruns_environment_argv_path_and_main(command, tmp_path):
    """What the script can read is what torchrun gives it: the variables of its contract, sys.argv as typed,
    sys.path[0] its folder, the launcher's working directory, __name__ == "__main__", OMP_NUM_THREADS=1, and the
    platform's start method for its own processes (not the fork server's, that the rank was forked from)."""
    seen = tmp_path / "seen"
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-m", "ddp_amp", command, "-n", "2", "--run-dir", str(tmp_path / "run"),
                             "script_checks.py", "--steps", "1", "--env-to", str(seen)], capture_output=True,
                            text=True, timeout=300, cwd=TASKS, env=env)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        found = json.loads((seen / f"rank{rank}.json").read_text())
        variables = found["env"]
        expected = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                    "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1",
                    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1"}
        assert {key: variables.get(key) for key in expected} == expected
        assert variables["MASTER_ADDR"] and variables["MASTER_PORT"].isdigit() and variables["TORCHELASTIC_RUN_ID"]
        assert found["argv"] == ["script_checks.py", "--steps", "1", "--env-to", str(seen)]
        assert found["path0"] == str(TASKS) and found["cwd"] == str(TASKS) and found["name"] == "__main__"
        assert found["threads"] == 1
        assert found["start_method"] == multiprocessing.get_all_start_methods()[0]  # the first is the default


def test_a_module_runs_as_python_m_runs_it(tmp_path):
    """-m MODULE: found from the working directory, sys.argv[0] its file, sys.path[0] the working directory."""
    seen = tmp_path / "seen"
    result = subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", "--run-dir", str(tmp_path / "run"),
                             "-m", "script_checks", "--steps", "1", "--env-to", str(seen)], capture_output=True,
                            text=True, timeout=300, cwd=TASKS)
    assert result.returncode == 0, result.stderr
    found = json.loads((seen / "rank1.json").read_text())
    assert found["argv"] == [str(CHECKS_SCRIPT), "--steps", "1", "--env-to", str(seen)]
    assert found["path0"] == str(TASKS) and found["name"] == "__main__"


@pytest.fixture(scope="module")
def raised(tmp_path_factory):
    """`ddp-amp COMMAND` of the script whose rank 1 raises, launched once per command (cached): (run dir,
    result). Its run dir is read, not written, by the tests that take it."""
    runs = {}

    def launched(command: str):
        if command not in runs:
            run_dir = tmp_path_factory.mktemp(f"raised-{command}") / "script"
            runs[command] = run_dir, launch_script(run_dir, CHECKS_SCRIPT, "--fail-rank", "1", "--fail-step", "2",
                                                   command=command)
        return runs[command]
    return launched


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_a_script_whose_ranks_leave_by_os_exit_0_finishes(command, tmp_path):
    """Ranks that end by os._exit(0) (no return to the caller): under `run`, torch's agent waited for their results
    for good (the launcher hung until killed); torchrun's subprocess workers end so with exit 0, and so do these.
    The timeout is a hang guard."""
    result = launch_script(tmp_path / "run", CHECKS_SCRIPT, "--steps", "2", "--os-exit", command=command, timeout=300)
    assert result.returncode == 0, result.stderr
    assert last_line(result.stderr).startswith("ddp-amp: the script finished on every rank"), result.stderr
    assert all(f"[rank {rank}] rank {rank} step 1 sum 4 restart 0" in result.stdout for rank in (0, 1)), result.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["outcome"] == "finished" and summary["exit_code"] == 0


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_a_rank_that_raises_is_named_with_its_exception_and_its_traceback_shown_once(command, raised):
    run_dir, result = raised(command)
    assert result.returncode == 1, result.stderr
    assert last_line(result.stderr).startswith("ddp-amp: error: rank 1 failed: ValueError: rank 1 fails on purpose")
    shown = result.stdout + result.stderr  # the display's report (stdout), the last line (stderr)
    assert shown.count("Traceback (most recent call last)") == 1
    assert shown.count('raise ValueError(f"rank {rank} fails on purpose")') == 1
    assert "runpy" not in shown and "ddp_amp" not in shown  # it starts in the script, as python SCRIPT shows it
    log = (run_dir / "logs" / "rank1.log").read_text()
    assert "rank 1 step 1 sum 4" in log and log.rstrip().endswith("ValueError: rank 1 fails on purpose")
    summary = read_summary(run_dir)
    assert summary["outcome"] == "failed" and summary["exit_code"] == 1
    assert summary["failure"].startswith("rank 1 failed: ValueError: rank 1 fails on purpose")


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_of_two_ranks_that_raise_the_verdict_names_the_first(command, tmp_path):
    """Rank 1 raises, rank 0 raises 50 ms later (on its own, not a peer's "connection closed"): the last line and
    the record name rank 1, as the display's "(after rank 1 failed)" does. Under run, torchrun's agent named the
    rank whose process ended first, rank 0, in 3 runs of 4. Three runs each."""
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        result = launch_script(run_dir, CHECKS_SCRIPT, "--fail-rank", "1", "--then-fail-rank", "0",
                               command=command, options=("--log-format", "plain"))
        assert result.returncode == 1, result.stderr
        assert last_line(result.stderr).startswith("ddp-amp: error: rank 1 failed: ValueError: rank 1 fails on "
                                                   "purpose"), result.stderr
        assert "RuntimeError: rank 0 fails after the other (after rank 1 failed)" in result.stderr
        assert read_summary(run_dir)["failure"].startswith("rank 1 failed: ValueError")
        # under run, torchrun's agent log and torch.multiprocessing's warnings stay in logs/agent.log
        assert "torch.distributed.elastic" not in result.stderr and "ProcessExitedException" not in result.stderr
        assert "Terminating process" not in result.stderr, result.stderr


def _start(command: str, run_dir, *script_args: str, mark: str, options: list[str] = ()) -> subprocess.Popen:
    # run with restarts to spare: a stop must still end the job, not restart the ranks it ended
    restarts = ["--max-restarts", "2"] if command == "run" else []
    return start_launch(run_dir, *restarts, *options, "--log-format", "plain", str(CHECKS_SCRIPT), *script_args,
                        command=command, mark=mark, own_session=True)

def test_a_rank_that_holds_the_others_back_is_marked_stalled_and_named_when_stopped(tmp_path):
    """Rank 1 sleeps where rank 0 enters its third all-reduce (the script's own timeout 60 s away): the live
    view marks rank 1 stalled, at its line of the script, once no collective moved for the stall threshold (at
    least 10 s); SIGTERM then ends the run with a line that names it, and the flight records say how long rank 0
    has waited (written while it waits, not once 2 s after it entered)."""
    mark = uuid.uuid4().hex
    process = _start("spawn", tmp_path / "run", "--steps", "10", "--hang-rank", "1", "--timeout", "60", mark=mark)
    try:
        seen = []
        for line in process.stderr:  # ends with the process: a stall never marked fails below
            seen.append(line)
            if line.startswith("[rank 1] stalled: "):
                break
        assert seen and seen[-1].startswith("[rank 1] stalled: no collective moved for 1"), "".join(seen)
        assert "it is at script_checks.py:" in seen[-1] and "after collective #2" in seen[-1], seen[-1]
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 128 + signal.SIGTERM
    assert last_line(err).startswith("ddp-amp: error: stopped by SIGTERM: passed on to every rank")
    assert "; rank 1 had stalled at script_checks.py:" in last_line(err), err
    diagnosis = subprocess.run([sys.executable, "-m", "ddp_amp", "diagnose", str(tmp_path / "run")],
                               capture_output=True, text=True, timeout=60)
    waited = int(diagnosis.stdout.split("rank 0 waited in it for ")[1].split(" s")[0])
    assert waited >= 10 - 2, diagnosis.stdout  # the stall came after 10 s or more; a record every 2 s
    assert run_processes(mark) == []


def _wait_for_steps(run_dir, deadline_s: float = 120) -> None:
    """Until both ranks have printed a step (their logs say so)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        logs = [run_dir / "logs" / f"rank{rank}.log" for rank in (0, 1)]
        if all(log.exists() and "step 1 " in log.read_text() for log in logs):
            return
        time.sleep(0.1)
    raise AssertionError("the ranks never printed their second step")


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_sigterm_to_the_process_group_reaches_every_rank_and_exits_143(command, tmp_path):
    """As a scheduler stops a job: SIGTERM to the whole group. Every rank's own handler ran (it wrote a file),
    rank 1's taking 7 s (a checkpoint's write) after rank 0 had exited: within --stop-timeout it is not killed.
    The launcher exits 143 with one line, and nothing is left running."""
    mark, signals = uuid.uuid4().hex, tmp_path / "signals"
    signals.mkdir()
    process = _start(command, tmp_path / "run", "--steps", "1000", "--step-s", "0.1", "--signals-to", str(signals),
                     "--slow-save-rank", "1", "--save-s", "7", mark=mark, options=["--stop-timeout", "60"])
    stderr = _group_signalled_once_stepping(process, tmp_path / "run", signal.SIGTERM)
    assert process.returncode == 143, stderr
    assert sorted(p.name for p in signals.iterdir()) == ["rank0.SIGTERM", "rank1.SIGTERM"]
    assert last_line(stderr) == (f"ddp-amp: error: stopped by SIGTERM: passed on to every rank (each rank's output "
                                 f"in {tmp_path / 'run' / 'logs'})")
    summary = read_summary(tmp_path / "run")
    assert summary["outcome"] == "stopped" and summary["restarts"] == 0
    assert not run_processes(mark)


def _group_signalled_once_stepping(process, run_dir, signum) -> str:
    """`signum` to the launch's whole process group (a terminal's Ctrl-C, a scheduler's stop) once its ranks
    step; its stderr once it ended (SIGKILL to the group if it had not within 60 s)."""
    try:
        _wait_for_steps(run_dir)
        os.killpg(process.pid, signum)
        return process.communicate(timeout=60)[1]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_ctrl_c_stops_a_script_without_showing_its_keyboard_interrupt_as_a_failure(command, tmp_path):
    """Ctrl-C in a terminal: SIGINT to the whole group. A script without a handler of its own raises
    KeyboardInterrupt in every rank: the run was stopped, so the launcher says so in one line (exit 130); it
    showed '[rank 1] failed:' and the KeyboardInterrupt's traceback under spawn, and under run it waited out
    --stop-timeout (a rank that the passed-on SIGINT reached while it reported the first exited 0, without the
    return value torchrun's agent waits for)."""
    mark = uuid.uuid4().hex
    # --stop-timeout well past the wait below: a launch still waiting for its ranks fails the test
    process = _start(command, tmp_path / "run", "--steps", "1000", "--step-s", "0.1", mark=mark,
                     options=["--stop-timeout", "600"])
    stderr = _group_signalled_once_stepping(process, tmp_path / "run", signal.SIGINT)
    assert process.returncode == 130, stderr
    assert "failed" not in stderr and "Traceback" not in stderr, stderr
    assert last_line(stderr) == (f"ddp-amp: error: stopped by SIGINT: passed on to every rank (each rank's output "
                                 f"in {tmp_path / 'run' / 'logs'})")
    assert not run_processes(mark)


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_a_sigkilled_launcher_leaves_nothing_running(command, tmp_path):
    mark = uuid.uuid4().hex
    process = _start(command, tmp_path / "run", "--steps", "100000", "--step-s", "0.05", mark=mark)
    try:
        _wait_for_steps(tmp_path / "run")
        assert len(run_processes(mark)) >= 3  # the launcher, the fork server, two ranks
        process.kill()
        process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while run_processes(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = run_processes(mark)
    finally:
        for pid in run_processes(mark):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} processes left 10 s after the launcher was SIGKILLed"


def test_run_restarts_a_script_whose_rank_was_killed_and_it_sees_the_count(tmp_path):
    """run --max-restarts 1: rank 1 SIGKILLs itself in the first attempt; the script runs again, its ranks read
    TORCHELASTIC_RESTART_COUNT=1, and the run finishes; the restart's cause is named."""
    result = launch_script(tmp_path / "run", CHECKS_SCRIPT, "--kill-once-rank", "1", command="run",
                           options=("--max-restarts", "1", "--log-format", "plain"))
    assert result.returncode == 0, result.stderr
    assert "[rank 1] rank 1 step 4 sum 10 restart 1" in result.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["restarts"] == 1
    # which rank ended the attempt, and how: on screen and in the record, not only in logs/agent.log
    assert "ddp-amp: restart 1: rank 1 died with SIGKILL" in result.stderr.splitlines(), result.stderr
    assert summary["restart_causes"] == [{"restart": 1, "rank": 1, "cause": "died with SIGKILL"}]


def test_a_hang_in_the_scripts_all_reduce_is_named_by_diagnose(tmp_path):
    """Rank 1 sleeps instead of entering its third all-reduce; rank 0's times out (the script's own 5 s). The
    last line and `ddp-amp diagnose` name rank 1, the collective and the script's line where rank 1 was."""
    result = launch_script(tmp_path / "run", CHECKS_SCRIPT, "--hang-rank", "1", "--timeout", "5")
    assert result.returncode == 1
    line = last_line(result.stderr)
    assert "rank 1 never entered collective #3 (all_reduce, 4 B)" in line, line
    assert "rank 1 was last in script_checks.py:" in line, line
    diagnosis = subprocess.run([sys.executable, "-m", "ddp_amp", "diagnose", str(tmp_path / "run")],
                               capture_output=True, text=True, timeout=60)
    assert diagnosis.returncode == 0
    assert diagnosis.stdout.splitlines()[0].startswith("rank 1 never entered collective #3 (all_reduce, 4 B)")


def test_show_lists_a_script_run_beside_a_task_run(tmp_path, raised):
    """`ddp-amp show` reads a script's record: its state and what it ran, beside a run of a built-in task."""
    task = subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", "--device", "cpu", "--task",
                           "linear", "--steps", "2", "--run-dir", str(tmp_path / "task")], capture_output=True,
                          text=True, timeout=300)
    assert task.returncode == 0, task.stderr
    script, failed = raised("spawn")
    assert failed.returncode == 1
    shown = subprocess.run([sys.executable, "-m", "ddp_amp", "show", str(tmp_path / "task"), str(script)],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[1]: line.split()[3:6] for line in shown.stdout.splitlines() if line.startswith("│ ")}
    assert rows["task"] == ["finished", "│", "linear"], shown.stdout
    assert rows["script"] == ["failed", "│", "script_checks.py"], shown.stdout
    assert "script_checks.py --fail-rank 1 --fail-step 2" in shown.stdout


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_a_rank_whose_script_ends_early_is_named_and_its_peers_fail_at_once(command, tmp_path):
    """Rank 1's script exits 0 at step 2; rank 0 enters the next all-reduce alone. As under torchrun, rank 1's
    process is gone, so rank 0 fails at once ("Connection closed by peer"), not at the group's 60 s timeout
    (run's workers used to stay alive until every rank was done); the verdict names rank 1 as the cause."""
    result = launch_script(tmp_path / "run", CHECKS_SCRIPT, "--leave-rank", "1", command=command)
    assert result.returncode == 1, result.stderr
    verdict = last_line(result.stderr)
    assert verdict.startswith("ddp-amp: error: rank 1 ended early (its script exited 0) while the other ranks still "
                              "ran collectives (rank 0 failed: RuntimeError: "), verdict
    assert "Connection closed by peer" in verdict or "Connection reset by peer" in verdict, verdict
    assert read_summary(tmp_path / "run")["failure"].startswith("rank 1 ended early")
