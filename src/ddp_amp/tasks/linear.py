"""The classic Linear(10, 10) example, made learnable: targets are a fixed random linear map plus noise.

With noise of standard deviation NOISE_STD the best achievable mean squared error is NOISE_STD**2 (the noise
floor), so convergence can be checked against a known number. A held-out set drawn the same way is its
validation set (--eval-every, --keep-best val_loss).
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.tasks import Task

FEATURES = 10
SAMPLES = 4096
VAL_SAMPLES = 1024
NOISE_STD = 0.1
DATA_SEED = 1234


def build() -> Task:
    gen = torch.Generator().manual_seed(DATA_SEED)
    true_weight = torch.randn(FEATURES, FEATURES, generator=gen) / FEATURES**0.5
    true_bias = torch.randn(FEATURES, generator=gen)
    inputs = torch.randn(SAMPLES, FEATURES, generator=gen)
    targets = inputs @ true_weight.T + true_bias + NOISE_STD * torch.randn(SAMPLES, FEATURES, generator=gen)
    # Drawn after the training set, which therefore stays what it was before the task had a validation set.
    val_inputs = torch.randn(VAL_SAMPLES, FEATURES, generator=gen)
    val_targets = (val_inputs @ true_weight.T + true_bias
                   + NOISE_STD * torch.randn(VAL_SAMPLES, FEATURES, generator=gen))
    loss_fn = nn.MSELoss()

    @torch.no_grad()
    def evaluate(model: nn.Module, device: torch.device) -> dict[str, float]:
        loss = loss_fn(model(inputs.to(device)), targets.to(device)).item()
        return {"loss": loss, "noise_floor": NOISE_STD**2}

    return Task(model=nn.Linear(FEATURES, FEATURES), dataset=TensorDataset(inputs, targets), loss_fn=loss_fn,
                evaluate=evaluate, val_dataset=TensorDataset(val_inputs, val_targets))
