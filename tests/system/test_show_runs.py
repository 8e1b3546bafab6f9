"""`ddp-amp show`: real run directories read back, compared, plotted, at every terminal width."""

import os
import subprocess
import sys

import pytest
from helpers import assert_ok, run_cli

from ddp_amp.files import DirectoryLock


def show(*args, columns=200):
    where = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}  # this checkout's code
    return subprocess.run([sys.executable, "-m", "ddp_amp", "show", *map(str, args)], capture_output=True,
                          text=True, timeout=60, env={"COLUMNS": str(columns), "PATH": "", **where})


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for name, lr in (("fast", "0.003"), ("slow", "0.001"), ("slowest-of-the-three", "0.0003")):
        assert_ok(run_cli("spawn", "-n", "1", "--device", "cpu", "--steps", "12", "--log-every", "3", "--lr", lr,
                          "--run-dir", str(root / name)))
    return root / "fast", root / "slow", root / "slowest-of-the-three"


def test_two_runs_side_by_side_with_their_differences_and_a_plot(two_runs, tmp_path):
    plot = tmp_path / "runs.png"
    result = show(*two_runs[:2], "--plot", plot)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "fast" in out and "slow" in out and out.count("finished") == 2
    assert "options that differ" in out and "--lr" in out and "0.003" in out and "0.001" in out
    assert "1.00x" in out  # the first run against itself
    assert any(ch in out for ch in "▁▂▃▄▅▆▇█")  # the loss curves
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_in_progress_is_shown_with_what_it_has_so_far(two_runs, tmp_path):
    running = tmp_path / "running"
    running.mkdir()
    finished = two_runs[0]
    (running / "config.json").write_text((finished / "config.json").read_text())
    (running / "metrics.jsonl").write_text("".join((finished / "metrics.jsonl").read_text().splitlines(True)[:2]))
    lock = DirectoryLock(running)  # as a launch holds it
    try:
        result = show(running)
    finally:
        lock.release()
    assert result.returncode == 0, result.stderr
    assert "in progress" in result.stdout and "6/12" in result.stdout


@pytest.mark.parametrize("width", [80, 100, 140])
def test_every_number_is_whole_at_a_terminals_width(two_runs, width):
    """Rendered as a terminal of that width renders it: each run's samples/s and final loss appear in full,
    and nothing is cut short with an ellipsis."""
    from rich.console import Console

    from ddp_amp.results.runs import load_run
    from ddp_amp.results.runs_view import runs_table

    runs = [load_run(path) for path in two_runs]
    console = Console(width=width, record=True, file=open(os.devnull, "w"))
    console.print(runs_table(runs, width=width))
    text = console.export_text()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    for run in runs:
        assert f"{run.summary.samples_per_s:.0f}" in text
        assert f"{run.summary.final_loss:.4f}" in text
    result = show(*two_runs, columns=width)  # the command itself, at that width
    assert result.returncode == 0 and "…" not in result.stdout, result.stdout


def test_eight_runs_at_100_columns_are_shown_in_tables_that_cut_no_word(two_runs, tmp_path):
    """Eight runs do not fit 100 columns side by side: the turned table is split so that each run's column
    holds its longest word ("finished", "val_accuracy", the loss curve) whole, every line within the width
    (before: one table whose columns folded "finishe|d" and "val_accu|racy")."""
    import shutil

    copies = [shutil.copytree(two_runs[index % 3], tmp_path / f"run{index}") for index in range(8)]
    result = show(*copies, columns=100)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert sum(line.count("finished") for line in lines) == 8
    assert sum(line.count("val_accuracy") for line in lines) == 8
    assert [line.strip() for line in lines if line.startswith("ddp-amp runs")] == ["ddp-amp runs (1 of 2)",
                                                                                    "ddp-amp runs (2 of 2)"]


def test_a_loop_scripts_options_are_shown_as_its_loop_ran_them(tmp_path):
    """examples/own_loop.py calls setup(checkpoint_every=50): a launch without --checkpoint-every checkpoints every
    50 steps, and show says 50 (config.json holds the command line's 0), beside a launch given
    --checkpoint-every 25 (the command line wins over setup()'s default); the --keep both were given is the same."""
    from helpers import TESTS, launch_script

    example = TESTS.parent / "examples" / "own_loop.py"
    runs = {"setup": tmp_path / "setup", "flag": tmp_path / "flag"}
    for name, options in (("setup", ()), ("flag", ("--checkpoint-every", "25"))):
        assert_ok(launch_script(runs[name], example, "--steps", "50", nproc=1,
                                options=("--device", "cpu", "--keep", "3", *options)))
    assert sorted(p.name for p in (runs["setup"] / "checkpoints").glob("*.pt")) == ["step-50.pt"]
    result = show(runs["setup"], runs["flag"])
    assert result.returncode == 0, result.stderr
    differing = {cells[1].strip(): [c.strip() for c in cells[2:4]]
                 for cells in (line.split("│") for line in result.stdout.split("options that differ")[1].splitlines())
                 if len(cells) == 5}
    assert differing == {"--checkpoint-every": ["50", "25"]}, result.stdout
