"""Mixed precision: which dtype a run uses, and the autocast / GradScaler pieces that go with it.

`resolve_precision` is pure (no torch) so the launcher can decide and report before any rank starts. On CPU
ranks `--amp auto` is decided by measurement instead (rank.amp_probe): the answers are cached here, per CPU
model, torch version, threads per rank and the task's layer shapes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ddp_amp.errors import UsageError


@dataclass(frozen=True)
class Precision:
    name: str
    """fp32, bf16, fp16 (autocast over fp32 weights), bf16-true (bf16 weights, fp32 master copies), or fp8 /
    fp8-rowwise (torchao's float8 linear layers, their recipe tensorwise or rowwise, under bf16 autocast): what
    summary.json reports."""
    warning: str | None = None
    """One line to print once, e.g. bf16 emulated on a CPU without native support."""
    reason: str | None = None
    """Why --amp auto (or --amp on without --dtype) chose it, for the start line and `ddp-amp env`: "the faster
    on this CPU: ..."; None when the flags chose."""
    measured: bool = False
    """--amp auto on CPU ranks: the name is provisional (fp32) until rank 0's probe decides (rank.amp_probe)."""

    @property
    def enabled(self) -> bool:
        return self.name != "fp32"

    @property
    def bf16_weights(self) -> bool:
        """bf16-true: the model holds and computes with bf16 weights; the optimizer updates fp32 master copies
        (parallel.master; under --shard full, FSDP2's MixedPrecisionPolicy). Autocast stays on around it: with
        the weights bf16 already it casts no weight, and it keeps the losses and norms in fp32."""
        return self.name == BF16_TRUE

    @property
    def fp8_recipe(self) -> str | None:
        """torchao's float8 recipe (tensorwise, rowwise) for fp8 precisions, else None."""
        return FP8_RECIPES.get(self.name)

    @property
    def uses_scaler(self) -> bool:
        # bf16 has fp32's exponent range: gradients do not underflow, so only fp16 needs loss scaling.
        return self.name == "fp16"

    def torch_dtype(self):
        import torch

        # fp8: the float8 layers' matmuls are fp8; everything around them runs under bf16 autocast (torchtitan's
        # choice: FSDP2's bf16 parameters); the weights stay fp32.
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, BF16_TRUE: torch.bfloat16}.get(
            self.name, torch.bfloat16)


BF16_TRUE = "bf16-true"
"""Lightning's name for a model that computes in bf16 (theirs keeps no fp32 copy; this one does, as DeepSpeed's
bf16 and torchtitan's FSDP2 mixed precision do, so an update below a bf16 ulp of a weight is not lost)."""


FP8_RECIPES = {"fp8": "tensorwise", "fp8-rowwise": "rowwise"}
"""--dtype's fp8 names and torchao's float8 recipes: tensorwise (one scale per tensor: torchao's default, the
fastest) and rowwise (a scale per row: more accurate, a little slower)."""
FP8_CAPABILITY = (8, 9)
"""fp8 tensor cores start with Ada (8.9) and Hopper (9.0)."""


def fp8_refusal(device_type: str, cuda_fp8: bool, dtype: str = "fp8") -> str | None:
    """Why --dtype `dtype` (an fp8 one) cannot run here, in one line, or None: it needs torchao and GPUs with fp8
    tensor cores."""
    import importlib.util

    if device_type != "cuda" or not cuda_fp8:
        where = "CPU ranks" if device_type != "cuda" else "these GPUs"
        return (f"--dtype {dtype} needs NVIDIA GPUs of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} "
                f"or newer (Ada, Hopper), and {where} have no fp8 matrix units; use --dtype bf16 or bf16-true")
    if importlib.util.find_spec("torchao") is None:
        return f"--dtype {dtype} needs torchao's float8 training: pip install 'ddp-amp[fp8]' (or pip install torchao)"
    return None


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


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model as /proc/cpuinfo names it, with family, model and stepping: a virtual machine's name alone
    ("Intel(R) Xeon(R) Processor") can stand for CPUs whose bf16 speeds differ."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    import platform

    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in fields:
        name += (f" (family {fields['cpu family']} model {fields.get('model', '?')} "
                 f"stepping {fields.get('stepping', '?')})")
    return name


def cpu_has_native_bf16() -> bool:
    """True on CPUs with bf16 instructions (AVX512-BF16 or AMX); elsewhere bf16 matmuls are emulated and slow."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


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


def cuda_devices_have_fp8(device_indices) -> bool:
    """Whether every one of these local GPUs has fp8 tensor cores (compute capability 8.9 and newer)."""
    import torch

    return all(tuple(torch.cuda.get_device_capability(index)) >= FP8_CAPABILITY for index in device_indices)


def cuda_devices_have_native_bf16(device_indices) -> bool:
    """Whether every one of these local GPUs computes bf16 natively (ranks must agree on one precision)."""
    import torch

    return all(cuda_has_native_bf16(torch.cuda.get_device_capability(index)) for index in device_indices)


def resolve_precision(
    device_type: str, amp: str, dtype: str, *, cuda_bf16: bool = False, cuda_fp8: bool = False,
    cpu_native_bf16: bool | None = None, cpu_native_fp16: bool | None = None,
) -> Precision:
    """Turn --amp/--dtype into a concrete precision for a device type ("cpu" or "cuda").

    auto: the faster precision. On GPUs bf16 where it is native (Ampere on), fp16 on older ones. On CPUs no
    flag predicts it (avx512_bf16 without AMX measured 0.81x fp32 on one Xeon and 1.10x on an EPYC Zen 4), so
    the answer is `measured`: fp32 until rank 0's probe says otherwise. An explicit --dtype with --amp auto
    means "on with that dtype". `cuda_bf16`: every GPU of the job computes bf16 natively; `cpu_native_bf16`:
    this CPU has bf16 instructions (no emulation warning); `cuda_fp8`: every GPU has fp8 tensor cores. fp8 is
    never chosen unasked.
    """
    if cpu_native_bf16 is None:
        cpu_native_bf16 = cpu_has_native_bf16()
    if cpu_native_fp16 is None:
        cpu_native_fp16 = cpu_has_native_fp16()
    if amp == "off":
        return Precision("fp32")
    if dtype in FP8_RECIPES:
        if refusal := fp8_refusal(device_type, cuda_fp8, dtype):
            raise UsageError(refusal)
        return Precision(dtype)
    if device_type == "cuda":
        if dtype == "auto":
            if cuda_bf16:
                return Precision("bf16", reason="native on these GPUs (compute capability 8.0+)")
            return Precision("fp16", reason="with GradScaler: these GPUs predate native bf16 "
                             "(compute capability < 8.0)")
        if dtype in ("bf16", BF16_TRUE) and not cuda_bf16:
            raise UsageError(f"--dtype {dtype} needs a GPU of compute capability 8.0 or newer (Ampere); "
                             "use --dtype fp16")
        return Precision(dtype)
    # CPU
    if dtype == "auto":
        if amp == "auto":
            return Precision("fp32", reason="bf16 or fp32, whichever trains the task faster on rank 0",
                             measured=True)
        dtype = "bf16"  # --amp on asked for AMP: bf16 is the CPU's AMP dtype
    if dtype in ("bf16", BF16_TRUE) and not cpu_native_bf16:
        return Precision(
            dtype, warning="this CPU has no native bf16 (avx512_bf16/amx): bf16 matrix products are emulated and "
            "will be slow"
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


# --amp auto's measured answers on CPU ranks, one JSON file per user: {key: entry}.
AMP_CACHE_FILE = "amp-auto.json"


def amp_cache_path() -> Path:
    """$DDP_AMP_CACHE_DIR, else $XDG_CACHE_HOME/ddp-amp, else ~/.cache/ddp-amp."""
    root = os.environ.get("DDP_AMP_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                        Path.home() / ".cache") / "ddp-amp"
    return Path(root) / AMP_CACHE_FILE


def amp_cache_key(torch_version: str, threads: int, shapes: list[tuple[int, int, int]], task: str = "") -> str:
    """What the answer depends on: the CPU, torch (its kernels), the threads per rank, the task and micro-batch
    and the shapes its layers saw (a tiny model's answer need not be a wide one's)."""
    digest = hashlib.sha256(json.dumps([task, sorted(shapes)]).encode()).hexdigest()[:12]
    return f"{cpu_model()} | torch {torch_version} | {threads} threads | shapes {digest}"


def cached_amp_choices() -> dict[str, dict[str, Any]]:
    """Every cached answer (none when the file is missing or unreadable: the probe then runs again)."""
    try:
        entries = json.loads(amp_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def remember_amp_choice(key: str, entry: dict[str, Any]) -> None:
    """Add one answer to the cache, atomically (a concurrent run reads the old file or the new one). A cache that
    cannot be written is no error: the next run probes again."""
    from ddp_amp.files import atomic_write

    path = amp_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, (json.dumps({**cached_amp_choices(), key: entry}, indent=1, sort_keys=True) + "\n").encode())
    except OSError:
        pass
