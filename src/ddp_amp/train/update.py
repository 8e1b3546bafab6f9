"""The optimizer's update, once its gradients are reduced: the one place that steps an optimizer through the
gradient scaler, for ddp-amp's own loop (train.step) and a script's (ddp_amp.loop) alike.

strategy's gradients for the update -> `unscale_` -> clip or norm -> `scaler.step` -> `update` -> the strategy's
update done -> `zero_grad(set_to_none=True)` -> the schedulers, unless GradScaler skipped the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ddp_amp.parallel.base import Strategy, whole_value
from ddp_amp.parallel.master_step import MasterAdamW


class OptimizerUpdate:
    """One optimizer's update under the run's scaler and parallel strategy.

    It counts the optimizer steps actually taken: GradScaler calls optimizer.step() only when the gradients are
    finite (it learns that with the one host sync it already makes), so a skipped step is seen here without
    reading the scale back from the device. (A fused optimizer takes the scaler's found_inf itself and would break
    this: never built under a GradScaler; see train.optim and ddp_amp.loop's prepare.)"""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, strategy: Strategy, *,
                 clip_grad: float | None, schedulers: Sequence[Any] = ()) -> None:
        self.optimizer, self.scaler, self.strategy = optimizer, scaler, strategy
        self.clip_grad, self.schedulers = clip_grad, list(schedulers)
        self.steps_taken = 0
        optimizer.register_step_post_hook(self._count_step)

    def __call__(self, *, want_norm: bool = False, clip_grad: float | None = None) -> tuple[bool, torch.Tensor | None]:
        """The whole update: (whether the optimizer stepped, the global norm of the unscaled gradients on the
        device, or None when neither clipping nor `want_norm` asked for it). `clip_grad`: this step's limit in
        place of the run's. The gradients are zeroed either way; the schedulers step only with the optimizer."""
        self.strategy.gradients_for_update()
        limit = self.clip_grad if clip_grad is None else clip_grad
        grad_norm = self.unscale_and_clip(limit) if limit is not None or want_norm else None
        stepped = self.step()
        self.optimizer.zero_grad(set_to_none=True)
        if stepped:  # after a skip the schedule must not advance either
            for scheduler in self.schedulers:
                scheduler.step()
        return stepped, grad_norm

    def unscale_and_clip(self, limit: float | None) -> torch.Tensor:
        """The norm of the true gradients: unscaled first (a no-op without fp16), clipped to `limit` after
        unscaling. The gradients are all-reduced already, so this rank's norm is the global one; it stays on the
        device. Sharded gradients (--shard full) are DTensors: torch's norm of them is the global one, replicated."""
        if isinstance(self.optimizer, MasterAdamW):  # bf16 gradients, scaled inside its one pass (no scaler)
            return self.optimizer.norm_and_clip(limit)
        self.scaler.unscale_(self.optimizer)
        # The optimizer's parameters: the model's own, or their fp32 masters (bf16-true), which hold the gradients.
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if limit is not None:
            return whole_value(torch.nn.utils.clip_grad_norm_(params, limit))
        return whole_value(torch.nn.utils.get_total_norm([p.grad for p in params]))

    def step(self) -> bool:
        """The optimizer step through the scaler (no zeroing, no schedule); False when the scaler skipped it
        (inf/NaN gradients)."""
        self.strategy.gradients_for_update()  # a no-op where the caller moved them already
        if not self.scaler.is_enabled():
            self.optimizer.step()
            self.strategy.update_done()
            return True
        taken = self.steps_taken
        self.scaler.step(self.optimizer)  # host sync (inside GradScaler): were the gradients finite?
        self.scaler.update()  # stays on the device
        self.strategy.update_done()
        return self.steps_taken > taken

    def _count_step(self, *_: Any) -> None:
        self.steps_taken += 1
