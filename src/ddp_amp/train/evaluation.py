"""Validation while training (--eval-every, Task.val_dataset): exact across ranks, and the best step kept.

Every rank evaluates a disjoint share of the validation set: a map-style set's indices r, r + W, ... with no
padding (DistributedSampler pads it with duplicates so that it divides by the world size, pytorch#25162, which
skews every metric), an iterable's items split as the training's are. Each batch's means are weighted by its
sample count and summed on the device, each metric with its own count (a batch may leave a val_metric out);
one all-reduce of the sums and the counts per evaluation gives every rank the means over the whole set, each
sample counted once: the loss of one process over the whole set. Batches are as large as the training's pieces
(--micro-batch N, or the size auto settled on), not the whole --batch-size: a forward without gradients keeps
no activations, but a GPT's fp32 logits at the whole batch can need more memory than training at a micro-batch.

The plain module is evaluated, not the DDP wrapper: its forward would broadcast buffers, a collective that
ranks holding different numbers of batches would not all join. Eval mode, autocast, no gradients. A sharded
model (--shard full) is the exception: each forward all-gathers its weights, so every rank runs as many as the
rank with the most batches, the others on a batch of theirs again, counted zero times (`_lockstep`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset, default_collate

from ddp_amp.dist import DistEnv
from ddp_amp.errors import RankUsageError
from ddp_amp.precision import Precision, autocast
from ddp_amp.tasks import Task
from ddp_amp.tasks.batches import forward, output_loss
from ddp_amp.train.data import is_iterable, to_device
from ddp_amp.train.iterable_data import IterableShard, shards_itself
from ddp_amp.train.microbatch import MicroBatches, batch_length

COUNT = "#count"
"""The key of a metric's sample count beside its sum (a batch that leaves the metric out does not count)."""


def rank_share(dataset: Any, env: DistEnv, sharded: bool) -> Any:
    """This rank's disjoint share of the validation set, unpadded."""
    if is_iterable(dataset):
        return IterableShard(dataset, env.rank, env.world_size, whole=shards_itself(dataset, sharded))
    return Subset(dataset, range(env.rank, len(dataset), env.world_size))


class Validation:
    def __init__(self, task: Task, env: DistEnv, device: torch.device, precision: Precision, *, batch_size: int,
                 spec: str, lockstep: bool = False, micro: MicroBatches | None = None) -> None:
        self.task, self.env, self.device, self.precision, self.spec = task, env, device, precision, spec
        self.lockstep = lockstep
        """Every rank runs each forward together (a sharded model's forward is a collective)."""
        self.share = rank_share(task.val_dataset, env, task.data_sharded)
        self.batch_size, self.micro = batch_size, micro
        self.names: list[str] | None = None
        """val_loss and val_<metric>, in order: fixed by the first evaluation, the same on every rank."""
        self.seconds: list[float] = []

    @property
    def loader(self) -> DataLoader:
        """This rank's share in batches of the training's piece size now (auto's may have halved since)."""
        size = min(self.micro.size, self.batch_size) if self.micro is not None else self.batch_size
        return DataLoader(self.share, batch_size=size, collate_fn=self.task.collate_fn,
                          pin_memory=self.device.type == "cuda")

    def _sums(self, module: torch.nn.Module, stop_requested: Callable[[], int | None]) -> dict[str, torch.Tensor]:
        sums: dict[str, torch.Tensor] = {}
        for batch, counted in self._lockstep(stop_requested) if self.lockstep else ((b, True) for b in self.loader):
            if stop_requested() and not self.lockstep:  # this rank's share left unfinished, the evaluation dropped
                break
            if self.device.type != "cpu":
                batch = to_device(batch, self.device)
            n = batch_length(batch) if counted else 0
            with autocast(self.precision, self.device.type):
                output, target = forward(module, batch, self.task.pass_every_field)
                values = {"val_loss": output_loss(output, target, self.task.loss_fn, self.spec)}
                if self.task.val_metrics is not None:
                    values.update({f"val_{name}": value for name, value in
                                   self.task.val_metrics(output, target).items()})
            for name, value in values.items():  # a metric a batch leaves out is averaged over the others
                total = torch.as_tensor(value, device=self.device).detach().double() * n
                sums[name] = sums[name] + total if name in sums else total
                counted_key = f"{name}{COUNT}"
                sums[counted_key] = sums.get(counted_key, self._zero()) + n
        return sums

    def _zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float64, device=self.device)

    def _lockstep(self, stop_requested: Callable[[], int | None]) -> Iterator[tuple[Any, bool]]:
        """This rank's batches and whether each counts, as many as the most any rank has: the ranks agree
        before each forward (one all-reduce) whether any has a batch left, and whether any was asked to stop."""
        batches, spare = iter(self.loader), None
        while True:
            batch = next(batches, None)
            flags = torch.tensor([batch is not None, bool(stop_requested())], dtype=torch.int32, device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            more, stopped = flags.tolist()
            if not more or stopped:
                return
            if batch is None:  # this rank's share is done: a forward all the same, for the others' all-gathers
                yield (spare if spare is not None else self._any_batch()), False
            else:
                spare = batch
                yield batch, True

    def _any_batch(self) -> Any:
        """One batch of the validation set's first item, for a rank whose share is empty."""
        dataset = self.task.val_dataset
        first = next(iter(dataset)) if is_iterable(dataset) else dataset[0]
        return (self.task.collate_fn or default_collate)([first])

    @torch.no_grad()
    def run(self, module: torch.nn.Module, stop_requested: Callable[[], int | None] = lambda: None) -> \
            tuple[dict[str, float], int]:
        """The validation means over the whole set, the same on every rank (one all-reduce), and the stop
        signal any rank received meanwhile (0: none), after which the means are incomplete and not to be used:
        a rank stops evaluating at its next batch, and every rank learns of it at the end."""
        started = time.perf_counter()
        was_training = module.training
        module.eval()
        try:
            sums = self._sums(module, stop_requested)
        finally:
            module.train(was_training)
        stopped = torch.tensor([float(stop_requested() or 0)], device=self.device)
        dist.all_reduce(stopped, op=dist.ReduceOp.MAX)  # the default group, CPU or device alike: a flag
        if stopped.item():
            return {}, int(stopped.item())
        if self.names is None:  # a rank with no batch knows no names: every name any rank's batches gave
            gathered = [None] * self.env.world_size
            dist.all_gather_object(gathered, sorted(name for name in sums if not name.endswith(COUNT)))
            self.names = sorted(set().union(*gathered))
        keys = [*self.names, *(f"{name}{COUNT}" for name in self.names)]
        vector = torch.stack([sums.get(key, self._zero()) for key in keys])
        dist.all_reduce(vector)  # each metric's sum and sample count over every rank's share
        values = vector.tolist()  # host sync: once per evaluation
        totals, counts = values[:len(self.names)], values[len(self.names):]
        self.seconds.append(time.perf_counter() - started)
        return {name: (total / count if count else math.nan)
                for name, total, count in zip(self.names, totals, counts)}, 0

    def summary(self, train_s: float | None) -> dict[str, Any]:
        total = sum(self.seconds)
        return {"evaluations": len(self.seconds), "seconds_each": total / len(self.seconds) if self.seconds else None,
                "share_of_run": total / train_s if train_s else None}


class BestKeeper:
    """--keep-best METRIC[:min|max]: the best step so far by that metric."""

    def __init__(self, spec: str | None) -> None:
        self.metric, self.mode = parse_keep_best(spec) if spec else (None, "min")
        self.best: dict[str, Any] | None = None
        """{"step", "metric", "value"} of the best evaluation so far (restored on resume)."""
        self.error: str | None = None
        """Why no best was kept: the metric was not logged at the last step's evaluation."""
        self.checksum: dict[str, Any] | None = None
        """The checksum record of the model_best.pt written for `best` (train.best_weights), on its writers."""

    def offer(self, step: int, values: dict[str, float], *, last: bool = False) -> bool:
        """Whether the evaluation of `step` is the best so far. A metric the evaluation does not log fails the
        run at its first evaluation; at the last step (the first evaluation of a run without --eval-every) the
        trained weights are kept: the problem is recorded in `error` and no best is kept, instead."""
        if self.metric is None or self.error is not None:
            return False
        if self.metric not in values:
            problem = (f"--keep-best {self.metric}: the evaluation logs no such metric (it logs "
                       f"{', '.join(sorted(values))})")
            if last:
                self.error = problem
                return False
            raise RankUsageError(problem)
        value = values[self.metric]
        if math.isnan(value):
            return False
        if self.best is not None and not (value < self.best["value"] if self.mode == "min"
                                          else value > self.best["value"]):
            return False
        self.best, self.checksum = {"step": step, "metric": self.metric, "value": value}, None
        return True


def parse_keep_best(spec: str) -> tuple[str, str]:
    """"val_loss" or "val_acc:max" -> (metric, mode); without a mode, min for a loss, max for anything else."""
    metric, _, mode = spec.partition(":")
    return metric, mode or ("min" if "loss" in metric else "max")
