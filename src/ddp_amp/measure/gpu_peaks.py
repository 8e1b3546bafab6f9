"""Dense peak TFLOP/s of the GPUs whose figures are published, per precision, matched exactly by the name
`torch.cuda.get_device_name` prints. No sparsity figures (training does not use 2:4 sparsity). An unknown GPU, or a
precision it has no fast path for (bf16 before Ampere), has no peak, so no MFU: none rather than a wrong one."""

from __future__ import annotations

import re

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")

# (full-match pattern of the name without its "NVIDIA "/"Tesla " prefix, model, {precision: dense TFLOP/s})
# from each GPU's data sheet. tf32 is the tensor-core rate a float32 matmul gets with --tf32 on.
_HOPPER_SXM = {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}
_HOPPER_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}
_A100 = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
GPU_PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"H100 80GB HBM3|H100 SXM5 (80|94)GB", "H100 SXM", _HOPPER_SXM),
    (r"H100 PCIe", "H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"H100 NVL", "H100 NVL", _HOPPER_NVL),
    (r"H200", "H200 SXM", _HOPPER_SXM),
    (r"H200 NVL", "H200 NVL", _HOPPER_NVL),
    (r"A100-SXM4-(40|80)GB|A100-PCIE-40GB|A100 80GB PCIe", "A100", _A100),
    (r"L40S", "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05}),
    (r"L40", "L40", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05}),
    (r"L4", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"A10", "A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (r"V100-SXM2-(16|32)GB", "V100 SXM2", {"fp32": 15.7, "fp16": 125.0}),
    (r"V100-PCIE-(16|32)GB", "V100 PCIe", {"fp32": 14.0, "fp16": 112.0}),
    (r"V100S-PCIE-32GB", "V100S PCIe", {"fp32": 16.4, "fp16": 130.0}),
    (r"T4", "T4", {"fp32": 8.1, "fp16": 65.0}),
)


def gpu_model(device_name: str) -> tuple[str, dict[str, float]] | None:
    """The model and its peaks for a device name as torch prints it ("NVIDIA H100 PCIe"), or None."""
    name = re.sub(r"^(NVIDIA|Tesla)\s+", "", device_name.strip())
    name = re.sub(r"^Tesla\s+", "", name)
    for pattern, model, peaks in GPU_PEAKS:
        if re.fullmatch(pattern, name):
            return model, peaks
    return None


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak of this GPU at `precision` (fp32, tf32, bf16 or fp16), or None when it is not known."""
    found = gpu_model(device_name)
    return found[1].get(precision) if found else None


def mfu(device_name: str, precision: str, tokens_per_s: float, flops_per_token: float, gpus: int) -> float | None:
    """Model FLOPs utilisation per GPU: the global `tokens_per_s` is shared by `gpus` GPUs, each with the peak
    of `device_name` at `precision` (None when that peak is not known)."""
    peak = peak_tflops(device_name, precision)
    return None if peak is None else tokens_per_s / gpus * flops_per_token / (peak * 1e12)
