"""The data side of training: a rank's shard of the data set, batches across epochs, and where a resumed run
picks the data up."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from ddp_amp.dist import DistEnv, usable_cores

MAX_DEFAULT_WORKERS = 4


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor inside `batch` (tensors, mappings, namedtuples, lists, tuples, nested) moved to `device`;
    anything else is returned as it is. non_blocking: from pinned memory the copy overlaps compute."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {key: to_device(value, device) for key, value in batch.items()}
        try:
            return type(batch)(moved)
        except (TypeError, ValueError):  # a Mapping type that cannot be built from a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields positionally
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def loader_workers(requested: int | None, device: torch.device, local_world_size: int) -> int:
    """DataLoader workers per rank. CPU ranks already use every core for compute, so loading stays in the rank;
    a GPU rank gets a few workers out of its share of the cores, so the GPU does not wait for the next batch."""
    if requested is not None:
        return requested
    if device.type == "cpu":
        return 0
    return max(0, min(MAX_DEFAULT_WORKERS, usable_cores() // local_world_size - 1))


def build_loader(dataset: Any, sampler: Any, batch_size: int, workers: int, device: torch.device,
                 seed: int) -> DataLoader:
    # A generator of its own: each new iterator draws its workers' base seed from it, not from the global
    # RNG, so where an iterator starts (a resume mid-epoch) does not shift the training randomness.
    extra: dict[str, Any] = {"generator": torch.Generator().manual_seed(seed)}
    if workers:
        # Workers live as long as the run (not re-forked every epoch) and keep two batches each ready.
        extra.update(persistent_workers=True, prefetch_factor=2)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=device.type == "cuda", **extra)


class ResumableSampler(Sampler):
    """A DistributedSampler that can start its next pass `skip_batches` batches in, without loading them:
    a run resumed mid-epoch sees exactly the batches an uninterrupted one would have."""

    def __init__(self, inner: DistributedSampler, batch_size: int) -> None:
        self.inner, self.batch_size, self.skip_batches = inner, batch_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = list(self.inner)[self.skip_batches * self.batch_size:]
        self.skip_batches = 0
        return iter(indices)

    def __len__(self) -> int:
        return len(self.inner)


class RankData:
    """This rank's batches, endlessly across epochs, and its position: the epoch and the micro-batches of it
    already trained on (what a checkpoint records and a resumed run continues from)."""

    def __init__(self, dataset: Any, env: DistEnv, device: torch.device, *, batch_size: int, seed: int,
                 workers: int) -> None:
        self.env = env
        # The sampler pads every rank to the same number of samples, so every rank runs the same number of
        # batches: no rank waits forever in an all-reduce the others never join.
        self.sampler = ResumableSampler(DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank,
                                                           shuffle=True, seed=seed, drop_last=False), batch_size)
        self.workers = workers
        self.loader = build_loader(dataset, self.sampler, batch_size, workers, device, seed=seed + env.rank)
        self.epoch = 0
        self.batches_in_epoch = 0

    @property
    def batches_per_epoch(self) -> int:
        return len(self.loader)

    def batches(self) -> Iterator[Any]:
        """set_epoch reshuffles (the same way on every rank) each epoch."""
        while True:
            self.sampler.set_epoch(self.epoch)
            self.sampler.skip_batches = self.batches_in_epoch  # mid-epoch after a resume, else 0
            for batch in self.loader:
                self.batches_in_epoch += 1
                yield batch
            self.epoch += 1
            self.batches_in_epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}

    def load_state_dict(self, state: dict[str, Any], saved_world_size: int | None) -> None:
        self.epoch, self.batches_in_epoch = state["epoch"], state["batches_in_epoch"]
        if saved_world_size and saved_world_size != self.env.world_size:
            # An elastic job resized: the epoch goes on from the share of its samples already seen (the shards
            # differ, so a few samples of this epoch may be seen twice or not at all).
            self.batches_in_epoch = self.batches_in_epoch * saved_world_size // self.env.world_size
