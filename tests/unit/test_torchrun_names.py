"""torchrun's names on ddp-amp's command line: bench's and doctor's -n reads a number, gpu, cpu and auto as
spawn's does (launch.torchrun.parse_nproc). In-process, nothing launched."""

import os

import pytest
from helpers import run_main


class Stop(Exception):
    """Raised by a stub where the command would start measuring: what reached it is recorded."""


def _ranks_bench_measures(args: list[str], monkeypatch) -> int:
    import ddp_amp.measure.bench as measure
    from ddp_amp.cli import main

    seen = []

    def run_bench(train, options, *, nproc, **_):
        seen.append(nproc)
        raise Stop

    monkeypatch.setattr(measure, "run_bench", run_bench)
    with pytest.raises(Stop):
        main(["bench", "--device", "cpu", *args])
    return seen[0]


def _ranks_doctor_measures(args: list[str], monkeypatch) -> int:
    import ddp_amp.launch.session as session
    from ddp_amp.cli import main

    seen = []

    def launch_quietly(options, root, *, nproc, **_):
        seen.append(nproc)
        raise Stop

    monkeypatch.setattr(session, "launch_quietly", launch_quietly)
    with pytest.raises(Stop):
        main(["doctor", "--device", "cpu", *args])
    return seen[0]


MEASURES = {"bench": _ranks_bench_measures, "doctor": _ranks_doctor_measures}


@pytest.mark.parametrize("command", MEASURES)
@pytest.mark.parametrize("spelling", ["--nproc-per-node", "-n"])
def test_bench_and_doctor_take_torchruns_spelling_of_the_rank_count(command, spelling, monkeypatch, tmp_path):
    assert MEASURES[command]([spelling, "3", "--run-dir", str(tmp_path / "r")], monkeypatch) == 3


@pytest.mark.parametrize("command", MEASURES)
@pytest.mark.parametrize("word", ["cpu", "auto"])
def test_bench_and_doctor_resolve_cpu_and_auto_as_spawn_does(command, word, monkeypatch, tmp_path):
    """spawn's reading (tests/unit/test_help.py): cpu a rank per core; auto a rank per GPU where there is one."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected = gpus if word == "auto" and gpus else os.cpu_count() or 1
    assert MEASURES[command](["-n", word, "--run-dir", str(tmp_path / "r")], monkeypatch) == expected


@pytest.mark.parametrize("command", MEASURES)
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
