"""LR schedules, defined in optimizer steps and composed explicitly.

Two schedulers stepped back to back multiply their factors (the classic ExponentialLR + CosineAnnealingLR
example climbs again after T_max). Here warm-up and decay are joined by SequentialLR, so exactly one
scheduler owns the LR at each step, and `scheduler.step()` is called once per *taken* optimizer step.
"""

from __future__ import annotations

import math

import torch
from torch.optim import lr_scheduler

STEP_MILESTONES = (1 / 3, 2 / 3)
STEP_GAMMA = 0.1
_FOREVER = 2**62
ONECYCLE_DIV_FACTOR = 25.0  # OneCycleLR's default: it starts at max_lr / 25


def run_length(config, batches_per_epoch: int) -> int:
    """The run's optimizer steps: --steps, or --epochs of `batches_per_epoch` batches per rank, --grad-accum of
    them a step; what must fit in them (--warmup-steps, --profile) checked against it (RankUsageError). The
    launcher checks an --epochs run with it before any rank starts (launch.preflight), the ranks again."""
    from ddp_amp.config import parse_window
    from ddp_amp.errors import RankUsageError

    total = config.steps if config.steps is not None else config.epochs * batches_per_epoch // config.grad_accum
    if total < 1:
        raise RankUsageError(f"--epochs {config.epochs} gives no optimizer step: the data set has "
                             f"{batches_per_epoch} batches per rank, fewer than --grad-accum {config.grad_accum}")
    if config.warmup_steps >= total:
        raise RankUsageError(f"--warmup-steps {config.warmup_steps} must be smaller than the run's {total} "
                             "optimizer steps")
    if config.profile is not None and parse_window(config.profile)[1] > total:
        raise RankUsageError(f"--profile {config.profile}: the run has only {total} steps")
    return total


def build_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str, total_steps: int, warmup_steps: int,
                    min_lr_ratio: float) -> lr_scheduler.LRScheduler:
    """The scheduler for `total_steps` optimizer steps, the first `warmup_steps` of them a linear warm-up.

    constant     lr after warm-up
    cosine       cosine from lr down to lr * min_lr_ratio at the last step, then flat
    exponential  geometric decay reaching lr * min_lr_ratio at the last step
    step         x0.1 at 1/3 and again at 2/3 of the post-warm-up steps
    onecycle     torch's OneCycleLR over all steps; --warmup-steps sets its rising phase
    """
    # Read before any scheduler is built: constructing LinearLR already lowers the group's lr to its start.
    peak_lr = optimizer.param_groups[0]["lr"]
    if schedule == "onecycle":
        # OneCycleLR has its own warm-up phase; composing a second one would double it.
        # OneCycleLR peaks at step pct_start * total_steps - 1; peak at step `warmup_steps`, like the others.
        pct_start = (warmup_steps + 1) / total_steps if warmup_steps else 0.3
        # It ends at max_lr / (div_factor * final_div_factor): choose final_div_factor to end at --min-lr-ratio.
        # cycle_momentum=False: cycling would silently override --momentum and AdamW's beta1.
        final_div_factor = 1 / (ONECYCLE_DIV_FACTOR * min_lr_ratio) if min_lr_ratio > 0 else math.inf
        return lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                       total_steps=total_steps, pct_start=pct_start, div_factor=ONECYCLE_DIV_FACTOR,
                                       final_div_factor=final_div_factor, cycle_momentum=False)
    decay_steps = max(1, total_steps - warmup_steps)
    phases: list[tuple[lr_scheduler.LRScheduler, int]] = []  # (scheduler, steps it owns); the last owns the rest
    if warmup_steps:
        phases.append((lr_scheduler.LinearLR(optimizer, start_factor=1 / (warmup_steps + 1), end_factor=1.0,
                                             total_iters=warmup_steps), warmup_steps))
    if schedule == "constant":
        phases.append((lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0), 0))
    elif schedule == "cosine":
        phases.append((lr_scheduler.CosineAnnealingLR(optimizer, T_max=decay_steps, eta_min=peak_lr * min_lr_ratio),
                       decay_steps))
        # CosineAnnealingLR is periodic: past T_max it climbs again. Hold the floor instead.
        phases.append((lr_scheduler.ConstantLR(optimizer, factor=min_lr_ratio, total_iters=_FOREVER), 0))
    elif schedule == "exponential":
        phases.append((lr_scheduler.ExponentialLR(optimizer, gamma=min_lr_ratio ** (1 / decay_steps)), 0))
    elif schedule == "step":
        milestones = sorted({max(1, round(decay_steps * f)) for f in STEP_MILESTONES})
        phases.append((lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=STEP_GAMMA), 0))
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    if len(phases) == 1:
        return phases[0][0]
    milestones, start = [], 0
    for _, length in phases[:-1]:
        start += length
        milestones.append(start)
    return lr_scheduler.SequentialLR(optimizer, schedulers=[s for s, _ in phases], milestones=milestones)


def closed_form_lr(step: int, *, lr: float, schedule: str, total_steps: int, warmup_steps: int,
                   min_lr_ratio: float) -> float:
    """The LR in effect for optimizer step `step` (0-based), written out by hand. Tests compare the two."""
    if schedule == "onecycle":
        raise ValueError("onecycle is torch's OneCycleLR; it has no separate closed form here")
    if step < warmup_steps:
        start = 1 / (warmup_steps + 1)
        return lr * (start + (1 - start) * step / warmup_steps)
    t = step - warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        t = min(t, decay_steps)
        floor = lr * min_lr_ratio
        return floor + (lr - floor) * (1 + math.cos(math.pi * t / decay_steps)) / 2
    if schedule == "exponential":
        return lr * min_lr_ratio ** (t / decay_steps)
    if schedule == "step":
        milestones = sorted({max(1, round(decay_steps * f)) for f in STEP_MILESTONES})
        return lr * STEP_GAMMA ** sum(t >= m for m in milestones)
    raise ValueError(f"unknown schedule {schedule!r}")
