"""Tasks the benchmarks share with benchmarks/handwritten.py, loaded as `--task benchmarks/tasks.py:NAME`."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.tasks import Task

WIDE = (1024, 4096, 1024, 1024)
"""The regression MLP of the performance comparisons: 1024-4096-1024-1024, MSE (9.4 M parameters, 38 MB of fp32
gradients to all-reduce per step)."""


BIG = (1024, 4096, 4096, 1024)
"""25 M parameters: a checkpoint with AdamW's moments of about 300 MB (benchmarks/checkpoint_blocking.py)."""


DEEP_LAYERS = 9
"""deep_regression's default: the wide MLP's parameter count (9.4 M) in nine equal 1024x1024 layers, the same
state in nine FSDP units of 4 MB instead of three of which one holds 44% of the weights
(benchmarks/shard_cost.py)."""


def deep_regression(samples: int = 8192, layers: int = DEEP_LAYERS) -> Task:
    """`--task-arg layers=24`: BIG's parameter count (25 M) in 4 MB units."""
    return wide_regression(samples, widths=(1024,) * (layers + 1))


def big_regression(samples: int = 1024) -> Task:
    return wide_regression(samples, widths=BIG)


def wide_regression(samples: int = 8192, seed: int = 1234, widths: tuple[int, ...] = WIDE) -> Task:
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, widths[0], generator=gen)
    teacher = torch.randn(widths[0], widths[-1], generator=gen) / widths[0] ** 0.5
    return Task(model=regression_mlp(widths), dataset=TensorDataset(inputs, inputs @ teacher),
                loss_fn=nn.functional.mse_loss)


def regression_mlp(widths: tuple[int, ...] = WIDE) -> nn.Sequential:
    """Linear layers of these widths with a GELU between each two, initialised from torch's global generator."""
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths, widths[1:]):
        layers += [nn.Linear(width_in, width_out), nn.GELU()]
    return nn.Sequential(*layers[:-1])


class _Stream(torch.utils.data.IterableDataset):
    """A map-style data set read as a stream, in order: the same items, through ddp-amp's iterable path."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self):
        return (self.dataset[i] for i in range(len(self.dataset)))


def mlp_stream() -> Task:
    """The default task (mlp) with its training set as an iterable data set."""
    from ddp_amp.tasks.mlp import build

    task = build()
    task.dataset = _Stream(task.dataset)
    return task


def mlp_validated() -> Task:
    """The default task (mlp) with a validation set of 16384 held-out samples and its accuracy."""
    from ddp_amp.tasks import mlp

    task = mlp.build()
    centers = torch.randn(mlp.CLASSES, mlp.FEATURES, generator=torch.Generator().manual_seed(mlp.DATA_SEED))
    task.val_dataset = TensorDataset(*mlp._clusters(centers, 16384, torch.Generator().manual_seed(5)))
    task.val_metrics = lambda output, target: {"accuracy": (output.argmax(1) == target).float().mean()}
    return task
