"""Tasks used by the tests, loaded through `--task path/to/helper_tasks.py:factory` like a user's own.

Each is a small regression whose loss function does something on a chosen call (1-based micro-step).
"""

import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.tasks import Task

INF_AT_CALL = 3  # the loss of this micro-step is multiplied by inf
SLOW_STEPS = 3  # the first micro-steps of slow_start sleep, as a cold start would


def _regression_with(on_call) -> Task:
    """A linear regression whose loss goes through `on_call(call, loss) -> loss` on every call."""
    gen = torch.Generator().manual_seed(7)
    # Small values: fp16 gradients at GradScaler's initial scale (65536) stay finite unless we make them inf.
    x = 0.1 * torch.randn(512, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen)
    calls = 0

    def loss_fn(output, target):
        nonlocal calls
        calls += 1
        return on_call(calls, nn.functional.mse_loss(output, target))

    return Task(model=nn.Linear(8, 1), dataset=TensorDataset(x, y), loss_fn=loss_fn)


def inf_at_third_step() -> Task:
    """The third loss is inf: its gradients overflow, GradScaler must skip that step."""
    return _regression_with(lambda call, loss: loss * float("inf") if call == INF_AT_CALL else loss)


def fail_on_rank1() -> Task:
    """Rank 1 raises at its fifth step; rank 0 trains on and would wait for it forever if nobody stopped it."""

    def on_call(call, loss):
        if call == 5 and os.environ.get("RANK") == "1":
            raise ValueError("injected failure at step 5")
        return loss

    return _regression_with(on_call)


def killed_once() -> Task:
    """Rank 1 is SIGKILLed at its third step of the first attempt; a torchrun restart then runs clean."""

    def on_call(call, loss):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if call == 3 and first_attempt and os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    return _regression_with(on_call)


def slow_start() -> Task:
    """The first SLOW_STEPS steps each sleep 0.5 s: a timing that counted warm-up would show it."""

    def on_call(call, loss):
        if call <= SLOW_STEPS:
            time.sleep(0.5)
        return loss

    return _regression_with(on_call)


def not_a_task():
    return "a string, not a Task"
