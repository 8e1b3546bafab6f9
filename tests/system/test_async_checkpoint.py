"""Checkpoints written in the background (the default) or by the loop itself (--no-async-checkpoint): the same
files either way, each save's blocked time in metrics.jsonl and summary.json, at most one write in flight, and
what a kill -9 or a stop signal in the middle of a background write leaves. Real 2-rank gloo runs, real
signals to the run's whole process group."""

import os
import signal
import subprocess
import time

import pytest
import torch
from helpers import USER_TASKS, assert_ok, launch, read_metrics, read_summary, start_launch

from ddp_amp.checkpoint.storage import checkpoints, load_checkpoint

pytestmark = pytest.mark.slow
# 3.6 M parameters: a 43 MB checkpoint with AdamW's moments, whose pickling, write and fsync outlast a step.
HEAVY = ["--device", "cpu", "--amp", "off", "--task", f"{USER_TASKS}:sized", "--task-arg", "width=400000",
         "--batch-size", "1"]


def spawn(run_dir, *args, wait: bool = True):
    if wait:
        return launch(run_dir, *args, "--log-format", "plain", own_session=True)
    return start_launch(run_dir, *args, "--log-format", "plain", own_session=True, stdout=subprocess.DEVNULL)


def temporary_files(run_dir):
    """Checkpoints being written: atomic_write's `.step-N.pt.HOST.PID.*.tmp` (not the sidecars', written after),
    or a sharded checkpoint's directory `.step-N.HOST.PID.tmp/`, which every rank writes its part into."""
    if not (run_dir / "checkpoints").is_dir():
        return []
    return sorted(path for path in (run_dir / "checkpoints").glob(".step-*.tmp")
                  if path.is_dir() or ".pt." in path.name)


FORMATS = [pytest.param([], id="single"), pytest.param(["--checkpoint-format", "sharded"], id="sharded")]


def wait_for_a_write_in_flight(process, run_dir, after_step: int) -> None:
    """Until a checkpoint's temporary file exists beside a complete checkpoint of `after_step` or later: a
    background write is under way."""
    deadline = time.monotonic() + 120
    while not (temporary_files(run_dir) and any(int(p.stem.split("-")[1]) >= after_step
                                                for p in checkpoints(run_dir))):
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "no checkpoint write was seen in flight"
        time.sleep(0.002)


def tensors(value, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by its path."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    return {key: t for name, item in items for key, t in tensors(item, f"{path}/{name}").items()}


def test_background_and_synchronous_saves_write_the_same_checkpoints_and_report_each_save(tmp_path):
    args = ["--device", "cpu", "--task", "mlp", "--amp", "off", "--steps", "20", "--checkpoint-every", "5",
            "--keep", "4", "--log-every", "5"]
    for mode in ("async-checkpoint", "no-async-checkpoint"):
        assert_ok(spawn(tmp_path / mode, *args, f"--{mode}"))
    background, synchronous = tmp_path / "async-checkpoint", tmp_path / "no-async-checkpoint"
    assert (background / "model.pt").read_bytes() == (synchronous / "model.pt").read_bytes()
    for step in (5, 10, 15, 20):
        a, b = (tensors(load_checkpoint(run / "checkpoints" / f"step-{step}.pt")["trainer"])
                for run in (background, synchronous))
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), step
    for run in (background, synchronous):
        # Each save on the line after its step's (a save follows its step's line); the last one in summary.json only
        saves = [save for line in read_metrics(run) for save in line.get("checkpoints", [])]
        assert [save["step"] for save in saves] == [5, 10, 15]
        assert all(save["blocked_s"] > 0 for save in saves)
        summary = read_summary(run)
        assert summary["checkpoint_blocked_s"] > 0 and summary["checkpoint_waits"] >= sum(s["waited"] for s in saves)
    assert read_summary(synchronous)["checkpoint_waits"] == 0  # nothing is ever in flight when the loop writes
    # The loop that writes itself is blocked for each write, so its mean blocked time holds its mean write time.
    summary = read_summary(synchronous)
    assert summary["checkpoint_blocked_s"] >= summary["checkpoint_write_s"]


def test_a_save_that_finds_the_previous_write_still_going_waits_for_it_and_says_so(tmp_path):
    """A checkpoint every step of a model whose write outlasts a step: one write in flight at a time, each save
    waiting for the last (counted in metrics.jsonl and summary.json), and every checkpoint complete."""
    assert_ok(spawn(tmp_path, *HEAVY, "--steps", "6", "--checkpoint-every", "1", "--keep", "6", "--log-every", "1"))
    saves = [save for line in read_metrics(tmp_path) for save in line.get("checkpoints", [])]
    waited = sum(save["waited"] for save in saves)
    summary = read_summary(tmp_path)
    assert waited >= 1 and summary["checkpoint_waits"] >= waited
    assert [p.name for p in checkpoints(tmp_path)] == [f"step-{n}.pt" for n in range(6, 0, -1)]
    assert all(load_checkpoint(path)["step"] == int(path.stem.split("-")[1]) for path in checkpoints(tmp_path))
    assert temporary_files(tmp_path) == []


@pytest.mark.parametrize("checkpoint_format", FORMATS)
def test_a_kill_9_during_a_background_write_leaves_the_previous_checkpoint_to_resume_from(checkpoint_format,
                                                                                          tmp_path):
    """SIGKILL to the whole run (as the OOM killer or a lost node ends it) while a checkpoint's temporary file
    (or, sharded, directory) is being written: the newest complete checkpoint loads, the partial write is never
    taken for one, and the next launch removes it and resumes from that checkpoint."""
    for attempt in range(5):  # a kill that lands just after a write ended caught nothing in flight: again
        run_dir = tmp_path / f"attempt-{attempt}"
        # 12 steps: 6 writes, each outlasting the steps to the next save, so one is seen in flight before the end
        process = spawn(run_dir, *HEAVY, *checkpoint_format, "--steps", "12", "--checkpoint-every", "2", "--keep", "2",
                        wait=False)
        wait_for_a_write_in_flight(process, run_dir, after_step=2)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        if temporary_files(run_dir):
            break
    assert temporary_files(run_dir), "no kill landed while a checkpoint was being written"
    newest = checkpoints(run_dir)[0]
    step = load_checkpoint(newest)["step"]
    resumed = spawn(run_dir, *HEAVY, *checkpoint_format, "--steps", "12", "--checkpoint-every", "2", "--keep", "2",
                    "--resume", "auto")
    assert_ok(resumed)
    assert read_summary(run_dir)["resumed_from_step"] == step
    assert temporary_files(run_dir) == []


@pytest.mark.parametrize("checkpoint_format", FORMATS)
def test_a_stop_signal_during_a_background_write_ends_with_a_complete_stop_checkpoint(checkpoint_format, tmp_path):
    process = spawn(tmp_path, *HEAVY, *checkpoint_format, "--steps", "1000", "--checkpoint-every", "2", "--keep", "3",
                    wait=False)
    wait_for_a_write_in_flight(process, tmp_path, after_step=2)
    os.killpg(process.pid, signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr
    stopped = read_summary(tmp_path)["stopped_at_step"]
    newest = checkpoints(tmp_path)[0]
    assert newest.stem == f"step-{stopped}" and load_checkpoint(newest)["step"] == stopped
    assert temporary_files(tmp_path) == []
