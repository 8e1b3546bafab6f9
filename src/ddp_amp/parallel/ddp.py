"""--shard none: DistributedDataParallel. Every rank holds the whole model and optimizer state; DDP all-reduces
the gradients in buckets while the backward runs. Its options (--bucket-mb, --static-graph, ...) are DDP's own."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_amp.config import TrainConfig
from ddp_amp.parallel.base import Strategy
from ddp_amp.parallel.master import MasterWeights


class DDPStrategy(Strategy):
    mode = "none"
    masters: MasterWeights | None = None
    """bf16-true: the fp32 weights the optimizer updates (the model's own are bf16)."""

    def setup_module(self, module: nn.Module, units=None) -> nn.Module:
        if self.precision.bf16_weights:
            self.masters = MasterWeights(module)
        wrapped = wrap_ddp(module, self.config, self.device)  # rank 0's (bf16) weights on every rank
        if self.masters:
            self.masters.agree()
        return wrapped

    def optimized(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        return self.masters.for_optimizer(params) if self.masters else params

    def compiled_adamw(self, params: list[nn.Parameter], **options: Any) -> torch.optim.Optimizer:
        from ddp_amp.parallel.master_step import MasterAdamW

        if self.mode != "none":  # ZeRO-1 steps its share in its own optimizer (this class's subclass)
            return super().compiled_adamw(params, **options)
        if not self.masters:
            raise NotImplementedError("--optimizer-impl compiled without bf16-true's masters")
        self.masters.moved_by_optimizer = True  # it reads the bf16 gradients and writes the bf16 weights itself
        return MasterAdamW(params, self.masters.pairs, **options)

    def gradients_for_update(self) -> None:
        if self.masters and not self.masters.moved_by_optimizer:
            self.masters.take_gradients()

    def update_done(self) -> None:
        if self.masters and not self.masters.moved_by_optimizer:
            self.masters.write_back()

    def full_state(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                   writers: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
        model, optimizer_state = super().full_state(module, optimizer, writers)
        return (self.masters.state_with_masters(model) if self.masters and model else model), optimizer_state

    def load_model_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        super().load_model_state(module, state)
        if self.masters:
            self.masters.load(state)

    def plain_model(self, module: nn.Module, writers: list[int]) -> nn.Module | None:
        """bf16-true: an fp32 copy holding the masters, on the writers: what a task's evaluate and the model's own
        save format take, as after any other run."""
        if not self.masters:
            return module
        if torch.distributed.get_rank() not in writers:
            return None
        return self.masters.fp32_copy(module)

    def error_line(self, exc: BaseException, model: nn.Module, step: int) -> str | None:
        return ddp_error_line(exc, model, step)


def buffer_sync_option(ddp_class: type, broadcast: bool) -> dict[str, bool]:
    """DDP's switch for broadcasting buffers from rank 0 at each forward (buffers are made equal once anyway,
    when DDP wraps the model), by the name this torch takes: `forward_sync_buffers` from torch 2.13 (where
    `broadcast_buffers` warns), `broadcast_buffers` before (torch 2.11 refuses the new name)."""
    import inspect

    name = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters
            else "broadcast_buffers")
    return {name: broadcast}


def wrap_ddp(model: nn.Module, config: TrainConfig, device: torch.device) -> DDP:
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
