"""bench --max-batch: the largest per-rank batch that trains, found inside one launch.

Doubling from --batch-size until a size does not fit on some rank, then bisecting between the last that
fitted and the first that did not, to within 1/16 of it. Each trial is TRIAL_STEPS optimizer steps on one batch
of that many samples (the data set's first ones, cycled), run as one piece under the out-of-memory agreement of
--micro-batch auto (AmpStep.try_batch): every rank learns of a failure on any of them, and nobody waits.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import default_collate

TRIAL_STEPS = 3
LARGEST = 2**20
"""No trial beyond this many samples per rank (a batch of cycled samples could otherwise grow without end)."""


def batch_of(dataset: Any, size: int, collate_fn=None) -> Any:
    """`size` samples, the data set's first ones cycled: indexed at once where the data set is tensors."""
    # TensorDataset: no per-item collation of a batch of 10^5 samples
    if collate_fn is None and hasattr(dataset, "tensors"):
        index = torch.arange(size) % len(dataset)
        return tuple(tensor[index] for tensor in dataset.tensors)
    return (collate_fn or default_collate)([dataset[i % len(dataset)] for i in range(size)])


def search(trial: Callable[[int], float | None], start: int) -> tuple[int, float | None]:
    """(the largest size `trial` found to fit, 0 when not even 1 did; its rate): doubling from `start` until a
    size does not fit, then bisecting between the last that fitted and the first that did not, to within 1/16.
    `trial(size)` is the throughput at that size, or None when it did not fit."""
    fitted, failed, rate = 0, None, None
    size = start
    while size <= LARGEST:  # doubling
        found = trial(size)
        if found is None:
            failed = size
            break
        fitted, rate, size = size, found, size * 2
    if fitted == 0:  # not even --batch-size: down from it
        low, high = 0, failed
    else:
        low, high = fitted, failed
    while high is not None and high - low > max(1, low // 16):  # bisecting
        middle = (low + high) // 2
        found = trial(middle)
        if found is None:
            high = middle
        else:
            low, rate = middle, found
    return low, rate


def _timed_steps(run_step: Callable[[int], bool], size: int, device: torch.device, world_size: int) -> float | None:
    """TRIAL_STEPS steps of `run_step(number)` (False: did not fit); the global samples/s at `size` (the median
    of the steps after the first), or None."""
    times = []
    for number in range(TRIAL_STEPS):
        started = time.perf_counter()
        if not run_step(number):
            return None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return size * world_size / statistics.median(times[1:] or times)


def largest_batch(step, dataset: Any, device: torch.device, world_size: int, start: int,
                  collate_fn=None) -> dict[str, Any]:
    """{"max_batch": the largest per-rank batch that trained (0: not even 1 sample), "samples_per_s": the global
    throughput at it (the median of its trial's steps after the first), "trials": every size tried}."""
    trials: list[dict[str, Any]] = []

    def trial(size: int) -> float | None:
        batch = batch_of(dataset, size, collate_fn)
        rate = _timed_steps(lambda number: step.try_batch(batch, number), size, device, world_size)
        trials.append({"batch": size, "fits": False} if rate is None
                      else {"batch": size, "fits": True, "samples_per_s": rate})
        return rate

    low, rate = search(trial, start)
    return {"max_batch": low, "samples_per_s": rate, "trials": trials}


def one_trial(step, dataset: Any, device: torch.device, world_size: int, size: int,
              collate_fn=None) -> dict[str, Any]:
    """One size, in plain steps (no out-of-memory agreement: under --shard full a pass holds collectives, so a
    rank that fails inside one leaves the others waiting; this launch fails instead, and the launcher, which
    runs one launch per size, counts it as not fitting). The same report as largest_batch's, of one trial."""
    batch = batch_of(dataset, size, collate_fn)
    rate = _timed_steps(lambda number: step.train_batch(batch, number), size, device, world_size)
    return {"max_batch": size, "samples_per_s": rate, "trials": [{"batch": size, "fits": True,
                                                                    "samples_per_s": rate}]}
