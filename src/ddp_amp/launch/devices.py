"""What --device resolves to on this machine, for the launcher's checks, without torch in the launcher: a CPU
run needs none; otherwise torch answers in a child of the fork server (launch.forkserver.call_warm)."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_amp.precision import cuda_devices_have_fp8, cuda_devices_have_native_bf16


@dataclass(frozen=True)
class DeviceFacts:
    """What --device resolves to on this machine, as the launcher's checks need it."""

    device_type: str
    visible: int = 0
    """GPUs visible (cuda only)."""
    cuda_bf16: bool = False
    """Whether the GPUs the ranks take compute bf16 natively."""
    gpu0_memory: int = 0
    cuda_fp8: bool = False
    """Whether they have fp8 tensor cores (--dtype fp8)."""


def device_facts(device: str, nproc_per_node: int) -> DeviceFacts:
    """--cpu needs no torch here; otherwise torch's answers come from a child of the fork server (call_warm),
    which has torch imported: the launcher of a CPU run never imports it."""
    if device == "cpu":
        return DeviceFacts("cpu")
    from ddp_amp.launch.forkserver import call_warm

    return call_warm(_device_facts_from_torch, device, nproc_per_node)


def _device_facts_from_torch(device: str, nproc_per_node: int) -> DeviceFacts:
    import torch

    device_type = "cuda" if device == "cuda" or torch.cuda.is_available() else "cpu"
    if device_type == "cpu":
        return DeviceFacts("cpu")
    visible = torch.cuda.device_count()
    if not visible:
        return DeviceFacts("cuda")
    taken = range(min(nproc_per_node, visible))
    return DeviceFacts("cuda", visible, cuda_devices_have_native_bf16(taken),
                       torch.cuda.get_device_properties(0).total_memory, cuda_devices_have_fp8(taken))
