"""The run's parallel mode (--shard none | optimizer | full), one strategy object per mode behind one interface
(parallel.base.Strategy): how the model is wrapped, how accumulation skips the gradients' reduction, how the
whole state is gathered for saving and handed back at a load, the plain model for export and evaluation, the
gradient scaler, and what each mode's errors mean. The training core, the checkpoints and the script-loop
module ask the strategy; nothing else tests the mode.

    none       parallel.ddp.DDPStrategy     every rank holds everything; DDP all-reduces the gradients
    optimizer  parallel.zero.ZeroStrategy   DDP, and each rank keeps its share of the optimizer state (ZeRO-1)
    full       parallel.fsdp.FSDPStrategy   parameters, gradients and optimizer state sharded (FSDP2)

This module and parallel.modes import no torch: the launcher reads what it needs of a mode (MODES) before any
rank exists.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ddp_amp.parallel.modes import MODES, Mode

if TYPE_CHECKING:
    import torch

    from ddp_amp.config import TrainConfig
    from ddp_amp.parallel.base import Strategy
    from ddp_amp.precision import Precision


def strategy_for(config: TrainConfig, device: torch.device, precision: Precision | None = None) -> Strategy:
    """This rank's strategy for the run's --shard mode (and, for bf16-true, where the fp32 weights live)."""
    module, name = MODES[config.shard].strategy.split(":")
    return getattr(importlib.import_module(module), name)(config, device, precision)


__all__ = ["MODES", "Mode", "strategy_for"]
