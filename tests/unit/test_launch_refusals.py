"""Refusals the launcher gives before any rank starts, run in-process through the CLI's own path (`main`): one
line, exit 2, no run dir made and nothing an earlier run left touched. What these options do once accepted is
tested with real ranks in tests/system (--shard, --resume, --init-from, --task-arg, checkpoints)."""

import dataclasses
import os
import subprocess

import pytest
import torch
from helpers import HELPER_TASKS, USER_TASKS, ddp_amps_run_dir, finished_run_dir, one_line, pretrained_weights, run_main

from ddp_amp.config import TrainConfig

from helper_tasks import Planted

FP32_SGD = ["--device", "cpu", "--amp", "off", "--optimizer", "sgd", "--lr", "0.05", "--schedule", "constant",
            "--seed", "4"]



@pytest.mark.parametrize("flags, named", [
    (["--static-graph"], "--static-graph"), (["--find-unused-parameters"], "--find-unused-parameters"),
    (["--grad-compression", "bf16"], "--grad-compression"), (["--sync-batchnorm"], "--sync-batchnorm"),
    (["--bucket-mb", "5"], "--bucket-mb"), (["--no-bucket-view"], "--no-bucket-view"),
    (["--no-broadcast-buffers"], "--no-broadcast-buffers")])
def test_a_ddp_option_with_shard_full_is_one_line_and_launches_nothing(flags, named, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, _, err = run_main(["spawn", "-n", "2", "--device", "cpu", "--shard", "full", *flags, "--run-dir",
                             str(run_dir)], capsys)
    assert code == 2
    assert err.strip() == (f"ddp-amp: error: {' '.join(flags)} is an option of DDP's, and --shard full trains "
                           "without DDP (FSDP2 reduce-scatters the gradients); drop "
                           f"{named} or use --shard none|optimizer")
    assert not run_dir.exists()


def test_what_shard_full_does_not_support_yet_is_refused(tmp_path, capsys):
    code, _, err = run_main(["spawn", "-n", "2", "--device", "cpu", "--shard", "full", "--micro-batch", "auto",
                             "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 2
    line = one_line(err)
    assert "--micro-batch" in line and "--shard full" in line
    assert not (tmp_path / "r").exists()


def test_overwrite_with_resume_is_refused(tmp_path, capsys):
    code, _, err = run_main(["spawn", "-n", "1", "--device", "cpu", "--overwrite", "--resume", "auto", "--run-dir",
                             str(tmp_path / "run")], capsys)
    assert code == 2
    assert err.strip() == ("ddp-amp: error: --overwrite starts the run dir over and --resume continues it: pass "
                           "one of them")
    assert not (tmp_path / "run").exists()


def test_sync_batchnorm_on_cpu_ranks_is_refused_before_launch(tmp_path, capsys):
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:batch_norm", "--steps", "2",
                             "--sync-batchnorm", "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and "--sync-batchnorm" in one_line(err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("arg", "problem"), [
    ("depth=3", "unknown argument 'depth'"),
    ("width=wide", "width='wide' is not an int"),
    ("width", "not KEY=VALUE"),
])
def test_a_bad_task_argument_is_one_line_exit_2_before_anything_starts(tmp_path, capsys, arg, problem):
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:sized", "--task-arg", arg,
                             "--steps", "2", "--run-dir", str(tmp_path / "run")], capsys)
    line = one_line(err)
    assert code == 2 and problem in line and "--task-arg" in line
    assert not (tmp_path / "run").exists()


def test_none_reaches_an_argument_that_takes_it_and_a_bad_value_names_the_whole_annotation(tmp_path, capsys):
    from ddp_amp.tasks import resolve_factory

    record = tmp_path / "received.txt"
    resolve_factory(f"{USER_TASKS}:optional_width", [f"record={record}", "width=none", "depth=None"])()
    assert record.read_text() == repr({"width": None, "depth": None})
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:optional_width", "--task-arg",
                             f"record={record}", "--task-arg", "width=wide", "--steps", "2", "--run-dir",
                             str(tmp_path / "run")], capsys)
    assert code == 2 and one_line(err) == ("ddp-amp: error: --task-arg width='wide' is not an int "
                                           "(optional_width takes width: int | None)")
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:sized", "--task-arg",
                             "width=none", "--steps", "2", "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and "--task-arg width='none' is not an int" in one_line(err)  # int alone takes no None


def test_a_task_argument_given_twice_is_one_line_exit_2_not_the_last_silently(tmp_path, capsys):
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:sized", "--task-arg",
                             "width=3", "--task-arg", "width=4", "--steps", "2", "--run-dir", str(tmp_path / "run")],
                            capsys)
    assert code == 2
    assert one_line(err) == "ddp-amp: error: --task-arg width is given twice (width=3 and width=4); give it once"
    assert not (tmp_path / "run").exists()


def test_a_fused_sgd_step_under_shard_full_is_refused(tmp_path, capsys):
    """torch has no fused SGD step for DTensor parameters (auto picks foreach there, tests/system/
    test_sharded_checkpoints.py): asked for by hand, it is one line before anything starts."""
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--shard", "full", "--optimizer-impl", "fused",
                             "--run-dir", str(tmp_path / "r")], capsys)
    assert (code, err) == (2, "ddp-amp: error: --optimizer-impl fused cannot run SGD under --shard full: torch has "
                              "no fused SGD step for sharded (DTensor) parameters; use foreach (what auto picks), "
                              "loop, or --optimizer adamw\n")
    assert not (tmp_path / "r").exists()


def test_a_missing_task_argument_is_one_line_exit_2(tmp_path, capsys):
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:sized", "--steps", "2",
                             "--run-dir", str(tmp_path / "run")], capsys)
    line = one_line(err)
    assert code == 2 and "missing argument 'width'" in line and "--task-arg" in line
    assert not (tmp_path / "run").exists()


RESUMABLE = ["--device", "cpu", "--task", f"{HELPER_TASKS}:resumable", "--steps", "40", "--batch-size", "16",
             "--seed", "5", "--log-every", "1", "--checkpoint-every", "10", "--lr", "0.01"]
"""tests/system/test_resume.py's runs, whose checkpoints these refusals are about."""


def test_a_checkpoint_holding_a_pickled_object_is_refused_unopened(tmp_path, capsys):
    marker = tmp_path / "code-ran"
    planted = tmp_path / "planted.pt"
    torch.save({"step": 10, "trainer": Planted(str(marker)), "rng": [], "config": {}, "world_size": 2}, planted)
    code, _, err = run_main(["spawn", "-n", "2", *RESUMABLE, "--resume", str(planted), "--run-dir",
                             str(tmp_path / "run")], capsys)
    line = one_line(err)
    assert code == 2 and "--resume" in line and "refused" in line
    assert not marker.exists(), "unpickling ran the object's code"
    assert not (tmp_path / "run").exists()


def test_resume_auto_into_a_run_dir_in_use_is_refused_without_announcing_a_start(tmp_path, capsys):
    """The "starting from the beginning" line is said once the run dir is this launch's, never before the
    refusal that it is another's."""
    from ddp_amp.files import DirectoryLock

    run_dir = tmp_path / "run"
    ddp_amps_run_dir(run_dir, {"metrics.jsonl": b'{"step": 5}\n'})
    held = DirectoryLock(run_dir)  # a launch running there
    try:
        code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--steps", "2", "--resume", "auto", "--run-dir",
                                 str(run_dir)], capsys)
    finally:
        held.release()
    assert code == 2 and "is in use by another ddp-amp launch" in one_line(err), err


@pytest.mark.parametrize("flag", ["--resume", "--init-from"])
def test_a_file_torch_did_not_write_is_named_so_not_blamed_on_a_pickle(flag, tmp_path, capsys):
    """torch's own message for a text file suggests weights_only=False ("will likely succeed"): wrong, and unsafe
    advice. It is not a torch file at all, and the refusal says that."""
    (tmp_path / "notes.pt").write_text("garbage, not a checkpoint\n")
    code, _, err = run_main(["spawn", "-n", "2", *RESUMABLE, flag, str(tmp_path / "notes.pt"), "--run-dir",
                             str(tmp_path / "run")], capsys)
    line = one_line(err)
    assert code == 2 and line.endswith(f"{flag} {tmp_path / 'notes.pt'}: not a file torch.save wrote (neither a "
                                       "zip archive nor a pickle)"), line
    assert "weights_only" not in err and not (tmp_path / "run").exists()


def test_a_resume_from_a_nan_checkpoint_names_the_newest_finite_one(tmp_path, capsys):
    """A NaN checkpoint beside finite ones (as an earlier version wrote; a run today never writes one, tested in
    tests/system/test_checkpoints.py): --resume names the finite one instead. Written as a run writes them
    (save_checkpoint: the file and its sidecar, launch and save times in order)."""
    from ddp_amp.checkpoint.storage import save_checkpoint

    config = dataclasses.asdict(TrainConfig(task=f"{HELPER_TASKS}:resumable", device="cpu", launch_time=1000.0))
    for step, value in [(5, 0.5), (10, 1.0), (15, float("nan"))]:
        save_checkpoint(tmp_path, {"step": step, "trainer": {"model": {"weight": torch.full((1, 8), value)}},
                                   "rng": [], "world_size": 2, "config": config, "saved_at": 1000.0 + step}, keep=5)
    assert (tmp_path / "checkpoints" / "step-15.json").exists()
    planted, newest_finite = tmp_path / "checkpoints" / "step-15.pt", tmp_path / "checkpoints" / "step-10.pt"
    code, _, err = run_main(["spawn", "-n", "2", "--device", "cpu", "--task", f"{HELPER_TASKS}:resumable",
                             "--resume", str(planted), "--run-dir", str(tmp_path / "again")], capsys)
    assert code == 2
    assert err.strip() == (f"ddp-amp: error: --resume {planted}: refused, it holds inf/NaN (in model.weight); the "
                           f"newest finite one is {newest_finite}")
    assert not (tmp_path / "again").exists()


def _resume_refusal(tmp_path, capsys, saved: dict, given: list[str]) -> str:
    """A checkpoint of a run of TrainConfig(`saved`) resumed with the flags `given`: the refusal's line; nothing
    launched."""
    from ddp_amp.checkpoint.storage import save_checkpoint

    config = dataclasses.asdict(TrainConfig(task="mlp", device="cpu", amp="off", launch_time=1000.0, **saved))
    save_checkpoint(tmp_path, {"step": 2, "trainer": {"model": {"weight": torch.zeros(2)}}, "rng": [],
                               "world_size": 2, "config": config, "saved_at": 1002.0}, keep=2)
    checkpoint = tmp_path / "checkpoints" / "step-2.pt"
    code, _, err = run_main(["spawn", "-n", "2", "--device", "cpu", "--amp", "off", *given, "--resume",
                             str(checkpoint), "--run-dir", str(tmp_path / "again")], capsys)
    assert code == 2 and not (tmp_path / "again").exists()
    prefix = f"ddp-amp: error: --resume {checkpoint}: this run differs from the checkpoint's: "
    assert err.startswith(prefix) and err.endswith("\n") and err.count("\n") == 1, err
    return err.removeprefix(prefix).rstrip("\n")


@pytest.mark.parametrize("saved, given, named", [
    ({"epochs": 1, "steps": None}, [], "--steps 100, the default (checkpoint: --epochs 1)"),
    ({"epochs": None, "steps": 6}, ["--epochs", "2"], "--epochs 2 (checkpoint: --steps 6)")])
def test_a_resume_that_counts_in_steps_where_the_checkpoint_counted_epochs_names_both_flags(saved, given, named,
                                                                                            tmp_path, capsys):
    """A run of --epochs resumed without it (or the reverse) differs in one thing, how long the run is: one
    difference naming the flag each was given. It read "--steps 100 (checkpoint: None); --epochs None
    (checkpoint: 1)", a flag nobody passed."""
    assert _resume_refusal(tmp_path, capsys, saved, given) == named


@pytest.mark.parametrize("given, named", [([], "--batch-size 32, the default (checkpoint: 16)"),
                                           (["--batch-size", "8"], "--batch-size 8 (checkpoint: 16)")])
def test_a_resume_that_differs_by_a_flag_left_out_says_its_value_is_the_default(given, named, tmp_path, capsys):
    """A flag forgotten on the resume: "--batch-size 32" alone reads as a value the user typed."""
    assert _resume_refusal(tmp_path, capsys, {"batch_size": 16}, given) == named


def _sized_weights(width: int) -> dict[str, torch.Tensor]:
    """What user_tasks.sized(width) trains: Linear(8, width), ReLU, Linear(width, 1)."""
    return {"0.weight": torch.zeros(width, 8), "0.bias": torch.zeros(width), "2.weight": torch.zeros(1, width),
            "2.bias": torch.zeros(1)}


def test_init_from_that_does_not_fit_is_one_line_and_changes_nothing(tmp_path, capsys):
    """Refused before --overwrite clears anything: the earlier run's files stay byte for byte."""
    source = tmp_path / "source.pt"
    torch.save(_sized_weights(5), source)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    for name, data in {"model.pt": b"weights", "metrics.jsonl": b'{"step": 2}\n', "summary.json": b"{}",
                       "config.json": b"{}"}.items():
        (earlier / name).write_bytes(data)
    before = {p.name: p.read_bytes() for p in earlier.iterdir()}
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:sized", "--task-arg", "width=6",
                             "--steps", "2", "--overwrite", "--init-from", str(source), "--run-dir", str(earlier)],
                            capsys)
    line = one_line(err)
    assert code == 2 and "--init-from" in line and "0.weight: file (5, 8) vs model (6, 8)" in line, line
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == before  # --overwrite never ran


def test_init_from_with_tensors_the_model_lacks_is_refused_unless_not_strict(tmp_path, capsys):
    partial = tmp_path / "partial.pt"
    torch.save({"0.weight": torch.randn(5, 8), "extra.weight": torch.zeros(2)}, partial)
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:sized", "--task-arg", "width=5",
                             "--steps", "1", "--init-from", str(partial), "--run-dir", str(tmp_path / "strict")],
                            capsys)
    assert code == 2 and "--no-init-strict" in one_line(err)
    assert not (tmp_path / "strict").exists()


def _plant_unreadable(tmp_path, kind: str):
    """Weights ddp-amp cannot read, as a damaged download or a copy cut short leaves them."""
    if kind == "safetensors":
        (tmp_path / "w.safetensors").write_text("garbage, not safetensors\n")
        return tmp_path / "w.safetensors"
    directory = tmp_path / kind
    directory.mkdir()
    index = directory / "model.safetensors.index.json"
    index.write_text({"index_not_json": "{", "index_without_weight_map": '{"metadata": {}}',
                      "index_naming_a_missing_shard": '{"weight_map": {"0.weight": "model-00001.safetensors"}}'}[kind])
    return directory


@pytest.mark.parametrize("kind, why", [
    ("safetensors", "not a .safetensors file safetensors can read (Error while deserializing header"),
    ("index_not_json", "model.safetensors.index.json is not JSON"),
    ("index_without_weight_map", "model.safetensors.index.json has no weight_map"),
    ("index_naming_a_missing_shard", "model.safetensors.index.json names model-00001.safetensors, which is not "
                                     "there")])
def test_init_from_weights_that_cannot_be_read_is_one_line_and_launches_nothing(kind, why, tmp_path, capsys):
    """A damaged .safetensors file or a save_pretrained directory whose index is broken or incomplete: one line
    naming the flag, the path and what is wrong, exit 2, no traceback, no run dir."""
    path = _plant_unreadable(tmp_path, kind)
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:sized", "--task-arg", "width=5",
                             "--steps", "1", "--init-from", str(path), "--run-dir", str(tmp_path / "run")], capsys)
    line = one_line(err)
    assert code == 2 and line.startswith(f"ddp-amp: error: --init-from {path}"), err
    assert why in line and "Traceback" not in err, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, problem", [
    (["--grad-accum", "5"], "--epochs 1 gives no optimizer step: the data set has 4 batches per rank, fewer than "
                            "--grad-accum 5"),
    (["--warmup-steps", "4"], "--warmup-steps 4 must be smaller than the run's 4 optimizer steps"),
    (["--profile", "3:6"], "--profile 3:6: the run has only 4 steps")])
def test_epochs_too_short_for_the_options_is_refused_before_launch(flags, problem, tmp_path, capsys):
    """An --epochs run's length is known from the data set (64 samples, 2 ranks of --batch-size 8: 4 batches
    per rank): what does not fit in it is one line, exit 2, before any rank starts, as it is for --steps."""
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:sized", "--task-arg", "width=5",
                             "--batch-size", "8", "--epochs", "1", *flags, "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and one_line(err) == f"ddp-amp: error: {problem}", err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["model.pt", "model_best.pt", "checkpoints/step-4.pt"])
def test_init_from_the_run_dirs_own_weights_with_overwrite_is_refused_before_launch(name, tmp_path, capsys):
    """--overwrite sets the earlier run's files aside before the ranks start: --init-from one of them would
    be read by no rank (before: every rank failed, 'no such file', exit 1). One line, exit 2, nothing moved."""
    weights = tmp_path / "buffer.pt"
    torch.save(_sized_weights(5), weights)
    run_dir = ddp_amps_run_dir(tmp_path / "run", {name: weights.read_bytes()})
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:sized", "--task-arg", "width=5",
                             "--steps", "1", "--overwrite", "--init-from", str(run_dir / name), "--run-dir",
                             str(run_dir)], capsys)
    assert code == 2 and one_line(err) == (
        f"ddp-amp: error: --init-from {run_dir / name}: a file of the earlier run in {run_dir}, which --overwrite "
        "sets aside before the ranks read it; copy it out of the run dir first, or give another --run-dir"), err
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


@pytest.fixture
def read_only_dir(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(target), str(target)],
                                           capture_output=True).returncode != 0:
        pytest.skip("a read-only bind mount needs root and mount permission")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(target)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only here")
        yield target
    finally:
        subprocess.run(["umount", str(target)], capture_output=True)


def test_a_run_dir_on_a_read_only_file_system_is_one_line_exit_2(read_only_dir, capsys):
    code, _, err = run_main(["spawn", "-n", "2", "--device", "cpu", "--steps", "3", "--run-dir",
                             str(read_only_dir)], capsys)
    line = one_line(err)
    assert code == 2 and "--run-dir" in line and "not writable" in line and "Read-only file system" in line


@pytest.mark.parametrize("name, why", [("missing", "does not exist"), ("a-file", "is not a directory")])
def test_diagnose_of_no_directory_says_so_not_that_it_has_no_records(tmp_path, capsys, name, why):
    (tmp_path / "a-file").write_text("")
    code, _, err = run_main(["diagnose", str(tmp_path / name)], capsys)
    assert code == 2 and one_line(err) == f"ddp-amp: error: diagnose: {str(tmp_path / name)!r} {why}"


def test_diagnose_without_records_is_one_line_exit_2(tmp_path, capsys):
    code, _, err = run_main(["diagnose", str(tmp_path)], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"ddp-amp: error: diagnose: {str(tmp_path)!r} has no flight records (flight_recorder/rank<N>.json): the "
        "ranks write them when a run fails or stalls"]


def test_resume_auto_without_a_checkpoint_starts_from_the_beginning_and_says_so(tmp_path, capsys, monkeypatch):
    """A requeue loop that always passes --resume auto: its first attempt, and one stopped before any checkpoint
    (its metrics left, no model.pt), start from the beginning, the earlier attempt's files cleared; the line says
    so. --resume PATH stays strict, and a finished run is never taken over."""
    launched = []
    monkeypatch.setattr("ddp_amp.launch.session.run_launch", lambda launch, display: launched.append(launch))
    run_dir = tmp_path / "run"
    # an attempt stopped before its first checkpoint
    ddp_amps_run_dir(run_dir, {"metrics.jsonl": b'{"step": 5}\n'})
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--steps", "2", "--resume", "auto", "--run-dir",
                             str(run_dir)], capsys)
    assert code == 0, err
    assert f"ddp-amp: --resume auto: no checkpoint in {run_dir / 'checkpoints'}: starting from the beginning" \
        in err.splitlines()
    assert len(launched) == 1 and launched[0].plan.config.resume is None
    assert not (run_dir / "metrics.jsonl").exists()
    (run_dir / "model.pt").write_bytes(b"finished")
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--steps", "2", "--resume", "auto", "--run-dir",
                             str(run_dir)], capsys)
    assert code == 2 and "holds a finished run (model.pt)" in one_line(err) and len(launched) == 1
    assert (run_dir / "model.pt").read_bytes() == b"finished"


@pytest.mark.parametrize(("task", "flags", "line"), [
    (f"{USER_TASKS}:frozen_trunk", ["--eval-every", "50"], f"--eval-every: --task {USER_TASKS}:frozen_trunk has "
     "no validation set (Task.val_dataset); drop it or give the task one"),
    (f"{USER_TASKS}:frozen_trunk", ["--eval-every", "5", "--keep-best", "val_loss"], "--eval-every and "
     f"--keep-best: --task {USER_TASKS}:frozen_trunk has no validation set (Task.val_dataset); drop them or give "
     "the task one"),
    (f"{USER_TASKS}:validation_loss_only", ["--keep-best", "val_acc"], "--keep-best val_acc: the evaluation of "
     f"--task {USER_TASKS}:validation_loss_only logs val_loss only (the task declares no val_metrics)"),
])
def test_validation_options_the_task_cannot_serve_are_refused_before_anything_is_touched(task, flags, line,
                                                                                           tmp_path, capsys):
    """Refused before launch, once, and under --overwrite nothing of the earlier run is deleted."""
    run_dir = tmp_path / "run"
    ddp_amps_run_dir(run_dir, {"model.pt": b"earlier weights", "metrics.jsonl": b'{"step": 1}\n'})
    earlier = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    code, _, err = run_main(["spawn", "-n", "2", "--device", "cpu", "--task", task, *flags, "--steps", "10",
                             "--overwrite", "--run-dir", str(run_dir)], capsys)
    assert code == 2
    assert one_line(err) == "ddp-amp: error: " + line
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == earlier


@pytest.mark.parametrize(("task", "metric"), [("linear", "val_loss"), ("mlp", "val_accuracy"),
                                              ("mlp-wide", "val_accuracy"), ("transformer", "val_loss")])
def test_every_built_in_task_has_a_validation_set_for_eval_every_and_keep_best(task, metric, tmp_path, capsys,
                                                                               monkeypatch):
    """Launched, not refused; the validation set is held out (none of its items is a training item)."""
    from ddp_amp.tasks import build_task

    launched = []
    monkeypatch.setattr("ddp_amp.launch.session.run_launch", lambda launch, display: launched.append(launch))
    code, _, err = run_main(["spawn", "-n", "2", "--device", "cpu", "--task", task, "--eval-every", "50",
                             "--keep-best", metric, "--steps", "100", "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 0 and len(launched) == 1, err
    built = build_task(task)
    train_inputs = {tuple(x.flatten().tolist()) for x, _ in built.dataset}
    assert len(built.val_dataset) >= 256 and not any(
        tuple(x.flatten().tolist()) in train_inputs for x, _ in built.val_dataset)


@pytest.mark.parametrize(("task", "args", "line"), [
    (f"{USER_TASKS}:few_samples", ["--task-arg", "count=6", "--batch-size", "8"], "--batch-size 8: 2 rank(s) take "
     "16 samples a step and the data set of --task {task} has 6; give --batch-size 3 or less"),
    (f"{USER_TASKS}:few_samples", ["--task-arg", "count=0"], "--task {task}: the dataset is empty"),
    (f"{HELPER_TASKS}:triple_items", [], "--task {task}: dataset items must be (inputs, target) pairs or mappings "
     "(called as model(**batch)), but item 0 is a tuple of 3 elements"),
], ids=["batch-larger-than-the-data", "empty", "items-not-pairs"])
def test_a_data_set_the_run_cannot_use_is_refused_before_launch(task, args, line, tmp_path, monkeypatch, capsys):
    """A batch larger than the data set (every step would be a whole epoch of 3 samples per rank while the record
    says a global batch of 16), an empty data set, items that are neither pairs nor mappings: one line, exit 2,
    no rank started, no run dir made."""
    launched = []
    monkeypatch.setattr("ddp_amp.launch.session.run_launch", lambda launch, display: launched.append(launch))
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", task, *args, "--steps", "2", "--run-dir",
                             str(tmp_path / "run")], capsys)
    assert code == 2 and one_line(err) == "ddp-amp: error: " + line.format(task=task)
    assert not launched and not (tmp_path / "run").exists()


@pytest.mark.parametrize("args", [[], ["--task-arg", "buffers_only=true"]], ids=["frozen", "buffers-only"])
def test_a_model_with_nothing_to_train_is_refused_before_launch(args, tmp_path, monkeypatch, capsys):
    """A task whose model has no parameter that requires a gradient (all frozen, or buffers only): one line naming
    --task, exit 2, no rank started (not DDP's "not needed" error from every rank after the launch)."""
    launched = []
    monkeypatch.setattr("ddp_amp.launch.session.run_launch", lambda launch, display: launched.append(launch))
    task = f"{USER_TASKS}:nothing_to_train"
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", task, *args, "--steps", "2", "--run-dir",
                             str(tmp_path / "run")], capsys)
    assert code == 2 and one_line(err) == (f"ddp-amp: error: --task {task}: its model has no parameter to train "
                                           "(none with requires_grad=True); give Task.model one")
    assert not launched and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("task", "left_out"), [
    (f"{USER_TASKS}:weighted_items", ("y", "weight")),
    (f"{USER_TASKS}:bert_with_a_text_column", ("text",)),
    (f"{USER_TASKS}:bert_dict_items", ()),
])
def test_the_batch_fields_the_models_forward_does_not_take_are_known_before_launch(task, left_out, tmp_path,
                                                                                  monkeypatch, capsys):
    """What the start line names: a plain forward(self, x) leaves y and weight to the loss; a Hugging Face model
    (whose **kwargs would swallow anything) gets its named inputs and labels, not the raw text."""
    launched = []
    monkeypatch.setattr("ddp_amp.launch.session.run_launch", lambda launch, display: launched.append(launch))
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", task, "--batch-size", "4", "--steps", "2",
                             "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 0, err
    assert launched[0].plan.fields_left_out == left_out


def test_a_mapping_batch_gives_the_model_the_fields_its_forward_names_and_the_loss_every_field():
    from ddp_amp.tasks import build_task
    from ddp_amp.tasks.batches import batch_loss, model_fields

    task = build_task(f"{USER_TASKS}:weighted_items", ["weight=0.5"])
    batch = {"x": torch.ones(2, 8), "y": torch.zeros(2, 1), "weight": torch.tensor([0.5, 0.5])}
    loss = batch_loss(task.model, batch, task.loss_fn)  # forward(self, x) given y and weight: a TypeError
    assert torch.allclose(loss, 0.5 * (task.model(batch["x"]) ** 2).mean())
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        batch_loss(task.model, batch, task.loss_fn, every_field=True)  # Task.pass_every_field: as before
    bert = build_task(f"{USER_TASKS}:bert_dict_items").model
    assert {"input_ids", "attention_mask", "labels"} <= model_fields(bert) and "text" not in model_fields(bert)
    ddp_like = torch.nn.Module()
    ddp_like._orig_mod = bert  # torch.compile's wrapper is looked through
    assert model_fields(ddp_like) == model_fields(bert)


def test_epochs_over_an_iterable_without_a_length_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    launched = []
    monkeypatch.setattr("ddp_amp.launch.session.run_launch", lambda launch, display: launched.append(launch))
    monkeypatch.setenv("DDP_AMP_TEST_INDEX_LOG", str(tmp_path))
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:stream", "--epochs", "2",
                             "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and one_line(err) == (
        f"ddp-amp: error: --task {USER_TASKS}:stream: --epochs needs a data set with a length, and this iterable "
        "(Stream) has none; train it for --steps N (it stops earlier if the data runs out)")
    assert not launched and not (tmp_path / "run").exists()


def test_an_unannotated_factory_argument_is_converted_by_its_defaults_type(tmp_path):
    from ddp_amp.tasks import resolve_factory

    record = tmp_path / "received.txt"
    resolve_factory(f"{USER_TASKS}:unannotated", [f"record={record}", "width=5", "scale=0.5"])()
    assert record.read_text() == repr({"width": 5, "scale": 0.5})  # not '5' and '0.5'


def test_an_output_with_a_loss_attribute_that_is_no_mapping_gives_its_loss():
    from types import SimpleNamespace

    from ddp_amp.tasks.batches import output_loss

    loss = torch.tensor(2.5)
    assert output_loss(SimpleNamespace(loss=loss, logits=None), {"labels": None}, None) is loss


def test_export_of_a_run_dir_without_which_takes_the_best_weights_it_kept(tmp_path):
    from ddp_amp.results.export import choose_source

    (tmp_path / "config.json").write_text("{}")
    for name in ("model.pt", "model_best.pt"):
        (tmp_path / name).write_bytes(b"weights")
    assert choose_source(tmp_path, "auto")[0] == tmp_path / "model_best.pt"
    assert choose_source(tmp_path, "last")[0] == tmp_path / "model.pt"
    (tmp_path / "model_best.pt").unlink()
    assert choose_source(tmp_path, "auto")[0] == tmp_path / "model.pt"


def test_a_factory_that_returns_no_task_is_one_line_before_launch(tmp_path, capsys):
    code, _, err = run_main(["spawn", "-n", "1", "--device", "cpu", "--task", f"{HELPER_TASKS}:not_a_task",
                             "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 2 and one_line(err) == (f"ddp-amp: error: --task '{HELPER_TASKS}:not_a_task': the factory "
                                           "returned str, not ddp_amp.tasks.Task")
    assert not (tmp_path / "r").exists()


def test_the_items_a_loss_averages_over_are_its_label_tokens_as_the_model_counts_them():
    """A causal LM's loss counts the labels after the first position (it predicts t + 1 from t), a seq2seq or
    masked LM's every label other than -100; a classifier's loss is a mean over samples; a task's own count wins,
    and a loss_fn of the task's own is a mean over samples unless it says otherwise."""
    import dataclasses

    from transformers import BertConfig, BertForSequenceClassification, T5Config, T5ForConditionalGeneration

    from ddp_amp.tasks import build_task
    from ddp_amp.tasks.batches import loss_items_counter

    llama = build_task(f"{USER_TASKS}:tiny_llama_uneven_labels")
    labels = torch.tensor([[5, 6, -100, -100], [7, 8, 9, -100]])
    count = loss_items_counter(llama, llama.model)
    assert int(count({"input_ids": labels.clamp(min=0), "labels": labels})) == 1 + 2
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    assert int(loss_items_counter(dataclasses.replace(llama, model=t5), t5)({"labels": labels})) == 2 + 3
    classifier = BertForSequenceClassification(BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=16))
    assert loss_items_counter(dataclasses.replace(llama, model=classifier), classifier) is None
    assert loss_items_counter(dataclasses.replace(llama, loss_fn=lambda output, batch: output.loss), llama.model) \
        is None
    own = dataclasses.replace(llama, loss_fn=lambda output, batch: output.loss, loss_items=lambda batch: 42)
    assert loss_items_counter(own, llama.model)(None) == 42


def test_a_data_set_the_launcher_cannot_look_into_on_the_meta_device_is_left_to_the_ranks(tmp_path, monkeypatch,
                                                                                         capsys):
    launched = []
    monkeypatch.setattr("ddp_amp.launch.session.run_launch", lambda launch, display: launched.append(launch))
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:int_labels", "--steps", "2",
                             "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 0 and len(launched) == 1, err


def test_a_forward_that_reads_fields_from_its_kwargs_gets_them_all_a_hugging_face_ones_do_not():
    from ddp_amp.tasks import build_task
    from ddp_amp.tasks.batches import model_fields

    assert model_fields(build_task(f"{USER_TASKS}:reads_kwargs").model) is None  # every field
    assert "text" not in model_fields(build_task(f"{USER_TASKS}:bert_dict_items").model)


@pytest.mark.parametrize(("flags", "line"), [
    (["--tracker", "comet"], "ddp-amp: error: --tracker 'comet' is not one of mlflow, wandb"),
    (["--tracker-project", "p"], "ddp-amp: error: --tracker-project, --tracker-run-name and --tracker-tag need "
                                 "--tracker mlflow or wandb"),
    (["--tracker", "mlflow", "--tracker-tag", "novalue"], "ddp-amp: error: --tracker-tag 'novalue': give it as "
                                                          "KEY=VALUE"),
    (["--tracker", "mlflow"], "ddp-amp: error: --tracker mlflow needs the mlflow package: pip install "
                              "'ddp-amp[mlflow]' (or pip install mlflow)"),
])
def test_a_tracker_the_run_cannot_use_is_one_line_exit_2_and_launches_nothing(flags, line, tmp_path, capsys,
                                                                              monkeypatch):
    """The last: mlflow not installed (its package found nowhere), as after a plain pip install ddp-amp."""
    import ddp_amp.rank.trackers as trackers

    monkeypatch.setitem(trackers.PACKAGES, "mlflow", "ddp_amp_no_such_package")
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--steps", "2", *flags, "--run-dir",
                             str(tmp_path / "run")], capsys)
    assert code == 2 and one_line(err) == line
    assert not (tmp_path / "run").exists()


def test_a_cpu_setting_is_refused_on_gpu_ranks_and_a_cuda_one_on_cpu_ranks():
    from ddp_amp.errors import UsageError
    from ddp_amp.launch.option_checks import check_ddp_options
    from ddp_amp.precision import Precision

    with pytest.raises(UsageError, match="^--flush-denormal on sets the CPU's flush-to-zero"):
        check_ddp_options(TrainConfig(flush_denormal="on"), "cuda", Precision("bf16"))
    with pytest.raises(UsageError, match="^--tf32 on sets TF32 on CUDA's tensor cores"):
        check_ddp_options(TrainConfig(tf32="on"), "cpu", Precision("bf16"))
    check_ddp_options(TrainConfig(flush_denormal="on"), "cpu", Precision("bf16"))  # where each means something
    check_ddp_options(TrainConfig(tf32="on"), "cuda", Precision("bf16"))


@pytest.mark.parametrize("name", ["config.json", "summary.json", "config.toml"])
def test_export_of_a_runs_other_files_is_one_line_saying_what_export_takes(tmp_path, capsys, name):
    source = finished_run_dir(tmp_path, "mlp", {"w": torch.ones(2)}) / name
    code, _, err = run_main(["export", str(source), "-o", str(tmp_path / "a.pt")], capsys)
    assert code == 2 and one_line(err).startswith(f"ddp-amp: error: export {str(source)!r}: not a file torch.save "
                                                  "wrote")
    assert "export takes a run directory, a checkpoint, a weights file" in err
    assert not (tmp_path / "a.pt").exists()


def test_export_to_a_dangling_symlink_is_refused_and_leaves_it(tmp_path, capsys):
    run_dir = finished_run_dir(tmp_path, "mlp", {"w": torch.ones(2)})
    (tmp_path / "link.pt").symlink_to(tmp_path / "nowhere")
    code, _, err = run_main(["export", str(run_dir), "-o", str(tmp_path / "link.pt")], capsys)
    assert code == 2 and one_line(err) == f"ddp-amp: error: -o {str(tmp_path / 'link.pt')!r} already exists; " \
                                          "remove it or choose another name"
    assert (tmp_path / "link.pt").is_symlink() and not (tmp_path / "nowhere").exists()


def test_export_of_the_current_directory_reads_it_as_any_other(tmp_path, capsys, monkeypatch):
    pretrained = tmp_path / "pretrained"
    pretrained.mkdir()
    torch.save(pretrained_weights(), pretrained / "pytorch_model.bin")
    monkeypatch.chdir(pretrained)  # `export .` from inside a save_pretrained directory: `.` has no name
    code, _, err = run_main(["export", ".", "-o", str(tmp_path / "a.pt")], capsys)
    assert code == 0, err
    assert err.strip() == f"ddp-amp: wrote {tmp_path / 'a.pt'} (2 tensors from .)"
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["linear.weight"], torch.ones(1, 8))
    (pretrained / "pytorch_model.bin").unlink()
    code, _, err = run_main(["export", ".", "-o", str(tmp_path / "b.pt")], capsys)
    assert code == 2 and one_line(err) == ("ddp-amp: error: export: .: a directory without model.safetensors or "
                                           "pytorch_model.bin (not written by save_pretrained)")
    assert not (tmp_path / "b.pt").exists()


def test_a_runs_directory_given_as_weights_names_what_to_give(tmp_path, capsys):
    """`export RUN/checkpoints` and `--init-from RUN`: one line naming model.pt and the checkpoints, exit 2,
    nothing written (before: "a directory without model.safetensors ... (not written by save_pretrained)")."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    code, _, err = run_main(["export", str(run / "checkpoints"), "-o", str(tmp_path / "a.pt")], capsys)
    assert code == 2 and one_line(err) == (
        f"ddp-amp: error: export: {run / 'checkpoints'}: a run's directory of checkpoints, not weights; give "
        f"{run / 'model.pt'} or one of its checkpoints (checkpoints/step-N.pt or step-N/)")
    code, _, err = run_main(["spawn", "-n", "1", "--device", "cpu", "--init-from", str(run), "--run-dir",
                             str(tmp_path / "new")], capsys)
    assert code == 2 and one_line(err) == (
        f"ddp-amp: error: --init-from {run}: a run's directory, not weights; give {run / 'model.pt'} or one of "
        "its checkpoints (checkpoints/step-N.pt or step-N/)")
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "new").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")
@pytest.mark.parametrize("command", ["spawn", "run", "doctor"])
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_device_cuda_where_no_gpu_is_visible_says_so_not_lower_the_rank_count(command, nproc, tmp_path, capsys):
    code, _, err = run_main([command, "-n", nproc, "--device", "cuda", "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert one_line(err) == "ddp-amp: error: --device cuda: no CUDA GPU is visible; use --device cpu or auto"
    assert not (tmp_path / "run").exists()


def test_more_dataloader_workers_than_the_node_can_start_is_refused_and_more_than_its_cores_is_a_warning(
        tmp_path, capsys):
    """2 ranks x 4194304 workers are more processes than any Linux kernel.pid_max allows (at most 2^22): one line,
    nothing launched. Above the usable cores per rank, torch's warning (which reaches only a rank's log) is the
    launcher's own line; a dry run shows it and starts nothing."""
    from ddp_amp.process import process_limit, usable_cores

    if process_limit() is None:
        pytest.skip("no process limit readable here (not Linux)")
    run_dir = tmp_path / "run"
    code, _, err = run_main(["spawn", "-n", "2", "--device", "cpu", "--num-workers", "4194304", "--run-dir",
                             str(run_dir)], capsys)
    assert code == 2 and not run_dir.exists()
    assert one_line(err).startswith("ddp-amp: error: --num-workers 4194304: 2 rank(s) with 4194304 DataLoader "
                                    "workers each are 8388610 processes, more than this node can start ("), err
    warning = "ddp-amp: warning: --num-workers"
    for workers, warned in ((usable_cores(), False), (usable_cores() + 1, True)):
        code, _, err = run_main(["run", "-n", "2", "--device", "cpu", "--num-workers", str(workers), "--dry-run",
                                 "--run-dir", str(tmp_path / f"dry{workers}")], capsys)
        assert code == 0 and (warning in err) == warned, err


@pytest.mark.parametrize("flags, problem", [
    (["--amp", "on", "--dtype", "bf16"], "steps bf16-true's fp32 masters, and this run is bf16: pass --dtype "
                                         "bf16-true, or pick fused, foreach or loop"),
    (["--dtype", "bf16-true", "--optimizer", "sgd"], "runs AdamW, not --optimizer sgd: pick fused, foreach or "
                                                     "loop"),
    (["--dtype", "bf16-true", "--shard", "optimizer"], "runs under --shard none, not --shard optimizer (which "
                                                       "steps its own optimizer): pick fused, foreach or loop")])
def test_the_compiled_step_where_it_does_not_apply_is_one_line(flags, problem, tmp_path, capsys):
    code, _, err = run_main(["spawn", "-n", "2", "--device", "cpu", *flags, "--optimizer-impl", "compiled",
                             "--run-dir", str(tmp_path / "r")], capsys)
    assert (code, err) == (2, f"ddp-amp: error: --optimizer-impl compiled {problem}\n")
    assert not (tmp_path / "r").exists()
