"""Which precision --amp/--dtype resolve to on each kind of device."""

import pytest

from ddp_amp.errors import UsageError
from ddp_amp.precision import resolve_precision


@pytest.mark.parametrize(
    ("device", "amp", "dtype", "cuda_bf16", "cpu_bf16", "expected"),
    [
        ("cpu", "auto", "auto", False, False, "fp32"),
        ("cpu", "auto", "auto", False, True, "bf16"),
        ("cpu", "on", "auto", False, True, "bf16"),
        ("cpu", "off", "auto", False, True, "fp32"),
        ("cpu", "auto", "bf16", False, False, "bf16"),  # an explicit dtype means on
        ("cuda", "auto", "auto", True, False, "bf16"),
        ("cuda", "auto", "auto", False, False, "fp16"),  # older GPUs
        ("cuda", "on", "fp16", True, False, "fp16"),
        ("cuda", "off", "auto", True, False, "fp32"),
    ],
)
def test_resolution(device, amp, dtype, cuda_bf16, cpu_bf16, expected):
    precision = resolve_precision(device, amp, dtype, cuda_bf16=cuda_bf16, cpu_native_bf16=cpu_bf16)
    assert precision.name == expected
    assert precision.uses_scaler == (expected == "fp16")


def test_emulated_cpu_bf16_warns_once_in_words():
    precision = resolve_precision("cpu", "on", "bf16", cpu_native_bf16=False)
    assert precision.name == "bf16"
    assert "emulated" in precision.warning and "slow" in precision.warning
    assert resolve_precision("cpu", "on", "bf16", cpu_native_bf16=True).warning is None


def test_bf16_on_a_gpu_without_it_is_a_usage_error():
    with pytest.raises(UsageError, match="--dtype bf16"):
        resolve_precision("cuda", "on", "bf16", cuda_bf16=False)
