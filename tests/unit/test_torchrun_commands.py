"""`ddp-amp run` and `ddp-amp multinode` without launching: the torchrun command lines they would run, their
refusals, the Slurm script, and the patch of torch's worker context. Real torchrun processes:
tests/system/test_torchrun.py."""

import json
import os
import shlex
import subprocess
import sys

import pytest
from helpers import one_line, run_main

from ddp_amp.cli import main

BAD_INPUTS = [
    (["multinode", "--nnodes", "0", "--endpoint", "127.0.0.1:29400"], "--nnodes"),
    (["multinode", "--nnodes", "3:2", "--endpoint", "127.0.0.1:29400"], "--nnodes"),
    (["multinode", "--nnodes", "x", "--endpoint", "127.0.0.1:29400"], "--nnodes"),
    (["multinode", "--nnodes", "2", "--node-rank", "2", "--endpoint", "127.0.0.1:29400"], "--node-rank"),
    (["multinode", "--nnodes", "2", "--node-rank", "-1", "--endpoint", "127.0.0.1:29400"], "--node-rank"),
    (["multinode", "--nnodes", "2", "--endpoint", ""], "--endpoint"),
    (["multinode", "--nnodes", "2", "--endpoint", "host:"], "--endpoint"),
    (["multinode", "--nnodes", "2", "--endpoint", "host:abc"], "--endpoint"),
    (["multinode", "--nnodes", "2", "--endpoint", "host:70000"], "--endpoint"),
    (["multinode", "--nnodes", "2", "--endpoint", "127.0.0.1:\u00b2"], "--endpoint"),  # superscript two
    (["multinode", "--nnodes", "2", "--endpoint", "[::1]:\u0663"], "--endpoint"),  # Arabic-Indic three
    (["multinode", "--nnodes", "2", "--endpoint", ":29400"], "--endpoint"),
    (["multinode", "--nnodes", "2", "--endpoint", "[::1"], "--endpoint"),
    (["multinode", "--nnodes", "2", "--endpoint", "no-such-host.invalid:29400"], "--endpoint"),
    (["multinode", "--nnodes", "2", "--endpoint", "127.0.0.1", "--rdzv-timeout", "0"], "--rdzv-timeout"),
    (["multinode", "--nnodes", "2", "--endpoint", "127.0.0.1", "--max-restarts", "-1"], "--max-restarts"),
    (["multinode", "--nnodes", "2:3", "--endpoint", "127.0.0.1", "--rdzv-last-call", "0"], "--rdzv-last-call"),
    (["multinode", "--nnodes", "2", "--endpoint", "127.0.0.1", "--nproc-per-node", "0"], "--nproc-per-node"),
    (["multinode", "--nnodes", "2", "--endpoint", "127.0.0.1", "--ifname", "nosuchif0"], "--ifname"),
    # 203.0.113.0/24 is TEST-NET-3: never this machine's; the check only tries to bind it, sends nothing.
    (["multinode", "--nnodes", "2", "--endpoint", "127.0.0.1", "--local-addr", "203.0.113.5"], "--local-addr"),
    (["run", "--nproc-per-node", "0"], "--nproc-per-node"),
    (["run", "--nproc-per-node", "many"], "--nproc-per-node"),
    (["run", "--max-restarts", "-1"], "--max-restarts"),
    (["run", "--lr", "nan"], "--lr"),
    (["run", "--tf32", "maybe"], "--tf32"),
    (["run", "--num-workers", "-1"], "--num-workers"),
]


@pytest.mark.parametrize(("args", "flag"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(args, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--device", "cpu", "--run-dir", str(tmp_path / "run")])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert exit_info.value.code == 2
    assert len(lines) == 1 and flag in lines[0], captured.err
    assert "Traceback" not in captured.out + captured.err
    assert not (tmp_path / "run").exists()


def test_multinode_without_an_endpoint_says_it_is_required(tmp_path, capsys):
    code, _, err = run_main(["multinode", "--nnodes", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run")],
                            capsys)
    assert code == 2
    assert one_line(err) == ("ddp-amp: error: --endpoint is required: host:port of the node that hosts the "
                             "rendezvous, e.g. node0:29400")
    assert not (tmp_path / "run").exists()


def parse_dry_run(stdout: str) -> tuple[dict, list[str]]:
    """The printed command: leading VAR=value words, then argv."""
    words = shlex.split(stdout.splitlines()[0])
    env = {}
    while "=" in words[0] and not words[0].startswith("/"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_run_dry_run_prints_a_standalone_torchrun_command(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--nproc-per-node", "2", "--device", "cpu", "--max-restarts", "1", "--dry-run",
              "--run-dir", str(tmp_path)])
    assert exit_info.value.code == 0
    env, argv = parse_dry_run(capsys.readouterr().out)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in argv and "--rdzv-endpoint" not in argv
    assert flag_value(argv, "--nproc-per-node") == "2" and flag_value(argv, "--nnodes") == "1"
    assert flag_value(argv, "--max-restarts") == "1"
    assert argv[-3:] == ["-m", "ddp_amp.worker", str(tmp_path / "config.json")]
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert not (tmp_path / "model.pt").exists()


def test_multinode_dry_run_prints_c10d_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["multinode", "--nnodes", "1:2", "--nproc-per-node", "3", "--endpoint", "127.0.0.1:29999",
              "--device", "cpu", "--dry-run", "--run-dir", str(tmp_path), "--local-addr", "127.0.0.1",
              "--is-host"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    env, argv = parse_dry_run(out)
    assert "--standalone" not in argv
    assert flag_value(argv, "--rdzv-backend") == "c10d"
    assert flag_value(argv, "--rdzv-endpoint") == "127.0.0.1:29999"
    assert flag_value(argv, "--nnodes") == "1:2"
    assert flag_value(argv, "--nproc-per-node") == "3"
    assert flag_value(argv, "--local-addr") == "127.0.0.1"
    # torchrun's own defaults; the last call only for an elastic range
    assert flag_value(argv, "--rdzv-conf") == "is_host=1,join_timeout=600,last_call_timeout=30"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # or a node joining later waits for MASTER_ADDR
    rdzv_id = flag_value(argv, "--rdzv-id")
    assert rdzv_id.startswith("ddp-amp-")
    assert f"--rdzv-id {rdzv_id}" in out.splitlines()[1], "the hint for the other nodes names the same id"


def test_default_rdzv_id_is_the_same_for_the_same_command(tmp_path, capsys):
    ids = []
    for name in ("a", "b"):
        with pytest.raises(SystemExit):
            main(["multinode", "--nnodes", "2", "--endpoint", "[::1]:29400", "--device", "cpu", "--dry-run",
                  "--run-dir", str(tmp_path / name), "--no-is-host"])
        _, argv = parse_dry_run(capsys.readouterr().out)
        assert flag_value(argv, "--rdzv-endpoint") == "[::1]:29400"
        assert "is_host=0" in flag_value(argv, "--rdzv-conf")
        ids.append(flag_value(argv, "--rdzv-id"))
    assert ids[0] == ids[1]


def test_emit_slurm_writes_a_script_and_launches_nothing(tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    with pytest.raises(SystemExit) as exit_info:
        main(["multinode", "--nnodes", "2", "--endpoint", "node0:29500", "--nproc-per-node", "4", "--task",
              "transformer", "--no-bucket-view", "--static-graph", "--emit-slurm", str(script)])
    assert exit_info.value.code == 0
    text = script.read_text()
    assert text.startswith("#!/bin/bash")
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    assert '--nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID"' in text
    assert "--task transformer" in text and "--nproc-per-node 4" in text and ":29500" in text
    assert "--no-bucket-view" in text and "--static-graph" in text and "True" not in text  # switches as switches
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4", "#SBATCH --requeue",
                 "#SBATCH --signal=USR1@120", "#SBATCH --time="):
        assert line in text
    assert "--rdzv-timeout 600" in text  # torchrun's own join timeout: slow nodes must not fail the job
    assert 'set -- "${continued[@]}"\n' in text  # how each attempt starts: the test below runs it
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def own_global_ipv4() -> str:
    """A non-loopback IPv4 address of this machine (using it sends nothing anywhere: it is our own)."""
    try:
        output = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                                text=True).stdout
    except FileNotFoundError:
        output = ""
    for line in output.splitlines():
        return line.split()[3].split("/")[0]
    pytest.skip("this machine has no global IPv4 address")


def multinode_dry_run(endpoint: str, tmp_path, capsys, *extra: str):
    with pytest.raises(SystemExit) as exit_info:
        main(["multinode", "--nnodes", "2", "--endpoint", endpoint, "--device", "cpu", "--dry-run",
              "--run-dir", str(tmp_path), *extra])
    captured = capsys.readouterr()
    return exit_info.value.code, captured


def test_an_exported_interface_is_never_overridden(tmp_path, capsys, monkeypatch):
    address = own_global_ipv4()
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")  # the user's choice, not the route to the endpoint
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    code, captured = multinode_dry_run(f"{address}:29400", tmp_path, capsys)
    assert code == 0, captured.err
    env, argv = parse_dry_run(captured.out)
    assert "NCCL_SOCKET_IFNAME" not in env
    detected = env["GLOO_SOCKET_IFNAME"]
    assert detected != "lo" and flag_value(argv, "--local-addr") == address
    note = [line for line in captured.err.splitlines() if "collectives on" in line]
    assert note and detected in note[0] and "NCCL_SOCKET_IFNAME=lo (exported, kept)" in note[0]


def test_an_explicit_ifname_sets_both_variables(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth9")
    code, captured = multinode_dry_run(f"{own_global_ipv4()}:29400", tmp_path, capsys, "--ifname", "lo")
    assert code == 0, captured.err
    env, _ = parse_dry_run(captured.out)
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"


def test_a_loopback_local_addr_for_a_network_endpoint_is_refused(tmp_path, capsys):
    code, captured = multinode_dry_run(f"{own_global_ipv4()}:29400", tmp_path, capsys, "--local-addr", "127.0.0.1")
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert "--local-addr 127.0.0.1 is a loopback address" in lines[0]
    assert not tmp_path.joinpath("config.json").exists()


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_tf32_is_a_training_option_of_every_launcher_and_refused_on_cpu_ranks(command, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--nproc-per-node", "2", "--device", "cpu", "--tf32", "off",
              "--run-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == ("ddp-amp: error: --tf32 off sets TF32 on CUDA's tensor cores, and "
                                               "these are CPU ranks: drop it")
    assert not (tmp_path / "run").exists()


def test_a_rank_killed_without_raising_is_the_cause_whatever_failed_first(tmp_path):
    """The agent reports every failed rank; one killed by a signal without an error file (SIGKILL, the OOM
    killer) is the cause, even when a peer's "connection closed" traceback is older."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddp_amp.launch.agent import root_failure

    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "RuntimeError: Connection closed by peer",
                                                  "extraInfo": {"py_callstack": "...", "timestamp": "100"}}}))
    peer = ProcessFailure(local_rank=0, pid=8429, exitcode=1, error_file=str(error_file))
    killed = ProcessFailure(local_rank=1, pid=8430, exitcode=-9, error_file="<N/A>")
    assert root_failure({0: peer, 1: killed}) == (1, "died with SIGKILL")
    assert root_failure({0: peer}) == (0, "failed: RuntimeError: Connection closed by peer")


def test_a_fractional_rdzv_timeout_reaches_torchrun_as_whole_seconds(tmp_path, capsys):
    """torchrun parses its rendezvous timeouts with int(): "0.5" would fail in every agent."""
    code, captured = multinode_dry_run("127.0.0.1:29400", tmp_path, capsys, "--rdzv-timeout", "0.5", "--is-host")
    assert code == 0
    _, argv = parse_dry_run(captured.out)
    assert flag_value(argv, "--rdzv-conf") == "is_host=1,join_timeout=1"


def test_nodes_on_one_machine_share_its_cores(tmp_path, capsys, monkeypatch):
    """A loopback endpoint puts every node on this machine: each rank gets its share of the cores across all
    nodes, not all of them (two nodes would oversubscribe the machine twice over). (A user's own
    OMP_NUM_THREADS would win: the test's shell may export one.)"""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    code, captured = multinode_dry_run("127.0.0.1:29400", tmp_path, capsys, "--is-host")
    assert code == 0
    env, _ = parse_dry_run(captured.out)
    assert env["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    code, captured = multinode_dry_run(f"{own_global_ipv4()}:29400", tmp_path / "b", capsys)
    assert code == 0
    env, _ = parse_dry_run(captured.out)
    assert env["OMP_NUM_THREADS"] == str(cores)


def test_emit_slurm_requeues_on_the_chosen_signals_stop_code_only(tmp_path):
    script = tmp_path / "job.sbatch"
    with pytest.raises(SystemExit) as exit_info:
        main(["multinode", "--nnodes", "2", "--endpoint", "node0:29500", "--requeue-signal", "USR2",
              "--emit-slurm", str(script)])
    assert exit_info.value.code == 0
    text = script.read_text()
    assert "#SBATCH --signal=USR2@120" in text
    # 128 + SIGUSR2, and only with a checkpoint to continue from.
    assert 'if [ "$status" -eq 140 ] && has_checkpoint; then' in text
    assert '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


@pytest.mark.parametrize("files, found", [
    ([], False), (["step-5.pt"], True), (["step-5/.metadata", "step-5/extras.pt"], True),
    (["step-5/__0_0.distcp"], False), (["step-5.json"], False)])
def test_the_slurm_scripts_checkpoint_test_sees_files_and_finished_sharded_directories(files, found, tmp_path):
    """The script's has_checkpoint, run by bash on a real run dir (with a space in its path): a step-N.pt, or a
    sharded step-N/ that DCP finished (its .metadata); a directory cut short or a lone sidecar is none."""
    from ddp_amp.launch.slurm import _RESUME

    run_dir = tmp_path / "run dir"
    for name in files:
        (run_dir / "checkpoints" / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints" / name).write_bytes(b"")
    function = _RESUME.split("\nif ")[0]
    result = subprocess.run(["bash", "-c", f'{function}\nhas_checkpoint', "script"], env={"RUN_DIR": str(run_dir)})
    assert (result.returncode == 0) == found


def test_a_bad_requeue_signal_is_one_line_exit_2(tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    with pytest.raises(SystemExit) as exit_info:
        main(["multinode", "--nnodes", "2", "--endpoint", "node0:29500", "--requeue-signal", "KILL",
              "--emit-slurm", str(script)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == ("ddp-amp: error: --requeue-signal must be one of USR1, USR2, TERM, "
                                               "got 'KILL'")
    assert not script.exists()


def test_torch_still_has_what_the_worker_context_patch_wraps():
    """The one patch of a private torch API applies to the installed torch: if torch renames
    MultiprocessContext._start, changes its parameters or drops its finished-reading event, this fails (and the
    guard leaves torch alone: finished ranks then wait for the agent's read, as before)."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    from ddp_amp.launch.agent_torch import let_workers_leave_when_done

    assert let_workers_leave_when_done() is True
    assert MultiprocessContext._start.lets_workers_leave


class _ContextAsTorchHasIt:
    def __init__(self):
        import threading

        self._worker_finished_event = threading.Event()
        self.set_at_start = None

    def _start(self) -> None:
        self.set_at_start = self._worker_finished_event.is_set()


class _ContextWithoutTheEvent:
    def _start(self) -> None:
        pass


class _ContextWithOtherParameters:
    def __init__(self):
        self._worker_finished_event = None

    def _start(self, processes) -> None:
        pass


def test_the_patch_sets_the_finished_reading_event_before_any_worker_starts():
    """Set before torch starts the workers: none ever sleeps on it (multiprocessing's Event.set would wait for a
    sleeper to wake), and each leaves as soon as it has put its return value."""
    from ddp_amp.launch.agent_torch import let_workers_leave_when_done

    assert let_workers_leave_when_done(_ContextAsTorchHasIt) is True
    context = _ContextAsTorchHasIt()
    context._start()
    assert context.set_at_start is True


@pytest.mark.parametrize("context_class", [_ContextWithoutTheEvent, _ContextWithOtherParameters, object])
def test_the_patch_leaves_a_changed_torch_alone(context_class):
    from ddp_amp.launch.agent_torch import let_workers_leave_when_done

    before = getattr(context_class, "_start", None)
    assert let_workers_leave_when_done(context_class) is False
    assert getattr(context_class, "_start", None) is before


@pytest.mark.parametrize(("given", "checkpoint", "added"), [
    ([], False, True), ([], True, True),  # every attempt: from the newest checkpoint, else from the beginning
    (["--resume", "runs/a/checkpoints/step-9.pt"], False, False), (["--resume", "x"], True, True),
    (["--resume=x"], True, True), (["--overwrite"], False, False), (["--overwrite"], True, True),
])
def test_the_slurm_script_adds_resume_auto_unless_the_job_starts_its_own_way(given, checkpoint, added, tmp_path):
    """A job emitted with its own --resume PATH or --overwrite keeps it for its first attempt; once it has a
    checkpoint of its own, a requeued attempt continues from it, --resume auto in place of its own flag (left
    beside it, --overwrite with --resume is refused: the requeue would fail)."""
    from ddp_amp.launch.slurm import _RESUME

    if checkpoint:
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / "step-5.pt").write_bytes(b"")
    result = subprocess.run(["bash", "-c", f'{_RESUME}\nprintf "%s\\n" "$@"', "script", "--steps", "9", *given],
                            env={"RUN_DIR": str(tmp_path)}, capture_output=True, text=True)
    expected = ["--steps", "9", "--resume", "auto"] if added else ["--steps", "9", *given]
    assert result.stdout.splitlines() == expected, result.stderr
