"""The stateful parts of a training run that a checkpoint holds, handed to the checkpoint manager by whoever trains
(as torchtitan's checkpointer is handed model_parts, optimizers, lr_schedulers and states), so that the manager
never reaches into the trainer. The random states are not among them: the manager reads those itself, per rank.

The checkpoint's "trainer" part keeps the layout it always had (model, optimizer, scheduler, scaler, the data's
position, skipped_steps, best), so that checkpoints written before this module still resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ddp_amp.parallel.base import Strategy


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DataPosition(Protocol):
    """Where the training data stands (train.data): what all ranks share, and each rank's own (iterable data)."""

    def state_dict(self) -> dict[str, Any]:
        """Keys of the checkpoint's trainer part (merged into it)."""
        ...

    def load_state_dict(self, state: dict[str, Any], saved_world_size: int | None) -> None: ...

    def rank_state(self) -> Any:
        """This rank's own position (None where every rank's is the same), gathered from every rank at a save."""
        ...

    def load_rank_state(self, ranks: list | None, saved_world_size: int | None) -> None: ...


@dataclass
class TrainingParts:
    strategy: Strategy
    """The parallel mode: how the model's and the optimizer's whole state is gathered and loaded back."""
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    """The LR scheduler (an LRScheduler); replaced where a resized --epochs run re-enters its schedule."""
    scaler: torch.amp.GradScaler
    data: DataPosition
    loop: Stateful
    """The loop's own counters (the steps fp16 skipped, the best evaluation so far)."""

    def extras(self) -> dict[str, Any]:
        """Everything but the model and the optimizer: a sharded checkpoint's extras, and the rest of a single
        file's trainer part."""
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                **self.data.state_dict(), **self.loop.state_dict()}

    def whole_state(self, writers: list[int]) -> dict[str, Any] | None:
        """The trainer part of a single-file checkpoint on the ranks in `writers`, None on the others. Every rank
        calls it: gathering sharded state is collective."""
        model, optimizer = self.strategy.full_state(self.module, self.optimizer, writers)
        if torch.distributed.get_rank() not in writers:
            return None
        return {"model": model, "optimizer": optimizer, **self.extras()}

    def load_extras(self, state: dict[str, Any], saved_world_size: int | None, data_ranks: list | None) -> None:
        """All but the model and the optimizer from a checkpoint's trainer part, taken by `saved_world_size`
        ranks; `data_ranks`: every rank's position in iterable data."""
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])  # the loss scale and its growth tracker
        self.data.load_state_dict(state, saved_world_size)
        self.data.load_rank_state(data_ranks, saved_world_size)
        self.loop.load_state_dict(state)


@dataclass
class Restored:
    """Where a checkpoint load continued from: the checkpoint, the optimizer step it was taken after, by how many
    ranks."""

    path: Path
    step: int
    world_size: int
