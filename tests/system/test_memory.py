"""Memory: --micro-batch auto across real 2-rank gloo runs, with an out-of-memory error on one rank only and
with real CPU allocator failures under --max-memory; the one-line refusal without auto; resume with another
micro-batch."""

import json

import pytest
import torch
from helpers import assert_ok, last_line, launch, load_weights, read_metrics, read_summary, run_cli

from helper_tasks import OOM_ABOVE

pytestmark = pytest.mark.slow

REGRESSION = ["--device", "cpu", "--amp", "off", "--optimizer", "sgd", "--schedule", "constant", "--seed", "3",
              "--batch-size", "32", "--log-every", "3", "--log-format", "plain"]


spawn = launch


def assert_weights_close(a: dict, b: dict) -> None:
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7)


def test_an_out_of_memory_error_on_one_rank_halves_the_micro_batch_on_every_rank(tmp_path, helper_task):
    """Rank 1 fails in forward above 8 samples while rank 0 goes on into backward: nobody waits forever, both
    halve twice in step 1, and the weights are those of --micro-batch 8 from the start."""
    task = helper_task("oom_above_8_on_rank1")
    result = spawn(tmp_path / "auto", *REGRESSION, "--task", task, "--steps", "6", "--micro-batch", "auto")
    assert_ok(result)
    summary = read_summary(tmp_path / "auto")
    assert summary["micro_batch_size"] == OOM_ABOVE
    assert summary["micro_batch_changes"] == [{"step": 1, "micro_batch_size": 16}, {"step": 1, "micro_batch_size": 8}]
    assert [record["micro_batch_size"] for record in read_metrics(tmp_path / "auto")] == [8, 8]
    assert "micro-batch 8" in result.stdout  # the live view's lines
    assert_ok(spawn(tmp_path / "fixed", *REGRESSION, "--task", task, "--steps", "6", "--micro-batch", "8"))
    assert_weights_close(load_weights(tmp_path / "auto"), load_weights(tmp_path / "fixed"))


ACTIVATIONS = ["--device", "cpu", "--amp", "off", "--batch-size", "4096", "--steps", "2", "--log-every", "1",
               "--max-memory", "1", "--log-format", "plain"]


def test_without_auto_running_out_of_memory_is_one_line_and_exit_1(tmp_path, helper_task):
    """A real CPU allocator failure: under a 1 GB RLIMIT_DATA, 4096 samples of the 64-16384-10 MLP do not fit."""
    result = spawn(tmp_path, *ACTIVATIONS, "--task", helper_task("activation_heavy"))
    assert result.returncode == 1, result.stderr
    verdict = last_line(result.stderr)
    assert verdict.startswith("ddp-amp: error: rank ") and "failed: out of memory in step 1 (" in verdict
    assert verdict.endswith("with a batch of 4096 samples per rank: use --micro-batch auto, or a smaller "
                            "--batch-size"), verdict
    assert "Traceback" not in result.stderr
    logs = "".join(path.read_text() for path in (tmp_path / "logs").glob("rank*.log"))
    assert "can't allocate memory" in logs and "Traceback" in logs  # the allocator's own error stays in the log


def test_a_max_memory_below_what_a_cpu_rank_holds_already_is_a_usage_error(tmp_path):
    """0.0001 GB under what torch alone holds: setting it would fail the rank's next allocation (a thread's
    stack, with a traceback); the rank refuses it instead, naming the flag and what it holds."""
    result = spawn(tmp_path, "--device", "cpu", "--steps", "3", "--max-memory", "0.0001", nproc=1)
    assert result.returncode == 2, result.stderr
    verdict = last_line(result.stderr)
    assert "--max-memory 0.0001: a CPU rank holds " in verdict and verdict.endswith("before training; give more")
    assert "Traceback" not in result.stderr and not (tmp_path / "model.pt").exists()


def test_auto_finds_the_micro_batch_that_fits_under_max_memory(tmp_path, helper_task):
    result = spawn(tmp_path, *ACTIVATIONS, "--task", helper_task("activation_heavy"), "--micro-batch", "auto")
    assert_ok(result)
    summary = read_summary(tmp_path)
    assert summary["micro_batch_size"] == 2048
    assert summary["micro_batch_changes"] == [{"step": 1, "micro_batch_size": 2048}]
    assert summary["steps"] == 2


def test_a_resumed_auto_run_starts_from_the_size_it_settled_on(tmp_path, helper_task):
    """--micro-batch auto settled on 2048 in step 1 and checkpointed there: resumed, it starts at 2048 (no
    batch of 4096 tried and failed again), so neither its first step nor an evaluation it repeats first runs
    at a size known not to fit."""
    task = ["--task", helper_task("activation_heavy"), "--micro-batch", "auto", "--checkpoint-every", "1"]
    assert_ok(spawn(tmp_path / "first", *ACTIVATIONS, *task))
    assert read_summary(tmp_path / "first")["micro_batch_changes"] == [{"step": 1, "micro_batch_size": 2048}]
    resumed = spawn(tmp_path / "second", *ACTIVATIONS, *task, "--resume",
                    str(tmp_path / "first" / "checkpoints" / "step-1.pt"))
    assert_ok(resumed)
    summary = read_summary(tmp_path / "second")
    assert summary["resumed_from_step"] == 1 and summary["steps"] == 2
    assert summary["micro_batch_size"] == 2048 and summary["micro_batch_changes"] == []


def test_resume_with_another_micro_batch_continues_the_same_run(tmp_path, helper_task):
    """A micro-batch size is not part of the mathematics: a run checkpointed under --micro-batch 4 resumes
    under --micro-batch 32 (the whole batch) and ends with the weights of the run it continues."""
    task = ["--task", helper_task("plain_regression"), "--steps", "6", "--checkpoint-every", "3", "--keep", "2"]
    assert_ok(spawn(tmp_path / "first", *REGRESSION, *task, "--micro-batch", "4"))
    checkpoint = tmp_path / "first" / "checkpoints" / "step-3.pt"
    resumed = spawn(tmp_path / "second", *REGRESSION, *task, "--micro-batch", "32", "--resume", str(checkpoint))
    assert_ok(resumed)
    summary = read_summary(tmp_path / "second")
    assert summary["resumed_from_step"] == 3 and summary["micro_batch_size"] == 32
    assert_weights_close(load_weights(tmp_path / "second"), load_weights(tmp_path / "first"))


def test_bench_max_batch_finds_the_largest_batch_under_max_memory(tmp_path, helper_task):
    out = tmp_path / "max-batch.json"
    result = run_cli("bench", "--device", "cpu", "--amp", "off", "--max-batch", "--task",
                     helper_task("activation_heavy"), "--max-memory", "1", "--batch-size", "1024", "--nproc", "2",
                     "--run-dir", str(tmp_path / "runs"), "--json", str(out))
    assert_ok(result)
    report = json.loads(out.read_text())
    fp32 = report["max_batch"]["fp32"]
    trials = {trial["batch"]: trial["fits"] for trial in fp32["trials"]}
    assert trials[1024] and trials[2048] and not trials[4096]  # doubled until it failed
    assert 2048 <= fp32["max_batch"] < 4096 and trials[fp32["max_batch"]]
    failed_above = min(size for size, fits in trials.items() if not fits and size > fp32["max_batch"])
    assert failed_above - fp32["max_batch"] <= fp32["max_batch"] // 16  # bisected
    assert fp32["samples_per_s"] > 0
    assert f"│ fp32      │ {fp32['max_batch']:>22} │" in result.stdout


def test_bench_max_batch_under_shard_full_searches_with_one_launch_per_size(tmp_path, helper_task):
    """A sharded pass holds collectives, so a size that does not fit ends its launch: one launch per size, the
    same doubling and bisecting, a failed size told apart by the out-of-memory record its rank left (the
    failing ranks' tracebacks are not shown: not fitting is the answer, not an error)."""
    out = tmp_path / "max-batch.json"
    result = run_cli("bench", "--device", "cpu", "--amp", "off", "--max-batch", "--shard", "full", "--task",
                     helper_task("activation_heavy"), "--max-memory", "1", "--batch-size", "1024", "--nproc", "2",
                     "--run-dir", str(tmp_path / "runs"), "--json", str(out), timeout=600)
    assert_ok(result)
    assert "Traceback" not in result.stderr
    report = json.loads(out.read_text())
    fp32 = report["max_batch"]["fp32"]
    trials = {trial["batch"]: trial["fits"] for trial in fp32["trials"]}
    assert trials[1024] and trials[2048] and not trials[4096]
    assert 2048 <= fp32["max_batch"] < 4096 and trials[fp32["max_batch"]]
    failed_above = min(size for size, fits in trials.items() if not fits and size > fp32["max_batch"])
    assert failed_above - fp32["max_batch"] <= fp32["max_batch"] // 16
    assert report["method"]["launch_per_trial"] is True
    launches = tmp_path / "runs" / "max-batch-off"
    assert sorted(int(p.name.split("-")[1]) for p in launches.glob("batch-*")) == sorted(trials)
    for size, fits in trials.items():
        assert bool(list((launches / f"batch-{size}").glob("out_of_memory-rank*.json"))) != fits, size


def test_an_out_of_memory_error_at_a_settled_size_is_one_line(tmp_path, helper_task):
    """Once a size has trained a whole step, auto's steps are DDP's own, with no agreement: an out-of-memory
    error on one rank later ends the run with one line (the other rank, waiting in the all-reduce, is
    stopped by the launcher), saying what changed."""
    result = spawn(tmp_path, *REGRESSION, "--task", helper_task("oom_on_rank1_at_call_3"), "--steps", "6",
                   "--micro-batch", "auto")
    assert result.returncode == 1, result.stderr
    assert last_line(result.stderr) == (
        "ddp-amp: error: rank 1 failed: out of memory in step 3 (forward) with a micro-batch of 32 samples "
        "(--batch-size 32): the memory a step needs grew after --micro-batch auto settled on 32 (shapes that "
        "vary?); use --micro-batch 16 or a smaller --batch-size")


def test_a_backends_own_allocation_failure_halves_as_the_allocators_does(tmp_path, helper_task):
    """oneDNN's "could not create a primitive" above 8 samples: --micro-batch auto halves to 8, the weights those
    of --micro-batch 8; without auto it is the one-line out-of-memory message, naming the backend's words."""
    task = [helper_task("onednn_failure_above"), "--task-arg", "limit=8"]
    assert_ok(spawn(tmp_path / "auto", *REGRESSION, "--task", *task, "--steps", "6", "--micro-batch", "auto"))
    assert read_summary(tmp_path / "auto")["micro_batch_size"] == 8
    assert_ok(spawn(tmp_path / "fixed", *REGRESSION, "--task", *task, "--steps", "6", "--micro-batch", "8"))
    assert_weights_close(load_weights(tmp_path / "auto"), load_weights(tmp_path / "fixed"))
    plain = spawn(tmp_path / "plain", *REGRESSION, "--task", *task, "--steps", "2")
    assert plain.returncode == 1
    verdict = last_line(plain.stderr)
    assert "failed: out of memory in step 1" in verdict and "could not create a primitive" in verdict, verdict


def test_a_look_alike_that_halving_never_answers_is_reported_as_it_is(tmp_path, helper_task):
    """The same message at every size (a oneDNN failure that is not memory): halved down to 1 sample, then the
    original error, not "the model does not fit"."""
    result = spawn(tmp_path, *REGRESSION, "--task", helper_task("onednn_failure_above"), "--task-arg", "limit=0",
                   "--steps", "2", "--micro-batch", "auto")
    assert result.returncode == 1
    verdict = last_line(result.stderr)
    assert verdict.endswith("failed: RuntimeError: could not create a primitive"), verdict
