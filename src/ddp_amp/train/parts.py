"""The stateful parts of a training run that a checkpoint holds, handed to the checkpoint manager by whoever trains
(as torchtitan's checkpointer is handed model_parts, optimizers, lr_schedulers and states), so that the manager
never reaches into the trainer. The random states are not among them: the manager reads those itself, per rank.

Two kinds, one interface (`Parts`), one checkpoint manager over both:
TrainingParts  ddp-amp's own loop: one model, its optimizer, schedule, scaler, data position and counters. The
               checkpoint's "trainer" part keeps the layout it always had (model, optimizer, scheduler, scaler, the
               data's position, skipped_steps, best), so that checkpoints written before this module still resume.
NamedParts     a script's loop (ddp_amp.loop): any number of models, optimizers and other state, by the names the
               script gave them (the trainer part: {name: state}, the scaler under "_scaler").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ddp_amp.errors import RankSetupError
from ddp_amp.parallel.base import Strategy
from ddp_amp.train.optim import implementation_of, keep_implementation


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


class Parts(Protocol):
    """What the checkpoint manager and the formats (checkpoint.formats) ask of a run's state. Every method that
    gathers or loads model or optimizer state is collective: every rank calls it."""

    strategy: Strategy

    def whole_state(self, writers: list[int]) -> dict[str, Any] | None:
        """The trainer part of a single-file checkpoint on the ranks in `writers`, None on the others."""
        ...

    def load_whole(self, trainer: dict[str, Any]) -> None:
        """The models and optimizers from a single-file checkpoint's trainer part (after load_extras)."""
        ...

    def weights(self) -> tuple[dict[str, nn.Module], dict[str, tuple[nn.Module, torch.optim.Optimizer]]]:
        """The models and the optimizers by name (an optimizer with the model it trains): a sharded
        checkpoint's tensors (checkpoint.sharded.local_state)."""
        ...

    def replicated(self) -> tuple[str, ...]:
        """The names among weights() that every rank holds whole (each written by one rank only)."""
        ...

    def after_sharded_load(self) -> None:
        """After a sharded checkpoint's weights were loaded (itself after load_extras)."""
        ...

    def extras(self) -> dict[str, Any]:
        """Everything but the models and the optimizers (a sharded checkpoint's extras.pt)."""
        ...

    def load_extras(self, state: dict[str, Any], saved_world_size: int | None, data_ranks: list | None) -> None: ...

    def rank_state(self) -> Any:
        """This rank's own data position (None where every rank's is the same), gathered at every save."""
        ...

    def refusal(self, state: dict[str, Any]) -> str | None:
        """Why a checkpoint cannot be continued by these parts (what it holds does not fit), else None."""
        ...

    def marker(self) -> dict[str, Any]:
        """What a checkpoint's config records of these parts, beside the run's options."""
        ...


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

    def __post_init__(self) -> None:
        self.implementation = implementation_of(self.optimizer)
        """How the run built its optimizer (--optimizer-impl), which no checkpoint's settings replace."""

    def whole_state(self, writers: list[int]) -> dict[str, Any] | None:
        """The trainer part of a single-file checkpoint on the ranks in `writers`, None on the others. Every rank
        calls it: gathering sharded state is collective."""
        model, optimizer = self.strategy.full_state(self.module, self.optimizer, writers)
        if torch.distributed.get_rank() not in writers:
            return None
        return {"model": model, "optimizer": optimizer, **self.extras()}

    def load_whole(self, trainer: dict[str, Any]) -> None:
        """From the checkpoint's whole state, each rank taking what it holds in this run's parallel mode (any
        mode's checkpoint)."""
        self.strategy.load_full_state(self.module, self.optimizer, trainer["model"], trainer["optimizer"])
        keep_implementation(self.optimizer, self.implementation)

    def weights(self) -> tuple[dict[str, nn.Module], dict[str, tuple[nn.Module, torch.optim.Optimizer]]]:
        return {"model": self.module}, {"optimizer": (self.module, self.optimizer)}

    def replicated(self) -> tuple[str, ...]:
        return self.strategy.replicated_parts

    def after_sharded_load(self) -> None:
        """ZeroRedundancyOptimizer's own groups hold the rate its step copies to its local optimizer, which the
        schedule's state decides."""
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        keep_implementation(self.optimizer, self.implementation)

    def load_extras(self, state: dict[str, Any], saved_world_size: int | None, data_ranks: list | None) -> None:
        """All but the model and the optimizer from a checkpoint's trainer part, taken by `saved_world_size`
        ranks; `data_ranks`: every rank's position in iterable data."""
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])  # the loss scale and its growth tracker
        self.data.load_state_dict(state, saved_world_size)
        self.data.load_rank_state(data_ranks, saved_world_size)
        self.loop.load_state_dict(state)

    def rank_state(self) -> Any:
        return self.data.rank_state()

    def marker(self) -> dict[str, Any]:
        return {}

    def refusal(self, state: dict[str, Any]) -> str | None:
        if state.get("config", {}).get("loop"):
            return "it is a checkpoint of a script's loop (ddp_amp.loop), not of a --task run"
        return None


@dataclass
class Restored:
    """Where a checkpoint load continued from: the checkpoint, the optimizer step it was taken after, by how many
    ranks."""

    path: Path
    step: int
    world_size: int


SCALER_KEY = "_scaler"
"""A script loop's checkpoint: the gradient scaler's state (fp16's loss scale), beside the script's names."""


@dataclass
class NamedParts:
    """A script's loop's state by the names it registered: the models (inside their parallel wrappers), the
    optimizers (each with the model it trains), and anything else with state_dict/load_state_dict (schedulers,
    the data position, the script's own). A single-file checkpoint holds the models and optimizers whole in
    the plain formats, whatever the parallel mode, so a run continues in another mode or on another world
    size; a sharded one, each rank's part."""

    strategy: Strategy
    scaler: torch.amp.GradScaler
    models: dict[str, nn.Module]
    optimizers: dict[str, tuple[nn.Module, torch.optim.Optimizer]]
    others: dict[str, Any]

    def __post_init__(self) -> None:
        self.implementations = {name: implementation_of(optimizer) for name, (_, optimizer) in self.optimizers.items()}
        """How the script built each optimizer (fused, foreach, ...), which no checkpoint's settings replace."""

    def names(self) -> list[str]:
        return sorted([*self.models, *self.optimizers, *self.others])

    def marker(self) -> dict[str, Any]:
        """What the checkpoint's config says of it: a script loop's, and the names it holds."""
        return {"loop": True, "parts": self.names()}

    def whole_state(self, writers: list[int]) -> dict[str, Any] | None:
        held = {name: self.strategy.full_state(module, None, writers)[0] for name, module in self.models.items()}
        for name, (module, optimizer) in self.optimizers.items():
            held[name] = self.strategy.full_state(module, optimizer, writers)[1]
        if torch.distributed.get_rank() not in writers:
            return None
        return {**held, **self.extras()}

    def load_whole(self, trainer: dict[str, Any]) -> None:
        """The models first: an optimizer's load needs its model's."""
        for name, module in self.models.items():
            try:
                self.strategy.load_model_state(module, trainer[name])
            except RuntimeError as exc:
                raise RankSetupError(f"its {name} does not fit the model given for it: "
                                     f"{' '.join(str(exc).split())[:300]}") from None
        for name, (module, optimizer) in self.optimizers.items():
            self.strategy.load_optimizer_state(module, optimizer, trainer[name])
            keep_implementation(optimizer, self.implementations[name])

    def weights(self) -> tuple[dict[str, nn.Module], dict[str, tuple[nn.Module, torch.optim.Optimizer]]]:
        return self.models, self.optimizers

    def replicated(self) -> tuple[str, ...]:
        kinds = self.strategy.replicated_parts
        return (*(self.models if "model" in kinds else ()), *(self.optimizers if "optimizer" in kinds else ()))

    def after_sharded_load(self) -> None:
        """Under ZeRO-1 the wrapper's groups hold the rate its step copies to its local optimizer: a scheduler's
        (loaded already) is put back there."""
        for name, (_, optimizer) in self.optimizers.items():
            keep_implementation(optimizer, self.implementations[name])
        if self.strategy.mode == "optimizer":
            optimizers = {id(optimizer) for _, optimizer in self.optimizers.values()}
            for other in self.others.values():
                if id(getattr(other, "optimizer", None)) in optimizers and hasattr(other, "get_last_lr"):
                    for group, lr in zip(other.optimizer.param_groups, other.get_last_lr()):
                        group["lr"] = lr

    def extras(self) -> dict[str, Any]:
        return {**{name: other.state_dict() for name, other in self.others.items()},
                SCALER_KEY: self.scaler.state_dict()}

    def load_extras(self, state: dict[str, Any], saved_world_size: int | None, data_ranks: list | None) -> None:
        """The data position continues on another world size (train.data); the others load as they are."""
        from ddp_amp.train.data import RankData

        for name, other in self.others.items():
            if isinstance(other, RankData):
                other.load_state_dict(state[name], saved_world_size)
            else:
                other.load_state_dict(state[name])
        if state.get(SCALER_KEY):
            self.scaler.load_state_dict(state[SCALER_KEY])

    def rank_state(self) -> None:
        return None  # a map-style data set's position is global (train.data.RankData)

    def refusal(self, state: dict[str, Any]) -> str | None:
        config = state.get("config") or {}
        held = config.get("parts") or sorted(key for key in state["trainer"] if key != SCALER_KEY)
        if not config.get("loop"):
            return f"it is not a checkpoint of ddp_amp.loop (it holds {', '.join(held)})"
        if missing := sorted(set(self.names()) - set(held)):
            return f"no {', '.join(missing)} in it (it holds {', '.join(held)})"
        return None
