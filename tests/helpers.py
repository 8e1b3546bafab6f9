"""What the tests share, imported by name (`from helpers import launch, read_summary`): paths, the ways to run
ddp-amp as a user does (in this process, as a command, a launch, a script's launch, one that is signalled once it
trains), and readers of what a run leaves. Fixtures and pytest's hooks are in conftest.py."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TASKS = TESTS / "tasks"
"""Tasks the tests train, each file loaded by the ranks through `--task path/to/file.py:factory` like a user's own:
helper_tasks.py (shaped for one behaviour each) and user_tasks.py (shaped as users write them)."""
HELPER_TASKS = TASKS / "helper_tasks.py"
ORIGIN_SCRIPT = TASKS / "origin_ddp.py"
"""The example this project grew from, as a torchrun script for CPU ranks."""
CHECKS_SCRIPT = TASKS / "script_checks.py"
"""A user's script with ways to fail, hang, record signals and its environment."""
USER_TASKS = TASKS / "user_tasks.py"
BENCHMARK_TASKS = TESTS.parent / "benchmarks" / "tasks.py"
sys.path.insert(0, str(TASKS))  # so that tests can import what a task file exports (its constants, its classes)



def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous endpoint a test names itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line(err: str) -> str:
    """ddp-amp's refusal: exactly one line, `ddp-amp: error: ...`, and no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddp-amp: error: "), err
    assert "Traceback" not in err
    return lines[0]


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    """`ddp-amp ARGS` in this process, through the CLI's own main(): (exit code, stdout, stderr). For what the
    launcher decides before any rank starts; the unit tier makes sure nothing launches."""
    from ddp_amp.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def run_cli(*args: str, timeout: float = 180, cwd: Path | None = None, env: dict | None = None,
            own_session: bool = False):
    """`python -m ddp_amp ARGS` in a subprocess, as a user would run it; output captured. `own_session`: in a
    session and process group of its own, as `setsid` starts it (a task that signals its whole group must not
    reach pytest)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ddp_amp", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=full_env, start_new_session=own_session)


SGD_FP32 = ["--device", "cpu", "--amp", "off", "--optimizer", "sgd", "--lr", "0.05", "--schedule", "constant",
            "--steps", "20", "--seed", "3", "--log-every", "5"]
"""A short fp32 SGD run: its result is exact enough to compare across launchers and rank counts."""


def launch(run_dir: Path, *args: str, command: str = "spawn", nproc: int = 2, env: dict | None = None,
           timeout: float = 300, own_session: bool = False, check: bool = False):
    """One training launch as a user types it: `ddp-amp COMMAND -n NPROC ARGS --run-dir RUN_DIR`, waited for and
    its output captured (run_cli). `check`: fail the test unless it exits 0."""
    result = run_cli(command, "-n", str(nproc), *args, "--run-dir", str(run_dir), timeout=timeout, env=env,
                     own_session=own_session)
    if check:
        assert_ok(result)
    return result


def launch_script(run_dir: Path, script: Path | str, *script_args: str, command: str = "spawn", nproc: int = 2,
                  options: tuple[str, ...] = (), env: dict | None = None, timeout: float = 300,
                  own_session: bool = False, cwd: Path | None = None):
    """A user's script launched as a user types it: `ddp-amp COMMAND -n NPROC OPTIONS --run-dir RUN_DIR SCRIPT
    ARGS` (the script and its arguments last), waited for, its output captured."""
    return run_cli(command, "-n", str(nproc), *options, "--run-dir", str(run_dir), str(script), *script_args,
                   timeout=timeout, env=env, own_session=own_session, cwd=cwd)


def assert_weights_close(a: dict, b: dict, rtol: float) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=rtol * b[key].abs().max().item())


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_metrics(run_dir: Path, evaluations: bool = False) -> list[dict]:
    """metrics.jsonl's training records (those with a loss), or with `evaluations` its validation records (those
    with a val_loss: --eval-every's, and the one at the end of every run whose task has a validation set)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if ("val_loss" if evaluations else "loss") in r]


def load_weights(run_dir: Path) -> dict:
    import torch

    return torch.load(run_dir / "model.pt", weights_only=True)


def ddp_amps_run_dir(run_dir: Path, files: dict[str, bytes] | None = None) -> Path:
    """A run dir as an earlier launch of ddp-amp leaves it: its config.json (by which ddp-amp knows a run dir of
    its own: launch.run_dir.files_not_ddp_amps) and `files`, each NAME: bytes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({"launch_time": 1.0, "run_dir": str(run_dir)}))
    for name, data in (files or {}).items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
    return run_dir


def pretrained_weights() -> dict:
    """The weights of tests/tasks/user_tasks.py:saves_pretrained's model (a Linear(8, 1)), as its run left them."""
    import torch

    return {"linear.weight": torch.ones(1, 8), "linear.bias": torch.zeros(1)}


def finished_run_dir(tmp_path: Path, task: str, weights: dict) -> Path:
    """A finished run's directory as export reads it: its config (the task) and its model.pt."""
    from ddp_amp.outputs import save_weights

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"task": task, "task_arg": [], "seed": 0}))
    (run_dir / "summary.json").write_text("{}")
    (run_dir / "config.toml").write_text('task = "mlp"\n')
    save_weights(run_dir, weights)
    return run_dir


def last_line(text: str) -> str:
    """The last line a command wrote (where ddp-amp puts its one-line verdict)."""
    return text.strip().splitlines()[-1]


def assert_ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


LONG_RUN = ["--device", "cpu", "--task", "linear", "--steps", "100000", "--log-every", "1", "--log-format", "plain"]
MARK_VAR = "DDP_AMP_TEST_RUN_MARK"


def run_processes(mark: str) -> list[int]:
    """PIDs of the live processes that carry `mark` in their environment: the launcher and everything it
    started, at any depth, in any session (torchrun starts its workers in sessions of their own)."""
    needle = f"{MARK_VAR}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def parent_of(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


class LongRun:
    """A launch that would train for a long time, returned once it is training (a file matching the glob `ready`
    exists in the run dir: a pattern, since a checkpoint that --keep prunes can come and go between two polls).

    `prefix`: a command the launch runs under (`timeout`); `own_session`: in a session and process group of its
    own, as `setsid` starts it, so that a signal can be sent to the whole group the way the system sends it;
    `env`: more environment variables."""

    def __init__(self, command: str, run_dir: Path, nproc: int = 2, args: list[str] = LONG_RUN, *,
                 prefix: list[str] = (), own_session: bool = False, ready: str = "metrics.jsonl",
                 env: dict | None = None) -> None:
        self.mark = uuid.uuid4().hex
        self.run_dir = run_dir
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "ddp_amp", command, "-n", str(nproc), *args, "--run-dir", str(run_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=own_session,
            env={**os.environ, **(env or {}), MARK_VAR: self.mark})
        deadline = time.monotonic() + 120
        while not any(run_dir.glob(ready)):
            assert self.process.poll() is None, self.process.stderr.read()
            assert time.monotonic() < deadline, "the run never started training"
            time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self.process.pid

    def processes(self) -> list[int]:
        return run_processes(self.mark)

    def ranks(self) -> list[int]:
        """The training processes: the children of the fork server. They carry its command line (forked, not
        exec'd); the fork server itself is the one whose parent does not. Not the store keeper beside them
        (spawn's rendezvous store, launch.processes.StoreKeeper), which names itself."""
        from ddp_amp.launch.processes import STORE_PROCESS_NAME

        def forked_from_server(pid: int) -> bool:
            return b"multiprocessing.forkserver" in (Path("/proc") / str(pid) / "cmdline").read_bytes()

        live = [pid for pid in self.processes() if forked_from_server(pid)]
        servers = {pid for pid in live if parent_of(pid) not in live}
        return sorted(pid for pid in live if parent_of(pid) in servers
                      and (Path("/proc") / str(pid) / "comm").read_text().strip() != STORE_PROCESS_NAME)

    def wait_until_gone(self, timeout_s: float = 20) -> list[int]:
        """Polls until no process of the run is alive; returns those still alive after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


def start_launch(run_dir: Path, *args: str, command: str = "spawn", nproc: int = 2, env: dict | None = None,
                 mark: str | None = None, own_session: bool = False, stdout=subprocess.PIPE) -> subprocess.Popen:
    """A launch as a user types it (`ddp-amp COMMAND -n NPROC --run-dir RUN_DIR ARGS`; ARGS may end with a script
    and its arguments), started and not waited for: the test signals it, kills it or waits itself. `mark`: put
    in its environment, so run_processes(mark) finds everything it started; `own_session`: in a session and
    process group of its own, as `setsid` starts it. Its stderr is a pipe; stdout a pipe unless DEVNULL is asked
    for (a long run whose output the test does not read must not fill a pipe)."""
    extra = {MARK_VAR: mark} if mark else {}
    return subprocess.Popen([sys.executable, "-m", "ddp_amp", command, "-n", str(nproc), "--run-dir", str(run_dir),
                             *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                            start_new_session=own_session,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), **extra})


def launch_until(run_dir: Path, *args: str, command: str = "spawn", nproc: int = 2,
                 until: int | Callable[[], bool] = 1, deliver: Callable[[subprocess.Popen], None] | None = None,
                 env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """A launch (start_launch's) stopped once it got as far as `until` says (a number: metrics.jsonl holds that
    many lines; else a condition to poll): `deliver(process)` (default SIGTERM to the launcher, as a terminal's
    or a scheduler's stop reaches it), then waited for; its output captured. Fails the test when the launch
    ended first."""
    process = start_launch(run_dir, *args, command=command, nproc=nproc, env=env)
    metrics = run_dir / "metrics.jsonl"
    reached = until if callable(until) else \
        lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= until
    deadline = time.monotonic() + timeout
    while not reached():
        if process.poll() is not None or time.monotonic() > deadline:
            out, err = process.communicate(timeout=timeout) if process.poll() is not None else ("", "timed out")
            pytest.fail(f"the launch never got there (exit {process.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.02)
    if deliver is None:
        process.send_signal(signal.SIGTERM)
    else:
        deliver(process)
    out, err = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
