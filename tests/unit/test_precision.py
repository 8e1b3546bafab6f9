"""Which precision --amp/--dtype resolve to on each kind of device."""

import pytest
import torch

from ddp_amp.errors import UsageError
from ddp_amp.precision import cuda_devices_have_native_bf16, cuda_has_native_bf16, resolve_precision


@pytest.mark.parametrize(
    ("device", "amp", "dtype", "cuda_bf16", "cpu_bf16", "expected"),
    [
        ("cpu", "auto", "auto", False, "none", "fp32"),  # provisional: rank 0's probe decides
        ("cpu", "auto", "auto", False, "avx512_bf16", "fp32"),
        ("cpu", "on", "auto", False, "avx512_bf16", "bf16"),  # AMP asked for: the CPU's AMP dtype
        ("cpu", "off", "auto", False, "avx512_bf16", "fp32"),
        ("cpu", "auto", "bf16", False, "none", "bf16"),  # an explicit dtype means on
        ("cuda", "auto", "auto", True, "none", "bf16"),
        ("cuda", "auto", "auto", False, "none", "fp16"),  # older GPUs
        ("cuda", "on", "fp16", True, "none", "fp16"),
        ("cuda", "off", "auto", True, "none", "fp32"),
    ],
)
def test_resolution(device, amp, dtype, cuda_bf16, cpu_bf16, expected):
    precision = resolve_precision(device, amp, dtype, cuda_bf16=cuda_bf16, cpu_native_bf16=cpu_bf16 != "none")
    assert precision.name == expected
    assert precision.uses_scaler == (expected == "fp16")
    assert (precision.reason is not None) == (amp == "auto" and dtype == "auto" or device == "cuda" and
                                              amp != "off" and dtype == "auto")
    # Only --amp auto on CPU is left to the measurement, whatever the CPU's flags.
    assert precision.measured == (device == "cpu" and amp == "auto" and dtype == "auto")


def test_auto_says_why_it_chose():
    assert "faster on rank 0" in resolve_precision("cpu", "auto", "auto", cpu_native_bf16=True).reason
    assert "GradScaler" in resolve_precision("cuda", "auto", "auto", cuda_bf16=False).reason


def test_emulated_cpu_bf16_warns_once_in_words():
    precision = resolve_precision("cpu", "on", "bf16", cpu_native_bf16=False)
    assert precision.name == "bf16"
    assert "emulated" in precision.warning and "slow" in precision.warning
    assert resolve_precision("cpu", "on", "bf16", cpu_native_bf16=True).warning is None


def test_bf16_on_a_gpu_without_it_is_a_usage_error():
    with pytest.raises(UsageError, match="--dtype bf16"):
        resolve_precision("cuda", "on", "bf16", cuda_bf16=False)


@pytest.mark.parametrize(("capability", "native"), [((6, 0), False), ((7, 0), False), ((7, 5), False),
                                                     ((8, 0), True), ((8, 6), True), ((9, 0), True)])
def test_gpu_bf16_is_native_from_compute_capability_8(capability, native):
    # V100 (7.0) and T4 (7.5) emulate bf16: torch.cuda.is_bf16_supported() says yes there; --amp auto must not.
    assert cuda_has_native_bf16(capability) is native
    expected = "bf16" if native else "fp16"
    assert resolve_precision("cuda", "auto", "auto", cuda_bf16=cuda_has_native_bf16(capability)).name == expected


def test_one_old_gpu_among_the_ranks_means_fp16_for_all(monkeypatch):

    capabilities = {0: (9, 0), 1: (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capabilities[index])
    assert cuda_devices_have_native_bf16([0]) is True
    assert cuda_devices_have_native_bf16([0, 1]) is False


def test_emulated_cpu_fp16_warns():
    precision = resolve_precision("cpu", "on", "fp16", cpu_native_bf16=False, cpu_native_fp16=False)
    assert precision.name == "fp16" and "emulated" in precision.warning
    assert resolve_precision("cpu", "on", "fp16", cpu_native_fp16=True).warning is None
