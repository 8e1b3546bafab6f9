"""`ddp-amp bench`: real interleaved AMP off/on launches on CPU, their JSON, their table. The refusals and the
arithmetic without launches: tests/unit/test_bench.py."""

import json
import re
import statistics

import pytest
from helpers import assert_ok, last_line, launch_until, run_cli


@pytest.fixture(scope="module")
def bench_both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    result = run_cli("bench", "--amp", "both", "--steps", "5", "--warmup", "2", "--repeats", "2", "--nproc", "2",
                     "--device", "cpu", "--task", "mlp", "--json", str(tmp / "out.json"), "--run-dir",
                     str(tmp / "runs"), env={"COLUMNS": "160"}, timeout=300)
    assert_ok(result)
    return json.loads((tmp / "out.json").read_text()), result


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
    per_repeat = [a["step_s_median"] / b["step_s_median"]
                  for a, b in zip(precisions["fp32"]["repeats"], precisions["bf16"]["repeats"])]
    assert speedup["per_repeat"] == pytest.approx(per_repeat) and len(per_repeat) == 2
    assert speedup["median"] == pytest.approx(statistics.median(per_repeat))
    assert "relative_difference" in report["loss_agreement"]
    env = report["environment"]
    assert env["world_size"] == 2 and env["backend"] == "gloo" and "torch" in env and "cpu_native_bf16" in env
    assert env["threads_per_rank"] >= 1 and isinstance(env["cpu_flags"], list)


def test_table_shows_both_rows_and_the_speedup(bench_both):
    report, result = bench_both
    rows = [line for line in result.stdout.splitlines() if line.strip("│ ").startswith(("fp32", "bf16"))]
    assert len(rows) == 2
    assert f"speedup bf16 over fp32: {report['speedup']['median']:.2f}x" in result.stdout


def test_warmup_is_not_timed(tmp_path, helper_task):
    result = run_cli("bench", "--amp", "off", "--steps", "6", "--warmup", "3", "--repeats", "1", "--nproc", "2",
                     "--device", "cpu", "--task", helper_task("slow_start"), "--json", str(tmp_path / "o.json"),
                     "--run-dir", str(tmp_path / "runs"))
    assert_ok(result)
    entry = json.loads((tmp_path / "o.json").read_text())["precisions"]["fp32"]
    assert entry["step_s_median"] < 0.1  # the three 0.5 s warm-up steps are not in it
    assert max(t for times in entry["repeats"][0]["step_s"].values() for t in times) < 0.4


def test_the_precisions_are_interleaved(bench_both):
    """fp32 and AMP take turns (a drift of the shared machine hits both alike), not all of one, then the other."""
    _, result = bench_both
    order = re.findall(r"^bench: \d+/4 (\S+) repeat (\d+):", result.stderr, flags=re.MULTILINE)
    assert order == [("fp32", "1"), ("bf16", "1"), ("fp32", "2"), ("bf16", "2")], result.stderr


@pytest.mark.parametrize("flush", ["off", "auto"])
def test_bench_finds_subnormal_activations_unless_they_are_flushed(tmp_path, helper_task, flush):
    out = tmp_path / "bench.json"
    result = run_cli("bench", "--device", "cpu", "--amp", "off", "--task", helper_task("subnormal_activations"),
                     "--steps", "3", "--warmup", "1", "--repeats", "1", "--nproc", "2", "--flush-denormal", flush,
                     "--run-dir", str(tmp_path / "runs"), "--json", str(out))
    assert_ok(result)
    report = json.loads(out.read_text())
    fp32 = report["precisions"]["fp32"]
    assert fp32["flush_denormal"] is (flush == "auto") and report["environment"]["flush_denormal"] is (flush == "auto")
    if flush == "off":
        share = fp32["subnormal_fraction"]["activations"]
        assert share > 0.5  # the frozen layer's outputs all are, the trained layer's most
        note = f"fp32: {share:.1%} of the activations were subnormal (below 1.2e-38)"
        assert any(line.startswith(note) for line in report["notes"])
        assert note in " ".join(result.stdout.split())
    else:
        assert fp32["subnormal_fraction"]["activations"] == 0.0
        assert not any("were subnormal" in note for note in report["notes"])


def test_shard_modes_are_interleaved_and_compared_with_the_first(tmp_path):
    """bench --shard none,full: both launched in every round, the table and JSON are none's, and full is given
    as ratios to it per interleaved pair: throughput, and rank 0's training-state memory (peak less baseline),
    with each rank's optimizer state (FSDP: half of DDP's on each of 2 ranks)."""
    out = tmp_path / "out.json"
    result = run_cli("bench", "--amp", "off", "--shard", "none,full", "--steps", "4", "--warmup", "2", "--repeats",
                     "2", "--nproc", "2", "--device", "cpu", "--task", "mlp-wide", "--json", str(out), "--run-dir",
                     str(tmp_path / "runs"), env={"COLUMNS": "200"}, timeout=600)
    assert_ok(result)
    report = json.loads(out.read_text())
    assert report["method"]["order"] == "interleaved off, off full" and report["method"]["shard"] == ["none", "full"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["off-0", "off-1", "off-full-0", "off-full-1"]
    assert json.loads((tmp_path / "runs" / "off-full-1" / "summary.json").read_text())["shard"] == "full"
    full = report["shards"]["full"]["fp32"]
    assert report["shards"]["against"] == "none"
    for figure in ("throughput", "training_state_memory"):
        assert full[figure]["min"] <= full[figure]["median"] <= full[figure]["max"] and full[figure]["min"] > 0
    whole = json.loads((tmp_path / "runs" / "off-0" / "summary.json").read_text())["optimizer_state_mb"][0]
    assert full["optimizer_state_mb"] == pytest.approx([whole / 2, whole / 2], rel=1e-3)
    median = full["throughput"]["median"]
    assert f"--shard full / none (fp32): throughput {median:.2f}x" in result.stdout


def test_the_default_compares_what_a_user_would_pick_here_with_each_ones_mfu(tmp_path):
    """No --amp: on a CPU with native bf16, bf16 weights (bf16-true) beside fp32 and autocast; elsewhere fp32 and
    autocast. The gpt task counts its FLOPs: each row has its MFU, and the table says which size ran."""
    from ddp_amp.precision import cpu_has_native_bf16

    result = run_cli("bench", "--steps", "3", "--warmup", "1", "--repeats", "1", "--nproc", "2", "--device", "cpu",
                     "--task", "gpt", "--json", str(tmp_path / "out.json"), "--run-dir", str(tmp_path / "runs"),
                     env={"COLUMNS": "200"}, timeout=300)
    assert_ok(result)
    report = json.loads((tmp_path / "out.json").read_text())
    expected = {"fp32", "bf16", "bf16-true"} if cpu_has_native_bf16() else {"fp32", "bf16"}
    assert set(report["precisions"]) == expected
    for entry in report["precisions"].values():
        assert entry["mfu"] == pytest.approx(entry["achieved_tflops_per_rank"] / entry["peak_tflops_per_rank"])
        assert entry["peak_source"].startswith("measured matmul, ")
    assert "task: GPT-2-style decoder, size tiny" in result.stdout
    assert "MFU" in result.stdout


def test_a_stopped_bench_names_no_resume_it_cannot_continue(tmp_path):
    """A stop during a measurement keeps the ranks' stop checkpoint, but a bench run is not continued: its line
    says where it stopped, not "continue with --resume auto" (which bench refuses, and which spawn would take as
    training)."""
    runs = tmp_path / "runs"
    result = launch_until(runs, "--device", "cpu", "--task", "linear", "--amp", "off", "--steps", "1000000",
                          "--warmup", "0", "--repeats", "1", "--checkpoint-every", "50", command="bench", nproc=1,
                          until=lambda: any(runs.glob("off-0/checkpoints/step-*.pt")))
    assert result.returncode == 143, result.stderr
    assert re.fullmatch(rf"ddp-amp: error: stopped by SIGTERM at step \d+; the measurement in "
                        rf"{re.escape(str(runs / 'off-0'))} is incomplete", last_line(result.stderr)), result.stderr
