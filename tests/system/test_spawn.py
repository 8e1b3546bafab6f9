"""Real multi-process runs through `ddp-amp spawn` on CPU: 2-rank gloo groups, real files."""

import functools
import json
import subprocess
import sys

import pytest
import torch
from helpers import (
    CHECKS_SCRIPT,
    SGD_FP32,
    assert_ok,
    assert_weights_close,
    last_line,
    launch,
    launch_script,
    load_weights,
    read_metrics,
    read_summary,
    run_cli,
)

from ddp_amp.train.schedule import closed_form_lr

from helper_tasks import DRAWS_DIR_VAR, EVALUATION_BYTES, RECORDED_DRAWS

pytestmark = pytest.mark.slow

spawn = functools.partial(launch, check=True)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two_rank")
    result = spawn(run_dir, *SGD_FP32, "--batch-size", "16")
    return run_dir, result


def test_run_dir_contract(two_rank_run):
    run_dir, result = two_rank_run
    summary = read_summary(run_dir)
    for key in ("world_size", "steps", "final_loss", "samples_per_s", "precision", "device", "backend", "wall_s",
                "time_to_first_step_s", "skipped_steps"):
        assert key in summary, key
    assert summary["world_size"] == 2
    assert summary["steps"] == 20
    assert summary["precision"] == "fp32" and summary["device"] == "cpu" and summary["backend"] == "gloo"
    assert summary["samples_per_s"] > 0 and 0 < summary["time_to_first_step_s"] < summary["wall_s"]
    assert summary["samples_per_s"] == pytest.approx(2 * summary["rank_samples_per_s"])  # global, not one rank's
    weights = load_weights(run_dir)  # weights_only=True
    assert weights and not any(key.startswith("module.") for key in weights)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [5, 10, 15, 20]
    assert all({"loss", "lr", "samples_per_s"} <= m.keys() for m in metrics)
    assert summary["final_loss"] == metrics[-1]["loss"]
    assert "[rank 0] step 20/20" in result.stdout and "[rank 1] step 20/20" in result.stdout
    assert not list(run_dir.glob("*.tmp"))


def test_two_ranks_equal_one_rank_with_double_batch(two_rank_run, tmp_path):
    run_dir, _ = two_rank_run
    spawn(tmp_path, *SGD_FP32, "--batch-size", "32", nproc=1)
    assert read_summary(tmp_path)["world_size"] == 1
    assert_weights_close(load_weights(run_dir), load_weights(tmp_path), rtol=1e-5)


def test_grad_accumulation_equals_the_bigger_batch(two_rank_run, tmp_path):
    run_dir, _ = two_rank_run
    spawn(tmp_path, *SGD_FP32, "--batch-size", "8", "--grad-accum", "2")
    assert read_summary(tmp_path)["global_batch_size"] == 32
    assert_weights_close(load_weights(run_dir), load_weights(tmp_path), rtol=1e-5)


def test_fp16_gradient_compression_rounds_the_all_reduce_and_still_trains_the_same(two_rank_run, tmp_path):
    """The hook is in the all-reduce: the weights are no longer bit-identical to the uncompressed run (the
    gradients crossed as fp16), yet within fp16's rounding of it."""
    run_dir, _ = two_rank_run
    spawn(tmp_path, *SGD_FP32, "--batch-size", "16", "--grad-compression", "fp16")
    assert read_summary(tmp_path)["ddp"]["grad_compression"] == "fp16"
    plain, compressed = load_weights(run_dir), load_weights(tmp_path)
    assert not all(torch.equal(plain[k], compressed[k]) for k in plain)
    assert_weights_close(compressed, plain, rtol=1e-2)


def test_same_seed_same_weights(two_rank_run, tmp_path):
    run_dir, _ = two_rank_run
    spawn(tmp_path, *SGD_FP32, "--batch-size", "16")
    first, second = load_weights(run_dir), load_weights(tmp_path)
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_linear_converges_to_its_noise_floor_and_lr_follows_the_schedule(tmp_path):
    spawn(tmp_path, "--device", "cpu", "--task", "linear", "--steps", "400", "--lr", "0.02", "--warmup-steps", "10",
          "--schedule", "cosine", "--log-every", "1")
    summary = read_summary(tmp_path)
    floor = summary["eval"]["noise_floor"]
    assert summary["final_loss"] < 2 * floor
    assert summary["eval"]["loss"] < 2 * floor
    lrs = [m["lr"] for m in read_metrics(tmp_path)]
    expected = [closed_form_lr(i, lr=0.02, schedule="cosine", total_steps=400, warmup_steps=10, min_lr_ratio=0.1)
                for i in range(400)]
    assert lrs == pytest.approx(expected, rel=1e-9)


def test_mlp_reaches_90_percent_accuracy(tmp_path):
    spawn(tmp_path, "--device", "cpu", "--task", "mlp", "--steps", "150")
    assert read_summary(tmp_path)["eval"]["accuracy"] >= 0.9


def test_fp16_skipped_step_is_counted_and_holds_the_lr(tmp_path, helper_task):
    spawn(tmp_path, "--device", "cpu", "--dtype", "fp16", "--task", helper_task("inf_at_third_step"),
          "--steps", "8", "--log-every", "1", "--batch-size", "16")
    summary = read_summary(tmp_path)
    assert summary["precision"] == "fp16"
    assert summary["skipped_steps"] == 1
    metrics = read_metrics(tmp_path)
    assert [m["skipped_steps"] for m in metrics][:4] == [0, 0, 1, 1]
    assert metrics[2]["lr"] == metrics[3]["lr"]
    assert "loss_scale" in metrics[0]


def test_failing_rank_stops_the_job_and_is_named(tmp_path, helper_task):
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--task", helper_task("fail_on_rank1"), "--steps",
                     "50", "--run-dir", str(tmp_path), timeout=120)
    assert result.returncode == 1
    verdict = last_line(result.stderr)
    assert verdict == "ddp-amp: error: rank 1 failed: ValueError: injected failure at step 5"
    output = result.stdout + result.stderr
    # The traceback once, under its rank (its last line), then the one-line summary.
    assert "[rank 1] failed:" in result.stdout
    assert output.count("ValueError: injected failure at step 5") == 2
    assert output.count("Traceback") == 1
    assert not (tmp_path / "model.pt").exists()


def test_two_jobs_started_together_do_not_collide(tmp_path):
    args = ["--device", "cpu", "--steps", "10", "--task", "linear"]
    commands = [[sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", *args, "--run-dir", str(tmp_path / name)]
                for name in ("a", "b")]
    jobs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in commands]
    outputs = [job.communicate(timeout=180) for job in jobs]
    for job, (_, err) in zip(jobs, outputs):
        assert job.returncode == 0, err
    assert read_summary(tmp_path / "a")["world_size"] == read_summary(tmp_path / "b")["world_size"] == 2


def test_the_readme_example_task_trains(tmp_path):
    spawn(tmp_path, "--device", "cpu", "--task", "examples/my_task.py:build", "--steps", "60")
    assert read_summary(tmp_path)["eval"]["accuracy"] >= 0.9


def test_a_failing_evaluation_keeps_the_weights_and_exits_1(tmp_path, helper_task):
    task = helper_task("eval_fails")
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--task", task, "--steps", "6", "--run-dir",
                     str(tmp_path))
    assert result.returncode == 1, result.stderr
    verdict = last_line(result.stderr)
    assert verdict.startswith(f"ddp-amp: error: task {task}: evaluate failed: RuntimeError: evaluation exploded")
    assert "Traceback" not in result.stdout + result.stderr
    assert load_weights(tmp_path)  # saved before the evaluation ran
    summary = read_summary(tmp_path)
    assert "eval" not in summary and "evaluation exploded" in summary["eval_error"]
    assert summary["steps"] == 6
    assert "RuntimeError: evaluation exploded" in (tmp_path / "logs" / "rank0.log").read_text()


def test_evaluate_is_handed_the_models_device(tmp_path, helper_task):
    spawn(tmp_path, "--device", "cpu", "--task", helper_task("eval_reports_device"), "--steps", "4", nproc=1)
    assert read_summary(tmp_path)["eval"] == {"on_model_device": 1.0, "training_mode": 0.0}


def test_peak_memory_is_the_trainings_not_the_evaluations(tmp_path, helper_task):
    """Rank 0's evaluation touches 2 GiB after training: the figure reported is read before it."""
    spawn(tmp_path, "--device", "cpu", "--task", helper_task("memory_hungry_evaluation"), "--steps", "4", nproc=1)
    summary = read_summary(tmp_path)
    assert summary["eval"]["block_sum"] > 0  # the evaluation ran
    assert 0 < summary["peak_memory_mb"] < EVALUATION_BYTES / 2**20 / 2


def test_loader_workers_train_the_same_weights(two_rank_run, tmp_path):
    run_dir, _ = two_rank_run
    spawn(tmp_path, *SGD_FP32, "--batch-size", "16", "--num-workers", "2")
    assert read_summary(tmp_path)["loader_workers"] == 2
    assert read_summary(run_dir)["loader_workers"] == 0  # the CPU default
    first, second = load_weights(run_dir), load_weights(tmp_path)
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_a_data_set_class_of_a_task_file_reaches_the_loader_workers(tmp_path, helper_task):
    """The task file is loaded from its path, under a name of its own that no fresh process can import: the
    workers are forked from the rank (they came from the fork server, could not unpickle the data set, and every
    run with workers of a task file failed: "DataLoader worker exited unexpectedly"). 64 samples, batches of
    16: the persistent workers serve three epochs."""
    spawn(tmp_path, "--device", "cpu", "--amp", "off", "--task", helper_task("structured_batches"), "--steps", "10",
          "--batch-size", "16", "--num-workers", "2", nproc=1)
    summary = read_summary(tmp_path)
    assert summary["loader_workers"] == 2 and summary["steps"] == 10


def test_ranks_draw_different_random_numbers_reproducibly(tmp_path, helper_task):
    draws = []
    for attempt in ("first", "second"):
        draws_dir = tmp_path / f"draws-{attempt}"
        draws_dir.mkdir()
        result = run_cli("spawn", "-n", "2", "--device", "cpu", "--task", helper_task("draws_in_forward"),
                         "--steps", "4", "--run-dir", str(tmp_path / attempt), env={DRAWS_DIR_VAR: str(draws_dir)})
        assert_ok(result)
        draws.append([(draws_dir / f"rank{rank}.txt").read_text().split() for rank in (0, 1)])
    (first_rank0, first_rank1), (second_rank0, second_rank1) = draws
    assert len(first_rank0) == RECORDED_DRAWS
    assert first_rank0 != first_rank1, "both ranks drew the same random numbers"
    assert (first_rank0, first_rank1) == (second_rank0, second_rank1), "the same seed drew other numbers"
    weights = [load_weights(tmp_path / attempt) for attempt in ("first", "second")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def strict_json(path):
    def refuse(token):
        raise AssertionError(f"{path.name} holds a bare {token} token, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_a_loss_that_stays_nan_stops_the_run_naming_step_and_rank(tmp_path, helper_task):
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--amp", "off", "--task", helper_task("nan_on_rank1"),
                     "--steps", "200", "--log-every", "10", "--max-nonfinite", "5", "--run-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr
    # Rank 1's loss is NaN from step 4: five in a row at step 8. Rank 0 follows a step later (NaN weights).
    verdict = last_line(result.stderr)
    assert verdict.startswith("ddp-amp: error: training diverged at step 8 on rank 1: the loss was inf/NaN "
                                "for 5 consecutive steps"), result.stderr
    assert not (tmp_path / "model.pt").exists()
    summary = strict_json(tmp_path / "summary.json")
    assert summary["diverged"]["step"] == 8 and summary["diverged"]["rank"] == 1
    assert summary["steps"] == 10  # stopped at the first log interval after it: no per-step host sync
    assert summary["final_loss"] is None and "final_loss" in summary["nonfinite"]
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda token: pytest.fail(f"metrics.jsonl holds {token}"))


def test_a_collapsed_fp16_loss_scale_stops_the_run(tmp_path, helper_task):
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--dtype", "fp16", "--task", helper_task("always_inf"),
                     "--steps", "200", "--max-nonfinite", "6", "--run-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr
    verdict = last_line(result.stderr)
    assert verdict.startswith("ddp-amp: error: training diverged at step 6: the fp16 loss scale collapsed"), \
        result.stderr
    summary = strict_json(tmp_path / "summary.json")
    assert summary["skipped_steps"] == 6 and summary["steps"] == 6
    assert not (tmp_path / "model.pt").exists()


def test_tensorboard_scalars_match_the_metrics_file(tmp_path):
    """Read back with tensorboard's own reader: every logged interval, the same values as metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spawn(tmp_path, "--device", "cpu", "--steps", "12", "--log-every", "4", "--dtype", "fp16", "--amp", "on",
          "--tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    metrics = read_metrics(tmp_path)
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("amp/loss_scale", "loss_scale"), ("throughput/samples_per_s", "samples_per_s")):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [4, 8, 12], tag
        assert [s.value for s in scalars] == pytest.approx([m[key] for m in metrics], rel=1e-6), tag


def test_a_run_dirs_config_toml_repeats_the_run(two_rank_run, tmp_path):
    """RUN_DIR/config.toml holds the launch's resolved options; fed back with --config (to a new run dir) it
    trains the same weights."""
    import tomllib

    run_dir, _ = two_rank_run
    kept = tomllib.loads((run_dir / "config.toml").read_text())
    assert kept["seed"] == 3 and kept["batch_size"] == 16 and kept["optimizer"] == "sgd"
    assert kept["nproc_per_node"] == "2"
    again = tmp_path / "again"
    assert_ok(run_cli("spawn", "--config", str(run_dir / "config.toml"), "--run-dir", str(again)))
    first, second = load_weights(run_dir), load_weights(again)
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_a_config_toml_records_no_overwrite_or_resume_so_config_of_it_clears_and_continues_nothing(tmp_path):
    """A run launched with --overwrite, another with --resume auto: neither config.toml records the action, so
    --config of the first (which names its own run dir) is refused over that run, and --config of the second
    over another's finished run (the first's); both left byte for byte (before: the first held overwrite = true,
    and the launch set its own run aside and trained over it)."""
    import tomllib

    overwritten, resumed = tmp_path / "overwritten", tmp_path / "resumed"
    for run_dir, flags in ((overwritten, ()), (overwritten, ("--overwrite",)), (resumed, ("--resume", "auto"))):
        spawn(run_dir, "--device", "cpu", "--steps", "2", *flags)
    for run_dir in (overwritten, resumed):
        kept = tomllib.loads((run_dir / "config.toml").read_text())
        assert "overwrite" not in kept and "resume" not in kept and kept["run_dir"] == str(run_dir)
    before = {path: path.read_bytes() for path in (overwritten / "model.pt", resumed / "model.pt")}
    for config, target in ((overwritten, ()), (resumed, ("--run-dir", str(overwritten)))):
        refused = run_cli("spawn", "--config", str(config / "config.toml"), *target)
        assert refused.returncode == 2 and "already holds a finished run" in refused.stderr, refused.stderr
    assert all(path.read_bytes() == data for path, data in before.items())


def test_profile_records_exactly_its_window_on_every_rank(tmp_path):
    import gzip

    result = spawn(tmp_path, "--device", "cpu", "--steps", "12", "--profile", "5:8", "--log-format", "plain")
    profile = read_summary(tmp_path)["profile"]
    assert profile["steps"] == [5, 8] and profile["excluded_from_throughput"] and profile["window_s"] > 0
    calls = {row["name"]: row["calls"] for row in profile["top_ops"]}
    assert calls.get("Optimizer.step#AdamW.step") == 4, calls  # steps 5, 6, 7 and 8: no more, no less
    for rank in (0, 1):
        trace = json.loads(gzip.decompress((tmp_path / "profile" / f"rank{rank}.json.gz").read_bytes()))
        assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    assert "profile of steps 5-8, rank 0" in result.stdout + result.stderr


def test_profile_of_a_resumed_run_records_the_part_of_its_window_it_runs(tmp_path):
    """Resumed at step 6 with --profile 3:8: steps 7 and 8 are profiled and said to be; resumed past the window
    (--profile 3:5), nothing is, and nothing claims a profile (before: "profile of steps 3-8", an empty table and
    no trace)."""
    import shutil

    spawn(tmp_path / "run", "--device", "cpu", "--steps", "12", "--checkpoint-every", "6", "--keep", "2")
    for window, profiled in (("3:8", [7, 8]), ("3:5", None)):
        run_dir = tmp_path / window.replace(":", "-")
        shutil.copytree(tmp_path / "run" / "checkpoints", run_dir / "checkpoints")
        result = spawn(run_dir, "--device", "cpu", "--steps", "12", "--checkpoint-every", "6", "--keep", "2",
                       "--resume", str(run_dir / "checkpoints" / "step-6.pt"), "--profile", window,
                       "--log-format", "plain")
        profile = read_summary(run_dir).get("profile")
        if profiled is None:
            assert profile is None and not (run_dir / "profile").exists()
            assert "profile of steps" not in result.stdout + result.stderr
            continue
        assert profile["steps"] == profiled and profile["window_s"] > 0
        calls = {row["name"]: row["calls"] for row in profile["top_ops"]}
        assert calls.get("Optimizer.step#AdamW.step") == 2, calls
        assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["rank0.json.gz", "rank1.json.gz"]
        assert "profile of steps 7-8, rank 0" in result.stdout + result.stderr


def test_compile_trains_the_same_weights_and_reports_the_compile_time(two_rank_run, tmp_path):
    run_dir, _ = two_rank_run
    spawn(tmp_path, *SGD_FP32, "--batch-size", "16", "--compile")
    summary = read_summary(tmp_path)
    assert summary["compile_s"] > 0 and summary["compiled_frames"] >= 1
    compiled, eager = load_weights(tmp_path), load_weights(run_dir)
    assert compiled.keys() == eager.keys()  # the module's own names, not the compiled wrapper's
    assert_weights_close(compiled, eager, rtol=1e-4)


def test_the_logged_loss_is_the_mean_over_ranks(tmp_path, helper_task):
    """Rank r's loss is r: the loss metrics.jsonl records for 2 ranks is 0.5 (one rank's would be 0 or 1)."""
    assert_ok(run_cli("spawn", "-n", "2", "--device", "cpu", "--task", helper_task("loss_is_the_rank"), "--steps", "3",
                      "--log-every", "1", "--run-dir", str(tmp_path)))
    assert [m["loss"] for m in read_metrics(tmp_path)] == [0.5, 0.5, 0.5]


def test_a_loss_that_stays_nan_stops_the_run_by_default(tmp_path, helper_task):
    """No --max-nonfinite: the default (20) still stops a run whose loss stays NaN."""
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--amp", "off", "--task", helper_task("nan_on_rank1"),
                     "--steps", "200", "--log-every", "10", "--run-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert last_line(result.stderr).startswith("ddp-amp: error: training diverged at step 23 on rank 1: the loss "
                                               "was inf/NaN for 20 consecutive steps"), result.stderr


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_a_tmpdir_too_long_for_a_unix_socket_still_launches(command, tmp_path):
    """The fork server's socket lives under TMPDIR: one whose path passes the 107 bytes of a Unix socket's
    address made every launch fail with multiprocessing's 'AF_UNIX path too long' traceback."""
    long_tmp = tmp_path / ("t" * (110 - len(str(tmp_path))))
    long_tmp.mkdir()
    assert len(str(long_tmp)) > 107
    result = launch_script(tmp_path / "run", CHECKS_SCRIPT, "--steps", "2", command=command,
                           env={"TMPDIR": str(long_tmp)})
    assert result.returncode == 0, result.stderr
    assert read_summary(tmp_path / "run")["outcome"] == "finished"
