"""The CUDA path, on real GPUs: nccl, bf16 and fp16 with evaluation, torchrun, bench, loader workers.

Skipped where no CUDA GPU is visible (CI has none); the two-rank tests need two GPUs. Run them with
`python -m pytest -m gpu` on a GPU machine.
"""

import pytest
import torch
from helpers import assert_ok, load_weights, read_summary, run_cli

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]
RANKS = min(GPUS, 2)


def native_bf16() -> bool:
    from ddp_amp.precision import cuda_has_native_bf16

    return GPUS > 0 and cuda_has_native_bf16(torch.cuda.get_device_capability(0))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("launcher", ["spawn", "run"])
def test_mlp_trains_and_evaluates_on_gpus(tmp_path, launcher, dtype):
    if dtype == "bf16" and not native_bf16():
        pytest.skip("this GPU has no native bf16")
    count_flag = "-n"
    result = run_cli(launcher, count_flag, str(RANKS), "--device", "cuda", "--task", "mlp", "--steps", "80",
                     "--dtype", dtype, "--run-dir", str(tmp_path), timeout=300)
    assert_ok(result)
    summary = read_summary(tmp_path)
    assert summary["precision"] == dtype and summary["backend"] == "nccl" and summary["device"] == "cuda"
    assert summary["world_size"] == RANKS
    assert summary["eval"]["accuracy"] >= 0.9
    assert load_weights(tmp_path)


def test_auto_precision_follows_compute_capability(tmp_path):
    result = run_cli("spawn", "-n", "1", "--device", "cuda", "--task", "linear", "--steps", "20",
                     "--run-dir", str(tmp_path), timeout=300)
    assert_ok(result)
    assert read_summary(tmp_path)["precision"] == ("bf16" if native_bf16() else "fp16")


def test_fp16_skip_counter_on_the_gpu(tmp_path, helper_task):
    result = run_cli("spawn", "-n", "1", "--device", "cuda", "--dtype", "fp16", "--task",
                     helper_task("inf_at_third_step"), "--steps", "8", "--log-every", "4", "--batch-size", "16",
                     "--run-dir", str(tmp_path), timeout=300)
    assert_ok(result)
    summary = read_summary(tmp_path)
    assert summary["skipped_steps"] == 1 and summary["precision"] == "fp16"


def test_structured_batches_reach_the_gpu_with_loader_workers(tmp_path, helper_task):
    result = run_cli("spawn", "-n", str(RANKS), "--device", "cuda", "--task", helper_task("structured_batches"),
                     "--steps", "10", "--num-workers", "2", "--amp", "off", "--run-dir", str(tmp_path), timeout=300)
    assert_ok(result)
    assert read_summary(tmp_path)["loader_workers"] == 2


def test_bench_transformer_reports_mfu_per_gpu(tmp_path):
    json_path = tmp_path / "bench.json"
    result = run_cli("bench", "--device", "cuda", "--nproc", str(RANKS), "--task", "transformer", "--steps", "20",
                     "--warmup", "5", "--repeats", "1", "--json", str(json_path), "--run-dir", str(tmp_path / "runs"),
                     timeout=600)
    assert_ok(result)
    import json

    report = json.loads(json_path.read_text())
    assert set(report["precisions"]) == {"fp32", "bf16" if native_bf16() else "fp16"}
    for entry in report["precisions"].values():
        if entry.get("mfu") is not None:
            assert 0 < entry["mfu"] < 1


def test_compile_and_the_fused_step_on_the_gpu(tmp_path):
    """--compile on CUDA (inductor's triton kernels) with the default fused AdamW; the weights keep the module's
    own names and the compile time is reported apart."""
    result = run_cli("spawn", "-n", str(RANKS), "--device", "cuda", "--task", "mlp", "--steps", "30", "--compile",
                     "--run-dir", str(tmp_path), timeout=600)
    assert_ok(result)
    summary = read_summary(tmp_path)
    assert summary["compile_s"] > 0 and summary["optimizer_impl"] in ("fused", "foreach")
    assert all(not key.startswith("_orig_mod") for key in load_weights(tmp_path))


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_gradient_compression_on_nccl(tmp_path, compression):
    if compression == "bf16" and not native_bf16():
        pytest.skip("this GPU has no native bf16")
    result = run_cli("spawn", "-n", str(RANKS), "--device", "cuda", "--task", "mlp", "--steps", "60",
                     "--grad-compression", compression, "--run-dir", str(tmp_path), timeout=300)
    assert_ok(result)
    summary = read_summary(tmp_path)
    assert summary["ddp"]["grad_compression"] == compression and summary["eval"]["accuracy"] >= 0.9


def test_each_ranks_own_bf16_answer_follows_its_gpus_capability():
    """The function each rank calls before the ranks agree: native bf16 from compute capability 8.0 on."""
    from ddp_amp.rank.setup import gpu_bf16_is_native

    major, _ = torch.cuda.get_device_capability(0)
    assert gpu_bf16_is_native(torch.device("cuda", 0)) is (major >= 8)


HELPER = str(__import__("conftest").HELPER_TASKS)


def test_micro_batch_auto_fits_under_max_memory_on_a_gpu(tmp_path):
    """--max-memory 0.5 caps the caching allocator (set_per_process_memory_fraction): the whole data set, 8192
    samples of the 64-16384-10 MLP, needs about 1.5 GB of activations, so auto halves until a size fits, and
    peak memory stays under the cap. (It asked for 65536 samples until the launcher refused a batch larger than
    the data set.)"""
    result = run_cli("spawn", "-n", "1", "--device", "cuda", "--task", f"{HELPER}:activation_heavy", "--amp", "off",
                     "--batch-size", "8192", "--steps", "3", "--max-memory", "0.5", "--micro-batch", "auto",
                     "--run-dir", str(tmp_path), timeout=300)
    assert_ok(result)
    summary = read_summary(tmp_path)
    assert summary["micro_batch_changes"] and summary["micro_batch_size"] < 8192
    assert summary["peak_memory_mb"] <= 512 and summary["peak_memory_allocated_mb"] <= summary["peak_memory_mb"]


def test_out_of_memory_on_a_gpu_without_auto_is_one_line(tmp_path):
    result = run_cli("spawn", "-n", "1", "--device", "cuda", "--task", f"{HELPER}:activation_heavy", "--amp", "off",
                     "--batch-size", "8192", "--steps", "3", "--max-memory", "0.5", "--run-dir", str(tmp_path),
                     timeout=300)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "failed: out of memory in step 1" in last and "--micro-batch auto" in last


def test_bench_max_batch_on_a_gpu(tmp_path):
    import json

    out = tmp_path / "max.json"
    result = run_cli("bench", "-n", "1", "--device", "cuda", "--task", f"{HELPER}:activation_heavy", "--max-batch",
                     "--max-memory", "2", "--batch-size", "1024", "--run-dir", str(tmp_path / "runs"), "--json",
                     str(out), timeout=600)
    assert_ok(result)
    report = json.loads(out.read_text())
    assert report["max_batch"]["fp32"]["max_batch"] >= 1024
    assert report["max_batch_ratio"]["ratio"] > 1  # half-precision activations: a larger batch fits


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_shard_full_trains_on_gpus_with_autocast_and_the_sharded_scaler(tmp_path, dtype, helper_task):
    """FSDP2 on nccl: bf16 or fp16 autocast over fp32 sharded parameters, clipping of sharded gradients, and
    fp16's ShardedGradScaler skipping the step the task makes infinite on every rank alike."""
    if dtype == "bf16" and not native_bf16():
        pytest.skip("this GPU has no native bf16")
    result = run_cli("spawn", "-n", str(RANKS), "--device", "cuda", "--task", "transformer", "--steps", "40",
                     "--dtype", dtype, "--shard", "full", "--clip-grad", "1.0", "--checkpoint-every", "20",
                     "--run-dir", str(tmp_path / "lm"), timeout=600)
    assert_ok(result)
    summary = read_summary(tmp_path / "lm")
    assert summary["shard"] == "full" and summary["precision"] == dtype and summary["backend"] == "nccl"
    assert summary["final_loss"] < 3.0 and load_weights(tmp_path / "lm")
    if dtype == "fp16":
        result = run_cli("spawn", "-n", str(RANKS), "--device", "cuda", "--dtype", "fp16", "--shard", "full",
                         "--task", helper_task("inf_at_third_step"), "--steps", "8", "--log-every", "4",
                         "--batch-size", "16", "--run-dir", str(tmp_path / "skip"), timeout=300)
        assert_ok(result)
        assert read_summary(tmp_path / "skip")["skipped_steps"] == 1


@pytest.mark.parametrize("mode", ["none", "full"])
def test_sharded_checkpoints_on_gpus_resume_bit_exact(tmp_path, mode):
    """--checkpoint-format sharded on nccl: each rank stages its CUDA part to host memory, the background DCP
    write runs on the checkpoint's own gloo group, and a resume (DCP loading into the CUDA template) ends on the
    uninterrupted run's weights byte for byte."""
    common = ["spawn", "-n", str(RANKS), "--device", "cuda", "--task", "mlp", "--steps", "20", "--amp", "off",
              "--shard", mode, "--checkpoint-format", "sharded"]
    assert_ok(run_cli(*common, "--checkpoint-every", "10", "--run-dir", str(tmp_path / "whole"), timeout=300))
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-10"
    assert (checkpoint / ".metadata").is_file() and len(list(checkpoint.glob("*.distcp"))) == RANKS
    assert_ok(run_cli(*common, "--resume", str(checkpoint), "--run-dir", str(tmp_path / "resumed"), timeout=300))
    assert (tmp_path / "resumed" / "model.pt").read_bytes() == (tmp_path / "whole" / "model.pt").read_bytes()


@pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")
def test_a_model_given_as_a_function_reaches_the_other_gpus_from_rank_0(tmp_path, helper_task):
    """Task.model as a function under --shard full on nccl: rank 1 builds on the meta device and receives its
    shards and buffers from rank 0's GPU; the weights are within 1e-5 of --shard none's."""
    common = ["spawn", "-n", "2", "--device", "cuda", "--amp", "off", "--optimizer", "adamw", "--task",
              helper_task("model_as_function"), "--steps", "20", "--batch-size", "16"]
    for mode in ("none", "full"):
        assert_ok(run_cli(*common, "--task-arg", f"record={tmp_path / mode}.txt", "--shard", mode, "--run-dir",
                          str(tmp_path / mode), timeout=300))
    assert sorted((tmp_path / "full.txt").read_text().splitlines()) == ["0 cpu", "1 meta"]
    full, none = load_weights(tmp_path / "full"), load_weights(tmp_path / "none")
    assert max((full[name] - none[name]).abs().max().item() for name in none) < 1e-5


@pytest.mark.parametrize("mode", ["none", "full"])
def test_bf16_true_trains_on_gpus_and_resumes_bit_exact(tmp_path, mode):
    """--dtype bf16-true on nccl: bf16 weights with fp32 masters under DDP, FSDP2's bf16 all-gathers over fp32
    shards under --shard full; within 2% of an fp32 run's loss, model.pt in fp32, and a resume from step 10 ends
    on the whole run's model.pt byte for byte."""
    if not native_bf16():
        pytest.skip("this GPU has no native bf16")
    common = ["spawn", "-n", str(RANKS), "--device", "cuda", "--task", "mlp", "--steps", "20", "--shard", mode]
    assert_ok(run_cli(*common, "--dtype", "bf16-true", "--checkpoint-every", "10", "--run-dir",
                      str(tmp_path / "whole"), timeout=300))
    assert_ok(run_cli(*common, "--amp", "off", "--run-dir", str(tmp_path / "fp32"), timeout=300))
    summary, fp32 = read_summary(tmp_path / "whole"), read_summary(tmp_path / "fp32")
    assert summary["precision"] == "bf16-true" and summary["backend"] == "nccl"
    assert summary["final_loss"] == pytest.approx(fp32["final_loss"], rel=0.02)
    assert all(t.dtype == torch.float32 for t in load_weights(tmp_path / "whole").values())
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-10.pt"
    assert_ok(run_cli(*common, "--dtype", "bf16-true", "--resume", str(checkpoint), "--run-dir",
                      str(tmp_path / "resumed"), timeout=300))
    assert (tmp_path / "resumed" / "model.pt").read_bytes() == (tmp_path / "whole" / "model.pt").read_bytes()


def fp8_ready() -> bool:
    from ddp_amp.precision import cuda_devices_have_fp8, fp8_refusal

    return GPUS > 0 and fp8_refusal("cuda", cuda_devices_have_fp8(range(RANKS))) is None


@pytest.mark.parametrize("mode", ["none", "full"])
def test_fp8_trains_resumes_bit_exact_and_continues_in_bf16(tmp_path, mode):
    """--dtype fp8 (torchao's float8, tensorwise) on nccl under DDP and FSDP2: its linear layers in fp8, its loss
    within 5% of bf16's, model.pt in fp32 under nn.Linear's names; a resume from step 10 ends on the whole run's
    model.pt byte for byte; the same checkpoint continues in bf16."""
    if not fp8_ready():
        pytest.skip("needs GPUs of compute capability 8.9+ and torchao")
    common = ["spawn", "-n", str(RANKS), "--device", "cuda", "--task", "gpt", "--steps", "20", "--shard", mode]
    assert_ok(run_cli(*common, "--dtype", "fp8", "--checkpoint-every", "10", "--run-dir", str(tmp_path / "whole"),
                      timeout=300))
    assert_ok(run_cli(*common, "--dtype", "bf16", "--run-dir", str(tmp_path / "bf16"), timeout=300))
    summary, bf16 = read_summary(tmp_path / "whole"), read_summary(tmp_path / "bf16")
    assert summary["precision"] == "fp8"
    assert summary["fp8"] == {"recipe": "tensorwise", "layers": 8, "output_layers_kept": ["head"]}  # head: tied
    assert summary["final_loss"] == pytest.approx(bf16["final_loss"], rel=0.05)
    weights = load_weights(tmp_path / "whole")
    assert all(t.dtype == torch.float32 for t in weights.values()) and "head.weight" in weights
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-10.pt"
    assert_ok(run_cli(*common, "--dtype", "fp8", "--resume", str(checkpoint), "--run-dir",
                      str(tmp_path / "resumed"), timeout=300))
    assert (tmp_path / "resumed" / "model.pt").read_bytes() == (tmp_path / "whole" / "model.pt").read_bytes()
    assert_ok(run_cli(*common, "--dtype", "bf16", "--resume", str(checkpoint), "--run-dir",
                      str(tmp_path / "in-bf16"), timeout=300))
    assert read_summary(tmp_path / "in-bf16")["precision"] == "bf16"


def test_the_gpt_task_reports_mfu_against_the_gpus_data_sheet(tmp_path):
    if not native_bf16():
        pytest.skip("this GPU has no native bf16")
    assert_ok(run_cli("spawn", "-n", "1", "--device", "cuda", "--task", "gpt", "--task-arg", "size=124m",
                      "--batch-size", "8", "--steps", "30", "--dtype", "bf16", "--run-dir", str(tmp_path), timeout=300))
    summary = read_summary(tmp_path)
    from ddp_amp.train.utilisation import gpu_model

    known = gpu_model(torch.cuda.get_device_name(0))
    assert summary["peak_source"] == (f"{known[0]} data sheet, bf16" if known else "measured matmul, bf16")
    assert 0 < summary["mfu"] < 1


def test_bench_amp_all_includes_fp8_where_the_gpu_has_it(tmp_path):
    if not native_bf16():
        pytest.skip("--amp all's bf16-true needs native bf16")
    json_path = tmp_path / "bench.json"
    assert_ok(run_cli("bench", "--device", "cuda", "--nproc", "1", "--task", "gpt", "--amp", "all", "--steps", "10",
                      "--warmup", "3", "--repeats", "1", "--json", str(json_path), "--run-dir", str(tmp_path / "runs"),
                      timeout=600))
    import json

    report = json.loads(json_path.read_text())
    assert set(report["precisions"]) == {"fp32", "bf16", "bf16-true"} | ({"fp8"} if fp8_ready() else set())
