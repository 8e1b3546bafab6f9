"""--dtype fp8: refused in one line where it cannot run (CPU ranks, GPUs without fp8, a script's own loop), never
chosen unasked; and the layer conversion itself (torchao's, checked here on the CPU): the converted model's
state holds the same high-precision weights under nn.Linear's names, so checkpoints and model.pt load into a
plain model and a run can continue in another precision. fp8 training on a GPU: tests/system/test_gpu.py."""

import pytest
import torch
from helpers import one_line, run_main

from ddp_amp.errors import UsageError
from ddp_amp.precision import resolve_precision


@pytest.mark.parametrize("command", [["spawn", "-n", "1"], ["run", "--nproc-per-node", "1"], ["bench"]])
@pytest.mark.parametrize("dtype", ["fp8", "fp8-rowwise"])
def test_fp8_on_cpu_ranks_is_one_line_and_launches_nothing(command, dtype, tmp_path, capsys):
    code, _, err = run_main([*command, "--device", "cpu", "--dtype", dtype, "--run-dir", str(tmp_path / "r")],
                            capsys)
    assert code == 2
    assert one_line(err) == (f"ddp-amp: error: --dtype {dtype} needs NVIDIA GPUs of compute capability 8.9 or "
                             "newer (Ada, Hopper), and CPU ranks have no fp8 matrix units; use --dtype bf16 or "
                             "bf16-true")
    assert not (tmp_path / "r").exists()


def test_fp8_needs_gpus_with_fp8_and_is_never_chosen_unasked():
    with pytest.raises(UsageError, match="these GPUs have no fp8"):
        resolve_precision("cuda", "on", "fp8", cuda_bf16=True, cuda_fp8=False)  # an A100
    assert resolve_precision("cuda", "on", "fp8-rowwise", cuda_bf16=True, cuda_fp8=True).fp8_recipe == "rowwise"
    assert resolve_precision("cuda", "on", "fp8", cuda_bf16=True, cuda_fp8=True).fp8_recipe == "tensorwise"
    assert resolve_precision("cuda", "auto", "auto", cuda_bf16=True, cuda_fp8=True).name == "bf16"
    assert resolve_precision("cuda", "off", "auto", cuda_bf16=True, cuda_fp8=True).name == "fp32"


def test_a_scripts_loop_is_refused_fp8(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    code, _, err = run_main(["spawn", "-n", "1", "--device", "cpu", "--dtype", "fp8", "--run-dir",
                             str(tmp_path / "r"), str(script)], capsys)
    assert code == 2 and "--dtype fp8" in one_line(err)
    assert not (tmp_path / "r").exists()


def test_the_converted_model_holds_the_plain_models_weights(capfd):
    pytest.importorskip("torchao.float8")
    from ddp_amp.parallel.float8 import fp8_summary, to_float8
    from ddp_amp.tasks.gpt import GPT, SIZES

    torch.manual_seed(0)
    plain = GPT(SIZES["tiny"])
    converted = to_float8(GPT(SIZES["tiny"]), "rowwise")
    converted.load_state_dict(plain.state_dict())
    # Every Linear of the blocks computes in fp8 (4 per block); the tied output layer stays nn.Linear, as
    # torchtitan keeps its output layer (though its shape, vocab 512 by width 128, could compute in fp8).
    assert fp8_summary(converted, "rowwise") == {"recipe": "rowwise", "layers": 4 * SIZES["tiny"].layers,
                                                 "output_layers_kept": ["head"]}
    assert type(converted.head) is torch.nn.Linear and converted.head.weight is converted.tok.weight  # tied
    state = converted.state_dict()
    assert state.keys() == plain.state_dict().keys()
    assert all(value.dtype == torch.float32 for value in state.values())
    again = GPT(SIZES["tiny"])
    again.load_state_dict(state)  # what model.pt and a checkpoint hold loads into the plain model, strictly
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), plain.state_dict().values()))


def test_layers_fp8_cannot_compute_stay_as_they_are():
    pytest.importorskip("torchao.float8")
    from ddp_amp.parallel.float8 import fp8_summary, to_float8

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    to_float8(model, "tensorwise")
    assert fp8_summary(model, "tensorwise")["layers"] == 1 and type(model[2]) is torch.nn.Linear  # 10 outputs


def test_an_output_layer_by_its_name_stays_in_high_precision():
    """Hugging Face's `lm_head` and torchtitan's `output`, untied, stay nn.Linear; a layer of another name of
    the same shape computes in fp8."""
    pytest.importorskip("torchao.float8")
    from ddp_amp.parallel.float8 import fp8_summary, to_float8

    model = torch.nn.ModuleDict({"body": torch.nn.Linear(32, 64), "lm_head": torch.nn.Linear(64, 128),
                                 "output": torch.nn.Linear(64, 128), "outputs": torch.nn.Linear(64, 128)})
    to_float8(model, "tensorwise")
    assert fp8_summary(model, "tensorwise") == {"recipe": "tensorwise", "layers": 2,
                                                "output_layers_kept": ["lm_head", "output"]}
    assert type(model["outputs"]).__name__ == "Float8Linear"
