"""What a device can compute, for model FLOPs utilisation (MFU): the achieved FLOP/s of training over the peak.

- GPUs whose figures are published: their dense peak TFLOP/s per precision, matched exactly by the name
  `torch.cuda.get_device_name` prints (no sparsity figures: training does not use 2:4 sparsity).
- Anything else (a CPU rank, a GPU missing from the table): the rate this rank reaches on a large matmul in the
  precision it trains in, measured (`measured_matmul_tflops`); on a CPU with the rank's own threads, every rank
  at once, as busy as in training: the per-core GEMM limit, not a data sheet's.
A precision a GPU has no fast path for (bf16 before Ampere, fp8 before Ada) has no peak in the table, and is
measured. Torch is imported only by the measurement.
"""

from __future__ import annotations

import operator
import re
import time
from dataclasses import dataclass

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")

# (full-match pattern of the name without its "NVIDIA "/"Tesla " prefix, model, {precision: dense TFLOP/s})
# from each GPU's data sheet. tf32 is the tensor-core rate a float32 matmul gets with --tf32 on.
_HOPPER_SXM = {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
_HOPPER_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}
_A100 = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
GPU_PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"H100 80GB HBM3|H100 SXM5 (80|94)GB", "H100 SXM", _HOPPER_SXM),
    (r"H100 PCIe", "H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0,
                                        "fp8": 1513.0}),
    (r"H100 NVL", "H100 NVL", _HOPPER_NVL),
    (r"H200", "H200 SXM", _HOPPER_SXM),
    (r"H200 NVL", "H200 NVL", _HOPPER_NVL),
    (r"A100-SXM4-(40|80)GB|A100-PCIE-40GB|A100 80GB PCIe", "A100", _A100),
    (r"L40S", "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0}),
    (r"L40", "L40", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05, "fp8": 362.0}),
    (r"L4", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5}),
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


def peak_precision(precision: str, tf32: bool = False) -> str:
    """Which peak a run's precision is held to: its matmuls' type. bf16-true computes in bf16; a float32 matmul
    runs on the tensor cores as tf32 when tf32 is on; fp8 (any recipe) in fp8."""
    if precision.startswith("fp8"):
        return "fp8"
    if precision == "fp32":
        return "tf32" if tf32 else "fp32"
    return "bf16" if precision == "bf16-true" else precision


@dataclass(frozen=True)
class Peak:
    tflops: float
    """Per rank."""
    source: str
    """Where the figure comes from: "H200 SXM data sheet, bf16", "measured matmul, bf16, 1 thread"."""

    def mfu(self, flops_per_s: float) -> float:
        return flops_per_s / (self.tflops * 1e12)


PEAK_BELOW_ACHIEVED = "; below the rate achieved: no MFU"
"""Said of a peak that training outran (an MFU over 100%, which no true peak allows: a CPU's peak measured while
other work held its cores, measured again and still too low; or a FLOP count too high for a data sheet's)."""


def held_to(tflops: float, peak: Peak) -> tuple[float | None, Peak]:
    """The MFU of `tflops` against `peak`, and the peak to report: None and a peak saying why, above 100%."""
    mfu = tflops / peak.tflops
    if mfu <= 1:
        return mfu, peak
    return None, Peak(peak.tflops, peak.source.removesuffix(PEAK_BELOW_ACHIEVED) + PEAK_BELOW_ACHIEVED)


MATMUL_SIZE = {"cpu": 512, "cuda": 4096}
"""Square matmuls large enough to reach a core's (a GPU's) GEMM rate, small enough to time in ~20 ms (~100 ms
on the slowest CPU path, emulated bf16) and to hold next to nothing (on a GPU 192 MB at most, given back to it
after)."""
MATMUL_REPEATS = 5
MATMUL_MIN_S = 0.2
"""The matmul is timed again until this long has passed (MATMUL_REPEATS times at least, MATMUL_MAX_REPEATS at
most), and the fastest counts: on a shared machine another process's burst can hold the cores for all of a few
repeats (a peak five times too low was seen, and with it an MFU over 100%), rarely for all of 0.2 s."""
MATMUL_MAX_REPEATS = 2000


def measured_matmul_tflops(device, dtype) -> float:
    """This process's rate on square matmuls of `dtype` on `device` (the fastest over MATMUL_MIN_S after a
    warm-up: a peak is what the device can do, and another process's burst on a shared core only slows some
    repeats), in TFLOP/s: on a CPU with torch's threads as set for the rank. fp8 is timed as bf16.

    Both `a @ b` and `F.linear(a, b)` (what nn.Linear runs) are timed, in turn, and the faster counts: on a CPU
    they can take different kernels, and in fp16 `a @ b` ran 6.7x slower than a linear layer of the same size
    (AMD EPYC, torch 2.13), so a peak of `a @ b` alone put a transformer's fp16 MFU at 236%."""
    import torch

    size = MATMUL_SIZE.get(device.type, MATMUL_SIZE["cuda"])
    # A generator of its own: the run's random state (its data order, its dropout, a resume's restored state) is
    # left as it was.
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    kernels = (operator.matmul, torch.nn.functional.linear)
    for kernel in kernels:  # the warm-up
        kernel(a, b)
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < MATMUL_REPEATS * len(kernels) or (time.perf_counter() - began < MATMUL_MIN_S
                                                         and len(times) < MATMUL_MAX_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        kernels[len(times) % len(kernels)](a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * size**3 / min(times) / 1e12


def device_peak(device, precision: str, tf32: bool = False) -> Peak:
    """The peak this rank's MFU is measured against: a known GPU's data sheet, else a measured matmul rate."""
    import torch

    held_to = peak_precision(precision, tf32)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = gpu_model(name)
        if found and held_to in found[1]:
            return Peak(found[1][held_to], f"{found[0]} data sheet, {held_to}")
    dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16}.get(held_to, torch.bfloat16)
    threads = f", {torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}" \
        if device.type == "cpu" else ""
    measured_as = "bf16" if held_to == "fp8" else held_to
    return Peak(measured_matmul_tflops(device, dtype), f"measured matmul, {measured_as}{threads}")
