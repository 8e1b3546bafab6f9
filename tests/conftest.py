import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER_TASKS = Path(__file__).with_name("helper_tasks.py")


def run_cli(*args: str, timeout: float = 180, cwd: Path | None = None, env: dict | None = None):
    """`python -m ddp_amp ARGS` in a subprocess, as a user would run it; output captured."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ddp_amp", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=full_env)


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def load_weights(run_dir: Path) -> dict:
    import torch

    return torch.load(run_dir / "model.pt", weights_only=True)


def last_line(text: str) -> str:
    """The last line a command wrote (where ddp-amp puts its one-line verdict)."""
    return text.strip().splitlines()[-1]


def assert_ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


@pytest.fixture
def helper_task():
    """`--task` spec of a factory in tests/helper_tasks.py."""
    return lambda name: f"{HELPER_TASKS}:{name}"
