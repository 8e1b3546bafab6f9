"""--shard optimizer (ZeRO-1): real 2- and 3-rank gloo runs. The weights are --shard none's bit for bit, the
optimizer state is divided between the ranks, and checkpoints pass between modes and world sizes."""

import shutil

import pytest

from conftest import assert_ok, read_summary, run_cli

pytestmark = pytest.mark.slow
ARGS = ["--device", "cpu", "--task", "mlp-wide", "--amp", "off", "--optimizer", "adamw", "--batch-size", "16",
        "--log-every", "10"]


def train(run_dir, *extra, nproc=2):
    result = run_cli("spawn", "-n", str(nproc), *ARGS, "--run-dir", str(run_dir), *extra, timeout=300)
    assert_ok(result)
    return read_summary(run_dir)


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("none")
    train(run_dir, "--steps", "30", "--checkpoint-every", "10", "--keep", "5", "--shard", "none")
    return run_dir


def test_sharded_optimizer_state_trains_the_same_weights_bit_for_bit(unsharded, tmp_path):
    summary = train(tmp_path, "--steps", "30", "--checkpoint-every", "10", "--keep", "5", "--shard", "optimizer")
    assert summary["shard"] == "optimizer"
    assert (tmp_path / "model.pt").read_bytes() == (unsharded / "model.pt").read_bytes()
    whole = read_summary(unsharded)["optimizer_state_mb"]
    shares = summary["optimizer_state_mb"]
    assert len(whole) == len(shares) == 2 and whole[0] == whole[1]  # unsharded: every rank holds it all
    assert sum(shares) == pytest.approx(whole[0], rel=1e-6)  # sharded: each rank a part, the parts the whole
    assert max(shares) < whole[0] and min(shares) > 0


def test_a_sharded_run_resumes_bit_exact_and_takes_an_unsharded_checkpoint(unsharded, tmp_path):
    """From step 10: a sharded run's own checkpoint, and the unsharded run's (the optimizer state is saved
    gathered, in the plain optimizer's format): both end on the uninterrupted weights."""
    own = tmp_path / "own"
    train(own, "--steps", "30", "--checkpoint-every", "10", "--keep", "5", "--shard", "optimizer")
    for name, checkpoint in (("resumed", own / "checkpoints" / "step-10.pt"),
                             ("crossed", unsharded / "checkpoints" / "step-10.pt")):
        summary = train(tmp_path / name, "--steps", "30", "--shard", "optimizer", "--resume", str(checkpoint))
        assert summary["resumed_from_step"] == 10
        assert (tmp_path / name / "model.pt").read_bytes() == (unsharded / "model.pt").read_bytes(), name


def test_a_sharded_checkpoint_continues_on_another_world_size(tmp_path):
    """2 ranks' sharded checkpoint at step 10 continued by 3, whose shares of the state are cut anew."""
    source = tmp_path / "two"
    train(source, "--steps", "30", "--checkpoint-every", "10", "--keep", "5", "--shard", "optimizer")
    run_dir = tmp_path / "three"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(source / "checkpoints" / "step-10.pt", run_dir / "checkpoints")
    summary = train(run_dir, "--steps", "30", "--shard", "optimizer", "--resume", "auto", nproc=3)
    assert summary["world_size"] == 3 and summary["resumed_from_step"] == 10 and summary["steps"] == 30
    assert len(summary["optimizer_state_mb"]) == 3 and min(summary["optimizer_state_mb"]) > 0
