"""What the step runs on: the optimizer (fused by default) and the DDP wrapper with its options."""

from __future__ import annotations

import re

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
    """The optimizer over the trainable parameters; under --shard optimizer a ZeroRedundancyOptimizer, whose
    rank keeps and updates the state of its share of them. Its step uses the same all-reduced gradients and the
    same update: the weights are bit for bit --shard none's (tests/system/test_shard.py), and its consolidated
    state_dict has the plain optimizer's format, so checkpoints pass between the modes and world sizes."""
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[impl]
    # Frozen parameters (requires_grad=False) stay out: no state for them, and weight decay never moves them.
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        cls, options = torch.optim.SGD, {"lr": config.lr, "momentum": config.momentum,
                                         "weight_decay": config.weight_decay, **kind}
    else:
        cls, options = torch.optim.AdamW, {"lr": config.lr, "weight_decay": config.weight_decay, **kind}
    if config.shard == "optimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Bucket views: each rank's parameters live in one flat buffer, so its step ends in one broadcast per
        # rank instead of one per tensor (docs/benchmarks.md); the saved weights copy themselves out of it.
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, parameters_as_bucket_view=True, **options)
    return cls(params, **options)


def gather_optimizer_state(optimizer: torch.optim.Optimizer, writers: list[int]) -> None:
    """Before a checkpoint, on every rank: a sharded optimizer's state gathered whole on each rank that writes
    one (a collective per writer). A plain optimizer has it all already."""
    if hasattr(optimizer, "consolidate_state_dict"):
        for rank in writers:
            optimizer.consolidate_state_dict(to=rank)


def optimizer_state_mb(optimizer: torch.optim.Optimizer) -> float:
    """The optimizer state (moments, momentum buffers) this rank holds, in MB: what --shard optimizer divides.
    ZeroRedundancyOptimizer gives each rank whole parameter tensors, so the shares follow the tensors' sizes
    (one large matrix lands on one rank); under --shard full each state tensor is a DTensor, of which this rank
    holds its shard (to_local)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's own optimizer
    held = [getattr(t, "to_local", lambda t=t: t)() for state in local.state.values() for t in state.values()
            if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in held) / 2**20


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Parameters trained and frozen (requires_grad=False), counted once each (tied weights once)."""
    unique = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    return {"trainable_parameters": trainable, "frozen_parameters": sum(p.numel() for p in unique) - trainable}


def buffer_sync_option(ddp_class: type, broadcast: bool) -> dict[str, bool]:
    """DDP's switch for broadcasting buffers from rank 0 at each forward (buffers are made equal once anyway,
    when DDP wraps the model), by the name this torch takes: `forward_sync_buffers` from torch 2.13 (where
    `broadcast_buffers` warns), `broadcast_buffers` before (torch 2.11 refuses the new name)."""
    import inspect

    name = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters
            else "broadcast_buffers")
    return {name: broadcast}


def wrap_ddp(model: torch.nn.Module, config: TrainConfig, device: torch.device) -> DDP:
    # --compile compiles the module inside DDP. torch documents compiling the DDP wrapper instead (its
    # DDPOptimizer splits the graph at bucket boundaries), but in this torch that captures no graph at all
    # (a graph break at DDP.forward, pytorch/pytorch#140416); inside, the whole forward and backward compile,
    # and DDP's reducer all-reduces the gradients as the compiled backward hands them over.
    inner = torch.compile(model) if config.compile else model
    ddp = DDP(inner, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=config.bucket_mb, gradient_as_bucket_view=config.bucket_view,
              static_graph=config.static_graph, find_unused_parameters=config.find_unused_parameters,
              **buffer_sync_option(DDP, config.broadcast_buffers))
    if config.grad_compression != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        ddp.register_comm_hook(None, hook[config.grad_compression])  # None: the default process group
    return ddp


UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"
STATIC_GRAPH_CHANGED = "not compatible with static_graph set to True"


def ddp_error_line(exc: BaseException, model: DDP, step: int) -> str | None:
    """DDP's known errors as one line that names the cause and the flag, or None for any other error.

    "Expected to have finished reduction...": parameters that got no gradient in the previous step (a branch
    not taken); DDP lists their indices among the parameters that require gradients, named here. The same
    start with "static_graph" is a graph that changed under --static-graph."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or UNFINISHED_REDUCTION not in text:
        return None
    if STATIC_GRAPH_CHANGED in text:
        return (f"step {step + 1}: the model used other parameters than in the steps before (a branch not taken "
                "every step), which --static-graph does not allow; drop --static-graph, and pass "
                "--find-unused-parameters if some parameters get no gradient in some steps")
    names = [name for name, p in model.module.named_parameters() if p.requires_grad]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", text)
    unused = [names[int(i)] for i in found.group(1).split() if int(i) < len(names)] if found else []
    which = (f"{len(unused)} parameter{'s' if len(unused) > 1 else ''} got no gradient in step {step} ("
             + ", ".join(unused[:8]) + (", ..." if len(unused) > 8 else "") + ")") if unused else \
        f"some parameters got no gradient in step {step}"
    return (f"{which}: the model does not use every parameter in every step, which DDP must be told of; pass "
            "--find-unused-parameters (or make every parameter take part in the loss)")
