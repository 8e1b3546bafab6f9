"""The divergence watch: notices a run that no longer trains, without a host sync per step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddp_amp.dist import DistEnv


class DivergenceWatch:
    """Non-finite losses are counted on the device (a streak per rank, and the step where it first reached the
    limit); whether any rank tripped travels in the all-reduce that logging makes anyway, and only then does a
    second one find where. Skipped fp16 steps are already known on the host, so a collapsed loss scale is caught
    at the step where it happens.
    """

    NEVER = 2**40

    def __init__(self, limit: int, device: torch.device) -> None:
        self.limit = limit
        self.streak = torch.zeros((), dtype=torch.int64, device=device)
        self.tripped_at = torch.full((), self.NEVER, dtype=torch.int64, device=device)
        self.skip_streak = 0

    def end_step(self, step: int, loss: torch.Tensor, stepped: bool) -> dict[str, Any] | None:
        """After optimizer step `step` (from 1), whose summed loss is `loss` (on the device). Returns the
        verdict when the loss scale collapsed (known on the host); a non-finite streak stays on the device."""
        if not self.limit:
            return None
        self.streak = torch.where(torch.isfinite(loss), 0, self.streak + 1)
        self.tripped_at = torch.where((self.streak >= self.limit) & (self.tripped_at == self.NEVER), step,
                                      self.tripped_at)
        # Known on the host (every rank skips the same steps: the gradients were all-reduced), no sync.
        self.skip_streak = 0 if stepped else self.skip_streak + 1
        if self.skip_streak >= self.limit:
            return {"step": step, "rank": None,
                    "reason": f"the fp16 loss scale collapsed: GradScaler skipped {self.limit} steps in a row "
                              "(inf/NaN gradients every step)"}
        return None

    def tripped(self) -> torch.Tensor:
        """1.0 on the device once this rank's streak has reached the limit (summed across ranks by logging)."""
        return (self.tripped_at != self.NEVER).float().reshape(1)

    def verdict(self, env: DistEnv) -> dict[str, Any]:
        """Once some rank tripped, on every rank: the earliest step (and its rank) where a streak reached the
        limit."""
        # Step and rank in one number, so a MIN all-reduce finds the earliest, lowest rank first.
        code = self.tripped_at * env.world_size + env.rank
        dist.all_reduce(code, op=dist.ReduceOp.MIN)
        step, rank = divmod(int(code.item()), env.world_size)
        return {"step": step, "rank": rank,
                "reason": f"the loss was inf/NaN for {self.limit} consecutive steps"}
