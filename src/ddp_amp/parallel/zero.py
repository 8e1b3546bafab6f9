"""--shard optimizer: ZeRO-1. DDP as under --shard none, and a ZeroRedundancyOptimizer: each rank keeps and
updates the optimizer state of its share of the parameters and broadcasts them after the step. The same
all-reduced gradients and the same update: the weights are bit for bit --shard none's (tests/system/test_shard.py),
and its consolidated state_dict has the plain optimizer's format, so checkpoints pass between the modes and world
sizes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddp_amp.parallel.ddp import DDPStrategy


class ZeroStrategy(DDPStrategy):
    mode = "optimizer"
    replicated_parts = ("model",)  # its optimizer state is each rank's own

    def build_optimizer(self, params: list[nn.Parameter], cls: type[torch.optim.Optimizer],
                        options: dict[str, Any]) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Bucket views: each rank's parameters live in one flat buffer, so its step ends in one broadcast per
        # rank instead of one per tensor (docs/benchmarks.md); the saved weights copy themselves out of it.
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, parameters_as_bucket_view=True, **options)

    def full_state(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                   writers: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
        if optimizer is not None:  # its state gathered whole on each rank that writes (a collective per writer)
            for rank in writers:
                optimizer.consolidate_state_dict(to=rank)
        return super().full_state(module, optimizer, writers)
