"""A map-style data set for a script's loop: each rank its own share of every epoch, shuffled the same way on
every rank by (seed, epoch), equal batch counts on every rank, and a position that a checkpoint keeps, so that a
resumed run starts with the very batch the interrupted one would have taken next, and no batch twice."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from ddp_amp.train.data import to_device


class RankSampler(Sampler[int]):
    """This rank's indices of one epoch: the epoch's permutation (or 0..N-1), cut to a whole number of batches on
    every rank (the remainder dropped, as DistributedSampler(drop_last=True) does), every world_size-th from
    `rank`, from batch `start` on."""

    def __init__(self, size: int, rank: int, world_size: int, batch_size: int, seed: int, shuffle: bool) -> None:
        self.size, self.rank, self.world_size, self.batch_size = size, rank, world_size, batch_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.start = 0, 0
        self.batches = size // (world_size * batch_size)
        """Batches per rank per epoch."""

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.size)
        mine = order[: self.batches * self.batch_size * self.world_size][self.rank::self.world_size]
        return iter(mine[self.start * self.batch_size:].tolist())

    def __len__(self) -> int:
        return (self.batches - self.start) * self.batch_size


class RankLoader:
    """Iterating gives one epoch of this rank's batches (the next epoch on the next iteration); `forever()` runs
    epoch after epoch. `state_dict()` is the position of the next batch; a loaded one is where the next iteration
    starts, once."""

    def __init__(self, dataset: Any, rank: int, world_size: int, batch_size: int, *, seed: int, shuffle: bool,
                 device: torch.device, **loader_options: Any) -> None:
        try:
            size = len(dataset)
        except TypeError:
            from ddp_amp.loop.settings import LoopError

            raise LoopError("loader(): the data set has no len(): give a map-style data set (an iterable one "
                            "shards and resumes as its own code says)") from None
        self.sampler = RankSampler(size, rank, world_size, batch_size, seed, shuffle)
        if self.sampler.batches < 1:
            from ddp_amp.loop.settings import LoopError

            raise LoopError(f"loader(): {size} items make no batch of {batch_size} on each of {world_size} ranks")
        self.dataset, self.batch_size, self.device, self.seed = dataset, batch_size, device, seed
        self.options = loader_options
        self.epoch = 0
        """The epoch the next batch belongs to."""
        self.taken = 0
        """Batches of that epoch taken so far."""

    def __len__(self) -> int:
        return self.sampler.batches

    def __iter__(self) -> Iterator[Any]:
        if self.taken >= self.sampler.batches:  # the previous epoch was used up
            self.epoch, self.taken = self.epoch + 1, 0
        self.sampler.epoch, self.sampler.start = self.epoch, self.taken
        # Its own generator: DataLoader draws its workers' base seed from it, not from the global RNG, so a resumed
        # run's random state (dropout) does not depend on where in an epoch it started.
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler,
                            generator=torch.Generator().manual_seed(self.seed + self.epoch), **self.options)
        for batch in loader:
            self.taken += 1
            yield batch if self.device.type == "cpu" else to_device(batch, self.device)

    def forever(self) -> Iterator[Any]:
        """Batches epoch after epoch, without end."""
        while True:
            yield from self

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "taken": self.taken}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.taken = int(state["epoch"]), int(state["taken"])
