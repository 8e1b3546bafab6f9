"""What the step runs on: the optimizer (fused by default), built for the run's parallel mode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ddp_amp.config import TrainConfig
from ddp_amp.parallel.base import Strategy
from ddp_amp.precision import Precision

COMPILED_AUTO_MIN_ELEMENTS = 1 << 20
"""`auto` takes the compiled step only where the trainable tensors hold this many elements on average: its host
work is per tensor (~70 us on an AMD Zen 5: the compiled call's guards, the aliases, the step's scalars), what it
saves per element, so a model of many small tensors steps slower with it (148 tensors of 78 K elements: 1.41-1.53x
the three passes' time) and one of few large ones faster (8 of 1.2 M: 0.81-0.96 there, 0.60 on an Intel Xeon with AMX):
benchmarks/master_step.py --shapes transformer|mlp."""


def optimizer_impl(config: TrainConfig, precision: Precision, device_type: str,
                   params: Sequence[torch.Tensor] = ()) -> str:
    """--optimizer-impl auto: fused, one kernel for every parameter (on this CPU AdamW's step took 13-18 ms
    fused against 72-112 ms in torch's default per-parameter loop); foreach under fp16's GradScaler, because a
    fused step takes the scaler's overflow flag itself and is called even for a step it skips, which the host
    (the LR schedule, the skipped-step count) would then learn of only through an extra sync per step. foreach
    for SGD under --shard full too: its parameters are DTensors, and torch registers no DTensor rule for the fused
    SGD kernel (it does for AdamW's), so every rank failed at its first step. compiled where the run compiles
    anyway (--compile) and it applies (bf16-true's AdamW under DDP, parallel.master_step) to `params`, the
    trainable ones, large enough (COMPILED_AUTO_MIN_ELEMENTS): it saves two of the master-weight step's three
    passes over memory, for a compile at the first step."""
    if config.optimizer_impl != "auto":
        return config.optimizer_impl
    large = bool(params) and sum(p.numel() for p in params) >= COMPILED_AUTO_MIN_ELEMENTS * len(params)
    if config.compile and large and compiled_step_applies(config, precision, device_type):
        return "compiled"
    sharded_sgd = config.optimizer == "sgd" and config.shard == "full"
    return "foreach" if precision.uses_scaler or sharded_sgd else "fused"


def compiled_step_applies(config: TrainConfig, precision: Precision, device_type: str) -> bool:
    """--optimizer-impl compiled runs AdamW over bf16-true's masters under DDP (ZeRO and FSDP2 step their own), on
    CPU ranks: where it was measured and tested (on a GPU, untried, the fused step stays)."""
    return (precision.bf16_weights and config.optimizer == "adamw" and config.shard == "none"
            and device_type == "cpu")


def build_optimizer(model: torch.nn.Module, config: TrainConfig, strategy: Strategy,
                    impl: str = "loop") -> torch.optim.Optimizer:
    """--optimizer over the trainable parameters, as the parallel mode runs it (parallel.zero: each rank
    keeps the state of its share)."""
    # Frozen parameters (requires_grad=False) stay out: no state for them, and weight decay never moves them.
    params = strategy.optimized([p for p in model.parameters() if p.requires_grad])
    if impl == "compiled":
        return strategy.compiled_adamw(params, lr=config.lr, weight_decay=config.weight_decay)
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[impl]
    if config.optimizer == "sgd":
        cls, options = torch.optim.SGD, {"lr": config.lr, "momentum": config.momentum,
                                         "weight_decay": config.weight_decay, **kind}
    else:
        cls, options = torch.optim.AdamW, {"lr": config.lr, "weight_decay": config.weight_decay, **kind}
    return strategy.build_optimizer(params, cls, options)


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""The param_groups settings that say how torch's optimizer runs, not what it computes."""


def implementation_of(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's implementation settings, as this run built the optimizer (--optimizer-impl)."""
    return [{k: group[k] for k in IMPLEMENTATION_KEYS if k in group} for group in optimizer.param_groups]


def keep_implementation(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """After a checkpoint's state was loaded: the run's own implementation back. torch's load_state_dict takes
    every group setting from the checkpoint, so a run resumed from a loop, foreach or compiled run's checkpoint
    stepped as that run had (torch's per-parameter loop: 72-112 ms a step against 13-18 fused, docs/training.md)
    while its summary said fused. A fused or capturable step wants its step counts on the parameters' device.
    (ZeroRedundancyOptimizer: its local optimizer too, which holds the state; its groups follow the wrapper's.)"""
    for target in (optimizer, getattr(optimizer, "optim", None)):
        for group, own in zip(target.param_groups if target is not None else (), settings):
            group.update(own)
            if own.get("fused") or own.get("capturable"):
                for param in group["params"]:
                    step = (target.state.get(param) or {}).get("step")  # ZeRO's wrapper keeps None there
                    if isinstance(step, torch.Tensor) and step.device != param.device:
                        target.state[param]["step"] = step.to(param.device, torch.float32)


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
