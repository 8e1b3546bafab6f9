"""The interface every parallel mode implements (Fabric's Strategy, for ddp-amp's three modes), and the helpers
they share. Every method that gathers or loads state is collective: every rank calls it."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn

from ddp_amp.config import TrainConfig
from ddp_amp.parallel.modes import MODES
from ddp_amp.precision import Precision


class Strategy:
    """One rank's parallel mode. `setup_module` first; the rest works on what it returned."""

    mode: ClassVar[str]
    """Its --shard name."""
    replicated_parts: ClassVar[tuple[str, ...]] = ("model", "optimizer")
    """The parts of a sharded checkpoint ("model", "optimizer") that every rank holds whole, so that each is
    written by one rank only (checkpoint.sharded.own_share)."""
    lockstep_evaluation: ClassVar[bool] = False
    """Every rank must run each validation forward together (a forward that all-gathers the weights)."""

    def __init__(self, config: TrainConfig, device: torch.device, precision: Precision | None = None) -> None:
        self.config, self.device = config, device
        self.precision = precision or Precision("fp32")
        self.one_size_per_launch = MODES[self.mode].one_size_per_launch
        """bench --max-batch tries one size per launch (parallel.Mode)."""

    def setup_module(self, module: nn.Module, units: Sequence[type | str] | None = None) -> nn.Module:
        """What the step trains, made of `module` (the model on this rank's device, or on the meta device where
        it is built from rank 0's weights); `units`: Task.shard_units, where the mode shards by blocks."""
        raise NotImplementedError

    def build_optimizer(self, params: list[nn.Parameter], cls: type[torch.optim.Optimizer],
                        options: dict[str, Any]) -> torch.optim.Optimizer:
        """The optimizer `cls(params, **options)` as this mode runs it."""
        return cls(params, **options)

    def compiled_adamw(self, params: list[nn.Parameter], **options: Any) -> torch.optim.Optimizer:
        """--optimizer-impl compiled: AdamW stepping bf16-true's masters in one pass (DDP's alone; refused before
        launch elsewhere, launch.option_checks)."""
        raise NotImplementedError(f"--optimizer-impl compiled under --shard {self.mode}")

    def optimized(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """What the optimizer updates for the model's trainable `params`: themselves, or their fp32 masters
        (bf16-true under DDP, parallel.master)."""
        return params

    def gradients_for_update(self) -> None:
        """Once the gradients are reduced, before anything reads them (the norm, clipping) or the optimizer steps:
        where the optimizer's parameters are not the model's, their gradients are moved over."""

    def update_done(self) -> None:
        """After the optimizer stepped: where its parameters are not the model's, the model takes their values."""

    def drop_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every gradient the step made so far, on the model and the optimizer's parameters (an out-of-memory
        rerun starts from none)."""
        module.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)

    def grad_scaler(self, precision: Precision) -> torch.amp.GradScaler:
        """fp16's loss scaler (enabled only for fp16; disabled it is a cheap pass-through)."""
        return torch.amp.GradScaler(self.device.type, enabled=precision.uses_scaler)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        """The backward passes inside accumulate their gradients locally; the one after reduces them all."""
        return model.no_sync()

    def no_backward_sync(self, model: nn.Module, enabled: bool) -> AbstractContextManager:
        """no_sync where `enabled` (a micro-step that is not the step's last), else nothing (Fabric's
        no_backward_sync(module, enabled)): the one place both loops choose whether a backward reduces. Under DDP
        the choice must hold the forward (DDP decides there); under FSDP2, the backward."""
        return self.no_sync(model) if enabled else contextlib.nullcontext()

    def full_state(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                   writers: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the model's state_dict, the optimizer's) whole on the ranks in `writers` in the plain formats (the
        optimizer's state keyed by parameter index), ({}, {}) on the others: what a single-file checkpoint
        holds, the same in every mode."""
        if torch.distributed.get_rank() not in writers:
            return {}, {}
        return module.state_dict(), {} if optimizer is None else optimizer.state_dict()

    def load_full_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                        optimizer_state: dict[str, Any]) -> None:
        """Every rank, from the whole state of any mode's checkpoint: each takes what it holds."""
        self.load_model_state(module, model_state)
        self.load_optimizer_state(module, optimizer, optimizer_state)

    def load_model_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        """Every rank: the whole model's state_dict, loaded (strictly) into what this rank holds of it."""
        module.load_state_dict(state)

    def load_optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Every rank: the optimizer of `module` from a whole state_dict in the plain format (full_state's)."""
        optimizer.load_state_dict(state)

    def model_state(self, module: nn.Module, writers: list[int]) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict on the ranks in `writers` (model.pt, model_best.pt), None elsewhere."""
        return self.full_state(module, None, writers)[0] or None

    def plain_model(self, module: nn.Module, writers: list[int]) -> nn.Module | None:
        """The trained model as a plain module (model.pt, the model's own format, rank 0's evaluation), at
        least on the ranks in `writers` (None where it is not)."""
        return module

    def error_line(self, exc: BaseException, model: nn.Module, step: int) -> str | None:
        """One line naming the cause and the flag for a known error of this mode in step `step`, else None."""
        return None

    def summary(self) -> dict[str, Any]:
        """Its part of summary.json."""
        return {"shard": self.mode}


def whole_value(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's value as a plain tensor (a replicated one is whole on every rank: a gradient norm)."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def on_meta_device(model: nn.Module) -> bool:
    """Any of the model's parameters or buffers without storage (built under torch.device("meta"))."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
