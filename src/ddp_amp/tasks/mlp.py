"""Classification of synthetic clustered data with a small MLP; reports held-out accuracy.

The held-out samples are also its validation set: --eval-every logs val_loss and val_accuracy, and --keep-best
val_accuracy keeps the best weights."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.tasks import Task

FEATURES = 32
CLASSES = 10
HIDDEN = 256
TRAIN_SAMPLES = 8192
TEST_SAMPLES = 2048
CLUSTER_SPREAD = 1.0
DATA_SEED = 1234


WIDE_FEATURES = 256
WIDE_HIDDEN = 1024
WIDE_LABEL_NOISE = 0.25
"""The share of the wide task's training labels drawn at random. Its clusters separate at once in 256
dimensions: with clean labels the loss reaches ~1e-8 within bench's warm-up, the gradients ~0 and the softmax
outputs subnormal, and a CPU's fp32 step then times its slow path for subnormals, not its arithmetic. Noisy
labels keep the loss near their entropy (~1 nat) and the gradients alive; held-out labels stay clean."""


def _clusters(centers: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    points = centers[labels] + CLUSTER_SPREAD * torch.randn(n, centers.shape[1], generator=gen)
    return points, labels


def build_wide() -> Task:
    """The bench's default: the same problem, 256 features and 1024-wide layers, so matmuls dominate a step,
    with noisy training labels, so it is still learning while bench times it."""
    return build(hidden=WIDE_HIDDEN, features=WIDE_FEATURES, label_noise=WIDE_LABEL_NOISE)


def build(hidden: int = HIDDEN, features: int = FEATURES, label_noise: float = 0.0) -> Task:
    gen = torch.Generator().manual_seed(DATA_SEED)
    # Centres ~ N(0, 1) in 32 dimensions lie ~8 apart: separable, but only after a few dozen steps of training.
    centers = torch.randn(CLASSES, features, generator=gen)
    train_x, train_y = _clusters(centers, TRAIN_SAMPLES, gen)
    test_x, test_y = _clusters(centers, TEST_SAMPLES, gen)
    if label_noise:
        noisy = torch.rand(TRAIN_SAMPLES, generator=gen) < label_noise
        train_y = torch.where(noisy, torch.randint(0, CLASSES, (TRAIN_SAMPLES,), generator=gen), train_y)
    model = nn.Sequential(
        nn.Linear(features, hidden), nn.GELU(),
        nn.Linear(hidden, hidden), nn.GELU(),
        nn.Linear(hidden, CLASSES),
    )

    @torch.no_grad()
    def evaluate(model: nn.Module, device: torch.device) -> dict[str, float]:
        predicted = model(test_x.to(device)).argmax(dim=1)
        return {"accuracy": (predicted == test_y.to(device)).float().mean().item()}

    return Task(model=model, dataset=TensorDataset(train_x, train_y), loss_fn=nn.CrossEntropyLoss(),
                evaluate=evaluate, val_dataset=TensorDataset(test_x, test_y), val_metrics=_accuracy)


def _accuracy(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accuracy": (logits.argmax(dim=1) == labels).float().mean()}
