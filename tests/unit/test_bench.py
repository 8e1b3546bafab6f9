"""`ddp-amp bench` without launching: its refusals, its table and JSON from given figures, its statistics.
The interleaved launches themselves: tests/system/test_bench_runs.py."""

import json
import os
import subprocess
import sys

import pytest

from ddp_amp.cli import main

BAD_INPUTS = [
    (["--amp", "sometimes"], "--amp"),
    (["--repeats", "0"], "--repeats"),
    (["--steps", "0"], "--steps"),
    (["--warmup", "-1"], "--warmup"),
    (["--launcher", "mpirun"], "--launcher"),
    (["--compile", "sometimes"], "--compile"),
    (["--tf32", "maybe"], "--tf32"),
    (["--json", "/no/such/dir/out.json"], "--json"),
    (["--lr", "0"], "--lr"),
    (["--shard", "none,zero3"], "--shard"),
    (["--shard", "full,full"], "--shard"),
    (["--max-batch", "--shard", "none,optimizer"], "--shard"),
    (["--amp", "off", "--dtype", "bf16-true"], "--dtype bf16-true conflicts with --amp off"),
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


@pytest.mark.parametrize("shards", ["", "none,", "none,,full"])
def test_an_empty_shard_mode_is_named_as_empty_not_as_an_unknown_blank(shards, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--device", "cpu", "--shard", shards, "--run-dir", str(tmp_path / "bench")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (f"ddp-amp: error: --shard {shards!r} names an empty mode; give one "
                                               "or more of none, optimizer, full, separated by commas")


@pytest.mark.parametrize("resume", ["auto", "runs/x/checkpoints/step-4.pt"])
def test_resume_is_refused_not_ignored_nor_taken_as_a_steps_mismatch(resume, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--device", "cpu", "--resume", resume, "--run-dir", str(tmp_path / "bench")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == ("ddp-amp: error: --resume does not apply to bench: each of its runs "
                                               "trains from step 0 (--init-from gives them starting weights)")
    assert not (tmp_path / "bench").exists()


def test_a_used_run_dir_is_refused_before_anything_runs(capsys, tmp_path):
    """bench takes no --overwrite: a directory that holds anything is refused (not "pass --overwrite")."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "mine.txt").write_text("keep")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--device", "cpu", "--run-dir", str(tmp_path / "bench")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (f"ddp-amp: error: --run-dir {str(tmp_path / 'bench')!r} is not "
                                               "empty; bench writes its runs into a new or empty directory: choose "
                                               "another")
    assert [p.name for p in (tmp_path / "bench").iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("command", [["bench", "--device", "cpu"], ["show", "."]])
def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, command):
    """A matplotlib that cannot be imported (as when it is not installed): one line saying how to get it."""
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed')\n")
    if command[0] == "show":  # a real run directory to show
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "config.json").write_text("{}")
        command = ["show", str(tmp_path / "run")]
    result = subprocess.run([sys.executable, "-m", "ddp_amp", *command, "--plot", str(tmp_path / "p.png")],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'ddp-amp[plot]'" in lines[0], result.stderr
    assert not (tmp_path / "p.png").exists() and not (tmp_path / "runs").exists()


def _refused(args: list[str], flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize(("flag", "name", "content"), [
    ("--json", "model.pt", b"PK\x03\x04 a trained model"),
    ("--plot", "mine.png", b"\x89PNG\r\n\x1a\n a figure of the user's"),
])
def test_a_report_never_replaces_a_file_ddp_amp_did_not_write(flag, name, content, capsys, tmp_path):
    (tmp_path / name).write_bytes(content)
    _refused(["bench", "--device", "cpu", flag, str(tmp_path / name), "--run-dir", str(tmp_path / "bench")], flag,
             capsys)
    assert (tmp_path / name).read_bytes() == content
    assert not (tmp_path / "bench").exists()  # refused before anything ran
    if flag == "--plot":
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "config.json").write_text("{}")
        _refused(["show", str(tmp_path / "run"), "--plot", str(tmp_path / name)], flag, capsys)
        assert (tmp_path / name).read_bytes() == content


@pytest.mark.parametrize(("flag", "path", "says"), [
    ("--json", "adir", "is a directory"),
    ("--plot", "adir.png", "is a directory"),
    ("--plot", "out.xyz", "the suffix chooses the format: .png, .pdf, .svg"),
    ("--plot", "out", "the suffix chooses the format"),
])
def test_a_report_path_that_cannot_take_the_report_is_refused_before_the_run(flag, path, says, capsys, tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir.png").mkdir()
    _refused(["bench", "--device", "cpu", flag, str(tmp_path / path), "--run-dir", str(tmp_path / "bench")], says,
             capsys)
    assert not (tmp_path / "bench").exists()


def test_a_report_ddp_amp_wrote_is_replaced_whole(tmp_path):
    """A rerun writes over its own earlier --json and --plot: both carry ddp-amp's mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddp_amp.commands.options import check_json_path, check_plot_path
    from ddp_amp.outputs import write_json_report
    from ddp_amp.results.report import save_figure

    report = tmp_path / "bench.json"
    write_json_report(report, {"speedup": 1.5}, "bench")
    check_json_path(report)
    write_json_report(report, {"speedup": 2.0}, "bench")
    assert json.loads(report.read_text()) == {"speedup": 2.0, "written_by": "written by ddp-amp bench"}
    for suffix in (".png", ".pdf", ".svg"):
        figure = tmp_path / f"plot{suffix}"
        for _ in range(2):
            check_plot_path(figure)
            fig, ax = plt.subplots()
            ax.plot([1, 2])
            save_figure(fig, figure, dpi=50)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "plot.pdf", "plot.png", "plot.svg"]


def test_compiled_variants_are_compared_within_their_precision():
    from ddp_amp.measure.bench import Measurement, analyse
    from ddp_amp.outputs import RunRecord

    def measured(label, repeat, step_s, compile_s=None):
        summary = {"global_batch_size": 64, "final_loss": 0.5, "samples_per_s": 1.0}
        if compile_s is not None:
            summary["compile_s"] = compile_s
        return Measurement(label, repeat, {0: [step_s] * 3, 1: [step_s] * 3}, {0: 100.0, 1: 100.0},
                           RunRecord(summary))

    report = analyse([measured("fp32", 0, 0.010), measured("fp32+compile", 0, 0.008, 7.0),
                      measured("bf16", 0, 0.005), measured("bf16+compile", 0, 0.004, 8.0)])
    assert report["speedup"]["amp"] == "bf16" and report["speedup"]["median"] == pytest.approx(2.0)
    assert report["compile_speedup"]["fp32"]["median"] == pytest.approx(1.25)
    assert report["compile_speedup"]["bf16"]["median"] == pytest.approx(1.25)
    assert report["precisions"]["bf16+compile"]["compile_s"] == 8.0


def test_a_speedup_is_the_median_of_the_per_repeat_ratios_not_a_ratio_of_pooled_medians():
    """Each repeat runs its precisions side by side: their ratio is free of the machine's drift between repeats.
    Here fp32's repeats ran 10, 20 and 30 ms, bf16's 25, 18 and 35: per repeat 0.40x, 1.11x, 0.86x, so 0.86x;
    the pooled medians (20 and 25 ms) would say 0.80x."""
    from ddp_amp.measure.bench import Measurement, analyse
    from ddp_amp.outputs import RunRecord

    def measured(label, repeat, step_s):
        summary = {"global_batch_size": 64, "final_loss": 0.5, "samples_per_s": 1.0}
        return Measurement(label, repeat, {0: [step_s] * 3, 1: [step_s] * 3}, {0: 100.0, 1: 100.0},
                           RunRecord(summary))

    report = analyse([measured(label, repeat, ms / 1e3) for repeat, pair in enumerate([(10, 25), (20, 18), (30, 35)])
                      for label, ms in zip(("fp32", "bf16"), pair)])
    assert report["speedup"]["per_repeat"] == pytest.approx([10 / 25, 20 / 18, 30 / 35])
    assert report["speedup"]["median"] == pytest.approx(30 / 35)
    assert report["precisions"]["fp32"]["step_s_median"] / report["precisions"]["bf16"]["step_s_median"] == \
        pytest.approx(0.8)


def test_amp_all_compares_autocast_and_bf16_true_each_with_fp32(tmp_path, capsys):
    """--amp all: fp32, autocast and bf16-true interleaved; each half precision's speedup over fp32 per
    interleaved repeat, each in the table's lines."""
    from rich.console import Console

    from ddp_amp.measure.bench import BenchOptions, Measurement, analyse
    from ddp_amp.outputs import RunRecord
    from ddp_amp.results.report import bench_table

    assert [mode for mode, _, _ in BenchOptions(amp="all").variants] == ["off", "on", "true"]

    def measured(label, repeat, step_s, loss):
        return Measurement(label, repeat, {0: [step_s] * 3, 1: [step_s] * 3}, {0: 100.0, 1: 100.0},
                           RunRecord({"global_batch_size": 64, "final_loss": loss, "samples_per_s": 1.0}))

    report = analyse([measured("fp32", 0, 0.010, 0.5), measured("bf16", 0, 0.0125, 0.5),
                      measured("bf16-true", 0, 0.004, 0.505), measured("fp32", 1, 0.012, 0.5),
                      measured("bf16", 1, 0.012, 0.5), measured("bf16-true", 1, 0.006, 0.505)])
    assert report["speedup"]["amp"] == "bf16"  # the first half precision, as before
    assert report["speedups"]["bf16"]["per_repeat"] == pytest.approx([0.8, 1.0])
    assert report["speedups"]["bf16-true"]["per_repeat"] == pytest.approx([2.5, 2.0])
    assert report["speedups"]["bf16-true"]["loss_relative_difference"] == pytest.approx(0.01)
    report["environment"] = {"torch": "2.13.0", "device": "a CPU", "world_size": 2, "backend": "gloo",
                             "threads_per_rank": 1, "cpu_native_bf16": True}
    Console(width=200).print(bench_table(report))
    out = capsys.readouterr().out
    assert "speedup bf16 over fp32: 0.90x (per repeat 0.80x-1.00x)" in out
    assert "speedup bf16-true over fp32: 2.25x (per repeat 2.00x-2.50x); final losses differ by 1.00%" in out


def test_mfu_is_per_rank_and_held_to_the_peak_the_ranks_reported(capsys):
    """Eight ranks processing eight times one's samples use each rank as one alone does; the table shows it."""
    from rich.console import Console

    from ddp_amp.measure.bench import Measurement, analyse
    from ddp_amp.outputs import RunRecord
    from ddp_amp.results.report import bench_table

    def measured(world_size, step_s):
        return Measurement("bf16", 0, {rank: [step_s] * 3 for rank in range(world_size)}, {0: 1.0},
                           RunRecord({"global_batch_size": 8 * world_size, "final_loss": 0.5, "samples_per_s": 1.0,
                                      "world_size": world_size, "model_flops_per_sample": 1e9,
                                      "peak_tflops_per_rank": 0.1, "peak_source": "measured matmul, bf16"}))

    one, eight = (analyse([measured(n, 0.2)])["precisions"]["bf16"] for n in (1, 8))
    # 8 samples per rank in 0.2 s: 40 samples/s of 1 GFLOP each per rank, 40 GFLOP/s of 100: 40 %
    assert one["mfu"] == pytest.approx(0.4) and eight["mfu"] == pytest.approx(0.4)
    assert one["achieved_tflops_per_rank"] == pytest.approx(0.04)
    report = analyse([measured(1, 0.2)])
    report["environment"] = {"torch": "2.13.0", "device": "a CPU", "world_size": 1, "backend": "gloo",
                             "threads_per_rank": 1, "cpu_native_bf16": True, "task": "GPT-2-style decoder, size tiny"}
    Console(width=200).print(bench_table(report))
    out = capsys.readouterr().out
    assert "task: GPT-2-style decoder, size tiny" in out
    assert "40.0%" in out and "MFU: bf16 0.04 of 0.1 TFLOP/s per rank (measured matmul, bf16)" in out


# Names as torch.cuda.get_device_name prints them, and the model and dense peaks each must get.
@pytest.mark.parametrize(("name", "model", "fp32", "tf32", "bf16", "fp16"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 67.0, 494.7, 989.4, 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 51.2, 378.0, 756.0, 756.0),
    ("NVIDIA H100 NVL", "H100 NVL", 60.0, 417.5, 835.5, 835.5),
    ("NVIDIA H200", "H200 SXM", 67.0, 494.7, 989.4, 989.4),
    ("NVIDIA A100-SXM4-40GB", "A100", 19.5, 156.0, 312.0, 312.0),
    ("NVIDIA A100-SXM4-80GB", "A100", 19.5, 156.0, 312.0, 312.0),
    ("NVIDIA A100-PCIE-40GB", "A100", 19.5, 156.0, 312.0, 312.0),
    ("NVIDIA A100 80GB PCIe", "A100", 19.5, 156.0, 312.0, 312.0),
    ("NVIDIA L40S", "L40S", 91.6, 183.0, 362.05, 362.05),
    ("NVIDIA L40", "L40", 90.5, 90.5, 181.05, 181.05),
    ("NVIDIA L4", "L4", 30.3, 60.0, 121.0, 121.0),
    ("NVIDIA A10", "A10", 31.2, 62.5, 125.0, 125.0),
    ("Tesla V100-SXM2-16GB", "V100 SXM2", 15.7, None, None, 125.0),
    ("Tesla V100-PCIE-32GB", "V100 PCIe", 14.0, None, None, 112.0),
    ("Tesla T4", "T4", 8.1, None, None, 65.0),
])
def test_each_gpu_gets_its_own_peaks(name, model, fp32, tf32, bf16, fp16):
    from ddp_amp.train.utilisation import gpu_model, peak_tflops

    assert gpu_model(name)[0] == model
    assert [peak_tflops(name, p) for p in ("fp32", "tf32", "bf16", "fp16")] == [fp32, tf32, bf16, fp16]


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA GeForce RTX 4090", "NVIDIA L40G", "NVIDIA H100",
                                  "NVIDIA H800", "AMD Instinct MI300X", ""])
def test_a_gpu_without_a_known_peak_has_no_table_peak(name):
    from ddp_amp.train.utilisation import gpu_model, peak_tflops

    assert gpu_model(name) is None
    assert peak_tflops(name, "bf16") is None


def test_each_precision_is_held_to_the_peak_of_its_matmuls():
    from ddp_amp.train.utilisation import peak_precision

    assert peak_precision("fp32", tf32=False) == "fp32"
    assert peak_precision("fp32", tf32=True) == "tf32"
    assert peak_precision("bf16", tf32=True) == "bf16"
    assert peak_precision("bf16-true") == "bf16"
    assert peak_precision("fp8-rowwise") == "fp8"


def test_subnormals_and_collapsed_gradients_are_named_under_the_table():
    from ddp_amp.measure.bench import numerics_notes

    clean = {"subnormal_fraction": {"activations": 0.0, "gradients": 1e-6, "weights": 0.0, "optimizer_state": 0.0},
             "gradient_to_weight_norm": 0.03}
    slow = {"subnormal_fraction": {"activations": 0.25, "gradients": 0.01, "weights": 0.0, "optimizer_state": 0.0},
            "gradient_to_weight_norm": 2e-9}
    assert numerics_notes({"precisions": {"fp32": clean, "bf16": clean}}) == []
    notes = numerics_notes({"precisions": {"fp32": slow, "bf16": clean}})
    assert len(notes) == 2 and all(note.startswith("fp32: ") for note in notes)
    assert "25.0% of the activations were subnormal" in notes[0] and "--flush-denormal on" in notes[0]
    assert "gradients had collapsed by the end (2.0e-09 of the weights' norm)" in notes[1]


def test_amp_auto_adds_bf16_weights_on_a_cpu_with_native_bf16_only():
    from ddp_amp.measure.bench import resolved_amp

    assert resolved_amp("auto", "cpu", cpu_native_bf16=True) == "all"
    assert resolved_amp("auto", "cpu", cpu_native_bf16=False) == "both"
    assert resolved_amp("auto", "cuda", cpu_native_bf16=True) == "both"
    assert resolved_amp("off", "cpu", cpu_native_bf16=True) == "off"


def test_measuring_a_cpu_ranks_peak_leaves_the_runs_random_state_as_it_was():
    """The peak is measured as training starts: after a resume restored the random state, a draw from it would
    change the data order and dropout of the resumed run."""
    import torch

    from ddp_amp.train.utilisation import device_peak

    torch.manual_seed(3)
    state = torch.get_rng_state()
    peak = device_peak(torch.device("cpu"), "bf16-true")
    assert torch.equal(torch.get_rng_state(), state)
    assert peak.tflops > 0 and peak.source.startswith("measured matmul, bf16, ")


def test_a_cpu_peak_is_the_fastest_matmul_over_a_fifth_of_a_second(monkeypatch):
    """Another process's burst holds the cores for the first 20 matmuls (10 ms each), then they take 0.1 ms: the
    peak is the fast one, not five repeats' worth of the burst. A clock of the test's own times the matmuls."""
    import types

    import torch

    from ddp_amp.train import utilisation

    clock = types.SimpleNamespace(now=0.0, calls=0)

    def matmul(a, b):
        clock.calls += 1
        clock.now += 0.01 if clock.calls <= 20 else 1e-4
        return a

    monkeypatch.setattr(utilisation, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(torch.Tensor, "__matmul__", matmul)
    monkeypatch.setattr(torch.nn.functional, "linear", matmul)
    size = utilisation.MATMUL_SIZE["cpu"]
    assert utilisation.measured_matmul_tflops(torch.device("cpu"), torch.float32) == pytest.approx(
        2 * size**3 / 1e-4 / 1e12)
    assert clock.now >= utilisation.MATMUL_MIN_S


def test_a_json_report_named_by_a_symlink_is_written_where_it_points_and_the_link_kept(tmp_path, capsys):
    """bench's and doctor's --json through a link, as a shell's `>` writes: renamed over the link, the report
    replaced the user's link with a file of ours."""
    from ddp_amp.commands.options import check_json_path
    from ddp_amp.outputs import write_json_report

    link, target = tmp_path / "latest.json", tmp_path / "reports" / "bench-1.json"
    target.parent.mkdir()
    link.symlink_to(target)  # dangling: the report is new
    for figure in (1, 2):  # then a report ddp-amp wrote, replaced
        check_json_path(link)
        write_json_report(link, {"figure": figure}, "bench")
        assert link.is_symlink() and json.loads(target.read_text())["figure"] == figure
    assert sorted(p.name for p in target.parent.iterdir()) == ["bench-1.json"]  # no temporary file left
    target.write_text("mine\n")
    with pytest.raises(SystemExit) as exit_info:  # through the command: one line, the link and the file kept
        main(["bench", "--device", "cpu", "--json", str(link), "--run-dir", str(tmp_path / "bench")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (f"ddp-amp: error: --json {str(link)!r} already exists and is not a "
                                               "report ddp-amp wrote; remove it or choose another name")
    assert link.is_symlink() and target.read_text() == "mine\n" and not (tmp_path / "bench").exists()


def test_bench_claims_no_mfu_over_100_percent():
    """bench computes its MFU from the runs' peaks: a peak the run itself found below the rate achieved (a busy
    machine) gave the table an MFU over 100%; now none, and the peak's source says why."""
    from ddp_amp.measure.bench import Measurement, analyse
    from ddp_amp.outputs import RunRecord

    def measured(label, repeat, peak):
        summary = {"global_batch_size": 64, "final_loss": 0.5, "samples_per_s": 6400.0, "world_size": 2,
                   "model_flops_per_sample": 1e9, "peak_tflops_per_rank": peak,
                   "peak_source": "measured matmul, fp32, 1 thread"}
        return Measurement(label, repeat, {0: [0.01] * 3, 1: [0.01] * 3}, {0: 100.0, 1: 100.0}, RunRecord(summary))

    report = analyse([measured("fp32", 0, 4.0), measured("bf16", 0, 2.0)])  # 3.2 TFLOP/s per rank achieved
    fp32, bf16 = report["precisions"]["fp32"], report["precisions"]["bf16"]
    assert fp32["mfu"] == pytest.approx(0.8) and fp32["peak_source"] == "measured matmul, fp32, 1 thread"
    assert bf16["mfu"] is None and bf16["achieved_tflops_per_rank"] == pytest.approx(3.2)
    assert bf16["peak_source"] == "measured matmul, fp32, 1 thread; below the rate achieved: no MFU"


def test_a_plot_named_by_a_symlink_takes_the_format_of_the_file_it_points_to(tmp_path, capsys):
    """`latest.png -> runs.pdf`: the file written is a PDF (PNG bytes went into runs.pdf); a link to a file
    of no plot format is refused naming it."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddp_amp.commands.options import check_plot_path
    from ddp_amp.errors import UsageError
    from ddp_amp.results.report import save_figure

    link, target = tmp_path / "latest.png", tmp_path / "runs.pdf"
    link.symlink_to(target)
    check_plot_path(link)
    fig, ax = plt.subplots()
    ax.plot([1, 2])
    save_figure(fig, link, dpi=50)
    assert link.is_symlink() and target.read_bytes().startswith(b"%PDF")
    other = tmp_path / "other.png"
    other.symlink_to(tmp_path / "notes.txt")
    with pytest.raises(UsageError, match=r"it links to .*notes\.txt'\): the suffix chooses the format"):
        check_plot_path(other)
