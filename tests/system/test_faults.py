"""Real signals against real launches: whatever dies, no process of the run is left behind."""

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import HELPER_TASKS, assert_ok, last_line, read_metrics, read_summary, run_cli

pytestmark = pytest.mark.slow

@pytest.fixture
def launch_tmpdir():
    """A TMPDIR of the test's own for a launch, short (under /tmp, as a user's is): under a long one (a test's
    tmp_path) the fork server's socket directory goes to /tmp itself (launch.forkserver), out of the test's sight."""
    directory = Path(tempfile.mkdtemp(prefix="ddp-amp-test-tmp-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


# What torch itself keeps in TMPDIR for later runs, on purpose: the compiler's cache.
TORCH_CACHES = ("torchinductor_",)


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_killing_the_launcher_kills_the_whole_run(command, tmp_path, long_run, launch_tmpdir):
    """SIGKILL to the launcher: nothing of the run keeps running, and nothing it put in TMPDIR stays there (the
    fork server's socket directory; under run the agent's directory), though no clean-up ran in the launcher."""
    run = long_run(command, env={"TMPDIR": str(launch_tmpdir)})
    assert len(run.processes()) >= 4  # launcher, 2 ranks, and the fork server or the torchrun agent
    assert any(launch_tmpdir.rglob("listener-*")), "the fork server's socket is not under TMPDIR"
    # While it runs: every socket the run listens on is on loopback (one run serves both checks, to keep the
    # suite short): the launcher's rendezvous store and event channel, gloo's pairs, the workers' store.
    addresses = listening_addresses(run.processes())
    assert len(addresses) >= 4, addresses
    assert all(address.startswith(("127.", "::1:")) for address in addresses), addresses
    run.process.kill()
    run.process.wait()
    assert run.wait_until_gone() == [], "processes of the run outlived its launcher"
    assert not (tmp_path / "model.pt").exists()
    left = [path.name for path in launch_tmpdir.iterdir() if not path.name.startswith(TORCH_CACHES)]
    assert left == [], f"left in TMPDIR: {left}"


@pytest.mark.parametrize("how", ["SIGKILL to the launcher", "SIGINT to the group"])
def test_a_launch_stopped_while_its_checks_build_the_task_leaves_nothing_running(how, tmp_path, long_run):
    """The launcher builds the task for its checks in a child of the fork server (launch.forkserver.call_warm):
    killed, or Ctrl-C'd, while the factory runs, nothing of it is left, and nothing is written in the run dir."""
    marker = tmp_path / "building"  # the factory writes it in the run dir, which holds nothing else
    run = long_run("spawn", tmp_path, args=["--device", "cpu", "--task", f"{HELPER_TASKS}:slow_to_build",
                                            "--task-arg", f"marker={marker}", "--steps", "2"],
                   ready="building", own_session=how.endswith("group"))
    builder = int(marker.read_text())
    assert builder != run.pid and builder in run.processes()  # built in a child, not in the launcher
    if how.endswith("group"):
        os.killpg(run.pid, signal.SIGINT)
        assert run.process.wait(timeout=30) == 130, run.process.stderr.read()
    else:
        run.process.kill()
        run.process.wait()
    assert run.wait_until_gone() == [], "processes of the launch outlived it"
    assert [p.name for p in tmp_path.iterdir()] == ["building"]


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_sigterm_stops_every_rank_with_one_line_and_exit_143(command, long_run):
    run = long_run(command)
    run.process.terminate()
    _, stderr = run.process.communicate(timeout=60)
    assert run.process.returncode == 143, stderr
    verdict = last_line(stderr)
    assert verdict.startswith("ddp-amp: error: stopped by SIGTERM"), stderr
    assert "Traceback" not in stderr
    assert run.wait_until_gone() == []


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_a_killed_ranks_verdict_says_where_the_work_is(command, tmp_path, helper_task):
    """Rank 1 SIGKILLed in its third step, after the checkpoint of step 2: the verdict names it and, as a loop
    script's does, the checkpoint to continue from and how."""
    run = tmp_path / "run"
    result = run_cli(command, "-n", "2", "--device", "cpu", "--task", helper_task("killed_once"), "--steps", "10",
                     "--checkpoint-every", "2", "--no-async-checkpoint", "--run-dir", str(run), timeout=180)
    assert result.returncode == 1, result.stderr
    verdict = last_line(result.stderr)
    assert "rank 1 " in verdict and "SIGKILL" in verdict, verdict
    assert f"; the newest complete checkpoint is {run / 'checkpoints' / 'step-2.pt'} (continue with --resume auto " \
           f"--run-dir {run})" in verdict, verdict
    # The ranks wrote no summary.json: the launcher's holds the verdict, which show gives as the run's state
    record = read_summary(run)
    assert record["launch_failure"] == verdict.removeprefix("ddp-amp: error: ") and record["world_size"] == 2
    shown = run_cli("show", str(run), env={"COLUMNS": "1000"})
    assert shown.returncode == 0 and f"run failed: {record['launch_failure']}" in shown.stdout, shown.stdout
    # and the resume it names counts this launch
    assert_ok(run_cli(command, "-n", "2", "--device", "cpu", "--task", helper_task("killed_once"), "--steps", "10",
                      "--checkpoint-every", "2", "--no-async-checkpoint", "--resume", "auto", "--run-dir", str(run),
                      env={"DDP_AMP_TEST_SPARED": "1"}, timeout=180))
    assert read_summary(run)["launches"] == 2 and "launch_failure" not in read_summary(run)


def test_a_second_launch_into_a_busy_run_dir_is_refused(tmp_path, long_run):
    first = long_run("spawn")
    second = run_cli("spawn", "-n", "2", "--device", "cpu", "--steps", "5", "--run-dir", str(tmp_path))
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"in use by another ddp-amp launch (pid {first.pid})" in lines[0]
    assert first.process.poll() is None, "the refused launch disturbed the running one"

    # The first launch dies without cleaning up: its lock goes with it, its metrics stay.
    first.process.kill()
    first.process.wait()
    assert first.wait_until_gone() == []
    old_lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    again = run_cli("spawn", "-n", "2", "--device", "cpu", "--steps", "5", "--run-dir", str(tmp_path))
    assert again.returncode == 2 and "holds an earlier run (metrics.jsonl); continue it with --resume auto, start " \
        "over in it with --overwrite" in again.stderr
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == old_lines  # refused: nothing touched
    fresh = run_cli("spawn", "-n", "2", "--device", "cpu", "--steps", "5", "--log-every", "1", "--overwrite",
                    "--run-dir", str(tmp_path))
    assert fresh.returncode == 0, fresh.stderr
    assert [record["step"] for record in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]


def test_temporary_files_of_a_killed_write_are_removed_at_the_next_launch(tmp_path):
    """A temporary file names its writer (host and pid): a dead writer's is debris, a live one's (another node
    writing into a shared run dir) is left alone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    leftover = tmp_path / f".model.pt.{host}.{dead.pid}.k3j2h1.tmp"
    leftover.write_bytes(b"\0" * 4096)  # what a kill during the save of model.pt leaves
    in_flight = tmp_path / f".summary.json.{host}.{os.getpid()}.x8f2q0.tmp"  # a live writer's (this process)
    in_flight.write_bytes(b"{")
    result = run_cli("spawn", "-n", "1", "--device", "cpu", "--steps", "3", "--run-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert not leftover.exists()
    assert list(tmp_path.glob(".*.tmp")) == [in_flight]


def test_a_killed_writer_not_yet_reaped_is_dead_for_the_cleanup(tmp_path):
    """A writer killed with its parent is a zombie until init reaps it: kill(pid, 0) still answers, but it will
    never write again, so its temporary file is debris (a relaunch right after a kill -9 of a job found one)."""
    from ddp_amp.files import remove_partial_writes

    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 30
    while (Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
           and time.monotonic() < deadline):
        time.sleep(0.01)  # exited, not waited for: a zombie
    host = socket.gethostname()
    leftover = tmp_path / f".step-4.pt.{host}.{zombie.pid}.k3j2h1.tmp"
    leftover.write_bytes(b"\0" * 4096)
    live = tmp_path / f".step-6.pt.{host}.{os.getpid()}.x8f2q0.tmp"
    live.write_bytes(b"\0")
    assert remove_partial_writes(tmp_path) == [leftover]
    assert list(tmp_path.glob(".*.tmp")) == [live]
    zombie.wait()


def listening_addresses(pids: list[int]) -> list[str]:
    """The local addresses of the TCP sockets these processes listen on, as "address:port"."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address_hex, port_hex = local.split(":")
            raw = bytes.fromhex(address_hex)
            # /proc/net/tcp* print each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(f"{ipaddress.ip_address(raw)}:{int(port_hex, 16)}")
    return found


@pytest.fixture
def small_file_system(tmp_path):
    target = tmp_path / "small"
    target.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(target)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root and mount permission")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], capture_output=True)


def test_no_room_for_the_weights_is_refused_before_training(small_file_system):
    run_dir = small_file_system / "run"
    # mlp-wide's weights take about 5 MiB: more than this 2 MiB file system holds.
    result = run_cli("spawn", "-n", "1", "--device", "cpu", "--task", "mlp-wide", "--steps", "5",
                     "--run-dir", str(run_dir))
    assert result.returncode == 1, result.stderr
    verdict = last_line(result.stderr)
    assert f"--run-dir {run_dir}:" in verdict and "MiB free, but model.pt needs" in verdict
    assert not (run_dir / "metrics.jsonl").exists(), "it trained before finding out"
    assert not list(run_dir.glob(".*.tmp"))


def test_a_metrics_line_that_does_not_fit_is_cut_back(small_file_system):
    from ddp_amp.outputs import METRICS_FILE, append_metrics

    append_metrics(small_file_system, {"step": 1, "loss": 0.5})
    first = (small_file_system / METRICS_FILE).read_bytes()
    filler = small_file_system / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    with pytest.raises(OSError):  # fill the file system to its last byte
        while True:
            os.write(fd, b"\0" * 4096)
    os.close(fd)
    with pytest.raises(OSError):
        append_metrics(small_file_system, {"step": 2, "loss": 0.25, "padding": "x" * 100_000})
    assert (small_file_system / METRICS_FILE).read_bytes() == first


def test_the_run_files_honour_the_umask(tmp_path):
    """mkstemp creates 0600 whatever the umask: the files must get what a plain open() gives (0640 under 027)."""
    command = [sys.executable, "-m", "ddp_amp", "spawn", "-n", "1", "--device", "cpu", "--steps", "4",
               "--checkpoint-every", "2", "--run-dir", str(tmp_path / "run")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, preexec_fn=lambda: os.umask(0o027))
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    for path in (run / "model.pt", run / "summary.json", run / "config.json", run / "metrics.jsonl",
                 run / "checkpoints" / "step-4.pt"):
        assert oct(path.stat().st_mode & 0o777) == oct(0o640), path


def test_a_checkpoint_that_does_not_fit_leaves_the_earlier_one_whole_and_alone(small_file_system):
    """Written beside and renamed over: a save that runs out of room raises, and what was there before stays."""
    import torch

    from ddp_amp.checkpoint.storage import checkpoints, load_checkpoint, save_checkpoint

    def state(step: int, numbers: int) -> dict:
        return {"step": step, "trainer": {"model": {"w": torch.ones(numbers)}}, "rng": [], "world_size": 1,
                "config": {"launch_time": 1.0}}

    save_checkpoint(small_file_system, state(10, 1000), keep=2)
    with pytest.raises(OSError):
        save_checkpoint(small_file_system, state(20, 1_000_000), keep=2)  # 4 MB on a 2 MiB file system
    assert [p.name for p in checkpoints(small_file_system)] == ["step-10.pt"]
    assert torch.equal(load_checkpoint(checkpoints(small_file_system)[0])["trainer"]["model"]["w"], torch.ones(1000))
    directory = small_file_system / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["step-10.json", "step-10.pt"]  # no debris
    # The same for a file written again under its own name (summary.json, model.pt): the old one survives.
    from ddp_amp.outputs import read_summary, write_summary

    write_summary(small_file_system, {"steps": 10})
    with pytest.raises(OSError):
        write_summary(small_file_system, {"steps": 20, "filler": "x" * 3_000_000})
    assert read_summary(small_file_system).raw == {"steps": 10}
    assert not list(small_file_system.glob(".*.tmp"))


def test_a_dead_writers_sharded_checkpoint_directory_is_removed_a_live_ones_kept(tmp_path):
    """--checkpoint-format sharded writes into `.step-N.HOST.PID.tmp/` (rank 0's tag; every rank's part inside):
    the cleanup removes a dead writer's whole directory, and keeps a live one's and a complete step-N/."""
    from ddp_amp.files import remove_partial_writes

    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid is free
    host = socket.gethostname()
    leftover = tmp_path / f".step-4.{host}.{dead.pid}.tmp"
    live, complete = tmp_path / f".step-6.{host}.{os.getpid()}.tmp", tmp_path / "step-2"
    for directory in (leftover, live, complete):
        directory.mkdir()
        (directory / "__0_0.distcp").write_bytes(b"\0" * 4096)
    assert remove_partial_writes(tmp_path) == [leftover]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, complete.name])
