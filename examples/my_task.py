"""Bring your own model: a task factory that ddp-amp can train.

    ddp-amp spawn -n 2 --task examples/my_task.py:build --steps 100

A factory returns a `ddp_amp.tasks.Task`. It may take keyword arguments, which `--task-arg KEY=VALUE` (repeatable)
passes to it, each converted by the parameter's annotation (int, float, bool, str, Path, or one of them | None; an
unannotated one by its default's type); this one takes none. It runs on every rank after the global torch seed is
set, so the model starts from the same weights everywhere; the data set must be the same on every rank (here it
is generated from a fixed seed), since ddp-amp gives each rank its share with a DistributedSampler's order.
The Task contract in full: docs/models.md.
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.tasks import Task


def _bars(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """16x16 noisy images holding one horizontal (label 0) or vertical (label 1) bar."""
    labels = torch.randint(0, 2, (n,), generator=gen)
    positions = torch.randint(2, 14, (n,), generator=gen)
    images = 0.3 * torch.randn(n, 1, 16, 16, generator=gen)
    for i in range(n):
        if labels[i] == 0:
            images[i, 0, positions[i], :] += 1.0
        else:
            images[i, 0, :, positions[i]] += 1.0
    return images, labels


def build() -> Task:
    gen = torch.Generator().manual_seed(42)
    train_x, train_y = _bars(2048, gen)
    test_x, test_y = _bars(512, gen)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 2),
    )

    @torch.no_grad()
    def evaluate(model: nn.Module, device: torch.device) -> dict[str, float]:
        # The trained model is on the rank's device (a GPU under --device cuda): bring the data to it.
        predicted = model(test_x.to(device)).argmax(1)
        return {"accuracy": (predicted == test_y.to(device)).float().mean().item()}

    return Task(model=model, dataset=TensorDataset(train_x, train_y), loss_fn=nn.CrossEntropyLoss(),
                evaluate=evaluate)
