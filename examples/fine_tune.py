"""Fine-tuning, as docs/models.md's "Fine-tuning" section runs it: pre-train, then start from those weights
with the trunk frozen, validate every N steps, keep the best, export it.

    ddp-amp spawn -n 2 --task examples/fine_tune.py:build --steps 60 --run-dir runs/base
    ddp-amp spawn -n 2 --task examples/fine_tune.py:build --task-arg freeze_trunk=true --init-from runs/base/model.pt \\
        --steps 60 --eval-every 10 --keep-best val_loss --checkpoint-every 10 --keep 1 --run-dir runs/tuned
    ddp-amp export runs/tuned --which best -o tuned.safetensors

The data: points on a noisy sine; the validation set is held out (another seed) and its size is odd, which
every rank's disjoint, unpadded share handles exactly.
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.tasks import Task


def _sine(samples: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = 6 * torch.rand(samples, 1, generator=gen) - 3
    return TensorDataset(x, torch.sin(x) + 0.1 * torch.randn(samples, 1, generator=gen))


def build(freeze_trunk: bool = False, width: int = 64) -> Task:
    model = nn.Sequential(nn.Linear(1, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
    if freeze_trunk:  # fine-tune the head only: the trunk is left out of the optimizer
        for layer in model[:4]:
            for parameter in layer.parameters():
                parameter.requires_grad_(False)
    return Task(model=model, dataset=_sine(2048, 0), loss_fn=nn.functional.mse_loss, val_dataset=_sine(511, 1),
                val_metrics=lambda output, target: {"abs_error": (output - target).abs().mean()})
