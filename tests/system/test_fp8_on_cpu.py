"""--dtype fp8's training path on 2-rank gloo runs, where CI can run it: the GPU test's checks
(tests/system/test_gpu.py::test_fp8_trains_resumes_bit_exact_and_continues_in_bf16) on the CPU.

ddp-amp refuses fp8 on CPU ranks (tests/unit/test_fp8.py): torch's CPU `_scaled_mm` emulates fp8, slowly. But it
computes, so with that one refusal lifted in every process of the launch (a sitecustomize on PYTHONPATH) the rest
runs as on a GPU: torchao's float8 layers under DDP and FSDP2, their checkpoints, a bit-exact resume, a checkpoint
that continues in bf16."""

import os

import pytest
import torch
from helpers import TESTS, assert_ok, load_weights, read_summary, run_cli

from ddp_amp.tasks.gpt import GPT, SIZES

pytest.importorskip("torchao.float8")

FP8_ON_CPU = TESTS / "fp8_on_cpu"
"""Its sitecustomize lifts the refusal (and turns oneDNN off, whose fp8 kernel on an AMX CPU is a reference one)."""



@pytest.mark.parametrize("mode", ["none", "full"])
def test_fp8_trains_resumes_bit_exact_and_continues_in_bf16_on_gloo(tmp_path, mode):
    """Under DDP (none) and FSDP2 (full): fp8 trains, model.pt holds fp32 weights under nn.Linear's names, and a
    resume from step 4 ends on the whole run's model.pt byte for byte. Under DDP its loss is near bf16's and not
    bf16's (the layers did compute in fp8); under FSDP2 its checkpoint continues in bf16."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(FP8_ON_CPU), os.environ.get("PYTHONPATH")]))}
    common = ["spawn", "-n", "2", "--device", "cpu", "--task", "gpt", "--steps", "8", "--shard", mode]

    def train(name: str, *args: str) -> dict:
        assert_ok(run_cli(*common, *args, "--run-dir", str(tmp_path / name), env=env, timeout=300))
        return read_summary(tmp_path / name)

    whole = train("whole", "--dtype", "fp8", "--checkpoint-every", "4")
    assert whole["precision"] == "fp8"
    assert whole["fp8"] == {"recipe": "tensorwise", "layers": 8, "output_layers_kept": ["head"]}  # head: tied
    weights = load_weights(tmp_path / "whole")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert weights.keys() == GPT(SIZES["tiny"]).state_dict().keys()  # a plain model's names: it loads model.pt
    checkpoint = str(tmp_path / "whole" / "checkpoints" / "step-4.pt")
    resumed = train("resumed", "--dtype", "fp8", "--resume", checkpoint)
    assert resumed["resumed_from_step"] == 4
    assert (tmp_path / "resumed" / "model.pt").read_bytes() == (tmp_path / "whole" / "model.pt").read_bytes()
    if mode == "none":
        bf16 = train("bf16", "--dtype", "bf16")
        assert whole["final_loss"] == pytest.approx(bf16["final_loss"], rel=0.05)
        assert whole["final_loss"] != bf16["final_loss"]
    else:
        in_bf16 = train("in-bf16", "--dtype", "bf16", "--resume", checkpoint)
        assert in_bf16["precision"] == "bf16" and "fp8" not in in_bf16 and in_bf16["steps"] == 8
