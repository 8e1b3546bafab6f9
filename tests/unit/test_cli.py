"""The command line: flag errors are one line and exit code 2 with nothing launched; --help never loads torch."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import ddp_amps_run_dir, run_main

GPUS_VISIBLE = torch.cuda.device_count() > 0
BAD_INPUTS = [  # a rank count is refused under its one name, whichever spelling gave it
    (["--nproc-per-node", "0"], "--nproc-per-node"),
    (["--gpus", "0"], "--nproc-per-node"),
    (["--nproc", "-1"], "--nproc-per-node"),
    (["-n", "abc"], "--nproc-per-node"),
    # more ranks than GPUs: named as the rank count where GPUs are visible, as --device cuda where none is
    (["--gpus", "9", "--device", "cuda"], "--nproc-per-node" if GPUS_VISIBLE else "--device cuda"),
    (["--device", "tpu"], "--device"),
    (["--amp", "maybe"], "--amp"),
    (["--dtype", "fp8"], "--dtype"),
    (["--lr", "-1"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--batch-size", "0"], "--batch-size"),
    (["--steps", "0"], "--steps"),
    (["--grad-accum", "0"], "--grad-accum"),
    (["--clip-grad", "-1"], "--clip-grad"),
    (["--schedule", "bogus"], "--schedule"),
    (["--task", "nosuchtask"], "--task"),
    (["--task", "nosuch.module:fn"], "--task"),
    (["--task", "os:path"], "--task"),
    (["--task", "os:getenv"], "--task"),  # callable, but needs arguments: not a factory
    (["--warmup-steps", "100", "--steps", "100"], "--warmup-steps"),
    (["--amp", "off", "--dtype", "fp16"], "--dtype"),
    (["--steps", "10", "--epochs", "1"], "--epochs"),
    (["--log-format", "fancy"], "--log-format"),
    (["--tf32", "yes"], "--tf32"),
    (["--tracker", "mlflow", "--tracker-tag", "team=a", "--tracker-tag", "team=b"],
     "--tracker-tag team is given twice"),
    (["--tracker", "wandb", "--tracker", "wandb"], "--tracker wandb is given twice"),
    (["--num-workers", "-2"], "--num-workers"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "inf"], "--timeout"),
    (["--max-nonfinite", "-1"], "--max-nonfinite"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["--keep", "0"], "--keep"),
    (["--stop-timeout", "0"], "--stop-timeout"),
    (["--resume", "/no/such/checkpoint.pt"], "--resume"),
    (["--optimizer-impl", "turbo"], "--optimizer-impl"),
    (["--grad-compression", "int8"], "--grad-compression"),
    (["--grad-compression", "bf16"], "--grad-compression"),  # torch's hook needs nccl
    (["--dtype", "fp16", "--optimizer-impl", "fused"], "--optimizer-impl"),
    (["--bucket-mb", "0"], "--bucket-mb"),
    (["--static-graph", "--grad-accum", "2"], "--static-graph"),
    (["--profile", "5"], "--profile"),
    (["--profile", "8:5"], "--profile"),
    (["--profile", "90:120"], "--profile"),  # beyond the run's 100 steps
    (["--flush-denormal", "maybe"], "--flush-denormal"),
    (["--micro-batch", "0"], "--micro-batch"),
    (["--micro-batch", "half"], "--micro-batch"),
    (["--micro-batch", "64", "--batch-size", "32"], "--micro-batch"),
    (["--micro-batch", "auto", "--static-graph"], "--static-graph"),
    (["--max-memory", "0"], "--max-memory"),
    (["--max-memory", "nan"], "--max-memory"),
    (["--max-memory", "lots"], "--max-memory"),
    (["--max-memory", "1000000"], "--max-memory"),  # more than this machine has
    # numbers torch cannot hold (each failed inside the ranks, with a traceback)
    (["--seed", str(2**64)], "--seed must be at most"),
    (["--grad-accum", "99999999999999999999"], "--grad-accum must be at most"),
    (["--max-nonfinite", str(2**63)], "--max-nonfinite must be at most"),
    (["--bucket-mb", "1e300"], "--bucket-mb"),
    (["--timeout", "1e308"], "--timeout"),
    (["--timeout", "1e-9"], "--timeout"),
    (["--stop-timeout", "1e308"], "--stop-timeout"),
]


@pytest.mark.parametrize(("args", "flag"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_launches_nothing(args, flag, capsys, tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_main(["spawn", "--device", "cpu", *args, "--run-dir", str(run_dir)], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert flag in lines[0]
    assert lines[0].startswith("ddp-amp: error: ")
    assert "Traceback" not in out + err
    assert not run_dir.exists(), "a rejected launch must not create its run directory"


def test_run_dir_that_is_a_file_is_refused_and_kept(capsys, tmp_path):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    code, _, err = run_main(["spawn", "--device", "cpu", "--run-dir", str(existing)], capsys)
    assert code == 2
    assert "--run-dir" in err and len(err.strip().splitlines()) == 1
    assert existing.read_text() == "keep me"


def test_finished_run_is_not_overwritten_without_flag(capsys, tmp_path):
    ddp_amps_run_dir(tmp_path, {"model.pt": b"weights"})
    config = (tmp_path / "config.json").read_bytes()
    code, _, err = run_main(["spawn", "--device", "cpu", "--run-dir", str(tmp_path)], capsys)
    assert code == 2
    assert "--overwrite" in err
    assert (tmp_path / "model.pt").read_bytes() == b"weights"
    assert (tmp_path / "config.json").read_bytes() == config


@pytest.mark.parametrize("args", [["--help"], ["--version"]])
def test_help_and_version_do_not_import_torch(args):
    """What keeps them fast (measured in benchmarks/cli_startup.py, not here)."""
    code = (
        "import sys\n"
        "from ddp_amp.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "False", f"ddp-amp {args[0]} imported torch"
    if args == ["--help"]:
        assert "spawn" in result.stdout
    else:
        from ddp_amp import __version__

        assert result.stdout.strip() == f"ddp-amp {__version__}"


def test_env_json_is_one_object_for_bug_reports(capsys):
    code, out, err = run_main(["env", "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    import torch

    assert report["torch"] == torch.__version__
    assert report["backends"]["gloo"] is True
    assert report["backends"]["nccl"] == torch.distributed.is_nccl_available()
    assert len(report["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report["threads"]["torch"] >= 1 and report["cores"] >= 1


def test_spawn_help_lists_training_options_and_torchrun_style_aliases():
    result = subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "--help"], capture_output=True, text=True,
                            timeout=30, env={"COLUMNS": "200", "PATH": ""})
    assert result.returncode == 0
    for flag in ("--nproc-per-node", "--gpus", "--nproc", "-n", "--grad-accum", "--clip-grad", "--schedule",
                 "--run-dir", "--amp", "--dtype", "--tracker", "--keep-best"):
        assert flag in result.stdout, flag


@pytest.mark.parametrize(("source", "expected"), [
    ("import torch\ndef build(:\n    pass\n", "syntax error in {path}, line 2"),
    ("import torch\nimport no_such_module_anywhere\n", "importing it failed at {path}, line 2: ModuleNotFoundError"),
    ("x = 1\nraise RuntimeError('broken at import')\n", "importing it failed at {path}, line 2: RuntimeError: broken"),
    # sys.exit() is the task's fault too, not the launcher's exit code (0 was a "success" that trained nothing)
    ("import sys\nsys.exit(0)\n", "importing it called sys.exit(0)"),
    ("def build():\n    raise SystemExit(5)\n", "the factory called sys.exit(5)"),
    ("def build():\n    raise KeyboardInterrupt\n", "the factory raised KeyboardInterrupt"),
])
@pytest.mark.parametrize("command", ["spawn", "run"])
def test_a_broken_task_file_is_one_line_naming_file_and_line(command, source, expected, tmp_path, capsys):
    path = tmp_path / "broken_task.py"
    path.write_text(source)
    run_dir = tmp_path / "run"
    code, out, err = run_main([command, "-n", "2", "--device", "cpu", "--task", f"{path}:build", "--run-dir",
                               str(run_dir)], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "--task" in lines[0] and expected.format(path=path) in lines[0], err
    assert "Traceback" not in out + err
    assert not run_dir.exists()


def test_tensorboard_without_the_package_is_one_line_and_launches_nothing(tmp_path, capsys, monkeypatch):
    """A tensorboard that cannot be imported (as when it is not installed): one line saying how to get it."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    run_dir = tmp_path / "run"
    code, _, err = run_main(["spawn", "--device", "cpu", "--tensorboard", "--run-dir", str(run_dir)], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--tensorboard" in lines[0] and "pip install" in lines[0], err
    assert not run_dir.exists()


@pytest.mark.parametrize(("words", "expected"), [
    ("ddp-amp spawn --device ", ["auto", "cpu", "cuda"]),
    ("ddp-amp run --schedule c", ["constant", "cosine"]),
    ("ddp-amp spawn --grad-compression ", ["none", "fp16", "bf16"]),
])
def test_the_shell_completes_the_choices_of_an_option(words, expected):
    """What `ddp-amp --install-completion` installs asks the program itself, through this variable."""
    result = subprocess.run([sys.executable, "-m", "ddp_amp"], capture_output=True, text=True, timeout=30,
                            env={**os.environ, "_DDP_AMP_COMPLETE": "complete_bash", "COMP_WORDS": words,
                                 "COMP_CWORD": str(len(words.split(" ")) - 1)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == expected


def test_every_training_option_is_a_field_of_train_config_with_its_docstring_as_help():
    import dataclasses

    from ddp_amp.commands.options import TRAINING_OPTIONS, field_docs
    from ddp_amp.config import NOT_OPTIONS, TrainConfig

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert set(TRAINING_OPTIONS) == set(fields) - set(NOT_OPTIONS)
    docs = field_docs()
    for name, (default, annotation) in TRAINING_OPTIONS.items():
        assert default == fields[name].default, name
        assert annotation.__metadata__[0].help.replace("\\[", "[") == docs[name], name


def test_print_config_then_config_gives_the_same_options_and_flags_win(tmp_path, capsys):
    code, out, _ = run_main(["spawn", "-n", "2", "--device", "cpu", "--lr", "0.01", "--steps", "12",
                             "--no-bucket-view", "--print-config"], capsys)
    assert code == 0
    import tomllib

    printed = tomllib.loads(out)
    assert printed["lr"] == 0.01 and printed["steps"] == 12 and printed["nproc_per_node"] == "2"
    assert printed["bucket_view"] is False and "run_dir" not in printed  # unset: the default (a new dir)
    config = tmp_path / "run.toml"
    config.write_text(out)
    code, again, _ = run_main(["spawn", "--config", str(config), "--print-config"], capsys)
    assert code == 0 and tomllib.loads(again) == printed
    code, overridden, _ = run_main(["spawn", "--config", str(config), "--lr", "0.02", "--print-config"], capsys)
    assert tomllib.loads(overridden)["lr"] == 0.02


@pytest.mark.parametrize("command", ["spawn", "run", "multinode"])
def test_print_config_refuses_what_a_launch_would_refuse(command, tmp_path, capsys):
    """A config --config would refuse is not printed as one: --print-config checks the options first."""
    code, out, err = run_main([command, "--steps", "0", "--print-config"], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["ddp-amp: error: --steps must be >= 1, got 0"]
    config = tmp_path / "bad.toml"
    config.write_text("lr = nan\n")
    code, out, err = run_main([command, "--config", str(config), "--print-config"], capsys)
    assert code == 2 and out == "" and "--lr must be a finite number > 0, got nan" in err and str(config) in err


def test_print_config_writes_floats_json_has_no_word_for_as_toml():
    import tomllib

    from ddp_amp.commands.config_file import toml_value

    assert [toml_value(v) for v in (float("nan"), float("inf"), -float("inf"), 0.5, True, "a")] == \
        ["nan", "inf", "-inf", "0.5", "true", '"a"']
    assert math.isnan(tomllib.loads(f"x = {toml_value(float('nan'))}")["x"])


@pytest.mark.parametrize(("text", "expected"), [
    ('steps = "5"\n', "steps = 5\n"), ('lr = 1\n', "lr = 1.0\n"), ('lr = "0.5"\n', "lr = 0.5\n"),
    ('micro_batch = 4\n', 'micro_batch = "4"\n'), ('tracker = "mlflow"\n', 'tracker = ["mlflow"]\n'),
])
def test_a_config_value_is_read_as_the_command_line_reads_the_flag(tmp_path, capsys, text, expected):
    """A TOML string is the flag's text (`--steps 5`), an integer is a number, and one string is one use of a
    repeatable flag; an integer is a string option's value only where that is a number (--micro-batch)."""
    config = tmp_path / "ok.toml"
    config.write_text(text)
    code, out, err = run_main(["spawn", "--config", str(config), "--print-config"], capsys)
    assert code == 0 and expected in out, err


@pytest.mark.parametrize(("text", "expected"), [
    ('lr = 0.01\nbogus = 3\n', "unknown key 'bogus'"),
    ('steps = "many"\n', 'steps = "many" is not a valid --steps'),
    ('device = "tpu"\n', 'device = "tpu" is not a valid --device'),
    ('bucket_view = 1\n', "bucket_view = 1 is an integer, but --bucket-view takes true or false"),
    ('run_dir = 5\n', "run_dir = 5 is an integer, but --run-dir takes a string"),
    ('run_dir = 2024-01-01\n', "run_dir = 2024-01-01 is a date or time, but --run-dir takes a string"),
    ('steps = 5.0\n', "steps = 5.0 is a float, but --steps takes an integer"),
    ('steps = true\n', "steps = true is a boolean, but --steps takes an integer"),
    ('lr = false\n', "lr = false is a boolean, but --lr takes a number"),
    ('compile = "true"\n', 'compile = "true" is a string, but --compile takes true or false'),
    ('task_arg = [1]\n', "task_arg = [1] is an array, but --task-arg takes an array of strings"),
    ('lr = \n', "is not valid TOML"),
    ('# caf\xe9, saved as latin-1\nlr = 0.01\n', "is not UTF-8, as TOML must be (byte 5)"),
])
def test_a_bad_config_file_is_one_line_naming_the_key_and_the_file(tmp_path, capsys, text, expected):
    config = tmp_path / "bad.toml"
    config.write_bytes(text.encode("latin-1"))
    run_dir = tmp_path / "run"
    code, _, err = run_main(["spawn", "--config", str(config), "--run-dir", str(run_dir)], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and str(config) in lines[0], err
    assert not run_dir.exists()
