"""The training commands' options grouped by concern: every TrainConfig option in exactly one panel, no panel of
more than 12 options, a plain --help that fits a screen and points at --help-all, which shows every option; and
the rank count, one option under every spelling it had."""

import dataclasses
import os
from collections import Counter

import pytest
import tomllib
import typer
from helpers import run_main

from ddp_amp.cli import app
from ddp_amp.commands.options import option_specs
from ddp_amp.commands.panels import PANELS, SHORT_HELP
from ddp_amp.config import NOT_OPTIONS, TrainConfig

TRAINING_COMMANDS = ("spawn", "run", "multinode", "bench")
OPTIONS = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in NOT_OPTIONS]


def _commands():
    return typer.main.get_command(app).commands


def test_every_train_config_option_is_in_exactly_one_panel():
    placed = Counter(name for names in PANELS.values() for name in names)
    assert [name for name in OPTIONS if placed[name] != 1] == []
    assert [name for name in placed if name not in OPTIONS] == []  # no panel names an option that is gone
    assert set(SHORT_HELP) <= set(OPTIONS)


@pytest.mark.parametrize("name", TRAINING_COMMANDS)
def test_no_panel_of_a_training_command_holds_more_than_12_options(name):
    command = _commands()[name]
    sizes = Counter(getattr(p, "rich_help_panel", None) or "Options" for p in command.params
                    if p.param_type_name == "option")
    assert max(sizes.values()) <= 12, sizes
    # every training option sits in its concern's panel on this command too (bench's own --amp, --shard and
    # --compile replace the training ones)
    panel_of = {name: panel for panel, names in PANELS.items() for name in names}
    misplaced = [p.name for p in command.params if p.name in panel_of and p.rich_help_panel in PANELS
                 and p.rich_help_panel != panel_of[p.name]]
    assert misplaced == []


@pytest.fixture
def help_text(monkeypatch, capsys):
    """`ddp-amp ARGS` (a help) in this process: what it printed on a plain terminal of 120 columns, as rich sees
    one. (`--help` in a fresh interpreter, and what it does not import: tests/unit/test_cli.py.)"""
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("TERM", "dumb")

    def text(*args: str) -> str:
        code, out, err = run_main(list(args), capsys)
        assert code == 0, err
        return out

    return text


@pytest.mark.parametrize("name", TRAINING_COMMANDS)
def test_help_fits_a_screen_and_points_at_the_full_list(name, help_text):
    text = help_text(name, "--help")
    lines = text.rstrip().splitlines()
    assert len(lines) <= 80, f"ddp-amp {name} --help has {len(lines)} lines at 120 columns"
    assert f"ddp-amp {name} --help-all" in lines[-1], lines[-1]
    if name == "bench":  # what bench refuses or a timing has no use for is left to --help-all
        assert "--task-arg" in text and "--warmup" in text
        assert not {"--epochs", "--resume", "--keep-best", "--tracker"} & set(text.split())
    else:
        assert "--tracker" in text and "--keep-best" in text  # the most used ones are there
    assert "--tracker-tag" not in text  # and the others are not


def test_bench_says_what_its_own_steps_and_amp_are(help_text):
    words = " ".join(help_text("bench", "--help").replace("│", " ").split())
    assert "Timed optimizer steps of each precision, after --warmup [default: 30]" in words
    assert "unless --epochs" not in words
    assert "auto: all on a CPU with native bf16, both elsewhere" in words  # bench's --amp, not spawn's
    assert "Timed optimizer steps" in " ".join(help_text("bench", "--help-all").replace("│", " ").split())



@pytest.mark.parametrize("name, default", [("spawn", "runs/<timestamp>"), ("bench", "runs/bench-<timestamp>"),
                                           ("doctor", "runs/doctor-<timestamp>")])
def test_run_dir_help_names_the_directory_the_command_makes(name, default, help_text):
    """bench and doctor keep their launches under runs/bench-... and runs/doctor-..., not a training run's name."""
    words = " ".join(help_text(name, "--help").replace("│", " ").split())
    assert f"[default: {default}]" in words


def test_amp_and_stop_timeout_help_say_what_a_run_does(help_text):
    """--amp auto on CPU ranks is measured (bf16 natively available or not), and a stop is agreed at a step, not
    at the next log interval; show --plot writes what its suffix says."""
    words = " ".join(help_text("spawn", "--help-all").replace("│", " ").split())
    assert "on CPU ranks whichever of fp32, bf16 and bf16-true trains the task fastest, measured at start-up" in words
    assert "on where the device computes bf16 natively" not in words
    assert "agree on a step, write its checkpoint and exit" in words and "next log interval" not in words
    assert ".png, .pdf or .svg" in " ".join(help_text("show", "--help").replace("│", " ").split())

@pytest.mark.parametrize("name", TRAINING_COMMANDS)
def test_help_all_shows_every_option_with_its_whole_help(name, help_text):
    text = help_text(name, "--help-all")
    command = _commands()[name]
    shown = [p for p in command.params if p.param_type_name == "option" and not p.hidden]  # hidden: torchrun's
    flags = [opt for p in shown for opt in p.opts if opt.startswith("--")]
    missing = [flag for flag in flags if f"{flag} " not in text and f"{flag}," not in text]
    assert missing == []
    for spec in option_specs():
        if name != "bench" or spec.name not in ("amp", "shard", "compile"):
            assert spec.flag in text, spec.flag
    assert "--help-all" not in text.rstrip().splitlines()[-1]  # no pointer to itself at the end
    words = " ".join(text.replace("│", " ").split())
    assert "converted by its annotation" in words  # --task-arg's whole help, not its one-line summary


def test_help_all_after_a_script_is_the_scripts_own_argument(tmp_path, capsys):
    """Every word after SCRIPT is the script's: --help-all there is not ddp-amp's."""
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    code, out, err = run_main(["run", "--dry-run", "-n", "2", str(script), "--help-all"], capsys)
    assert code == 0, err
    assert "--help-all" in out and "Show every option" not in out


@pytest.mark.parametrize("spelling", ["--nproc-per-node", "--nproc", "--gpus", "-n", "--nproc_per_node"])
@pytest.mark.parametrize("name", ["spawn", "run", "multinode"])
def test_the_rank_count_is_one_option_under_every_spelling(name, spelling, capsys):
    code, out, err = run_main([name, spelling, "3", "--print-config"], capsys)
    assert code == 0, err
    assert tomllib.loads(out)["nproc_per_node"] == "3"


@pytest.mark.parametrize("spelling", ["--nproc-per-node", "--nproc", "--gpus", "-n", "--nproc_per_node"])
def test_spawn_starts_the_rank_count_it_is_given_under_every_spelling(spelling, monkeypatch, capsys):
    """What reaches the launch: the same count, whichever spelling gave it (torchrun's names too)."""
    import ddp_amp.launch.session as session

    seen = []
    monkeypatch.setattr(session, "spawn_launch", lambda train, output, nproc, script=None: seen.append(nproc))
    code, _, err = run_main(["spawn", spelling, "2", "--device", "cpu"], capsys)
    assert code == 0, err
    assert seen == ["2"]
    nprocs = []

    class Stop(Exception):
        pass

    def preflight(config, *, nproc_per_node, **_):
        nprocs.append(nproc_per_node)
        raise Stop

    monkeypatch.undo()
    monkeypatch.setattr("ddp_amp.launch.preflight.preflight", preflight)
    monkeypatch.setattr(session, "warm_start", lambda train, **_: TrainConfig(**train))
    with pytest.raises(Stop):
        session.spawn_launch({"device": "cpu"}, {"overwrite": False, "run_dir": None}, "cpu")
    assert nprocs == [os.cpu_count() or 1]


def test_a_config_file_from_before_the_rename_still_sets_the_rank_count(tmp_path, capsys):
    config = tmp_path / "old.toml"
    config.write_text("nproc = 2\nlr = 0.01\n")
    code, out, err = run_main(["spawn", "--config", str(config), "--print-config"], capsys)
    assert code == 0, err
    printed = tomllib.loads(out)
    assert printed["nproc_per_node"] == "2" and printed["lr"] == 0.01 and "nproc" not in printed


def test_a_config_file_an_editor_saved_with_a_byte_order_mark_reads_as_without(tmp_path, capsys):
    config = tmp_path / "notepad.toml"
    config.write_bytes(b"\xef\xbb\xbfsteps = 3\nlr = 0.01\n")
    code, out, err = run_main(["spawn", "--config", str(config), "--print-config"], capsys)
    assert code == 0, err
    printed = tomllib.loads(out)
    assert printed["steps"] == 3 and printed["lr"] == 0.01


@pytest.mark.parametrize("text", ['nproc = 2\nnproc_per_node = "3"\n', 'nproc_per_node = "3"\nnproc = 2\n'])
def test_a_config_file_with_both_the_old_and_the_new_name_is_refused_not_one_taken(tmp_path, capsys, text):
    config = tmp_path / "both.toml"
    config.write_text(text)
    code, out, err = run_main(["spawn", "--config", str(config), "--print-config"], capsys)
    assert code == 2 and out == ""
    assert err.splitlines() == [f"ddp-amp: error: --config {str(config)!r} gives nproc and nproc_per_node, one "
                                "option (nproc is its old name): keep one"]


@pytest.mark.parametrize("option", ["tensorboard", "compile", "overwrite", "quiet", "bucket_view"])
def test_a_flag_a_config_file_turns_on_or_off_is_turned_back_on_the_command_line(tmp_path, capsys, option):
    """Flags given on the command line override the file, booleans too: each has its --no- form (before, one
    that defaults to off had none, so a file's `compile = true` could not be undone but by editing the file)."""
    from ddp_amp.commands.options import option_specs

    default = {"overwrite": False, "quiet": False, **{spec.name: spec.default for spec in option_specs()}}[option]
    config = tmp_path / "on.toml"
    config.write_text(f"{option} = {'false' if default else 'true'}\n")
    flag = "--" + option.replace("_", "-")
    code, out, err = run_main(["spawn", "--config", str(config), "--no-" + flag[2:] if not default else flag,
                               "--print-config"], capsys)
    assert code == 0, err
    printed = tomllib.loads(out)
    assert printed[option] is default


def test_print_config_is_flat_toml_grouped_under_each_concern(capsys):
    code, out, err = run_main(["spawn", "-n", "2", "--lr", "0.01", "--tracker", "wandb", "--print-config"], capsys)
    assert code == 0, err
    headings = [line[2:] for line in out.splitlines() if line.startswith("# ")]
    assert headings[:len(PANELS)] == list(PANELS)  # in --help's order, then the command's own
    sections = {block.splitlines()[0][2:]: block for block in out.strip().split("\n\n")}
    assert "lr = 0.01" in sections["Optimization"] and 'tracker = ["wandb"]' in sections["Observability"]
    assert 'nproc_per_node = "2"' in sections["Launch"]
    assert tomllib.loads(out)["lr"] == 0.01


def test_bench_help_gives_the_task_and_batch_it_runs_on_each_device(help_text):
    """bench's --task and --batch-size defaults depend on the device (a GPT-2 small on GPUs): its help said
    mlp-wide and 32 alone, and listed the built-in tasks without mlp-wide."""
    words = " ".join(help_text("bench", "--help-all").replace("│", " ").split())
    assert "[default: (mlp-wide on CPU ranks, gpt size=124m on GPUs)]" in words
    assert "[default: (32 on CPU ranks, 8 on GPUs)]" in words and "mlp, mlp-wide, transformer" in words
    spawn = " ".join(help_text("spawn", "--help-all").replace("│", " ").split())
    assert "[default: mlp]" in spawn and "on GPUs)]" not in spawn
