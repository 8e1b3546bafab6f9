"""An elastic job on loopback whose second node arrives later and shares the first one's run dir (a shared file
system): it joins without a refusal or a deletion, and the resized --epochs run ends on its schedule's end."""

import os
import subprocess
import sys
import time

import pytest
from helpers import HELPER_TASKS, assert_ok, free_port, read_metrics, read_summary, run_cli

# serial: nodes that join while a job trains, on rendezvous deadlines: alone, so that another test's
# load does not decide who joins in time.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

CHECKPOINT_EVERY = 5
HOLD_AT = 12  # helper_tasks.HOLD_AT_CALL: waits_for_world holds there while the world is smaller



def test_a_late_node_joins_a_shared_run_dir_and_the_resized_run_ends_on_its_schedule(tmp_path):
    run_dir, port = tmp_path / "shared", free_port()
    schedule = ["--epochs", "2", "--batch-size", "16", "--schedule", "onecycle", "--warmup-steps", "3",
                "--log-every", "5", "--device", "cpu"]

    def node() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "1:2", "--nproc-per-node", "1", "--endpoint",
             f"127.0.0.1:{port}", "--task", f"{HELPER_TASKS}:waits_for_world", *schedule, "--checkpoint-every",
             str(CHECKPOINT_EVERY), "--rdzv-last-call", "1", "--rdzv-timeout", "120", "--log-format", "plain",
             "--run-dir", str(run_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "DDP_AMP_TEST_WORLD": "2"})

    jobs = [node()]
    try:
        held = run_dir / "checkpoints" / f"step-{HOLD_AT // CHECKPOINT_EVERY * CHECKPOINT_EVERY}.pt"
        deadline = time.monotonic() + 180
        while not held.exists():  # the one-node job trains up to its hold
            assert time.monotonic() < deadline and jobs[0].poll() is None, "no checkpoint before the hold"
            time.sleep(0.2)
        jobs.append(node())  # the same --run-dir: the running job's
        outputs = [job.communicate(timeout=300) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    for job, (out, err) in zip(jobs, outputs):
        assert job.returncode == 0, out + err
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["resumed_from_step"] > 0
    reference = tmp_path / "reference"
    assert_ok(run_cli("spawn", "-n", "2", "--task", f"{HELPER_TASKS}:waits_for_world", *schedule,
                      "--run-dir", str(reference)))
    unresized = read_summary(reference)
    assert summary["final_lr"] == pytest.approx(unresized["final_lr"], rel=1e-9)
    assert summary["steps"] == unresized["steps"]
    steps = [record["step"] for record in read_metrics(run_dir)]
    assert steps == sorted(set(steps)), "a step logged twice or out of order"


def test_nodes_that_join_while_the_job_trains_grow_it_and_no_node_leaves(tmp_path):
    """Two nodes train (--nnodes 2:3, no hold: the ranks are between steps, as in real training) when a third
    arrives. Each node's agent stops its workers when it notices the newcomer, at its own monitor interval; the
    ranks of the first one to notice agree with all ranks on a stop step and checkpoint it. A rank whose agent
    has not noticed yet must not end there: a clean exit is, to its agent, the end of the job, and that node would
    leave the job. All three nodes go on with world size 3 from the stop step and finish together, and no
    worker outlives its agent's SIGTERM (torchrun SIGKILLs one still there 30 s later)."""
    port, steps = free_port(), 1000
    run_dirs = [tmp_path / f"node{index}" for index in range(3)]

    def node(index: int) -> subprocess.Popen:
        # The first node's agent looks every 5 s (torchrun's default; the interval is each agent's own), so the
        # other's agent is nearly always the first to notice, seconds before it.
        interval = "5" if index == 0 else "0.1"
        return subprocess.Popen(
            [sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "2:3", "--nproc-per-node", "1", "--endpoint",
             f"127.0.0.1:{port}", "--task", f"{HELPER_TASKS}:slow_until_world", "--device", "cpu", "--steps",
             str(steps), "--log-every", "100", "--checkpoint-every", "50", "--rdzv-last-call", "1",
             "--monitor-interval", interval, "--rdzv-timeout", "120", "--log-format", "plain",
             "--run-dir", str(run_dirs[index])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "DDP_AMP_TEST_WORLD": "3"})

    jobs = [node(0), node(1)]
    try:
        deadline = time.monotonic() + 180
        while not (run_dirs[0] / "checkpoints" / "step-50.pt").exists():  # the two-node job trains
            assert time.monotonic() < deadline and all(job.poll() is None for job in jobs), "no checkpoint"
            time.sleep(0.2)
        jobs.append(node(2))
        outputs = [job.communicate(timeout=150) for job in jobs]  # ~25 s here
    finally:
        for job in jobs:
            job.kill()
    for job, (out, err) in zip(jobs, outputs):
        assert job.returncode == 0, out + err
    summaries = [read_summary(run_dir) for run_dir in run_dirs]
    assert [s["world_size"] for s in summaries] == [3, 3, 3]
    assert [s["steps"] for s in summaries] == [steps] * 3
    resumed = {s["resumed_from_step"] for s in summaries}
    assert len(resumed) == 1 and 50 <= resumed.pop() < steps  # the stop step, agreed by every rank
    weights = [(run_dir / "model.pt").read_bytes() for run_dir in run_dirs]
    assert weights[0] == weights[1] == weights[2]
    for run_dir in run_dirs[:2]:
        assert "Unable to shutdown process" not in (run_dir / "logs" / "agent.log").read_text()
