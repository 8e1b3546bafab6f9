"""What the step runs on: the optimizer (fused by default) and the DDP wrapper with its options."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_amp.config import TrainConfig
from ddp_amp.precision import Precision


def optimizer_impl(config: TrainConfig, precision: Precision) -> str:
    """--optimizer-impl auto: fused, one kernel for every parameter (on this CPU AdamW's step took 13-18 ms
    fused against 72-112 ms in torch's default per-parameter loop); foreach under fp16's GradScaler, because a
    fused step takes the scaler's overflow flag itself and is called even for a step it skips, which the host
    (the LR schedule, the skipped-step count) would then learn of only through an extra sync per step."""
    if config.optimizer_impl != "auto":
        return config.optimizer_impl
    return "foreach" if precision.uses_scaler else "fused"


def build_optimizer(model: torch.nn.Module, config: TrainConfig, impl: str = "loop") -> torch.optim.Optimizer:
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[impl]
    # Frozen parameters (requires_grad=False) stay out: no state for them, and weight decay never moves them.
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                               weight_decay=config.weight_decay, **kind)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, **kind)


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Parameters trained and frozen (requires_grad=False), counted once each (tied weights once)."""
    unique = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    return {"trainable_parameters": trainable, "frozen_parameters": sum(p.numel() for p in unique) - trainable}


def wrap_ddp(model: torch.nn.Module, config: TrainConfig, device: torch.device) -> DDP:
    # --compile compiles the module inside DDP. torch documents compiling the DDP wrapper instead (its
    # DDPOptimizer splits the graph at bucket boundaries), but in this torch that captures no graph at all
    # (a graph break at DDP.forward, pytorch/pytorch#140416); inside, the whole forward and backward compile,
    # and DDP's reducer all-reduces the gradients as the compiled backward hands them over.
    inner = torch.compile(model) if config.compile else model
    ddp = DDP(inner, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=config.bucket_mb, gradient_as_bucket_view=config.bucket_view,
              static_graph=config.static_graph, find_unused_parameters=config.find_unused_parameters,
              broadcast_buffers=config.broadcast_buffers)
    if config.grad_compression != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        ddp.register_comm_hook(None, hook[config.grad_compression])  # None: the default process group
    return ddp
