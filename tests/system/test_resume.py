"""Checkpoints and resume with real processes and real signals: the resumed run's weights equal, bit for bit,
those of a run that was never interrupted."""

import subprocess
import time

import pytest
import torch
from helpers import HELPER_TASKS, assert_ok, last_line, load_weights, read_metrics, read_summary, run_cli, start_launch

pytestmark = pytest.mark.slow

TASK = f"{HELPER_TASKS}:resumable"
STEPS = 40
# 512 samples / (16 per rank x 2 ranks): 16 steps an epoch, so a checkpoint at 20 or 30 is mid-epoch.
ARGS = ["--device", "cpu", "--task", TASK, "--steps", str(STEPS), "--batch-size", "16", "--seed", "5",
        "--log-every", "1", "--checkpoint-every", "10", "--lr", "0.01"]
PRECISIONS = {"fp32": ["--amp", "off"], "bf16": ["--dtype", "bf16"], "fp16": ["--dtype", "fp16"]}
SLOW = {"DDP_AMP_TEST_STEP_SLEEP": "0.05"}  # slow enough to be caught between two checkpoints


def env_for(precision: str, **extra: str) -> dict:
    env = dict(extra)
    if precision == "fp16":
        env["DDP_AMP_TEST_BIG_SAMPLE"] = "1"  # GradScaler skips recur, so its state must be restored exactly
    return env


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference runs, one per precision, never interrupted."""
    runs = {}
    for precision, flags in PRECISIONS.items():
        run_dir = tmp_path_factory.mktemp(f"reference-{precision}")
        assert_ok(run_cli("spawn", "-n", "2", *ARGS, *flags, "--run-dir", str(run_dir), env=env_for(precision)))
        runs[precision] = run_dir
    return runs


def assert_bit_identical(a, b) -> None:
    first, second = load_weights(a), load_weights(b)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), f"{key} differs"


def start(command: str, run_dir, precision: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """A 2-rank launch of this file's run in `precision`, not waited for (the test signals it)."""
    return start_launch(run_dir, *ARGS, *PRECISIONS[precision], *extra, command=command,
                        env={**env_for(precision, **SLOW), **(env or {})}, stdout=subprocess.DEVNULL)

def wait_for(path, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_resume_after_the_launcher_is_killed_is_bit_identical(precision, tmp_path, uninterrupted):
    process = start("spawn", tmp_path, precision)
    wait_for(tmp_path / "checkpoints" / "step-20.pt", process)
    process.kill()  # SIGKILL: no clean-up at all
    process.wait()
    assert not (tmp_path / "model.pt").exists()
    result = run_cli("spawn", "-n", "2", *ARGS, *PRECISIONS[precision], "--resume", "auto",
                     "--run-dir", str(tmp_path), env=env_for(precision))
    assert_ok(result)
    summary = read_summary(tmp_path)
    assert summary["resumed_from_step"] in (20, 30)
    assert_bit_identical(tmp_path, uninterrupted[precision])
    if precision == "fp16":
        reference = read_summary(uninterrupted["fp16"])
        assert summary["skipped_steps"] == reference["skipped_steps"] > 0
        assert summary["loss_scale"] == reference["loss_scale"]
    # metrics.jsonl was cut back to the checkpoint and continued: every step once, in order.
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, STEPS + 1))
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == ["step-30.pt", "step-40.pt"]


@pytest.mark.parametrize(("command", "precision"), [("spawn", "fp16"), ("run", "fp32")])
def test_sigterm_stops_at_one_step_checkpoints_and_resumes(command, precision, tmp_path, uninterrupted):
    process = start(command, tmp_path, precision)
    wait_for(tmp_path / "checkpoints" / "step-10.pt", process)
    process.terminate()
    _, stderr = process.communicate(timeout=90)
    assert process.returncode == 143, stderr
    verdict = last_line(stderr)
    assert verdict.startswith("ddp-amp: error: stopped by SIGTERM at step "), stderr
    stopped = read_summary(tmp_path)
    stopped_at = stopped["stopped_at_step"]
    checkpoint = tmp_path / "checkpoints" / f"step-{stopped_at}.pt"
    assert f"checkpoint {checkpoint}" in verdict and checkpoint.exists()
    assert not (tmp_path / "model.pt").exists()
    result = run_cli(command, "-n", "2", *ARGS, *PRECISIONS[precision], "--resume", "auto", "--run-dir",
                     str(tmp_path), env=env_for(precision))
    assert_ok(result)
    resumed = read_summary(tmp_path)
    assert resumed["resumed_from_step"] == stopped_at
    assert resumed["launches"] == 2
    assert resumed["wall_s_all_launches"] == round(stopped["wall_s"] + resumed["wall_s"], 3)
    assert_bit_identical(tmp_path, uninterrupted[precision])


def test_a_restarted_worker_group_resumes_from_the_newest_checkpoint(tmp_path, uninterrupted):
    result = run_cli("run", "-n", "2", *ARGS, "--amp", "off", "--max-restarts", "1", "--run-dir", str(tmp_path),
                     env={"DDP_AMP_TEST_KILL_AT": "25"})
    assert_ok(result)
    summary = read_summary(tmp_path)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 20
    verdict = last_line(result.stderr)
    assert verdict.startswith("ddp-amp: recovered after 1 restart: rank 1 died with SIGKILL (last seen in step ")
    assert verdict.endswith("; resumed from step 20"), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert_bit_identical(tmp_path, uninterrupted["fp32"])


@pytest.mark.parametrize("damage", ["part-missing", "part-truncated", "metadata-truncated"])
def test_a_restart_skips_a_damaged_sharded_checkpoint_and_ends_on_the_uninterrupted_weights(damage, tmp_path,
                                                                                            uninterrupted):
    """Sharded checkpoints under `run --max-restarts 2`: at step 25 rank 1 damages step-20/ (a part lost or cut
    short, or the metadata cut short) and SIGKILLs itself. The restarted group skips step-20/, says so in the
    console, continues from step-10/ and ends on the weights of the run that was never interrupted."""
    step_20 = tmp_path / "checkpoints" / "step-20"
    result = run_cli("run", "-n", "2", *ARGS, "--amp", "off", "--checkpoint-format", "sharded", "--max-restarts",
                     "2", "--run-dir", str(tmp_path),
                     env={"DDP_AMP_TEST_KILL_AT": "25", "DDP_AMP_TEST_DAMAGE": f"{damage}:{step_20}"})
    assert_ok(result)
    summary = read_summary(tmp_path)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 10
    assert f"ddp-amp: warning: the restart skipped checkpoint {step_20}: " in result.stderr, result.stderr
    assert last_line(result.stderr).endswith("; resumed from step 10"), result.stderr
    assert_bit_identical(tmp_path, uninterrupted["fp32"])


def test_a_corrupt_newest_checkpoint_is_skipped(tmp_path, uninterrupted):
    process = start("spawn", tmp_path, "fp32")
    wait_for(tmp_path / "checkpoints" / "step-20.pt", process)
    process.kill()
    process.wait()
    newest = max((tmp_path / "checkpoints").glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a write cut short
    result = run_cli("spawn", "-n", "2", *ARGS, "--amp", "off", "--resume", "auto", "--run-dir", str(tmp_path))
    assert_ok(result)
    assert f"ddp-amp: warning: skipping checkpoint {newest}" in result.stderr
    assert read_summary(tmp_path)["resumed_from_step"] < int(newest.stem.split("-")[1])
    assert_bit_identical(tmp_path, uninterrupted["fp32"])


SHARDED = ("--checkpoint-format", "sharded")
FLIPS = [pytest.param("flip-model", (), id="single-model-tensor"),
         pytest.param("flip-optimizer", (), id="single-optimizer-state"),
         pytest.param("flip-part", SHARDED, id="sharded-part"),
         pytest.param("flip-metadata", SHARDED, id="sharded-metadata")]


@pytest.mark.parametrize("damage, options", FLIPS)
def test_a_byte_flipped_in_the_newest_checkpoint_is_caught_by_its_checksum_and_skipped(damage, options, tmp_path,
                                                                                       uninterrupted):
    """A run killed after its step-20 checkpoint; then one byte inverted inside the newest checkpoint (a model
    tensor's or an optimizer state's storage in a single file, a rank's part or DCP's metadata in a sharded one),
    the file's size unchanged: it still loads. `--resume auto` says once that it skips it, naming the file and
    its checksum, continues from the one before, and ends on the uninterrupted run's weights bit for bit."""
    import helper_tasks

    process = start("spawn", tmp_path, "fp32", *options)
    wait_for(tmp_path / "checkpoints" / "step-20.json", process)
    process.kill()
    process.wait()
    newest = max((path for path in (tmp_path / "checkpoints").glob("step-*") if path.suffix != ".json"),
                 key=lambda path: int(path.name.split("-")[1].removesuffix(".pt")))
    helper_tasks.DAMAGES[damage](newest)
    result = run_cli("spawn", "-n", "2", *ARGS, "--amp", "off", *options, "--resume", "auto", "--run-dir",
                     str(tmp_path))
    assert_ok(result)
    warnings = [line for line in result.stderr.splitlines() if "skipping checkpoint" in line]
    named = {"flip-part": "__1_0.distcp: ", "flip-metadata": ".metadata: "}.get(damage, "")
    assert len(warnings) == 1 and warnings[0].startswith(
        f"ddp-amp: warning: skipping checkpoint {newest}: damaged, {named}its crc32 is "), result.stderr
    assert read_summary(tmp_path)["resumed_from_step"] < int(newest.name.split("-")[1].removesuffix(".pt"))
    assert_bit_identical(tmp_path, uninterrupted["fp32"])


@pytest.mark.parametrize("damage, options", [FLIPS[0], FLIPS[2]])
def test_a_restart_skips_a_checkpoint_whose_checksum_does_not_match(damage, options, tmp_path, uninterrupted):
    """Under `run --max-restarts 1`: at step 25 rank 1 inverts a byte of step-20 (a model tensor's in a single
    file, a part of a sharded one) and SIGKILLs itself. The restarted group skips step-20, says why in the
    console and summary.json's checkpoints_skipped, continues from step 10 and ends on the uninterrupted
    weights."""
    step_20 = tmp_path / "checkpoints" / ("step-20" if options else "step-20.pt")
    result = run_cli("run", "-n", "2", *ARGS, "--amp", "off", *options, "--max-restarts", "1", "--run-dir",
                     str(tmp_path), env={"DDP_AMP_TEST_KILL_AT": "25", "DDP_AMP_TEST_DAMAGE": f"{damage}:{step_20}"})
    assert_ok(result)
    summary = read_summary(tmp_path)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 10
    assert [line.split(": damaged, ")[0] for line in summary["checkpoints_skipped"]] == [str(step_20)], summary
    assert f"ddp-amp: warning: the restart skipped checkpoint {step_20}: damaged, " in result.stderr, result.stderr
    assert_bit_identical(tmp_path, uninterrupted["fp32"])


# The flags docs/checkpoints.md says a resume must share with its checkpoint, with another value each: written
# out here, not read from the code's own list.
MUST_MATCH_IN_DOCS = {"--batch-size": "32", "--grad-accum": "2", "--task": "linear", "--schedule": "step",
                      "--warmup-steps": "1", "--min-lr-ratio": "0.5", "--steps": "41", "--lr": "0.02",
                      "--optimizer": "sgd", "--seed": "6"}


def test_a_resume_with_other_settings_is_refused_naming_them(tmp_path, uninterrupted):
    """Each flag is named with both values, read from a real run's checkpoint (what it records is what is
    compared). Another world size is no mismatch (a job continued on another allocation): spawn -n 1 resumes a
    2-rank checkpoint here, and world size is not among the differences. No rank starts: refused before launch."""
    checkpoint = uninterrupted["fp32"] / "checkpoints" / "step-40.pt"
    changed = [item for flag, value in MUST_MATCH_IN_DOCS.items() for item in (flag, value)]
    result = run_cli("spawn", "-n", "1", *ARGS, "--amp", "off", *changed, "--resume", str(checkpoint),
                     "--run-dir", str(tmp_path / "run"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    differences = lines[0].split("this run differs from the checkpoint's: ", 1)[1].split("; ")
    assert sorted(d.split(" ")[0] for d in differences) == sorted(MUST_MATCH_IN_DOCS), lines[0]
    assert "--seed 6 (checkpoint: 5)" in differences and "world size" not in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_restart_never_continues_from_an_earlier_runs_checkpoint(tmp_path):
    """--overwrite keeps an earlier run's checkpoints in the run dir: a restarted (or resized) worker group
    continues only from this launch's own, else from --resume."""
    import dataclasses

    from ddp_amp.checkpoint.manager import checkpoint_to_continue
    from ddp_amp.checkpoint.storage import save_checkpoint
    from ddp_amp.config import TrainConfig

    def written_by(launch_time: float, step: int) -> None:
        config = TrainConfig(run_dir=str(tmp_path), launch_time=launch_time)
        save_checkpoint(tmp_path, {"step": step, "trainer": {}, "rng": [], "world_size": 2,
                                   "config": dataclasses.asdict(config)}, keep=5)

    this_launch = TrainConfig(run_dir=str(tmp_path), launch_time=2000.0)
    written_by(1000.0, 40)  # the run that --overwrite replaced
    assert checkpoint_to_continue(this_launch, tmp_path) is None
    written_by(2000.0, 10)
    path, state = checkpoint_to_continue(this_launch, tmp_path)
    assert path.name == "step-10.pt" and state["step"] == 10  # not the earlier run's newer step-40


def test_the_newest_checkpoint_is_the_latest_saved_not_the_highest_step(tmp_path):
    """A run continued on another world size counts its steps as a run of that size would: 2 ranks stopped at
    step 7, 4 ranks continued from their step 3 and stopped at 6. step-6.pt is the newer, for --resume auto,
    for a restart's choice and for pruning, whether the 4 ranks were another launch or the same one resized."""
    import dataclasses

    from ddp_amp.checkpoint.storage import checkpoints, newest_valid_checkpoint, save_checkpoint
    from ddp_amp.config import TrainConfig

    def written(run_dir, launch_time: float, step: int, saved_at: float, world_size: int, keep: int = 5) -> None:
        config = TrainConfig(run_dir=str(run_dir), launch_time=launch_time)
        save_checkpoint(run_dir, {"step": step, "saved_at": saved_at, "trainer": {}, "rng": [],
                                  "world_size": world_size, "config": dataclasses.asdict(config)}, keep=keep)

    relaunched, resized = tmp_path / "relaunched", tmp_path / "resized"
    written(relaunched, 1000.0, 7, 1010.0, 2)
    written(relaunched, 2000.0, 6, 2010.0, 4)
    written(resized, 1000.0, 7, 1010.0, 2)
    written(resized, 1000.0, 6, 1020.0, 4)  # an elastic job that grew within one launch
    for run_dir in (relaunched, resized):
        assert [p.name for p in checkpoints(run_dir)] == ["step-6.pt", "step-7.pt"]
        path, state = newest_valid_checkpoint(run_dir)
        assert path.name == "step-6.pt" and state["world_size"] == 4
    written(resized, 1000.0, 5, 1030.0, 4, keep=2)  # pruning keeps the two latest saved: 5 and 6
    assert [p.name for p in checkpoints(resized)] == ["step-5.pt", "step-6.pt"]
