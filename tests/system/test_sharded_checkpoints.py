"""--checkpoint-format sharded: each checkpoint a torch.distributed.checkpoint directory that every rank writes its
own part of. Real 2-, 3- and 4-rank gloo runs in each --shard mode: resume bit-exact at the same world size,
reshard on another, pruning, sidecars, file modes, the NaN guard, export, and the refusal without a shared run
directory."""

import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import HELPER_TASKS, assert_ok, free_port, launch, read_summary, run_cli

from ddp_amp.checkpoint.storage import checkpoints, load_checkpoint, read_metadata

from helper_tasks import SHARDED_DAMAGES

pytestmark = pytest.mark.slow
ARGS = ["--device", "cpu", "--task", "mlp", "--amp", "off", "--optimizer", "adamw", "--batch-size", "16",
        "--log-every", "5", "--steps", "20"]


def train(run_dir, *extra, nproc=2):
    launch(run_dir, *ARGS, *extra, nproc=nproc, check=True)
    return read_summary(run_dir)


def weights(path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module", params=["none", "optimizer", "full"])
def mode_runs(request, tmp_path_factory):
    """One 20-step run per format in a --shard mode, a checkpoint every 5 steps and the last 3 kept (step-10, 15
    and 20): both tests of the mode read them."""
    mode, root = request.param, tmp_path_factory.mktemp(f"runs-{request.param}")
    previous = os.umask(0o022)
    try:
        summaries = {fmt: train(root / fmt, "--shard", mode, "--checkpoint-every", "5", "--keep", "3",
                                "--checkpoint-format", fmt) for fmt in ("single", "sharded")}
    finally:
        os.umask(previous)
    return mode, root, summaries


def test_each_rank_writes_its_part_and_a_resume_is_bit_exact(mode_runs, tmp_path):
    """Every 5 of 20 steps, --keep 3: step-10/, step-15/ and step-20/ are left, each with its sidecar, a part
    written by each rank (DCP spreads DDP's replicated tensors over the ranks; ZeRO's and FSDP's are each rank's
    own), files 0644 and directories 0755 under umask 022. Training is the single-file run's, byte for byte, and
    a run resumed from step-15/ ends on the same model.pt."""
    mode, root, summaries = mode_runs
    single, run = root / "single", root / "sharded"
    assert (run / "model.pt").read_bytes() == (single / "model.pt").read_bytes()
    directory = run / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["step-10", "step-10.json", "step-15", "step-15.json",
                                                           "step-20", "step-20.json"]
    assert [p.name for p in checkpoints(run)] == ["step-20", "step-15", "step-10"]
    assert summaries["sharded"]["checkpoint"] == str(directory / "step-20")
    for checkpoint in checkpoints(run):
        parts = sorted(checkpoint.glob("*.distcp"))
        assert [p.name for p in parts] == ["__0_0.distcp", "__1_0.distcp"]
        sizes = [p.stat().st_size for p in parts]
        assert min(sizes) > 0.25 * sum(sizes), sizes  # each rank wrote a real share, not one rank all of it
        assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o755
        assert {stat.S_IMODE(p.stat().st_mode) for p in checkpoint.iterdir()} == {0o644}
        metadata = read_metadata(checkpoint)
        assert metadata["step"] == int(checkpoint.name.split("-")[1]) and metadata["world_size"] == 2
    resumed = train(tmp_path / "resumed", "--shard", mode, "--resume", str(directory / "step-15"))
    assert resumed["resumed_from_step"] == 15
    assert (tmp_path / "resumed" / "model.pt").read_bytes() == (run / "model.pt").read_bytes()
    # export gathers the model from the parts, in this process alone: the last step's is model.pt
    exported = tmp_path / "exported.pt"
    assert_ok(run_cli("export", str(directory / "step-20"), "-o", str(exported)))
    final, model = weights(exported), weights(run / "model.pt")
    assert final.keys() == model.keys() and all(torch.equal(final[k], model[k]) for k in model)


def test_a_sharded_checkpoint_reshards_onto_another_world_size_as_a_single_file_one_does(mode_runs, tmp_path):
    """2 ranks' step-10 continued by 4: the same weights as from the single-file checkpoint of the same step
    (each rank of the new world reads its own share of the state: ZeRO's other parameters, FSDP's other rows;
    4 -> 2 is the 2 -> 4 -> 2 test's, tests/system/test_shard.py)."""
    mode, root, _ = mode_runs
    ends = []
    for fmt, name in (("single", "step-10.pt"), ("sharded", "step-10")):
        run = tmp_path / f"{fmt}-4"
        summary = train(run, "--shard", mode, "--resume", str(root / fmt / "checkpoints" / name), nproc=4)
        assert summary["world_size"] == 4 and summary["resumed_from_step"] == 10
        ends.append(weights(run / "model.pt"))
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0]), mode


def test_an_optimizer_without_state_is_saved_without_its_part_and_resumes_on_the_schedules_rate(tmp_path):
    """SGD without momentum holds no state: its part is left out (DCP's getter would otherwise run a zero-lr
    step to make some), the learning rate of the first resumed step is the schedule's, and the resumed run ends
    on the uninterrupted run's weights, with ZeRO and FSDP too (whose DTensor parameters SGD's fused step, auto's
    choice elsewhere, cannot update: every rank failed at its first step)."""
    for mode in ("none", "optimizer", "full"):
        sgd = ["--optimizer", "sgd", "--momentum", "0", "--warmup-steps", "8", "--shard", mode]
        run = tmp_path / mode
        train(run, *sgd, "--checkpoint-every", "5", "--checkpoint-format", "sharded")
        saved = dcp.FileSystemReader(str(run / "checkpoints" / "step-15")).read_metadata().state_dict_metadata
        assert saved and not any(name.startswith("optimizer.") for name in saved)
        train(tmp_path / f"{mode}-resumed", *sgd, "--resume", str(run / "checkpoints" / "step-15"))
        assert (tmp_path / f"{mode}-resumed" / "model.pt").read_bytes() == (run / "model.pt").read_bytes(), mode


def test_the_nan_guard_writes_no_sharded_checkpoint_of_a_diverged_state(tmp_path):
    """inf/NaN in any rank's part: no rank writes (an all-reduced flag), and the last finite one stays newest."""
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--task", f"{HELPER_TASKS}:nan_from_step_12", "--steps",
                     "40", "--checkpoint-every", "5", "--keep", "2", "--max-nonfinite", "4", "--log-every", "1",
                     "--checkpoint-format", "sharded", "--run-dir", str(tmp_path))
    assert result.returncode == 1
    assert [p.name for p in checkpoints(tmp_path)] == ["step-10", "step-5"]
    assert read_summary(tmp_path)["nonfinite_checkpoints_skipped"] == [15]
    assert not list((tmp_path / "checkpoints").glob(".*"))  # nothing half-written left either
    assert load_checkpoint(tmp_path / "checkpoints" / "step-10")["step"] == 10


@pytest.fixture(scope="module")
def sharded_every_2(tmp_path_factory):
    """A 20-step run with sharded checkpoints at every second step, all kept, trained once: the damage test damages
    a copy, the other tests only read it."""
    run = tmp_path_factory.mktemp("sharded-every-2") / "run"
    train(run, "--checkpoint-every", "2", "--keep", "10", "--checkpoint-format", "sharded")
    return run


def test_a_damaged_sharded_checkpoint_is_skipped_with_a_warning_and_refused_by_export(tmp_path, sharded_every_2):
    """The newest step-N/ damaged as a copy or a kill leaves it, or a byte flipped inside, in each of these ways
    at once (SHARDED_DAMAGES' order, one to each of step-20/ down to step-10/: one launch for all six): `--resume
    auto` says in the console that it skips each and why (its checksums name the file that differs), and resumes
    from step-8/, the complete one before them; export and --init-from of each damaged one are one line, exit 2."""
    run = tmp_path / "run"
    shutil.copytree(sharded_every_2, run)
    damaged = {damage: run / "checkpoints" / f"step-{20 - 2 * index}" for index, damage in enumerate(SHARDED_DAMAGES)}
    for damage, step in damaged.items():
        SHARDED_DAMAGES[damage](step)
    (run / "model.pt").unlink()  # as if it had stopped at step 20
    result = run_cli("spawn", "-n", "2", *ARGS, "--run-dir", str(run), "--resume", "auto",
                     "--checkpoint-format", "sharded", timeout=300)
    assert_ok(result)
    assert read_summary(run)["resumed_from_step"] == 8
    for damage, step in damaged.items():
        assert f"ddp-amp: warning: skipping checkpoint {step}: " in result.stderr, (damage, result.stderr)
    assert f"ddp-amp: resuming from {(run / 'checkpoints' / 'step-8').resolve()}\n" in result.stderr
    for damage, step in damaged.items():
        exported = run_cli("export", str(step), "-o", str(tmp_path / "out.pt"))
        assert exported.returncode == 2 and len(exported.stderr.strip().splitlines()) == 1, (damage, exported.stderr)
        assert "Traceback" not in exported.stderr and not (tmp_path / "out.pt").exists()
        initialised = run_cli("spawn", "-n", "2", *ARGS, "--init-from", str(step), "--run-dir",
                              str(tmp_path / "init"))
        lines = initialised.stderr.strip().splitlines()
        assert initialised.returncode == 2 and len(lines) == 1, (damage, initialised.stderr)
        assert lines[0].startswith(f"ddp-amp: error: --init-from {step}: damaged, "), (damage, lines)
        assert not (tmp_path / "init").exists()


def test_a_path_inside_a_run_that_is_not_a_checkpoint_is_one_line_naming_the_one_to_give(tmp_path,
                                                                                         sharded_every_2):
    """extras.pt holds a step, a config and a schedule, but no weights: given to --resume it launched the ranks,
    which failed reading it as a directory (exit 1); --init-from and export ended in a KeyError traceback; verify
    called it unchecked. A part, step-N.json (read as "damaged"), the run directory and its checkpoints/ (read as
    an "incomplete" sharded checkpoint) are refused the same way: one line naming what to give, exit 2, no run
    dir made and nothing written."""
    step_20 = sharded_every_2 / "checkpoints" / "step-20"
    extras, given = step_20 / "extras.pt", f"not a checkpoint; give {step_20}"
    refusals = {("--resume", extras): f"a file of the sharded checkpoint {step_20}, {given}",
                ("--init-from", extras): f"a file of the sharded checkpoint {step_20}, {given}",
                ("--resume", step_20 / "__1_0.distcp"): f"a file of the sharded checkpoint {step_20}, {given}",
                ("--resume", step_20.with_suffix(".json")): f"the record written beside {step_20}, {given}",
                ("--resume", sharded_every_2): "a run directory, not a checkpoint; give one of its checkpoints "
                f"(checkpoints/step-N.pt or step-N/), or continue from its newest with --resume auto --run-dir "
                f"{sharded_every_2}",
                ("--resume", step_20.parent): "a run's directory of checkpoints, not a checkpoint; give one of them "
                f"(step-N.pt or step-N/), or continue from the newest with --resume auto --run-dir "
                f"{sharded_every_2}"}
    for (flag, path), why in refusals.items():
        result = run_cli("spawn", "-n", "2", *ARGS, flag, str(path), "--run-dir", str(tmp_path / "run"))
        assert (result.returncode, result.stderr) == (2, f"ddp-amp: error: {flag} {path}: {why}\n"), flag
        assert not (tmp_path / "run").exists()
    exported = run_cli("export", str(extras), "-o", str(tmp_path / "out.pt"))
    assert (exported.returncode, exported.stderr) == (2, f"ddp-amp: error: export: {extras}: a file of the sharded "
                                                         f"checkpoint {step_20}, {given}\n")
    assert not list(tmp_path.glob("out.pt*"))
    verified = run_cli("verify", str(extras))
    assert (verified.returncode, verified.stdout) == (2, "")
    assert verified.stderr == (f"ddp-amp: error: verify {extras}: a file of the sharded checkpoint {step_20}, "
                               f"{given}, or the run directory\n")


def test_sharded_checkpoints_without_a_shared_run_directory_are_refused(tmp_path):
    """Two nodes (on loopback), each with its own run directory: a rank of the other node could never write its
    part where rank 0's are. One line, exit 2, before training; no checkpoint anywhere."""
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "2", "--nproc-per-node",
                               "1", "--endpoint", f"127.0.0.1:{port}", "--device", "cpu", "--steps", "20",
                               "--checkpoint-every", "5", "--checkpoint-format", "sharded", "--rdzv-timeout", "60",
                               "--log-format", "plain", "--run-dir", str(tmp_path / f"node{index}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for index in range(2)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [2, 2], outputs
    line = ("--checkpoint-format sharded needs a run directory that every node shares (each rank writes its part "
            "of every checkpoint there), and this job's nodes each have their own")
    assert any(line in err for _, err in outputs), outputs
    assert not any((tmp_path / f"node{index}" / "checkpoints").exists() for index in range(2))


def test_a_step_saved_again_in_the_other_format_replaces_the_first_and_its_sidecar(tmp_path):
    """A run stopped after step 13 in single files, resumed from step 5 in sharded directories: its step 10 is
    a step-10/ described by step-10.json, and step-10.pt (which shared the sidecar) is gone; step-5.pt stays."""
    run, logs = tmp_path / "run", tmp_path / "indices"
    logs.mkdir()
    task = ["--device", "cpu", "--amp", "off", "--task", f"{HELPER_TASKS}:records_indices", "--batch-size", "8",
            "--steps", "40", "--checkpoint-every", "5", "--keep", "20", "--run-dir", str(run)]
    env = {**os.environ, "DDP_AMP_TEST_INDEX_LOG": str(logs), "DDP_AMP_TEST_STEP_SLEEP": "0.05"}
    stopped = subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", *task], capture_output=True,
                             text=True, timeout=300, start_new_session=True, env={**env, "DDP_AMP_TEST_STOP_AT": "13"})
    assert stopped.returncode == 143, stopped.stderr
    assert (run / "checkpoints" / "step-10.pt").is_file()
    assert_ok(run_cli("spawn", "-n", "2", *task, "--checkpoint-format", "sharded", "--resume",
                      str(run / "checkpoints" / "step-5.pt"), env={"DDP_AMP_TEST_INDEX_LOG": str(logs)}, timeout=300))
    names = {p.name for p in (run / "checkpoints").iterdir()}
    assert {"step-5.pt", "step-10", "step-15", "step-40"} <= names, names
    assert not {"step-10.pt", "step-15.pt"} & names, names  # the stop came after step 13
    assert read_metadata(run / "checkpoints" / "step-10")["config"]["checkpoint_format"] == "sharded"
    assert read_metadata(run / "checkpoints" / "step-5.pt")["config"]["checkpoint_format"] == "single"
