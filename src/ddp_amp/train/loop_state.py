"""The loop's own part of a checkpoint (ddp-amp's loop): what its counters and choices were at the step saved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddp_amp.train.evaluation import BestKeeper
from ddp_amp.train.microbatch import MicroBatches


@dataclass
class LoopState:
    """The optimizer steps fp16 skipped so far, the best evaluation so far (and model_best.pt's checksum), the
    step whose evaluation a stop cut short (a resumed run evaluates it first), and the micro-batch size
    --micro-batch auto settled on: a resumed run starts from it, so that neither that first evaluation nor the
    first step runs at a size already known not to fit (auto still halves it where it does not, on other
    ranks or devices)."""

    best: BestKeeper
    micro: MicroBatches | None = None
    skipped_steps: int = 0
    unevaluated: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "best": self.best.best, "unevaluated": self.unevaluated,
                "best_checksum": self.best.checksum,
                "micro_batch_size": self.micro.size if self.micro is not None and self.micro.auto else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = state["skipped_steps"]
        self.best.best = state.get("best")  # the best evaluation so far, over the run's attempts
        self.best.checksum = state.get("best_checksum")
        self.unevaluated = state.get("unevaluated")
        if self.micro is not None and self.micro.auto and state.get("micro_batch_size"):
            self.micro.size = min(self.micro.size, state["micro_batch_size"])
