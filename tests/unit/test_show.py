"""`ddp-amp show` without launching: bad paths refused in one line, older run dirs shown. Real run directories
read back, compared and plotted: tests/system/test_show_runs.py."""

import os
import subprocess
import sys

import pytest


def show(*args, columns=200):
    where = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}  # this checkout's code
    return subprocess.run([sys.executable, "-m", "ddp_amp", "show", *map(str, args)], capture_output=True,
                          text=True, timeout=60, env={"COLUMNS": str(columns), "PATH": "", **where})


@pytest.mark.parametrize("make", ["missing", "file", "not_a_run", "config_a_list", "summary_a_list",
                                  "metrics_a_number"])
def test_what_is_not_a_run_dir_is_one_line_exit_2(tmp_path, make):
    path = tmp_path / make
    if make == "file":
        path.write_text("x")
    elif make != "missing":
        path.mkdir()
    if make.endswith("_a_list") or make.endswith("_a_number"):  # valid JSON, not the object ddp-amp writes
        (path / "config.json").write_text("[]" if make == "config_a_list" else "{}")
        (path / "summary.json").write_text("[]" if make == "summary_a_list" else "{}")
        (path / "metrics.jsonl").write_text('{"step": 1}\n3\n' if make == "metrics_a_number" else "")
    result = show(path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp-amp: error: show: ") and str(path) in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_an_option_an_older_run_lacks_is_shown_as_not_recorded():
    from pathlib import Path

    from ddp_amp.results.runs import Run, config_differences

    older = Run(Path("older"), {"lr": 0.003, "run_dir": "older"}, {}, [], "finished")
    newer = Run(Path("newer"), {"lr": 0.003, "flush_denormal": "auto", "max_memory": None, "run_dir": "newer"}, {},
                [], "finished")
    assert config_differences([older, newer]) == {"flush_denormal": ["(not recorded)", "auto"],
                                                  "max_memory": ["(not recorded)", None]}
    assert config_differences([newer, newer]) == {}


def test_beside_a_task_run_a_scripts_run_differs_only_in_what_both_trained_with():
    """A plain script's config.json holds ddp-amp's loop's defaults (--task mlp, --steps 100) it never ran, and
    the launchers' own fields (job_id) are no options: neither is listed as differing; a difference between the
    runs that used an option is, with "-" for the script's run."""
    from pathlib import Path

    from ddp_amp.outputs import RunRecord
    from ddp_amp.results.runs import Run, config_differences

    task = Run(Path("task"), {"task": "linear", "steps": 5, "device": "cpu", "job_id": "a"}, RunRecord({}), [],
               "finished")
    script = Run(Path("script"), {"task": "mlp", "steps": 100, "device": "cpu", "job_id": "b", "script": {
        "target": "train.py", "args": []}}, RunRecord({"outcome": "finished"}), [], "finished")
    assert config_differences([task, script]) == {}
    other = Run(Path("other"), {"task": "mlp", "steps": 5, "device": "cpu"}, RunRecord({}), [], "finished")
    assert config_differences([task, script, other]) == {"task": ["linear", "-", "mlp"]}


def test_a_loop_scripts_run_shows_its_precision_steps_and_loss_of_its_reported_metrics(tmp_path):
    """A script run through ddp_amp.loop: its summary's `loop` gives the precision and the steps, its metrics.jsonl
    (report()'s names, a GAN's loss_d and loss_g) the final loss, named, and the curve."""
    import json

    run = tmp_path / "gan"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"script": {"target": "own_loop.py", "args": ["--steps", "30"]}}))
    (run / "summary.json").write_text(json.dumps({
        "outcome": "stopped", "world_size": 2, "wall_s": 4.0,
        "loop": {"precision": "bf16", "last_reported_step": 30, "stopped_at_step": 27}}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "loss_g": 0.7, "loss_d": 1.0 / step}) + "\n"
                                               for step in (10, 20, 30)))
    result = show(run, columns=60)  # turned: one row per figure
    assert result.returncode == 0, result.stderr
    cells = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in result.stdout.splitlines()
             if line.count("│") == 3}
    assert cells["precision"] == "bf16" and cells["steps"] == "27" and cells["final loss"] == "0.0333 (loss_d)"
    assert cells["runs"] == "own_loop.py --steps 30" and cells["loss curve"]


def test_plain_script_runs_differ_only_in_what_a_script_takes_and_a_failure_says_why(tmp_path):
    """Two plain-script runs whose config.json hold other defaults of ddp-amp's loop (--amp, --log-every: a
    script does not run that loop): only the script and --stop-timeout are listed as differing; the failed
    run's line says why it failed, the stopped loop script's at which step."""
    import json

    base = {"amp": "auto", "log_every": 10, "stop_timeout": 60.0, "device": "auto"}
    runs = {
        "ok": ({**base, "script": {"target": "train.py", "args": []}}, {"outcome": "finished", "world_size": 2}),
        "bad": ({**base, "amp": "on", "log_every": 5, "stop_timeout": 9.0, "script": {"target": "train.py",
                 "args": ["--lr", "1"]}}, {"outcome": "failed", "world_size": 2,
                                           "failure": "rank 1 failed: ValueError: no"}),
    }
    for name, (config, summary) in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    result = show(tmp_path / "ok", tmp_path / "bad")
    assert result.returncode == 0, result.stderr
    assert "bad failed: rank 1 failed: ValueError: no" in result.stdout.splitlines()
    options = [line.split("│")[1].strip() for line in result.stdout.split("options that differ")[1].splitlines()
               if line.count("│") == 4]
    assert options == ["SCRIPT", "--stop-timeout"], result.stdout


def test_a_runs_mfu_is_shown_beside_its_throughput(tmp_path):
    import json

    run = tmp_path / "gpt"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"task": "gpt"}))
    (run / "summary.json").write_text(json.dumps({
        "task": "gpt", "world_size": 2, "steps": 20, "precision": "bf16", "samples_per_s": 170.0,
        "final_loss": 2.9, "wall_s": 17.0, "mfu": 0.4037, "model_path": str(run / "model.pt")}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 20, "loss": 2.9}) + "\n")
    result = show(run, columns=60)
    assert result.returncode == 0, result.stderr
    cells = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in result.stdout.splitlines()
             if line.count("│") == 3}
    assert cells["MFU"] == "40.4%" and cells["samples/s"] == "170"


@pytest.mark.parametrize(("steps", "shown"), [(100, "0/100"), (None, "0")])
def test_a_run_that_has_logged_nothing_yet_shows_its_steps_without_none(tmp_path, steps, shown):
    """A launch killed before its first log (or one still starting): config.json alone. An --epochs run's
    config has no step count: its total is not known."""
    import json

    run = tmp_path / "starting"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"task": "mlp", "steps": steps}))
    result = show(run, columns=60)
    assert result.returncode == 0, result.stderr
    cells = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in result.stdout.splitlines()
             if line.count("│") == 3}
    assert cells["state"] == "unfinished" and cells["steps"] == shown


def test_a_metrics_file_cut_mid_line_shows_its_whole_lines_and_a_resume_cuts_it_clean(tmp_path):
    """metrics.jsonl ending in half a line (a write the machine did not finish): show reads the whole lines
    before it, and the resume's cut drops it, so the next line appended starts a line of its own. Half a line
    anywhere else is still damage (exit 2)."""
    import json

    from ddp_amp.outputs import append_metrics, cut_metrics

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"steps": 30}))
    whole = "".join(json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in (10, 20))
    (run / "metrics.jsonl").write_text(whole + '{"step": 30, "lo')
    result = show(run)
    assert result.returncode == 0, result.stderr
    assert "20/30" in result.stdout and "0.0500" in result.stdout
    cut_metrics(run, 20)
    append_metrics(run, {"step": 30, "loss": 0.03})
    assert (run / "metrics.jsonl").read_text() == whole + json.dumps({"loss": 0.03, "step": 30}) + "\n"
    (run / "metrics.jsonl").write_text('{"step": 5, "lo\n' + whole)
    assert show(run).returncode == 2


def test_runs_of_the_same_folder_name_are_named_by_the_parts_of_their_paths_that_differ(tmp_path):
    """sweep/a/run, sweep/b/run and other/run, shown together: each is named by as many of its path's last parts
    as tell it apart from the others (a/run, b/run, other/run: before, three columns headed "run"); a run of
    another name keeps its own."""
    from pathlib import Path

    from ddp_amp.outputs import RunRecord
    from ddp_amp.results.runs import Run, name_apart

    paths = [tmp_path / "sweep" / "a" / "run", tmp_path / "sweep" / "b" / "run", tmp_path / "other" / "run",
             tmp_path / "solo"]
    runs = name_apart([Run(path, {}, RunRecord({}), [], "finished") for path in paths])
    assert [run.name for run in runs] == [str(Path("a", "run")), str(Path("b", "run")), str(Path("other", "run")),
                                          "solo"]
    for path in paths[:2]:  # and as the command shows them
        path.mkdir(parents=True)
        (path / "config.json").write_text('{"task": "mlp"}')
        (path / "summary.json").write_text("{}")
    result = show(*paths[:2])
    assert result.returncode == 0, result.stderr
    assert str(Path("a", "run")) in result.stdout and str(Path("b", "run")) in result.stdout, result.stdout


def test_turned_tables_hold_every_word_whole_within_the_width():
    """A run whose eval text is long beside a script's run with a long word: every line of the turned tables
    within 80 columns, closed by its border, and every word of every cell whole (rich, left to size the columns,
    narrowed them evenly and widened some back to their minimum: 16 lines cropped, "bf" for "bf16")."""
    import io

    from rich.console import Console

    from ddp_amp.results.runs_view import _turned

    headers = ["run", "state", "runs", "precision", "steps", "eval"]
    rows = [["a", "finished", "mlp", "fp32", "12",
             "val_loss 1.2345, val_accuracy 0.9876, val_perplexity 3.4560, val_top5 0.99"],
            ["b", "finished", "examples/scripts/train_gan_loop.py --epochs 3", "bf16", "12", "-"]]
    console = Console(width=80, file=io.StringIO(), record=True)
    for table in _turned(headers, rows, 80):
        console.print(table)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert all(line.rstrip().endswith(("│", "┃", "┓", "┫", "┩", "┘", "┛")) for line in lines
               if line.startswith(("│", "┃", "┏", "┡", "└"))), "\n".join(lines)
    text = " ".join(lines)
    for word in [word for row in rows for cell in row[1:] for word in cell.split()]:
        assert word in text, word
