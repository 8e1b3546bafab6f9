"""Progress of real runs: what a terminal, a pipe and the JSON lines show of 2-rank launches."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import assert_ok, run_cli


def test_json_format_emits_one_object_per_event(tmp_path):
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--steps", "20", "--log-format", "json",
                     "--run-dir", str(tmp_path))
    assert_ok(result)
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert {e["rank"] for e in events} == {0, 1}
    for rank in (0, 1):
        mine = [e for e in events if e["rank"] == rank]
        assert [e["step"] for e in mine if e["type"] == "log"] == [10, 20]
        assert mine[-1]["type"] == "done"


def test_spawn_piped_prints_every_rank_every_interval_and_a_summary(tmp_path):
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--steps", "30", "--run-dir", str(tmp_path))
    assert_ok(result)
    for rank in (0, 1):
        for step in (10, 20, 30):
            assert f"[rank {rank}] step {step}/30 loss " in result.stdout
        assert f"[rank {rank}] done: 30 steps" in result.stdout
    assert f"wrote {tmp_path}/model.pt" in result.stdout
    assert (tmp_path / "logs" / "rank1.log").exists()


def test_quiet_prints_only_the_summary(tmp_path):
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--steps", "20", "--quiet", "--run-dir", str(tmp_path))
    assert_ok(result)
    assert "step 10/20" not in result.stdout
    assert "[rank 1] done: 20 steps" in result.stdout


@pytest.mark.skipif(shutil.which("script") is None, reason="util-linux `script` is not installed")
def test_rich_display_under_a_terminal_shows_a_row_per_rank(tmp_path):
    command = (f"{sys.executable} -m ddp_amp spawn -n 2 --device cpu --steps 40 --log-every 10 "
               f"--run-dir {tmp_path / 'run'}")
    typescript = tmp_path / "screen.log"
    env = {**os.environ, "COLUMNS": "120", "LINES": "40", "TERM": "xterm"}
    result = subprocess.run(["script", "-qfec", command, str(typescript)], capture_output=True, text=True,
                            timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    screen = typescript.read_text(errors="replace")
    assert "\x1b[" in screen, "expected a live terminal display"
    assert "all ranks: loss" in screen
    summary = screen[screen.index("summary"):]
    assert "│    0 │" in summary and "│    1 │" in summary


