"""The script `multinode --emit-slurm` writes, run by a real Slurm cluster: Debian's slurmctld, one slurmd per
emulated node (`slurmd -N 127.0.0.1`, `-N 127.0.0.2`) and munged, private to a temporary directory. Preempted
the ways Slurm preempts: `scancel --signal=USR1` (what `--signal=USR1@N` sends), the time-limit warning
itself, and a plain `scancel` (SIGTERM to the job step). Skipped, with the reason, where the cluster cannot
run (not root, packages missing)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from helpers import CHECKS_SCRIPT, HELPER_TASKS, MARK_VAR, TESTS, free_port, launch_script, read_summary, run_processes

pytestmark = pytest.mark.slow

NODES = ("127.0.0.1", "127.0.0.2")  # resolvable names: `scontrol show hostnames` gives the rendezvous host
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")
HOLD_AT = 30  # the micro-step at which the preempted job's ranks wait for their stop signal
STEPS = 400
LOOP_EXAMPLE = TESTS.parent / "examples" / "own_loop.py"



SLURM_CONF = """ClusterName=ddpamp
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire + 1 s before it may start again (120 s by default).
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
# No cgroups needed: processes are tracked by parentage, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# A node may declare the machine's cores although two nodes share them.
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
# A requeue cycle in about 12 s instead of about 160 s.
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
JobRequeue=1
MpiDefault=none
ReturnToService=2
KillWait=30
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("munge", "state", "log", *(f"spool/{node}" for node in NODES)):
            (root / sub).mkdir(parents=True)
        (root / "munge").chmod(0o755)  # munged wants its socket's directory searchable by everyone
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        cores = os.cpu_count() or 1
        nodes = "\n".join(f"NodeName={node} NodeAddr={node} Port={free_port()} CPUs={cores} State=UNKNOWN"
                          for node in NODES)
        (root / "slurm.conf").write_text(SLURM_CONF.format(root=root, ctld_port=free_port(), nodes=nodes))
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    def start(self) -> None:
        munge = self.root / "munge"
        self._run(["munged", f"--socket={munge}/munge.socket", f"--key-file={munge}/munge.key",
                   f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/seed",
                   f"--log-file={self.root}/log/munged.log"])
        self._run(["slurmctld", "-c", "-i"])
        for node in NODES:
            self._run(["slurmd", "-N", node])
        deadline = time.monotonic() + 60
        while self.sinfo_idle() < len(NODES):
            assert time.monotonic() < deadline, (self.root / "log" / "slurmctld.log").read_text()[-3000:]
            time.sleep(0.5)

    def _run(self, command: list[str]) -> None:
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{command}: {result.stderr}"

    def sinfo_idle(self) -> int:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env, capture_output=True, text=True).stdout
        return sum(state.strip() == "idle" for state in out.splitlines())

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True)
        pid_files = [self.root / f"slurmd-{node}.pid" for node in NODES]
        pid_files += [self.root / "slurmctld.pid", self.root / "munge" / "munged.pid"]
        for pid_file in pid_files:
            try:
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            deadline = time.monotonic() + 20
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)

    def sbatch(self, script: Path, *options: str, env: dict[str, str] | None = None) -> str:
        result = subprocess.run(["sbatch", "--parsable", "--chdir", str(script.parent),
                                 f"--output={script.parent}/slurm-%j.out", *options, str(script)],
                                env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol's view of the job (JobState, Restarts, ...); {} once the controller has forgotten it."""
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=self.env, capture_output=True,
                             text=True).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_done(self, job_id: str, timeout_s: float = 400) -> dict[str, str]:
        """Until the job reached a final state (requeues go through PENDING, not a final state)."""
        deadline = time.monotonic() + timeout_s
        while (state := self.job(job_id)).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                   "NODE_FAIL", None):
            assert time.monotonic() < deadline, f"job {job_id} still {state.get('JobState')}"
            time.sleep(1)
        return state


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the private Slurm cluster runs its daemons as root")
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"Slurm or munge not installed ({', '.join(missing)}): apt-get install slurmctld slurmd "
                    "slurm-client munge")
    # Not under pytest's temporary directories (mode 700): munged wants every directory above its socket
    # searchable by everyone.
    root = Path(tempfile.mkdtemp(prefix="ddp-amp-slurm-"))
    root.chmod(0o755)
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def emit_script(directory: Path, *extra: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "job.sbatch"
    result = subprocess.run(
        [sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "2", "--nproc-per-node", "1", "--endpoint",
         f"127.0.0.1:{free_port()}", "--device", "cpu", "--task", f"{HELPER_TASKS}:holds_until_stopped",
         "--steps", str(STEPS), "--log-every", "10", "--log-format", "plain", "--run-dir", str(directory / "run"),
         *extra, "--emit-slurm", str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return script


def job_env(directory: Path, mark: str, hold: bool) -> dict[str, str]:
    """What sbatch exports to the job (--export=ALL): this interpreter's ddp-amp first on PATH, a mark that
    finds the job's processes, and the hold of the helper task."""
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", MARK_VAR: mark}
    if hold:
        env.update(DDP_AMP_TEST_HOLD_AT=str(HOLD_AT), DDP_AMP_TEST_HOLD_DIR=str(directory))
    return env


def wait_until_held(directory: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not all((directory / f"held-rank{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline, "the job's ranks never reached the hold"
        time.sleep(0.5)


def job_output(directory: Path) -> str:
    return "\n".join(path.read_text(errors="replace") for path in sorted(directory.glob("slurm-*.out")))


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """The same job, never signalled: the weights every preempted job must end with."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    job = slurm.sbatch(emit_script(directory), env=job_env(directory, "uninterrupted", hold=False))
    assert slurm.wait_done(job)["JobState"] == "COMPLETED", job_output(directory)
    return torch.load(directory / "run" / "model.pt", weights_only=True)


def stop_step(output: str, signal_name: str) -> int:
    """The step of the job's stop line (`stopped by SIGUSR1 at step N; checkpoint ...`, from node 0's ddp-amp)."""
    found = re.findall(rf"stopped by {signal_name} at step (\d+); checkpoint", output)
    assert found, output
    return int(found[0])


def assert_resumed_to_the_same_weights(directory: Path, uninterrupted: dict, signal_name: str) -> None:
    run = directory / "run"
    summary = read_summary(run)
    output = job_output(directory)
    assert summary["slurm_restart_count"] == 1, output
    # Held in step HOLD_AT until the signal came: the ranks stop at the next poll of the stop agreement.
    stopped = stop_step(output, signal_name)
    assert HOLD_AT <= stopped < STEPS
    assert summary["resumed_from_step"] == stopped and summary["resumed_from"].endswith(f"step-{stopped}.pt")
    assert summary["steps"] == STEPS
    weights = torch.load(run / "model.pt", weights_only=True)
    assert weights.keys() == uninterrupted.keys()
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in weights), "resumed weights differ"


def test_scancel_signal_usr1_stops_requeues_and_resumes_bit_for_bit(slurm, uninterrupted, tmp_path):
    job = slurm.sbatch(emit_script(tmp_path), env=job_env(tmp_path, "preempted", hold=True))
    wait_until_held(tmp_path)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm.env, check=True)
    state = slurm.wait_done(job)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", job_output(tmp_path)
    assert_resumed_to_the_same_weights(tmp_path, uninterrupted, "SIGUSR1")
    assert run_processes("preempted") == []


def test_the_time_limit_warning_stops_requeues_and_resumes(slurm, uninterrupted, tmp_path):
    """--time 3 with --signal=USR2@90: Slurm itself sends USR2 to the job step between 30 s and 90 s in (it may
    send it up to 60 s early, its documentation says); the ranks wait for it at HOLD_AT, so the step is known
    however late it comes."""
    job = slurm.sbatch(emit_script(tmp_path, "--requeue-signal", "USR2"), "--time=3", "--signal=USR2@90",
                       env=job_env(tmp_path, "time-limit", hold=True))
    state = slurm.wait_done(job, timeout_s=600)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", job_output(tmp_path)
    assert_resumed_to_the_same_weights(tmp_path, uninterrupted, "SIGUSR2")
    assert run_processes("time-limit") == []


def test_a_plain_scancel_stops_with_a_checkpoint_and_is_not_requeued(slurm, tmp_path):
    job = slurm.sbatch(emit_script(tmp_path), env=job_env(tmp_path, "cancelled", hold=True))
    wait_until_held(tmp_path)
    subprocess.run(["scancel", job], env=slurm.env, check=True)  # SIGTERM to the job step, then SIGKILL
    deadline = time.monotonic() + 120
    while run_processes("cancelled"):
        assert time.monotonic() < deadline, "the job's processes outlived scancel"
        time.sleep(0.5)
    assert slurm.wait_done(job)["JobState"] == "CANCELLED"
    summary = read_summary(tmp_path / "run")
    assert summary["stopped_by"] == "SIGTERM" and HOLD_AT <= summary["stopped_at_step"] < STEPS
    assert (tmp_path / "run" / "checkpoints" / f"step-{summary['stopped_at_step']}.pt").exists()
    assert not (tmp_path / "run" / "model.pt").exists()


def test_a_users_script_emitted_for_slurm_runs_on_both_nodes_in_one_process_group(slurm, tmp_path):
    """`multinode --emit-slurm job.sbatch SCRIPT ARGS`: the job runs the script on both nodes, one rank each, exits
    0, every rank's lines in the job's output, each all-reduce summing both ranks. Not the origin example: its
    destroy_process_group() with its DDP model alive can hang at exit under load, under torchrun too
    (docs/scripts.md); its weights against torchrun's are tested on one machine."""
    script = tmp_path / "job.sbatch"
    emitted = subprocess.run(
        [sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "2", "--nproc-per-node", "1", "--endpoint",
         f"127.0.0.1:{free_port()}", "--device", "cpu", "--log-format", "plain", "--run-dir", str(tmp_path / "run"),
         "--emit-slurm", str(script), str(CHECKS_SCRIPT), "--steps", "5"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert emitted.returncode == 0, emitted.stderr
    job = slurm.sbatch(script, env=job_env(tmp_path, "script", hold=False))
    assert slurm.wait_done(job)["JobState"] == "COMPLETED", job_output(tmp_path)
    output = job_output(tmp_path)
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} step 4 sum 10 restart 0" in output, output
    assert read_summary(tmp_path / "run")["outcome"] == "finished"
    assert run_processes("script") == []


def test_a_loop_script_preempted_by_slurm_resumes_after_its_requeue_to_the_uninterrupted_weights(slurm, tmp_path):
    """examples/own_loop.py (ddp_amp.loop, two models and optimizers) emitted for Slurm, 2 nodes of 1 rank:
    `scancel --signal=USR1` once it has trained 20 steps. Its ranks stop at one step and save, the job is requeued,
    the second attempt's restore() resumes (SLURM_RESTART_COUNT), and the weights are bit for bit those of the
    same script run uninterrupted by `ddp-amp spawn -n 2`."""
    steps = "300"
    reference = launch_script(tmp_path / "reference", LOOP_EXAMPLE, "--steps", steps)
    assert reference.returncode == 0, reference.stderr
    script = tmp_path / "job.sbatch"
    emitted = subprocess.run(
        [sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "2", "--nproc-per-node", "1", "--endpoint",
         f"127.0.0.1:{free_port()}", "--device", "cpu", "--log-format", "plain", "--run-dir", str(tmp_path / "run"),
         "--emit-slurm", str(script), str(LOOP_EXAMPLE), "--steps", steps],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert emitted.returncode == 0, emitted.stderr
    output = preempted_after_step_20_and_requeued(slurm, script, tmp_path, "loop-preempted")
    resumed = re.findall(r"ddp-amp loop: resumed from \S+step-(\d+)\.pt \(step (\d+)\)", output)
    assert resumed and 20 <= int(resumed[0][1]) < int(steps), output
    loop = read_summary(tmp_path / "run")["loop"]  # the requeued attempt's account says so too
    assert loop["slurm_restart_count"] == 1 and loop["resumed_from_step"] == int(resumed[0][1]), loop
    assert_the_references_weights(tmp_path)
    assert run_processes("loop-preempted") == []


def preempted_after_step_20_and_requeued(slurm, script: Path, directory: Path, mark: str) -> str:
    """The job submitted, `scancel --signal=USR1` once its loop script reported step 20 (its second report), and
    waited for: it completed after one requeue. The job's output."""
    job = slurm.sbatch(script, env=job_env(directory, mark, hold=False))
    metrics, deadline = directory / "run" / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):  # step 20 reported
        assert time.monotonic() < deadline, job_output(directory)
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm.env, check=True)
    state = slurm.wait_done(job)
    output = job_output(directory)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", output
    return output


def assert_the_references_weights(directory: Path) -> None:
    """The job's model.pt is, bit for bit, that of the same script run uninterrupted into directory/reference."""
    weights = torch.load(directory / "run" / "model.pt", weights_only=True)
    expected = torch.load(directory / "reference" / "model.pt", weights_only=True)
    assert all(torch.equal(weights[m][k], expected[m][k]) for m in expected for k in expected[m])


def test_a_loop_script_in_a_one_node_job_from_run_is_requeued_and_resumes(slurm, tmp_path):
    """`run -n 2 --emit-slurm job.sbatch SCRIPT`: a one-node job of the same run. Preempted with `scancel
    --signal=USR1` once it has trained 20 steps, its ranks stop at one step and save, the job requeues itself,
    and the second attempt continues the run dir (--resume auto, added on the requeue): the weights are bit for
    bit those of the same script run uninterrupted by `ddp-amp spawn -n 2`."""
    steps = "300"
    reference = launch_script(tmp_path / "reference", LOOP_EXAMPLE, "--steps", steps)
    assert reference.returncode == 0, reference.stderr
    script = tmp_path / "job.sbatch"
    emitted = subprocess.run(
        [sys.executable, "-m", "ddp_amp", "run", "-n", "2", "--device", "cpu", "--log-format", "plain",
         "--run-dir", str(tmp_path / "run"), "--emit-slurm", str(script), str(LOOP_EXAMPLE), "--steps", steps],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert emitted.returncode == 0, emitted.stderr
    preempted_after_step_20_and_requeued(slurm, script, tmp_path, "run-preempted")
    loop = read_summary(tmp_path / "run")["loop"]
    assert loop["slurm_restart_count"] == 1 and 20 <= loop["resumed_from_step"] < int(steps), loop
    assert_the_references_weights(tmp_path)
    assert run_processes("run-preempted") == []
