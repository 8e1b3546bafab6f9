"""Tasks used by the tests, loaded through `--task path/to/helper_tasks.py:factory` like a user's own."""

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.tasks import Task

INF_AT_CALL = 3  # the loss of this micro-step (1-based) is multiplied by inf


def _regression() -> tuple[nn.Module, TensorDataset]:
    gen = torch.Generator().manual_seed(7)
    # Small values: fp16 gradients at GradScaler's initial scale (65536) stay finite unless we make them inf.
    x = 0.1 * torch.randn(512, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen)
    return nn.Linear(8, 1), TensorDataset(x, y)


def inf_at_third_step() -> Task:
    """A regression whose third loss is inf: its gradients overflow, GradScaler must skip that step."""
    model, data = _regression()
    calls = 0

    def loss_fn(output, target):
        nonlocal calls
        calls += 1
        loss = nn.functional.mse_loss(output, target)
        return loss * float("inf") if calls == INF_AT_CALL else loss

    return Task(model=model, dataset=data, loss_fn=loss_fn)


def fail_on_rank1() -> Task:
    """Rank 1 raises at its fifth step; rank 0 trains on and would wait for it forever if nobody stopped it."""
    model, data = _regression()
    calls = 0

    def loss_fn(output, target):
        nonlocal calls
        calls += 1
        if calls == 5 and os.environ.get("RANK") == "1":
            raise ValueError("injected failure at step 5")
        return nn.functional.mse_loss(output, target)

    return Task(model=model, dataset=data, loss_fn=loss_fn)


def not_a_task():
    return "a string, not a Task"


def killed_once() -> Task:
    """Rank 1 is SIGKILLed at its third step of the first attempt; a torchrun restart then runs clean."""
    import signal

    model, data = _regression()
    calls = 0

    def loss_fn(output, target):
        nonlocal calls
        calls += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if calls == 3 and first_attempt and os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return nn.functional.mse_loss(output, target)

    return Task(model=model, dataset=data, loss_fn=loss_fn)


SLOW_STEPS = 3  # the first micro-steps of this task sleep, as a cold start would


def slow_start() -> Task:
    """A regression whose first SLOW_STEPS steps each sleep 0.5 s: a timing that counted warm-up would show it."""
    import time

    model, data = _regression()
    calls = 0

    def loss_fn(output, target):
        nonlocal calls
        calls += 1
        if calls <= SLOW_STEPS:
            time.sleep(0.5)
        return nn.functional.mse_loss(output, target)

    return Task(model=model, dataset=data, loss_fn=loss_fn)
