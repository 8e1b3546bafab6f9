"""Checkpoints outside the one-writer, same-world-size case: --overwrite over a longer run, a resume on another
world size (every sample once, the schedule's end kept), and a run that diverges."""

import functools
from collections import Counter

import pytest
from helpers import HELPER_TASKS, assert_ok, ddp_amps_run_dir, last_line, read_metrics, read_summary, run_cli

from helper_tasks import INDEXED_SAMPLES

pytestmark = pytest.mark.slow


own_session_cli = functools.partial(run_cli, timeout=300, own_session=True)
"""A launch in a session of its own (a helper task may signal its whole process group)."""


def checkpoint_names(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt"))


def test_overwrite_starts_clean_and_the_advice_after_a_stop_works(tmp_path):
    run_dir, indices = tmp_path / "run", tmp_path / "indices"
    indices.mkdir()
    task = ["--device", "cpu", "--task", f"{HELPER_TASKS}:records_indices", "--checkpoint-every", "10",
            "--keep", "2", "--log-every", "5", "--run-dir", str(run_dir)]
    env = {"DDP_AMP_TEST_INDEX_LOG": str(indices), "DDP_AMP_TEST_STEP_SLEEP": "0.05"}
    assert_ok(own_session_cli("spawn", "-n", "2", *task, "--steps", "60", env=env))
    assert checkpoint_names(run_dir) == ["step-50.pt", "step-60.pt"]
    # A shorter run over it, stopped by SIGTERM to its process group in its 15th step.
    stopped = own_session_cli("spawn", "-n", "2", *task, "--steps", "40", "--overwrite",
                     env={**env, "DDP_AMP_TEST_STOP_AT": "15"})
    assert stopped.returncode == 143, stopped.stderr
    step = read_summary(run_dir)["stopped_at_step"]
    assert 15 <= step < 40
    # The stop lands within a poll or two of the stop agreement, so maybe after step 20's checkpoint: the two
    # newest of this run's own (every 10th step and the stop step), none of the longer run's.
    own = sorted({*range(10, step + 1, 10), step})[-2:]
    assert checkpoint_names(run_dir) == [f"step-{n}.pt" for n in own]
    assert not (run_dir / "model.pt").exists()
    advice = last_line(stopped.stderr).split("(continue with ", 1)[1].rstrip(")").split()
    assert advice == ["--resume", "auto", "--run-dir", str(run_dir)]
    resumed = own_session_cli("spawn", "-n", "2", *task[:-2], "--steps", "40", *advice, env=env)  # the advice, pasted
    assert_ok(resumed)
    summary = read_summary(run_dir)
    assert summary["resumed_from_step"] == step and summary["steps"] == 40
    # Only this run's lines, each step once: the longer run's are gone, the stopped attempt's cut back.
    assert [record["step"] for record in read_metrics(run_dir)] == list(range(5, 41, 5))


@pytest.mark.parametrize("schedule", ["cosine", "onecycle"])
def test_a_resume_on_another_world_size_trains_every_sample_once_and_keeps_the_schedules_end(tmp_path, schedule):
    epochs = 3
    # --amp off: the model logs every forward, and --amp auto's probe runs one (of the first samples, apart from
    # training) to see the layers' shapes.
    common = ["--device", "cpu", "--task", f"{HELPER_TASKS}:records_indices", "--epochs", str(epochs),
              "--batch-size", "8", "--schedule", schedule, "--warmup-steps", "2", "--log-every", "1", "--amp", "off"]
    logs = {name: tmp_path / f"indices-{name}" for name in ("resized", "reference")}
    for log in logs.values():
        log.mkdir()
    run, reference = tmp_path / "run", tmp_path / "reference"
    env = {"DDP_AMP_TEST_INDEX_LOG": str(logs["resized"]), "DDP_AMP_TEST_STEP_SLEEP": "0.05"}
    # Two ranks, stopped in their 8th step (epoch 1 of 0..2: 6 steps an epoch), then continued by three (what is
    # left of the epoch, a multiple of 16 samples, may not divide by three: nothing is padded all the same).
    stopped = own_session_cli("spawn", "-n", "2", *common, "--run-dir", str(run),
                              env={**env, "DDP_AMP_TEST_STOP_AT": "8"})
    assert stopped.returncode == 143, stopped.stderr
    resumed = own_session_cli("spawn", "-n", "3", *common, "--resume", "auto", "--run-dir", str(run), env=env)
    assert_ok(resumed)
    assert "written by 2 ranks, continued by 3: the global batch goes from 16 to 24 samples" in resumed.stderr
    assert_ok(own_session_cli("spawn", "-n", "3", *common, "--run-dir", str(reference),
                     env={"DDP_AMP_TEST_INDEX_LOG": str(logs["reference"])}))
    seen = Counter(int(line) for path in logs["resized"].iterdir() for line in path.read_text().split())
    assert seen == {index: epochs for index in range(INDEXED_SAMPLES)}, "a sample was skipped or repeated"
    summary, unresized = read_summary(run), read_summary(reference)
    assert summary["world_size"] == 3 and summary["resumed_from_step"] > 0
    assert summary["final_lr"] == pytest.approx(unresized["final_lr"], rel=1e-9)
    assert summary["steps"] == unresized["steps"]  # it ran to the end of the last epoch, as the reference


def test_a_diverging_run_keeps_its_last_finite_checkpoint_and_skips_the_nan_one(tmp_path):
    args = ["--device", "cpu", "--task", f"{HELPER_TASKS}:nan_from_step_12", "--steps", "40", "--checkpoint-every",
            "5", "--keep", "2", "--max-nonfinite", "4", "--log-every", "1", "--run-dir", str(tmp_path)]
    result = run_cli("spawn", "-n", "2", *args)
    assert result.returncode == 1
    newest_finite = tmp_path / "checkpoints" / "step-10.pt"
    assert checkpoint_names(tmp_path) == ["step-10.pt", "step-5.pt"]  # step-15 held NaN: not written
    assert last_line(result.stderr).endswith(f"the newest finite checkpoint is {newest_finite} "
                                             f"(--resume {newest_finite})"), result.stderr
    assert read_summary(tmp_path)["nonfinite_checkpoints_skipped"] == [15]
    # A resume from a NaN checkpoint planted beside them: tests/unit/test_launch_refusals.py.


def test_overwrite_removes_every_file_and_folder_an_earlier_run_left(tmp_path):
    """Its checkpoints above all (a longer run's higher steps would outrank this run's), and its TensorBoard
    events, profiler traces, best weights and pretrained copy: nothing of it may pass for this run's."""
    from ddp_amp.launch.run_dir import prepare_run_dir

    earlier = {"model.pt": b"w", "metrics.jsonl": b"{}\\n", "summary.json": b"{}", "model_best.pt": b"b",
               "step_times.json": b"[]", "checkpoints/step-90.pt": b"c", "checkpoints/step-90.json": b"{}",
               "tensorboard/events.out": b"e", "profile/rank0.json.gz": b"p", "pretrained/config.json": b"{}"}
    ddp_amps_run_dir(tmp_path, earlier)
    earlier["config.json"] = (tmp_path / "config.json").read_bytes()
    prepared = prepare_run_dir(tmp_path, overwrite=True)
    prepared.lock.release()
    aside = prepared.set_aside
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                  if not p.name.startswith(".") and aside not in p.parents)
    assert left == [], left
    # Set aside until the new run has trained (then deleted), or put back after a launch that failed before.
    from ddp_amp.launch.run_dir import settle_earlier_run

    assert settle_earlier_run(tmp_path, aside, trained=False)
    assert {name: (tmp_path / name).read_bytes() for name in earlier} == earlier
    again = prepare_run_dir(tmp_path, overwrite=True)
    again.lock.release()
    assert not settle_earlier_run(tmp_path, again.set_aside, trained=True)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock") == [], list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_refusal_from_the_ranks_under_overwrite_leaves_the_earlier_run_as_it_was(tmp_path):
    """The ranks refuse a task whose model is on the meta device (found only when they build it; the launcher
    refuses an empty data set itself, before anything is touched): the launch fails, and the earlier run
    --overwrite was to replace is back, byte for byte, the new attempt's files set aside in .failed-launch."""
    run_dir = tmp_path / "run"
    assert_ok(run_cli("spawn", "-n", "2", "--device", "cpu", "--task", "linear", "--steps", "4", "--checkpoint-every",
                      "2", "--run-dir", str(run_dir)))
    earlier = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*")
               if p.is_file() and "logs" not in p.parts and p.name != ".lock"}
    assert {"model.pt", "metrics.jsonl", "summary.json", "config.json", "checkpoints/step-4.pt"} <= earlier.keys()
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--task", f"{HELPER_TASKS}:model_on_meta", "--steps",
                     "4", "--overwrite", "--run-dir", str(run_dir))
    assert result.returncode == 2 and "meta device" in last_line(result.stderr), result.stderr
    assert "the earlier run's files in" in result.stderr and "are back as they were" in result.stderr
    now = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*")
           if p.is_file() and "logs" not in p.parts and p.name != ".lock" and ".failed-launch" not in p.parts}
    assert now == earlier
    assert (run_dir / ".failed-launch" / "config.json").read_bytes() != earlier["config.json"]  # the new attempt's


@pytest.mark.slow
def test_the_time_a_checkpoint_blocks_training_is_in_the_summary(tmp_path):
    """Each save blocks the loop only while the state is gathered and copied to host memory (and while the
    previous write, if still going, finishes: at most one is in flight); the write runs in the background."""
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--task", "mlp-wide", "--amp", "off", "--steps", "20",
                     "--checkpoint-every", "5", "--run-dir", str(tmp_path / "saved"))
    assert result.returncode == 0, result.stderr
    summary = read_summary(tmp_path / "saved")
    assert 0 < summary["checkpoint_blocked_s"] <= summary["checkpoint_blocked_max_s"]
    assert summary["checkpoint_write_s"] > 0
    assert 0 <= summary["checkpoint_waits"] <= 3  # 4 saves: the first never waits
    result = run_cli("spawn", "-n", "1", "--device", "cpu", "--steps", "5", "--run-dir", str(tmp_path / "none"))
    assert result.returncode == 0, result.stderr
    assert "checkpoint_blocked_s" not in read_summary(tmp_path / "none")
