"""The data side of training: a rank's shard of the data set, batches across epochs, and where a resumed run
picks the data up."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from ddp_amp.dist import DistEnv
from ddp_amp.process import usable_cores

WORKERS_START = "fork" if sys.platform == "linux" else None
"""How a rank's DataLoader workers start: forked from the rank, holding its data set as it is (a fresh process
could not import the class of a --task file, loaded from its path), as on Linux by default before Python 3.14."""
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


def is_iterable(dataset: Any) -> bool:
    """A torch IterableDataset (Hugging Face's datasets.IterableDataset is one), or anything iterable that
    cannot be indexed."""
    return isinstance(dataset, IterableDataset) or (hasattr(dataset, "__iter__") and not hasattr(dataset,
                                                                                                  "__getitem__"))


def loader_workers(requested: int | None, device: torch.device, local_world_size: int) -> int:
    """DataLoader workers per rank. CPU ranks already use every core for compute, so loading stays in the rank;
    a GPU rank gets a few workers out of its share of the cores, so the GPU does not wait for the next batch."""
    if requested is not None:
        return requested
    if device.type == "cpu":
        return 0
    return max(0, min(MAX_DEFAULT_WORKERS, usable_cores() // local_world_size - 1))


def build_loader(dataset: Any, batch_sampler: Any, workers: int, device: torch.device, seed: int,
                 collate_fn=None, **options: Any) -> DataLoader:
    # A generator of its own: each new iterator draws its workers' base seed from it, not from the global
    # RNG, so where an iterator starts (a resume mid-epoch) does not shift the training randomness.
    extra: dict[str, Any] = {"generator": torch.Generator().manual_seed(seed)}
    if workers:
        # Workers live as long as the run (not re-forked every epoch) and keep two batches each ready.
        extra.update(persistent_workers=True, prefetch_factor=2, multiprocessing_context=WORKERS_START)
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=workers, pin_memory=device.type == "cuda",
                      collate_fn=collate_fn, **{**extra, **options})


class EpochSampler(Sampler):
    """This rank's indices of one epoch, from a global sample cursor.

    The epoch's order is a permutation drawn from the seed and the epoch, padded to a multiple of the world
    size with its first samples and striped across the ranks (rank r takes positions r, r + W, ...): exactly
    DistributedSampler's. `cursor` positions of it were consumed already (by every rank together); the rest
    is striped across the ranks there are now. A resumed run continues exactly where it stopped, and a
    resized one (an elastic job, or --resume on another world size) trains on every remaining sample of the
    epoch once, whatever the world size was before: in the epoch a resize split, nothing is padded (the
    ranks' shares differ by one sample at most; RankBatches keeps their batch counts equal)."""

    def __init__(self, size: int, rank: int, world_size: int, seed: int, shuffle: bool = True) -> None:
        self.size, self.rank, self.world_size, self.seed, self.shuffle = size, rank, world_size, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self.resized_epoch: int | None = None
        """The epoch a world-size change split: its rest is striped without padding."""

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = list(range(self.size))
        rest = order[self.cursor:]
        padding = 0 if self.epoch == self.resized_epoch else -len(rest) % self.world_size
        rest += (order * math.ceil(padding / self.size))[:padding] if padding else []
        return iter(rest[self.rank::self.world_size])

    def __len__(self) -> int:
        """A whole epoch's share (what an epoch's length in batches is counted from)."""
        return math.ceil(self.size / self.world_size)

    def remaining(self) -> int:
        """This rank's samples left in the epoch, from the cursor."""
        rest = max(0, self.size - self.cursor)
        return math.ceil(rest / self.world_size) if rest else 0


class RankBatches(Sampler):
    """This rank's batches: `batch_size` indices at a time, as DataLoader's own batching makes them. In the
    epoch a resize split, a rank may hold one sample fewer than another and so end a batch short: it halves
    its last full batch, so every rank runs as many batches (no rank waits in an all-reduce the others never
    join) and no sample is repeated."""

    def __init__(self, sampler: EpochSampler, batch_size: int) -> None:
        self.sampler, self.batch_size = sampler, batch_size

    def __iter__(self) -> Iterator[list[int]]:
        indices, size = list(self.sampler), self.batch_size
        batches = [indices[start:start + size] for start in range(0, len(indices), size)]
        if self.sampler.epoch == self.sampler.resized_epoch:
            wanted = math.ceil(self.sampler.remaining() / size)  # the same on every rank
            if len(batches) < wanted:
                if batches and len(batches[-1]) > 1:
                    last = batches.pop()
                    batches += [last[:len(last) // 2], last[len(last) // 2:]]
                else:  # a batch of one sample cannot be halved: repeat this epoch's first sample
                    batches.append(indices[:1] or [0])
        return iter(batches)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)


class RankData:
    """This rank's batches, endlessly across epochs, and the position in the data: the epoch, and the global
    cursor into it (samples consumed by all ranks), which is what a checkpoint records and a resumed or
    resized run continues from. ddp-amp's own loop takes `batches()`; a script's loop (ddp_amp.loop's
    `loader`) iterates it an epoch at a time, or takes `forever()`.

    `on_device`: each batch moved to `device` as it is taken (a script's loop; ddp-amp's step moves its own)."""

    def __init__(self, dataset: Any, env: DistEnv, device: torch.device, *, batch_size: int, seed: int,
                 workers: int, collate_fn=None, shuffle: bool = True, on_device: bool = False,
                 **loader_options: Any) -> None:
        self.env, self.batch_size, self.device = env, batch_size, device
        # Every rank gets the same number of samples (the padding), so every rank runs the same number of
        # batches: no rank waits forever in an all-reduce the others never join.
        self.sampler = EpochSampler(len(dataset), env.rank, env.world_size, seed, shuffle)
        self.workers = workers
        self.on_device = on_device and device.type != "cpu"
        self.loader = build_loader(dataset, RankBatches(self.sampler, batch_size), workers, device,
                                   seed=seed + env.rank, collate_fn=collate_fn, **loader_options)
        self._endless: Iterator[Any] | None = None

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def batches_per_epoch(self) -> int:
        return len(self.loader)

    def batches(self) -> Iterator[Any]:
        """Each epoch in a new order (the same on every rank), from the cursor on."""
        while True:
            yield from self

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch, from the cursor; the next epoch's position once it is used up."""
        sampler = self.sampler
        if sampler.cursor and not sampler.remaining():  # an epoch used up by a loop that stopped at its last batch
            sampler.epoch, sampler.cursor = sampler.epoch + 1, 0
        for batch in self.loader:
            sampler.cursor += self.batch_size * self.env.world_size
            yield to_device(batch, self.device) if self.on_device else batch
        sampler.epoch += 1
        sampler.cursor = 0

    def __len__(self) -> int:
        return self.batches_per_epoch

    def forever(self) -> Iterator[Any]:
        """Batches epoch after epoch, without end (a script's loop)."""
        return self.batches()

    def next_batch(self) -> Any:
        """The next batch of one endless stream, the same stream at every call (ddp_amp.loop's accumulate)."""
        if self._endless is None:
            self._endless = self.batches()
        return next(self._endless)

    def rank_state(self) -> None:
        return None  # the global cursor in state_dict says it all

    def load_rank_state(self, states: list | None, saved_world_size: int | None) -> None:
        pass

    def can_run(self, step: int) -> bool:
        return True  # every rank runs as many batches (RankBatches)

    def close(self) -> None:
        pass

    def remaining_batches(self, epochs: int) -> int:
        """Batches left on this rank until the end of epoch `epochs` (from the current position)."""
        if self.epoch >= epochs:  # a position saved at the last epoch's end reads as the start of the next
            return 0
        this_epoch = math.ceil(self.sampler.remaining() / self.batch_size)
        return this_epoch + max(0, epochs - self.epoch - 1) * self.batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.sampler.epoch, "cursor": self.sampler.cursor,
                "resized_epoch": self.sampler.resized_epoch}

    def load_state_dict(self, state: dict[str, Any], saved_world_size: int | None) -> None:
        self.sampler.epoch = state["epoch"]
        self.sampler.resized_epoch = state.get("resized_epoch")
        if saved_world_size not in (None, self.env.world_size):
            self.sampler.resized_epoch = state["epoch"]
        if "cursor" in state:
            self.sampler.cursor = state["cursor"]
        elif "taken" in state:  # ddp_amp.loop's loader before it was this class: batches of the epoch taken
            self.sampler.cursor = state["taken"] * self.batch_size * (saved_world_size or self.env.world_size)
        else:  # a checkpoint of an earlier version: batches of its own world size
            self.sampler.cursor = state["batches_in_epoch"] * self.batch_size * (saved_world_size or
                                                                                 self.env.world_size)
        if self.sampler.cursor and not self.sampler.remaining():
            # Saved at an epoch's last batch (a checkpoint every epoch): the next batch is the next epoch's, and
            # `epoch` says so, as the uninterrupted run's does once its loop over the epoch ended. A script's
            # `for epoch in range(data.epoch, E)` would otherwise run the finished epoch's number again.
            self.sampler.epoch, self.sampler.cursor = self.sampler.epoch + 1, 0
