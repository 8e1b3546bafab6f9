"""Mixed precision: which dtype a run uses, and the autocast / GradScaler pieces that go with it.

`resolve_precision` is pure (no torch) so the launcher can decide and report before any rank starts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import lru_cache

from ddp_amp.errors import UsageError


@dataclass(frozen=True)
class Precision:
    name: str
    """fp32, bf16 or fp16: what summary.json reports."""
    warning: str | None = None
    """One line to print once, e.g. bf16 emulated on a CPU without native support."""
    reason: str | None = None
    """Why --amp auto (or --amp on without --dtype) chose it, for the start line and `ddp-amp env`: "the faster
    on this CPU: ..."; None when the flags chose."""

    @property
    def enabled(self) -> bool:
        return self.name != "fp32"

    @property
    def uses_scaler(self) -> bool:
        # bf16 has fp32's exponent range: gradients do not underflow, so only fp16 needs loss scaling.
        return self.name == "fp16"

    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.name]


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """True on CPUs with bf16 instructions (AVX512-BF16 or AMX); elsewhere bf16 matmuls are emulated and slow."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_fast_bf16() -> bool:
    """True where bf16 trains faster than fp32: CPUs with AMX tiles (amx_bf16). With avx512_bf16 alone the
    bf16 matmuls are native but slower than fp32's (0.81x on the bench's task, an AVX-512 Xeon without AMX),
    so --amp auto keeps fp32 there."""
    return "amx_bf16" in cpu_flags()


def cpu_has_native_fp16() -> bool:
    """True on CPUs with fp16 arithmetic (AVX512-FP16 or AMX-FP16); elsewhere fp16 autocast is emulated."""
    return bool(cpu_flags() & {"avx512_fp16", "amx_fp16"})


NATIVE_BF16_CAPABILITY = (8, 0)


def cuda_has_native_bf16(capability: tuple[int, int]) -> bool:
    """bf16 tensor cores start with Ampere (compute capability 8.0).

    Not torch.cuda.is_bf16_supported(): by default it counts emulation and answers yes on V100 and T4, where
    bf16 runs far slower than fp16.
    """
    return tuple(capability) >= NATIVE_BF16_CAPABILITY


def cuda_devices_have_native_bf16(device_indices) -> bool:
    """Whether every one of these local GPUs computes bf16 natively (ranks must agree on one precision)."""
    import torch

    return all(cuda_has_native_bf16(torch.cuda.get_device_capability(index)) for index in device_indices)


def resolve_precision(
    device_type: str, amp: str, dtype: str, *, cuda_bf16: bool = False, cpu_native_bf16: bool | None = None,
    cpu_fast_bf16: bool | None = None, cpu_native_fp16: bool | None = None,
) -> Precision:
    """Turn --amp/--dtype into a concrete precision for a device type ("cpu" or "cuda").

    auto: the faster precision. On GPUs bf16 where it is native (Ampere on), fp16 on older ones; on CPUs bf16
    only where it beats fp32 (AMX), fp32 elsewhere. An explicit --dtype with --amp auto means "on with that
    dtype". `cuda_bf16`: every GPU of the job computes bf16 natively; `cpu_native_bf16`: this CPU has bf16
    instructions (no emulation warning); `cpu_fast_bf16`: they are faster than fp32 (AMX).
    """
    if cpu_native_bf16 is None:
        cpu_native_bf16 = cpu_has_native_bf16()
    if cpu_fast_bf16 is None:
        cpu_fast_bf16 = cpu_has_fast_bf16()
    if cpu_native_fp16 is None:
        cpu_native_fp16 = cpu_has_native_fp16()
    if amp == "off":
        return Precision("fp32")
    if device_type == "cuda":
        if dtype == "auto":
            if cuda_bf16:
                return Precision("bf16", reason="native on these GPUs (compute capability 8.0+)")
            return Precision("fp16", reason="with GradScaler: these GPUs predate native bf16 "
                             "(compute capability < 8.0)")
        if dtype == "bf16" and not cuda_bf16:
            raise UsageError("--dtype bf16 needs a GPU of compute capability 8.0 or newer (Ampere); "
                             "use --dtype fp16")
        return Precision(dtype)
    # CPU
    if dtype == "auto":
        if cpu_fast_bf16 and amp == "auto":
            return Precision("bf16", reason="the faster on this CPU: it has AMX (amx_bf16)")
        if amp == "auto":
            why = ("its bf16 (avx512_bf16 without AMX) trains slower than fp32" if cpu_native_bf16
                   else "it has no native bf16")
            return Precision("fp32", reason=f"the faster on this CPU: {why}")
        dtype = "bf16"  # --amp on asked for AMP: bf16 is the CPU's AMP dtype
    if dtype == "bf16" and not cpu_native_bf16:
        return Precision(
            "bf16", warning="this CPU has no native bf16 (avx512_bf16/amx): bf16 autocast is emulated and will be slow"
        )
    if dtype == "fp16" and not cpu_autocast_supports_fp16():
        raise UsageError("--dtype fp16 is not supported on CPU by this torch build; use --dtype bf16 or --amp off")
    if dtype == "fp16" and not cpu_native_fp16:
        return Precision(
            "fp16", warning="this CPU has no native fp16 (avx512_fp16/amx_fp16): fp16 autocast is emulated and will "
            "be slow"
        )
    return Precision(dtype)


def cpu_autocast_supports_fp16() -> bool:
    import torch

    try:
        with torch.autocast("cpu", dtype=torch.float16):
            return torch.ones(1, 1).matmul(torch.ones(1, 1)).dtype == torch.float16
    except RuntimeError:
        return False


def autocast(precision: Precision, device_type: str):
    """The forward-pass context: torch.amp autocast when AMP is on, nothing otherwise."""
    if not precision.enabled:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type, dtype=precision.torch_dtype())


def grad_scaler(precision: Precision, device_type: str):
    """A torch.amp.GradScaler, enabled only for fp16 (disabled it is a cheap pass-through)."""
    import torch

    return torch.amp.GradScaler(device_type, enabled=precision.uses_scaler)
