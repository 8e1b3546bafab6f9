"""Which precision --amp/--dtype resolve to on each kind of device."""

import pytest

from ddp_amp.errors import UsageError
from ddp_amp.precision import cuda_devices_have_native_bf16, cuda_has_native_bf16, resolve_precision


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


@pytest.mark.parametrize(("capability", "native"), [((6, 0), False), ((7, 0), False), ((7, 5), False),
                                                     ((8, 0), True), ((8, 6), True), ((9, 0), True)])
def test_gpu_bf16_is_native_from_compute_capability_8(capability, native):
    # V100 (7.0) and T4 (7.5) emulate bf16: torch.cuda.is_bf16_supported() says yes there; --amp auto must not.
    assert cuda_has_native_bf16(capability) is native
    expected = "bf16" if native else "fp16"
    assert resolve_precision("cuda", "auto", "auto", cuda_bf16=cuda_has_native_bf16(capability)).name == expected


def test_one_old_gpu_among_the_ranks_means_fp16_for_all(monkeypatch):
    import torch

    capabilities = {0: (9, 0), 1: (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capabilities[index])
    assert cuda_devices_have_native_bf16([0]) is True
    assert cuda_devices_have_native_bf16([0, 1]) is False


def test_emulated_cpu_fp16_warns():
    precision = resolve_precision("cpu", "on", "fp16", cpu_native_bf16=False, cpu_native_fp16=False)
    assert precision.name == "fp16" and "emulated" in precision.warning
    assert resolve_precision("cpu", "on", "fp16", cpu_native_fp16=True).warning is None
