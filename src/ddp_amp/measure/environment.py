"""What this machine is, for `bench`'s footer and `ddp-amp env`: torch, the CPU and its bf16 flags, the GPUs,
the backends, the threads. Torch is imported inside the functions."""

from __future__ import annotations

import os
from typing import Any

from ddp_amp.outputs import RunRecord
from ddp_amp.process import usable_cores

CPU_FLAGS_THAT_MATTER = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def flags_that_matter() -> list[str]:
    """The CPU features that decide bf16/fp16 matmul speed, of those this CPU has."""
    from ddp_amp.precision import cpu_flags

    present = cpu_flags()
    return [flag for flag in CPU_FLAGS_THAT_MATTER if flag in present]


def cpu_name() -> str:
    from ddp_amp.precision import cpu_model

    return cpu_model()


def environment(device_type: str, summary: RunRecord, tf32: bool | None) -> dict[str, Any]:
    import torch

    from ddp_amp.precision import cpu_has_native_bf16

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "world_size": summary.world_size,
        "backend": summary.backend,
        "threads_per_rank": summary.threads_per_rank,
        "cpu": cpu_name(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "cpu_flags": flags_that_matter(),
        "cores": usable_cores(),
    }
    if device_type == "cuda":
        env["device"] = torch.cuda.get_device_name(0)
        env["tf32_matmul"] = bool(tf32) if tf32 is not None else torch.backends.cuda.matmul.allow_tf32
    else:
        env["device"] = env["cpu"]
    return env


def environment_report() -> dict[str, Any]:
    """What `ddp-amp env` shows: versions, which backends this torch has, every GPU, the CPU and threads."""
    import sys

    import torch
    import torch.distributed as dist

    from ddp_amp import __version__
    from ddp_amp.precision import (
        amp_cache_path,
        cached_amp_choices,
        cpu_flags,
        cpu_has_native_bf16,
        cuda_has_native_bf16,
        resolve_precision,
    )

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = []
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        capability = (props.major, props.minor)
        gpus.append({"index": index, "name": props.name, "compute_capability": f"{props.major}.{props.minor}",
                     "memory_gib": props.total_memory / 2**30, "native_bf16": cuda_has_native_bf16(capability)})
    amp_auto = {"cpu": resolve_precision("cpu", "auto", "auto")}
    if gpus:
        amp_auto["cuda"] = resolve_precision("cuda", "auto", "auto",
                                             cuda_bf16=all(gpu["native_bf16"] for gpu in gpus))
    nccl = None
    if dist.is_available() and dist.is_nccl_available():
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    return {
        "ddp_amp": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "backends": {name: dist.is_available() and getattr(dist, f"is_{name}_available")()
                     for name in ("gloo", "nccl", "mpi")},
        "gpus": gpus,
        "cpu": cpu_name(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "cpu_amx_bf16": "amx_bf16" in cpu_flags(),
        "amp_auto_cpu_cache": {"path": str(amp_cache_path()), "answers": cached_amp_choices()},
        "amp_auto": {device: {"precision": choice.name, "reason": choice.reason}
                     for device, choice in amp_auto.items()},
        "cores": usable_cores(),
        "threads": {"torch": torch.get_num_threads(), "torch_interop": torch.get_num_interop_threads(),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
    }
