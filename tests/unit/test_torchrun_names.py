"""torchrun's names on ddp-amp's command line (commands.torchrun_names): its underscore spellings and
--rdzv-endpoint reach the same option as ddp-amp's own names; the torchrun flags a command has no option for are
taken where they change nothing and otherwise refused in one line; bench's and doctor's -n reads gpu, cpu and auto
as spawn's does. In-process, nothing launched."""

import os

import pytest
import tomllib
from helpers import run_main

SAME_OPTION = [  # (commands, ddp-amp's name, torchrun's other spelling, a value)
    (("spawn", "run", "multinode"), "--nproc-per-node", "--nproc_per_node", "3"),
    (("run", "multinode"), "--max-restarts", "--max_restarts", "2"),
    (("run", "multinode"), "--monitor-interval", "--monitor_interval", "0.5"),
    (("multinode",), "--node-rank", "--node_rank", "1"),
    (("multinode",), "--rdzv-id", "--rdzv_id", "job-7"),
    (("multinode",), "--local-addr", "--local_addr", "10.0.0.2"),
    (("multinode",), "--endpoint", "--rdzv-endpoint", "node0:29400"),
    (("multinode",), "--endpoint", "--rdzv_endpoint", "node0:29400"),
]
SPELLINGS = [(command, name, other, value) for commands, name, other, value in SAME_OPTION for command in commands]


def printed_config(args: list[str], capsys) -> dict:
    code, out, err = run_main([*args, "--print-config"], capsys)
    assert code == 0, err
    return tomllib.loads(out)


@pytest.mark.parametrize(("command", "name", "other", "value"), SPELLINGS,
                         ids=[f"{c} {o}" for c, _, o, _ in SPELLINGS])
def test_torchruns_spelling_is_the_same_option(command, name, other, value, capsys):
    default = printed_config([command], capsys)
    given = printed_config([command, name, value], capsys)
    assert given != default  # the value is not the default: the comparison below would prove nothing
    assert printed_config([command, other, value], capsys) == given
    assert printed_config([command, f"{other}={value}"], capsys) == given


@pytest.mark.parametrize("command", ["run", "multinode", "bench", "doctor"])
def test_torchruns_spellings_stay_out_of_the_help(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run_main([command, "--help-all" if command != "doctor" else "--help"], capsys)
    assert code == 0, err
    assert "--nproc-per-node" in out
    assert not [word for word in out.split() if word.startswith("--") and "_" in word]
    assert "--master-addr" not in out and "--rdzv-backend" not in out  # nor the flags taken only to refuse
    assert all("torchrun's --rdzv-endpoint" in line for line in out.splitlines() if "--rdzv-endpoint" in line)


class Stop(Exception):
    """Raised by a stub where the command would start measuring: what reached it is recorded."""


MEASURED_BY = {"bench": ("ddp_amp.measure.bench", "run_bench"), "doctor": ("ddp_amp.launch.session", "launch_quietly")}
"""Where each command hands its rank count on to start measuring: a stub there records it and stops."""


def _ranks_measured(command: str, args: list[str], monkeypatch) -> int:
    import importlib

    from ddp_amp.cli import main

    seen = []

    def measure(*_, nproc, **__):
        seen.append(nproc)
        raise Stop

    module, function = MEASURED_BY[command]
    monkeypatch.setattr(importlib.import_module(module), function, measure)
    with pytest.raises(Stop):
        main([command, "--device", "cpu", *args])
    return seen[0]


@pytest.mark.parametrize("command", MEASURED_BY)
@pytest.mark.parametrize("spelling", ["--nproc-per-node", "--nproc_per_node", "-n"])
def test_bench_and_doctor_take_torchruns_spelling_of_the_rank_count(command, spelling, monkeypatch, tmp_path):
    assert _ranks_measured(command, [spelling, "3", "--run-dir", str(tmp_path / "r")], monkeypatch) == 3


@pytest.mark.parametrize("command", MEASURED_BY)
@pytest.mark.parametrize("word", ["cpu", "auto"])
def test_bench_and_doctor_resolve_cpu_and_auto_as_spawn_does(command, word, monkeypatch, tmp_path):
    """spawn's reading (tests/unit/test_help.py): cpu a rank per core; auto a rank per GPU where there is one."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected = gpus if word == "auto" and gpus else os.cpu_count() or 1
    assert _ranks_measured(command, ["-n", word, "--run-dir", str(tmp_path / "r")], monkeypatch) == expected


@pytest.mark.parametrize("command", MEASURED_BY)
@pytest.mark.parametrize(("value", "line"), [
    ("gpu", "--nproc-per-node gpu: no CUDA GPU is visible"),
    ("many", "--nproc-per-node 'many' is not a number, gpu, cpu or auto"),
    ("0", "--nproc-per-node must be >= 1, got 0"),
])
def test_bench_and_doctor_refuse_a_rank_count_as_spawn_does(command, value, line, capsys, tmp_path):
    import torch

    if value == "gpu" and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: gpu is a count here")
    for name in ("spawn", command):
        code, out, err = run_main([name, "-n", value, "--device", "cpu", "--run-dir", str(tmp_path / name)], capsys)
        assert code == 2 and err.strip().splitlines() == [f"ddp-amp: error: {line}"], (name, err)
        assert "Traceback" not in out + err and not (tmp_path / name).exists()


def test_doctor_takes_torchruns_rendezvous_spellings(monkeypatch, capsys):
    import ddp_amp.commands.doctor as doctor

    seen = []

    def doctor_job(nnodes, endpoint, nproc, **options):
        seen.append((nnodes, endpoint, nproc, options["rdzv_id"], options["local_addr"]))
        raise Stop

    monkeypatch.setattr(doctor, "doctor_job", doctor_job)
    for args in (["--endpoint", "node0:29400", "--rdzv-id", "j", "--local-addr", "10.0.0.2", "-n", "2"],
                 ["--rdzv_endpoint", "node0:29400", "--rdzv_id", "j", "--local_addr", "10.0.0.2", "--nproc_per_node",
                  "2"],
                 ["--rdzv-endpoint", "node0:29400", "--rdzv_id=j", "--local_addr=10.0.0.2", "-n", "2"]):
        with pytest.raises(Stop):
            run_main(["doctor", "--nnodes", "2", *args], capsys)
    assert seen == [("2", "node0:29400", 2, "j", "10.0.0.2")] * 3  # --nnodes as typed: doctor_job reads it


NOT_TAKEN = [  # (the command line, the flag as typed, a word of what to do instead)
    (["spawn", "--master-addr", "10.0.0.1"], "--master-addr", "drop it"),
    (["spawn", "--master_port", "29500"], "--master_port", "drop it"),
    (["spawn", "--nnodes", "2"], "--nnodes", "ddp-amp multinode"),
    (["spawn", "--rdzv-backend", "c10d"], "--rdzv-backend", "ddp-amp run"),
    (["spawn", "--rdzv_endpoint", "node0:29400"], "--rdzv_endpoint", "ddp-amp multinode"),
    (["run", "--master_addr", "10.0.0.1"], "--master_addr", "drop it"),
    (["run", "--master-port", "29500"], "--master-port", "drop it"),
    (["run", "--nnodes", "1:2"], "--nnodes", "ddp-amp multinode"),
    (["run", "--rdzv-backend", "static"], "--rdzv-backend", "give c10d"),
    (["run", "--rdzv_backend", "etcd"], "--rdzv_backend", "give c10d"),
    (["run", "--rdzv-endpoint", "node0:29400"], "--rdzv-endpoint", "ddp-amp multinode"),
    (["multinode", "--standalone"], "--standalone", "ddp-amp run"),
    (["multinode", "--rdzv-backend", "etcd-v2"], "--rdzv-backend", "give c10d"),
    (["multinode", "--rdzv_backend", "static"], "--rdzv_backend", "give c10d"),
    (["multinode", "--master-addr", "node0"], "--master-addr", "--endpoint HOST:PORT"),
    (["multinode", "--master_port", "29500"], "--master_port", "--endpoint HOST:PORT"),
]


@pytest.mark.parametrize(("args", "flag", "instead"), NOT_TAKEN, ids=[" ".join(a) for a, _, _ in NOT_TAKEN])
def test_a_torchrun_flag_the_command_has_no_option_for_is_one_line_exit_2(args, flag, instead, capsys, tmp_path,
                                                                       monkeypatch):
    import ddp_amp.launch.multinode as multinode
    import ddp_amp.launch.session as session

    def launched(*_, **__):
        raise AssertionError("launched")

    for module, name in ((session, "spawn_launch"), (session, "standalone_launch"), (multinode, "multinode_launch")):
        monkeypatch.setattr(module, name, launched)
    run_dir = tmp_path / "run"
    extra = ["--nnodes", "2", "--endpoint", "127.0.0.1"] if args[0] == "multinode" else []
    code, out, err = run_main([*args, *extra, "--device", "cpu", "--run-dir", str(run_dir)], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"ddp-amp: error: {flag}") and instead in lines[0], err
    assert "Traceback" not in out + err and not run_dir.exists()


TAKEN = [  # torchrun flags that ask for what the command does anyway: the same options as without them
    ["spawn", "--standalone"],
    ["spawn", "--nnodes", "1"],
    ["run", "--standalone"],
    ["run", "--nnodes", "1:1"],
    ["run", "--rdzv-backend", "c10d"],
    ["run", "--rdzv_backend", "c10d"],
    ["multinode", "--rdzv-backend", "c10d"],
    ["multinode", "--rdzv_backend=c10d"],
]


@pytest.mark.parametrize("args", TAKEN, ids=[" ".join(a) for a in TAKEN])
def test_a_torchrun_flag_that_changes_nothing_is_taken(args, capsys):
    assert printed_config([*args, "-n", "2"], capsys) == printed_config([args[0], "-n", "2"], capsys)


@pytest.mark.parametrize("command", ["spawn", "run"])
def test_standalone_is_documented_where_it_is_taken(command, capsys):
    code, out, err = run_main([command, "--help-all"], capsys)
    assert code == 0, err
    assert "--standalone" in " ".join(out.split()) and "changes nothing" in " ".join(out.split())


def test_a_config_file_sets_no_torchrun_flag_a_command_has_no_option_for(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text('master_addr = "10.0.0.1"\n')
    code, _, err = run_main(["run", "--config", str(config), "--print-config"], capsys)
    assert code == 2 and "unknown key 'master_addr'" in err, err
