"""An elastic job on loopback whose second node arrives later and shares the first one's run dir (a shared file
system): it joins without a refusal or a deletion, and the resized --epochs run ends on its schedule's end."""

import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import HELPER_TASKS, assert_ok, read_metrics, read_summary, run_cli

pytestmark = pytest.mark.slow

CHECKPOINT_EVERY = 5
HOLD_AT = 12  # helper_tasks.HOLD_AT_CALL: waits_for_world holds there while the world is smaller


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
