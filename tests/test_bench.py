"""`ddp-amp bench`: real interleaved AMP off/on launches on CPU, their JSON, their table."""

import json

import pytest

from ddp_amp.cli import main

from conftest import assert_ok, run_cli

BAD_INPUTS = [
    (["--amp", "sometimes"], "--amp"),
    (["--repeats", "0"], "--repeats"),
    (["--steps", "0"], "--steps"),
    (["--warmup", "-1"], "--warmup"),
    (["--launcher", "mpirun"], "--launcher"),
    (["--tf32", "maybe"], "--tf32"),
    (["--json", "/no/such/dir/out.json"], "--json"),
    (["--lr", "0"], "--lr"),
]


@pytest.mark.parametrize(("args", "flag"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(args, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--device", "cpu", *args, "--run-dir", str(tmp_path / "bench")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == 2
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in err
    assert not (tmp_path / "bench").exists()


@pytest.fixture(scope="module")
def bench_both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    result = run_cli("bench", "--amp", "both", "--steps", "5", "--warmup", "2", "--repeats", "2", "--nproc", "2",
                     "--device", "cpu", "--task", "mlp", "--json", str(tmp / "out.json"), "--run-dir",
                     str(tmp / "runs"), env={"COLUMNS": "160"}, timeout=300)
    assert_ok(result)
    return json.loads((tmp / "out.json").read_text()), result


@pytest.mark.slow
def test_json_holds_both_precisions_with_every_ranks_step_times(bench_both):
    report, _ = bench_both
    precisions = report["precisions"]
    assert set(precisions) == {"fp32", "bf16"}
    for entry in precisions.values():
        assert len(entry["repeats"]) == 2
        for repeat in entry["repeats"]:
            assert set(repeat["step_s"]) == {"0", "1"}
            assert all(len(times) == 5 for times in repeat["step_s"].values())
        pooled = sorted(t for r in entry["repeats"] for times in r["step_s"].values() for t in times)
        assert entry["step_s_median"] == pytest.approx((pooled[9] + pooled[10]) / 2)
        assert entry["step_s_p90"] >= entry["step_s_median"]
        assert entry["samples_per_s"] > 0 and entry["peak_memory_mb"] > 0 and entry["final_loss"] > 0
    speedup = report["speedup"]
    assert speedup["amp"] == "bf16"
    assert speedup["median"] == pytest.approx(precisions["fp32"]["step_s_median"] / precisions["bf16"]["step_s_median"])
    assert len(speedup["per_repeat"]) == 2
    assert "relative_difference" in report["loss_agreement"]
    env = report["environment"]
    assert env["world_size"] == 2 and env["backend"] == "gloo" and "torch" in env and "cpu_native_bf16" in env
    assert env["threads_per_rank"] >= 1 and isinstance(env["cpu_flags"], list)


@pytest.mark.slow
def test_table_shows_both_rows_and_the_speedup(bench_both):
    report, result = bench_both
    rows = [line for line in result.stdout.splitlines() if line.strip("│ ").startswith(("fp32", "bf16"))]
    assert len(rows) == 2
    assert f"speedup bf16 over fp32: {report['speedup']['median']:.2f}x" in result.stdout


@pytest.mark.slow
def test_warmup_is_not_timed(tmp_path, helper_task):
    result = run_cli("bench", "--amp", "off", "--steps", "6", "--warmup", "3", "--repeats", "1", "--nproc", "2",
                     "--device", "cpu", "--task", helper_task("slow_start"), "--json", str(tmp_path / "o.json"),
                     "--run-dir", str(tmp_path / "runs"))
    assert_ok(result)
    entry = json.loads((tmp_path / "o.json").read_text())["precisions"]["fp32"]
    assert entry["step_s_median"] < 0.1  # the three 0.5 s warm-up steps are not in it
    assert max(t for times in entry["repeats"][0]["step_s"].values() for t in times) < 0.4


def test_plot_without_matplotlib_says_how_to_install_it(capsys, tmp_path):
    pytest.importorskip("rich")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("matplotlib is installed here")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--device", "cpu", "--plot", str(tmp_path / "p.png"), "--run-dir", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "pip install 'ddp-amp[plot]'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


def test_mfu_is_per_gpu():
    from ddp_amp.bench import GPU_PEAK_TFLOPS, mfu

    peak = GPU_PEAK_TFLOPS["H100"] * 1e12
    # 8 GPUs together process 8x the tokens of one: the utilisation of each is that of one alone.
    one = mfu("NVIDIA H100 80GB HBM3", tokens_per_s=1e5, flops_per_token=1e6, gpus=1)
    eight = mfu("NVIDIA H100 80GB HBM3", tokens_per_s=8e5, flops_per_token=1e6, gpus=8)
    assert one == pytest.approx(1e11 / peak) and eight == pytest.approx(one)
    assert mfu("Some Unknown GPU", 1e5, 1e6, gpus=1) is None
