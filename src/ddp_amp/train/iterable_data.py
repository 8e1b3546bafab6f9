"""Iterable data sets (streams, Hugging Face's IterableDataset): a rank's share of the stream, the agreement on
its end (no rank waits in an all-reduce for a rank whose stream ran out), and the position a resumed run skips
to. Map-style data is train.data's RankData."""

from __future__ import annotations

import collections
import copy
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from ddp_amp.dist import DistEnv, SideGroup
from ddp_amp.train.data import WORKERS_START
from ddp_amp.train.microbatch import batch_length


class IterableShard(IterableDataset):
    """A rank's share of an iterable data set: of the stream's items 0, 1, 2, ... rank r takes r, r + W, ...,
    and among those DataLoader worker w of K takes every K-th (accelerate's IterableDatasetShard, unpadded).
    With `whole`, the data set already yields only this rank's share (Hugging Face's split_dataset_by_node,
    or Task.data_sharded) and every item is this rank's. `next_index` is the stream position of the next item
    to look at, so a resumed run can skip what was trained (a data set without a state of its own)."""

    def __init__(self, source: Any, rank: int, world_size: int, *, whole: bool) -> None:
        self.source, self.rank, self.world_size, self.whole = source, rank, world_size, whole
        self.next_index = 0
        self.skip_to = 0
        """Stream items below this index are passed over, not yielded (a resume without a data set state)."""

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        stride, offset = (1, 0) if self.whole else (self.world_size, self.rank)
        index = self.next_index
        for item in self.source:
            position, index = index, index + 1
            self.next_index = index
            if position < self.skip_to or position % stride != offset:
                continue
            if (position // stride) % workers == worker:
                yield item


def shards_itself(dataset: Any, declared: bool) -> bool:
    """Task.data_sharded, or a Hugging Face IterableDataset after split_dataset_by_node (its _distributed)."""
    return declared or getattr(dataset, "_distributed", None) is not None


class IterableRankData:
    """This rank's batches of an iterable data set, and the agreement that ends the run at one step on every
    rank when any rank's data runs out (pytorch#141069: uneven shards otherwise leave a rank waiting in an
    all-reduce the others never join).

    The ranks agree ahead, on a gloo group of their own, on the last step every rank can fill: each proposes
    the last step it holds the batches for, fetched up to `depth` steps beyond the step agreed so far, and the
    MIN all-reduce runs asynchronously while the steps already agreed train; it is read when the training
    reaches the agreed step (one all-reduce per `depth` steps, overlapped). A rank that is not out of data
    always proposes beyond it, so an agreed step that does not advance means some rank ran out: every rank
    stops there. Map-style data sets never use this."""

    PROPOSE_S = 0.25
    """Host time of steps a proposal looks ahead: `depth` is this rank's steps per PROPOSE_S, at most MAX_DEPTH."""
    MAX_DEPTH = 16

    def __init__(self, dataset: Any, env: DistEnv, device: torch.device, *, batch_size: int, workers: int,
                 grad_accum: int, collate_fn=None, sharded: bool = False, epochs: int | None = None) -> None:
        self.env, self.batch_size, self.workers, self.grad_accum = env, batch_size, workers, grad_accum
        self.source = dataset
        self.shard = IterableShard(dataset, env.rank, env.world_size, whole=shards_itself(dataset, sharded))
        # Its own state is only meaningful where the data set is iterated in this process.
        self.stateful = workers == 0 and callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None))
        self.loader = DataLoader(self.shard, batch_size=batch_size, num_workers=workers, collate_fn=collate_fn,
                                 pin_memory=device.type == "cuda",
                                 multiprocessing_context=WORKERS_START if workers else None)
        self.epochs = epochs or 1
        self.epoch = 0
        size = len(dataset) if hasattr(dataset, "__len__") else None
        share = None if size is None or self.shard.whole else math.ceil(size / env.world_size)
        self.batches_per_epoch = (math.ceil((size if self.shard.whole else share) / batch_size)
                                  if size is not None else None)
        self.side = SideGroup()  # a collective: every rank makes it at the same point
        self.buffer: collections.deque = collections.deque()
        """(the step's batches, the position before they were fetched), fetched ahead."""
        self.limit: int | None = None
        """The last step every rank can fill, as agreed; None before the first agreement."""
        self.proposal = torch.zeros(1)
        self.exhausted = False
        self._batches: Iterator[Any] | None = None
        self._timer: tuple[int, float] | None = None
        self.depth = 1
        self.agreement_s, self.agreements = 0.0, 0
        """Host time spent issuing and reading the end agreement (the cost a step sees), and how many."""
        self.items = 0
        """Items this rank has fetched for its steps (from the start of the run, resumes included)."""
        self.skipped_items = 0
        """On a resume without a data set state: the items all ranks had trained, passed over in the stream."""

    # --- fetching ---------------------------------------------------------------------------------------------
    def _position(self) -> dict[str, Any]:
        position: dict[str, Any] = {"next_index": self.shard.next_index, "epoch": self.epoch, "items": self.items}
        if self.stateful:
            position["dataset"] = copy.deepcopy(self.source.state_dict())
        return position

    def _next_batch(self) -> Any:
        while True:
            if self._batches is None:
                if self.epoch >= self.epochs:
                    raise StopIteration
                if callable(getattr(self.source, "set_epoch", None)):
                    self.source.set_epoch(self.epoch)
                self._batches = iter(self.loader)
            try:
                return next(self._batches)
            except StopIteration:
                self._batches = None
                self.epoch += 1
                self.shard.next_index = self.shard.skip_to = 0

    def _fill(self, steps: int) -> None:
        """Fetch until the buffer holds `steps` steps, or the data runs out."""
        while len(self.buffer) < steps and not self.exhausted:
            before = self._position()
            try:
                batches = [self._next_batch() for _ in range(self.grad_accum)]
            except StopIteration:
                self.exhausted = True  # a partial step is never run: its batches are dropped
                break
            self.items += sum(batch_length(batch) for batch in batches)
            self.buffer.append((batches, before))

    # --- the agreement ----------------------------------------------------------------------------------------
    def _propose(self, step: int) -> None:
        """Offer, asynchronously, the last step this rank can fill: up to `depth` beyond the agreed one."""
        agreed = self.limit if self.limit is not None else step
        self._fill(agreed - step + self.depth)
        started = time.perf_counter()
        self.proposal.fill_(float(step + len(self.buffer)))
        self.side.all_reduce_async(self.proposal, dist.ReduceOp.MIN)
        self.agreement_s += time.perf_counter() - started

    def _settle(self) -> None:
        started = time.perf_counter()
        self.side.wait()  # issued `depth` steps ago: done by now, this returns at once
        self.limit = int(self.proposal.item())
        self.agreement_s += time.perf_counter() - started
        self.agreements += 1

    def _adapt_depth(self, step: int) -> None:
        now = time.perf_counter()
        previous, self._timer = self._timer, (step, now)
        if previous is not None and step > previous[0]:
            step_s = (now - previous[1]) / (step - previous[0])
            self.depth = max(1, min(self.MAX_DEPTH, int(self.PROPOSE_S / step_s) if step_s > 0 else self.MAX_DEPTH))

    def can_run(self, step: int) -> bool:
        """Whether every rank holds the batches of step `step` (counted from 0). Called before every step on
        every rank; waits only where an agreement is due, which is the same step on every rank."""
        if self.limit is None:  # the first agreement is waited for at once: nothing to overlap it with yet
            self._propose(step)
            self._settle()
        elif step >= self.limit and self.side.in_flight:
            self._settle()
        if step >= self.limit:
            return False  # some rank had no batch for this step: every rank stops before it
        if not self.side.in_flight:
            self._adapt_depth(step)
            self._propose(step)
        return True

    def take(self) -> Iterator[Any]:
        """The batches of the step `can_run` agreed on."""
        batches, _ = self.buffer.popleft()
        return iter(batches)

    def close(self) -> None:
        """Wait for the proposal in flight, and tear its group down."""
        self.side.close()

    # --- checkpoints --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"iterable": True}

    def rank_state(self) -> dict[str, Any]:
        """Where this rank's data stands after the steps taken: before the first buffered step's batches. With
        DataLoader workers the stream position is in the workers, not known here: none is recorded."""
        if self.workers:
            return {"workers": self.workers}
        return self.buffer[0][1] if self.buffer else self._position()

    def load_rank_state(self, states: list | None, saved_world_size: int | None) -> None:
        """Continue where this rank's data stood at the checkpoint: the data set's own state where it keeps
        one, else the stream read again from its start with what was trained passed over."""
        from ddp_amp.errors import RankSetupError

        if saved_world_size not in (None, self.env.world_size) or not states or len(states) <= self.env.rank:
            raise RankSetupError(f"--resume: an iterable data set resumes on the world size that wrote the "
                                 f"checkpoint ({saved_world_size} ranks), not on {self.env.world_size}")
        state = states[self.env.rank]
        if state is None or "next_index" not in state:
            raise RankSetupError("--resume: the checkpoint's iterable data was read by DataLoader workers, whose "
                                 "position is not known; train an iterable with --num-workers 0 to resume it")
        self.epoch, self.items = state["epoch"], state["items"]
        if self.stateful and "dataset" in state:
            self.source.load_state_dict(state["dataset"])
            self.shard.next_index = state["next_index"]
        else:
            self.shard.skip_to = state["next_index"]
            self.skipped_items = sum(other["items"] for other in states)

    def load_state_dict(self, state: dict[str, Any], saved_world_size: int | None) -> None:
        pass  # the position is each rank's own: load_rank_state
