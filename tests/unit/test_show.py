"""`ddp-amp show` without launching: bad paths refused in one line, older run dirs shown. Real run directories
read back, compared and plotted: tests/system/test_show_runs.py."""

import subprocess
import sys

import pytest


def show(*args, columns=200):
    return subprocess.run([sys.executable, "-m", "ddp_amp", "show", *map(str, args)], capture_output=True,
                          text=True, timeout=60, env={"COLUMNS": str(columns), "PATH": ""})


@pytest.mark.parametrize("make", ["missing", "file", "not_a_run"])
def test_what_is_not_a_run_dir_is_one_line_exit_2(tmp_path, make):
    path = tmp_path / make
    if make == "file":
        path.write_text("x")
    elif make == "not_a_run":
        path.mkdir()
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
