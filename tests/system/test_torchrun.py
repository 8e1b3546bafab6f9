"""`ddp-amp run` and `ddp-amp multinode`: real torchrun processes, restarts, failures and their verdicts."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import SGD_FP32, assert_ok, assert_weights_close, last_line, launch, load_weights, read_summary, run_cli

from ddp_amp.cli import main

STUB_SRUN = """#!/bin/bash
# Stands in for srun on one machine: starts the command once per "node" of the allocation, locally.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node "$@" > "$STUB_LOG.node$node" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
STUB_SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then for ((i = 0; i < SLURM_NNODES; i++)); do echo localhost; done; fi
if [ "$1" = "requeue" ]; then echo "requeue $2" >> "$STUB_LOG.scontrol"; fi
"""


def test_the_slurm_script_runs_every_node(tmp_path, capsys):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    script, run_dir = tmp_path / "job.sbatch", tmp_path / "run"
    with pytest.raises(SystemExit):
        main(["multinode", "--nnodes", "2", "--endpoint", f"node0:{closed_port()}", "--device", "cpu", "--steps",
              "20", "--checkpoint-every", "10", "--task", "linear", "--run-dir", str(run_dir),
              "--emit-slurm", str(script)])
    env = {**os.environ, "PATH": f"{stubs}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "STUB_LOG": str(tmp_path / "log")}
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text() for p in tmp_path.glob("log.node*"))
    assert result.returncode == 0, result.stderr + logs
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["steps"] == 20
    assert load_weights(run_dir) and sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt")) == \
        ["step-10.pt", "step-20.pt"]
    assert not (tmp_path / "log.scontrol").exists()  # finished: nothing requeued


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_endpoint_fails_fast_with_one_line(tmp_path):
    result = run_cli("multinode", "--nnodes", "2", "--endpoint", f"127.0.0.1:{closed_port()}", "--no-is-host",
                     "--rdzv-timeout", "3", "--device", "cpu", "--run-dir", str(tmp_path / "r"), timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not be reached within 3s" in lines[0], result.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", [["multinode", "--task", "linear"], ["doctor"]], ids=["multinode", "doctor"])
def test_a_node_whose_peers_never_join_fails_after_the_rdzv_timeout_with_a_line_that_says_so(tmp_path, command):
    """The node hosting the store, alone: torch's RendezvousTimeoutError has no message; the verdict names the
    rendezvous, --nnodes and --rdzv-timeout, the command to start on the other nodes, and shows no tail of the
    agent's log."""
    port = closed_port()
    result = run_cli(*command, "--nnodes", "2", "--endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "2",
                     "--device", "cpu", "--run-dir", str(tmp_path / "r"), timeout=120)
    assert result.returncode == 1, result.stderr
    assert last_line(result.stderr).startswith(f"ddp-amp: error: fewer than 2 node(s) (--nnodes 2) joined the "
                                               f"rendezvous at 127.0.0.1:{port}"), result.stderr
    assert f"within --rdzv-timeout 2s: start ddp-amp {command[0]} on the other nodes" in result.stderr
    assert "INFO torch.distributed" not in result.stderr  # the agent's log stays in its file


def test_a_node_whose_rendezvous_host_ends_says_it_lost_the_rendezvous(tmp_path):
    """Two nodes with different training options (so different --rdzv-id) wait in the host node's store; the host
    is killed; the other's verdict says it lost the rendezvous, in one line, without c10d's C++ warnings."""
    port = closed_port()
    common = ["multinode", "--nnodes", "2", "--endpoint", f"127.0.0.1:{port}", "--device", "cpu", "--task", "linear",
              "--rdzv-timeout", "120"]

    def start(steps: str, name: str) -> subprocess.Popen:
        env = {key: value for key, value in os.environ.items() if key != "TORCH_CPP_LOG_LEVEL"}  # a caller's level wins
        return subprocess.Popen([sys.executable, "-m", "ddp_amp", *common, "--steps", steps, "--run-dir",
                                 str(tmp_path / name)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

    def wait_for(condition, job: subprocess.Popen) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline and job.poll() is None, "never got there"
            time.sleep(0.1)

    host = start("5", "host")
    try:
        wait_for(lambda: port_open(port), host)  # the host serves the store: the other node joins it
        other = start("6", "other")
        log = tmp_path / "other" / "logs" / "agent.log"
        wait_for(lambda: log.exists() and "attempts to join" in log.read_text(), other)
        host.kill()
        _, err = other.communicate(timeout=120)
    finally:
        for job in (host, *([other] if "other" in locals() else [])):
            job.kill()
            job.communicate()
    assert other.returncode == 1, err
    assert last_line(err).startswith(f"ddp-amp: error: lost the connection to the rendezvous at 127.0.0.1:{port}"), err
    # c10d's own warnings of the broken store connection (each with ~10 lines of C++ frames) stay out of the launcher's
    # terminal: its last line says it.
    assert "[c10d]" not in err and "frame #" not in err, err


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_two_runs_started_together_do_not_collide_and_match_spawn(tmp_path):
    # Two torchrun jobs at once (each its own loopback rendezvous store on a kernel-chosen port), then spawn.
    commands = [[sys.executable, "-m", "ddp_amp", "run", "--nproc-per-node", "2", *SGD_FP32, "--batch-size", "16",
                 "--run-dir", str(tmp_path / name)] for name in ("a", "b")]
    jobs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in commands]
    for job in jobs:
        _, err = job.communicate(timeout=240)
        assert job.returncode == 0, err
    assert_ok(run_cli("spawn", "--gpus", "2", *SGD_FP32, "--batch-size", "16", "--run-dir", str(tmp_path / "spawn")))
    assert read_summary(tmp_path / "a")["world_size"] == read_summary(tmp_path / "b")["world_size"] == 2
    assert_weights_close(load_weights(tmp_path / "a"), load_weights(tmp_path / "spawn"), rtol=1e-6)
    assert_weights_close(load_weights(tmp_path / "b"), load_weights(tmp_path / "spawn"), rtol=1e-6)


@pytest.mark.parametrize("nnodes", ["2", "2:3"])
def test_multinode_on_one_machine(tmp_path, nnodes):
    """2:3 and no third node: once two have joined and the last call has passed, the job runs with two."""
    port = closed_port()
    commands = [[sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", nnodes, "--nproc-per-node", "1",
                 "--endpoint", f"127.0.0.1:{port}", "--device", "cpu", "--steps", "20", "--rdzv-last-call", "1",
                 "--run-dir", str(tmp_path / name)] for name in ("a", "b")]
    jobs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in commands]
    for job in jobs:
        _, err = job.communicate(timeout=240)
        assert job.returncode == 0, err
    assert read_summary(tmp_path / "a")["world_size"] == read_summary(tmp_path / "b")["world_size"] == 2
    assert (tmp_path / "a" / "model.pt").read_bytes() == (tmp_path / "b" / "model.pt").read_bytes()


def test_a_dry_run_prints_this_launchs_command_and_leaves_an_earlier_run_as_it_was(tmp_path):
    """A finished run (--steps 6, checkpoints at steps 3 and 6): a dry run of --overwrite --steps 3 into it is
    refused in one line and leaves every file of it as it was; into a new run dir, it writes only this launch's
    config.json, and the command it prints, run by hand, trains this launch's 3 steps there."""
    def files_of(run_dir: Path) -> dict[str, tuple[bytes, int, int]]:
        return {str(path.relative_to(run_dir)): (path.read_bytes(), path.stat().st_ino, path.stat().st_mtime_ns)
                for path in sorted(run_dir.rglob("*")) if path.is_file()}

    base, new = tmp_path / "base", tmp_path / "new"
    launch(base, "--device", "cpu", "--steps", "6", "--checkpoint-every", "3", nproc=1, check=True)
    before, listing = files_of(base), sorted(str(path) for path in base.rglob("*"))
    dry = run_cli("run", "-n", "1", "--device", "cpu", "--steps", "3", "--overwrite", "--dry-run", "--run-dir",
                  str(base))
    assert dry.returncode == 2 and dry.stdout == "", dry.stderr
    assert dry.stderr.startswith(f"ddp-amp: error: --dry-run: --run-dir '{base}' holds an earlier run (model.pt")
    assert files_of(base) == before and sorted(str(path) for path in base.rglob("*")) == listing
    dry = run_cli("run", "-n", "1", "--device", "cpu", "--steps", "3", "--dry-run", "--run-dir", str(new))
    assert dry.returncode == 0 and os.listdir(new) == ["config.json"], dry.stderr
    by_hand = subprocess.run(dry.stdout.splitlines()[0], shell=True, capture_output=True, text=True, timeout=240,
                             env={**os.environ, "TMPDIR": str(tmp_path)})  # torchrun leaves its logs in TMPDIR
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    assert read_summary(new)["steps"] == 3 and (new / "model.pt").is_file()
    assert read_summary(base)["steps"] == 6


def test_a_killed_worker_is_restarted(tmp_path, helper_task):
    result = run_cli("run", "--nproc-per-node", "2", "--max-restarts", "1", "--device", "cpu", "--task",
                     helper_task("killed_once"), "--steps", "10", "--log-every", "5", "--run-dir", str(tmp_path),
                     timeout=240)
    assert_ok(result)
    assert read_summary(tmp_path)["steps"] == 10 and read_summary(tmp_path)["restarts"] == 1
    assert [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines()].__len__() == 2
    verdict = last_line(result.stderr)
    assert verdict.startswith("ddp-amp: recovered after 1 restart: rank 1 died with SIGKILL")
    assert verdict.endswith("; restarted from the beginning (no checkpoint)"), result.stderr


@pytest.mark.parametrize(("task", "expected"), [
    ("fail_on_rank1", "rank 1 failed: ValueError: injected failure at step 5"),
    ("killed_once", "rank 1 died with SIGKILL"),  # no restart allowed: the first death ends the job
])
def test_a_failing_run_names_the_rank_that_failed_first(tmp_path, helper_task, task, expected):
    result = run_cli("run", "-n", "2", "--device", "cpu", "--task", helper_task(task), "--steps", "20",
                     "--run-dir", str(tmp_path), timeout=180)
    assert result.returncode == 1, result.stderr
    verdict = last_line(result.stderr)
    assert verdict.startswith(f"ddp-amp: error: {expected} (the agent's log: "), result.stderr


def test_a_finished_rank_leaves_at_the_agents_sigterm_when_a_peer_dies_after_training(tmp_path, helper_task):
    """Rank 1 has finished and waits in torch's wrapper when rank 0 dies in its evaluation: the agent's SIGTERM
    must let rank 1 go at once (without, torch SIGKILLs it 30 s later, and then hung for ever in the close)."""
    result = run_cli("run", "--nproc-per-node", "2", "--max-restarts", "1", "--device", "cpu", "--task",
                     helper_task("dies_in_evaluation_once"), "--steps", "4", "--run-dir", str(tmp_path),
                     timeout=240)
    assert_ok(result)
    assert "forcefully exiting via SIGKILL" not in result.stderr, result.stderr
    assert read_summary(tmp_path)["restarts"] == 1
    assert read_summary(tmp_path)["eval"] == {"evaluated": 1.0}
